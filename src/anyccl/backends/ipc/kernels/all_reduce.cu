// The all_reduce kernels (low latency, one shot, two shots, the copy-engine path's local
// reduction) and reduce_scatter, for float32, float16 and bfloat16 with sum, min and max.

// ---- the low-latency protocol ('LL', as NCCL's): data and flag travel together --------------
// A line is 16 bytes, {data word, flag, data word, flag}, written with one 16-byte store: the
// reader polls the line until both flags carry this call's value, so no fence and no separate
// flag is needed, and a line holds 8 bytes of data. A line's flag is the epoch scrambled by an
// odd multiplier (a bijection on 32 bits, so the epoch two calls back, whose lines this half
// still holds, never matches) -- scrambled so that the bytes another kernel left in the half
// (a gather of small integers, say) do not pass for a flag. Lines are built from elements, so
// any element alignment works.
__device__ __forceinline__ u32 ll_flag(u64 epoch) { return (u32)epoch * 0x9E3779B1u; }

__device__ __forceinline__ void ll_store(char* line, u64 data, u32 flag) {
    asm volatile("st.volatile.global.v4.u32 [%0], {%1, %2, %3, %4};" ::"l"(line),
                 "r"((u32)data), "r"(flag), "r"((u32)(data >> 32)), "r"(flag) : "memory");
}
// Waits until the line at `line` carries `flag` and sets *data; false if the host aborted.
__device__ __forceinline__ bool ll_load(const Args& a, const char* line, u32 flag, u64* data) {
    u32 d0, f0, d1, f1;
    u32 spins = 0;
    while (true) {
        asm volatile("ld.volatile.global.v4.u32 {%0, %1, %2, %3}, [%4];"
                     : "=r"(d0), "=r"(f0), "=r"(d1), "=r"(f1) : "l"(line) : "memory");
        if (f0 == flag && f1 == flag) break;
        if ((++spins & 4095u) == 0 && a.status[STATUS_ABORT]) return false;
    }
    *data = (u64)d0 | ((u64)d1 << 32);
    return true;
}

// The 8 data bytes of line `p` of an array of `count` elements (zeros past its end).
template <typename T>
__device__ __forceinline__ u64 ll_pack(const char* in, u64 p, u64 count) {
    const u64 per = 8 / Elem<T>::SIZE, e0 = p * per;
    if (e0 + per <= count && (((u64)in) & 7ULL) == 0) return *(const u64*)(in + p * 8);
    u64 bits = 0;
    for (u64 k = 0; k < per && e0 + k < count; ++k) {
        const u64 e = Elem<T>::SIZE == 4 ? (u64) * (const u32*)(in + (e0 + k) * 4)
                                         : (u64) * (const u16*)(in + (e0 + k) * 2);
        bits |= e << (8 * Elem<T>::SIZE * k);
    }
    return bits;
}
// Stores the elements of line `p` (those below `count`) into `out`.
template <typename T>
__device__ __forceinline__ void ll_unpack(char* out, u64 p, u64 count, u64 bits) {
    const u64 per = 8 / Elem<T>::SIZE, e0 = p * per;
    if (e0 + per <= count && (((u64)out) & 7ULL) == 0) {
        *(u64*)(out + p * 8) = bits;
        return;
    }
    for (u64 k = 0; k < per && e0 + k < count; ++k) {
        if (Elem<T>::SIZE == 4) *(u32*)(out + (e0 + k) * 4) = (u32)(bits >> (32 * k));
        else *(u16*)(out + (e0 + k) * 2) = (u16)(bits >> (16 * k));
    }
}
// Element-wise combination of the lines got[0..n), in rank order (the same bits on every
// rank), times `scale`.
template <typename T, int OP>
__device__ __forceinline__ u64 ll_reduce(const u64* got, int n, float scale) {
    typedef Elem<T> E;
    const int per = 8 / E::SIZE, bits = 8 * E::SIZE;
    u64 out = 0;
#pragma unroll
    for (int k = 0; k < per; ++k) {
        float acc = E::of((u32)(got[0] >> (bits * k)));
        for (int q = 1; q < n; ++q) acc = combine<OP>(acc, E::of((u32)(got[q] >> (bits * k))));
        if (scale != 1.0f) acc *= scale;
        out |= (u64)E::bits(acc) << (bits * k);
    }
    return out;
}

