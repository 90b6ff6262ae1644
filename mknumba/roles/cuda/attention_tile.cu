// Hopper (sm_90a) attention tile for mknumba's Ring Attention: FlashAttention's forward pass for
// one tile of 128 query rows of one (batch, head), folding in tiles of 128 keys as they arrive.
//
// Linked into numba kernels like gemm_tile.cu. A block of 384 threads runs it:
//   warps 0-7  two consumer warpgroups; warpgroup w owns query rows [64w, 64w + 64) of the tile.
//              Per KV tile: S = Q K^T on wgmma (m64n128k16, both operands in shared memory),
//              the online softmax of S in fp32 registers, then O += P V on wgmma with P taken
//              from registers (S's accumulator layout is the A-fragment layout of the next MMA,
//              so P never touches shared memory) and V from shared memory as a transposed
//              (MN-major) B; S of the next KV tile is in flight during this one's softmax
//              (consume), and the two warpgroups take turns issuing their MMAs (ping-pong:
//              named barriers 1 and 2), so one's softmax runs under the other's MMAs. O, the
//              row maxima and the denominators stay in registers for the
//              whole query tile, over every KV slice: the partial results merge exactly as a
//              log-sum-exp merge would, in fp32, and O is rounded to bf16 once.
//   warps 8-11 the producer warpgroup: it gives most of its registers to the consumers
//              (setmaxnreg), then one lane issues the bulk tensor copies (TMA) of Q, K and V.
// Operands are bf16, described by 3-D CUtensorMaps {all heads' columns, sequence, batch} with
// boxes of 64 columns x 128 rows and 128B swizzle; a head of 128 is two boxes side by side.
// Shared memory, from a 1024-byte-aligned base:
//   [Q slots][K slots][V slots][barriers], 32 KB a slot
// Barriers: q_full[s] / q_empty[s] guard the Q slots; k_full[s] and v_full[s] (the producer's
// expect_tx, the copies' complete_tx) and kv_empty[s] (one arrival per consumer warpgroup once
// the MMAs that read slot s retired) guard the KV ring. Nothing is reset between tiles: the caller carries
// the number of query tiles and of KV tiles this block has already passed through, and slot and
// phase follow from them, so the producer runs ahead into the next tile.
//
// Positions, for the causal mask, come as runs of three ints: pos(j) = j < split ? base0 + j
// : base1 + (j - split), increasing in j (sched.sequence.runs builds them for the contiguous
// and zigzag layouts). A query sees the keys whose position is at most its own; since positions
// increase, the KV tiles a query tile sees are a prefix of the slice, and only the tiles that
// straddle the diagonal (or the ragged end of the slice) need a per-element mask.

#include "sm90.cuh"

