// Probe (issue 23, the few-tile rows): split-K whose slices add up in distributed shared memory.
//
// mk.Gemm's split-K (kernels/gemm/) writes each slice's partial tile to a global workspace,
// releases a flag, and a fold unit per tile waits for the S flags and sums the S planes on one
// SM: a fixed cost of ~6-12 us a call (benchmarks/NOTES.md), which is why "auto" runs whole
// ping-pong tiles at 512 x 1024 and the like, at 0.64-0.86x cuBLAS. Here the S slices of one
// 128 x 256 tile run as one thread-block cluster of S CTAs (cluster rank r: K from r * K / S):
// after its main loop each CTA writes its fp32 accumulators into its own shared memory (the
// ring's, free by then), the cluster meets at a barrier, and CTA r sums rows [r * 128 / S,
// (r + 1) * 128 / S) of the S partial tiles through distributed shared memory (mapa +
// ld.shared::cluster), rounds once to bf16 and stores them to C; a second cluster barrier keeps
// every CTA's shared memory alive until the others have read it. No workspace, no flag, no fold
// unit. One tile per cluster (grid = tiles x S CTAs).
//
// The main loop is the library's sm_90a tile (gemm_tile.cu): 2 consumer warpgroups (rows 64 wg..
// of the tile, wgmma m64n256k16, 128 fp32 accumulators a thread) and a producer warp driving TMA
// through a 4-stage ring of 48 KB slots; B is [N, K] (K-major). It #includes the library's
// sm90.cuh and gemm_common.cuh (build with -I mknumba/roles/cuda).
//
//   nvcc -O3 -std=c++17 -gencode=arch=compute_90a,code=sm_90a -I mknumba/roles/cuda \
//        benchmarks/cuda/gemm_cluster_split.cu -lcuda -lcublas -o gemm_cluster_split
//   ./gemm_cluster_split M N K S [M N K S ...]     # S in {1, 2, 4, 8}; prints JSON lines
//
// Per shape: ours and cuBLAS on the same fresh random inputs (gemm_probe.cuh: each a CUDA graph of
// 20 launches replayed in alternating rounds, the median per call, and the relative error of
// ours against cuBLAS's output), and how many clusters of S such CTAs fit at once
// (cudaOccupancyMaxActiveClusters).
// S = 1 is the unsplit tile through the same code (its "reduction" reads its own tile).
#include "gemm_common.cuh"
#include "gemm_probe.cuh"

