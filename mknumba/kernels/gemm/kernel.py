"""The persistent GEMM kernel: the compute role over whole tiles, split-K's units, or both.

Split-K (``plan.split_k_for``): when the output has few tiles for the compute blocks and K is
long (with "auto", past ``plan.PP_MAX_K`` or into more than ``plan.PP_MAX_SLICES`` slices: else
the ping-pong tiles run instead), each tile's K is cut into ``s`` slices. The work units are
then (tile t, slice j), each computing its slice into plane ``1 + j`` of a bf16 workspace and
publishing ``flags[(1 + j) * tiles + t] = epoch``, and then the tile's fold, which reads no K:
it waits for the tile's ``s`` flags and sums the planes into C (an fp32 sum, rounded once: the
build's ``fold``, ``roles.compute``'s fold contract; the sm_90a one reads them with many 16-byte
loads in flight per thread, ``fold_planes`` in ``roles/cuda/gemm_common.cuh``). A tile's fold is
cut into ``parts`` units, each a band of its rows (``plan.fold_parts_for``: as many as keep the
folds of all tiles to one round of the blocks), so that the sum runs on as many SMs as the
slices did (512 x 1024 x 8192 in 8 slices on an H100: 22.8 us, against 28.1 with one unit a
tile; benchmarks/NOTES.md). A fold takes no slice of its own because the compute role waits
before a tile starts: its slice would begin only once the others were done. The folds come after
every slice in the order (``plan.split_order``), and a block takes a unit only after its last
one, so a fold waits on units that run or ran, never on one queued behind it; and after a fold a
block runs only folds, which touch no ring slot, so the sm_90a ring's phases (``seq * k_iters``,
equal ``k_iters`` for every slice) stay right.

Tail split (``plan.tail_split_for``): when the tiles outnumber the compute blocks, the last
round of tiles may leave most blocks idle (448 tiles on 132 blocks: 3 full rounds, then 52
tiles while 80 blocks wait). Then only the last ``tail`` tiles of the grouped order are split:
the kernel (``_make_kernel(build, threads, "tail")``, :func:`tail_split_role`) runs two phases,
each a compute role over its part of the order. Phase 1: the first ``tiles - tail`` tiles
whole, as the unsplit kernel runs them (:func:`whole_tiles`: into C, ``flags[t]``; the tensor
maps' first pair, slice 0's, sees all of K from 0 on, as the unsplit maps do). Then a block
barrier, and phase 2: the tail's units as split-K runs them (:func:`split_units`; units
``j * tiles + t`` of the tail tiles t, every slice, then the fold units: ``plan.split_order``
with ``tail``; the same flags and workspace planes), from ``seq`` 0 on a ring started afresh
(``TileBuild.reinit``, ``mk_gemm_sm90_reinit``): phase 1's tiles run ``K / 64`` k-steps, the
slices fewer, and the tile's ring phase ``seq * k_iters`` assumes one depth per run. The barrier
comes after every thread's last phase-1 tile (the producer warp, which leaves each tile once
its loads are queued, meets it too), so the consumers have waited on every full barrier: no
copy is in flight when the ring is invalidated. The folds still wait on units that run or ran:
phase 1 waits on nothing, so every block reaches phase 2; there a block takes units in order,
and a fold comes after every slice of the tail, as in split-K. The planes are full [m, n] ones,
as split-K's (the tail's tiles are columns of the grouped order, not a band of rows).
"""
import numpy as np

from ... import _compat  # noqa: F401  (numpy alias before numba compiles anything)
from ... import primitives as prim
from ..._compat import SIMULATOR
from ...errors import ROLE_COMPUTE
from ...roles import compute
from ...roles.blocks import begin
from ..gemm_inputs import TensorMaps
from ..launch import array_type
from numba import cuda, types

Bits2D, Bits3D = array_type(np.uint16, 2), array_type(np.uint16, 3)
Words64, Flags, Ints = array_type(np.uint64, 1), array_type(np.uint32, 1), array_type(np.int32, 1)
Record = array_type(np.int64, 1)

# The simulator sizes dynamic shared arrays with dtype.itemsize, so it needs a dtype instance.
_BYTE = np.dtype(np.uint8) if SIMULATOR else np.uint8


@cuda.jit(device=True, inline=True)
def whole_tiles(where, u, tm):
    """No split: tile u into C, announced in ``flags[u]`` (``place`` of :func:`split_units`
    built without a split: C and no fold, constants, as the sm_90a epilogue's global stores
    need)."""
    return where[0], 0, where[2], 0, where[1], u, False


