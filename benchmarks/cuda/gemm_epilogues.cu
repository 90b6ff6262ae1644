// The library's Hopper GEMM tile (mknumba/roles/cuda/gemm_tile.cu) with the epilogues that
// benchmarks/probe_gemm_tile.py times against its own (``store_warp_rows``, 2 KB of staging per
// warp), chosen by PROBE_EPILOGUE:
//   0  straight from the accumulator layout: 4-byte stores, each warp store touching 8 rows
//      (the first epilogue; on an H200 it cost 6.3 us per tile against the staged one's 0.8)
//   1  none (timing only: the output is left unwritten)
// compute.linked_source pastes the library's files named below (they are not beside this one).
// The staging stays allocated (unused) so that the ring's layout is the library's.

#include "gemm_common.cuh"

namespace {

// store_warp_rows' arguments and contract, 4-byte stores straight from the accumulators:
// thread (lane) holds rows row0 + lane / 4 (+8), columns 8j + 2 (lane % 4) (+1) (sm90.cuh)
template <int N>
__device__ __forceinline__ void store_direct(const float (&d)[N], unsigned stage, int lane,
                                             __nv_bfloat16 *out, int ldc, int row0, int col0,
                                             int m, int n, unsigned long long addend, int adds,
                                             long long plane_elems) {
#pragma unroll
    for (int j = 0; j < N / 8; ++j) {
        const int col = col0 + 2 * (lane % 4) + 8 * j;
#pragma unroll
        for (int h = 0; h < 2; ++h) {
            const int row = row0 + lane / 4 + 8 * h;
            if (row < m && col < n) {  // n is even (the op checks), so col + 1 < n as well
                unsigned w = pack_bf16x2(d[4 * j + 2 * h], d[4 * j + 2 * h + 1]);
                if (adds > 0) w = add_planes(w, addend, adds, plane_elems, (long long)row * n + col);
                *(unsigned *)(out + (long long)row * ldc + col) = w;
            }
        }
    }
}

template <int N>
__device__ __forceinline__ void store_none(const float (&)[N], unsigned, int, __nv_bfloat16 *,
                                           int, int, int, int, int, unsigned long long, int,
                                           long long) {}

}  // namespace

#if PROBE_EPILOGUE == 0
#define store_warp_rows store_direct
#elif PROBE_EPILOGUE == 1
#define store_warp_rows store_none
#else
#error "PROBE_EPILOGUE must be 0 or 1"
#endif

#include "gemm_tile.cu"