namespace {

constexpr int BM = 128, BN = 256, BK = 64, STAGES = 4, CONSUMERS = 256, THREADS = 288;
constexpr unsigned A_BYTES = BM * BK * 2, B_BYTES = BN * BK * 2;
constexpr unsigned RING_BYTES = STAGES * (A_BYTES + B_BYTES);
constexpr unsigned BAR_OFFSET = RING_BYTES;
// the partial tile in fp32, rows padded by 8 floats so that a warp's float2 stores (8 rows x 32
// bytes) fall in distinct banks, two wavefronts for 256 bytes
constexpr int RED_LD = BN + 8;
static_assert(BM * RED_LD * 4 <= RING_BYTES, "the partial tile fits in the ring");
constexpr unsigned SMEM_BYTES = RING_BYTES + 16 * STAGES + 1024;

__device__ __forceinline__ float4 ld_cluster_f4(unsigned addr) {
    float4 v;
    asm volatile("ld.shared::cluster.v4.f32 {%0, %1, %2, %3}, [%4];"
                 : "=f"(v.x), "=f"(v.y), "=f"(v.z), "=f"(v.w) : "r"(addr) : "memory");
    return v;
}

__device__ __forceinline__ void st_shared_f2(unsigned addr, float x, float y) {
    asm volatile("st.shared.v2.f32 [%0], {%1, %2};" ::"r"(addr), "f"(x), "f"(y) : "memory");
}

template <int S>
__global__ void __launch_bounds__(THREADS, 1)
    cluster_split_gemm(const unsigned long long tmaps, __nv_bfloat16 *c, int m, int n,
                       int k_iters, int tiles_n) {
    extern __shared__ __align__(1024) unsigned char smem[];
    const unsigned base = ring_base((unsigned long long)smem);
    const unsigned a_ring = base, b_ring = base + STAGES * A_BYTES;
    const unsigned full = base + BAR_OFFSET, empty = full + 8 * STAGES;
    const int tid = threadIdx.x;
    const unsigned r = S > 1 ? probe::cluster_rank() : 0;
    const int tile = blockIdx.x / S, tile_m = tile / tiles_n, tile_n = tile % tiles_n;
    const int k0 = (int)r * k_iters;  // this slice's first k-step

    if (tid == 0) {
        init_ring<STAGES>(full, empty, 2, tmaps);
        mbar_init_fence();
    }
    __syncthreads();

    float d[128];
    if (tid >= CONSUMERS) {  // producer warp
        if (tid == CONSUMERS) {
            for (int kk = 0; kk < k_iters; ++kk) {
                const unsigned s = kk % STAGES, phase = (kk / STAGES) & 1;
                mbar_wait(empty + 8 * s, phase ^ 1);
                mbar_expect_tx(full + 8 * s, A_BYTES + B_BYTES);
                tma_load_2d(a_ring + s * A_BYTES, tmaps, (k0 + kk) * BK, tile_m * BM, full + 8 * s);
                tma_load_2d(b_ring + s * B_BYTES, tmaps + 128, (k0 + kk) * BK, tile_n * BN,
                            full + 8 * s);
            }
        }
    } else {  // consumers: the library tile's main loop
        const int wg = tid / 128;
#pragma unroll
        for (int i = 0; i < 128; ++i) d[i] = 0.f;
        fence_operands(d);
        for (int kk = 0; kk < k_iters; ++kk) {
            const unsigned s = kk % STAGES, phase = (kk / STAGES) & 1;
            mbar_wait(full + 8 * s, phase);
            const unsigned a = a_ring + s * A_BYTES + wg * 64 * 128, b = b_ring + s * B_BYTES;
            wgmma_fence();
#pragma unroll
            for (int k16 = 0; k16 < BK / 16; ++k16)
                wgmma_m64n256k16(d, smem_desc(a + 32 * k16), smem_desc(b + 32 * k16));
            wgmma_commit();
            wgmma_wait<1>();
            fence_operands(d);
            if (kk > 0 && tid % 128 == 0) mbar_arrive(empty + 8 * ((kk - 1) % STAGES));
        }
        wgmma_wait<0>();
        fence_operands(d);
    }
    // every MMA of both warpgroups has read its slots, and every copy landed (each was waited
    // on): the ring is free for the partial tile
    __syncthreads();
    if (tid < CONSUMERS) {
        const int wg = tid / 128, warp = (tid % 128) / 32, lane = tid % 32;
        const int row = wg * 64 + warp * 16 + lane / 4;
#pragma unroll
        for (int j = 0; j < BN / 8; ++j) {
            const int col = 8 * j + 2 * (lane % 4);
            st_shared_f2(base + (row * RED_LD + col) * 4, d[4 * j], d[4 * j + 1]);
            st_shared_f2(base + ((row + 8) * RED_LD + col) * 4, d[4 * j + 2], d[4 * j + 3]);
        }
    }
    if (S > 1) probe::cluster_sync(); else __syncthreads();

    // rows [r * BM / S, +BM / S) of the tile: the S partials summed, rounded once
    constexpr int ROWS = BM / S, UNITS = ROWS * (BN / 8);  // 8 columns (two float4) a unit
    unsigned src[S];
#pragma unroll
    for (int q = 0; q < S; ++q) src[q] = S > 1 ? probe::map_to(base, q) : base;
    for (int u = tid; u < UNITS; u += THREADS) {
        const int lr = u / (BN / 8), col = 8 * (u % (BN / 8));
        const int row = (int)r * ROWS + lr;
        const int grow = tile_m * BM + row, gcol = tile_n * BN + col;
        float4 x[S][2];
#pragma unroll
        for (int q = 0; q < S; ++q) {
            const unsigned at = src[q] + (row * RED_LD + col) * 4;
            x[q][0] = ld_cluster_f4(at);
            x[q][1] = ld_cluster_f4(at + 16);
        }
        float f[8] = {0.f, 0.f, 0.f, 0.f, 0.f, 0.f, 0.f, 0.f};
#pragma unroll
        for (int q = 0; q < S; ++q) {
            f[0] += x[q][0].x; f[1] += x[q][0].y; f[2] += x[q][0].z; f[3] += x[q][0].w;
            f[4] += x[q][1].x; f[5] += x[q][1].y; f[6] += x[q][1].z; f[7] += x[q][1].w;
        }
        if (grow < m && gcol < n) *(uint4 *)(c + (long long)grow * n + gcol) = pack_bf16x8(f);
    }
    if (S > 1) probe::cluster_sync();  // the others are done reading this CTA's partial
}

template <int S>
void launch(const unsigned long long tmaps, __nv_bfloat16 *c, int m, int n, int k,
            cudaStream_t stream) {
    const int tiles_n = (n + BN - 1) / BN, tiles = ((m + BM - 1) / BM) * tiles_n;
    probe::ClusterLaunch l(tiles * S, THREADS, SMEM_BYTES, S, stream);
    CHECK(cudaLaunchKernelEx(&l.cfg, cluster_split_gemm<S>, tmaps, c, m, n, k / BK / S, tiles_n));
}

template <int S> int max_clusters() {
    CHECK(cudaFuncSetAttribute(cluster_split_gemm<S>, cudaFuncAttributeMaxDynamicSharedMemorySize,
                               SMEM_BYTES));
    probe::ClusterLaunch l(S * 64, THREADS, SMEM_BYTES, S, 0);
    int count = 0;
    CHECK(cudaOccupancyMaxActiveClusters(&count, cluster_split_gemm<S>, &l.cfg));
    return count;
}

void run_ours(int s, const unsigned long long tmaps, __nv_bfloat16 *c, int m, int n, int k,
              cudaStream_t st) {
    switch (s) {
        case 1: launch<1>(tmaps, c, m, n, k, st); break;
        case 2: launch<2>(tmaps, c, m, n, k, st); break;
        case 4: launch<4>(tmaps, c, m, n, k, st); break;
        case 8: launch<8>(tmaps, c, m, n, k, st); break;
        default: fprintf(stderr, "S must be 1, 2, 4 or 8\n"); exit(2);
    }
}

}  // namespace

