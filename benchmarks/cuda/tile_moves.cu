// Hopper (sm_90a) tile moves for mknumba's communication roles: the TMA engine carries the bytes.
//
// A block that moves a tile with plain loads keeps only what its threads hold in registers in
// flight (288 threads x 8 words = 18 KB per source): over NVLink that is ~11 GB/s per block
// (benchmarks/NOTES.md), so a 64 KB tile costs ~6 us of round trips. Here one warp hands every
// row of the tile to the TMA engine at once (cp.async.bulk: up to 128 KB in flight per block), the
// block sums the rows in shared memory, and the warp hands the result rows back to the engine
// (bulk stores, to local memory or a peer's over NVLink). Slower than the plain loads per block
// (benchmarks/NOTES.md: a tile's loads, sum and stores run one after the other), so only the
// probe benchmarks/probe_tile_moves.py uses it, as the base for a double-buffered version.
//
//   dst_j[rows x row_bytes] <- src_0 (+ src_1)      for j < ndst (1 or 2), nsrc (1 or 2)
//
// Linked into the numba kernels with cuda.declare_device(..., link=[this file]); every thread of
// the block calls each entry point. Shared memory (the block's dynamic shared memory, which a
// communication block does not otherwise use): one 64 KB buffer per source and an mbarrier.
// Requirements, checked by the Python caller (bulk_moves.py): row_bytes a multiple of 16 and at
// most ROW_BYTES_MAX, rows at most ROWS_MAX, every address and stride a multiple of 16.
//
// Memory order. The caller acquired the sources' flags (thread 0, then a block barrier); each
// issuing lane then orders the async proxy's reads after that with fence.proxy.async.global.
// The loads complete on the mbarrier (its wait orders the shared-memory data for every thread).
// Sums are written to shared memory by generic stores: fence.proxy.async.shared::cta and a
// barrier before the bulk stores read them. The stores are waited for (wait_group 0: written,
// not just read) and fenced back to the generic proxy before the closing barrier, so the caller
// may publish a flag with its usual fence + release, and may start the next move on this buffer
// (with MK_BULK_WAIT 1 only read; mk_bulk_drain then does the rest before a flag).

// sm90.cuh (mknumba/roles/cuda/) is pasted before this file by bulk_moves.py.

#ifndef MK_BULK_WAIT
// 0: a move returns once its stores are written (the caller may publish a flag at once);
// 1: once they are read out of shared memory (call mk_bulk_drain before publishing a flag)
#define MK_BULK_WAIT 0
#endif

namespace {

constexpr int ROWS_MAX = 128;
constexpr int ROW_BYTES_MAX = 512;
constexpr unsigned BUF_BYTES = ROWS_MAX * ROW_BYTES_MAX;  // one source tile: 64 KB
// Layout from the 128-byte-aligned base: [source 0][source 1][mbarrier]
constexpr unsigned BAR_OFFSET = 2 * BUF_BYTES;

__device__ __forceinline__ unsigned base_of(unsigned long long smem_generic) {
    unsigned base = (unsigned)__cvta_generic_to_shared((void *)smem_generic);
    return (base + 127u) & ~127u;
}

__device__ __forceinline__ void bulk_load(unsigned dst, unsigned long long src, unsigned bytes,
                                          unsigned bar) {
    asm volatile("cp.async.bulk.shared::cluster.global.mbarrier::complete_tx::bytes"
                 " [%0], [%1], %2, [%3];" ::"r"(dst), "l"(src), "r"(bytes), "r"(bar)
                 : "memory");
}

__device__ __forceinline__ void bulk_store(unsigned long long dst, unsigned src, unsigned bytes) {
    asm volatile("cp.async.bulk.global.shared::cta.bulk_group [%0], [%1], %2;" ::"l"(dst),
                 "r"(src), "r"(bytes) : "memory");
}

__device__ __forceinline__ void st_shared_v4(unsigned addr, uint4 v) {
    asm volatile("st.shared.v4.u32 [%0], {%1, %2, %3, %4};" ::"r"(addr), "r"(v.x), "r"(v.y),
                 "r"(v.z), "r"(v.w) : "memory");
}

__device__ __forceinline__ unsigned add_bf16x2(unsigned a, unsigned b) {
    // The exact sum of each pair, rounded once (as roles/reduce.py's add_words).
    unsigned d;
    asm("add.rn.bf16x2 %0, %1, %2;" : "=r"(d) : "r"(a), "r"(b));
    return d;
}

}  // namespace

