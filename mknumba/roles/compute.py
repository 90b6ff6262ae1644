"""Compute role: one output tile of C = A @ B^T, bf16 in, fp32 accumulate, bf16 out.

Tile contract (shared by both implementations; the persistent kernel calls it once per tile with
every thread of the block):

    tile(smem, tmaps, a, b, c, c_row0, addend, adds, m, n, k, tile_m, tile_n, seq)
        -> 1 in exactly one thread, else 0

    a: [m, k] bf16 bits (uint16/int16), row-major     — A, K contiguous
    b: [n, k] bf16 bits, row-major                     — B given as [N, K] (K contiguous),
       or [k, n] row-major (N contiguous: a weight as ``a @ b`` takes it) with a build whose
       ``b_kn`` is set (``"<build>:kn"``, see :func:`tile_build`)
    c: [*, n] bf16 bits, row-major, from global row c_row0 on — the tile's rows
       [tile_m*BM, +BM) and cols [tile_n*BN, +BN) land in c[row - c_row0, col]
    addend: [P, m, n] bf16 bits; adds > 0: planes 1..adds are added to the tile before it is
       stored (the fused ReduceScatter's owner folds the delivered partials in, ``to_owner``)
    smem: the block's dynamic shared memory (uint8); tmaps: uint64[32], the two CUtensorMaps
    seq: how many tiles this block has already computed (the sm_90a ring's phase follows from it)

A split-K fold (``kernels.gemm``) has no K of its own, so it is not a tile but a build's ``fold``
(:class:`TileBuild`), called by every thread of the block like the tile:

    fold(c, c_row0, addend, adds, m, n, tile_n) -> 1 in exactly one thread, else 0

    c: rows [c_row0, c_row0 + c.shape[0]) of the output (a band of a tile's rows), set in the
       tile's columns (tile column tile_n, bounded by n) to planes 1..adds of addend summed in
       fp32 and rounded once; the thread returning 1 does so as the tile's does

The thread that returns 1 does so after every thread's stores of this tile were issued and a
block-level barrier among the storing threads, so it can publish the tile's completion flag with a
release (``primitives.st_release``), or, where nothing in the kernel reads the flag (the unsplit
mk.Gemm), record it with no fence (``primitives.record``) for the host to read after the kernel: the
release's fence waits for the tile's stores, at a block's last tile on the kernel's path
(:func:`make_compute_role`; what it cost: benchmarks/NOTES.md). Threads may leave a call before its
tile is done (the sm_90a producer warp once its loads are queued; in the ping-pong tile the
warpgroup that does not own the tile at once), so whatever a caller does per tile it does per
thread, with no block barrier between tiles. A build with a ``drain`` (:class:`TileBuild`; mk.Gemm's
opt-in tensor-store tile) returns 0 everywhere instead, its stores may still be in flight; after the
block's last tile the role drains them and publishes the flag of every tile the block ran
(:func:`publish_after`).

Implementations:
- ``gemm_tile_sm90``: Hopper only (sm_90a). The linked helper ``cuda/gemm_tile.cu`` does TMA into a
  4-stage mbarrier ring, two consumer warpgroups issue wgmma m64n256k16; 128 x 256 x 64 tiles,
  288 threads per block, ``SM90_SMEM_BYTES`` of dynamic shared memory. B [k, n] is read as it is
  (TMA boxes of 64 N-columns, a transposed wgmma operand): built with ``MK_B_KN=1``.
- ``SM90_PINGPONG_TILE`` (mk.Gemm only; "auto" takes it by shape, ``kernels.gemm.pp_for``):
  ``cuda/gemm_pingpong.cu``, the same ring and calling sequence with 128 x 128 tiles, each computed
  whole by one consumer warpgroup; the two warpgroups take alternate tiles (``seq`` odd or even) and
  turns in the main loop, so one's epilogue runs while the other's MMAs do. A 6-stage ring; 288
  threads. Also built with 128 x 64, 64 x 128 and 64 x 64 tiles (``"sm90:pp:<BM>x<BN>"``,
  :func:`pp_name`), each ring as deep as fits (:func:`pp_stages`: 8, 8 and 13 stages). Variants
  named by letters after ``sm90:pp``: :data:`SM90_PP_VARIANTS` (``"sm90:ppd:64x64"``,
  ``"sm90:ppdr:128x64"``, ...); "auto" takes the ones measured faster
  (``kernels.gemm.plan.PP_AUTO_VARIANT``).
- ``SM90_TMS_TILE`` (mk.Gemm without split-K only; "auto" takes it for whole tiles at K <=
  ``kernels.gemm.plan.TMS_MAX_K``): ``cuda/gemm_tile.cu`` with ``MK_TMA_STORE=1``: the same ring and
  tile; each consumer warp's 16 x 64 chunks leave by TMA tensor stores through C's tensor map
  (``TileBuild.c_map``) from two 2 KB buffers, and no consumer waits for them, nor meets the others,
  between tiles; the tile flags go out at the block's end (``TileBuild.drain``).
- ``gemm_tile_simt``: the generic twin (simulator, GPUs without sm_90a): plain loads, one fp32 dot
  product per output element, ``SIMT_TILE`` tiles, any block size.
"""
import os
from collections import namedtuple

import numpy as np
from numba import cuda, types

from .._compat import SIMULATOR
from ..errors import ROLE_COMPUTE, MkValueError
from ..primitives import (data_ptr, peer_view, prefetch_l1, record, release, udiv32,
                          wait_flag)
from .blocks import no_stamp, stamp

HELPER = os.path.join(os.path.dirname(os.path.abspath(__file__)), "cuda", "gemm_tile.cu")
LIBRARY_CUDA = os.path.dirname(HELPER)
PINGPONG_HELPER = os.path.join(LIBRARY_CUDA, "gemm_pingpong.cu")

