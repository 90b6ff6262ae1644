// Hopper (sm_90a) GEMM tile for mknumba's persistent kernels: C[tile] = A[tile rows, :] @ B[tile cols, :]^T
//
// Linked into numba kernels with cuda.declare_device(..., link=[this file]) and LTO, so both entry
// points inline into the caller. A block of 288 threads (320 with MK_PUBLISHER) runs them:
//   warps 0-7  two consumer warpgroups; warpgroup w owns rows [64w, 64w+64) of the 128 x 256 tile
//              and runs wgmma m64n256k16 with fp32 accumulators in registers (128 per thread);
//   warp 8     the producer: one lane issues the bulk tensor copies (TMA) that fill the ring.
// Operands (bf16, row-major, described by two CUtensorMaps in global memory):
//   A [M, K]  box 64 (K) x 128 (rows): K-major, 128-byte swizzled (wgmma's K-major layout);
//   B, by MK_B_KN:
//     0  [N, K]  box 64 (K) x 256 (rows of B): K-major like A;
//     1  [K, N]  (a row-major weight as it is) four boxes 64 (N) x 64 (K) side by side per
//        k-step, 8 KB apart: each box row is 64 N-columns of one k (128 B, 128B swizzle), which
//        wgmma reads as an MN-major ("transposed") B: smem_desc_mn with the box stride as its
//        leading offset, tnspB = 1 (see sm90.cuh). Boxes wholly past column n are not loaded
//        (their columns of the accumulator are never stored).
// The shared-memory ring has STAGES slots of (A 16 KB + B 32 KB), each guarded by two mbarriers:
//   full[s]  the producer's arrive.expect_tx + TMA complete_tx; consumers wait on it;
//   empty[s] one arrive per consumer warpgroup once its MMAs that read slot s have retired.
// The ring is never reset between tiles: the caller passes `seq`, the number of tiles this block
// has already run, and k-step g = seq * k_iters + kk uses slot g % STAGES with phase (g / STAGES) & 1.
// Hence the producer runs ahead into the next tile while the consumers finish this one's epilogue.
// A kernel that then runs tiles of another depth (mk.Gemm's tail split) starts the ring afresh
// between the two with mk_gemm_sm90_reinit, and seq from 0.
//
// A finished tile leaves the registers through 2 KB of staging per consumer warp (gemm_common.cuh
// store_warp_rows: stmatrix, then 16-byte loads and stores that cover whole 128-byte rows).
// benchmarks/probe_gemm_tile.py times it against other epilogues (benchmarks/cuda/);
// benchmarks/probe_gemm_stamps.py records its timeline through the MK_STAMP / MK_FULL_WAIT
// hooks (gemm_common.cuh; empty here) and times it with a shallower ring (MK_STAGES).
// MK_TMA_STORE 1 (mk.Gemm's opt-in "sm90:tms", whole tiles only) keeps the 4-stage ring and the
// per-warp 16-row chunks, but each chunk leaves by a TMA tensor store the consumers do not wait
// for: per consumer warp two 2 KB buffers (16 rows x 64 columns, 1024-byte aligned, so the
// swizzle of store_warp_rows' stmatrix is the tensor map's 128B swizzle), taken in turn by the
// warp's chunks (4 a tile, so across tiles too). For each: lane 0 waits until at most one of its
// stores still reads shared memory (cp.async.bulk.wait_group.read 1: the other buffer's),
// __syncwarp, stmatrix, fence.proxy.async.shared::cta, __syncwarp, lane 0 stores the box
// {64 columns, 16 rows} through C's tensor map (the third in tmaps; TMA drops rows past m and
// columns past n) and commits it as one bulk group. Chunks wholly past n or m are skipped, and
// then lane 0 waits for every read (wait_group.read 0) so the buffers still alternate. No
// consumer barrier and no flag per tile: the tile returns 0 everywhere, its stores may still
// be in flight. After the block's last tile mk_gemm_sm90_drain waits for them (wait_group 0 in
// each lane 0, a proxy fence, the consumers' barrier) and names the threads that then publish
// every tile flag of the block (compute.make_compute_role), so a flag still says its tile's
// data is in C; where nothing reads the flags during the kernel (mk.Gemm's, which records them)
// it waits only until the stores have read shared memory. Only the unsplit mk.Gemm runs it: a
// split-K fold (adds > 0) would read slices whose flags come only at their blocks' end, and the
// fused ops read flags during the kernel.
// MK_PUBLISHER 1 (the fused ops' build, compute.SM90_FUSED_TILE) adds a tenth warp (320 threads)
// that publishes tile flags: consumers arrive on an mbarrier after their stores and go on; the
// publisher waits on it and returns 1, so the fence before the flag (which waits for the tile's
// stores to drain) stalls only that warp. Without it (mk.Gemm's build) consumer thread 0
// publishes after a barrier of the consumers.

