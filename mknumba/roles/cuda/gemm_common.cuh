// What the Hopper GEMM tiles (gemm_tile.cu, gemm_pingpong.cu) share after their main loops:
// folding partials in (add_planes, add_planes_v4; a split-K fold's band: fold_planes), the staged
// epilogue (store_warp_rows) and the swizzled stmatrix of 64 accumulator columns that it and
// the tensor-store epilogue (gemm_tile.cu, MK_TMA_STORE) share (stmatrix_chunk).
#pragma once
#include "sm90.cuh"

// Probe hooks: benchmarks/cuda/gemm_stamps.cu defines them to record a timeline of the tile
// (benchmarks/probe_gemm_stamps.py); by default they are nothing or the plain call, so the
// library's builds compile to the same code as without them.
//   MK_STAMP(event, item, step): a point of the timeline; ``event`` a bare name only the probe
//     knows, ``item`` the block's tile number (seq), ``step`` the k-step where it has one.
//   MK_FULL_WAIT(bar, phase, item, step): a consumer's wait for k-step ``step``'s data.
#ifndef MK_STAMP
#define MK_STAMP(event, item, step)
#endif
#ifndef MK_FULL_WAIT
#define MK_FULL_WAIT(bar, phase, item, step) mbar_wait(bar, phase)
#endif