# Must match the constants at the top of gemm_tile.cu.
SM90_TILE = (128, 256)      # BM, BN
SM90_BK = 64
SM90_STAGES = 4
SM90_THREADS = 288          # two consumer warpgroups + one producer warp
#: the epilogue's staging (2 KB per consumer warp): stmatrix, then 16-byte stores of whole rows.
#: On an H200 at m = n = 8192 it cut the fixed cost per tile from 6.3 to 0.8 us against 4-byte
#: stores from the accumulators (benchmarks/probe_gemm_tile.py, results/gemm_tile_probe.json).
SM90_STAGING = 8 * 16 * 128
#: the fused kernels' tile: the same, plus a tenth warp that publishes the tile flags, so the
#: fence before each flag (which waits for the tile's stores) stalls no MMA warp. In the 1x2
#: fused kernels it was faster at 14 of 16 points (benchmarks/NOTES.md).
SM90_FUSED_TILE = "sm90:e2p1"
#: the ping-pong tile (``cuda/gemm_pingpong.cu``): each consumer warpgroup computes whole
#: BM x BN tiles, the two take turns in the main loop, so one's epilogue overlaps the other's
#: MMAs. Opt-in, mk.Gemm only (the fused ops refuse it: not measured there). Built in each
#: (BM, BN) of SM90_PINGPONG_SHAPES (:func:`pp_name`): "sm90:pp" is 128 x 128, the others
#: "sm90:pp:<BM>x<BN>" (smaller tiles: more of them where a GEMM has few); the ring as deep as
#: fits (:func:`pp_stages`). The source takes the shape and depth as defines (sm90_defines).
SM90_PINGPONG_TILE = "sm90:pp"
SM90_PINGPONG_SHAPE = (128, 128)    # "sm90:pp"'s BM, BN (gemm_pingpong.cu's defaults)
SM90_PINGPONG_SHAPES = ((128, 128), (128, 64), (64, 128), (64, 64))
#: dynamic shared memory an sm90 block may take: an H100 / H200 SM's 227 KB (232448 B) less 64 B
#: for the static shared memory of the kernels around the tile
SM90_SMEM_LIMIT = 232448 - 64
#: the deepest ring of a ping-pong build (64 x 64 fits 13 stages of 16 KB)
SM90_PINGPONG_MAX_STAGES = 16
#: variants of the ping-pong tile, each also with ":kn", named by letters after "sm90:pp"
#: ("sm90:pp<letters>:<BM>x<BN>", in this order; :func:`pp_variant_name`) -> sm90_build's
#: argument: d each MMA's descriptors advanced from the slot's by an add (MK_PP_DESC_ITER); r
#: the early ramp (``TileBuild.early``: the kernel prefetches each block's first entry of the
#: order before the block's setup: :func:`ramp_of`)
SM90_PP_VARIANTS = {"d": "desc_iter", "r": "early"}
#: the tensor-store tile (``cuda/gemm_tile.cu`` with MK_TMA_STORE): the sm90 tile whose
#: epilogue's chunks leave by TMA stores nobody waits for, two buffers per consumer warp (twice
#: the staging); mk.Gemm without split-K only (its flags go out at each block's end).
SM90_TMS_TILE = "sm90:tms"
#: threads of consumer warp 0 that publish a tensor-store block's flags after its last tile
#: (gemm_tile.cu mk_gemm_sm90_drain returns 0..31 there)
DRAIN_PUBLISHERS = 32


def pp_shape(pingpong):
    """The (BM, BN) of a ping-pong build from :func:`sm90_build`'s ``pingpong``: None (not
    one: False), :data:`SM90_PINGPONG_SHAPE` (True) or one of :data:`SM90_PINGPONG_SHAPES`."""
    if not isinstance(pingpong, (tuple, list)):
        return SM90_PINGPONG_SHAPE if pingpong else None
    shape = tuple(int(x) for x in pingpong)
    if shape not in SM90_PINGPONG_SHAPES:
        raise MkValueError(f"no ping-pong tile of {shape}: the builds are "
                           f"{', '.join(f'{bm}x{bn}' for bm, bn in SM90_PINGPONG_SHAPES)}")
    return shape


def pp_name(shape):
    """The library's name of the ping-pong build of ``shape`` (BM, BN), B as [n, k]."""
    shape = pp_shape(shape)
    return (SM90_PINGPONG_TILE if shape == SM90_PINGPONG_SHAPE else
            f"{SM90_PINGPONG_TILE}:{shape[0]}x{shape[1]}")


def pp_variant_name(shape, letters):
    """The name of the ping-pong tile of ``shape`` (BM, BN), B as [n, k], in the variant of
    ``letters`` (:data:`SM90_PP_VARIANTS`, e.g. "dr")."""
    bm, bn = pp_shape(shape)
    if not letters or "".join(x for x in SM90_PP_VARIANTS if x in letters) != letters:
        raise MkValueError(f"no ping-pong variant {letters!r}: letters of "
                           f"{''.join(SM90_PP_VARIANTS)!r}, in that order")
    return f"{SM90_PINGPONG_TILE}{letters}:{bm}x{bn}"


def _ring_bytes(bm, bn, stages, staging):
    """A ring of ``stages`` slots of A (bm rows) and B (bn rows) of 64 k, the epilogue's
    staging, the barriers (two per slot and two more) and 1 KB to align the base for the 128B
    swizzle."""
    return stages * (bm + bn) * SM90_BK * 2 + staging + 16 * stages + 16 + 1024


def pp_stages(shape):
    """Slots of the ping-pong build of ``shape``'s ring: as many as fit in
    :data:`SM90_SMEM_LIMIT`, at most :data:`SM90_PINGPONG_MAX_STAGES` (128 x 128: 6, 128 x 64
    and 64 x 128: 8, 64 x 64: 13)."""
    bm, bn = pp_shape(shape)
    stages = SM90_PINGPONG_MAX_STAGES
    while stages > 2 and _ring_bytes(bm, bn, stages, SM90_STAGING) > SM90_SMEM_LIMIT:
        stages -= 1
    return stages


SM90_PINGPONG_STAGES = pp_stages(SM90_PINGPONG_SHAPE)


