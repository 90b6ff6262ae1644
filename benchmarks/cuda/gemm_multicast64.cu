// Probe (issue 23, the 512 x 1024 row): 64 x 64 tiles in thread-block clusters whose operands
// arrive by TMA multicast, as cuBLAS runs that row (nvjet 64x64, 13 stages, cluster 2x1).
//
// At 512 x 1024 x K "auto" runs one 64 x 64 ping-pong tile per SM (128 tiles) at ~223 ns a
// k-step, cuBLAS's clustered kernel at ~156 with 0.77x our L2 sectors (benchmarks/NOTES.md,
// twenty-fifth session). The library's ping-pong tiles in clusters of 2 (`ppmc`, nineteenth
// session) ran slower, so this probe asks the question alone, outside the library: one tile a
// CTA, a cluster of CM x CN CTAs over a CM x CN block of tiles; CTAs of one tile column (same
// tile_n) share B's box, each loading 64 / CM of its rows and multicasting them to the others;
// CTAs of one tile row share A the same way (64 / CN rows each). Every CTA's consumer frees a
// slot in every CTA that writes into it (its own and the CM + CN - 2 others of its row and
// column: a remote mbarrier arrive of default semantics, CUTLASS's form), so a slot's producers
// overwrite it only once all its readers are done. One producer warp, a STAGES-slot ring of 16
// KB slots, and the consumers MODE (below) names: by default one warpgroup (wgmma m64n64k16, 32
// fp32 accumulators a thread), the library's ping-pong 64 x 64 loop with one tile a block.
// (CM, CN) = (1, 1) is the plain tile through the same code: the calibration against the
// library's 64 x 64 rate. MODE 1-3 ask whether one chain of dependent MMAs a block is what
// holds the tile, MODE 4 what the ring delivers with no MMA at all; TMAP and INTERLEAVE, whether
// where the tensor maps live or how the ring is laid out matters (cuBLAS's kernel there: one
// consumer warpgroup's chain, parameter maps, an interleaved ring; benchmarks/NOTES.md,
// twenty-eighth session).
//
//   nvcc -O3 -std=c++17 [-DMODE=1|2|3|4] [-DRING_SLOTS=n] [-DTMAP=1|2] [-DINTERLEAVE=1] \
//        [-DRASTER=1|2|3|4] \
//        -gencode=arch=compute_90a,code=sm_90a \
//        -I mknumba/roles/cuda benchmarks/cuda/gemm_multicast64.cu -lcuda -lcublas \
//        -o gemm_multicast64
//   ./gemm_multicast64 M N K CM CN [M N K CM CN ...]   # (CM, CN) in (1,1) (2,1) (1,2) (2,2)
//                                                      # (4,1); prints JSON lines
// (Clusters of 4 CTAs: at 512 x 1024, 32 clusters, of which an H100 holds 30 at once: two waves.)
//
// Per shape: ours and cuBLAS (cublasGemmEx, bf16 in and out, fp32 compute) on the same random
// inputs (gemm_probe.cuh: each a CUDA graph of 20 launches replayed in alternating rounds,
// the median per call, and the relative error of ours against cuBLAS's output).
#include <algorithm>

#include "gemm_common.cuh"
#include "gemm_probe.cuh"