namespace {

// One Q slot, three KV slots (the pipelined loop reads two KV tiles at once).
constexpr int BQ = 128, BKV = 128, Q_STAGES = 1, KV_STAGES = 3;
constexpr unsigned BOX_BYTES = 128 * 128;       // 128 rows x 64 bf16
constexpr unsigned TILE_BYTES = 2 * BOX_BYTES;  // 128 rows of a head of up to 128
constexpr unsigned K_OFFSET = Q_STAGES * TILE_BYTES, V_OFFSET = K_OFFSET + KV_STAGES * TILE_BYTES;
constexpr unsigned BAR_OFFSET = V_OFFSET + KV_STAGES * TILE_BYTES;
// Registers a thread after setmaxnreg (see mk_attn_sm90_producer_regs). The producer's numba
// loop spills below 56; below ~200 ptxas serializes the consumers' pipelined MMAs (C7512).
constexpr int PRODUCER_REGS = 56, CONSUMER_REGS = 224;
// what the producer warpgroup gives up is all the consumers' setmaxnreg.inc can take (more:
// it waits forever) from a block of 384 threads at 168 registers each
static_assert(2 * CONSUMER_REGS + PRODUCER_REGS <= 3 * 168, "setmaxnreg: more than the block has");
constexpr float LN2 = 0.6931471805599453f;
// -inf (NVRTC has no <math.h> INFINITY)
__device__ __forceinline__ float neg_inf() { return __int_as_float((int)0xff800000u); }

struct Smem {
    unsigned q, k, v, q_full, q_empty, k_full, v_full, kv_empty;  // shared-space addresses
};

__device__ __forceinline__ Smem smem_at(unsigned long long smem_generic) {
    unsigned base = (unsigned)__cvta_generic_to_shared((void *)smem_generic);
    base = (base + 1023u) & ~1023u;
    const unsigned bar = base + BAR_OFFSET;
    const unsigned kv_bar = bar + 16 * Q_STAGES;
    return Smem{base,   base + K_OFFSET, base + V_OFFSET, bar, bar + 8 * Q_STAGES,
                kv_bar, kv_bar + 8 * KV_STAGES, kv_bar + 16 * KV_STAGES};
}

struct Runs {
    int base0, split, base1;
};

__device__ __forceinline__ Runs runs_at(unsigned long long p) {
    const int *r = (const int *)p;
    return Runs{r[0], r[1], r[2]};
}

__device__ __forceinline__ int pos(const Runs &r, int j) {
    return j < r.split ? r.base0 + j : r.base1 + (j - r.split);
}

// How many of the slice's first n keys lie at or before position p.
__device__ __forceinline__ int keys_upto(const Runs &r, int n, int p) {
    const int first = min(r.split, n);
    return max(0, min(p - r.base0 + 1, first)) + max(0, min(p - r.base1 + 1, n - first));
}

// The number of KV tiles of a slice of n keys that the query tile at rows [row0, row0 + BQ)
// of a slice of nq rows sees (a prefix of the slice's tiles).
__device__ __forceinline__ int kv_tiles(const Runs &q, int row0, int nq, const Runs &kv, int n,
                                        int causal) {
    const int keys = causal ? keys_upto(kv, n, pos(q, min(row0 + BQ, nq) - 1)) : n;
    return (keys + BKV - 1) / BKV;
}

__device__ __forceinline__ float fast_exp2(float x) {
    float y;
    asm("ex2.approx.ftz.f32 %0, %1;" : "=f"(y) : "f"(x));
    return y;
}

__device__ __forceinline__ float quad_max(float x) {
    x = fmaxf(x, __shfl_xor_sync(0xffffffffu, x, 1));
    return fmaxf(x, __shfl_xor_sync(0xffffffffu, x, 2));
}

__device__ __forceinline__ float quad_sum(float x) {
    x += __shfl_xor_sync(0xffffffffu, x, 1);
    return x + __shfl_xor_sync(0xffffffffu, x, 2);
}

// Where a query tile is in its walk over the KV tiles it sees: slice ``slice`` (its positions
// ``kr``, ``tiles`` tiles visible), tile ``tile`` of it; the same order as the producer's.
struct Cursor {
    int slice, tile, tiles;
    Runs kr;
};

// Moves to the next KV tile, skipping slices the query tile sees none of; false past the last.
__device__ __forceinline__ bool advance(Cursor &c, const Runs &qr, int row0, int seq,
                                        unsigned long long kv_runs, int slices, int causal) {
    if (++c.tile < c.tiles) return true;
    while (++c.slice < slices) {
        c.kr = runs_at(kv_runs + 12ull * c.slice);
        c.tiles = kv_tiles(qr, row0, seq, c.kr, seq, causal);
        if (c.tiles > 0) {
            c.tile = 0;
            return true;
        }
    }
    return false;
}

// Ping-pong: warpgroup w issues its steady-state MMAs only in its turn, which it takes at
// named barrier 1 + w (256 threads: its own 128 waiting, the other warpgroup's 128 passing)
// and passes to the other once they are issued, so one warpgroup's softmax runs under the
// other's MMAs. Both warpgroups walk the same KV tiles (a warpgroup whose rows are all masked
// still takes every turn), so they take equally many turns; warpgroup 1 hands warpgroup 0 the
// first turn once per launch, and the turns run on across query tiles (the last pass of a
// launch is left unmatched, as in FlashAttention-3).
__device__ __forceinline__ void turn_take(int wg) {
    asm volatile("bar.sync %0, 256;" ::"r"(1 + wg) : "memory");
}
__device__ __forceinline__ void turn_pass(int wg) {
    asm volatile("bar.arrive %0, 256;" ::"r"(1 + (wg ^ 1)) : "memory");
}

// S = Q K^T for one KV tile (issued and committed, not waited for): D / 16 MMAs of 16 columns,
// 32 bytes apart along the swizzled rows of each 64-column box.
template <int D>
__device__ __forceinline__ void qk_mma(float (&d)[64], unsigned q, unsigned k) {
    wgmma_fence();
#pragma unroll
    for (int kk = 0; kk < D / 16; ++kk) {
        const unsigned off = (kk / 4) * BOX_BYTES + (kk % 4) * 32;
        wgmma_m64n128k16_ss(d, smem_desc(q + off), smem_desc(k + off), kk > 0);
    }
    wgmma_commit();
}

// O += P V for one KV tile (issued and committed): 8 MMAs of 16 keys, P's words for keys
// [16t, 16t + 16) being p[4t .. 4t + 3]; V's 16-key slabs are 2 KB apart (16 rows of 128 B).
template <int D>
__device__ __forceinline__ void pv_mma(float (&o)[D / 2], const unsigned (&p)[32], unsigned v) {
    wgmma_fence();
#pragma unroll
    for (int t = 0; t < BKV / 16; ++t) {
        const unsigned long long dv = smem_desc_mn(v + t * 16 * 128, BOX_BYTES);
        if constexpr (D == 128)
            wgmma_m64n128k16_rs(o, p[4 * t], p[4 * t + 1], p[4 * t + 2], p[4 * t + 3], dv);
        else
            wgmma_m64n64k16_rs(o, p[4 * t], p[4 * t + 1], p[4 * t + 2], p[4 * t + 3], dv);
    }
    wgmma_commit();
}

// One thread's softmax state: rows lo and hi (8 apart), the running maxima of the scaled scores
// (log2 units) and this thread's part of the denominators.
struct RowState {
    int pos_lo, pos_hi;
    float m_lo, m_hi, l_lo, l_hi;
};

// The online softmax of one KV tile's scores, in place: masks keys past the slice's end and
// (causal) keys after the query, raises the maxima, turns d into e^(scaled score - max) and
// adds it to the denominators. Returns in corr the factors by which O must be rescaled.
__device__ __forceinline__ void softmax(float (&d)[64], RowState &st, const Cursor &c, int seq,
                                        int q_first, int causal, float scale_log2, int lane,
                                        float &corr_lo, float &corr_hi) {
    const int c0 = c.tile * BKV, last = min(c0 + BKV, seq) - 1;
    if (c0 + BKV > seq || (causal && pos(c.kr, last) > q_first)) {
#pragma unroll
        for (int j = 0; j < BKV / 8; ++j) {
#pragma unroll
            for (int e = 0; e < 2; ++e) {
                const int key = c0 + 8 * j + 2 * (lane % 4) + e;
                const int kp = pos(c.kr, key);
                if (key >= seq || (causal && kp > st.pos_lo)) d[4 * j + e] = neg_inf();
                if (key >= seq || (causal && kp > st.pos_hi)) d[4 * j + 2 + e] = neg_inf();
            }
        }
    }
    float mx_lo = neg_inf(), mx_hi = neg_inf();
#pragma unroll
    for (int j = 0; j < BKV / 8; ++j) {
        mx_lo = fmaxf(mx_lo, fmaxf(d[4 * j], d[4 * j + 1]));
        mx_hi = fmaxf(mx_hi, fmaxf(d[4 * j + 2], d[4 * j + 3]));
    }
    const float mn_lo = fmaxf(st.m_lo, quad_max(mx_lo) * scale_log2);
    const float mn_hi = fmaxf(st.m_hi, quad_max(mx_hi) * scale_log2);
    // a row that has seen no key yet keeps a maximum of -inf: subtract 0 instead
    const float ref_lo = mn_lo == neg_inf() ? 0.f : mn_lo;
    const float ref_hi = mn_hi == neg_inf() ? 0.f : mn_hi;
    corr_lo = fast_exp2(st.m_lo - ref_lo);
    corr_hi = fast_exp2(st.m_hi - ref_hi);
    st.m_lo = mn_lo;
    st.m_hi = mn_hi;
    float sum_lo = 0.f, sum_hi = 0.f;
#pragma unroll
    for (int j = 0; j < BKV / 8; ++j) {
        d[4 * j] = fast_exp2(fmaf(d[4 * j], scale_log2, -ref_lo));
        d[4 * j + 1] = fast_exp2(fmaf(d[4 * j + 1], scale_log2, -ref_lo));
        d[4 * j + 2] = fast_exp2(fmaf(d[4 * j + 2], scale_log2, -ref_hi));
        d[4 * j + 3] = fast_exp2(fmaf(d[4 * j + 3], scale_log2, -ref_hi));
        sum_lo += d[4 * j] + d[4 * j + 1];
        sum_hi += d[4 * j + 2] + d[4 * j + 3];
    }
    st.l_lo = st.l_lo * corr_lo + sum_lo;
    st.l_hi = st.l_hi * corr_hi + sum_hi;
}

// P in bf16 as the next MMA's A fragments: 8-column group j is half of the 16-key step j / 2;
// rows lo, hi of keys +0..7 are words 0, 1 and of keys +8..15 words 2, 3.
__device__ __forceinline__ void to_fragments(const float (&d)[64], unsigned (&p)[32]) {
#pragma unroll
    for (int j = 0; j < BKV / 8; ++j) {
        p[4 * (j / 2) + 2 * (j % 2)] = pack_bf16x2(d[4 * j], d[4 * j + 1]);
        p[4 * (j / 2) + 2 * (j % 2) + 1] = pack_bf16x2(d[4 * j + 2], d[4 * j + 3]);
    }
}

template <int D>
__device__ __forceinline__ void rescale(float (&o)[D / 2], float corr_lo, float corr_hi) {
#pragma unroll
    for (int j = 0; j < D / 8; ++j) {
        o[4 * j] *= corr_lo;
        o[4 * j + 1] *= corr_lo;
        o[4 * j + 2] *= corr_hi;
        o[4 * j + 3] *= corr_hi;
    }
}

// The consumers' work on one query tile (see mk_attn_sm90_tile), FlashAttention-3's pipelining
// within a warpgroup: S = Q K^T of the next KV tile is issued before this tile's O += P V, and
// its softmax runs while P V is still in flight, so the tensor cores work through the softmax
// (the two warpgroups also overlap each other). S, P and O together need ~200 registers a
// thread: the producer warpgroup hands its registers over (mk_attn_sm90_consumer_regs). Slot g
// of the KV ring is released once its P V retired. Returns the updated kv_seq.
template <int D>
__device__ __forceinline__ int consume(const Smem &sm, unsigned long long out,
                                       unsigned long long lse, int b, int h, int heads, int seq,
                                       int row0, unsigned long long q_runs,
                                       unsigned long long kv_runs, int slices, int causal,
                                       float scale_log2, int kv_seq, int q_seq) {
    const int tid = threadIdx.x, wg = tid / 128, warp = (tid % 128) / 32, lane = tid % 32;
    const Runs qr = runs_at(q_runs);
    RowState st;
    st.pos_lo = pos(qr, row0 + wg * 64 + warp * 16 + lane / 4);  // this thread's two rows
    st.pos_hi = pos(qr, row0 + wg * 64 + warp * 16 + lane / 4 + 8);
    st.m_lo = st.m_hi = neg_inf();
    st.l_lo = st.l_hi = 0.f;
    const int q_first = pos(qr, row0);  // the tile's earliest query position
    if (wg == 1 && q_seq == 0) turn_pass(wg);  // the launch's first turn: warpgroup 0's

    float o[D / 2], d[64], corr_lo, corr_hi;
    unsigned p[32];
#pragma unroll
    for (int i = 0; i < D / 2; ++i) o[i] = 0.f;
    fence_operands(o);

    const unsigned qs = q_seq % Q_STAGES;
    mbar_wait(sm.q_full + 8 * qs, (q_seq / Q_STAGES) & 1);
    const unsigned q = sm.q + qs * TILE_BYTES + wg * 64 * 128;  // this warpgroup's 64 rows
    auto slot = [&](unsigned g) { return g % KV_STAGES; };
    auto phase = [&](unsigned g) { return (g / KV_STAGES) & 1; };

    Cursor c{-1, 0, 0, Runs{0, 0, 0}};
    unsigned g = kv_seq;
    if (advance(c, qr, row0, seq, kv_runs, slices, causal)) {
        mbar_wait(sm.k_full + 8 * slot(g), phase(g));
        qk_mma<D>(d, q, sm.k + slot(g) * TILE_BYTES);
        wgmma_wait<0>();
        fence_operands(d);
        softmax(d, st, c, seq, q_first, causal, scale_log2, lane, corr_lo, corr_hi);
        to_fragments(d, p);
        // S of tile g + 1 is computed while P V of tile g runs; O is rescaled for the new
        // maxima while S is, before its P V
        while (advance(c, qr, row0, seq, kv_runs, slices, causal)) {
            ++g;
            mbar_wait(sm.k_full + 8 * slot(g), phase(g));
            // no turn held while waiting for the producer
            mbar_wait(sm.v_full + 8 * slot(g - 1), phase(g - 1));
            turn_take(wg);
            qk_mma<D>(d, q, sm.k + slot(g) * TILE_BYTES);
            fence_operands(o);
            rescale<D>(o, corr_lo, corr_hi);
            pv_mma<D>(o, p, sm.v + slot(g - 1) * TILE_BYTES);
            turn_pass(wg);
            wgmma_wait<1>();  // groups retire in order: S, not yet P V
            fence_operands(d);
            softmax(d, st, c, seq, q_first, causal, scale_log2, lane, corr_lo, corr_hi);
            wgmma_wait<0>();
            fence_operands(o);
            if (tid % 128 == 0) mbar_arrive(sm.kv_empty + 8 * slot(g - 1));
            to_fragments(d, p);
        }
        rescale<D>(o, corr_lo, corr_hi);
        mbar_wait(sm.v_full + 8 * slot(g), phase(g));
        pv_mma<D>(o, p, sm.v + slot(g) * TILE_BYTES);
        wgmma_wait<0>();
        fence_operands(o);
        if (tid % 128 == 0) mbar_arrive(sm.kv_empty + 8 * slot(g));
        ++g;
    }
    if (tid % 128 == 0) mbar_arrive(sm.q_empty + 8 * qs);  // every MMA that read Q retired

    // ---- epilogue: O / l in bf16, lse = ln(sum of e^(scaled score)) in fp32
    const float l_lo = quad_sum(st.l_lo), l_hi = quad_sum(st.l_hi);
    // __fdividef: an IEEE division calls a slow-path subroutine, and any call in the function
    // makes ptxas serialize every wgmma in it
    const float inv_lo = l_lo > 0.f ? __fdividef(1.f, l_lo) : 0.f;
    const float inv_hi = l_hi > 0.f ? __fdividef(1.f, l_hi) : 0.f;
    __nv_bfloat16 *o_base = (__nv_bfloat16 *)out + ((long long)b * seq * heads + h) * D;
    const long long row_stride = (long long)heads * D;
    const int col = 2 * (lane % 4), row_lo = row0 + wg * 64 + warp * 16 + lane / 4;
    const int row_hi = row_lo + 8;
    if (row_lo < seq) {
        unsigned *dst = (unsigned *)(o_base + row_lo * row_stride + col);
#pragma unroll
        for (int j = 0; j < D / 8; ++j)
            dst[4 * j] = pack_bf16x2(o[4 * j] * inv_lo, o[4 * j + 1] * inv_lo);
    }
    if (row_hi < seq) {
        unsigned *dst = (unsigned *)(o_base + row_hi * row_stride + col);
#pragma unroll
        for (int j = 0; j < D / 8; ++j)
            dst[4 * j] = pack_bf16x2(o[4 * j + 2] * inv_hi, o[4 * j + 3] * inv_hi);
    }
    if (lane % 4 == 0) {
        float *l_base = (float *)lse + ((long long)b * heads + h) * seq;
        if (row_lo < seq)
            l_base[row_lo] = l_lo > 0.f ? (st.m_lo + __log2f(l_lo)) * LN2 : neg_inf();
        if (row_hi < seq)
            l_base[row_hi] = l_hi > 0.f ? (st.m_hi + __log2f(l_hi)) * LN2 : neg_inf();
    }
    return (int)g;
}

}  // namespace

