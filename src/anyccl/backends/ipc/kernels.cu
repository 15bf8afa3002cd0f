// anyccl's ipc kernels: collectives and point-to-point between the GPUs of one node, driven by
// the GPUs themselves. Every rank maps every other rank's data buffer and signal area (CUDA IPC);
// a kernel writes (pushes) its data straight into the peers' buffers over NVLink or PCIe, then
// raises a flag in the peer's signal area; the peer's kernel spins on its own flag, and reads
// what arrived from its own memory. No CPU takes part once the kernels are queued.
//
// Compiled at run time by NVRTC (backends/ipc/compiler.py) with no headers.
//
// Ordering rules (the reasons the protocol needs no reset between calls):
//   - Collectives count epochs on the GPU (SIG_EPOCH, bumped by the last block of each kernel),
//     so kernel arguments never change from call to call and a CUDA graph can replay them.
//   - Each data buffer has two halves; epoch e writes half e & 1. A rank writes into a peer's
//     half only after that peer entered epoch e - 1 (SIG_ENTER), so the peer has finished
//     reading what epoch e - 2 left in that half.
//   - Flags hold epochs (or message sequence numbers), which only grow: a waiter waits for
//     flag >= value, and a stale flag is always smaller.
//   - Point-to-point messages flow through a ring of slots per (sender, receiver): chunk seq
//     goes to slot (seq - 1) % slots once the receiver has consumed chunk seq - slots.
//   - While spinning, thread 0 looks at the host-mapped status word every few thousand polls:
//     the host sets status[0] to abort (timeout, dead peer), and every block returns.

typedef unsigned long long u64;
typedef unsigned int u32;
typedef unsigned short u16;

#define MAX_RANKS 8
#define THREADS 512
#define MIN_TILE_BYTES 65536ULL  // flags are sized for tiles this small

// signal area of each rank, in u64 words
#define SIG_EPOCH 0         // collectives this rank completed (owner only)
#define SIG_DONE 1          // blocks of the running collective that finished (owner only)
#define SIG_ENTER 8         // [MAX_RANKS] epoch each peer has entered (written by the peers)
#define SIG_BAR 16          // [MAX_RANKS] barrier arrivals (written by the peers)
#define SIG_SENT 24         // [MAX_RANKS] chunks sent to each peer (owner only)
#define SIG_RECVD 32        // [MAX_RANKS] chunks received from each peer (owner only)
#define SIG_SEND_DONE 40    // [MAX_RANKS] blocks of the running send to each peer that finished
#define SIG_RECV_DONE 48    // [MAX_RANKS] blocks of the running recv from each peer that finished
#define SIG_FLAGS 64        // flags A [max_tiles][MAX_RANKS], flags B [max_tiles][MAX_RANKS],
                            // ready [MAX_RANKS][slots], meta [MAX_RANKS][slots],
                            // consumed [MAX_RANKS][slots]

// status words (host-mapped memory)
#define STATUS_ABORT 0      // set by the host: every kernel returns
#define STATUS_ERROR 1      // set by a kernel: 1 = a message's size or tag differs
#define STATUS_PEER 2
#define STATUS_EXPECTED 3
#define STATUS_GOT 4

struct Args {
    char* data[MAX_RANKS];      // every rank's data buffer, mapped in this process
    u64* sig[MAX_RANKS];        // every rank's signal area, mapped in this process
    const char* ins[MAX_RANKS]; // reduce_scatter: the input piece for each rank
    char* outs[MAX_RANKS];      // all_gather: the output piece from each rank
    const char* in;
    char* out;
    u64 count;                  // elements (reductions) or bytes (copies, messages)
    u64 half_bytes;             // bytes of one half of a data buffer
    u64 slot_bytes;             // bytes of one slot; a half holds 2 * nranks slots
    u64 p2p_offset;             // where the message rings start in a data buffer
    u64 chunk_bytes;            // bytes of one message slot
    u64 tile_bytes;             // collectives: bytes a block moves between two flags
    u64 tag;                    // message tag
    volatile u64* status;       // host-mapped status words
    float scale;                // AVG: 1 / nranks; else 1
    int rank, nranks, root, peer;
    int max_tiles, slots;
};