def sm90_smem_bytes(pingpong=False, tms=False):
    """Dynamic shared memory of the sm90 tile (or a ping-pong tile: ``pingpong`` True or its
    shape, :func:`pp_shape`; or the tensor-store tile: two chunks of staging per warp)."""
    shape = pp_shape(pingpong)
    (bm, bn), stages = ((shape, pp_stages(shape)) if shape else (SM90_TILE, SM90_STAGES))
    return _ring_bytes(bm, bn, stages, SM90_STAGING * (2 if tms else 1))


def sm90_threads(publisher=False):
    """Threads per block of the sm90 tile: 320 when a tenth warp publishes the tile flags."""
    return SM90_THREADS + 32 * bool(publisher)


SM90_SMEM_BYTES = sm90_smem_bytes()

SIMT_TILE = (32, 32)
SIMT_THREADS = 128


# ---- sm_90a: thin numba wrappers around the linked helper ---------------------------------------
_SM90_BUILDS = {}   # (publisher, b_kn, pingpong, helper, defines, tms, desc_iter) -> (init,
#                     tile, drain, reinit)


def sm90_defines(publisher=False, b_kn=False, tms=False, pingpong=False, desc_iter=False):
    """The defines :func:`sm90_tile_functions` appends to a build's own (a probe that links
    another function from the same source names the same file: :func:`linked_source`); a
    ping-pong build's tile shape and ring depth (:func:`pp_shape`, :func:`pp_stages`), and
    its descriptor variant's (:data:`SM90_PP_VARIANTS`): MK_PP_DESC_ITER."""
    shape = pp_shape(pingpong)
    pp = (f"#define MK_PP_BM {shape[0]}\n#define MK_PP_BN {shape[1]}\n"
          f"#define MK_PP_STAGES {pp_stages(shape)}\n" if shape else "")
    if shape and desc_iter:
        pp += "#define MK_PP_DESC_ITER 1\n"
    return (("#define MK_PUBLISHER 1\n" if publisher else "") +
            ("#define MK_TMA_STORE 1\n" if tms else "") + ("#define MK_B_KN 1\n" if b_kn else "")
            + pp)


def sm90_tile_functions(publisher=False, b_kn=False, pingpong=False, helper=None, defines="",
                        tms=False, desc_iter=False):
    """``(init, tile, drain, reinit, fold)`` device functions around ``cuda/gemm_tile.cu`` built
    with ``MK_PUBLISHER=publisher``, ``MK_B_KN=b_kn`` and ``MK_TMA_STORE=tms`` (see the
    helper's header; b_kn: B is [k, n], not [n, k]; drain: None, or with ``tms`` the block's
    end; reinit: the ring started afresh, of the library's own gemm_tile.cu only, else None;
    fold: a split-K fold, None for the whole-tile builds, ping-pong and ``tms``;
    :class:`TileBuild`), or with ``pingpong`` (True, or a shape: :func:`pp_shape`) around
    ``cuda/gemm_pingpong.cu`` (no publisher; the same calling sequence; no reinit; with
    ``desc_iter`` its descriptor variant: :data:`SM90_PP_VARIANTS`). ``helper``: another
    source with gemm_tile.cu's entry points (a probe's variant, e.g.
    ``benchmarks/cuda/gemm_epilogues.cu``, which may include the library's files by name:
    :func:`linked_source`; no reinit), ``defines`` prepended to it. Launch with
    ``sm90_smem_bytes(pingpong, tms)`` and ``sm90_threads(publisher)``."""
    if pingpong and (publisher or tms):
        raise MkValueError("the ping-pong tile is built without a publisher warp or tensor "
                           "stores")
    if publisher and tms:
        raise MkValueError("the tensor-store tile publishes its flags at the block's end: "
                           "no publisher warp")
    pingpong = pp_shape(pingpong)
    if desc_iter and not pingpong:
        raise MkValueError("the descriptor variant is the ping-pong tile's")
    key = (bool(publisher), bool(b_kn), pingpong, helper, defines, bool(tms), bool(desc_iter))
    if key not in _SM90_BUILDS:
        # the library's gemm_tile.cu without the publisher warp: the builds whose restart
        # ran on a GPU (mk.Gemm's tail split; the publisher build's has not)
        own = helper is None and not pingpong and not publisher
        helper = linked_source(helper or (PINGPONG_HELPER if pingpong else HELPER),
                               defines + sm90_defines(publisher, b_kn, tms, pingpong, desc_iter))
        prefix = "mk_gemm_sm90pp" if pingpong else "mk_gemm_sm90"
        u64, i32 = types.uint64, types.int32
        init_fn = cuda.declare_device(f"{prefix}_init", i32(u64, u64), link=[helper],
                                      abi="c")
        tile_fn = cuda.declare_device(
            f"{prefix}_tile",
            i32(u64, u64, u64, i32, i32, u64, i32, i32, i32, i32, i32, i32, i32),
            link=[helper], abi="c")

        @cuda.jit(device=True)
        def gemm_init(smem, tmaps):
            """Once per block before the first tile (the caller then syncs the block)."""
            init_fn(data_ptr(smem), data_ptr(tmaps))

        @cuda.jit(device=True)
        def gemm_tile(smem, tmaps, a, b, c, c_row0, addend, adds, m, n, k, tile_m, tile_n,
                      seq):
            """One tile through TMA + wgmma (128 x 256, ping-pong its shape); a and b are
            read through ``tmaps`` (B's layout is the build's: MK_B_KN)."""
            k_iters = (k + SM90_BK - 1) // SM90_BK
            return tile_fn(data_ptr(smem), data_ptr(tmaps), data_ptr(c), np.int32(c.shape[1]),
                           np.int32(c_row0), data_ptr(addend), np.int32(adds), np.int32(m),
                           np.int32(n), np.int32(tile_m), np.int32(tile_n), np.int32(k_iters),
                           np.int32(seq))
        # after the block's last tile, every thread: drain(1) its tensor stores are complete,
        # drain(0) they have read shared memory; returns 0..DRAIN_PUBLISHERS - 1 in the
        # threads that publish (or record) its flags, else -1
        drain = (cuda.declare_device(f"{prefix}_drain", i32(i32), link=[helper], abi="c")
                 if tms else None)
        # between two runs of tiles whose ring phases do not continue (the caller syncs the
        # block before and after): every barrier invalidated and initialised again
        if own:
            reinit_fn = cuda.declare_device(f"{prefix}_reinit", i32(u64, u64), link=[helper],
                                            abi="c")

            @cuda.jit(device=True)
            def reinit(smem, tmaps):
                reinit_fn(data_ptr(smem), data_ptr(tmaps))
        else:
            reinit = None
        if pingpong or tms:
            fold = None       # whole tiles only (TileBuild.gemm_only): no split-K
        else:
            fold_fn = cuda.declare_device(f"{prefix}_fold",
                                          i32(u64, i32, i32, i32, u64, i32, i32, i32, i32),
                                          link=[helper], abi="c")

            @cuda.jit(device=True)
            def fold(c, c_row0, addend, adds, m, n, tile_n):
                """A split-K fold's band (the fold contract): ``mk_gemm_sm90_fold``."""
                return fold_fn(data_ptr(c), np.int32(c.shape[1]), np.int32(c_row0),
                               np.int32(c.shape[0]), data_ptr(addend), np.int32(adds),
                               np.int32(m), np.int32(n), np.int32(tile_n))
        _SM90_BUILDS[key] = (gemm_init, gemm_tile, drain, reinit, fold)
    return _SM90_BUILDS[key]


