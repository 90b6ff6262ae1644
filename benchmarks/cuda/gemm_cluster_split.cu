// Probe (issue 23, the few-tile rows): split-K whose slices add up in distributed shared memory.
//
// mk.Gemm's split-K (kernels/gemm.py) writes each slice's partial tile to a global workspace,
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
// Per shape: ours and cuBLAS (cublasGemmEx, bf16 in and out, fp32 compute: what torch.matmul
// runs) on the same fresh random inputs, each timed as a CUDA graph of 20 launches replayed in
// alternating rounds (median per call), the relative error of ours against cuBLAS's output (max |diff| /
// max |ref|), and how many clusters of S such CTAs fit at once (cudaOccupancyMaxActiveClusters).
// S = 1 is the unsplit tile through the same code (its "reduction" reads its own tile).
#include <cuda.h>
#include <cuda_runtime.h>
#include <cublas_v2.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <cstdio>
#include <cstdlib>
#include <vector>

#include "gemm_common.cuh"

#define CHECK(x)                                                                          \
    do {                                                                                  \
        auto e_ = (x);                                                                    \
        if (e_ != 0) {                                                                    \
            fprintf(stderr, "%s:%d %s failed: %d\n", __FILE__, __LINE__, #x, (int)e_);    \
            exit(1);                                                                      \
        }                                                                                 \
    } while (0)

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

__device__ __forceinline__ void cluster_sync() {
    asm volatile("barrier.cluster.arrive.release.aligned;\n"
                 "barrier.cluster.wait.acquire.aligned;" ::: "memory");
}

__device__ __forceinline__ unsigned cluster_rank() {
    unsigned r;
    asm volatile("mov.u32 %0, %%cluster_ctarank;" : "=r"(r));
    return r;
}

// this CTA's shared address ``addr`` as CTA ``cta`` of the cluster sees it
__device__ __forceinline__ unsigned map_to(unsigned addr, unsigned cta) {
    unsigned out;
    asm volatile("mapa.shared::cluster.u32 %0, %1, %2;" : "=r"(out) : "r"(addr), "r"(cta));
    return out;
}

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
    const unsigned r = S > 1 ? cluster_rank() : 0;
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
    if (S > 1) cluster_sync(); else __syncthreads();

    // rows [r * BM / S, +BM / S) of the tile: the S partials summed, rounded once
    constexpr int ROWS = BM / S, UNITS = ROWS * (BN / 8);  // 8 columns (two float4) a unit
    unsigned src[S];
#pragma unroll
    for (int q = 0; q < S; ++q) src[q] = S > 1 ? map_to(base, q) : base;
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
    if (S > 1) cluster_sync();  // the others are done reading this CTA's partial
}

CUtensorMap encode(void *ptr, int rows, int cols, int box_rows) {
    CUtensorMap map;
    cuuint64_t dims[2] = {(cuuint64_t)cols, (cuuint64_t)rows};
    cuuint64_t strides[1] = {(cuuint64_t)cols * 2};
    cuuint32_t box[2] = {64, (cuuint32_t)box_rows}, elem[2] = {1, 1};
    CHECK(cuTensorMapEncodeTiled(&map, CU_TENSOR_MAP_DATA_TYPE_BFLOAT16, 2, ptr, dims, strides,
                                 box, elem, CU_TENSOR_MAP_INTERLEAVE_NONE,
                                 CU_TENSOR_MAP_SWIZZLE_128B, CU_TENSOR_MAP_L2_PROMOTION_L2_256B,
                                 CU_TENSOR_MAP_FLOAT_OOB_FILL_NONE));
    return map;
}

__global__ void fill_random(__nv_bfloat16 *x, long long count, unsigned seed) {
    for (long long i = blockIdx.x * (long long)blockDim.x + threadIdx.x; i < count;
         i += (long long)gridDim.x * blockDim.x) {
        unsigned h = (unsigned)i * 2654435761u ^ seed;
        h ^= h >> 15; h *= 2246822519u; h ^= h >> 13; h *= 3266489917u; h ^= h >> 16;
        x[i] = __float2bfloat16((h & 0xFFFF) / 32768.f - 1.f);
    }
}

cudaStream_t stream = 0;  // the stream launches go to (a capture's, while timing)