// ---- memory ordering -------------------------------------------------------------------------
__device__ __forceinline__ void st_release(u64* p, u64 v) {
    asm volatile("st.release.sys.global.u64 [%0], %1;" ::"l"(p), "l"(v) : "memory");
}
__device__ __forceinline__ u64 ld_acquire(const u64* p) {
    u64 v;
    asm volatile("ld.acquire.sys.global.u64 %0, [%1];" : "=l"(v) : "l"(p) : "memory");
    return v;
}
__device__ __forceinline__ u64 ld_volatile(const u64* p) { return *(const volatile u64*)p; }

// Thread 0 spins until *flag >= value; the whole block returns false if the host aborted.
__device__ bool block_wait(const Args& a, const u64* flag, u64 value) {
    __shared__ int aborted;
    __syncthreads();  // every thread has read the previous wait's verdict before it changes
    if (threadIdx.x == 0) {
        int stop = 0;
        u32 spins = 0;
        while (ld_acquire(flag) < value) {
            if ((++spins & 4095u) == 0 && a.status[STATUS_ABORT]) {
                stop = 1;
                break;
            }
        }
        aborted = stop;
    }
    __syncthreads();
    return !aborted;
}

// After the block's writes: make them visible system-wide, then raise `flag` to `value`.
__device__ void block_signal(u64* flag, u64 value) {
    __syncthreads();
    if (threadIdx.x == 0) {
        __threadfence_system();
        st_release(flag, value);
    }
}

// The last block to finish sets *target = value (and resets the block counter).
__device__ void block_finish(u64* done, u64* target, u64 value) {
    __syncthreads();
    if (threadIdx.x == 0) {
        __threadfence();
        u64 prev = atomicAdd(done, 1ULL);
        if (prev == gridDim.x - 1) {
            *(volatile u64*)done = 0;
            __threadfence();
            *(volatile u64*)target = value;
        }
    }
}

// ---- copies ----------------------------------------------------------------------------------
// a 16-byte load through L2 only: L1 is not coherent with what other GPUs write here
__device__ __forceinline__ uint4 ldcg(const uint4* p) {
    uint4 v;
    asm volatile("ld.global.cg.v4.u32 {%0, %1, %2, %3}, [%4];"
                 : "=r"(v.x), "=r"(v.y), "=r"(v.z), "=r"(v.w) : "l"(p));
    return v;
}

__device__ __forceinline__ bool aligned16(const void* p) {
    return (((unsigned long long)p) & 15ULL) == 0;
}

// The block copies nbytes; `cg` reads through L2 only (data another GPU wrote here). 16-byte
// loads and stores where both ends are 16-byte aligned, else byte by byte.
__device__ void block_copy(char* dst, const char* src, u64 nbytes, bool cg) {
    const u64 packs = aligned16(dst) && aligned16(src) ? nbytes >> 4 : 0;
    const uint4* s = (const uint4*)src;
    uint4* d = (uint4*)dst;
    u64 i = threadIdx.x;
    if (cg) {
        for (; i + 3 * THREADS < packs; i += 4 * THREADS) {
            uint4 v0 = ldcg(s + i), v1 = ldcg(s + i + THREADS);
            uint4 v2 = ldcg(s + i + 2 * THREADS), v3 = ldcg(s + i + 3 * THREADS);
            d[i] = v0; d[i + THREADS] = v1; d[i + 2 * THREADS] = v2; d[i + 3 * THREADS] = v3;
        }
        for (; i < packs; i += THREADS) d[i] = ldcg(s + i);
    } else {
        for (; i + 3 * THREADS < packs; i += 4 * THREADS) {
            uint4 v0 = s[i], v1 = s[i + THREADS], v2 = s[i + 2 * THREADS], v3 = s[i + 3 * THREADS];
            d[i] = v0; d[i + THREADS] = v1; d[i + 2 * THREADS] = v2; d[i + 3 * THREADS] = v3;
        }
        for (; i < packs; i += THREADS) d[i] = s[i];
    }
    for (u64 b = (packs << 4) + threadIdx.x; b < nbytes; b += THREADS) dst[b] = src[b];
}

// ---- element types: loaded as float, stored back rounded to nearest ------------------------
struct f16 { u16 bits; };
struct bf16 { u16 bits; };

