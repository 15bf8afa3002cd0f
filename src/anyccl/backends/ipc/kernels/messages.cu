// Point-to-point messages through a ring of slots per (sender, receiver); the tag and size
// travel with each chunk and a receive that expects others reports it.

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
