// Hopper (sm_90a) GEMM tile, "ping-pong" schedule (CUTLASS's KernelTmaWarpSpecializedPingpong):
// C[tile] = A[tile rows, :] @ B[tile cols, :]^T. Same contract, operands (tensor maps, MK_B_KN)
// and entry-point arguments as gemm_tile.cu (read its header first); what differs:
//   warps 0-7  two consumer warpgroups, each computing WHOLE BM x BN tiles on its own: the
//              block's tile seq belongs to warpgroup seq % 2, which runs BM / 64 wgmma
//              m64nBNk16 per k16 step (tile rows 0-63, and with BM = 128 rows 64-127; BN / 2
//              fp32 accumulators per thread for each); the other warpgroup returns 0 from that
//              call at once and goes on to its own next tile;
//   warp 8     the producer: one lane fills the ring in tile order, as in gemm_tile.cu.
// The tile's shape and the ring's depth are the build's (roles/compute.py derives them and the
// shared memory from the build's name): MK_PP_BM, MK_PP_BN in {64, 128}, MK_PP_STAGES; by default
// 128 x 128 in 6 stages. Smaller tiles give a GEMM with few output tiles more of them to spread
// over the SMs. MK_PP_DESC_ITER 1 ("sm90:ppd*"): k_step builds the slot's two wgmma descriptors
// once and each MMA's by an add (sm90.cuh desc_at).
// Only one warpgroup runs its main loop at a time, so one warpgroup's epilogue (and its wait for
// its next tile's inputs) runs while the other's MMAs keep the tensor cores busy.
// Ring: STAGES slots of A BM x 128 B (box 64 x BM) + B BN x 128 B (box 64 x BN, or with MK_B_KN
// BN / 64 boxes 64 (N) x 64 (K) side by side), never reset between tiles (slot and phase from
// g = seq * k_iters + kk, gemm_common.cuh produce_tile); full[s] as in gemm_tile.cu; empty[s]
// takes ONE arrival per use: the warpgroup that consumed the slot.
//
// The handoff: two mbarriers order[0] and order[1] of 128 arrivals.
//   After issuing the last MMAs of its tile s, every thread of warpgroup s % 2 arrives on
//   order[(s + 1) % 2], and tile s > 0 starts its main loop once phase (s - 1) / 2 of
//   order[s % 2] completed. order[w] is arrived on only by the other warpgroup, once (128
//   arrivals, on every path: also k_iters == 0) for each tile it owns, in tile order: the
//   phases of order[1] are tiles 0, 2, 4, ..., those of order[0] tiles 1, 3, 5, ..., so phase
//   (s - 1) / 2 of order[s % 2] is tile s - 1's.
//   The parity wait is exact (it would pass early if the phase before were still open, and
//   hang if the phase after had completed too): when tile s waits, the phase before (tile
//   s - 3) has completed, since the waiter's previous tile, s - 2, waited for it; the phase
//   after (tile s + 1) cannot complete before this wait passed, since tile s + 1 waits for
//   tile s, which arrives after it.
//   No count depends on how many tiles a block runs: with 0 tiles nothing arrives or waits;
//   with 1 warpgroup 1 never runs a main loop; the last tile's arrival is never waited on and
//   stays pending when the kernel ends, which is harmless. The producer needs no handoff: it
//   only waits for empty slots, which the main loops free in k-step order.
// The epilogue is the sm90 tile's (gemm_common.cuh store_warp_rows, 2 KB of staging per warp,
// private to the warp, BN / 64 chunks of 64 columns per 16 rows): the two warpgroups'
// epilogues need no ordering. The owning warpgroup's thread 0 returns 1 after a named barrier
// of its 128 threads (barrier 1 + wg).
// Probe hooks (MK_STAMP, MK_FULL_WAIT: gemm_common.cuh; empty here) at the places gemm_tile.cu
// has them, for benchmarks/probe_gemm_stamps.py's st:pp builds; a tile's events come from its
// owning warpgroup's thread 0 or 128, so the probe's summary covers tiles of even seq
// (warpgroup 0's: every tile where a block runs one).

#include "gemm_common.cuh"

#ifndef MK_B_KN
#define MK_B_KN 0
#endif
#ifndef MK_PP_BM
#define MK_PP_BM 128
#endif
#ifndef MK_PP_BN
#define MK_PP_BN 128
#endif
#ifndef MK_PP_STAGES
#define MK_PP_STAGES 6
#endif
#ifndef MK_PP_DESC_ITER
#define MK_PP_DESC_ITER 0
#endif