// After the block's first __syncthreads(): the producer warpgroup (all four warps: setmaxnreg is
// per warpgroup) hands registers to the two consumer warpgroups. A 384-thread block starts at
// 168 a thread (65536 / 384, rounded down to ptxas's unit of 8); 2 x CONSUMER_REGS +
// PRODUCER_REGS must stay within 3 x 168 = 504.
extern "C" __device__ int mk_attn_sm90_producer_regs() {
    regs_dec<PRODUCER_REGS>();
    return 0;
}

extern "C" __device__ int mk_attn_sm90_consumer_regs() {
    regs_inc<CONSUMER_REGS>();
    return 0;
}

// Once per block, before the first tile; thread 0 initialises the barriers, the caller then
// runs __syncthreads().
extern "C" __device__ int mk_attn_sm90_init(unsigned long long smem) {
    if (threadIdx.x == 0) {
        const Smem sm = smem_at(smem);
        for (int s = 0; s < Q_STAGES; ++s) {
            mbar_init(sm.q_full + 8 * s, 1);
            mbar_init(sm.q_empty + 8 * s, 2);
        }
        for (int s = 0; s < KV_STAGES; ++s) {
            mbar_init(sm.k_full + 8 * s, 1);
            mbar_init(sm.v_full + 8 * s, 1);
            mbar_init(sm.kv_empty + 8 * s, 2);
        }
        mbar_init_fence();
    }
    return 0;
}