def linked_source(helper, defines=""):
    """A linked helper (``cuda/*.cu``) as NVRTC gets it: ``defines`` prepended and each
    ``#include "*.cuh"`` (or ``"*.cu"``) of ours replaced by that file, from the helper's
    directory or else from the library's ``cuda/``, the first time it is met (a header that
    others include too is pasted once: ``#pragma once`` means nothing in one pasted file;
    NVRTC, as numba drives it, searches no directory of ours). Written to the temp
    directory under a name made from its content, so every process (and rank) that asks for
    the same build shares one file."""
    import hashlib
    import re
    import tempfile
    here = os.path.dirname(helper)
    pasted = set()

    def paste(name):
        if name in pasted:
            return ""
        pasted.add(name)
        path = os.path.join(here, name)
        return expand(path if os.path.exists(path) else os.path.join(LIBRARY_CUDA, name))

    def expand(path):
        with open(path) as f:
            text = f.read()
        return re.sub(r'^#include "([\w.]+\.cuh?)"$', lambda m: paste(m.group(1)), text,
                      flags=re.M)

    text = defines + expand(helper)
    digest = hashlib.sha1(text.encode()).hexdigest()[:16]
    stem = os.path.splitext(os.path.basename(helper))[0]
    path = os.path.join(tempfile.gettempdir(), f"mknumba-{stem}-{digest}.cu")
    if not os.path.exists(path):
        tmp = f"{path}.{os.getpid()}"
        with open(tmp, "w") as f:
            f.write(text)
        os.replace(tmp, path)     # atomic: a concurrent rank reads the old or the new, whole
    return path


if not SIMULATOR:
    gemm_init_sm90, gemm_tile_sm90, _, gemm_reinit_sm90, gemm_fold_sm90 = sm90_tile_functions()


# ---- bf16 <-> fp32 on raw bits -----------------------------------------------------------------
if SIMULATOR:
    def _f32_bits(x):
        with np.errstate(over="ignore"):      # a value past float32's range becomes +-inf
            return int(np.array([x], dtype=np.float32).view(np.uint32)[0])

    def _bits_f32(u):
        return np.array([u & 0xFFFFFFFF], dtype=np.uint32).view(np.float32)[0]

    def _bits_device(fn):
        """The simulator calls these as plain functions: numba's simulated device call swaps
        the module's ``cuda`` global around each call, costing more than the conversion, and
        these use no ``cuda``."""
        return fn
else:
    @cuda.jit(device=True, inline=True)
    def _f32_bits(x):
        return np.uint32(cuda.libdevice.float_as_int(np.float32(x)))

    @cuda.jit(device=True, inline=True)
    def _bits_f32(u):
        return cuda.libdevice.int_as_float(np.int32(u))

    _bits_device = cuda.jit(device=True, inline=True)


@_bits_device
def bf16_to_f32(bits):
    """bf16 stored as 16 bits -> float32 (exact: bf16 is the top half of a float32)."""
    return _bits_f32((np.uint32(bits) & np.uint32(0xFFFF)) << np.uint32(16))


@_bits_device
def bf16_hi_to_f32(u):
    """The bf16 in the upper half of a uint32 -> float32 (one mask)."""
    return _bits_f32(np.uint32(u) & np.uint32(0xFFFF0000))


@_bits_device
def f32_to_bf16(x):
    """float32 -> bf16 bits, round to nearest even (NaN stays NaN), as uint16."""
    u = _f32_bits(x)
    if (u & np.uint32(0x7FFFFFFF)) > np.uint32(0x7F800000):
        return np.uint16(0x7FC0)
    u += np.uint32(0x7FFF) + ((u >> np.uint32(16)) & np.uint32(1))
    return np.uint16(u >> np.uint32(16))


if SIMULATOR:
    # The SIMT tiles, reduce and attention roles widen bf16 per element: in the simulator they
    # read a table of every bf16's float32, 5x cheaper a call (tests/test_simulator.py checks it
    # against the functions above, kept as *_bits, on all 2**16 inputs).
    bf16_to_f32_bits, bf16_hi_to_f32_bits = bf16_to_f32, bf16_hi_to_f32
    _BF16_F32 = (np.arange(1 << 16, dtype=np.uint32) << np.uint32(16)).view(np.float32)

    def bf16_to_f32(bits):
        return _BF16_F32[int(bits) & 0xFFFF]

    def bf16_hi_to_f32(u):
        return _BF16_F32[(int(u) >> 16) & 0xFFFF]


# ---- generic SIMT twin ------------------------------------------------------------------------
@cuda.jit(device=True)
def gemm_init_simt(smem, tmaps):
    """No ring to set up; present so both tiles have the same calling sequence."""
    pass