// ---- all_reduce, small, one shot: every line to every peer, each rank reduces them all ------
template <typename T, int OP>
__device__ void all_reduce_ll(const Args& a) {
    const u64 epoch = enter(a);
    const int r = a.rank, n = a.nranks;
    const u32 flag = ll_flag(epoch);
    const u64 lines = ceil_div(a.count * Elem<T>::SIZE, 8);
    const u64 first = blockIdx.x * (u64)THREADS + threadIdx.x, stride = (u64)gridDim.x * THREADS;
    for (int i = 1; i < n; ++i)
        if (!may_write(a, (r + i) % n, epoch)) return;
    for (u64 p = first; p < lines; p += stride) {   // every push first: nothing waits here
        const u64 mine = ll_pack<T>(a.in, p, a.count);
        for (int i = 1; i < n; ++i) {
            const int q = (r + i) % n;
            ll_store(slot(a, q, epoch, r) + p * 16, mine, flag);
        }
    }
    for (u64 p = first; p < lines; p += stride) {
        u64 got[MAX_RANKS];
        for (int q = 0; q < n; ++q) {
            if (q == r) got[q] = ll_pack<T>(a.in, p, a.count);
            else if (!ll_load(a, slot(a, r, epoch, q) + p * 16, flag, &got[q])) return;
        }
        ll_unpack<T>(a.out, p, a.count, ll_reduce<T, OP>(got, n, a.scale));
    }
    leave(a, epoch);
}

// ---- all_reduce, mid sizes, two shots of lines: reduce-scatter, then all-gather --------------
// Segment q (its lines) goes to rank q's slot r; rank r reduces its segment as its lines
// arrive and sends the result to every peer's slot n + r; each rank takes the other segments
// from its slots n + q. Per rank 2 (n - 1) / n of the array crosses the links (as lines, twice
// its bytes), against n - 1 times the array in the one-shot lines; three phases, the pushes of
// each before its waits, so no thread waits on one that has not pushed.
template <typename T, int OP>
__device__ void all_reduce_ll_two_shot(const Args& a) {
    const u64 epoch = enter(a);
    const int r = a.rank, n = a.nranks;
    const u32 flag = ll_flag(epoch);
    const u64 lines = ceil_div(a.count * Elem<T>::SIZE, 8), seg = ceil_div(lines, n);
    const u64 first = blockIdx.x * (u64)THREADS + threadIdx.x, stride = (u64)gridDim.x * THREADS;
    for (int i = 1; i < n; ++i)
        if (!may_write(a, (r + i) % n, epoch)) return;
    for (u64 j = first; j < seg; j += stride) {     // 1: segment q's line j to rank q
        for (int i = 1; i < n; ++i) {
            const int q = (r + i) % n;
            if (q * seg + j < lines)
                ll_store(slot(a, q, epoch, r) + j * 16, ll_pack<T>(a.in, q * seg + j, a.count),
                         flag);
        }
    }
    for (u64 j = first; j < seg && r * seg + j < lines; j += stride) {   // 2: reduce mine
        const u64 p = r * seg + j;
        u64 got[MAX_RANKS];
        for (int q = 0; q < n; ++q) {
            if (q == r) got[q] = ll_pack<T>(a.in, p, a.count);
            else if (!ll_load(a, slot(a, r, epoch, q) + j * 16, flag, &got[q])) return;
        }
        const u64 sum = ll_reduce<T, OP>(got, n, a.scale);
        for (int i = 1; i < n; ++i)
            ll_store(slot(a, (r + i) % n, epoch, n + r) + j * 16, sum, flag);
        ll_unpack<T>(a.out, p, a.count, sum);
    }
    for (u64 j = first; j < seg; j += stride) {     // 3: the others' reduced segments
        for (int i = 1; i < n; ++i) {
            const int q = (r + n - i) % n;
            if (q * seg + j >= lines) continue;
            u64 sum;
            if (!ll_load(a, slot(a, r, epoch, n + q) + j * 16, flag, &sum)) return;
            ll_unpack<T>(a.out, q * seg + j, a.count, sum);
        }
    }
    leave(a, epoch);
}