namespace {

// MODE 0: one consumer warpgroup, one accumulator chain (the library's 64 x 64 loop);
//      1: one warpgroup, two accumulators (k16 steps 0, 2 into one, 1, 3 into the other: two
//         independent chains of dependent MMAs), added at the end;
//      2: two consumer warpgroups taking alternate k-steps, each its own accumulator, added
//         through shared memory at the end (an even ring: each warpgroup only ever waits on
//         its own slots' phases);
//      3: two consumer warpgroups, each the tile's 32 columns 32 w.. (wgmma m64n32k16): two
//         independent chains over the same k-steps, both waiting for and freeing every slot;
//      4: loads only (the ring's delivery rate alone; the output is not the product): the
//         consumer warpgroup waits for each slot and frees it, no wgmma instruction at all
//         (an empty wgmma group makes ptxas issue a dummy MMA). Its four warps meet at a named
//         barrier before the slot is freed: without the MMAs' warpgroup-wide sync, warp 0
//         could free a slot whose full barrier a lagging warp has yet to pass, and once the
//         refill completes that barrier's next phase the lagging warp's parity wait never
//         returns.
#ifndef MODE
#define MODE 0
#endif
// TMAP: where the kernel reads its two tensor maps. 0: global memory (a pointer argument, as the
// library passes them), 1: kernel parameters (__grid_constant__, as cuBLAS and CUTLASS pass
// them), 2: __constant__ memory. (The CUDA guide: maps in global memory "may be slower".)
#ifndef TMAP
#define TMAP 0
#endif
__constant__ CUtensorMap const_maps[2];
// INTERLEAVE=1: a slot's A and B boxes side by side (slot s at s x 16 KB, as cuBLAS lays out
// its ring), else all A boxes, then all B boxes
#ifndef RASTER
#define RASTER 0
#endif
#ifndef INTERLEAVE
#define INTERLEAVE 0
#endif
#ifndef RING_SLOTS  // -DRING_SLOTS=n: the ring's depth (a macro STAGES would clash with
#define RING_SLOTS (MODE == 2 ? 12 : 13)  // gemm_common.cuh's template parameters)
#endif
constexpr int STAGES = RING_SLOTS;
static_assert(MODE != 2 || STAGES % 2 == 0, "MODE 2 needs an even ring");
constexpr int BM = 64, BN = 64, BK = 64;
constexpr int CONSUMERS = MODE == 2 || MODE == 3 ? 256 : 128, THREADS = CONSUMERS + 32;
constexpr unsigned A_BYTES = BM * BK * 2, B_BYTES = BN * BK * 2;
constexpr unsigned RING_BYTES = STAGES * (A_BYTES + B_BYTES);
constexpr unsigned SMEM_BYTES = RING_BYTES + 16 * STAGES + 1024;

// RASTER >= 2: an SM's rank among the GPU's %smid values (rank_sms), 0 .. SMs - 1
constexpr int MAX_SMID = 1024;
__device__ int sm_rank[MAX_SMID];

// each CTA's %smid; launched one CTA an SM (as much shared memory as the GEMM)
__global__ void record_smids(int *out) {
    unsigned smid;
    asm volatile("mov.u32 %0, %%smid;" : "=r"(smid));
    if (threadIdx.x == 0) out[blockIdx.x] = smid;
}

// fills sm_rank and prints the %smid values in order (a JSON line)
void rank_sms(int sms) {
    int *d_ids, *ids = new int[sms], rank[MAX_SMID];
    CHECK(cudaMalloc(&d_ids, sms * sizeof(int)));
    CHECK(cudaFuncSetAttribute(record_smids, cudaFuncAttributeMaxDynamicSharedMemorySize,
                               SMEM_BYTES));
    record_smids<<<sms, 32, SMEM_BYTES>>>(d_ids);
    CHECK(cudaMemcpy(ids, d_ids, sms * sizeof(int), cudaMemcpyDeviceToHost));
    std::sort(ids, ids + sms);
    for (int i = 0; i < MAX_SMID; ++i) rank[i] = MAX_SMID;  // not an SM: no tile
    printf("{\"kernel\": \"smids\", \"smids\": [");
    for (int i = 0; i < sms; ++i) {
        if (ids[i] < 0 || ids[i] >= MAX_SMID || (i && ids[i] == ids[i - 1])) {
            fprintf(stderr, "%%smid %d twice or out of range: not one CTA an SM\n", ids[i]);
            exit(3);
        }
        rank[ids[i]] = i;
        printf("%s%d", i ? ", " : "", ids[i]);
    }
    printf("]}\n");
    CHECK(cudaMemcpyToSymbol(sm_rank, rank, sizeof(rank)));
    CHECK(cudaFree(d_ids));
    delete[] ids;
}

// one arrival on the mbarrier at this CTA's shared address ``bar`` in cluster CTA ``cta``
// (default semantics: release at CTA scope, no GPU-scope fence)
__device__ __forceinline__ void mbar_arrive_cluster(unsigned bar, unsigned cta) {
    asm volatile("mbarrier.arrive.shared::cluster.b64 _, [%0];" ::"r"(probe::map_to(bar, cta))
                 : "memory");
}

// a box into the same shared offset of every CTA in ``mask``, each one's mbarrier at ``bar``
__device__ __forceinline__ void tma_load_2d_mc(unsigned dst, unsigned long long tmap, int inner,
                                               int outer, unsigned bar, unsigned short mask) {
    asm volatile(
        "cp.async.bulk.tensor.2d.shared::cluster.global.mbarrier::complete_tx::bytes"
        ".multicast::cluster [%0], [%1, {%2, %3}], [%4], %5;" ::"r"(dst), "l"(tmap), "r"(inner),
        "r"(outer), "r"(bar), "h"(mask)
        : "memory");
}

__device__ __forceinline__ void wgmma_m64n32k16_ss(float (&d)[16], unsigned long long da,
                                                   unsigned long long db) {
    asm volatile(
        "wgmma.mma_async.sync.aligned.m64n32k16.f32.bf16.bf16 {"
        "%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15"
        "}, %16, %17, 1, 1, 1, 0, 0;\n"
        : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3]), "+f"(d[4]), "+f"(d[5]), "+f"(d[6]),
          "+f"(d[7]), "+f"(d[8]), "+f"(d[9]), "+f"(d[10]), "+f"(d[11]), "+f"(d[12]),
          "+f"(d[13]), "+f"(d[14]), "+f"(d[15])
        : "l"(da), "l"(db));
}