namespace {

// bytes of staging per warp: 16 rows x 64 bf16, one 64-column chunk of the warp's rows
constexpr unsigned WARP_STAGING = 16 * 128;

// The shared-space address of a block's dynamic shared memory, rounded up to 1024 bytes (the
// 128B swizzle repeats every 1024 B, and the ring's slots start there).
__device__ __forceinline__ unsigned ring_base(unsigned long long smem_generic) {
    const unsigned base = (unsigned)__cvta_generic_to_shared((void *)smem_generic);
    return (base + 1023u) & ~1023u;
}

// Thread 0, once per block: the ring's mbarriers (full[s]: the producer's one arrival and the
// copies' bytes; empty[s]: empty_count arrivals per use, 8 bytes apart) and a prefetch of the
// two tensor maps. The caller initialises its other barriers, then runs mbar_init_fence().
template <int STAGES>
__device__ __forceinline__ void init_ring(unsigned full, unsigned empty, unsigned empty_count,
                                          unsigned long long tmaps) {
    for (int s = 0; s < STAGES; ++s) {
        mbar_init(full + 8 * s, 1);
        mbar_init(empty + 8 * s, empty_count);
    }
    prefetch_tensormap(tmaps);
    prefetch_tensormap(tmaps + 128);
}

// Whether B [K, N] comes in one copy per k-step (a 3-d tensor map) rather than one per 64-column
// panel: the host's twin, kernels/gemm_inputs.py kn_one_copy, encodes the map of that rank.
__device__ __forceinline__ bool b_kn_one_copy(int n) { return n % 64 == 0; }

// The producer's part of one tile (one lane calls it): k-steps g0 .. g0 + k_iters - 1 of the
// block's ring of STAGES slots, k-step g in slot g % STAGES, whose mbarriers full and empty
// (8 bytes apart per slot) complete once per use, so g / STAGES gives the phase. Slot s holds A
// (BM rows x 64 k, box 64 x BM of tmaps) at a_ring + s * BM * 128 and B at b_ring + s * BN * 128:
//   B_KN 0  B [N, K]: one box 64 (k) x BN (rows of B), K-major like A;
//   B_KN 1  B [K, N]: BN / 64 boxes 64 (N) x 64 (k) side by side, 8 KB apart, each a 64-column
//           panel of MN-major B (smem_desc_mn). Where N is a whole number of panels
//           (b_kn_one_copy) one 3-d copy lands them all (the map sees B as 64 columns x K rows
//           x N / 64 panels; panels past N read as zeros and count toward the bytes); else one
//           copy per panel, and boxes wholly past column n are not loaded (their columns of
//           the accumulator are never stored).
template <int BM, int BN, int STAGES, int B_KN>
__device__ __forceinline__ void produce_tile(unsigned a_ring, unsigned b_ring, unsigned full,
                                             unsigned empty, unsigned long long tmaps, int n,
                                             int tile_m, int tile_n, int k_iters, unsigned g0) {
    constexpr unsigned A_BYTES = BM * 128, B_BYTES = BN * 128, B_BOX_BYTES = 64 * 128;
    for (int kk = 0; kk < k_iters; ++kk) {
        const unsigned g = g0 + kk, s = g % STAGES, phase = (g / STAGES) & 1;
        mbar_wait(empty + 8 * s, phase ^ 1);  // slot free (a fresh barrier passes)
        MK_STAMP(slot_free, g0 / k_iters, kk);
        const int n0 = tile_n * BN;
        const bool per_panel = B_KN && !b_kn_one_copy(n);
        const int boxes = per_panel ? min(BN / 64, (n - n0 + 63) / 64) : 0;
        mbar_expect_tx(full + 8 * s, A_BYTES + (per_panel ? boxes * B_BOX_BYTES : B_BYTES));
        tma_load_2d(a_ring + s * A_BYTES, tmaps, kk * 64, tile_m * BM, full + 8 * s);
        if (per_panel) {
            for (int j = 0; j < boxes; ++j)
                tma_load_2d(b_ring + s * B_BYTES + j * B_BOX_BYTES, tmaps + 128, n0 + 64 * j,
                            kk * 64, full + 8 * s);
        } else if (B_KN) {  // the k-step's BN / 64 panels in one 3-d copy
            tma_load_3d(b_ring + s * B_BYTES, tmaps + 128, 0, kk * 64, tile_n * (BN / 64),
                        full + 8 * s);
        } else {
            tma_load_2d(b_ring + s * B_BYTES, tmaps + 128, kk * 64, n0, full + 8 * s);
        }
    }
}

// Folded partials (the fused ReduceScatter's owner, see compute.py): the word w of bf16x2 at
// element offset off, plus the same word of planes 1..adds of ``addend`` (planes of plane_elems
// elements). One plane: a packed add (the exact sum, rounded once); more: fp32, rounded once.
// Plain loads: the calling thread has acquired each plane's flag itself.
__device__ __forceinline__ unsigned add_planes(unsigned w, unsigned long long addend, int adds,
                                               long long plane_elems, long long off) {
    const __nv_bfloat16 *base = (const __nv_bfloat16 *)addend + off;
    __nv_bfloat162 v = *reinterpret_cast<__nv_bfloat162 *>(&w);
    if (adds == 1) {
        v = __hadd2(v, *(const __nv_bfloat162 *)(base + plane_elems));
    } else {
        float2 f = __bfloat1622float2(v);
        for (int p = 1; p <= adds; ++p) {
            const float2 x = __bfloat1622float2(*(const __nv_bfloat162 *)(base + p * plane_elems));
            f.x += x.x;
            f.y += x.y;
        }
        v = __floats2bfloat162_rn(f.x, f.y);
    }
    return *reinterpret_cast<unsigned *>(&v);
}

// 16 bytes of global memory through L2 only (ld.global.cg): partials that another block or GPU
// wrote during this kernel, behind a flag the calling thread acquired. Volatile: never hoisted
// above that acquire; the loads of a batch still issue back to back (nothing waits for one
// until its value is used).
__device__ __forceinline__ uint4 ld_global_cg_v4(const void *p) {
    uint4 v;
    asm volatile("ld.global.cg.v4.u32 {%0, %1, %2, %3}, [%4];"
                 : "=r"(v.x), "=r"(v.y), "=r"(v.z), "=r"(v.w) : "l"(p));
    return v;
}

// f[0..7] += the 8 bf16 of x (x.x's low half first: element order in memory)
__device__ __forceinline__ void add_bf16x8(float (&f)[8], uint4 x) {
    const unsigned w[4] = {x.x, x.y, x.z, x.w};
#pragma unroll
    for (int i = 0; i < 4; ++i) {
        f[2 * i] += __uint_as_float(w[i] << 16);
        f[2 * i + 1] += __uint_as_float(w[i] & 0xFFFF0000u);
    }
}

__device__ __forceinline__ uint4 pack_bf16x8(const float (&f)[8]) {
    return make_uint4(pack_bf16x2(f[0], f[1]), pack_bf16x2(f[2], f[3]), pack_bf16x2(f[4], f[5]),
                      pack_bf16x2(f[6], f[7]));
}

// add_planes for 8 bf16 (16 bytes, 16-byte aligned): one 16-byte load per plane, up to four
// planes' loads in flight before the first is added (one memory round trip per four planes,
// not one per plane and element pair).
__device__ __forceinline__ uint4 add_planes_v4(uint4 v, unsigned long long addend, int adds,
                                               long long plane_elems, long long off) {
    const __nv_bfloat16 *base = (const __nv_bfloat16 *)addend + off;
    if (adds == 1) {
        const uint4 x = *(const uint4 *)(base + plane_elems);
        unsigned w[4] = {v.x, v.y, v.z, v.w};
        const unsigned xw[4] = {x.x, x.y, x.z, x.w};
#pragma unroll
        for (int i = 0; i < 4; ++i) {
            __nv_bfloat162 s = __hadd2(*reinterpret_cast<__nv_bfloat162 *>(&w[i]),
                                       *reinterpret_cast<const __nv_bfloat162 *>(&xw[i]));
            w[i] = *reinterpret_cast<unsigned *>(&s);
        }
        return make_uint4(w[0], w[1], w[2], w[3]);
    }
    float f[8] = {0.f, 0.f, 0.f, 0.f, 0.f, 0.f, 0.f, 0.f};
    add_bf16x8(f, v);
#pragma unroll 1
    for (int p = 1; p <= adds; p += 4) {
        uint4 x[4];
#pragma unroll
        for (int q = 0; q < 4; ++q)
            x[q] = p + q <= adds ? ld_global_cg_v4(base + (p + q) * plane_elems)
                                 : make_uint4(0, 0, 0, 0);
#pragma unroll
        for (int q = 0; q < 4; ++q) add_bf16x8(f, x[q]);
    }
    return pack_bf16x8(f);
}

// A split-K fold's band of rows (kernels/gemm/: a sum of partials only, no K of its own, so no
// product to add them to): rows [row0, row0 + rows) and columns [col0, +BN) bounded by n :=
// planes 1..adds of ``addend`` ([P, m, n], plane_elems apart) summed in fp32, rounded once, into
// ``out`` (its first row is row0, ldc elements per row). Threads tid < THREADS each take one
// column of 8 elements (16 bytes; a warp covers 512 contiguous bytes of a row) in every
// THREADS / (BN / 8)-th row, V rows and P planes at a time: V * P 16-byte loads in flight per
// thread before the first add. (The accumulator epilogue's add_planes_v4 waits for memory once per
// 16 bytes it stores: 16 dependent round trips per thread and batch of planes; here rows / (STEP
// * V) per P planes: one for a band of 16 rows and up to 8 planes.)
template <int BN, int THREADS>
__device__ __forceinline__ void fold_planes(__nv_bfloat16 *out, int ldc,
                                            unsigned long long addend, int adds,
                                            long long plane_elems, int row0, int rows, int col0,
                                            int n, int tid) {
    constexpr int PER_ROW = BN / 8, STEP = THREADS / PER_ROW;
    // 16 loads in flight, as many as the split kernel's registers (capped at 168 by 288
    // threads) held without a spill in the tile's fold before this one
    constexpr int V = 2, P = 8;
    static_assert(THREADS % PER_ROW == 0, "whole rows");
    const int col = col0 + 8 * (tid % PER_ROW);
    if (col >= n) return;  // n is a multiple of 8 (the op checks): 8 columns fit or none
    const __nv_bfloat16 *src = (const __nv_bfloat16 *)addend + plane_elems + col;
#pragma unroll 1
    for (int r = tid / PER_ROW; r < rows; r += STEP * V) {  // rows r, r + STEP, ... of the band
        float f[V][8];
#pragma unroll
        for (int v = 0; v < V; ++v)
#pragma unroll
            for (int i = 0; i < 8; ++i) f[v][i] = 0.f;
#pragma unroll 1
        for (int p = 0; p < adds; p += P) {
            uint4 x[P][V];
#pragma unroll
            for (int q = 0; q < P; ++q)
#pragma unroll
                for (int v = 0; v < V; ++v)
                    x[q][v] = r + STEP * v < rows && p + q < adds
                                  ? ld_global_cg_v4(src + (p + q) * plane_elems +
                                                    (long long)(row0 + r + STEP * v) * n)
                                  : make_uint4(0, 0, 0, 0);
#pragma unroll
            for (int q = 0; q < P; ++q)
#pragma unroll
                for (int v = 0; v < V; ++v) add_bf16x8(f[v], x[q][v]);
        }
#pragma unroll
        for (int v = 0; v < V; ++v)
            if (r + STEP * v < rows)
                *(uint4 *)(out + (long long)(r + STEP * v) * ldc + col) = pack_bf16x8(f[v]);
    }
}

// Four 8 x 8 bf16 matrices into shared memory: lane l gives the address of row l % 8 of matrix
// l / 8; register i holds this thread's fragment of matrix i (row lane / 4, columns 2 (lane % 4)
// and +1: the accumulator layout of one 8-column group).
__device__ __forceinline__ void stmatrix_x4(unsigned addr, unsigned r0, unsigned r1, unsigned r2,
                                            unsigned r3) {
    asm volatile("stmatrix.sync.aligned.m8n8.x4.shared.b16 [%0], {%1, %2, %3, %4};" ::"r"(addr),
                 "r"(r0), "r"(r1), "r"(r2), "r"(r3)
                 : "memory");
}

// Columns [64 cc, 64 cc + 64) of one warp's 16 rows of an m64nNk16 accumulator (d: N / 2 floats
// per thread, the layout in sm90.cuh) as bf16 into 16 rows of 128 B from ``stage``, 16-byte
// units swizzled by row % 8, so that neither stmatrix nor reads of whole rows conflict. With
// ``stage`` on a 1024-byte boundary this is the layout a 16-row x 64-column box of a tensor map
// with the 128B swizzle has in shared memory (the swizzle XORs address bits 4-6 with bits 7-9).
// mat, mrow: lane / 8 and lane % 8, the matrix row this lane gives the address of.
template <int N>
__device__ __forceinline__ void stmatrix_chunk(const float (&d)[N], int cc, unsigned stage,
                                               int mat, int mrow) {
#pragma unroll
    for (int p = 0; p < 4; ++p) {
        // matrices (8-column group, row half): (2p, 0), (2p, 1), (2p + 1, 0), (2p + 1, 1)
        const int j = 8 * cc + 2 * p;
        const int unit = 2 * p + mat / 2, row = 8 * (mat % 2) + mrow;
        stmatrix_x4(stage + row * 128 + ((unit ^ mrow) * 16), pack_bf16x2(d[4 * j], d[4 * j + 1]),
                    pack_bf16x2(d[4 * j + 2], d[4 * j + 3]),
                    pack_bf16x2(d[4 * j + 4], d[4 * j + 5]),
                    pack_bf16x2(d[4 * j + 6], d[4 * j + 7]));
    }
}

// One warp's 16 rows of an m64nNk16 accumulator (d: N / 2 floats per thread, the layout in
// sm90.cuh) to global rows row0.. and columns col0.. of ``out`` (indexed by global row, ldc
// elements per row), bounded by m and n, with ``adds`` planes of ``addend`` ([P, m, n]) folded
// in. They leave in 64-column chunks through ``stage``, the warp's WARP_STAGING bytes:
// stmatrix_chunk, then 16-byte loads and stores that cover whole 128-byte rows (a quarter of the
// store instructions of storing the accumulator layout as it is, no half-written sectors).
template <int N>
__device__ __forceinline__ void store_warp_rows(const float (&d)[N], unsigned stage, int lane,
                                                __nv_bfloat16 *out, int ldc, int row0, int col0,
                                                int m, int n, unsigned long long addend,
                                                int adds, long long plane_elems) {
    const int mat = lane / 8, mrow = lane % 8;
#pragma unroll
    for (int cc = 0; cc < N / 32; ++cc) {
        stmatrix_chunk(d, cc, stage, mat, mrow);
        __syncwarp();
#pragma unroll
        for (int it = 0; it < 4; ++it) {  // 8 lanes per row: each warp store covers 4 rows
            const int row = 4 * it + lane / 8, unit = lane % 8;
            uint4 v = ld_shared_v4(stage + row * 128 + ((unit ^ (row % 8)) * 16));
            const int grow = row0 + row, gcol = col0 + 64 * cc + 8 * unit;
            if (grow < m && gcol < n) {  // n is a multiple of 8 (the op checks): 8 columns fit
                if (adds > 0)
                    v = add_planes_v4(v, addend, adds, plane_elems, (long long)grow * n + gcol);
                *(uint4 *)(out + (long long)grow * ldc + gcol) = v;
            }
        }
        __syncwarp();  // the chunk is read before the next one overwrites it
    }
}

}  // namespace
