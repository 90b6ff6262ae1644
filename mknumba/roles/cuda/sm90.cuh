// Hopper (sm_90a) building blocks shared by the linked tiles (gemm_tile.cu, attention_tile.cu):
// mbarriers, bulk tensor copies (TMA), wgmma and its shared-memory descriptors.
// A tile's source names this file in an #include line; compute.linked_source pastes it in
// (NVRTC, as numba drives it, searches no directory of ours).
#pragma once
#include <cuda_bf16.h>

#pragma nv_diag_suppress 177  // a tile uses some of these helpers, not all

namespace {

// ---- mbarrier ------------------------------------------------------------------------------
__device__ __forceinline__ void mbar_init(unsigned bar, unsigned count) {
    asm volatile("mbarrier.init.shared::cta.b64 [%0], %1;" ::"r"(bar), "r"(count) : "memory");
}

// Before a barrier's location is initialised again (PTX ISA: mbarrier.init on a valid object is
// undefined), once no thread waits on it and no arrival or transaction is pending.
__device__ __forceinline__ void mbar_inval(unsigned bar) {
    asm volatile("mbarrier.inval.shared::cta.b64 [%0];" ::"r"(bar) : "memory");
}

__device__ __forceinline__ void mbar_wait(unsigned bar, unsigned phase) {
    unsigned done;
    do {
        asm volatile("{ .reg .pred p;\n"
                     "  mbarrier.try_wait.parity.shared::cta.b64 p, [%1], %2;\n"
                     "  selp.u32 %0, 1, 0, p; }"
                     : "=r"(done) : "r"(bar), "r"(phase) : "memory");
    } while (!done);
}

__device__ __forceinline__ void mbar_arrive(unsigned bar) {
    asm volatile("mbarrier.arrive.shared::cta.b64 _, [%0];" ::"r"(bar) : "memory");
}

__device__ __forceinline__ void mbar_expect_tx(unsigned bar, unsigned bytes) {
    asm volatile("mbarrier.arrive.expect_tx.shared::cta.b64 _, [%0], %1;" ::"r"(bar), "r"(bytes)
                 : "memory");
}

// After thread 0 initialised a block's barriers (the caller then syncs the block).
__device__ __forceinline__ void mbar_init_fence() {
    asm volatile("fence.mbarrier_init.release.cluster;" ::: "memory");
}

// ---- bulk tensor copy: one box of a tensor map into shared memory ----------------------------
// Out-of-range parts of the box are filled with zeros and still count toward complete_tx, so
// ragged edges need no special case in the main loops.
__device__ __forceinline__ void tma_load_2d(unsigned dst, unsigned long long tmap, int inner,
                                            int outer, unsigned bar) {
    asm volatile(
        "cp.async.bulk.tensor.2d.shared::cluster.global.mbarrier::complete_tx::bytes"
        " [%0], [%1, {%2, %3}], [%4];" ::"r"(dst), "l"(tmap), "r"(inner), "r"(outer), "r"(bar)
        : "memory");
}

__device__ __forceinline__ void tma_load_3d(unsigned dst, unsigned long long tmap, int inner,
                                            int middle, int outer, unsigned bar) {
    asm volatile(
        "cp.async.bulk.tensor.3d.shared::cluster.global.mbarrier::complete_tx::bytes"
        " [%0], [%1, {%2, %3, %4}], [%5];" ::"r"(dst), "l"(tmap), "r"(inner), "r"(middle),
        "r"(outer), "r"(bar)
        : "memory");
}

__device__ __forceinline__ void prefetch_tensormap(unsigned long long tmap) {
    asm volatile("prefetch.tensormap [%0];" ::"l"(tmap) : "memory");
}

// Between the generic proxy and the async proxy (TMA): the calling thread's earlier accesses,
// including what it acquired from other GPUs' stores, are ordered before its later TMA reads.
__device__ __forceinline__ void fence_proxy_async() {
    asm volatile("fence.proxy.async.global;" ::: "memory");
}

// ---- bulk tensor copy the other way: one box of shared memory out to a tensor map ----------
// Between this thread's generic-proxy writes to shared memory (st.shared, stmatrix) and the
// async proxy's reads of it (a bulk copy issued after a barrier, by this or another thread).
__device__ __forceinline__ void fence_proxy_async_shared() {
    asm volatile("fence.proxy.async.shared::cta;" ::: "memory");
}

// The box at shared ``src`` to the tensor map's box at (inner, outer), in this thread's current
// bulk group (bulk_commit closes it). Parts of the box past the tensor's extents are not written.
__device__ __forceinline__ void tma_store_2d(unsigned long long tmap, unsigned src, int inner,
                                             int outer) {
    asm volatile("cp.async.bulk.tensor.2d.global.shared::cta.bulk_group [%0, {%1, %2}], [%3];"
                 ::"l"(tmap), "r"(inner), "r"(outer), "r"(src)
                 : "memory");
}

__device__ __forceinline__ void bulk_commit() {
    asm volatile("cp.async.bulk.commit_group;" ::: "memory");
}

// Until at most N of this thread's bulk groups still read their shared-memory sources (their
// global writes may still be in flight).
template <int N> __device__ __forceinline__ void bulk_wait_read() {
    asm volatile("cp.async.bulk.wait_group.read %0;" ::"n"(N) : "memory");
}

// Until at most N of this thread's bulk groups are incomplete (written to global memory).
template <int N> __device__ __forceinline__ void bulk_wait() {
    asm volatile("cp.async.bulk.wait_group %0;" ::"n"(N) : "memory");
}

// ---- wgmma ---------------------------------------------------------------------------------
// Shared-memory matrix descriptors of 128B-swizzled tiles whose rows are 128 B (64 bf16), 8-row
// core-matrix groups 1024 B apart (the layout a TMA box of 64 columns writes):
//   K-major (the reduction dimension along the row): the leading offset is unused;
//   MN-major (the output dimension along the row, a transposed B): the leading offset is the
//   distance between 64-column boxes side by side (``box_bytes``).
// Why, for MN-major: the 128B-swizzle MN-major canonical layout (PTX ISA, "Shared Memory Matrix
// Layout"; CUTLASS's GMMA::Layout_MN_SW128_Atom) is, in 16-byte units,
//   Swizzle<3,4,3> o ((T,8,m),(8,k)) : ((1,T,LBO),(8T,SBO)),  T = 8 bf16 per unit:
// along M/N, 64 contiguous elements (one 128-byte row), then the next 64 LBO bytes on (the next
// box); along K, 8 rows 128 B apart, then the next 8 rows SBO bytes on (1024: the 8-row swizzle
// atom). A k16 step is 2 such groups: advance the start address by 16 rows (2048 B).
__device__ __forceinline__ unsigned long long smem_desc(unsigned addr) {
    return (unsigned long long)((addr & 0x3FFFF) >> 4) | (1ull << 16) | ((1024ull >> 4) << 32) |
           (1ull << 62);
}

__device__ __forceinline__ unsigned long long smem_desc_mn(unsigned addr, unsigned box_bytes) {
    return (unsigned long long)((addr & 0x3FFFF) >> 4) |
           ((unsigned long long)(box_bytes >> 4) << 16) | ((1024ull >> 4) << 32) | (1ull << 62);
}

// A descriptor of the same layout at ``bytes`` (a multiple of 16) past ``desc``'s start address,
// without rebuilding it (CUTLASS's descriptor iterator): the start address is bits 0-13 of
// address >> 4 and a block's shared addresses stay below 256 KB, so smem_desc(addr + bytes) ==
// smem_desc(addr) + (bytes >> 4), and likewise smem_desc_mn, for any such address, 128B swizzle
// included (the swizzle acts on the address the MMA forms, not on the descriptor). Only the low
// word changes: the high word stays a constant the compiler sees.
__device__ __forceinline__ unsigned long long desc_at(unsigned long long desc, unsigned bytes) {
    return (desc & 0xFFFFFFFF00000000ull) | (unsigned)((unsigned)desc + (bytes >> 4));
}

__device__ __forceinline__ void wgmma_fence() { asm volatile("wgmma.fence.sync.aligned;" ::: "memory"); }
__device__ __forceinline__ void wgmma_commit() {
    asm volatile("wgmma.commit_group.sync.aligned;" ::: "memory");
}
template <int N> __device__ __forceinline__ void wgmma_wait() {
    asm volatile("wgmma.wait_group.sync.aligned %0;" ::"n"(N) : "memory");
}

#define MK_ACC8(i)                                                                                 \
    "+f"(d[i]), "+f"(d[i + 1]), "+f"(d[i + 2]), "+f"(d[i + 3]), "+f"(d[i + 4]), "+f"(d[i + 5]),    \
        "+f"(d[i + 6]), "+f"(d[i + 7])

// The accumulator layout of every m64nNk16 below: warp w of the warpgroup holds rows 16w + lane/4
// and 16w + lane/4 + 8; d[4j .. 4j+3] are columns 8j + 2 (lane % 4) and +1 of those two rows.

// d[64 x 256] += A_desc[64 x 16] @ B_desc[256 x 16]^T, A K-major in shared memory; B K-major
// (TRANS_B 0: smem_desc) or MN-major (TRANS_B 1, wgmma's tnspB: smem_desc_mn, B stored [16 x 256])
template <int TRANS_B = 0>
__device__ __forceinline__ void wgmma_m64n256k16(float (&d)[128], unsigned long long da,
                                                 unsigned long long db) {
    asm volatile(
        "{\n"
        "wgmma.mma_async.sync.aligned.m64n256k16.f32.bf16.bf16 {"
        "%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15,"
        "%16, %17, %18, %19, %20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31,"
        "%32, %33, %34, %35, %36, %37, %38, %39, %40, %41, %42, %43, %44, %45, %46, %47,"
        "%48, %49, %50, %51, %52, %53, %54, %55, %56, %57, %58, %59, %60, %61, %62, %63,"
        "%64, %65, %66, %67, %68, %69, %70, %71, %72, %73, %74, %75, %76, %77, %78, %79,"
        "%80, %81, %82, %83, %84, %85, %86, %87, %88, %89, %90, %91, %92, %93, %94, %95,"
        "%96, %97, %98, %99, %100, %101, %102, %103, %104, %105, %106, %107, %108, %109, %110, %111,"
        "%112, %113, %114, %115, %116, %117, %118, %119, %120, %121, %122, %123, %124, %125, %126, %127"
        "}, %128, %129, 1, 1, 1, 0, %130;\n"
        "}\n"
        : MK_ACC8(0), MK_ACC8(8), MK_ACC8(16), MK_ACC8(24), MK_ACC8(32), MK_ACC8(40),
          MK_ACC8(48), MK_ACC8(56), MK_ACC8(64), MK_ACC8(72), MK_ACC8(80), MK_ACC8(88),
          MK_ACC8(96), MK_ACC8(104), MK_ACC8(112), MK_ACC8(120)
        : "l"(da), "l"(db), "n"(TRANS_B));
}

// d[64 x 128] (= or +=, by ``accumulate``) A_desc[64 x 16] @ B_desc[128 x 16]^T, A K-major;
// B K-major or MN-major as for wgmma_m64n256k16 (TRANS_B)
template <int TRANS_B = 0>
__device__ __forceinline__ void wgmma_m64n128k16_ss(float (&d)[64], unsigned long long da,
                                                    unsigned long long db, int accumulate) {
    asm volatile(
        "{\n"
        ".reg .pred p;\n"
        "setp.ne.b32 p, %66, 0;\n"
        "wgmma.mma_async.sync.aligned.m64n128k16.f32.bf16.bf16 {"
        "%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15,"
        "%16, %17, %18, %19, %20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31,"
        "%32, %33, %34, %35, %36, %37, %38, %39, %40, %41, %42, %43, %44, %45, %46, %47,"
        "%48, %49, %50, %51, %52, %53, %54, %55, %56, %57, %58, %59, %60, %61, %62, %63"
        "}, %64, %65, p, 1, 1, 0, %67;\n"
        "}\n"
        : MK_ACC8(0), MK_ACC8(8), MK_ACC8(16), MK_ACC8(24), MK_ACC8(32), MK_ACC8(40),
          MK_ACC8(48), MK_ACC8(56)
        : "l"(da), "l"(db), "r"(accumulate), "n"(TRANS_B));
}

// d[64 x 64] (= or +=, by ``accumulate``) A_desc[64 x 16] @ B_desc[64 x 16]^T, as
// wgmma_m64n128k16_ss
template <int TRANS_B = 0>
__device__ __forceinline__ void wgmma_m64n64k16_ss(float (&d)[32], unsigned long long da,
                                                   unsigned long long db, int accumulate) {
    asm volatile(
        "{\n"
        ".reg .pred p;\n"
        "setp.ne.b32 p, %34, 0;\n"
        "wgmma.mma_async.sync.aligned.m64n64k16.f32.bf16.bf16 {"
        "%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15,"
        "%16, %17, %18, %19, %20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31"
        "}, %32, %33, p, 1, 1, 0, %35;\n"
        "}\n"
        : MK_ACC8(0), MK_ACC8(8), MK_ACC8(16), MK_ACC8(24)
        : "l"(da), "l"(db), "r"(accumulate), "n"(TRANS_B));
}

// m64nNk16 with both operands in shared memory, N from the accumulator (N / 2 floats per thread)
template <int TRANS_B = 0>
__device__ __forceinline__ void wgmma_ss(float (&d)[64], unsigned long long da,
                                         unsigned long long db, int accumulate) {
    wgmma_m64n128k16_ss<TRANS_B>(d, da, db, accumulate);
}
template <int TRANS_B = 0>
__device__ __forceinline__ void wgmma_ss(float (&d)[32], unsigned long long da,
                                         unsigned long long db, int accumulate) {
    wgmma_m64n64k16_ss<TRANS_B>(d, da, db, accumulate);
}

// d[64 x N] += A[64 x 16] @ B_desc[16 x N], A from registers (bf16x2 words a0..a3 in the
// A-fragment layout, which is the accumulator layout of 16 columns), B MN-major (transposed)
__device__ __forceinline__ void wgmma_m64n128k16_rs(float (&d)[64], unsigned a0, unsigned a1,
                                                    unsigned a2, unsigned a3,
                                                    unsigned long long db) {
    asm volatile(
        "{\n"
        "wgmma.mma_async.sync.aligned.m64n128k16.f32.bf16.bf16 {"
        "%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15,"
        "%16, %17, %18, %19, %20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31,"
        "%32, %33, %34, %35, %36, %37, %38, %39, %40, %41, %42, %43, %44, %45, %46, %47,"
        "%48, %49, %50, %51, %52, %53, %54, %55, %56, %57, %58, %59, %60, %61, %62, %63"
        "}, {%64, %65, %66, %67}, %68, 1, 1, 1, 1;\n"
        "}\n"
        : MK_ACC8(0), MK_ACC8(8), MK_ACC8(16), MK_ACC8(24), MK_ACC8(32), MK_ACC8(40),
          MK_ACC8(48), MK_ACC8(56)
        : "r"(a0), "r"(a1), "r"(a2), "r"(a3), "l"(db));
}

__device__ __forceinline__ void wgmma_m64n64k16_rs(float (&d)[32], unsigned a0, unsigned a1,
                                                   unsigned a2, unsigned a3,
                                                   unsigned long long db) {
    asm volatile(
        "{\n"
        "wgmma.mma_async.sync.aligned.m64n64k16.f32.bf16.bf16 {"
        "%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15,"
        "%16, %17, %18, %19, %20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31"
        "}, {%32, %33, %34, %35}, %36, 1, 1, 1, 1;\n"
        "}\n"
        : MK_ACC8(0), MK_ACC8(8), MK_ACC8(16), MK_ACC8(24)
        : "r"(a0), "r"(a1), "r"(a2), "r"(a3), "l"(db));
}

// ---- register reallocation between warpgroups ----------------------------------------------
// Every warp of a warpgroup executes the same one. ptxas honours them only when it assembles the
// whole kernel at once (numba's LTO link into a cubin); assembled as a separate compilation
// unit (PTX handed to nvJitLink, or ptxas -c) it drops them (C7504).
template <int N> __device__ __forceinline__ void regs_inc() {
    asm volatile("setmaxnreg.inc.sync.aligned.u32 %0;" ::"n"(N));
}
template <int N> __device__ __forceinline__ void regs_dec() {
    asm volatile("setmaxnreg.dec.sync.aligned.u32 %0;" ::"n"(N));
}

// Keeps the compiler from moving accumulator reads/writes across the asynchronous MMAs.
template <int N> __device__ __forceinline__ void fence_operands(float (&d)[N]) {
#pragma unroll
    for (int i = 0; i < N; ++i) asm volatile("" : "+f"(d[i])::"memory");
}

__device__ __forceinline__ unsigned pack_bf16x2(float lo, float hi) {
    __nv_bfloat162 v = __floats2bfloat162_rn(lo, hi);  // lo in the low half: the lower column
    return *reinterpret_cast<unsigned *>(&v);
}

__device__ __forceinline__ uint4 ld_shared_v4(unsigned addr) {
    uint4 v;
    asm volatile("ld.shared.v4.u32 {%0, %1, %2, %3}, [%4];"
                 : "=r"(v.x), "=r"(v.y), "=r"(v.z), "=r"(v.w) : "r"(addr) : "memory");
    return v;
}

}  // namespace
