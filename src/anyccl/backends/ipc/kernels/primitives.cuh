// anyccl's ipc kernels: collectives and point-to-point between the GPUs of one node, driven by
// the GPUs themselves. Every rank maps every other rank's data buffer and signal area (CUDA IPC);
// a kernel writes (pushes) its data straight into the peers' buffers over NVLink or PCIe, then
// raises a flag in the peer's signal area; the peer's kernel spins on its own flag, and reads
// what arrived from its own memory. No CPU takes part once the kernels are queued.
//
// This file holds what every kernel is built from: the argument block, memory ordering, block
// waits and signals, copies, element types and reductions, epochs and tiles. The kernels are in
// all_reduce.cu, movement.cu, messages.cu and copy_engine_flags.cu. compiler.py compiles them
// as one source, after the layout constants that Python and the kernels share (MAX_RANKS,
// THREADS, MIN_TILE_BYTES, SIG_FLAGS, STATUS_*), which it defines from memory.py and backend.py.
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

typedef unsigned long long u64;
typedef unsigned int u32;
typedef unsigned short u16;


// signal area of each rank, in u64 words
#define SIG_EPOCH 0         // collectives this rank completed (owner only)
#define SIG_DONE 1          // blocks of the running collective that finished (owner only)
#define SIG_ENTER 8         // [MAX_RANKS] epoch each peer has entered (written by the peers)
#define SIG_BAR 16          // [MAX_RANKS] barrier arrivals (written by the peers)
#define SIG_SENT 24         // [MAX_RANKS] chunks sent to each peer (owner only)
#define SIG_RECVD 32        // [MAX_RANKS] chunks received from each peer (owner only)
#define SIG_SEND_DONE 40    // [MAX_RANKS] blocks of the running send to each peer that finished
#define SIG_RECV_DONE 48    // [MAX_RANKS] blocks of the running recv from each peer that finished
// SIG_FLAGS (from Python): flags A [max_tiles][MAX_RANKS], flags B [max_tiles][MAX_RANKS],
                            // ready [MAX_RANKS][slots], meta [MAX_RANKS][slots],
                            // consumed [MAX_RANKS][slots]

// status words (host-mapped memory), indices from Python: STATUS_ABORT (set by the host: every
// kernel returns), STATUS_ERROR (set by a kernel: 1 = a message's size or tag differs),
// STATUS_PEER, STATUS_EXPECTED, STATUS_GOT (what the failed receive saw)

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