// A launch of `ctas` CTAs of the kernel in clusters of S (the attribute lives beside the config,
// which points at it).
template <int S> struct ClusterLaunch {
    cudaLaunchConfig_t cfg = {};
    cudaLaunchAttribute attr[1];
    explicit ClusterLaunch(int ctas) {
        cfg.gridDim = dim3(ctas);
        cfg.blockDim = dim3(THREADS);
        cfg.dynamicSmemBytes = SMEM_BYTES;
        cfg.stream = stream;
        attr[0].id = cudaLaunchAttributeClusterDimension;
        attr[0].val.clusterDim.x = S;
        attr[0].val.clusterDim.y = 1;
        attr[0].val.clusterDim.z = 1;
        cfg.attrs = attr;
        cfg.numAttrs = 1;
    }
};

template <int S>
void launch(const unsigned long long tmaps, __nv_bfloat16 *c, int m, int n, int k) {
    const int tiles_n = (n + BN - 1) / BN, tiles = ((m + BM - 1) / BM) * tiles_n;
    ClusterLaunch<S> l(tiles * S);
    CHECK(cudaLaunchKernelEx(&l.cfg, cluster_split_gemm<S>, tmaps, c, m, n, k / BK / S, tiles_n));
}

template <int S> int max_clusters() {
    CHECK(cudaFuncSetAttribute(cluster_split_gemm<S>, cudaFuncAttributeMaxDynamicSharedMemorySize,
                               SMEM_BYTES));
    ClusterLaunch<S> l(S * 64);
    int count = 0;
    CHECK(cudaOccupancyMaxActiveClusters(&count, cluster_split_gemm<S>, &l.cfg));
    return count;
}

void run_ours(int s, const unsigned long long tmaps, __nv_bfloat16 *c, int m, int n, int k) {
    switch (s) {
        case 1: launch<1>(tmaps, c, m, n, k); break;
        case 2: launch<2>(tmaps, c, m, n, k); break;
        case 4: launch<4>(tmaps, c, m, n, k); break;
        case 8: launch<8>(tmaps, c, m, n, k); break;
        default: fprintf(stderr, "S must be 1, 2, 4 or 8\n"); exit(2);
    }
}

}  // namespace