int main(int argc, char **argv) {
    const auto runs = probe::arg_runs(argc, argv, 4, "M N K S [M N K S ...]");
    CHECK(cudaFree(0));
    const int fits[4] = {max_clusters<1>(), max_clusters<2>(), max_clusters<4>(),
                         max_clusters<8>()};
    cublasHandle_t handle;
    CHECK(cublasCreate(&handle));
    for (const auto &run : runs) {
        const int m = run.v[0], n = run.v[1], k = run.v[2], s = run.v[3];
        if (m % BM || n % BN || k % (BK * s)) {
            fprintf(stderr, "skip %dx%dx%d S=%d: whole tiles and slices only\n", m, n, k, s);
            continue;
        }
        probe::Operands x(m, n, k, run.first);
        CUtensorMap maps[2] = {probe::encode(x.a, m, k, BM), probe::encode(x.b, n, k, BN)};
        const probe::DeviceMaps tm(maps);
        auto ours = [&](cudaStream_t st) { run_ours(s, tm.addr, x.c, m, n, k, st); };
        const probe::Result res = probe::compare_with_cublas(handle, x, m, n, k, ours);
        const int fit = fits[s == 1 ? 0 : s == 2 ? 1 : s == 4 ? 2 : 3];
        printf("{\"kernel\": \"gemm_cluster_split_probe\", \"shape\": {\"m\": %d, \"n\": %d, "
               "\"k\": %d}, \"slices\": %d, \"ctas\": %d, \"max_active_clusters\": %d, "
               "\"ours_us\": %.3f, \"cublas_us\": %.3f, \"speedup\": %.4f, \"rel_err\": %.3e}\n",
               m, n, k, s, (m / BM) * (n / BN) * s, fit, res.ours_us, res.cublas_us,
               res.cublas_us / res.ours_us, res.rel_err);
        fflush(stdout);
    }
    return 0;
}