__device__ __forceinline__ float h2f(u16 h) {
    float f;
    asm("cvt.f32.f16 %0, %1;" : "=f"(f) : "h"(h));
    return f;
}
__device__ __forceinline__ u16 f2h(float f) {
    u16 h;
    asm("cvt.rn.f16.f32 %0, %1;" : "=h"(h) : "f"(f));
    return h;
}
__device__ __forceinline__ float b2f(u16 b) { return __uint_as_float(((u32)b) << 16); }
__device__ __forceinline__ u16 f2b(float f) {
    u16 b;
    asm("cvt.rn.bf16.f32 %0, %1;" : "=h"(b) : "f"(f));
    return b;
}

template <typename T> struct Elem;
template <> struct Elem<float> {
    static const int N = 4;  // per 16-byte pack
    static const int SIZE = 4;
    __device__ static void unpack(uint4 v, float* f) {
        f[0] = __uint_as_float(v.x); f[1] = __uint_as_float(v.y);
        f[2] = __uint_as_float(v.z); f[3] = __uint_as_float(v.w);
    }
    __device__ static uint4 pack(const float* f) {
        return make_uint4(__float_as_uint(f[0]), __float_as_uint(f[1]), __float_as_uint(f[2]),
                          __float_as_uint(f[3]));
    }
    __device__ static float get(const char* p) { return *(const float*)p; }
    __device__ static void put(char* p, float f) { *(float*)p = f; }
};
template <typename H, float (*TO)(u16), u16 (*FROM)(float)> struct Elem16 {
    static const int N = 8;
    static const int SIZE = 2;
    __device__ static void unpack(uint4 v, float* f) {
        u32 w[4] = {v.x, v.y, v.z, v.w};
#pragma unroll
        for (int k = 0; k < 4; ++k) {
            f[2 * k] = TO((u16)(w[k] & 0xffffu));
            f[2 * k + 1] = TO((u16)(w[k] >> 16));
        }
    }
    __device__ static uint4 pack(const float* f) {
        u32 w[4];
#pragma unroll
        for (int k = 0; k < 4; ++k) w[k] = (u32)FROM(f[2 * k]) | ((u32)FROM(f[2 * k + 1]) << 16);
        return make_uint4(w[0], w[1], w[2], w[3]);
    }
    __device__ static float get(const char* p) { return TO(*(const u16*)p); }
    __device__ static void put(char* p, float f) { *(u16*)p = FROM(f); }
};
template <> struct Elem<f16> : Elem16<f16, h2f, f2h> {};
template <> struct Elem<bf16> : Elem16<bf16, b2f, f2b> {};

#define OP_SUM 0
#define OP_MIN 1
#define OP_MAX 2
template <int OP> __device__ __forceinline__ float combine(float x, float y) {
    return OP == OP_SUM ? x + y : OP == OP_MIN ? fminf(x, y) : fmaxf(x, y);
}

// out[d][i] = scale * reduce_s src[s][i] for i < count, for every destination d.
template <typename T, int OP>
__device__ void block_reduce(const char* const* src, int nsrc, char* const* dst, int ndst,
                             u64 count, float scale) {
    typedef Elem<T> E;
    bool vector = true;  // 16-byte packs where every array is 16-byte aligned, else elements
    for (int k = 0; k < nsrc; ++k) vector = vector && aligned16(src[k]);
    for (int k = 0; k < ndst; ++k) vector = vector && aligned16(dst[k]);
    const u64 packs = vector ? count / E::N : 0;
    for (u64 i = threadIdx.x; i < packs; i += THREADS) {
        float acc[E::N], v[E::N];
        E::unpack(ldcg((const uint4*)src[0] + i), acc);
        for (int s = 1; s < nsrc; ++s) {
            E::unpack(ldcg((const uint4*)src[s] + i), v);
#pragma unroll
            for (int k = 0; k < E::N; ++k) acc[k] = combine<OP>(acc[k], v[k]);
        }
        if (scale != 1.0f) {
#pragma unroll
            for (int k = 0; k < E::N; ++k) acc[k] *= scale;
        }
        uint4 o = E::pack(acc);
        for (int d = 0; d < ndst; ++d) ((uint4*)dst[d])[i] = o;
    }
    for (u64 i = packs * E::N + threadIdx.x; i < count; i += THREADS) {
        float acc = E::get(src[0] + i * E::SIZE);
        for (int s = 1; s < nsrc; ++s) acc = combine<OP>(acc, E::get(src[s] + i * E::SIZE));
        if (scale != 1.0f) acc *= scale;
        for (int d = 0; d < ndst; ++d) E::put(dst[d] + i * E::SIZE, acc);
    }
}