int main(int argc, char **argv) {
    if (argc < 5 || (argc - 1) % 4) {
        fprintf(stderr, "usage: %s M N K S [M N K S ...]\n", argv[0]);
        return 2;
    }
    CHECK(cudaFree(0));
    const int fits[4] = {max_clusters<1>(), max_clusters<2>(), max_clusters<4>(), max_clusters<8>()};
    cublasHandle_t handle;
    CHECK(cublasCreate(&handle));
    cudaEvent_t e0, e1;
    CHECK(cudaEventCreate(&e0));
    CHECK(cudaEventCreate(&e1));
    for (int arg = 1; arg < argc; arg += 4) {
        const int m = atoi(argv[arg]), n = atoi(argv[arg + 1]), k = atoi(argv[arg + 2]),
                  s = atoi(argv[arg + 3]);
        if (m % BM || n % BN || k % (BK * s)) {
            fprintf(stderr, "skip %dx%dx%d S=%d: whole tiles and slices only\n", m, n, k, s);
            continue;
        }
        __nv_bfloat16 *a, *b, *c, *ref;
        CHECK(cudaMalloc(&a, (size_t)m * k * 2));
        CHECK(cudaMalloc(&b, (size_t)n * k * 2));
        CHECK(cudaMalloc(&c, (size_t)m * n * 2));
        CHECK(cudaMalloc(&ref, (size_t)m * n * 2));
        fill_random<<<1024, 256>>>(a, (long long)m * k, 1234u + arg);
        fill_random<<<1024, 256>>>(b, (long long)n * k, 99u + arg);
        CHECK(cudaMemset(c, 0xFF, (size_t)m * n * 2));  // poison: NaNs where nothing is written
        CUtensorMap maps[2] = {encode(a, m, k, BM), encode(b, n, k, BN)};
        unsigned long long *tm;
        CHECK(cudaMalloc(&tm, sizeof(maps)));
        CHECK(cudaMemcpy(tm, maps, sizeof(maps), cudaMemcpyHostToDevice));
        const float one = 1.f, zero = 0.f;
        auto cublas = [&]() {
            CHECK(cublasGemmEx(handle, CUBLAS_OP_T, CUBLAS_OP_N, n, m, k, &one, b, CUDA_R_16BF, k,
                               a, CUDA_R_16BF, k, &zero, ref, CUDA_R_16BF, n, CUBLAS_COMPUTE_32F,
                               CUBLAS_GEMM_DEFAULT));
        };
        auto ours = [&]() { run_ours(s, (unsigned long long)tm, c, m, n, k); };
        ours();
        cublas();
        CHECK(cudaDeviceSynchronize());
        CHECK(cudaGetLastError());
        // error of ours against cuBLAS's output
        std::vector<unsigned short> hc((size_t)m * n), hr((size_t)m * n);
        CHECK(cudaMemcpy(hc.data(), c, hc.size() * 2, cudaMemcpyDeviceToHost));
        CHECK(cudaMemcpy(hr.data(), ref, hr.size() * 2, cudaMemcpyDeviceToHost));
        auto f32 = [](unsigned short h) {
            unsigned u = (unsigned)h << 16;
            float f;
            memcpy(&f, &u, 4);
            return f;
        };
        double maxdiff = 0, maxref = 0;
        for (size_t i = 0; i < hc.size(); ++i) {
            const double x = f32(hc[i]), y = f32(hr[i]);
            maxdiff = std::max(maxdiff, x == x ? std::fabs(x - y) : 1e30);
            maxref = std::max(maxref, std::fabs(y));
        }
        // timing: a CUDA graph of `reps` launches each (the GPU's time, not the host's launch
        // rate), replayed in rounds, ours and cuBLAS alternating
        const int reps = 20, rounds = 7;
        cudaStream_t st;
        CHECK(cudaStreamCreateWithFlags(&st, cudaStreamNonBlocking));
        CHECK(cublasSetStream(handle, st));
        auto capture = [&](auto fn) {
            cudaGraph_t g;
            cudaGraphExec_t x;
            CHECK(cudaStreamBeginCapture(st, cudaStreamCaptureModeThreadLocal));
            for (int i = 0; i < reps; ++i) fn();
            CHECK(cudaStreamEndCapture(st, &g));
            CHECK(cudaGraphInstantiate(&x, g, 0));
            CHECK(cudaGraphDestroy(g));
            return x;
        };
        stream = st;
        cudaGraphExec_t go = capture(ours), gb = capture(cublas);
        std::vector<float> to, tb;
        for (int w = 0; w < 2; ++w) {
            CHECK(cudaGraphLaunch(go, st));
            CHECK(cudaGraphLaunch(gb, st));
        }
        for (int rd = 0; rd < rounds; ++rd) {
            for (int which = 0; which < 2; ++which) {
                float ms;
                CHECK(cudaEventRecord(e0, st));
                CHECK(cudaGraphLaunch(which ? gb : go, st));
                CHECK(cudaEventRecord(e1, st));
                CHECK(cudaEventSynchronize(e1));
                CHECK(cudaEventElapsedTime(&ms, e0, e1));
                (which ? tb : to).push_back(ms * 1000 / reps);
            }
        }
        CHECK(cudaGraphExecDestroy(go));
        CHECK(cudaGraphExecDestroy(gb));
        CHECK(cublasSetStream(handle, 0));
        stream = 0;
        CHECK(cudaStreamDestroy(st));
        std::sort(to.begin(), to.end());
        std::sort(tb.begin(), tb.end());
        const int fit = fits[s == 1 ? 0 : s == 2 ? 1 : s == 4 ? 2 : 3];
        printf("{\"kernel\": \"gemm_cluster_split_probe\", \"shape\": {\"m\": %d, \"n\": %d, "
               "\"k\": %d}, \"slices\": %d, \"ctas\": %d, \"max_active_clusters\": %d, "
               "\"ours_us\": %.3f, \"cublas_us\": %.3f, \"speedup\": %.4f, \"rel_err\": %.3e}\n",
               m, n, k, s, (m / BM) * (n / BN) * s, fit, to[rounds / 2], tb[rounds / 2],
               tb[rounds / 2] / to[rounds / 2], maxdiff / maxref);
        fflush(stdout);
        CHECK(cudaFree(a));
        CHECK(cudaFree(b));
        CHECK(cudaFree(c));
        CHECK(cudaFree(ref));
        CHECK(cudaFree(tm));
    }
    return 0;
}