#include "gemm_common.cuh"

#ifndef MK_PUBLISHER
#define MK_PUBLISHER 0
#endif
#ifndef MK_B_KN
#define MK_B_KN 0
#endif
#ifndef MK_TMA_STORE
#define MK_TMA_STORE 0
#endif
#if MK_TMA_STORE && MK_PUBLISHER
#error "the tensor-store epilogue publishes no flag per tile: it has no publisher warp"
#endif
#ifndef MK_STAGES
#define MK_STAGES 4  // a probe's build may take fewer (the library's shared memory still fits)
#endif

namespace {

constexpr int BM = 128, BN = 256, BK = 64, STAGES = MK_STAGES;
constexpr int CONSUMER_WARPGROUPS = 2;
constexpr int CONSUMER_THREADS = 128 * CONSUMER_WARPGROUPS;
constexpr unsigned A_BYTES = BM * BK * 2, B_BYTES = BN * BK * 2, STAGE_BYTES = A_BYTES + B_BYTES;
#if MK_B_KN
constexpr unsigned B_BOX_BYTES = BK * 128;   // one box of B: 64 k-rows of 64 N-columns
#endif
// per consumer warp one chunk of staging, or two with MK_TMA_STORE (one filling while the other's
// store reads it)
constexpr unsigned STAGING_BYTES = CONSUMER_THREADS / 32 * (1 + MK_TMA_STORE) * WARP_STAGING;
// Layout from the 1024-byte-aligned base (128B swizzle repeats every 1024 B):
//   [A slot 0..3][B slot 0..3][epilogue staging][full 0..3][empty 0..3][staged][published]
constexpr unsigned B_OFFSET = STAGES * A_BYTES;
constexpr unsigned STAGING_OFFSET = STAGES * STAGE_BYTES;
constexpr unsigned BAR_OFFSET = STAGING_OFFSET + STAGING_BYTES;
static_assert(STAGING_OFFSET % 1024 == 0 && WARP_STAGING % 1024 == 0,
              "staging buffers on 1024-byte boundaries (the 128B swizzle's period)");

struct Ring {
    unsigned a, b, staging, full, empty, staged, published;  // shared-space addresses
};

__device__ __forceinline__ Ring ring_at(unsigned long long smem_generic) {
    const unsigned base = ring_base(smem_generic);
    return Ring{base, base + B_OFFSET, base + STAGING_OFFSET, base + BAR_OFFSET,
                base + BAR_OFFSET + 8 * STAGES, base + BAR_OFFSET + 16 * STAGES,
                base + BAR_OFFSET + 16 * STAGES + 8};
}

__device__ __forceinline__ void consumer_barrier() {
    // Named barrier 1 over the two consumer warpgroups (barrier 0 is __syncthreads).
    asm volatile("bar.sync 1, %0;" ::"n"(CONSUMER_THREADS) : "memory");
}

}  // namespace