namespace {

constexpr int BM = MK_PP_BM, BN = MK_PP_BN, BK = 64, STAGES = MK_PP_STAGES;
static_assert((BM == 64 || BM == 128) && (BN == 64 || BN == 128), "tiles of 64 or 128");
constexpr int CONSUMER_THREADS = 256;
constexpr unsigned A_BYTES = BM * BK * 2, B_BYTES = BN * BK * 2, STAGE_BYTES = A_BYTES + B_BYTES;
constexpr unsigned STAGING_BYTES = CONSUMER_THREADS / 32 * WARP_STAGING;
// Layout from the 1024-byte-aligned base (128B swizzle repeats every 1024 B; every slot is a
// multiple of 8 KB):
//   [A slot 0..STAGES-1][B slots][staging, 2 KB per consumer warp][full 0..][empty 0..][order 0, 1]
constexpr unsigned B_OFFSET = STAGES * A_BYTES;
constexpr unsigned STAGING_OFFSET = STAGES * STAGE_BYTES;
constexpr unsigned BAR_OFFSET = STAGING_OFFSET + STAGING_BYTES;

struct Ring {
    unsigned a, b, staging, full, empty, order;  // shared-space addresses
};

__device__ __forceinline__ Ring ring_at(unsigned long long smem_generic) {
    const unsigned base = ring_base(smem_generic);
    return Ring{base, base + B_OFFSET, base + STAGING_OFFSET, base + BAR_OFFSET,
                base + BAR_OFFSET + 8 * STAGES, base + BAR_OFFSET + 16 * STAGES};
}

// One k-step (ring step g, the tile's kk) of a warpgroup's main loop: wait for its slot's data,
// issue its MMAs (tile rows 0-63 into d0 and, with BM = 128, rows 64-127 into d1), then wait
// until only these are in flight (one k-step of MMAs kept in flight: the caller may release the
// warpgroup's previous slot).
__device__ __forceinline__ void k_step(const Ring &r, unsigned g, float (&d0)[BN / 2],
                                       float (&d1)[BN / 2], int seq, int kk) {
    const unsigned s = g % STAGES, phase = (g / STAGES) & 1;
    MK_FULL_WAIT(r.full + 8 * s, phase, seq, kk);
    const unsigned a = r.a + s * A_BYTES, b = r.b + s * B_BYTES;
    wgmma_fence();
    // k16: 16 bf16 = 32 bytes along A's (and a K-major B's) swizzled rows; with MK_B_KN 16 rows
    // (2 KB) down every box of B
#if MK_PP_DESC_ITER
    // the slot's two descriptors once, then each MMA's by an add to the start address (desc_at)
    const unsigned long long da = smem_desc(a);
#if MK_B_KN
    const unsigned long long db = smem_desc_mn(b, 64 * 128);
    constexpr unsigned B_K16 = 16 * 128;
#else
    const unsigned long long db = smem_desc(b);
    constexpr unsigned B_K16 = 32;
#endif
#pragma unroll
    for (int k16 = 0; k16 < BK / 16; ++k16) {
        const unsigned long long dbk = desc_at(db, B_K16 * k16);
        wgmma_ss<MK_B_KN>(d0, desc_at(da, 32 * k16), dbk, 1);
        if (BM == 128) wgmma_ss<MK_B_KN>(d1, desc_at(da, 64 * 128 + 32 * k16), dbk, 1);
    }
#else
#pragma unroll
    for (int k16 = 0; k16 < BK / 16; ++k16) {
#if MK_B_KN
        const unsigned long long db = smem_desc_mn(b + 16 * 128 * k16, 64 * 128);
#else
        const unsigned long long db = smem_desc(b + 32 * k16);
#endif
        wgmma_ss<MK_B_KN>(d0, smem_desc(a + 32 * k16), db, 1);
        if (BM == 128) wgmma_ss<MK_B_KN>(d1, smem_desc(a + 64 * 128 + 32 * k16), db, 1);
    }
#endif
    wgmma_commit();
    wgmma_wait<1>();
    fence_operands(d0);
    if (BM == 128) fence_operands(d1);
}

}  // namespace