// ---- collective bookkeeping -----------------------------------------------------------------
__device__ __forceinline__ u64* flag_a(const Args& a, u64* sig, u64 tile, int from) {
    return sig + SIG_FLAGS + tile * MAX_RANKS + from;
}
__device__ __forceinline__ u64* flag_b(const Args& a, u64* sig, u64 tile, int from) {
    return sig + SIG_FLAGS + ((u64)a.max_tiles + tile) * MAX_RANKS + from;
}
// slot s of rank `owner`'s half for `epoch`
__device__ __forceinline__ char* slot(const Args& a, int owner, u64 epoch, int s) {
    return a.data[owner] + (epoch & 1ULL) * a.half_bytes + (u64)s * a.slot_bytes;
}
__device__ __forceinline__ u64 ceil_div(u64 x, u64 y) { return (x + y - 1) / y; }
__device__ __forceinline__ u64 umin(u64 x, u64 y) { return x < y ? x : y; }

// The epoch this kernel runs; block 0 tells every peer that this rank entered it.
__device__ u64 enter(const Args& a) {
    u64 epoch = ld_volatile(&a.sig[a.rank][SIG_EPOCH]) + 1;
    if (blockIdx.x == 0 && threadIdx.x < a.nranks && threadIdx.x != a.rank)
        st_release(&a.sig[threadIdx.x][SIG_ENTER + a.rank], epoch);
    return epoch;
}
// Before writing into peer p's half for `epoch`: p has finished epoch - 2.
__device__ bool may_write(const Args& a, int p, u64 epoch) {
    return block_wait(a, &a.sig[a.rank][SIG_ENTER + p], epoch - 1);
}
__device__ void leave(const Args& a, u64 epoch) {
    u64* my = a.sig[a.rank];
    block_finish(&my[SIG_DONE], &my[SIG_EPOCH], epoch);
}

// ---- tiles pushed to a peer, copied locally, and taken from where peers pushed them ---------
// Push `nbytes` of `src` into rank q's slot `from` for `epoch`, raising flag A of each tile.
__device__ void push_tiles(const Args& a, int q, u64 epoch, int from, const char* src,
                           u64 nbytes) {
    const u64 tiles = ceil_div(nbytes, a.tile_bytes);
    for (u64 t = blockIdx.x; t < tiles; t += gridDim.x) {
        const u64 b0 = t * a.tile_bytes, b1 = umin(b0 + a.tile_bytes, nbytes);
        block_copy(slot(a, q, epoch, from) + b0, src + b0, b1 - b0, false);
        block_signal(flag_a(a, a.sig[q], t, from), epoch);
    }
}
// This block's tiles of `nbytes`, from `src` to `dst` (both local).
__device__ void copy_tiles(const Args& a, char* dst, const char* src, u64 nbytes) {
    const u64 tiles = ceil_div(nbytes, a.tile_bytes);
    for (u64 t = blockIdx.x; t < tiles; t += gridDim.x) {
        const u64 b0 = t * a.tile_bytes, b1 = umin(b0 + a.tile_bytes, nbytes);
        block_copy(dst + b0, src + b0, b1 - b0, false);
    }
}
// Wait for each tile rank `from` pushed into this rank's slot `from`, and copy it to `dst`;
// false if the host aborted.
__device__ bool take_tiles(const Args& a, u64 epoch, int from, char* dst, u64 nbytes) {
    const u64 tiles = ceil_div(nbytes, a.tile_bytes);
    for (u64 t = blockIdx.x; t < tiles; t += gridDim.x) {
        const u64 b0 = t * a.tile_bytes, b1 = umin(b0 + a.tile_bytes, nbytes);
        if (!block_wait(a, flag_a(a, a.sig[a.rank], t, from), epoch)) return false;
        block_copy(dst + b0, slot(a, a.rank, epoch, from) + b0, b1 - b0, true);
    }
    return true;
}

