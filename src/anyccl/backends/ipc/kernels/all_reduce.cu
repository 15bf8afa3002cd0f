// The all_reduce kernels (low latency, one shot, two shots, the copy-engine path's local
// reduction) and reduce_scatter, for float32, float16 and bfloat16 with sum, min and max.

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
// Pushers: A) segment q of my input to rank q's slot r, tile by tile; B) reduce my segment's
// tiles as they arrive, the result to my output and to every peer's slot n + r. Takers: C)
// copy the segments the peers reduced from my slots n + q to my output, as they arrive.
template <typename T, int OP>
__device__ void all_reduce_two_shot(const Args& a) {
    const u64 epoch = enter(a);
    const int r = a.rank, n = a.nranks;
    const u64 E = Elem<T>::SIZE, N = Elem<T>::N;
    const u64 seg = ceil_div(ceil_div(a.count, n), N) * N;  // elements of each rank's segment
    const u64 tile = a.tile_bytes / E, tiles = ceil_div(seg, tile);
    const Role me = role(a);
    u64* my = a.sig[r];
    if (me.push) {
        for (int i = 1; i < n; ++i)
            if (!may_write(a, (r + i) % n, epoch)) return;
        // A: tile t of every peer's segment, peer by peer, then the next tile
        for (u64 t = me.index; t < tiles; t += me.count) {
            for (int i = 1; i < n; ++i) {
                const int q = (r + i) % n;
                const u64 e0 = q * seg + t * tile;
                const u64 e1 = umin(umin(e0 + tile, (q + 1) * seg), a.count);
                if (e0 < e1)
                    block_copy(slot(a, q, epoch, r) + t * tile * E, a.in + e0 * E,
                               (e1 - e0) * E, false);
            }
            __syncthreads();
            if (threadIdx.x == 0) {
                __threadfence_system();
                for (int i = 1; i < n; ++i) st_release(flag_a(a, a.sig[(r + i) % n], t, r), epoch);
            }
        }
        // B: reduce my segment's tiles; the result to my output and every peer's slot n + r
        for (u64 t = me.index; t < tiles; t += me.count) {
            const u64 e0 = r * seg + t * tile;
            const u64 e1 = umin(umin(e0 + tile, (r + 1) * seg), a.count);
            for (int i = 1; i < n; ++i)
                if (!block_wait(a, flag_a(a, my, t, (r + n - i) % n), epoch)) return;
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
    }
    if (me.take) {
        // C: the segments the other ranks reduced, tile by tile
        for (u64 t = me.index; t < tiles; t += me.count) {
            for (int i = 1; i < n; ++i) {
                const int q = (r + i) % n;
                const u64 e0 = q * seg + t * tile;
                const u64 e1 = umin(umin(e0 + tile, (q + 1) * seg), a.count);
                if (!block_wait(a, flag_b(a, my, t, q), epoch)) return;
                if (e0 < e1)
                    block_copy(a.out + e0 * E, slot(a, r, epoch, n + q) + t * tile * E,
                               (e1 - e0) * E, true);
            }
        }
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
    if (me.push && !push_tiles(a, me, epoch, r, a.ins, a.count * E)) return;
    if (me.take) {
        u64* my = a.sig[r];
        for (u64 t = me.index; t < tiles; t += me.count) {
            const u64 e0 = t * tile, e1 = umin(e0 + tile, a.count);
            for (int i = 0; i < n; ++i)   // i = 0: my pushes of the tile left (in place)
                if (!block_wait(a, flag_a(a, my, t, (r + n - i) % n), epoch)) return;
            const char* src[MAX_RANKS];
            for (int q = 0; q < n; ++q)
                src[q] = q == r ? a.ins[r] + e0 * E : slot(a, r, epoch, q) + e0 * E;
            char* dst[1] = {a.out + e0 * E};
            block_reduce<T, OP>(src, n, dst, 1, e1 - e0, a.scale);
        }
    }
    leave(a, epoch);
}

// ---- all_reduce by copy engines: the local step ---------------------------------------------
// The copy engines move the data (ce.py queues the copies; copy_engine_flags.cu's kernels raise
// and wait for the flags between them);
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

// ---- the typed entry points: <kind>_<dtype>_<op>, as compiler.py lists them ----------------
#define ENTRY(NAME, BODY)                                                                      \
    extern "C" __global__ void __launch_bounds__(THREADS) NAME(Args a) { BODY; }
#define TYPED(T, TN, OP, ON)                                                                   \
    ENTRY(all_reduce_low_latency_##TN##_##ON, (all_reduce_ll<T, OP>(a)))                       \
    ENTRY(all_reduce_one_shot_##TN##_##ON, (reduce_scatter<T, OP>(a)))                          \
    ENTRY(all_reduce_two_shot_##TN##_##ON, (all_reduce_two_shot<T, OP>(a)))                    \
    ENTRY(reduce_scatter_##TN##_##ON, (reduce_scatter<T, OP>(a)))                               \
    ENTRY(reduce_local_##TN##_##ON, (reduce_local<T, OP>(a)))
#define ALL_OPS(T, TN) TYPED(T, TN, OP_SUM, sum) TYPED(T, TN, OP_MIN, min) TYPED(T, TN, OP_MAX, max)
ALL_OPS(float, float32)
ALL_OPS(f16, float16)
ALL_OPS(bf16, bfloat16)
