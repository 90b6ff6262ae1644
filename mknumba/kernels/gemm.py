"""Persistent GEMM on one GPU: ``mknumba.gemm(a, b)`` = a @ b, bf16 in and out, fp32 accumulation.

The kernel is the compute role on its own (``roles.compute.make_compute_role``, the same role
the fused kernels run): a persistent grid (``sched.plan_grid``) whose first ``compute_blocks``
blocks walk the output tiles in grouped raster order (``sched.grouped_order``), computing each
with the role's tile function and publishing each finished tile ``t = tile_m * tiles_n + tile_n``
with ``tile_flags[t] = epoch``. The blocks held back (``reserved_sms``) return at once here; in
the fused kernels they run the communication roles and consume those flags.

Split-K (:func:`split_k_for`): when the output has few tiles for the compute blocks and K is
long (with "auto", past :data:`PP_MAX_K` or into more than :data:`PP_MAX_SLICES` slices: else
the ping-pong tiles run instead), each tile's K is cut into ``s`` slices. The work units are
then (tile t, slice j), each computing its slice into plane ``1 + j`` of a bf16 workspace and
publishing ``flags[(1 + j) * tiles + t] = epoch``, and then the tile's fold, which reads no K:
it waits for the tile's ``s`` flags and sums the planes into C (an fp32 sum, rounded once: the
build's ``fold``, ``roles.compute``'s fold contract; the sm_90a one reads them with many 16-byte
loads in flight per thread, ``fold_planes`` in ``roles/cuda/gemm_common.cuh``). A tile's fold is
cut into ``parts`` units, each a band of its rows (:func:`fold_parts_for`: as many as keep the
folds of all tiles to one round of the blocks), so that the sum runs on as many SMs as the
slices did (512 x 1024 x 8192 in 8 slices on an H100: 22.8 us, against 28.1 with one unit a
tile; benchmarks/NOTES.md). A fold takes no slice of its own because the compute role waits
before a tile starts: its slice would begin only once the others were done. The folds come after
every slice in the order, and a block takes a unit only after its last one, so a fold waits on
units that run or ran, never on one queued behind it; and after a fold a block runs only folds,
which touch no ring slot, so the sm_90a ring's phases (``seq * k_iters``, equal ``k_iters`` for
every slice) stay right.

Tail split (:func:`tail_split_for`): when the tiles outnumber the compute blocks, the last
round of tiles may leave most blocks idle (448 tiles on 132 blocks: 3 full rounds, then 52
tiles while 80 blocks wait). Then only the last ``tail`` tiles of the grouped order are split:
the kernel (``_make_kernel(build, threads, "tail")``, :func:`tail_split_role`) runs two phases,
each a compute role over its part of the order. Phase 1: the first ``tiles - tail`` tiles
whole, as the unsplit kernel runs them (:func:`whole_tiles`: into C, ``flags[t]``; the tensor
maps' first pair, slice 0's, sees all of K from 0 on, as the unsplit maps do). Then a block
barrier, and phase 2: the tail's units as split-K runs them (:func:`split_units`; units
``j * tiles + t`` of the tail tiles t, every slice, then the fold units: :func:`split_order`
with ``tail``; the same flags and workspace planes), from ``seq`` 0 on a ring started afresh
(``TileBuild.reinit``, ``mk_gemm_sm90_reinit``): phase 1's tiles run ``K / 64`` k-steps, the
slices fewer, and the tile's ring phase ``seq * k_iters`` assumes one depth per run. The barrier
comes after every thread's last phase-1 tile (the producer warp, which leaves each tile once
its loads are queued, meets it too), so the consumers have waited on every full barrier: no
copy is in flight when the ring is invalidated. The folds still wait on units that run or ran:
phase 1 waits on nothing, so every block reaches phase 2; there a block takes units in order,
and a fold comes after every slice of the tail, as in split-K. The planes are full [m, n] ones,
as split-K's (the tail's tiles are columns of the grouped order, not a band of rows).

Tile implementations: ``"sm90"`` (TMA + wgmma, Hopper, 128 x 256 tiles), ``"sm90:pp"`` (the
ping-pong schedule, 128 x 128 tiles, ``roles.compute.SM90_PINGPONG_TILE``; no split-K; "auto"
takes it where 128 x 256 tiles are few and K <= ``PP_MAX_K``, or fill their rounds poorly and
K <= ``TMS_MAX_K``: ``pp_for``; also in 128 x 64,
64 x 128 and 64 x 64 tiles, ``"sm90:pp:<BM>x<BN>"``, which "auto" takes there by the tiles'
count: ``pp_shape_for``, in the variant ``PP_AUTO_VARIANT`` names: ``pp_auto_name``),
``"sm90:tms"`` (the sm90 tile whose epilogue leaves by TMA tensor stores it does not wait
for, ``roles.compute.SM90_TMS_TILE``; no split-K: its tile flags go out at each block's end,
after its stores completed; "auto" takes it for unsplit shapes with K <= ``TMS_MAX_K``) or
``"simt"`` (the generic twin: the CUDA simulator and GPUs without sm_90a), each reading B as
given: [n, k] (or a ``w.T`` view of one), or row-major [k, n] through its ``":kn"`` build
(``kernels.gemm_inputs``). Calls go through the launch frame (``kernels.launch``): planned
once per shape and layout of B, then an address bind and one driver launch. The plans of one
op may run different kernels ("auto": the ping-pong, tensor-store or default build by shape;
B's two layouts), but all launch the grid of its call counter (:func:`shared_bps`).
"""
import threading

import numpy as np

from .. import _compat  # noqa: F401  (numpy alias before numba compiles anything)
from .. import primitives as prim
from .._compat import SIMULATOR
from ..arrays import (check_device, is_torch, new_output, operand, refuse_overlap, torch_ptr,
                      unshared)