def _simt_tile(b_kn):
    """The SIMT tile reading B as [n, k] or, with ``b_kn`` (a constant of the build), [k, n]."""

    @cuda.jit(device=True)
    def gemm_tile_simt(smem, tmaps, a, b, c, c_row0, addend, adds, m, n, k, tile_m, tile_n,
                       seq):
        """One SIMT_TILE tile of C = A @ B^T: threads stride over its elements, fp32 dot
        products (plus ``adds`` planes of ``addend``: the product rounded to bf16 first, as
        the sm90 tile's partial is, then the sum rounded once)."""
        r0 = tile_m * SIMT_TILE[0]
        c0 = tile_n * SIMT_TILE[1]
        rows = min(SIMT_TILE[0], m - r0)
        cols = min(SIMT_TILE[1], n - c0)
        for e in range(cuda.threadIdx.x, rows * cols, cuda.blockDim.x):
            i = r0 + e // cols
            j = c0 + e % cols
            acc = np.float32(0.0)
            for kk in range(k):
                acc += bf16_to_f32(a[i, kk]) * bf16_to_f32(b[kk, j] if b_kn else b[j, kk])
            if adds > 0:
                acc = bf16_to_f32(f32_to_bf16(acc))
                for p in range(1, adds + 1):
                    acc += bf16_to_f32(addend[p, i, j])
            c[i - c_row0, j] = f32_to_bf16(acc)
        cuda.syncthreads()  # every store of the tile is issued before thread 0 reports it
        return cuda.threadIdx.x == 0
    return gemm_tile_simt


gemm_tile_simt = _simt_tile(False)
gemm_tile_simt_kn = _simt_tile(True)


@cuda.jit(device=True)
def fold_simt(c, c_row0, addend, adds, m, n, tile_n):
    """The SIMT twin's split-K fold (the fold contract above): threads stride over the band's
    elements, an fp32 sum of the planes, rounded once."""
    c0 = tile_n * SIMT_TILE[1]
    rows = min(c.shape[0], m - c_row0)
    cols = min(SIMT_TILE[1], n - c0)
    for e in range(cuda.threadIdx.x, rows * cols, cuda.blockDim.x):
        i = e // cols
        j = c0 + e % cols
        acc = np.float32(0.0)
        for p in range(1, adds + 1):
            acc += bf16_to_f32(addend[p, c_row0 + i, j])
        c[i, j] = f32_to_bf16(acc)
    cuda.syncthreads()  # every store of the band is issued before thread 0 reports it
    return cuda.threadIdx.x == 0


def make_compute_role(build, destination, grouped=None, stamps=None, units=None,
                      publish=True):
    """The compute role around one tile build (:class:`TileBuild`: the plain GEMM and the
    fused kernels); ``b`` is [n, k], or [k, n] when ``build.b_kn``.

    ``compute_role(smem, tmaps, a, b, order, tiles_n, blk, blocks, epoch, where)``: compute
    block ``blk`` of ``blocks`` computes tiles ``order[blk], order[blk + blocks], ...`` (linear
    ids ``t = tile_m * tiles_n + tile_n``) and announces each with ``flags[idx] = epoch`` behind
    a release; with ``publish`` False, for a kernel in which nothing waits on these flags,
    records it with ``primitives.record`` instead (read by the host once the kernel is done: no
    fence waits for the tile's stores). ``destination = (place, ready)``: ``place(where, t,
    tile_m) -> (c, c_row0, addend, adds, flags, idx, system)`` says where the tile goes (``c``
    from global row ``c_row0`` on; ``adds`` planes of ``addend`` to fold in, see the tile
    contract), the flag array and index that announce it, and whether the release is at system
    scope (the flag's reader is another GPU) or GPU scope; ``ready(where, t, adds, epoch)``
    waits, in every thread and before every tile, until the tile's inputs are there: the planes
    to fold in, or (AllGather + GEMM) the rows of A that other GPUs send (False: timed out,
    error recorded). Per thread, not block-wide: the sm_90a tile's producer warp runs ahead into
    the next tile while the consumers finish this one, and a block barrier would stall it.
    ``where`` is the kernel's tuple of what they need (:data:`OWN_TILE`, :data:`TO_OWNER`,
    ``kernels.allgather_gemm``).

    ``grouped = (work, operands)`` (a grouped GEMM, ``kernels.moe_dispatch``): ``work(where,
    epoch, tiles)`` -> how many entries of ``order`` this call runs (``tiles`` is the planned
    length; it may wait, in every thread, for what decides it: the routing counts), and
    ``operands(where, tm, a, b, tmaps) -> (a, b, tmaps)`` the tile row's A (whose rows end
    where the tile's stores stop), B and tensor maps (one expert's). Default: every entry of
    ``order``, the role's own operands.

    ``stamps = (start, done)``: trace rows (``roles.blocks.stamp``); the role then takes
    ``tr, trace`` after ``where`` and, when ``tr``, stamps entry i of ``order`` in
    ``trace[start, i]`` before its tile and ``trace[done, i]`` after (thread 0's view).

    ``units``: the entries of ``order`` are work units, not tiles (see :func:`make_compute_tile`).
    """
    work = grouped[0] if grouped is not None else all_tiles
    tile_init = build.init
    compute_tile = make_compute_tile(build, destination, grouped, units, publish)
    finish = (nothing_after if build.drain is None
              else publish_after(build, destination, units, publish))
    mark = stamp if stamps is not None else no_stamp
    start, done = stamps if stamps is not None else (0, 0)

    @cuda.jit(device=True, inline=True)
    def tiles_loop(smem, tmaps, a, b, order, tiles_n, blk, blocks, epoch, where, tr, trace):
        tile_init(smem, tmaps)
        cuda.syncthreads()
        seq = 0
        tiles = work(where, epoch, order.shape[0])
        i = blk         # no range() with a run-time step, no 64-bit divide: see udiv32
        while i < tiles:
            mark(tr, trace, start, i)
            compute_tile(smem, tmaps, a, b, order[i], tiles_n, seq, epoch, where)
            mark(tr, trace, done, i)
            i += blocks
            seq += 1
        finish(smem, tmaps, a, b, order, tiles_n, blk, blocks, epoch, where, tiles)

    if stamps is not None:
        @cuda.jit(device=True)
        def traced_role(smem, tmaps, a, b, order, tiles_n, blk, blocks, epoch, where, tr,
                        trace):
            tiles_loop(smem, tmaps, a, b, order, tiles_n, blk, blocks, epoch, where, tr,
                       trace)
        return traced_role

    @cuda.jit(device=True)
    def compute_role(smem, tmaps, a, b, order, tiles_n, blk, blocks, epoch, where):
        # no stamps: no_stamp ignores its trace argument, any array will do
        tiles_loop(smem, tmaps, a, b, order, tiles_n, blk, blocks, epoch, where, False,
                   order)
    return compute_role