// Producer lane: Q rows [row0, row0 + 128) of head column col (= head * d) of batch b, once the
// block's previous query tile (q_seq - 1) no longer reads the slot.
extern "C" __device__ int mk_attn_sm90_load_q(unsigned long long smem, unsigned long long tmap,
                                              int b, int col, int row0, int d, int q_seq) {
    const Smem sm = smem_at(smem);
    const unsigned s = q_seq % Q_STAGES, full = sm.q_full + 8 * s;
    mbar_wait(sm.q_empty + 8 * s, ((q_seq / Q_STAGES) & 1) ^ 1);  // a fresh barrier passes
    mbar_expect_tx(full, (unsigned)d * BQ * 2);
    for (int c = 0; c < d; c += 64)
        tma_load_3d(sm.q + s * TILE_BYTES + (c / 64) * BOX_BYTES, tmap, col + c, row0, b, full);
    return 0;
}

// Producer lane: the KV tiles of one slice (k_map, v_map: its tensor maps; kv_runs: its
// positions) that the query tile at row0 sees, into the ring; the caller has acquired the
// slice's flags. live == 0 (an earlier wait timed out): pass the tiles through the ring without
// copying, so the consumers finish (their result is discarded: the op raises). Returns the
// updated kv_seq.
extern "C" __device__ int mk_attn_sm90_load_kv(unsigned long long smem, unsigned long long k_map,
                                               unsigned long long v_map, int b, int col, int d,
                                               int seq, int row0, unsigned long long q_runs,
                                               unsigned long long kv_runs, int causal,
                                               int kv_seq, int live) {
    const Smem sm = smem_at(smem);
    const Runs qr = runs_at(q_runs), kr = runs_at(kv_runs);
    const int tiles = kv_tiles(qr, row0, seq, kr, seq, causal);
    if (live) fence_proxy_async();  // the slice's data, acquired by this thread, then TMA reads
    for (int t = 0; t < tiles; ++t, ++kv_seq) {
        const unsigned s = kv_seq % KV_STAGES, phase = (kv_seq / KV_STAGES) & 1;
        mbar_wait(sm.kv_empty + 8 * s, phase ^ 1);
        if (!live) {
            mbar_arrive(sm.k_full + 8 * s);
            mbar_arrive(sm.v_full + 8 * s);
            continue;
        }
        const unsigned bytes = (unsigned)d * BKV * 2;
        mbar_expect_tx(sm.k_full + 8 * s, bytes);
        for (int c = 0; c < d; c += 64)
            tma_load_3d(sm.k + s * TILE_BYTES + (c / 64) * BOX_BYTES, k_map, col + c, t * BKV, b,
                        sm.k_full + 8 * s);
        mbar_expect_tx(sm.v_full + 8 * s, bytes);
        for (int c = 0; c < d; c += 64)
            tma_load_3d(sm.v + s * TILE_BYTES + (c / 64) * BOX_BYTES, v_map, col + c, t * BKV, b,
                        sm.v_full + 8 * s);
    }
    return kv_seq;
}

// Consumers (threads 0-255, all of them): one query tile of 128 rows from row0 of head h of
// batch b against every slice in turn. out: bf16 [batch, seq, heads, d]; lse: fp32 [batch,
// heads, seq]; q_runs: the query rows' positions; kv_runs: ``slices`` runs, 12 bytes apart, in
// the order the producer loads them; d is 64 or 128; scale_log2 = softmax scale * log2(e).
// kv_seq, q_seq: KV tiles and query tiles this block has already consumed. Returns the updated
// kv_seq.
extern "C" __device__ int mk_attn_sm90_tile(unsigned long long smem, unsigned long long out,
                                            unsigned long long lse, int b, int h, int heads,
                                            int seq, int d, int row0, unsigned long long q_runs,
                                            unsigned long long kv_runs, int slices, int causal,
                                            float scale_log2, int kv_seq, int q_seq) {
    const Smem sm = smem_at(smem);
    if (d == 64)
        return consume<64>(sm, out, lse, b, h, heads, seq, row0, q_runs, kv_runs, slices, causal,
                           scale_log2, kv_seq, q_seq);
    return consume<128>(sm, out, lse, b, h, heads, seq, row0, q_runs, kv_runs, slices, causal,
                        scale_log2, kv_seq, q_seq);
}