from ..errors import (ERR_SET, ERR_WORDS, ROLE_COMPUTE, MkError, MkValueError, positive_ints,
                      raise_if_timed_out)
from ..roles import compute
from ..roles.blocks import begin
from ..runtime import default_timeout_ns
from ..sched.tiles import cdiv, gemm_group_m, grouped_order, plan_grid
from .gemm_inputs import NoTensorMaps, TensorMaps, b_kn, b_mode, b_shape
from .launch import Launch, Slot, array_type, compile_kernel
from .lifetime import Frame
from .streams import StreamOrder, is_capturing, outputs_in_capture, stream_handle
from numba import cuda, types

__all__ = ["gemm", "Gemm", "split_k_for", "tail_split_for", "pp_for", "pp_shape_for",
           "pp_auto_name"]

Bits2D, Bits3D = array_type(np.uint16, 2), array_type(np.uint16, 3)
Words64, Flags, Ints = array_type(np.uint64, 1), array_type(np.uint32, 1), array_type(np.int32, 1)
Record = array_type(np.int64, 1)

# The simulator sizes dynamic shared arrays with dtype.itemsize, so it needs a dtype instance.
_BYTE = np.dtype(np.uint8) if SIMULATOR else np.uint8

#: split-K: K is cut in whole k-steps of the sm_90a tile (the SIMT tile takes the same cuts)
SPLIT_BK = compute.SM90_BK
#: the fewest k-steps a slice gets from :func:`split_k_for`: a split pays a fixed cost per slice
#: and fold (the slice's ring filling and partial tile stored, the fold's wait and read of the
#: partials: together about what 12-16 k-steps of the sm90 tile take), so a slice carries at
#: least that
SPLIT_MIN_STEPS = 16
#: the tail split (:func:`tail_split_for`) only where it can save at least this fraction of
#: the kernel's time: slices and folds cost about as much as a round of tiles loses by small
#: tails of many rounds (8192 x 28672 x 4096 on an H200: 55 rounds, 2-4% slower; 4096^3 with
#: 8 SMs held back: 5 rounds, 17% faster: benchmarks/NOTES.md)
TAIL_MIN_GAIN = 0.05
#: the most slices of a split tail: its workspace is ``s + 1`` planes the size of C (full
#: planes, as split-K's), and tails were measured up to 4 slices
TAIL_MAX_SLICES = 4
#: the thinnest band of a tile's rows one fold unit sums (:func:`fold_parts_for`): 16 rows of
#: the sm90 tile are two rows for each of its 256 summing threads, all their loads at once
FOLD_MIN_ROWS = 16
#: the most units a tile's fold is cut into (:func:`fold_parts_for`; 1: one unit a tile)
FOLD_MAX_PARTS = 8


