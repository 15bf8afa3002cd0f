// The flags of the copy-engine all_reduce (ce.py): one-thread kernels that wait for them and
// raise them, so that no CPU and no stream memory operation stands between the copies.

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
// to the peers first). A null pointer is skipped. A kernel rather than cuStreamWriteValue32,
// which CUDA precedes with a system-wide memory fence that slows the copies in flight on the
// other streams.
extern "C" __global__ void ce_flags(Args a) {
    if (threadIdx.x != 0 || blockIdx.x != 0) return;
    for (int q = 0; q < a.nranks; ++q)
        if (a.ins[q]) *(volatile u32*)a.ins[q] = 0;
    __threadfence_system();
    for (int q = 0; q < a.nranks; ++q)
        if (a.outs[q]) asm volatile("st.release.sys.global.u32 [%0], %1;" ::"l"(a.outs[q]), "r"(1u)
                                    : "memory");
}