// Once per block, before the first tile; thread 0 initialises the barriers, the caller then
// runs __syncthreads(). tmaps: address of the 128-byte CUtensorMaps: A, then B (with
// MK_TMA_STORE then C: the caller's c from row c_row0 on, boxes of 64 columns x 16 rows).
namespace {
// Thread 0's part of mk_gemm_sm90_init (and of mk_gemm_sm90_reinit, after the invalidation).
__device__ __forceinline__ void init_barriers(const Ring &r, unsigned long long tmaps) {
    init_ring<STAGES>(r.full, r.empty, CONSUMER_WARPGROUPS, tmaps);
    if (MK_TMA_STORE) prefetch_tensormap(tmaps + 256);
    if (MK_PUBLISHER) {
        mbar_init(r.staged, CONSUMER_THREADS / 32);  // each consumer warp's stores of a tile
        mbar_init(r.published, 1);              // the publisher: that tile's flag is out
    }
    mbar_init_fence();
}
}  // namespace

extern "C" __device__ int mk_gemm_sm90_init(unsigned long long smem, unsigned long long tmaps) {
    MK_STAMP(block_start, 0, 0);
    if (threadIdx.x == 0) init_barriers(ring_at(smem), tmaps);
    return 0;
}

// Between two runs of tiles in one block whose ring phases do not continue each other (mk.Gemm's
// tail split: whole tiles of K / 64 k-steps, then K slices of fewer, seq from 0 again): thread 0
// invalidates every barrier (PTX: an mbarrier is invalidated before its location is initialised
// again) and initialises them as mk_gemm_sm90_init does. The caller runs __syncthreads() before
// (every thread done with the earlier tiles: the consumers waited on each full barrier, so no
// copy is in flight, and no thread waits on a barrier any more) and after.
extern "C" __device__ int mk_gemm_sm90_reinit(unsigned long long smem, unsigned long long tmaps) {
    if (threadIdx.x == 0) {
        const Ring r = ring_at(smem);
        for (int s = 0; s < STAGES; ++s) {
            mbar_inval(r.full + 8 * s);
            mbar_inval(r.empty + 8 * s);
        }
        if (MK_PUBLISHER) {
            mbar_inval(r.staged);
            mbar_inval(r.published);
        }
        init_barriers(r, tmaps);
    }
    return 0;
}

