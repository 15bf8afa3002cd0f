// Data movement without arithmetic, on bytes of any dtype: all_gather, broadcast, barrier.

// ---- all_gather (bytes): my piece goes to every peer's slot r; piece q lands in outs[q] ------
extern "C" __global__ void __launch_bounds__(THREADS) all_gather(Args a) {
    const u64 epoch = enter(a);
    const int r = a.rank;
    const Role me = role(a);
    const char* srcs[MAX_RANKS];
    for (int q = 0; q < a.nranks; ++q) srcs[q] = a.in;
    if (me.push && !push_tiles(a, me, epoch, r, srcs, a.count)) return;
    if (me.take) {
        if (a.outs[r] != a.in) copy_tiles(a, me, a.outs[r], a.in, a.count);
        if (!take_tiles(a, me, epoch, -1, a.outs, a.count)) return;
    }
    leave(a, epoch);
}

// ---- broadcast (bytes): the root pushes to every peer's slot root --------------------------
extern "C" __global__ void __launch_bounds__(THREADS) broadcast(Args a) {
    const u64 epoch = enter(a);
    const int r = a.rank, root = a.root;
    const Role me = role(a);
    if (r == root) {
        const char* srcs[MAX_RANKS];
        for (int q = 0; q < a.nranks; ++q) srcs[q] = a.in;
        if (me.push && !push_tiles(a, me, epoch, root, srcs, a.count)) return;
        if (me.take && a.out != a.in) copy_tiles(a, me, a.out, a.in, a.count);
    } else {
        // nothing to push here: every block takes
        const Role all{(int)blockIdx.x, (int)gridDim.x, false, true};
        char* dsts[MAX_RANKS];
        dsts[root] = a.out;
        if (!take_tiles(a, all, epoch, root, dsts, a.count)) return;
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