// ---- all_reduce, small: data and flag travel together ('LL', as NCCL's low-latency protocol) -
// Each 4-byte word of the input goes to every peer as one 8-byte store (word, epoch): the peer
// polls each word until it carries this epoch, so no fence and no separate flag is needed.
// Words are built from elements, so any element alignment works.
template <typename T>
__device__ __forceinline__ u32 load_word(const char* in, u64 w, u64 count) {
    const u64 per = 4 / Elem<T>::SIZE, e0 = w * per;
    u32 word = 0;
    for (u64 k = 0; k < per && e0 + k < count; ++k) {
        u32 bits = Elem<T>::SIZE == 4 ? *(const u32*)(in + (e0 + k) * 4)
                                      : (u32) * (const u16*)(in + (e0 + k) * 2);
        word |= bits << (32 / per * k);
    }
    return word;
}
template <typename T>
__device__ __forceinline__ float word_elem(u32 word, int k) {
    if (Elem<T>::SIZE == 4) return __uint_as_float(word);
    char bytes[4];
    *(u32*)bytes = word;
    return Elem<T>::get(bytes + 2 * k);
}

template <typename T, int OP>
__device__ void all_reduce_ll(const Args& a) {
    const u64 epoch = enter(a);
    const int r = a.rank, n = a.nranks;
    const u64 E = Elem<T>::SIZE, per = 4 / E, words = ceil_div(a.count * E, 4);
    const u64 stamp = (epoch & 0xffffffffULL) << 32;
    for (int i = 1; i < n; ++i)
        if (!may_write(a, (r + i) % n, epoch)) return;
    const u64 stride = (u64)gridDim.x * THREADS;
    for (u64 w = blockIdx.x * (u64)THREADS + threadIdx.x; w < words; w += stride) {
        const u32 mine = load_word<T>(a.in, w, a.count);
        for (int i = 1; i < n; ++i) {
            const int q = (r + i) % n;
            volatile u64* to = (volatile u64*)slot(a, q, epoch, r) + w;
            *to = stamp | mine;
        }
        u32 got[MAX_RANKS];
        bool ok = true;
        for (int q = 0; q < n; ++q) {
            if (q == r) { got[q] = mine; continue; }
            const volatile u64* from = (const volatile u64*)slot(a, r, epoch, q) + w;
            u64 v = *from;
            u32 spins = 0;
            while ((v & 0xffffffff00000000ULL) != stamp) {
                if ((++spins & 4095u) == 0 && a.status[STATUS_ABORT]) { ok = false; break; }
                v = *from;
            }
            got[q] = (u32)v;
        }
        if (!ok) break;
        for (u64 k = 0; k < per && w * per + k < a.count; ++k) {
            float acc = word_elem<T>(got[0], (int)k);
            for (int q = 1; q < n; ++q) acc = combine<OP>(acc, word_elem<T>(got[q], (int)k));
            if (a.scale != 1.0f) acc *= a.scale;
            Elem<T>::put(a.out + (w * per + k) * E, acc);
        }
    }
    leave(a, epoch);
}

// ---- all_reduce, two shots: reduce-scatter by pushes, then all-gather by pushes -------------
template <typename T, int OP>
__device__ void all_reduce_two_shot(const Args& a) {
    const u64 epoch = enter(a);
    const int r = a.rank, n = a.nranks;
    const u64 E = Elem<T>::SIZE, N = Elem<T>::N;
    const u64 seg = ceil_div(ceil_div(a.count, n), N) * N;  // elements of each rank's segment
    const u64 tile = a.tile_bytes / E, tiles = ceil_div(seg, tile);
    u64* my = a.sig[r];
    // A: my input's segment q goes to rank q's slot r
    for (int i = 1; i < n; ++i) {
        const int q = (r + i) % n;
        if (!may_write(a, q, epoch)) return;
        for (u64 t = blockIdx.x; t < tiles; t += gridDim.x) {
            const u64 e0 = q * seg + t * tile;
            const u64 e1 = umin(umin(e0 + tile, (q + 1) * seg), a.count);
            if (e0 < e1)
                block_copy(slot(a, q, epoch, r) + t * tile * E, a.in + e0 * E, (e1 - e0) * E,
                           false);
            block_signal(flag_a(a, a.sig[q], t, r), epoch);
        }
    }
    // B: reduce my segment; the result goes to my output and to every peer's slot n + r
    for (u64 t = blockIdx.x; t < tiles; t += gridDim.x) {
        const u64 e0 = r * seg + t * tile;
        const u64 e1 = umin(umin(e0 + tile, (r + 1) * seg), a.count);
        for (int q = 0; q < n; ++q)
            if (q != r && !block_wait(a, flag_a(a, my, t, q), epoch)) return;
        if (e0 < e1) {
            const char* src[MAX_RANKS];
            char* dst[MAX_RANKS];
            int nd = 0;
            for (int q = 0; q < n; ++q) {
                src[q] = q == r ? a.in + e0 * E : slot(a, r, epoch, q) + t * tile * E;
                if (q != r) dst[nd++] = slot(a, q, epoch, n + r) + t * tile * E;
            }
            dst[nd++] = a.out + e0 * E;
            block_reduce<T, OP>(src, n, dst, nd, e1 - e0, a.scale);
        }
        __syncthreads();
        if (threadIdx.x == 0) {
            __threadfence_system();
            for (int q = 0; q < n; ++q)
                if (q != r) st_release(flag_b(a, a.sig[q], t, r), epoch);
        }
    }
    // C: the segments the other ranks reduced
    for (int i = 1; i < n; ++i) {
        const int q = (r + i) % n;
        for (u64 t = blockIdx.x; t < tiles; t += gridDim.x) {
            const u64 e0 = q * seg + t * tile;
            const u64 e1 = umin(umin(e0 + tile, (q + 1) * seg), a.count);
            if (!block_wait(a, flag_b(a, my, t, q), epoch)) return;
            if (e0 < e1)
                block_copy(a.out + e0 * E, slot(a, r, epoch, n + q) + t * tile * E,
                           (e1 - e0) * E, true);
        }
    }
    leave(a, epoch);
}