// One 128 x 256 output tile; every thread of the block calls it for every tile.
//   c, ldc: bf16 output (row-major, ldc elements per row) holding global rows from c_row0 on;
//   m, n bound the stores. adds > 0: add planes 1..adds of ``addend`` ([P, m, n] bf16, plane
//   stride m * n) at the same element before storing (add_planes). (A split-K fold, which has
//   no K of its own, is not a tile: mk_gemm_sm90_fold.)
//   tile_m, tile_n: tile coordinates; k_iters = ceil(K / 64); seq: tiles this block already ran.
// Returns 1 in exactly one thread (consumer thread 0, or the publisher's lane 0) once all of this
// tile's stores are issued by every consumer thread: that thread publishes the tile's completion
// flag. Other threads return 0; the producer warp returns as soon as it has queued the loads.
// MK_TMA_STORE: 0 in every thread (the flags go out after mk_gemm_sm90_drain).
extern "C" __device__ int mk_gemm_sm90_tile(unsigned long long smem, unsigned long long tmaps,
                                            unsigned long long c, int ldc, int c_row0,
                                            unsigned long long addend, int adds, int m, int n,
                                            int tile_m, int tile_n, int k_iters, int seq) {
    const Ring r = ring_at(smem);
    const int tid = threadIdx.x;
    const unsigned g0 = (unsigned)seq * (unsigned)k_iters;
    MK_STAMP(enter, seq, 0);

#if MK_PUBLISHER
    if (tid >= CONSUMER_THREADS + 32) {  // ---- publisher warp
        // Tile seq - 1's flag went out after the previous call returned; then wait until every
        // consumer has stored tile seq (mbarrier: release/acquire at CTA scope, so the caller's
        // fence and release at GPU or system scope cover those stores).
        if (tid == CONSUMER_THREADS + 32 && seq > 0) mbar_arrive(r.published);
        mbar_wait(r.staged, seq & 1);
        return tid == CONSUMER_THREADS + 32;
    }
#endif
    if (tid >= CONSUMER_THREADS) {  // ---- producer warp: one lane drives the copy engine
        if (tid == CONSUMER_THREADS) {
            MK_STAMP(produce, seq, 0);
            produce_tile<BM, BN, STAGES, MK_B_KN>(r.a, r.b, r.full, r.empty, tmaps, n, tile_m,
                                                  tile_n, k_iters, g0);
            MK_STAMP(produced, seq, 0);
        }
        return 0;
    }

    __nv_bfloat16 *out = (__nv_bfloat16 *)c - (long long)c_row0 * ldc;  // indexed by global row
    const long long plane_elems = (long long)m * n;
    // ---- consumers: warpgroup wg multiplies its 64 rows of A against all 256 columns of B
    const int wg = tid / 128;
    float d[128];
#pragma unroll
    for (int i = 0; i < 128; ++i) d[i] = 0.f;
    fence_operands(d);

    for (int kk = 0; kk < k_iters; ++kk) {
        const unsigned g = g0 + kk, s = g % STAGES, phase = (g / STAGES) & 1;
        MK_FULL_WAIT(r.full + 8 * s, phase, seq, kk);
        const unsigned a = r.a + s * A_BYTES + wg * 64 * 128, b = r.b + s * B_BYTES;
        wgmma_fence();
        // k16: 16 bf16 = 32 bytes along A's swizzled rows; with MK_B_KN 16 rows (2 KB) down
        // every box of B
#pragma unroll
        for (int k16 = 0; k16 < BK / 16; ++k16)
#if MK_B_KN
            wgmma_m64n256k16<1>(d, smem_desc(a + 32 * k16),
                                smem_desc_mn(b + 16 * 128 * k16, B_BOX_BYTES));
#else
            wgmma_m64n256k16(d, smem_desc(a + 32 * k16), smem_desc(b + 32 * k16));
#endif
        wgmma_commit();
        // Keep one k-step of MMAs in flight; the previous step's slot can be refilled now.
        wgmma_wait<1>();
        fence_operands(d);
        if (kk > 0 && tid % 128 == 0) mbar_arrive(r.empty + 8 * ((g - 1) % STAGES));
    }
    wgmma_wait<0>();
    fence_operands(d);
    MK_STAMP(main_done, seq, 0);
    if (k_iters > 0 && tid % 128 == 0) mbar_arrive(r.empty + 8 * ((g0 + k_iters - 1) % STAGES));

    // ---- epilogue: fp32 -> bf16. Thread layout of m64nNk16: warp w of the warpgroup holds
    // rows 16w + lane/4 (+8), and d[4j..4j+3] are columns 8j + 2*(lane%4) (+1) of those two
    // rows.
    const int lane = tid % 32, warp = (tid % 128) / 32;
#if MK_TMA_STORE
    // the warp's 16 rows, 64 columns at a time through its two buffers and tensor stores
    // (the header); adds is 0 (whole tiles only)
    const unsigned stage = r.staging + (tid / 32) * 2 * WARP_STAGING;
    const int row0 = tile_m * BM + wg * 64 + warp * 16, col0 = tile_n * BN;
    const int chunks = row0 < m ? min(BN / 64, (n - col0 + 63) / 64) : 0;
#pragma unroll
    for (int cc = 0; cc < BN / 64; ++cc) {
        if (cc < chunks) {
            const unsigned buf = stage + (cc % 2) * WARP_STAGING;
            if (lane == 0) bulk_wait_read<1>();  // this buffer's last store has read it
            __syncwarp();
            stmatrix_chunk(d, cc, buf, lane / 8, lane % 8);
            fence_proxy_async_shared();  // this lane's stmatrix before the store's reads
            __syncwarp();
            if (lane == 0) {
                tma_store_2d(tmaps + 256, buf, col0 + 64 * cc, row0 - c_row0);
                bulk_commit();
            }
        }
    }
    if (chunks < BN / 64 && lane == 0) bulk_wait_read<0>();
#else
    // the warp's 16 rows, 64 columns at a time through its 2 KB of staging (gemm_common.cuh)
    store_warp_rows(d, r.staging + (tid / 32) * WARP_STAGING, lane, out, ldc,
                    tile_m * BM + wg * 64 + warp * 16, tile_n * BN, m, n, addend, adds,
                    plane_elems);
#endif
    MK_STAMP(stored, seq, 0);
#if MK_PUBLISHER
    // Hand the tile to the publisher and go on. Waiting first until tile seq - 1 was published
    // keeps the two barriers' phases from running more than one tile apart.
    if (seq > 0) mbar_wait(r.published, (seq - 1) & 1);
    __syncwarp();  // orders the warp's stores before lane 0's arrival (a release, cumulative)
    if (lane == 0) mbar_arrive(r.staged);
    MK_STAMP(done, seq, 0);
    return 0;
#elif MK_TMA_STORE
    MK_STAMP(done, seq, 0);
    return 0;  // no flag per tile: its stores may be in flight (mk_gemm_sm90_drain)
#else
    consumer_barrier();
    MK_STAMP(done, seq, 0);
    return tid == 0;
#endif
}