// tmaps: A (box 64 x 64 / CN), B (box 64 x 64 / CM)
template <int CM, int CN>
__global__ void __launch_bounds__(THREADS, 1)
    mc_gemm(const unsigned long long global_maps, __nv_bfloat16 *c, int m, int n, int k_iters,
            int clusters_m, const __grid_constant__ CUtensorMap map_a,
            const __grid_constant__ CUtensorMap map_b) {
    extern __shared__ __align__(1024) unsigned char smem[];
    constexpr int CS = CM * CN;
    const unsigned long long ta = TMAP == 1   ? (unsigned long long)&map_a
                                  : TMAP == 2 ? (unsigned long long)&const_maps[0]
                                              : global_maps;
    const unsigned long long tb = TMAP == 1   ? (unsigned long long)&map_b
                                  : TMAP == 2 ? (unsigned long long)&const_maps[1]
                                              : global_maps + 128;
    const unsigned base = ring_base((unsigned long long)smem);
    constexpr unsigned A_STEP = INTERLEAVE ? A_BYTES + B_BYTES : A_BYTES,
                       B_STEP = INTERLEAVE ? A_BYTES + B_BYTES : B_BYTES;
    const unsigned a_ring = base, b_ring = base + (INTERLEAVE ? A_BYTES : STAGES * A_BYTES);
    const unsigned full = base + RING_BYTES, empty = full + 8 * STAGES;
    const int tid = threadIdx.x;
    const unsigned r = CS > 1 ? probe::cluster_rank() : 0;
    const int rm = r % CM, rn = r / CM;
    // RASTER 0: consecutive clusters down a tile column (sharing B), 1: along a tile row;
    // 2-4 (1 x 1 only): the tile by the SM the CTA runs on (%smid, one CTA an SM: the grid is
    // every SM and CTAs of SMs past the last tile leave): 2 consecutive SMs along a tile row,
    // 3 down a tile column, 4 each 16 consecutive SMs a 4 x 4 patch of tiles (if SMs of one
    // GPC are numbered together, its requests for one box come from up to 4 of them at once)
    const int clusters_n = n / BN / CN;
    int cl = blockIdx.x / CS;
    if (RASTER >= 2) {
        unsigned smid;
        asm volatile("mov.u32 %0, %%smid;" : "=r"(smid));
        cl = sm_rank[smid];  // %smid may skip numbers: its rank among the GPU's SMs'
        if (cl >= clusters_m * clusters_n) return;
    }
    const int patch = cl / 16, in_patch = cl % 16;
    const int cm_ = RASTER == 1 || RASTER == 2 ? cl / clusters_n
                    : RASTER == 4 ? 4 * (patch % (clusters_m / 4)) + in_patch / 4
                                  : cl % clusters_m;
    const int cn_ = RASTER == 1 || RASTER == 2 ? cl % clusters_n
                    : RASTER == 4 ? 4 * (patch / (clusters_m / 4)) + in_patch % 4
                                  : cl / clusters_m;
    const int tile_m = cm_ * CM + rm, tile_n = cn_ * CN + rn;

    if (tid == 0) {
        init_ring<STAGES>(full, empty, (CM + CN - 1) * (MODE == 3 ? 2 : 1), global_maps);
        if (TMAP) {
            prefetch_tensormap(ta);
            prefetch_tensormap(tb);
        }
        mbar_init_fence();
    }
    if (CS > 1) probe::cluster_sync(); else __syncthreads();

    if (tid >= CONSUMERS) {  // producer warp
        if (tid == CONSUMERS) {
            unsigned short mask_a = 0, mask_b = 0;  // CTAs of this tile row / tile column
            for (int q = 0; q < CN; ++q) mask_a |= (unsigned short)(1u << (rm + CM * q));
            for (int q = 0; q < CM; ++q) mask_b |= (unsigned short)(1u << (q + CM * rn));
            for (int kk = 0; kk < k_iters; ++kk) {
                const unsigned s = kk % STAGES, phase = (kk / STAGES) & 1;
                mbar_wait(empty + 8 * s, phase ^ 1);
                mbar_expect_tx(full + 8 * s, A_BYTES + B_BYTES);
                const unsigned a_dst = a_ring + s * A_STEP, b_dst = b_ring + s * B_STEP;
                if (CN == 1)
                    tma_load_2d(a_dst, ta, kk * BK, tile_m * BM, full + 8 * s);
                else
                    tma_load_2d_mc(a_dst + rn * (BM / CN) * 128, ta, kk * BK,
                                   tile_m * BM + rn * (BM / CN), full + 8 * s, mask_a);
                if (CM == 1)
                    tma_load_2d(b_dst, tb, kk * BK, tile_n * BN, full + 8 * s);
                else
                    tma_load_2d_mc(b_dst + rm * (BN / CM) * 128, tb, kk * BK,
                                   tile_n * BN + rm * (BN / CM), full + 8 * s, mask_b);
            }
        }
    } else {  // the consumer warpgroup(s)
        const int wg = tid / 128;
        float d[32], e[32];
#pragma unroll
        for (int i = 0; i < 32; ++i) d[i] = e[i] = 0.f;
        fence_operands(d);
        if (MODE == 1) fence_operands(e);
        int prev = -1;  // this warpgroup's previous k-step
        for (int kk = MODE == 2 ? wg : 0; kk < k_iters; kk += MODE == 2 ? 2 : 1) {
            const unsigned s = kk % STAGES, phase = (kk / STAGES) & 1;
            mbar_wait(full + 8 * s, phase);
            const unsigned a = a_ring + s * A_STEP, b = b_ring + s * B_STEP;
            if (MODE == 4) {
                asm volatile("bar.sync 1, 128;" ::: "memory");
            } else {
                wgmma_fence();
#pragma unroll
                for (int k16 = 0; k16 < BK / 16; ++k16) {
                    const unsigned long long da = smem_desc(a + 32 * k16);
                    if (MODE == 3)
                        wgmma_m64n32k16_ss(*(float(*)[16])d, da,
                                           smem_desc(b + wg * 32 * 128 + 32 * k16));
                    else if (MODE == 1 && (k16 & 1))
                        wgmma_m64n64k16_ss(e, da, smem_desc(b + 32 * k16), 1);
                    else
                        wgmma_m64n64k16_ss(d, da, smem_desc(b + 32 * k16), 1);
                }
                wgmma_commit();
                wgmma_wait<1>();
            }
            fence_operands(d);
            if (MODE == 1) fence_operands(e);
            if (prev >= 0 && tid % 128 == 0) {  // the previous slot, in every CTA writing it
                const unsigned e_bar = empty + 8 * (prev % STAGES);
                if (CS == 1) {
                    mbar_arrive(e_bar);
                } else {
                    for (int q = 0; q < CN; ++q) mbar_arrive_cluster(e_bar, rm + CM * q);
                    for (int q = 0; q < CM; ++q)
                        if (q != rm) mbar_arrive_cluster(e_bar, q + CM * rn);
                }
            }
            prev = kk;
        }
        wgmma_wait<0>();
        fence_operands(d);
        if (MODE == 1) {
            fence_operands(e);
#pragma unroll
            for (int i = 0; i < 32; ++i) d[i] += e[i];
        }
        if (MODE == 2) {
            // every copy landed and every MMA retired in both warpgroups: the ring is free
            asm volatile("bar.sync 1, 256;" ::: "memory");
            const unsigned x = base + (tid % 128) * 16;
            if (wg == 1) {
#pragma unroll
                for (int i = 0; i < 8; ++i)
                    asm volatile("st.shared.v4.f32 [%0], {%1, %2, %3, %4};" ::"r"(x + i * 2048),
                                 "f"(d[4 * i]), "f"(d[4 * i + 1]), "f"(d[4 * i + 2]),
                                 "f"(d[4 * i + 3]) : "memory");
            }
            asm volatile("bar.sync 1, 256;" ::: "memory");
            if (wg == 1) goto done;
#pragma unroll
            for (int i = 0; i < 8; ++i) {
                float4 v;
                asm volatile("ld.shared.v4.f32 {%0, %1, %2, %3}, [%4];"
                             : "=f"(v.x), "=f"(v.y), "=f"(v.z), "=f"(v.w) : "r"(x + i * 2048)
                             : "memory");
                d[4 * i] += v.x; d[4 * i + 1] += v.y; d[4 * i + 2] += v.z; d[4 * i + 3] += v.w;
            }
        }
        // accumulator layout of m64nNk16: warp w rows 16w + lane/4 (+8), d[4j..4j+3] columns
        // 8j + 2 (lane % 4) (+1) of those two rows
        const int warp = (tid % 128) / 32, lane = tid % 32;
        const int row = tile_m * BM + warp * 16 + lane / 4;
#pragma unroll
        for (int j = 0; j < (MODE == 3 ? BN / 16 : BN / 8); ++j) {
            const int col = tile_n * BN + (MODE == 3 ? 32 * wg : 0) + 8 * j + 2 * (lane % 4);
            if (col < n) {
                if (row < m)
                    *(unsigned *)(c + (long long)row * n + col) =
                        pack_bf16x2(d[4 * j], d[4 * j + 1]);
                if (row + 8 < m)
                    *(unsigned *)(c + (long long)(row + 8) * n + col) =
                        pack_bf16x2(d[4 * j + 2], d[4 * j + 3]);
            }
        }
    }
done:
    // no CTA leaves while a peer may still arrive on its barriers or copy into its ring
    if (CS > 1) probe::cluster_sync();
}

