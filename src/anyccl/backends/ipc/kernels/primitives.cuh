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
#define SIG_TICKET 2        // blocks of the running collective that took their role (owner only)
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
    int takers;                 // collectives: blocks that only take what arrived (see Role)
};

// ---- memory ordering -------------------------------------------------------------------------
__device__ __forceinline__ void st_release(u64* p, u64 v) {
    asm volatile("st.release.sys.global.u64 [%0], %1;" ::"l"(p), "l"(v) : "memory");
}
// A release fence at system scope, then relaxed flag stores: the block's writes before it
// (made this thread's by a __syncthreads) reach every GPU before any flag stored after it. One
// fence serves all the flags a thread raises next, which then leave back to back: a st_release
// per flag would make each flag wait for the one before it to cross the link.
__device__ __forceinline__ void fence_release() { asm volatile("fence.acq_rel.sys;" ::: "memory"); }
__device__ __forceinline__ void st_relaxed(u64* p, u64 v) {
    asm volatile("st.relaxed.sys.global.u64 [%0], %1;" ::"l"(p), "l"(v) : "memory");
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
        fence_release();
        st_relaxed(flag, value);
    }
}

// The last block to finish sets *target = value (and resets the block counter, and the role
// tickets when given).
__device__ void block_finish(u64* done, u64* target, u64 value, u64* tickets = nullptr) {
    __syncthreads();
    if (threadIdx.x == 0) {
        __threadfence();
        u64 prev = atomicAdd(done, 1ULL);
        if (prev == gridDim.x - 1) {
            *(volatile u64*)done = 0;
            if (tickets) *(volatile u64*)tickets = 0;
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
    __device__ static float of(u32 bits) { return __uint_as_float(bits); }  // the low SIZE bytes
    __device__ static u32 bits(float f) { return __float_as_uint(f); }
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
    __device__ static float of(u32 bits) { return TO((u16)(bits & 0xffffu)); }
    __device__ static u32 bits(float f) { return FROM(f); }
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
    block_finish(&my[SIG_DONE], &my[SIG_EPOCH], epoch, &my[SIG_TICKET]);
}

// ---- roles: pushers and takers ---------------------------------------------------------------
// A collective's blocks split into pushers (they write into the peers' slots) and a.takers
// takers (they read what arrived in this rank's own slots: copy it out, or reduce it), so that
// the local copies and reductions run while the links carry the next tiles instead of after
// them. Roles go by arrival (a ticket per block), so the pushers are the first blocks to run:
// a taker never spins on an SM that a pusher it waits for still needs. With a.takers == 0
// every block does both, its pushes first. `index` of `count`: this block's share of the
// tiles of its role.
struct Role {
    int index, count;
    bool push, take;
};
__device__ Role role(const Args& a) {
    if (a.takers <= 0 || a.takers >= (int)gridDim.x) return Role{(int)blockIdx.x, (int)gridDim.x,
                                                                 true, true};
    __shared__ int ticket;
    __syncthreads();
    if (threadIdx.x == 0) ticket = (int)atomicAdd(&a.sig[a.rank][SIG_TICKET], 1ULL);
    __syncthreads();
    const int pushers = (int)gridDim.x - a.takers;
    return ticket < pushers ? Role{ticket, pushers, true, false}
                            : Role{ticket - pushers, a.takers, false, true};
}

// ---- tiles pushed to the peers, copied locally, and taken from where peers pushed them -------
// Before pushing anything for `epoch` from rank `from`: every peer may be written to.
__device__ bool may_write_all(const Args& a, int from, u64 epoch) {
    for (int i = 1; i < a.nranks; ++i)
        if (!may_write(a, (from + i) % a.nranks, epoch)) return false;
    return true;
}
// Push tile t of `nbytes` of srcs[q] into every peer q's slot `from` for `epoch` and raise
// flag A of the tile at each. This rank's own flag A of the tile (from `from` to itself) says
// the tile has left, so a taker may overwrite it (an in-place reduction). srcs[q] is read for
// q != from only.
__device__ void push_tile(const Args& a, u64 epoch, int from, const char* const* srcs,
                          u64 nbytes, u64 t) {
    const int n = a.nranks;
    const u64 b0 = t * a.tile_bytes, b1 = umin(b0 + a.tile_bytes, nbytes);
    for (int i = 1; i < n; ++i) {
        const int q = (from + i) % n;
        block_copy(slot(a, q, epoch, from) + b0, srcs[q] + b0, b1 - b0, false);
    }
    __syncthreads();
    if (threadIdx.x == 0) {
        fence_release();
        for (int i = 0; i < n; ++i) {   // i = 0: this rank's own flag, that the tile left
            const int q = (from + i) % n;
            st_relaxed(flag_a(a, a.sig[q], t, from), epoch);
        }
    }
}
// Wait for tile t that each peer q pushed into this rank's slot q (only rank `only`, if it
// is not -1), the peer that pushed to this rank first, first, and copy it to dsts[q]; false
// if the host aborted.
__device__ bool take_tile(const Args& a, u64 epoch, int only, char* const* dsts, u64 nbytes,
                          u64 t) {
    const int r = a.rank, n = a.nranks;
    const u64 b0 = t * a.tile_bytes, b1 = umin(b0 + a.tile_bytes, nbytes);
    for (int i = 1; i < n; ++i) {
        const int q = (r + n - i) % n;
        if (only >= 0 && q != only) continue;
        if (!block_wait(a, flag_a(a, a.sig[r], t, q), epoch)) return false;
        block_copy(dsts[q] + b0, slot(a, r, epoch, q) + b0, b1 - b0, true);
    }
    return true;
}
// Tile t of `nbytes`, from `src` to `dst` (both local).
__device__ void copy_tile(const Args& a, char* dst, const char* src, u64 nbytes, u64 t) {
    const u64 b0 = t * a.tile_bytes, b1 = umin(b0 + a.tile_bytes, nbytes);
    block_copy(dst + b0, src + b0, b1 - b0, false);
}
// This block's share of `tiles` tiles (its role's: the k-th is me.index + k * me.count) as a
// pipeline: push(k) of its k-th tile, then take(k - 1) of the one before, so that pushes are
// in flight while it waits for what the peers pushed; a pusher of a split only pushes, a
// taker only takes. false if a take saw the host abort.
template <typename Push, typename Take>
__device__ bool run_tiles(const Role& me, u64 tiles, Push push, Take take) {
    const u64 mine = me.index < tiles ? ceil_div(tiles - (u64)me.index, me.count) : 0;
    const u64 lag = me.push ? 1 : 0;
    for (u64 k = 0; k < mine + (me.take ? lag : 0); ++k) {
        if (me.push && k < mine) push(me.index + k * me.count);
        if (me.take && k >= lag && k - lag < mine && !take(me.index + (k - lag) * me.count))
            return false;
    }
    return true;
}