// A split-K fold's unit (kernels/gemm/), every thread of the block: rows [c_row0, c_row0 + rows)
// of tile column tile_n (its BN columns, bounded by m and n) := the sum of planes 1..adds of
// ``addend`` ([P, m, n] bf16), rounded once, into ``c`` (whose first row is c_row0, ldc elements
// per row). It reads no K and touches no ring slot or barrier of the ring: the consumers read
// the planes straight from memory with many loads in flight (fold_planes), the other warps
// return 0 at once. Returns 1 in consumer thread 0 once every consumer's stores are issued (the
// consumers' barrier), as the tile does without MK_PUBLISHER or MK_TMA_STORE.
extern "C" __device__ int mk_gemm_sm90_fold(unsigned long long c, int ldc, int c_row0, int rows,
                                            unsigned long long addend, int adds, int m, int n,
                                            int tile_n) {
    const int tid = threadIdx.x;
    if (tid >= CONSUMER_THREADS) return 0;
    MK_STAMP(fold_enter, 0, 0);  // (no seq here: a probe's stamps count the block's items)
    fold_planes<BN, CONSUMER_THREADS>((__nv_bfloat16 *)c, ldc, addend, adds, (long long)m * n,
                                      c_row0, min(rows, m - c_row0), tile_n * BN, n, tid);
    consumer_barrier();
    MK_STAMP(fold_done, 0, 0);
    return tid == 0;
}

#if MK_TMA_STORE
// Once per block after its last tile, in every thread. publish 1: each consumer warp's tensor
// stores are complete and ordered before generic accesses (wait_group 0 and a proxy fence in the
// lane that issued them, then the consumers' barrier), so the flags released next say their
// tiles are in C. publish 0 (nothing in the kernel reads the flags): only until the stores have
// read their staging (wait_group.read 0), which the block's shared memory must outlive; the
// writes finish with the kernel. Returns the publisher index 0..31 in consumer warp 0, which
// then publishes (or records) the block's tile flags; -1 elsewhere (the producer warp at once).
extern "C" __device__ int mk_gemm_sm90_drain(int publish) {
    const int tid = threadIdx.x;
    if (tid >= CONSUMER_THREADS) return -1;
    if (tid % 32 == 0) {
        if (publish) {
            bulk_wait<0>();
            fence_proxy_async();
        } else {
            bulk_wait_read<0>();
        }
    }
    if (publish) consumer_barrier();
    return tid < 32 ? tid : -1;
}
#endif