def make_compute_tile(build, destination, grouped=None, units=None, publish=True):
    """One tile of :func:`make_compute_role`'s loop, for kernels that hand tiles out
    themselves (the fused reductions' adaptive split, ``roles.controller``):
    ``compute_tile(smem, tmaps, a, b, t, tiles_n, seq, epoch, where)`` computes linear tile
    ``t`` as this block's ``seq``-th tile (after ``tile_init`` and a barrier, once per block),
    places and announces it as the role does (``publish``: as there). Per thread, no barrier.

    ``units(where, u, a, b, tmaps) -> (t, a, b, tmaps)``: ``t`` is a work unit ``u``, a part
    of tile ``t`` that reads the operands returned (split-K, ``kernels.gemm``: a slice of K);
    ``place`` and ``ready`` then get ``u`` where they get ``t``. Default: a unit is a tile."""
    place, ready = destination
    operands = grouped[1] if grouped is not None else same_operands
    unit = units if units is not None else whole_tile
    tile, n_dim = build.tile, 1 if build.b_kn else 0
    announce = release if publish else record

    @cuda.jit(device=True, inline=True)
    def compute_tile(smem, tmaps, a, b, u, tiles_n, seq, epoch, where):
        t, ua, ub, ut = unit(where, u, a, b, tmaps)
        tm = udiv32(t, tiles_n)
        ta, tb, tt = operands(where, tm, ua, ub, ut)
        m, k = ta.shape
        n = tb.shape[n_dim]
        c, c_row0, addend, adds, flags, idx, system = place(where, u, tm)
        if not ready(where, u, adds, epoch):   # each thread acquires the tile's inputs
            adds = 0              # timed out (recorded): store the product alone, go on
        if tile(smem, tt, ta, tb, c, c_row0, addend, adds, m, n, k, tm, t - tm * tiles_n,
                seq):
            announce(flags, idx, epoch, system)   # the tile's stores (its barrier) first
    return compute_tile


@cuda.jit(device=True, inline=True)
def prefetch_first(order, blk):
    """The early ramp (``TileBuild.early``), called by the kernel before the block's setup
    (``roles.blocks.begin``'s ticket, the tile's barriers, their block barriers): block
    ``blk``'s first entry of ``order`` on its way to the SM's L1, so that the compute role's
    load of it, on the path to the block's first TMA load, does not wait for L2 there."""
    if blk < order.shape[0]:
        prefetch_l1(order, blk)


@cuda.jit(device=True, inline=True)
def no_prefetch(order, blk):
    pass


def ramp_of(build):
    """What a kernel running ``build``'s compute role calls first, with its order and block:
    :func:`prefetch_first` for an early-ramp build, else nothing."""
    return prefetch_first if build.early else no_prefetch


@cuda.jit(device=True, inline=True)
def nothing_after(smem, tmaps, a, b, order, tiles_n, blk, blocks, epoch, where, tiles):
    """A block's tiles published their flags themselves (builds without a ``drain``)."""
    pass


def publish_after(build, destination, units=None, publish=True):
    """The end of :func:`make_compute_role`'s loop for a build with a ``drain``
    (:class:`TileBuild`), whose tiles publish nothing: every thread drains the block's
    outstanding stores, then :data:`DRAIN_PUBLISHERS` threads release the flags (``place`` of
    ``destination``) of the units ``order[blk], order[blk + blocks], ...`` the block ran, each
    thread every DRAIN_PUBLISHERS-th (their fences overlap: one warp). ``publish`` False: the
    drain waits only until the stores have read shared memory, and the flags are recorded."""
    place, drain = destination[0], build.drain
    unit = units if units is not None else whole_tile
    announce, complete = (release, np.int32(1)) if publish else (record, np.int32(0))

    @cuda.jit(device=True, inline=True)
    def publish_all(smem, tmaps, a, b, order, tiles_n, blk, blocks, epoch, where, tiles):
        j = drain(complete)
        if j >= 0:
            i = blk + j * blocks
            while i < tiles:
                u = order[i]
                tm = udiv32(unit(where, u, a, b, tmaps)[0], tiles_n)
                flags, idx, system = place(where, u, tm)[4:]
                announce(flags, idx, epoch, system)
                i += DRAIN_PUBLISHERS * blocks
    return publish_all


@cuda.jit(device=True, inline=True)
def all_tiles(where, epoch, tiles):
    """Every entry of the tile order (the default ``work`` of :func:`make_compute_role`)."""
    return tiles


@cuda.jit(device=True, inline=True)
def whole_tile(where, u, a, b, tmaps):
    """Each work unit a whole tile (the default ``units`` of :func:`make_compute_tile`)."""
    return u, a, b, tmaps


@cuda.jit(device=True, inline=True)
def same_operands(where, tm, a, b, tmaps):
    """The role's own A, B and tensor maps for every tile (the default ``operands``)."""
    return a, b, tmaps


@cuda.jit(device=True, inline=True)
def own_tile(where, t, tm):
    """Every tile into one array: ``where = (c, flags, system, planes)``, tile ``t`` announced
    by ``flags[t]`` (the plain GEMM); nothing to fold in (``planes``: any [P, m, n] array, the
    tile's unread addend)."""
    c, flags, system, planes = where
    return c, 0, planes, 0, flags, t, system


@cuda.jit(device=True, inline=True)
def nothing_to_wait(where, t, adds, epoch):
    return True