template <int CM, int CN>
void launch(const unsigned long long tmaps, const CUtensorMap *maps, __nv_bfloat16 *c, int m,
            int n, int k, cudaStream_t stream) {
    const int tiles_m = m / BM, tiles_n = n / BN;
    int sms = 0;
    CHECK(cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, 0));
    probe::ClusterLaunch l(RASTER >= 2 ? sms : tiles_m * tiles_n, THREADS, SMEM_BYTES, CM * CN,
                           stream);
    CHECK(cudaLaunchKernelEx(&l.cfg, mc_gemm<CM, CN>, tmaps, c, m, n, k / BK, tiles_m / CM,
                               maps[0], maps[1]));
}

template <int CM, int CN> void allow_smem() {
    CHECK(cudaFuncSetAttribute(mc_gemm<CM, CN>, cudaFuncAttributeMaxDynamicSharedMemorySize,
                               SMEM_BYTES));
}

bool run_ours(int cm, int cn, const unsigned long long tmaps, const CUtensorMap *maps,
              __nv_bfloat16 *c, int m, int n, int k, cudaStream_t st) {
    if (cm == 1 && cn == 1) launch<1, 1>(tmaps, maps, c, m, n, k, st);
    else if (cm == 2 && cn == 1) launch<2, 1>(tmaps, maps, c, m, n, k, st);
    else if (cm == 1 && cn == 2) launch<1, 2>(tmaps, maps, c, m, n, k, st);
    else if (cm == 2 && cn == 2) launch<2, 2>(tmaps, maps, c, m, n, k, st);
    else if (cm == 4 && cn == 1) launch<4, 1>(tmaps, maps, c, m, n, k, st);
    else return false;
    return true;
}

}  // namespace