// ---- reduce_scatter: input piece ins[q] goes to rank q, which reduces what it got -----------
// (with every ins[q] the whole array, this is the one-shot all_reduce: each rank pushes its
// array to every peer and reduces all of it)
template <typename T, int OP>
__device__ void reduce_scatter(const Args& a) {
    const u64 epoch = enter(a);
    const int r = a.rank, n = a.nranks;
    const u64 E = Elem<T>::SIZE, tile = a.tile_bytes / E, tiles = ceil_div(a.count, tile);
    for (int i = 1; i < n; ++i) {
        const int q = (r + i) % n;
        if (!may_write(a, q, epoch)) return;
        push_tiles(a, q, epoch, r, a.ins[q], a.count * E);  // tiles of tile elements each
    }
    u64* my = a.sig[r];
    for (u64 t = blockIdx.x; t < tiles; t += gridDim.x) {
        const u64 e0 = t * tile, e1 = umin(e0 + tile, a.count);
        for (int q = 0; q < n; ++q)
            if (q != r && !block_wait(a, flag_a(a, my, t, q), epoch)) return;
        const char* src[MAX_RANKS];
        for (int q = 0; q < n; ++q)
            src[q] = q == r ? a.ins[r] + e0 * E : slot(a, r, epoch, q) + e0 * E;
        char* dst[1] = {a.out + e0 * E};
        block_reduce<T, OP>(src, n, dst, 1, e1 - e0, a.scale);
    }
    leave(a, epoch);
}

// ---- all_reduce by copy engines: the local step ---------------------------------------------
// The copy engines move the data (ce.py queues them, with stream memory operations as flags);
// this kernel only reduces what arrived, in local memory: element i of ins[0..nranks)
// combined, written to every outs[0..nranks) (the output, and the slots the peers copy it back
// from). ins[q] may be outs[q]: each thread reads an element's sources before writing it.
template <typename T, int OP>
__device__ void reduce_local(const Args& a) {
    const u64 E = Elem<T>::SIZE, tile = a.tile_bytes / E, tiles = ceil_div(a.count, tile);
    for (u64 t = blockIdx.x; t < tiles; t += gridDim.x) {
        const u64 e0 = t * tile, e1 = umin(e0 + tile, a.count);
        const char* src[MAX_RANKS];
        char* dst[MAX_RANKS];
        for (int q = 0; q < a.nranks; ++q) {
            src[q] = a.ins[q] + e0 * E;
            dst[q] = a.outs[q] + e0 * E;
        }
        block_reduce<T, OP>(src, a.nranks, dst, a.nranks, e1 - e0, a.scale);
    }
}

// ---- copy-engine all_reduce flags (ce.py) ----------------------------------------------------
// One thread spins until every flag at ins[q] (32-bit, this rank's) is set; the stream's later
// work (a copy, the reduction) starts after it. Returns early if the host aborted (which also
// raises every copy-engine flag).
extern "C" __global__ void ce_wait(Args a) {
    if (threadIdx.x != 0 || blockIdx.x != 0) return;
    u32 spins = 0;
    for (int q = 0; q < a.nranks; ++q) {
        if (!a.ins[q]) continue;
        for (;;) {
            u32 v;
            asm volatile("ld.acquire.sys.global.u32 %0, [%1];" : "=r"(v) : "l"(a.ins[q]) : "memory");
            if (v) break;
            if ((++spins & 4095u) == 0 && a.status[STATUS_ABORT]) return;
        }
    }
}

