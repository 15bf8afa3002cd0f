// Data movement without arithmetic, on bytes of any dtype: all_gather, broadcast, barrier, and
// the copy-engine ring's copying takes.

// ---- all_gather (bytes): my piece goes to every peer's slot r; piece q lands in outs[q] ------
extern "C" __global__ void __launch_bounds__(THREADS) all_gather(Args a) {
    const u64 epoch = enter(a);
    const int r = a.rank;
    const Role me = role(a);
    const char* srcs[MAX_RANKS];
    for (int q = 0; q < a.nranks; ++q) srcs[q] = a.in;
    if (me.push && !may_write_all(a, r, epoch)) return;
    const bool copy = a.outs[r] != a.in;
    auto push = [&](u64 t) { push_tile(a, epoch, r, srcs, a.count, t); };
    auto take = [&](u64 t) {
        if (copy) copy_tile(a, a.outs[r], a.in, a.count, t);
        return take_tile(a, epoch, -1, a.outs, a.count, t);
    };
    if (!run_tiles(me, ceil_div(a.count, a.tile_bytes), push, take)) return;
    leave(a, epoch);
}

// ---- broadcast (bytes): the root pushes to every peer's slot root --------------------------
extern "C" __global__ void __launch_bounds__(THREADS) broadcast(Args a) {
    const u64 epoch = enter(a);
    const int r = a.rank, root = a.root;
    const u64 tiles = ceil_div(a.count, a.tile_bytes);
    const Role me = role(a);
    if (r == root) {
        const char* srcs[MAX_RANKS];
        for (int q = 0; q < a.nranks; ++q) srcs[q] = a.in;
        if (me.push && !may_write_all(a, root, epoch)) return;
        auto push = [&](u64 t) { push_tile(a, epoch, root, srcs, a.count, t); };
        auto take = [&](u64 t) {
            if (a.out != a.in) copy_tile(a, a.out, a.in, a.count, t);
            return true;
        };
        run_tiles(me, tiles, push, take);
    } else {
        // nothing to push here: every block takes
        const Role all{(int)blockIdx.x, (int)gridDim.x, false, true};
        char* dsts[MAX_RANKS];
        dsts[root] = a.out;
        auto take = [&](u64 t) { return take_tile(a, epoch, root, dsts, a.count, t); };
        if (!run_tiles(all, tiles, [](u64) {}, take)) return;
    }
    leave(a, epoch);
}

// ---- ce_copy (bytes): a copying step of the copy-engine ring (ce.py) takes the `count` bytes
// that arrived at ins[0] (this rank's ring area) to `out`, a tile per block in turn ----------
extern "C" __global__ void __launch_bounds__(THREADS) ce_copy(Args a) {
    const u64 tiles = ceil_div(a.count, (u64)a.tile_bytes);
    for (u64 t = blockIdx.x; t < tiles; t += gridDim.x) {
        const u64 b0 = t * a.tile_bytes, b1 = umin(b0 + a.tile_bytes, a.count);
        block_copy(a.out + b0, a.ins[0] + b0, b1 - b0, true);
    }
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