// Once per block, before the first tile; thread 0 initialises the barriers, the caller then
// runs __syncthreads(). tmaps: address of the two 128-byte CUtensorMaps (A, then B).
extern "C" __device__ int mk_gemm_sm90pp_init(unsigned long long smem, unsigned long long tmaps) {
    MK_STAMP(block_start, 0, 0);
    if (threadIdx.x == 0) {
        Ring r = ring_at(smem);
        init_ring<STAGES>(r.full, r.empty, 1, tmaps);  // one warpgroup consumes each slot
        mbar_init(r.order, 128);
        mbar_init(r.order + 8, 128);
        mbar_init_fence();
    }
    return 0;
}

// One BM x BN output tile; every thread of the block calls it for every tile (arguments as
// mk_gemm_sm90_tile's). Returns 1 in exactly one thread, the owning warpgroup's thread 0, once
// every thread of that warpgroup has issued its stores of the tile; the other warpgroup returns
// 0 at once, the producer warp once it has queued the loads.
extern "C" __device__ int mk_gemm_sm90pp_tile(unsigned long long smem, unsigned long long tmaps,
                                              unsigned long long c, int ldc, int c_row0,
                                              unsigned long long addend, int adds, int m, int n,
                                              int tile_m, int tile_n, int k_iters, int seq) {
    const Ring r = ring_at(smem);
    const int tid = threadIdx.x;
    const unsigned g0 = (unsigned)seq * (unsigned)k_iters;
    MK_STAMP(enter, seq, 0);

    if (tid >= CONSUMER_THREADS) {  // ---- producer warp: one lane drives the copy engine
        if (tid == CONSUMER_THREADS) {
            MK_STAMP(produce, seq, 0);
            produce_tile<BM, BN, STAGES, MK_B_KN>(r.a, r.b, r.full, r.empty, tmaps, n, tile_m,
                                                  tile_n, k_iters, g0);
            MK_STAMP(produced, seq, 0);
        }
        return 0;
    }
    // The warpgroup, broadcast from lane 0 so that the compiler sees it is uniform across the
    // warp (wgmma under a branch it cannot prove uniform serializes every wgmma of the kernel).
    const int wg = __shfl_sync(0xffffffffu, tid / 128, 0);
    if (wg != (seq & 1)) return 0;  // the other warpgroup's tile

    // ---- this warpgroup's tile: its main loop follows tile seq - 1's (the handoff above)
    if (seq > 0) mbar_wait(r.order + 8 * wg, ((unsigned)(seq - 1) >> 1) & 1);
    // tile rows 0-63 and, with BM = 128, 64-127 (with BM = 64, d1 is never read: no registers)
    float d0[BN / 2], d1[BN / 2];
#pragma unroll
    for (int i = 0; i < BN / 2; ++i) d0[i] = d1[i] = 0.f;
    fence_operands(d0);
    if (BM == 128) fence_operands(d1);

    for (int kk = 0; kk < k_iters; ++kk) {
        const unsigned g = g0 + kk;
        k_step(r, g, d0, d1, seq, kk);
        if (kk > 0 && tid % 128 == 0) mbar_arrive(r.empty + 8 * ((g - 1) % STAGES));
    }
    // Every MMA of this tile is issued: the next tile's main loop may queue behind them.
    mbar_arrive(r.order + 8 * (wg ^ 1));
    wgmma_wait<0>();
    fence_operands(d0);
    if (BM == 128) fence_operands(d1);
    MK_STAMP(main_done, seq, 0);
    if (k_iters > 0 && tid % 128 == 0) mbar_arrive(r.empty + 8 * ((g0 + k_iters - 1) % STAGES));

    // ---- epilogue: each warp stores its 16 rows of each 64-row half through its staging
    const int lane = tid % 32, warp = (tid % 128) / 32;
    __nv_bfloat16 *out = (__nv_bfloat16 *)c - (long long)c_row0 * ldc;  // indexed by global row
    const long long plane_elems = (long long)m * n;
    const unsigned stage = r.staging + (tid / 32) * WARP_STAGING;
    const int row0 = tile_m * BM + warp * 16, col0 = tile_n * BN;
    store_warp_rows(d0, stage, lane, out, ldc, row0, col0, m, n, addend, adds, plane_elems);
    if (BM == 128)
        store_warp_rows(d1, stage, lane, out, ldc, row0 + 64, col0, m, n, addend, adds,
                        plane_elems);
    MK_STAMP(stored, seq, 0);
    // Named barrier 1 + wg over this warpgroup (barrier 0 is __syncthreads).
    asm volatile("bar.sync %0, 128;" ::"r"(1 + wg) : "memory");
    MK_STAMP(done, seq, 0);
    return tid % 128 == 0;
}