// One thread clears the flags at ins[q] (this rank's own, 32-bit), then raises those at outs[q]
// (in peers' signal areas) to 1, after every write the stream made before it (the copies and the
// reduction queued ahead: the kernel boundary orders them; the system fence makes them visible
// to the peers first). A null pointer is skipped. A kernel instead of cuStreamWriteValue32,
// which CUDA precedes with a system-wide memory fence: with copies in flight on the other
// streams those writes measured slow (ce_allreduce.py --sync, one process, 256 MiB: 333 GB/s
// with stream-memop flags, 352 with kernel-raised ones).
extern "C" __global__ void ce_flags(Args a) {
    if (threadIdx.x != 0 || blockIdx.x != 0) return;
    for (int q = 0; q < a.nranks; ++q)
        if (a.ins[q]) *(volatile u32*)a.ins[q] = 0;
    __threadfence_system();
    for (int q = 0; q < a.nranks; ++q)
        if (a.outs[q]) asm volatile("st.release.sys.global.u32 [%0], %1;" ::"l"(a.outs[q]), "r"(1u)
                                    : "memory");
}

// ---- all_gather (bytes): my piece goes to every peer's slot r; piece q lands in outs[q] ------
extern "C" __global__ void __launch_bounds__(THREADS) all_gather(Args a) {
    const u64 epoch = enter(a);
    const int r = a.rank, n = a.nranks;
    for (int i = 1; i < n; ++i) {
        const int q = (r + i) % n;
        if (!may_write(a, q, epoch)) return;
        push_tiles(a, q, epoch, r, a.in, a.count);
    }
    if (a.outs[r] != a.in) copy_tiles(a, a.outs[r], a.in, a.count);
    for (int i = 1; i < n; ++i)
        if (!take_tiles(a, epoch, (r + i) % n, a.outs[(r + i) % n], a.count)) return;
    leave(a, epoch);
}

// ---- broadcast (bytes): the root pushes to every peer's slot root --------------------------
extern "C" __global__ void __launch_bounds__(THREADS) broadcast(Args a) {
    const u64 epoch = enter(a);
    const int r = a.rank, n = a.nranks, root = a.root;
    if (r == root) {
        for (int i = 1; i < n; ++i) {
            const int q = (r + i) % n;
            if (!may_write(a, q, epoch)) return;
            push_tiles(a, q, epoch, root, a.in, a.count);
        }
        if (a.out != a.in) copy_tiles(a, a.out, a.in, a.count);
    } else if (!take_tiles(a, epoch, root, a.out, a.count)) {
        return;
    }
    leave(a, epoch);
}

// ---- barrier: one block; every rank tells every peer, then waits for all -------------------
extern "C" __global__ void __launch_bounds__(THREADS) barrier(Args a) {
    const u64 epoch = enter(a);
    const int r = a.rank, n = a.nranks;
    if (threadIdx.x < n && threadIdx.x != r)
        st_release(&a.sig[threadIdx.x][SIG_BAR + r], epoch);
    for (int q = 0; q < n; ++q)
        if (q != r && !block_wait(a, &a.sig[r][SIG_BAR + q], epoch)) return;
    leave(a, epoch);
}

// ---- messages ----------------------------------------------------------------------------------
__device__ __forceinline__ u64* ready_flag(const Args& a, u64* sig, int from, u64 s) {
    return sig + SIG_FLAGS + 2ULL * a.max_tiles * MAX_RANKS + (u64)from * a.slots + s;
}
__device__ __forceinline__ u64* meta_word(const Args& a, u64* sig, int from, u64 s) {
    return ready_flag(a, sig, from, s) + (u64)MAX_RANKS * a.slots;
}
__device__ __forceinline__ u64* consumed_flag(const Args& a, u64* sig, int to, u64 s) {
    return ready_flag(a, sig, to, s) + 2ULL * MAX_RANKS * a.slots;
}
__device__ __forceinline__ u64 chunks_of(const Args& a) {
    return a.count ? ceil_div(a.count, a.chunk_bytes) : 1;  // an empty message still meets
}
__device__ __forceinline__ u64 meta_of(const Args& a) {  // what the receiver checks
    return (a.tag << 40) | (a.count & ((1ULL << 40) - 1));
}