def split_units(build, split=True):
    """``(units, place, ready)`` of the compute role (``roles.compute.make_compute_tile``)
    for the units of ``plan.split_order``, with ``where = (c, flags, ws, slices, kc, tiles,
    timeout_ns, err, parts)``: ``flags`` [(slices + 1) * tiles], the tiles' then the slices';
    ``ws`` [slices + 1, m, n] bf16, plane 1 + j slice j's partials (one slice: any [P, m, n]
    array, never read); a fold unit waits at most ``timeout_ns`` for a flag, then writes the
    error record ``err`` (:data:`ROLE_COMPUTE`); ``parts`` fold units a tile. The compute role
    runs them with :func:`tile_or_fold`. ``split`` False: every unit a whole tile (one
    slice)."""
    if not split:
        return compute.whole_tile, whole_tiles, compute.nothing_to_wait
    tma, kn, words, bm = build.tma, build.b_kn, TensorMaps.ROW, build.shape[0]

    @cuda.jit(device=True, inline=True)
    def unit(where, u, a, b, tmaps):
        """Tile and operands of unit u: slice j reads K from j * kc, ``kc`` deep (the SIMT
        tile: to the end of K at most); a fold unit (j >= slices) reads none. The sm_90a tile reads
        through slice j's tensor maps, so its views carry only the depth: every slice runs the
        same k-steps (the maps read zeros past K), as the ring's phases need."""
        slices, kc, tiles = where[3], where[4], where[5]
        j = prim.udiv32(u, tiles)
        lo = j * kc
        hi = lo + kc if j < slices else lo
        row = j if j < slices else 0
        if tma:
            hi, lo = hi - lo, 0
        return (u - j * tiles, a[:, lo:hi], b[lo:hi, :] if kn else b[:, lo:hi],
                tmaps[row * words:(row + 1) * words])

    @cuda.jit(device=True, inline=True)
    def place(where, u, tm):
        """Slice j of several: into plane 1 + j, announced in ``flags[tiles + u]``. The one
        slice: into C, announced in ``flags[t]``. Fold unit p (j = slices + p): the sum of
        planes 1..slices into band p of the tile's ``parts`` (rows ``tm * bm + p * bm /
        parts``, as many; C's rows from there, none past m), announced in ``flags[t]`` (by
        each of the tile's fold units: it holds once the kernel is done)."""
        c, flags, ws, slices, tiles = where[0], where[1], where[2], where[3], where[5]
        j = prim.udiv32(u, tiles)
        if slices > 1 and j < slices:
            return ws[1 + j], 0, ws, 0, flags, tiles + u, False      # flags: this GPU's
        if slices == 1:
            return c, 0, ws, 0, flags, u, False
        band = prim.udiv32(bm, where[8])
        lo = min(tm * bm + (j - slices) * band, c.shape[0])
        return c[lo:min(lo + band, c.shape[0])], lo, ws, slices, flags, u - j * tiles, False

    @cuda.jit(device=True, inline=True)
    def ready(where, u, adds, epoch):
        """A fold unit (``adds`` planes): wait (this thread, acquire at GPU scope) for each
        slice's flag, at most ``timeout_ns`` from the first look; anything else waits for
        nothing."""
        if adds == 0:
            return True
        flags, tiles, timeout_ns, err = where[1], where[5], where[6], where[7]
        t = u - prim.udiv32(u, tiles) * tiles
        deadline = prim.globaltimer() + timeout_ns     # here: not a register the tile carries
        for j in range(1, adds + 1):
            if not prim.wait_flag(flags, j * tiles + t, epoch, deadline, err, 0,
                                  ROLE_COMPUTE, 100, False):
                return False
        return True

    return unit, place, ready


def tile_or_fold(build):
    """The tile function of the split kernels' compute role: a unit of :func:`split_units`
    with no K (a fold unit) runs the build's ``fold`` on the band of C that ``place`` gave it
    (``roles.compute``'s fold contract), any other unit the build's tile."""
    tile, fold = build.tile, build.fold

    @cuda.jit(device=True, inline=True)
    def split_tile(smem, tmaps, a, b, c, c_row0, addend, adds, m, n, k, tile_m, tile_n, seq):
        if k == 0:
            return fold(c, c_row0, addend, adds, m, n, tile_n)
        return tile(smem, tmaps, a, b, c, c_row0, addend, adds, m, n, k, tile_m, tile_n, seq)
    return split_tile