// ---- all_reduce, two shots: reduce-scatter by pushes, then all-gather by pushes -------------
// Tile t of the segments, in three steps: A) segment q's tile of my input to rank q's slot r;
// B) once every peer's A arrived, reduce my segment's tile, the result to my output and to
// every peer's slot n + r; C) once every peer's B arrived, copy the other segments' tile from
// my slots n + q to my output. A block that both pushes and takes runs its tiles as a
// pipeline, A of its next tile before B of this one and B before C of the one before, so
// that it has pushes in flight while it waits; with takers, pushers run A and B, takers C.
struct TwoShot {
    const Args& a;
    u64 epoch, seg, tile, E;
    int r, n;
    __device__ u64 e0(int q, u64 t) const { return q * seg + t * tile; }
    __device__ u64 e1(int q, u64 t) const {
        return umin(umin(e0(q, t) + tile, (q + 1) * seg), a.count);
    }
};

template <typename T, int OP>
__device__ void two_shot_push(const TwoShot& s, u64 t) {
    const Args& a = s.a;
    for (int i = 1; i < s.n; ++i) {
        const int q = (s.r + i) % s.n;
        const u64 e0 = s.e0(q, t), e1 = s.e1(q, t);
        if (e0 < e1)
            block_copy(slot(a, q, s.epoch, s.r) + t * s.tile * s.E, a.in + e0 * s.E,
                       (e1 - e0) * s.E, false);
    }
    __syncthreads();
    if (threadIdx.x == 0) {
        fence_release();
        for (int i = 1; i < s.n; ++i)
            st_relaxed(flag_a(a, a.sig[(s.r + i) % s.n], t, s.r), s.epoch);
    }
}
template <typename T, int OP>
__device__ bool two_shot_reduce(const TwoShot& s, u64 t) {
    const Args& a = s.a;
    const int r = s.r, n = s.n;
    u64* my = a.sig[r];
    for (int i = 1; i < n; ++i)
        if (!block_wait(a, flag_a(a, my, t, (r + n - i) % n), s.epoch)) return false;
    const u64 e0 = s.e0(r, t), e1 = s.e1(r, t);
    if (e0 < e1) {
        const char* src[MAX_RANKS];
        char* dst[MAX_RANKS];
        int nd = 0;
        for (int q = 0; q < n; ++q) {
            src[q] = q == r ? a.in + e0 * s.E : slot(a, r, s.epoch, q) + t * s.tile * s.E;
            if (q != r) dst[nd++] = slot(a, q, s.epoch, n + r) + t * s.tile * s.E;
        }
        dst[nd++] = a.out + e0 * s.E;
        block_reduce<T, OP>(src, n, dst, nd, e1 - e0, a.scale);
    }
    __syncthreads();
    if (threadIdx.x == 0) {
        fence_release();
        for (int q = 0; q < n; ++q)
            if (q != r) st_relaxed(flag_b(a, a.sig[q], t, r), s.epoch);
    }
    return true;
}
__device__ bool two_shot_take(const TwoShot& s, u64 t) {
    const Args& a = s.a;
    for (int i = 1; i < s.n; ++i) {
        const int q = (s.r + i) % s.n;
        const u64 e0 = s.e0(q, t), e1 = s.e1(q, t);
        if (!block_wait(a, flag_b(a, a.sig[s.r], t, q), s.epoch)) return false;
        if (e0 < e1)
            block_copy(a.out + e0 * s.E, slot(a, s.r, s.epoch, s.n + q) + t * s.tile * s.E,
                       (e1 - e0) * s.E, true);
    }
    return true;
}

template <typename T, int OP>
__device__ void all_reduce_two_shot(const Args& a) {
    const u64 epoch = enter(a);
    const int r = a.rank, n = a.nranks;
    const u64 E = Elem<T>::SIZE, N = Elem<T>::N;
    const u64 seg = ceil_div(ceil_div(a.count, n), N) * N;  // elements of each rank's segment
    const TwoShot s{a, epoch, seg, a.tile_bytes / E, E, r, n};
    const u64 tiles = ceil_div(seg, s.tile);
    const Role me = role(a);
    if (me.push)
        for (int i = 1; i < n; ++i)
            if (!may_write(a, (r + i) % n, epoch)) return;
    // this block's k-th tile is me.index + k * me.count; step k runs A of its tile k, B of
    // k - 1 and C of k - 2 (a taker of a split: C of k)
    const u64 mine = me.index < tiles ? ceil_div(tiles - me.index, me.count) : 0;
    const u64 lag_c = me.push ? 2 : 0;
    for (u64 k = 0; k < mine + (me.take ? lag_c : 1); ++k) {
        if (me.push && k < mine) two_shot_push<T, OP>(s, me.index + k * me.count);
        if (me.push && k >= 1 && k - 1 < mine &&
            !two_shot_reduce<T, OP>(s, me.index + (k - 1) * me.count)) return;
        if (me.take && k >= lag_c && k - lag_c < mine &&
            !two_shot_take(s, me.index + (k - lag_c) * me.count)) return;
    }
    leave(a, epoch);
}

