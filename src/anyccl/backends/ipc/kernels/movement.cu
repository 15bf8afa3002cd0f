// Data movement without arithmetic, on bytes of any dtype: all_gather, broadcast, barrier.

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