def fold_parts_for(tiles, blocks, bm):
    """Fold units per split tile (each a band of ``bm / parts`` rows, see the module
    docstring): the most of 1, 2, 4, ... up to :data:`FOLD_MAX_PARTS` whose units, ``tiles *
    parts``, are no more than the compute blocks, and whose bands are no thinner than
    :data:`FOLD_MIN_ROWS` rows. Each unit waits for all of its tile's slices, so units beyond
    one round of the blocks would add their waits and fixed costs in turn."""
    parts = 1
    while (parts * 2 <= FOLD_MAX_PARTS and tiles * parts * 2 <= blocks and
           bm % (parts * 2) == 0 and bm // (parts * 2) >= FOLD_MIN_ROWS):
        parts *= 2
    return parts


def split_k_for(tiles, k, blocks):
    """Slices of K per output tile when ``split_k`` is left to the op: one output tile per
    compute block leaves ``blocks - tiles`` SMs idle, so when ``tiles`` is at most half of
    ``blocks``, each tile's K is cut into ``blocks // tiles`` slices (every slice of every tile
    then runs at once; the folds, one per tile, take the blocks left or a second turn), but no
    slice shorter than ``SPLIT_MIN_STEPS`` k-steps, so K of fewer than ``2 * SPLIT_MIN_STEPS``
    k-steps is not split (its unsplit time is mostly fixed costs, which a split adds to).
    Chosen from ``benchmarks/probe_split_k.py``'s timings on an H200, where it picks the
    fastest split at each of the probe's seven shapes (benchmarks/NOTES.md); 1: no split.
    ``Gemm(split_k=s)`` forces s (``benchmarks/bench_gemm.py --split-k``)."""
    return max(1, min(blocks // tiles, cdiv(k, SPLIT_BK) // SPLIT_MIN_STEPS))


def tail_split_for(tiles, k, blocks):
    """``(tail, s)``: the last ``tail`` tiles of the order cut into ``s`` slices of K each
    (the tail split, module docstring), or ``(0, 1)``: none. With more tiles than compute
    blocks, the last round runs ``tail = tiles % blocks`` tiles; when that leaves at least
    half the blocks idle (``0 < tail <= blocks // 2``), each of its tiles is cut into ``s =
    min(blocks // tail, k_steps // SPLIT_MIN_STEPS, TAIL_MAX_SLICES)`` slices (the tail's
    slices all run at once, none shorter than split-K's), one fewer when that divides the
    k-steps evenly and ``s`` does not (no ragged slice for one slice less), and no split
    below 2; and only where that can save :data:`TAIL_MIN_GAIN` of the time: the last
    round's ``1 - 1 / s`` of a round over ``ceil(tiles / blocks)`` rounds. Split-K
    (:func:`split_k_for`) takes the shapes with few tiles, this one those it leaves
    unsplit."""
    tail = tiles % blocks
    if tiles <= blocks or tail == 0 or tail > blocks // 2:
        return 0, 1
    steps = cdiv(k, SPLIT_BK)
    s = min(blocks // tail, steps // SPLIT_MIN_STEPS, TAIL_MAX_SLICES)
    if s > 2 and steps % s and steps % (s - 1) == 0:
        s -= 1
    if s < 2 or (1 - 1 / s) < TAIL_MIN_GAIN * cdiv(tiles, blocks):
        return 0, 1
    return tail, s


#: K up to which "auto" runs whole tiles through the TMA-store epilogue (``sm90:tms``): with
#: few k-steps a tile, its stores weigh most, and they leave without stalling the consumers;
#: from 4096 on the default epilogue is as fast or faster (an H200: benchmarks/NOTES.md)
TMS_MAX_K = 2048


#: K up to which "auto" runs the ping-pong tile where 128 x 256 tiles are few
#: (:func:`pp_for`); at 14336 the sm90 tile's two slices are faster (an H200: NOTES.md)
PP_MAX_K = 8192
#: slices of K (:func:`split_k_for`) from which "auto" splits few tiles rather than run the
#: ping-pong tile at K <= PP_MAX_K (:func:`pp_for`): 8 slices of 128 x 256 tiles, their folds
#: in 8 units a tile, ran 512 x 1024 x 8192 in 22.8 us against the 64 x 64 ping-pong tile's
#: 27.4 on an H100, while 4 slices lost to it (512 x 1024 x 4096, 1024 x 1024 x 8192:
#: benchmarks/NOTES.md)
PP_MAX_SLICES = 7


def pp_for(kind, m, n, k, blocks):
    """Whether "auto" takes a ping-pong tile (whole tiles, no split; which shape:
    :func:`pp_shape_for`) for a shape whose tile build would be ``kind`` on ``blocks`` compute
    blocks, in two regions:

    - where 128 x 256 tiles are few (at most half the blocks get one: split-K's region), up
      to :data:`PP_MAX_K` and where split-K's rule would cut K into at most
      :data:`PP_MAX_SLICES` slices. Smaller whole tiles beat the slices and folds there (an
      H200, gated: 512 x 4096 and 2048 x 1024 at K 512-8192 0.56-0.85x -> 0.78-0.87x cuBLAS;
      512 x 1024 at K 4096 / 8192 in 64 x 64 tiles 16.5 / 28.4 us against 4 / 8 slices'
      23.2 / 28.2; 1024 x 1024 in 128 x 64 tiles 17.8 / 32.5 us against 4 slices' 24.3 /
      35.3), while at K = 14336 the slices win;
    - where they are many but their last round leaves blocks idle and smaller tiles fill the
      rounds better: the ping-pong shape's rounds times its cost (:func:`pp_rounds_cost`)
      below the 128 x 256 tiles' rounds times :data:`SM90_TILE_COST`, at K up to
      :data:`TMS_MAX_K` (beyond, the tail split evens out the last round). On an H100:
      512 x 28672 (448 tiles, 4 rounds, against 7 of 128 x 128) at K 512 / 1024 / 2048
      0.85-0.88x -> 0.91-0.94x cuBLAS with B [n, k], 0.95-0.98x -> 1.02x with B [k, n];
      1024 x 28672 (7 rounds against 14) stays with 128 x 256 (0.96 against 0.92).

    (benchmarks/NOTES.md.)"""
    if kind not in ("sm90", "sm90:kn"):
        return False
    bm, bn = compute.SM90_TILE
    tiles = cdiv(m, bm) * cdiv(n, bn)
    if tiles <= blocks // 2:
        return k <= PP_MAX_K and split_k_for(tiles, k, blocks) <= PP_MAX_SLICES
    return k <= TMS_MAX_K and pp_rounds_cost(pp_shape_for(m, n, blocks), m, n, blocks) < \
        cdiv(tiles, blocks) * SM90_TILE_COST


#: "auto"'s ping-pong tile shapes (:func:`pp_shape_for`) -> the time of one such tile relative
#: to a 128 x 128 one at the same K (a smaller tile costs more than its share of the area: its
#: fixed costs, and MMAs of fewer columns or rows per k-step). Estimates; on an H200 they pick
#: the faster build at every shape timed with more than one (512 x 1024: 64 x 64 over 128 x 64
#: and 128 x 128; 1024 x 1024: 128 x 64 over 64 x 64; benchmarks/NOTES.md). A shape left out is
#: never chosen (``{(128, 128): 1.0}``: only "sm90:pp"), so the rule can be switched off per
#: tile shape.
PP_TILE_COST = {(128, 128): 1.0, (128, 64): 0.55, (64, 128): 0.55, (64, 64): 0.3}


#: the sm90 tile's (128 x 256) time relative to a 128 x 128 ping-pong tile's at the same K, in
#: :data:`PP_TILE_COST`'s unit: on an H100 a round of 128 x 256 tiles took 1.86 / 1.90 times one
#: of 128 x 128 tiles at 512 x 28672 x 512 / 1024 x 28672 x 512 (benchmarks/NOTES.md)
SM90_TILE_COST = 1.85


def pp_rounds_cost(shape, m, n, blocks):
    """The time of ``m x n`` in ping-pong tiles of ``shape`` on ``blocks`` compute blocks, in
    :data:`PP_TILE_COST`'s unit: rounds of tiles (``ceil(tiles / blocks)``) times the cost of
    one."""
    bm, bn = shape
    return cdiv(cdiv(m, bm) * cdiv(n, bn), blocks) * PP_TILE_COST[tuple(shape)]


def pp_shape_for(m, n, blocks):
    """The ping-pong tile shape (BM, BN) "auto" takes where :func:`pp_for` takes the
    ping-pong tile: of :data:`PP_TILE_COST`'s shapes, the one of least
    :func:`pp_rounds_cost`; a tie goes to the larger tile (fewer loads of A and B), then to
    the taller one. On an H200 (132 blocks): 512 x 1024 64 x 64 (128 tiles), 1024 x 1024
    128 x 64 (128), 2048 x 1024 and 512 x 4096 128 x 128 (128)."""
    best, best_cost = compute.SM90_PINGPONG_SHAPE, None
    larger_first = sorted(PP_TILE_COST, key=lambda s: (-s[0] * s[1], -s[0]))
    for shape in larger_first:
        total = pp_rounds_cost(shape, m, n, blocks)
        if best_cost is None or total < best_cost:
            best, best_cost = shape, total
    return best


#: the variant of the ping-pong tile "auto" runs at each tile shape (letters of
#: ``roles.compute.SM90_PP_VARIANTS``): on an H200 at the 20 few-tile shapes of the grid (512 x
#: 4096, 2048 x 1024, 1024 x 1024, 512 x 1024 at K 512-8192, ours and cuBLAS alternating), d
#: (each MMA's descriptors by an add) made the 128-row tiles faster, up to 4% at long K with B
#: [n, k], and the 64 x 64 tile slower at most points (up to 6%); r (the block's first order
#: entry prefetched before its setup) read level or faster at every tile shape, within the
#: timing's noise (benchmarks/NOTES.md). 64 x 128 is untimed: r only, as the other 64-row tile.
PP_AUTO_VARIANT = {(128, 128): "dr", (128, 64): "dr", (64, 128): "r", (64, 64): "r"}


def pp_auto_name(shape):
    """The build "auto" runs for ping-pong tiles of ``shape`` (BM, BN), B as [n, k]: the
    variant :data:`PP_AUTO_VARIANT` names (the plain :func:`~mknumba.roles.compute.pp_name`
    build where it names none)."""
    letters = PP_AUTO_VARIANT.get(tuple(shape), "")
    return compute.pp_variant_name(shape, letters) if letters else compute.pp_name(shape)


def tms_for(kind, k):
    """Whether "auto" takes the TMA-store build for an unsplit shape of depth ``k`` whose tile
    build would be ``kind``."""
    return kind in ("sm90", "sm90:kn") and k <= TMS_MAX_K


def shared_bps(known, sms, bps, op="mknumba.gemm"):
    """Blocks per SM a new plan of an op launches, whose call counter
    (``kernels.lifetime.Frame``) numbers launches of ``known`` blocks (None: this is the op's
    first plan, which sets it): the kernel's own ``bps`` (what fits on an SM) where that gives
    the same grid, else the counter's. Fewer blocks than fit are all co-resident; more than
    fit are right for whole tiles only (no block waits on another: the extra ones run when
    others end), and a split, whose folds wait on slices that other blocks compute, checks
    its own kernel's fit against the grid (:class:`_Plan`)."""
    if known is None or known == sms * bps:
        return bps
    if known % sms:
        raise MkError(f"{op}: the op's call counter counts launches of {known} blocks, not "
                      f"a whole number per SM of {sms}")
    return known // sms


def split_slices(k, s):
    """``(slices, kc)``: K cut into at most ``s`` slices of ``kc`` (whole k-steps; the last
    slice may be shorter) and no empty one; ``(1, k)`` when that leaves one slice."""
    steps = cdiv(k, SPLIT_BK)
    per = cdiv(steps, max(1, min(int(s), steps)))
    slices = cdiv(steps, per)
    return (slices, per * SPLIT_BK) if slices > 1 else (1, k)


def split_order(order, slices, tail=None, parts=1):
    """The work units of a split in the order blocks take them: every slice of every tile
    (unit ``j * tiles + t``, slice j of tile t, tiles in ``order``'s order), then the fold
    units, band p of every tile's fold (``(slices + p) * tiles + t``) for p < ``parts``. One
    slice: ``order`` itself. ``tail`` (the tail split): only the last ``tail`` tiles of
    ``order`` so, after the others as they are (whole tiles, units ``t``)."""
    if slices == 1:
        return order
    tiles = len(order)
    whole = tiles - (tiles if tail is None else tail)
    return np.concatenate([order[:whole]] + [order[whole:] + j * tiles
                                             for j in range(slices + parts)]).astype(np.int32)


def _sim_safe(tiles, slices, blocks, parts=1):
    """Whether the simulator, which runs blocks one at a time in grid order, meets every
    slice a fold unit waits for before the fold (its block is the fold's or an earlier one),
    for ``tiles`` split tiles (the tail split: the tail's; every block takes its phase-2 units
    from index ``blk`` of them on)."""
    if slices == 1:
        return True       # no folds
    for i in range(tiles):
        for p in range(parts):
            fold = ((slices + p) * tiles + i) % blocks
            if any((j * tiles + i) % blocks > fold for j in range(slices)):
                return False
    return True


def _fold_parts(tiles, slices, blocks, bm):
    """:func:`fold_parts_for`; in the simulator as many or fewer, down to 1, so that
    :func:`_sim_safe` holds where it can."""
    parts = fold_parts_for(tiles, blocks, bm)
    while SIMULATOR and parts > 1 and not _sim_safe(tiles, slices, blocks, parts):
        parts //= 2
    return parts


@cuda.jit(device=True, inline=True)
def whole_tiles(where, u, tm):
    """No split: tile u into C, announced in ``flags[u]`` (``place`` of :func:`split_units`
    built without a split: C and no fold, constants, as the sm_90a epilogue's global stores
    need)."""
    return where[0], 0, where[2], 0, where[1], u, False


def split_units(build, split=True):
    """``(units, place, ready)`` of the compute role (``roles.compute.make_compute_tile``)
    for the units of :func:`split_order`, with ``where = (c, flags, ws, slices, kc, tiles,
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
    ``roles.compute.make_compute_role``'s: with ``order`` = :func:`split_order` with a
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
        """a [m, k], b [n, k] (or [k, n] with a ":kn" tile build), c [m, n]: bf16 bits;
        ws: the split's workspace [slices + 1, m, n] (one slice: c as [1, m, n], never read);
        tmaps: the tensor maps of a and b, a pair per slice (sm90); flags uint32[(slices + 1)
        * tiles]: [0, tiles) := epoch when tile t is done (nothing in the kernel reads
        them: whole tiles record them with plain stores), the rest the slices' (split_units);
        frame: the op's call counter (``kernels.lifetime.Frame``); order int32: the work units
        (split_order of sched.grouped_order, with the tail split's ``tail``); slices of kc
        (split_slices), each tile's fold in ``parts`` units (fold_parts_for); a fold unit waits
        at most timeout_ns, then records the error in err (int64[ERR_WORDS], mapped)."""
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
_SIM_SMS = 4  # a small "device" for the simulator: 4 SMs, one block each


def _build(kind, split=False):
    """(roles.compute.TileBuild, persistent kernel) of a tile build name, for split-K
    (True), whole tiles (False) or the tail split ("tail")."""
    b = compute.tile_build(kind)
    if (kind, split) not in _KERNELS:
        _KERNELS[kind, split] = _make_kernel(b, b.threads, split)
    return b, _KERNELS[kind, split]


def check_shapes(m, n, k, op="mknumba.gemm"):
    if min(m, n, k) < 1:
        raise MkValueError(f"{op}: empty GEMM (m={m}, n={n}, k={k})")
    if k % 8 or n % 8:
        raise MkValueError(f"{op}: k={k} and n={n} must be multiples of 8: rows of A, B and C "
                           "must be 16-byte aligned for the bulk tensor copies; pad them (m may "
                           "be any size)")


def fused_tile(tile, op):
    """``(kind, TileBuild)`` a fused op runs for its ``tile=`` option: :func:`kind_for`, with
    "auto" on sm_90a the build whose own warp publishes tile flags
    (``roles.compute.SM90_FUSED_TILE``); a timing-only build, or one for mk.Gemm only (the
    ping-pong tile), is refused."""
    kind = kind_for(tile, op)
    if tile == "auto" and kind == "sm90":
        kind = compute.SM90_FUSED_TILE
    build = compute.tile_build(kind)
    if build.timing_only:
        raise MkValueError(f"{op}: tile build {tile!r} leaves the output unwritten "
                           "(timing only)")
    if build.gemm_only:
        raise MkValueError(f"{op}: tile build {tile!r} is for mknumba.Gemm only so far (not "
                           f"checked in the fused kernels); use 'auto', 'sm90' or "
                           f"{compute.SM90_FUSED_TILE!r}")
    return kind, build


def check_tile_name(tile, op="mknumba.gemm"):
    """Refuse (MkValueError, naming ``op``) a ``tile=`` option that names no tile build:
    "auto", the library's builds (the sm_90a ones also in the simulator, which refuses them
    when they would run: :func:`kind_for`) or a registered one."""
    if tile != "auto" and not compute.is_sm90_name(tile):
        try:
            compute.tile_build(tile)   # "simt", another build of the tile (probes)
        except MkValueError as e:
            raise MkValueError(f"{op}: tile={tile!r}: {e}") from None


def kind_for(tile, op="mknumba.gemm"):
    """The tile build a ``tile=`` option picks on this machine (see :class:`Gemm`)."""
    check_tile_name(tile, op)
    if SIMULATOR:
        if tile not in ("auto", "simt"):
            raise MkValueError(f"{op}: the {tile} tile needs a Hopper GPU; the simulator runs "
                               "'simt'")
        return "simt"
    cc = tuple(cuda.get_current_device().compute_capability)
    if tile == "auto":
        return "sm90" if cc == (9, 0) else "simt"
    if compute.tile_build(tile).tma and cc != (9, 0):
        raise MkValueError(f"{op}: the {tile} tile needs compute capability 9.0, this GPU "
                           f"has {cc}")
    return tile


_drv = None


def current_device():
    """The CUDA ordinal of this thread's current context (None in the simulator)."""
    global _drv
    if SIMULATOR:
        return None
    if _drv is None:
        from cuda.bindings import driver as _drv
    err, dev = _drv.cuCtxGetDevice()
    return int(dev) if err == 0 else None


class Gemm:
    """C = A @ B on one GPU, with a per-tile completion flag other roles can wait on.

    ``Gemm(tile="auto", reserved_sms=0, group_m=None, split_k=None)``: each call is one
    persistent launch,
    planned once per shape and layout (compiled, tables built, arguments converted); a later
    call of that shape binds its arrays' addresses and launches. Plans are kept for the op's
    lifetime (a captured CUDA graph may refer to them); the first call of a shape must not be
    inside a capture. After a call, ``tile_flags(m, n, k, b_layout)[t] == epoch`` for every
    output tile ``t = tile_m * tiles_n + tile_n`` of the plan's build (128 x 256 tiles; where
    "auto" takes a ping-pong tile, its shape: :func:`pp_shape_for`). ``split_k``: slices of K
    per output tile (split-K, see the module docstring): None lets :func:`split_k_for` choose
    by shape, and where it does not split, :func:`tail_split_for` split the last round's tiles
    (the tail split); an int forces at most that many for every tile (1: no split, nor a tail
    split; fewer when K has fewer 64-deep steps). ``group_m``: the tiles' order in bands of
    that many tile rows (``sched.tiles``); None: :func:`~mknumba.sched.tiles.gemm_group_m`.

    ``tile``: "auto" runs, on a Hopper GPU (sm_90a), a ping-pong build where 128 x 256 tiles
    are few and K <= :data:`PP_MAX_K`, or fill their rounds poorly and K <= :data:`TMS_MAX_K`
    (:func:`pp_for`; only with ``split_k`` None;
    ``"sm90:pp"`` or a smaller tile's, :func:`pp_shape_for`, in the variant of
    :func:`pp_auto_name`), the tensor-store build
    ``"sm90:tms"`` for other shapes it does not split (nor their tail) with K <=
    :data:`TMS_MAX_K`, and the default ``"sm90"`` elsewhere (chosen per shape; the SIMT twin
    without sm_90a); or a build by name (module docstring):
    ``"sm90"``, ``"sm90:pp"`` (and ``"sm90:pp:128x64"``, ``":64x128"``, ``":64x64"``; and
    their variants, e.g. ``"sm90:ppdr:128x64"``) and ``"sm90:tms"`` (these whole tiles only:
    ``split_k`` None or 1, no tail split), ``"simt"``.
    """

    name = "mknumba.gemm"

    def __init__(self, tile="auto", reserved_sms=0, group_m=None, split_k=None):
        check_tile_name(tile)
        group_m = positive_ints(self.name, group_m=group_m)["group_m"]
        if split_k is not None and (isinstance(split_k, bool) or not isinstance(
                split_k, (int, np.integer)) or split_k < 1):
            raise MkValueError(f"{self.name}: split_k must be None (chosen by shape) or an "
                               f"int >= 1 (1: no split), got {split_k!r}")
        if split_k is not None and split_k > 1 and compute.whole_tiles_only(tile):
            raise MkValueError(f"{self.name}: tile={tile!r} takes no split_k (it computes "
                               "whole tiles only); pass split_k=None or 1")
        self.tile, self.reserved_sms, self.group_m = tile, int(reserved_sms), group_m
        self.split_k = None if split_k is None else int(split_k)
        self.frame = None     # the call counter of the last GPU used
        self._frames = {}     # device -> (tile build, Frame, error record): one per GPU
        self.streams = StreamOrder(self.name)
        self._plans = {}      # (m, n, k, b mode, device) -> _Plan
        self._hot = None      # (b_layout, plan, device, b's shape, b's strides): the hot path
        self._lock = threading.Lock()

    def __call__(self, a, b, b_layout="kn", out=None, stream=None):
        """a: [m, k] bf16; b: [k, n] (b_layout="kn", as in a @ b) or [n, k] ("nk", a @ b.T).

        Arrays: PyTorch tensors (result: a bf16 tensor, computed on the current torch stream)
        or numba/CuPy device arrays (result: a numba array of bf16 bits, uint16; on
        ``stream``). bf16 as ``torch.bfloat16``, ``ml_dtypes.bfloat16`` or its bits as
        uint16/int16.
        """
        hot = self._hot
        if hot is not None and out is not None and stream is None and b_layout == hot[0]:
            _, plan, dev, b_shape, b_strides = hot      # the last call's, with tensors
            pa = torch_ptr(a, (plan.m, plan.k), dev) if is_torch(a) else None
            pb = pa and torch_ptr(b, b_shape, dev, b_strides)
            pc = pb and torch_ptr(out, (plan.m, plan.n), dev)
            if (pc and unshared(plan.unshared, (pc, pa, pb), plan.sizes, 1)
                    and current_device() == dev and not (plan.slices > 1 and plan.err[ERR_SET])):
                s = stream_handle(None, dev)
                with plan.launch.lock:
                    self.streams.enter(s)
                    plan.run(pa, pb, pc, s)
                return out
        return self._call(a, b, b_layout, out, stream)

    def _call(self, a, b, b_layout, out, stream):
        """A call with every check (the first of a shape, or anything but the hot path)."""
        if b_layout not in ("kn", "nk"):
            raise MkValueError(f"{self.name}: b_layout must be 'kn' (b is [k, n]) or 'nk' (b is "
                               f"[n, k]), got {b_layout!r}")
        A = operand(a, self.name, "a", ndim=2)
        if not A.torch and not SIMULATOR:      # a numba/CuPy array: the current GPU's
            check_device(A, self.name, current_device())
        B = operand(b, self.name, "b", ndim=2, layouts=("row", "col"), device_id=A.device)
        if A.torch != B.torch:
            raise MkValueError(f"{self.name}: a and b must both be PyTorch tensors or both be "
                               "device arrays")
        m, k = A.shape
        n = B.shape[1] if b_layout == "kn" else B.shape[0]
        kb = B.shape[0] if b_layout == "kn" else B.shape[1]
        if kb != k:
            raise MkValueError(f"{self.name}: inner dimensions differ: a is [{m}, {k}], b "
                               f"({b_layout}) gives k={kb}")
        check_shapes(m, n, k)
        mode = b_mode(B, b_layout, n, k, self.name)
        given = out is not None
        s = stream_handle(stream, A.device if A.torch else None)
        outputs_in_capture(self.name, s, out=out)
        if out is None:
            out = new_output(a, A.torch, (m, n))
        C = operand(out, self.name, "out", shape=(m, n), device_id=A.device)
        if A.torch != C.torch:
            raise MkValueError(f"{self.name}: out must be a PyTorch tensor exactly when the "
                               "inputs are")
        refuse_overlap(self.name, (C,), (A, B))
        key = (m, n, k, mode, A.device)
        plan = self._plans.get(key)
        if plan is None:
            plan = self._plan(key, s)
        raise_if_timed_out(plan.err, f"{self.name} (a split-K fold of an earlier call)")
        b_param = B.as_param(np.uint16, b_shape(mode, n, k))
        args = (A.as_param(np.uint16, (m, k)), b_param, C.as_param(np.uint16, (m, n)), s)
        with plan.launch.lock:
            self.streams.enter(s)
            if A.device is not None and A.device != current_device():
                with cuda.gpus[A.device]:
                    plan.run(*args)
            else:
                plan.run(*args)
        # the next call with tensors like these takes the hot path
        self._hot = ((b_layout, plan, A.device, tuple(B.shape), None if mode in ("kn", "nk")
                      else tuple(B.strides))
                     if A.torch and given and stream is None and A.dtype == "bfloat16" and
                     B.dtype == "bfloat16" and C.dtype == "bfloat16" else None)
        return out

    def _plan(self, key, stream):
        m, n, k, mode, device = key
        if device is not None and device != current_device():
            with cuda.gpus[device]:
                return self._plan(key, stream)
        if is_capturing(stream):
            raise MkError(f"{self.name}: the first call of shape {m} x {n} x {k} (b {mode}) "
                          "is inside a CUDA graph capture; call once before capturing (a new "
                          "shape plans, which allocates)")
        with self._lock:
            if key not in self._plans:
                self._plans[key] = _Plan(self, m, n, k, mode, device)
            self.frame = self._frames[device][1]
            return self._plans[key]

    def _counter(self, device, grid):
        """(tile build, Frame, error record) of ``device``, made with the first plan there:
        the record (int64[ERR_WORDS], mapped) says which fold of a split timed out, if one
        did."""
        if device not in self._frames:
            self._frames[device] = (kind_for(self.tile), Frame(grid),
                                    cuda.mapped_array(ERR_WORDS, np.int64))
            self._frames[device][2][:] = 0
        if self._frames[device][1].grid != grid:     # shared_bps keeps them equal
            raise MkError(f"{self.name}: a plan of {grid} blocks on a call counter of "
                          f"{self._frames[device][1].grid}")
        return self._frames[device]

    def _start_at(self, calls):
        """Tests: as if ``calls`` calls had run on the last GPU used (its counter and every
        flag of its plans), e.g. just short of 2**32, to run the next calls across the wrap.
        Only between calls, after they finished."""
        dev = next(d for d, f in self._frames.items() if f[1] is self.frame)
        cuda.synchronize()
        self.frame.start_at(calls, [plan.flags for key, plan in self._plans.items()
                                    if key[4] == dev])

    def tile_flags(self, m, n, k, b_layout="kn"):
        """The tile flags of the plan for this shape (device uint32 array)."""
        return self._plan_of(m, n, k, b_layout).tile_flags

    def _plan_of(self, m, n, k, b_layout="kn"):
        """The plan a call of this shape and layout of B ("nk", or any [k, n] one) made."""
        for (pm, pn, pk, mode, _), plan in self._plans.items():
            if (pm, pn, pk) == (m, n, k) and (mode == "nk") == (b_layout == "nk"):
                return plan
        raise MkValueError(f"{self.name}: no call of shape {m} x {n} x {k} yet")

    def calls(self):
        """(calls, epoch) of the last call (reads the device counter: waits for it); raises
        MkTimeoutError if a split's fold timed out."""
        if self.frame is None:
            return (0, 0)
        got = self.frame.read()
        for _, _, err in self._frames.values():
            raise_if_timed_out(err, self.name)
        return got


def _device_sms():
    """SMs of the current GPU (the simulator's small device: ``_SIM_SMS``)."""
    return _SIM_SMS if SIMULATOR else cuda.get_current_device().MULTIPROCESSOR_COUNT


class _Plan:
    """One shape and layout of B of a :class:`Gemm`: the compiled kernel, its order table and
    flags, the tensor maps, and the prepared :class:`~mknumba.kernels.launch.Launch`."""

    def __init__(self, op, m, n, k, mode, device):
        kind = kind_for(op.tile) if device not in op._frames else op._frames[device][0]
        self.b_kn = b_kn(mode)
        base = kind = compute.kn_kind(kind, op.name) if self.b_kn else kind
        if op.tile == "auto" and op.split_k is None and \
                pp_for(kind, m, n, k, max(1, _device_sms() - op.reserved_sms)):
            # one block an SM, as the default tile; its tile shape by the tiles' count
            kind = pp_auto_name(pp_shape_for(m, n, max(1, _device_sms() - op.reserved_sms)))
            kind = compute.kn_kind(kind, op.name) if self.b_kn else kind
        elif op.tile == "auto" and tms_for(kind, k) and (op.split_k or 1) == 1:
            kind = compute.kn_kind(compute.SM90_TMS_TILE, op.name) if self.b_kn else \
                compute.SM90_TMS_TILE
        build, kernel = _build(kind)
        if build.gemm_only and (op.split_k or 1) > 1:
            raise MkValueError(f"{op.name}: tile={op.tile!r} takes no split_k (it computes "
                               "whole tiles only); pass split_k=None or 1")
        compiled, bps = compile_kernel(kernel, build.threads, build.smem_bytes)
        sms = _device_sms()
        # every plan of the op launches one grid (its call counter counts blocks); a split's
        # own kernel is checked against it below
        known = op._frames[device][1].grid if device in op._frames else None
        bps = shared_bps(known, sms, bps, op.name)
        try:
            grid = plan_grid(sms, bps, op.reserved_sms)
        except ValueError as e:
            raise MkValueError(f"{op.name}: {e}") from None
        bm, bn = build.shape
        tiles_m, tiles_n = cdiv(m, bm), cdiv(n, bn)
        tiles, blocks = tiles_m * tiles_n, grid.compute_blocks
        group_m = op.group_m or gemm_group_m(tiles_m, tiles_n, blocks)
        split = split_k_for(tiles, k, blocks) if op.split_k is None else op.split_k
        # the tail split where the rule leaves the shape unsplit, with a tile build that can
        # start its ring afresh and runs split units (not the whole-tile builds), and not
        # where "auto" takes the tensor-store tile: at K <= TMS_MAX_K its epilogue gains more
        # than a split tail's slices of at most 32 k-steps do (an H200: benchmarks/NOTES.md)
        self.tail, base_build = 0, compute.tile_build(base)
        if op.split_k is None and split == 1 and kind == base and \
                base_build.reinit is not None and not base_build.gemm_only:
            self.tail, split = tail_split_for(tiles, k, blocks)
            if SIMULATOR and not _sim_safe(self.tail, split_slices(k, split)[0], blocks):
                self.tail, split = 0, 1      # a fold would wait on a later simulated block
        if kind != base and build.shape == base_build.shape and split_slices(k, split)[0] > 1:
            # "auto" splits this shape (or its tail): the default tile (the tensor-store
            # tile's shape, so the same tiles), whose split kernel is compiled and checked
            # against the grid below (the ping-pong tiles, of other shapes, run whole: pp_for
            # takes them instead of a split)
            kind = base
            build, kernel = _build(kind)
        self.slices, self.kc = split_slices(k, split if build.fold is not None else 1)
        self.parts = (_fold_parts(self.tail or tiles, self.slices, blocks, bm)
                      if self.slices > 1 else 1)
        if SIMULATOR and not _sim_safe(self.tail or tiles, self.slices, blocks, self.parts):
            raise MkValueError(f"{op.name}: split_k={self.slices} with {tiles} tiles on "
                               f"{blocks} blocks: the simulator runs blocks one at a time, and "
                               "a fold would wait on a later block; take fewer slices, or "
                               "tiles a multiple of the blocks")
        if self.slices > 1:
            # the split kernel runs the same grid (the op's call counter counts its blocks), so
            # it must fit as many blocks per SM: a fold waits on blocks that must be running
            kernel = _build(kind, "tail" if self.tail else True)[1]
            compiled, split_bps = compile_kernel(kernel, build.threads, build.smem_bytes)
            if split_bps < bps and self.tail:      # the rule's choice: then no tail split
                self.tail, self.slices, self.kc, self.parts = 0, 1, k, 1
                kernel = _build(kind)[1]
                compiled, _ = compile_kernel(kernel, build.threads, build.smem_bytes)
            elif split_bps < bps:
                raise MkError(f"{op.name}: the split-K kernel fits {split_bps} blocks per SM, "
                              f"the GEMM's grid has {bps}; pass split_k=1")
        _, frame, self.err = op._counter(device, grid.grid)
        self.m, self.n, self.k, self.mode, self.tile_shape = m, n, k, mode, build.shape
        self.sizes = (2 * m * n, 2 * m * k, 2 * k * n)      # c, a, b (bf16): arrays.unshared
        self.unshared = set()
        self.kind = kind          # the tile build's name
        # flags start at the last call's epoch, which no later call's reaches (a fresh 0 would
        # read as reached past 2**31 calls: primitives.epoch_reached)
        self.flags = cuda.to_device(np.full((self.slices + 1) * tiles, frame.read()[1],
                                            np.uint32))
        self.tile_flags = self.flags[:tiles]     # the tiles' own; then the slices' (split_units)
        self.order = cuda.to_device(split_order(grouped_order(tiles_m, tiles_n, int(group_m)),
                                                self.slices, self.tail or None, self.parts))
        split = self.slices > 1
        # the workspace: plane 1 + j holds slice j's partials (plane 0, the addend's own
        # plane, is never read); one slice: C as [1, m, n] stands in, never read either
        self.ws = cuda.device_array((self.slices + 1, m, n), np.uint16) if split else None
        # a pair of maps per slice; the first sees all of K, as the unsplit maps do: the tail
        # split's whole tiles read through it
        self.tmaps = (TensorMaps(m, n, k, build.shape, slices=self.slices, kc=self.kc,
                                 c_map=build.c_map)
                      if build.tma else NoTensorMaps(TensorMaps.ROW * self.slices))
        words = self.tmaps.words
        self.launch = Launch(kernel, compiled, dict(
            a=Slot((m, k)), b=Slot(b_shape(mode, n, k)), c=Slot((m, n)),
            ws=self.ws if split else Slot((1, m, n)), tmaps=Slot((words,)),
            flags=self.flags, frame=frame.words, order=self.order, compute_blocks=blocks,
            tiles=tiles, slices=self.slices, kc=self.kc, parts=self.parts,
            timeout_ns=default_timeout_ns(), err=self.err),
            grid.grid, build.threads, build.smem_bytes)

    def run(self, a, b, c, stream):
        """Bind the parameters (``Operand.as_param``: addresses on the GPU) of A, B as given
        and C, derive the tensor maps (C's too for a build that stores through one), and
        launch on ``stream``."""
        maps = self.tmaps(a, b, stream, self.b_kn, c)
        if self.slices == 1:
            self.launch.binder("a", "b", "c", "ws", "tmaps")(
                stream, a, b, c, c if not SIMULATOR else c.reshape((1, self.m, self.n)), maps)
        else:
            self.launch.binder("a", "b", "c", "tmaps")(stream, a, b, c, maps)


_default = {}


def gemm(a, b, b_layout="kn", out=None, stream=None, reserved_sms=0, tile="auto"):
    """C = a @ b (b_layout="kn", b is [k, n]) or a @ b.T (b_layout="nk", b is [n, k]).

    bf16 inputs and output, fp32 accumulation, one persistent launch. ``reserved_sms`` SMs are held
    back from the compute role. m may be any size; n and k must be multiples of 8. B is read as
    it is given, with no copy: [n, k], a column-major [k, n] view of one (like ``w.T``), or
    row-major [k, n].
    """
    key = (tile, int(reserved_sms))
    if key not in _default:
        _default[key] = Gemm(tile=tile, reserved_sms=reserved_sms)
    return _default[key](a, b, b_layout=b_layout, out=out, stream=stream)