@cuda.jit(device=True, inline=True)
def to_owner(where, t, tm):
    """The fused reductions on one node: each tile goes where it is summed.

    ``where = (planes, ptrs, owner_of_row, flags, flag_ptrs, tiles, me, G, slot, deliver,
    fold, out, out_row0, wait)``: ``planes`` is this GPU's [2, P, m, n] bf16-bits view of the
    symmetric partials (``ptrs``: its address table), plane 0 its own partials, planes 1.. an
    inbox per other local GPU; ``flags`` [P * tiles] the matching tile flags. ``deliver``: a
    tile whose row block another local GPU owns (``owner_of_row``) is written straight into
    that owner's inbox over NVLink, its flag released there (system scope), so the owner sums
    local memory only; a tile this GPU owns, or every tile when not ``deliver``, goes to plane
    0 with a local flag (system scope when ``G > 1`` and not ``deliver``: then the owners read
    it over NVLink). ``fold`` (ReduceScatter, with ``deliver``): a tile this GPU owns is
    finished here, its inbox planes added in the epilogue, straight into ``out`` (this rank's
    rows from ``out_row0``); ``wait = (deadline, err, rank)`` bounds :func:`inbox_ready`.
    """
    planes, ptrs, owner_of_row, flags, flag_ptrs, tiles, me, G, slot, deliver = where[:10]
    fold, out, out_row0 = where[10:13]
    o = owner_of_row[tm]
    if deliver and o != me:
        j = me - o if me > o else me - o + G         # my inbox there: peer_after(o, j) == me
        return (peer_view(ptrs, o, planes)[slot, j], 0, planes[slot], 0,
                peer_view(flag_ptrs, o, flags), j * tiles + t, True)
    if fold:
        return out, out_row0, planes[slot], G - 1, flags, t, False
    return planes[slot, 0], 0, planes[slot], 0, flags, t, G > 1 and not deliver


@cuda.jit(device=True, inline=True)
def inbox_ready(where, t, adds, epoch):
    """Wait (this thread, acquire at system scope) until every other local GPU has delivered
    tile ``t`` into its inbox plane here (:func:`to_owner` with ``fold``; nothing to wait for
    when ``adds`` is 0)."""
    flags, tiles = where[3], where[5]
    deadline, err, rank = where[13]
    for j in range(1, adds + 1):
        if not wait_flag(flags, j * tiles + t, epoch, deadline, err, rank, ROLE_COMPUTE):
            return False
    return True


#: (place, ready) pairs for make_compute_role
OWN_TILE = (own_tile, nothing_to_wait)
TO_OWNER = (to_owner, inbox_ready)


# ---- tile builds: what a kernel needs to run one tile implementation ---------------------------
#: init/tile: the device functions (tile contract above); shape: (BM, BN); threads per block;
#: smem_bytes: dynamic shared memory per block; tma: reads A and B through tensor maps (sm_90a);
#: timing_only: leaves the output unwritten (probes; the fused ops refuse it); b_kn: B is [k, n]
#: (row-major, N contiguous), not [n, k]; gemm_only: only mk.Gemm without split-K runs it (the
#: fused ops refuse it); drain: None, or a device function (int32 publish) -> int that the
#: tiles of a build which publishes no flag per tile need after the block's last one
#: (:func:`publish_after`);
#: c_map: the tile stores C through a third tensor map after A's and B's, of the caller's ``c``
#: (``kernels.gemm_inputs.TensorMaps`` with ``c_map``); reinit: None, or a device function
#: like ``init`` that starts the tile's state afresh after tiles ran (every thread of the block
#: past a barrier, and one after it), so that ``seq`` may restart at 0 with tiles of another
#: depth (mk.Gemm's tail split; the SIMT tile keeps no state: its ``init``); early: mk.Gemm's
#: kernel prefetches each block's first entry of the order before the block's setup
#: (:func:`ramp_of`; the ping-pong tile's "r" variants: :data:`SM90_PP_VARIANTS`); fold: None,
#: or the build's split-K fold (the fold contract, module docstring; mk.Gemm's split kernels).
TileBuild = namedtuple("TileBuild",
                       "init tile shape threads smem_bytes tma timing_only b_kn gemm_only drain "
                       "c_map reinit early fold",
                       defaults=(False, False, None, False, None, False, None))
_BUILDS = {"simt": TileBuild(gemm_init_simt, gemm_tile_simt, SIMT_TILE, SIMT_THREADS, 0, False,
                             False, reinit=gemm_init_simt, fold=fold_simt),
           "simt:kn": TileBuild(gemm_init_simt, gemm_tile_simt_kn, SIMT_TILE, SIMT_THREADS, 0,
                                False, False, True, reinit=gemm_init_simt, fold=fold_simt)}
if not SIMULATOR:
    _BUILDS["sm90"] = TileBuild(gemm_init_sm90, gemm_tile_sm90, SM90_TILE, SM90_THREADS,
                                SM90_SMEM_BYTES, True, False, reinit=gemm_reinit_sm90,
                                fold=gemm_fold_sm90)


class KernelBuilds:
    """The persistent kernels of one op, one per tile build, made on first use:
    ``builds(kind) -> (TileBuild, threads per block, kernel)``, ``make_kernel(build,
    threads)`` making the kernel (the SIMT tile runs 32 threads in the simulator, whose
    threads are Python threads)."""

    def __init__(self, make_kernel):
        import threading
        self.make_kernel, self.kernels, self.lock = make_kernel, {}, threading.Lock()

    def __call__(self, kind):
        b = tile_build(kind)
        with self.lock:
            if kind not in self.kernels:
                self.kernels[kind] = (threads_of(b), self.make_kernel(b, threads_of(b)))
        return (b, *self.kernels[kind])


def threads_of(build):
    """Threads per block a kernel runs ``build`` with: its own, except the SIMT tile in the
    simulator (32: the simulator's threads are Python threads)."""
    return 32 if SIMULATOR and not build.tma else build.threads