def tail_split_role(build):
    """The tail split's compute role (module docstring), called as
    ``roles.compute.make_compute_role``'s: with ``order`` = ``plan.split_order`` with a
    ``tail``, it runs the whole tiles first (the unsplit role), then, after a block barrier, the
    tail's units (the split role, its tile state started afresh: ``build.reinit``). The tail's
    length follows from the order's: ``tiles - tail + (slices + parts) * tail`` units."""
    whole_role = compute.make_compute_role(build, (whole_tiles, compute.nothing_to_wait),
                                           publish=False)   # the folds read slice flags only
    unit, place, ready = split_units(build)
    tail_role = compute.make_compute_role(
        build._replace(init=build.reinit, tile=tile_or_fold(build)), (place, ready), units=unit)

    @cuda.jit(device=True, inline=True)
    def two_phases(smem, tmaps, a, b, order, tiles_n, blk, blocks, epoch, where):
        slices, tiles, parts = where[3], where[5], where[8]
        whole = tiles - prim.udiv32(order.shape[0] - tiles, slices + parts - 1)
        whole_role(smem, tmaps, a, b, order[:whole], tiles_n, blk, blocks, epoch, where)
        cuda.syncthreads()    # every thread done with phase 1's ring before it starts afresh
        tail_role(smem, tmaps, a, b, order[whole:], tiles_n, blk, blocks, epoch, where)
    return two_phases


def _make_kernel(build, threads, split):
    """The persistent kernel around one tile build (``roles.compute.TileBuild``), with
    :func:`split_units`, (not ``split``) whole tiles only, or (``split="tail"``) both: whole
    tiles, then a split tail (:func:`tail_split_role`). Three kernels, not one: a tile
    whose destination is chosen per unit stores through generic addresses, and the unsplit
    GEMM (every large one) keeps its global stores and registers."""
    bounds = {} if SIMULATOR else {"launch_bounds": (threads, 1)}
    if split == "tail":
        compute_role = tail_split_role(build)
    else:
        unit, place, ready = split_units(build, split)
        # whole tiles' flags are read by nothing in the kernel: recorded, not released
        compute_role = compute.make_compute_role(
            build._replace(tile=tile_or_fold(build)) if split else build, (place, ready),
            units=unit, publish=bool(split))
    bn, n_dim = build.shape[1], 1 if build.b_kn else 0
    ramp = compute.ramp_of(build)

    @cuda.jit(**bounds)
    def gemm_kernel(a: Bits2D, b: Bits2D, c: Bits2D, ws: Bits3D, tmaps: Words64, flags: Flags,
                    frame: Words64, order: Ints, compute_blocks: types.int64, tiles: types.int64,
                    slices: types.int64, kc: types.int64, parts: types.int64,
                    timeout_ns: types.uint64, err: Record):
        """a [m, k], b [n, k] (or [k, n] with a ":kn" tile build), c [m, n]: bf16 bits; ws:
        the split's workspace [slices + 1, m, n] (one slice: c as [1, m, n], never read);
        tmaps: the tensor maps of a and b, a pair per slice (sm90); flags uint32[(slices +
        1) * tiles]: [0, tiles) := epoch when tile t is done (nothing in the kernel reads
        them: whole tiles record them with plain stores), the rest the slices'
        (split_units); frame: the op's call counter (``kernels.lifetime.Frame``); order
        int32: the work units (plan.split_order of sched.grouped_order, with the tail
        split's ``tail``); slices of kc (plan.split_slices), each tile's fold in ``parts``
        units (plan.fold_parts_for); a fold unit waits at most timeout_ns, then records the
        error in err (int64[ERR_WORDS], mapped)."""
        smem = cuda.shared.array(0, dtype=_BYTE)
        ramp(order, cuda.blockIdx.x)   # an early-ramp build: the block's first unit, into L1
        epoch, call = begin(frame)
        if cuda.blockIdx.x >= compute_blocks:
            return  # held back for other roles; nothing else runs in a plain GEMM
        where = (c, flags, ws, slices, kc, tiles, timeout_ns, err, parts)
        compute_role(smem, tmaps, a, b, order, (b.shape[n_dim] + bn - 1) // bn, cuda.blockIdx.x,
                     compute_blocks, epoch, where)

    return gemm_kernel


_KERNELS = {}   # (tile build name, split: False, True or "tail") -> the persistent kernel


def _build(kind, split=False):
    """(roles.compute.TileBuild, persistent kernel) of a tile build name, for split-K
    (True), whole tiles (False) or the tail split ("tail")."""
    b = compute.tile_build(kind)
    if (kind, split) not in _KERNELS:
        _KERNELS[kind, split] = _make_kernel(b, b.threads, split)
    return b, _KERNELS[kind, split]
