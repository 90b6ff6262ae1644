// What the standalone GEMM probes (gemm_cluster_split.cu, gemm_multicast64.cu) share: error
// checks, the operands' tensor maps and random fill, cluster launches, and the comparison with
// cuBLAS.
//
// compare_with_cublas runs a probe's kernel and cublasGemmEx (bf16 in and out, fp32 compute:
// what torch.matmul runs) on the same operands once, measures the relative error of ours
// against cuBLAS's output (max |diff| / max |ref|; a NaN left in the poisoned output counts as
// 1e30), then times each as a CUDA graph of 20 launches (the GPU's time, not the host's launch
// rate), replayed in 7 alternating rounds: the median per call.
#pragma once
#include <cuda.h>
#include <cuda_runtime.h>
#include <cublas_v2.h>

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <vector>

#define CHECK(x)                                                                          \
    do {                                                                                  \
        auto e_ = (x);                                                                    \
        if (e_ != 0) {                                                                    \
            fprintf(stderr, "%s:%d %s failed: %d\n", __FILE__, __LINE__, #x, (int)e_);    \
            exit(1);                                                                      \
        }                                                                                 \
    } while (0)

namespace probe {

// ---- thread-block clusters
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

// a row-major bf16 [rows, cols] matrix read in boxes of 64 columns x box_rows rows, 128B swizzle
// PROMO: the maps' L2 promotion, 256 (the library's), 128 or 0 (none)
#ifndef PROMO
#define PROMO 256
#endif
inline CUtensorMap encode(void *ptr, int rows, int cols, int box_rows) {
    CUtensorMap map;
    cuuint64_t dims[2] = {(cuuint64_t)cols, (cuuint64_t)rows};
    cuuint64_t strides[1] = {(cuuint64_t)cols * 2};
    cuuint32_t box[2] = {64, (cuuint32_t)box_rows}, elem[2] = {1, 1};
    CHECK(cuTensorMapEncodeTiled(&map, CU_TENSOR_MAP_DATA_TYPE_BFLOAT16, 2, ptr, dims, strides,
                                 box, elem, CU_TENSOR_MAP_INTERLEAVE_NONE,
                                 CU_TENSOR_MAP_SWIZZLE_128B,
                                 PROMO == 256   ? CU_TENSOR_MAP_L2_PROMOTION_L2_256B
                                 : PROMO == 128 ? CU_TENSOR_MAP_L2_PROMOTION_L2_128B
                                                : CU_TENSOR_MAP_L2_PROMOTION_NONE,
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

// A launch of ``ctas`` CTAs in clusters of ``cluster`` along x (the attribute lives beside the
// config, which points at it: pass ``cfg`` to cudaLaunchKernelEx while this object lives).
struct ClusterLaunch {
    cudaLaunchConfig_t cfg = {};
    cudaLaunchAttribute attr[1];
    ClusterLaunch(int ctas, int threads, unsigned smem, int cluster, cudaStream_t stream) {
        cfg.gridDim = dim3(ctas);
        cfg.blockDim = dim3(threads);
        cfg.dynamicSmemBytes = smem;
        cfg.stream = stream;
        attr[0].id = cudaLaunchAttributeClusterDimension;
        attr[0].val.clusterDim.x = cluster;
        attr[0].val.clusterDim.y = 1;
        attr[0].val.clusterDim.z = 1;
        cfg.attrs = attr;
        cfg.numAttrs = 1;
    }
};

// The command line as runs of ``width`` integers each; exits with the usage line when it does
// not split into whole runs. A run's ``first`` is its first argument's index (a seed).
struct ArgRun {
    int first;
    std::vector<int> v;
};
inline std::vector<ArgRun> arg_runs(int argc, char **argv, int width, const char *usage) {
    if (argc < width + 1 || (argc - 1) % width) {
        fprintf(stderr, "usage: %s %s\n", argv[0], usage);
        exit(2);
    }
    std::vector<ArgRun> runs;
    for (int arg = 1; arg < argc; arg += width) {
        ArgRun r{arg, {}};
        for (int i = 0; i < width; ++i) r.v.push_back(atoi(argv[arg + i]));
        runs.push_back(r);
    }
    return runs;
}

// An A map and a B map in device memory, where the kernels read them; freed with the object.
struct DeviceMaps {
    unsigned long long addr;
    explicit DeviceMaps(const CUtensorMap (&maps)[2]) {
        void *p;
        CHECK(cudaMalloc(&p, sizeof(maps)));
        CHECK(cudaMemcpy(p, maps, sizeof(maps), cudaMemcpyHostToDevice));
        addr = (unsigned long long)p;
    }
    ~DeviceMaps() { CHECK(cudaFree((void *)addr)); }
    DeviceMaps(const DeviceMaps &) = delete;
    DeviceMaps &operator=(const DeviceMaps &) = delete;
};

// A [m, k] and B [n, k] filled at random, C poisoned (NaN), cuBLAS's output beside it.
struct Operands {
    __nv_bfloat16 *a, *b, *c, *ref;
    Operands(int m, int n, int k, unsigned seed) {
        CHECK(cudaMalloc(&a, (size_t)m * k * 2));
        CHECK(cudaMalloc(&b, (size_t)n * k * 2));
        CHECK(cudaMalloc(&c, (size_t)m * n * 2));
        CHECK(cudaMalloc(&ref, (size_t)m * n * 2));
        fill_random<<<1024, 256>>>(a, (long long)m * k, 1234u + seed);
        fill_random<<<1024, 256>>>(b, (long long)n * k, 99u + seed);
        CHECK(cudaMemset(c, 0xFF, (size_t)m * n * 2));
    }
    ~Operands() {
        CHECK(cudaFree(a));
        CHECK(cudaFree(b));
        CHECK(cudaFree(c));
        CHECK(cudaFree(ref));
    }
};

struct Result {
    float ours_us, cublas_us;
    double rel_err;
};

// ``ours(stream)`` launches the probe's kernel on ``stream`` (a capture's while timing).
template <class Ours>
Result compare_with_cublas(cublasHandle_t handle, const Operands &x, int m, int n, int k,
                           Ours ours) {
    const float one = 1.f, zero = 0.f;
    auto cublas = [&](cudaStream_t) {
        CHECK(cublasGemmEx(handle, CUBLAS_OP_T, CUBLAS_OP_N, n, m, k, &one, x.b, CUDA_R_16BF, k,
                           x.a, CUDA_R_16BF, k, &zero, x.ref, CUDA_R_16BF, n, CUBLAS_COMPUTE_32F,
                           CUBLAS_GEMM_DEFAULT));
    };
    ours((cudaStream_t)0);
    cublas((cudaStream_t)0);
    CHECK(cudaDeviceSynchronize());
    CHECK(cudaGetLastError());
    std::vector<unsigned short> hc((size_t)m * n), hr((size_t)m * n);
    CHECK(cudaMemcpy(hc.data(), x.c, hc.size() * 2, cudaMemcpyDeviceToHost));
    CHECK(cudaMemcpy(hr.data(), x.ref, hr.size() * 2, cudaMemcpyDeviceToHost));
    auto f32 = [](unsigned short h) {
        unsigned u = (unsigned)h << 16;
        float f;
        memcpy(&f, &u, 4);
        return f;
    };
    double maxdiff = 0, maxref = 0;
    for (size_t i = 0; i < hc.size(); ++i) {
        const double p = f32(hc[i]), q = f32(hr[i]);
        maxdiff = std::max(maxdiff, p == p ? std::fabs(p - q) : 1e30);
        maxref = std::max(maxref, std::fabs(q));
    }
    const int reps = 20, rounds = 7;
    cudaStream_t st;
    CHECK(cudaStreamCreateWithFlags(&st, cudaStreamNonBlocking));
    CHECK(cublasSetStream(handle, st));
    auto capture = [&](auto fn) {
        cudaGraph_t g;
        cudaGraphExec_t exec;
        CHECK(cudaStreamBeginCapture(st, cudaStreamCaptureModeThreadLocal));
        for (int i = 0; i < reps; ++i) fn(st);
        CHECK(cudaStreamEndCapture(st, &g));
        CHECK(cudaGraphInstantiate(&exec, g, 0));
        CHECK(cudaGraphDestroy(g));
        return exec;
    };
    cudaGraphExec_t go = capture(ours), gb = capture(cublas);
    cudaEvent_t e0, e1;
    CHECK(cudaEventCreate(&e0));
    CHECK(cudaEventCreate(&e1));
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
    CHECK(cudaEventDestroy(e0));
    CHECK(cudaEventDestroy(e1));
    CHECK(cublasSetStream(handle, 0));
    CHECK(cudaStreamDestroy(st));
    std::sort(to.begin(), to.end());
    std::sort(tb.begin(), tb.end());
    return Result{to[rounds / 2], tb[rounds / 2], maxdiff / maxref};
}

}  // namespace probe