def sm90_build(publisher=False, b_kn=False, pingpong=False, helper=None, defines="",
               tms=False, desc_iter=False, early=False):
    """The :class:`TileBuild` of :func:`sm90_tile_functions` with these arguments (sm_90a).
    The library runs gemm_tile.cu without and, in the fused ops, with the publisher warp, each
    also with b_kn, and on request the ping-pong tile or the tensor-store tile (mk.Gemm only);
    ``benchmarks/probe_gemm_tile.py`` registers variants from its own sources (``helper``;
    :func:`register_tile`; ``desc_iter``, ``early``: the ping-pong tile's variants,
    :data:`SM90_PP_VARIANTS`)."""
    if early and not pingpong:
        raise MkValueError("the early ramp is a variant of the ping-pong tile (mk.Gemm only)")
    init, tile, drain, reinit, fold = sm90_tile_functions(publisher, b_kn, pingpong, helper,
                                                          defines, tms, desc_iter)
    return TileBuild(init, tile, pp_shape(pingpong) or SM90_TILE,
                     sm90_threads(publisher), sm90_smem_bytes(pingpong, tms), True, False, b_kn,
                     _whole_tiles(pingpong=pingpong, tms=tms), drain, tms, reinit, bool(early),
                     fold)


def _whole_tiles(pingpong=False, tms=False, **_):
    """An sm90 build's ``gemm_only`` from :func:`sm90_build`'s arguments: the ping-pong and
    the tensor-store tiles compute whole tiles only."""
    return bool(pingpong or tms)


#: the library's sm_90a builds other than "sm90" -> sm90_build's arguments, made on first use
_SM90_LAZY = {"sm90:kn": dict(b_kn=True),
              SM90_FUSED_TILE: dict(publisher=True),
              f"{SM90_FUSED_TILE}:kn": dict(publisher=True, b_kn=True),
              SM90_TMS_TILE: dict(tms=True),
              f"{SM90_TMS_TILE}:kn": dict(b_kn=True, tms=True)}
_SM90_LAZY.update({f"{pp_name(shape)}{kn}": dict(b_kn=bool(kn), pingpong=shape)
                   for shape in SM90_PINGPONG_SHAPES for kn in ("", ":kn")})
_SM90_LAZY.update({f"{pp_variant_name(shape, letters)}{kn}":
                   dict(b_kn=bool(kn), pingpong=shape,
                        **{SM90_PP_VARIANTS[x]: True for x in letters})
                   for shape in SM90_PINGPONG_SHAPES for kn in ("", ":kn")
                   for letters in ("d", "r", "dr")})


def is_sm90_name(name):
    """Whether ``name`` is one of the library's sm_90a tile builds (which the simulator knows
    by name but cannot run)."""
    return name == "sm90" or name in _SM90_LAZY


def whole_tiles_only(name):
    """Whether the tile build ``name`` computes whole tiles only (``TileBuild.gemm_only``: no
    split-K), known without making it (the simulator knows the sm_90a builds by name only)."""
    if name == "auto" or name == "sm90":
        return False
    if name in _SM90_LAZY:
        return _whole_tiles(**_SM90_LAZY[name])
    return tile_build(name).gemm_only


def tile_build(name):
    """The tile build called ``name``: ``"simt"``, ``"sm90"`` (the library's Hopper tile),
    ``SM90_FUSED_TILE``, the ping-pong builds (``SM90_PINGPONG_TILE`` and the other shapes'
    :func:`pp_name`), ``SM90_TMS_TILE`` (made on first use), or one added with
    :func:`register_tile`; any of the library's with ``":kn"`` appended (:func:`kn_kind`): the
    same tile reading B as [k, n]. Raises MkValueError for anything
    else, and in the simulator for the sm_90a builds."""
    if name not in _BUILDS and is_sm90_name(name):
        if SIMULATOR:
            raise MkValueError(f"the {name} tile needs a Hopper GPU (sm_90a); the simulator "
                               "runs 'simt'")
        _BUILDS[name] = sm90_build(**_SM90_LAZY[name])
    if name not in _BUILDS:
        raise MkValueError(f"no tile build {name!r} here (known: {sorted(_BUILDS)}"
                           f"{'' if SIMULATOR else ', ' + ', '.join(map(repr, _SM90_LAZY))}"
                           ", each of the library's also with ':kn')")
    return _BUILDS[name]


def kn_kind(kind, op="mknumba"):
    """The name of the build ``kind`` reading B as [k, n] (row-major) instead of [n, k]; a
    build without one (e.g. a probe's, :func:`register_tile`) raises MkValueError."""
    name = f"{kind}:kn"
    try:
        tile_build(name)
    except MkValueError:
        raise MkValueError(f"{op}: tile build {kind!r} has no variant reading b as [k, n] "
                           "(row-major); pass b as a column-major view (w.T of a row-major "
                           "[n, k] w)") from None
    return name


def register_tile(name, build):
    """Add a :class:`TileBuild` under ``name`` (probes that time variants of a tile, e.g.
    ``benchmarks/probe_gemm_tile.py`` with :func:`sm90_build`); the kernels then take
    ``tile=name``."""
    if name in _BUILDS:
        raise MkValueError(f"tile build {name!r} exists already")
    _BUILDS[name] = build


__all__ = ["SM90_TILE", "SM90_THREADS", "SM90_FUSED_TILE", "SM90_SMEM_BYTES",
           "SM90_PINGPONG_TILE", "SM90_PINGPONG_SHAPE", "SM90_PINGPONG_SHAPES", "pp_name",
           "pp_shape", "pp_stages", "SM90_PP_VARIANTS", "pp_variant_name", "ramp_of",
           "SM90_TMS_TILE", "is_sm90_name",
           "whole_tiles_only",
           "SIMT_TILE", "SIMT_THREADS",
           "sm90_smem_bytes", "sm90_threads", "sm90_tile_functions", "sm90_build",
           "sm90_defines", "publish_after",
           "gemm_init_simt", "gemm_tile_simt", "gemm_tile_simt_kn", "bf16_to_f32",
           "bf16_hi_to_f32", "f32_to_bf16", "make_compute_role", "make_compute_tile",
           "own_tile", "to_owner", "TileBuild", "tile_build", "kn_kind", "threads_of",
           "KernelBuilds", "register_tile",
           "HELPER"] + ([] if SIMULATOR else ["gemm_init_sm90", "gemm_tile_sm90"])
