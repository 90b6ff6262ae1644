"""Which kernel a GEMM of a shape runs: the tile build ("auto"'s rules by shape), split-K's
slices and fold units, the tail split, the grid every plan of an op shares, and the ``tile=``
names an op takes.

The rules are applied once per shape and layout of B, when an op plans it (``op._Plan``); the
kernels themselves (``kernel``) take the choices as arguments. The checks of shapes and ``tile=``
names are here too, and the fused ops share them (``check_shapes``, ``fused_tile``). The
measurements behind each rule are in benchmarks/NOTES.md.
"""
import numpy as np
from numba import cuda

from ..._compat import SIMULATOR
from ...errors import MkError, MkValueError
from ...roles import compute
from ...sched.tiles import cdiv

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
    """Fold units per split tile (each a band of ``bm / parts`` rows, see ``kernel``'s
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
    (the tail split: ``kernels.gemm.kernel``), or ``(0, 1)``: none. With more tiles than compute
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
    its own kernel's fit against the grid (``op._Plan``)."""
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
    """The tile build a ``tile=`` option picks on this machine (see
    :class:`~mknumba.kernels.gemm.op.Gemm`)."""
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