// ---- reduce_scatter: input piece ins[q] goes to rank q, which reduces what it got -----------
// (with every ins[q] the whole array, this is the one-shot all_reduce: each rank pushes its
// array to every peer and reduces all of it). Pushers push; takers reduce tiles as they arrive.
template <typename T, int OP>
__device__ void reduce_scatter(const Args& a) {
    const u64 epoch = enter(a);
    const int r = a.rank, n = a.nranks;
    const u64 E = Elem<T>::SIZE, tile = a.tile_bytes / E, tiles = ceil_div(a.count, tile);
    const Role me = role(a);
    if (me.push && !may_write_all(a, r, epoch)) return;
    u64* my = a.sig[r];
    auto push = [&](u64 t) { push_tile(a, epoch, r, a.ins, a.count * E, t); };
    auto take = [&](u64 t) {
        const u64 e0 = t * tile, e1 = umin(e0 + tile, a.count);
        for (int i = 0; i < n; ++i)   // i = 0: my pushes of the tile left (in place)
            if (!block_wait(a, flag_a(a, my, t, (r + n - i) % n), epoch)) return false;
        const char* src[MAX_RANKS];
        for (int q = 0; q < n; ++q)
            src[q] = q == r ? a.ins[r] + e0 * E : slot(a, r, epoch, q) + e0 * E;
        char* dst[1] = {a.out + e0 * E};
        block_reduce<T, OP>(src, n, dst, 1, e1 - e0, a.scale);
        return true;
    };
    if (!run_tiles(me, tiles, push, take)) return;
    leave(a, epoch);
}

// ---- collectives by copy engines: the reducing step of the ring -----------------------------
// The copy engines move the data (ce.py queues the copies; copy_engine_flags.cu's kernels raise
// and wait for the flags between them); this kernel only reduces, in local memory, a chunk
// that arrived in the ring area (`ins[0]`): out = in (+) it, times `scale`. (A copying step
// is movement.cu's ce_copy.)
template <typename T, int OP>
__device__ void ce_step(const Args& a) {
    const u64 E = Elem<T>::SIZE, tile = a.tile_bytes / E, tiles = ceil_div(a.count, tile);
    for (u64 t = blockIdx.x; t < tiles; t += gridDim.x) {
        const u64 e0 = t * tile, e1 = umin(e0 + tile, a.count);
        const char* src[2] = {a.in + e0 * E, a.ins[0] + e0 * E};
        char* dst[1] = {a.out + e0 * E};
        block_reduce<T, OP>(src, 2, dst, 1, e1 - e0, a.scale);
    }
}

// ---- the typed entry points: <kind>_<dtype>_<op>, as compiler.py lists them ----------------
#define ENTRY(NAME, BODY)                                                                      \
    extern "C" __global__ void __launch_bounds__(THREADS) NAME(Args a) { BODY; }
#define TYPED(T, TN, OP, ON)                                                                   \
    ENTRY(all_reduce_low_latency_##TN##_##ON, (all_reduce_ll<T, OP>(a)))                       \
    ENTRY(all_reduce_low_latency_two_shot_##TN##_##ON, (all_reduce_ll_two_shot<T, OP>(a)))     \
    ENTRY(all_reduce_one_shot_##TN##_##ON, (reduce_scatter<T, OP>(a)))                          \
    ENTRY(all_reduce_two_shot_##TN##_##ON, (all_reduce_two_shot<T, OP>(a)))                    \
    ENTRY(reduce_scatter_##TN##_##ON, (reduce_scatter<T, OP>(a)))                               \
    ENTRY(ce_step_##TN##_##ON, (ce_step<T, OP>(a)))
#define ALL_OPS(T, TN) TYPED(T, TN, OP_SUM, sum) TYPED(T, TN, OP_MIN, min) TYPED(T, TN, OP_MAX, max)
ALL_OPS(float, float32)
ALL_OPS(f16, float16)
ALL_OPS(bf16, bfloat16)