int main(int argc, char **argv) {
    const auto runs = probe::arg_runs(argc, argv, 5, "M N K CM CN [M N K CM CN ...]");
    CHECK(cudaFree(0));
    allow_smem<1, 1>(); allow_smem<2, 1>(); allow_smem<1, 2>(); allow_smem<2, 2>();
    allow_smem<4, 1>();
    cublasHandle_t handle;
    CHECK(cublasCreate(&handle));
    if (RASTER >= 2) {
        int sms = 0;
        CHECK(cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, 0));
        rank_sms(sms);
    }
    for (const auto &run : runs) {
        const int m = run.v[0], n = run.v[1], k = run.v[2], cm = run.v[3], cn = run.v[4];
        if (m % (BM * cm) || n % (BN * cn) || k % BK ||
            (RASTER >= 2 && (cm * cn != 1 || (RASTER == 4 && (m / BM % 4 || n / BN % 4))))) {
            fprintf(stderr, "skip %dx%dx%d %dx%d: whole clusters of tiles only (RASTER >= 2: "
                    "1 x 1; 4: 4 x 4 patches)\n", m, n, k, cm, cn);
            continue;
        }
        probe::Operands x(m, n, k, run.first);
        CUtensorMap maps[2] = {probe::encode(x.a, m, k, BM / cn),
                               probe::encode(x.b, n, k, BN / cm)};
        const probe::DeviceMaps tm(maps);
        CHECK(cudaMemcpyToSymbol(const_maps, maps, sizeof(maps)));
        auto ours = [&](cudaStream_t st) {
            if (!run_ours(cm, cn, tm.addr, maps, x.c, m, n, k, st)) {
                fprintf(stderr, "no build for cluster %dx%d\n", cm, cn);
                exit(2);
            }
        };
        const probe::Result res = probe::compare_with_cublas(handle, x, m, n, k, ours);
        printf("{\"kernel\": \"gemm_multicast64_probe\", \"shape\": {\"m\": %d, \"n\": %d, "
               "\"k\": %d}, \"cluster\": [%d, %d], \"stages\": %d, \"ctas\": %d, "
               "\"ours_us\": %.3f, \"cublas_us\": %.3f, \"speedup\": %.4f, "
               "\"ns_per_kstep\": %.1f, \"mode\": %d, \"tmap\": %d, \"interleave\": %d, "
               "\"raster\": %d, \"promo\": %d, \"rel_err\": %.3e}\n",
               m, n, k, cm, cn, STAGES, (m / BM) * (n / BN), res.ours_us, res.cublas_us,
               res.cublas_us / res.ours_us, res.ours_us * 1000 / (k / BK), MODE, TMAP,
               INTERLEAVE, RASTER, PROMO, res.rel_err);
        fflush(stdout);
    }
    return 0;
}