// Once per block before its first move: thread 0 sets up the mbarrier; then a block barrier.
extern "C" __device__ int mk_bulk_init(unsigned long long smem) {
    if (threadIdx.x == 0) {
        const unsigned bar = base_of(smem) + BAR_OFFSET;
        mbar_init(bar, 1);
        mbar_init_fence();
    }
    __syncthreads();
    return 0;
}

// One move (see the header). seq: moves this block already made (the mbarrier's phase follows).
// Strides are in bytes. Returns 0 in every thread after the closing barrier.
extern "C" __device__ int mk_bulk_move(unsigned long long smem, int seq,
                                       unsigned long long src0, unsigned long long src1,
                                       long long src_stride, int nsrc,
                                       unsigned long long dst0, long long dst0_stride,
                                       unsigned long long dst1, long long dst1_stride, int ndst,
                                       int rows, int row_bytes) {
    const unsigned base = base_of(smem), bar = base + BAR_OFFSET;
    const int tid = threadIdx.x, lane = tid % 32;
    const unsigned total = (unsigned)(rows * row_bytes);

    if (tid < 32) {  // ---- warp 0 hands every source row to the TMA engine
        if (lane == 0)
            mbar_expect_tx(bar, total * nsrc);
        __syncwarp();
        fence_proxy_async();
        for (int r = lane; r < rows; r += 32) {
            bulk_load(base + r * row_bytes, src0 + r * src_stride, row_bytes, bar);
            if (nsrc > 1)
                bulk_load(base + BUF_BYTES + r * row_bytes, src1 + r * src_stride, row_bytes, bar);
        }
    }
    mbar_wait(bar, seq & 1);  // the TMA engine completes or faults: no timeout

    if (nsrc > 1) {  // ---- sum in place into buffer 0, 16 bytes (8 bf16) per step
        for (unsigned off = 16u * tid; off < total; off += 16u * blockDim.x) {
            uint4 a = ld_shared_v4(base + off), b = ld_shared_v4(base + BUF_BYTES + off);
            a.x = add_bf16x2(a.x, b.x);
            a.y = add_bf16x2(a.y, b.y);
            a.z = add_bf16x2(a.z, b.z);
            a.w = add_bf16x2(a.w, b.w);
            st_shared_v4(base + off, a);
        }
        asm volatile("fence.proxy.async.shared::cta;" ::: "memory");
        __syncthreads();
    }

    if (tid < 32) {  // ---- warp 0 hands the result rows back to the engine
        for (int r = lane; r < rows; r += 32) {
            bulk_store(dst0 + r * dst0_stride, base + r * row_bytes, row_bytes);
            if (ndst > 1) bulk_store(dst1 + r * dst1_stride, base + r * row_bytes, row_bytes);
        }
        asm volatile("cp.async.bulk.commit_group;" ::: "memory");
        if (MK_BULK_WAIT) {
            asm volatile("cp.async.bulk.wait_group.read 0;" ::: "memory");
        } else {
            asm volatile("cp.async.bulk.wait_group 0;" ::: "memory");
            fence_proxy_async();
        }
    }
    __syncthreads();
    return 0;
}

// Every earlier move's stores written and ordered before the caller's next fence + flag.
extern "C" __device__ int mk_bulk_drain(unsigned long long smem) {
    if (threadIdx.x < 32) {
        asm volatile("cp.async.bulk.wait_group 0;" ::: "memory");
        fence_proxy_async();
    }
    __syncthreads();
    return 0;
}