// Send `count` bytes of `in` to rank `peer`, chunk by chunk through its ring of slots.
extern "C" __global__ void __launch_bounds__(THREADS) send(Args a) {
    const int to = a.peer, r = a.rank;
    u64* my = a.sig[r];
    const u64 base = ld_volatile(&my[SIG_SENT + to]), chunks = chunks_of(a), meta = meta_of(a);
    const u64 slots = (u64)a.slots;
    for (u64 i = blockIdx.x; i < chunks; i += gridDim.x) {
        const u64 seq = base + i + 1, s = (seq - 1) % slots;
        if (seq > slots && !block_wait(a, consumed_flag(a, my, to, s), seq - slots)) return;
        const u64 b0 = i * a.chunk_bytes, b1 = umin(b0 + a.chunk_bytes, a.count);
        char* ring = a.data[to] + a.p2p_offset + ((u64)r * slots + s) * a.chunk_bytes;
        if (b0 < b1) block_copy(ring, a.in + b0, b1 - b0, false);
        __syncthreads();
        if (threadIdx.x == 0) {
            __threadfence_system();
            *(volatile u64*)meta_word(a, a.sig[to], r, s) = meta;
            st_release(ready_flag(a, a.sig[to], r, s), seq);
        }
    }
    block_finish(&my[SIG_SEND_DONE + to], &my[SIG_SENT + to], base + chunks);
}

// Receive `count` bytes from rank `peer` into `out`; a message of another size or tag is an
// error reported through the status words (and this rank stops receiving).
extern "C" __global__ void __launch_bounds__(THREADS) recv(Args a) {
    const int from = a.peer, r = a.rank;
    u64* my = a.sig[r];
    const u64 base = ld_volatile(&my[SIG_RECVD + from]), chunks = chunks_of(a);
    const u64 slots = (u64)a.slots, expected = meta_of(a);
    for (u64 i = blockIdx.x; i < chunks; i += gridDim.x) {
        const u64 seq = base + i + 1, s = (seq - 1) % slots;
        if (!block_wait(a, ready_flag(a, my, from, s), seq)) return;
        const u64 got = ld_volatile(meta_word(a, my, from, s));
        if (got != expected) {
            if (threadIdx.x == 0) {
                a.status[STATUS_PEER] = (u64)from;
                a.status[STATUS_EXPECTED] = expected;
                a.status[STATUS_GOT] = got;
                __threadfence_system();
                a.status[STATUS_ERROR] = 1;
            }
            return;
        }
        const u64 b0 = i * a.chunk_bytes, b1 = umin(b0 + a.chunk_bytes, a.count);
        const char* ring = a.data[r] + a.p2p_offset + ((u64)from * slots + s) * a.chunk_bytes;
        if (b0 < b1) block_copy(a.out + b0, ring, b1 - b0, true);
        block_signal(consumed_flag(a, a.sig[from], r, s), seq);
    }
    block_finish(&my[SIG_RECV_DONE + from], &my[SIG_RECVD + from], base + chunks);
}

// ---- the typed entry points ------------------------------------------------------------------
#define TYPED(T, TN, OP, ON)                                                                     \
    extern "C" __global__ void __launch_bounds__(THREADS) all_reduce_0_##TN##_##ON(Args a) {     \
        all_reduce_ll<T, OP>(a);                                                                 \
    }                                                                                            \
    extern "C" __global__ void __launch_bounds__(THREADS) all_reduce_2_##TN##_##ON(Args a) {     \
        all_reduce_two_shot<T, OP>(a);                                                           \
    }                                                                                            \
    extern "C" __global__ void __launch_bounds__(THREADS) reduce_scatter_##TN##_##ON(Args a) {   \
        reduce_scatter<T, OP>(a);                                                                \
    }                                                                                            \
    extern "C" __global__ void __launch_bounds__(THREADS) reduce_local_##TN##_##ON(Args a) {     \
        reduce_local<T, OP>(a);                                                                  \
    }
#define ALL_OPS(T, TN) TYPED(T, TN, OP_SUM, sum) TYPED(T, TN, OP_MIN, min) TYPED(T, TN, OP_MAX, max)
ALL_OPS(float, float32)
ALL_OPS(f16, float16)
ALL_OPS(bf16, bfloat16)
