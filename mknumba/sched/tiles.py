"""Persistent tile scheduling: which blocks compute, and in which order they visit output tiles.

A persistent kernel launches exactly as many blocks as can be resident at once (``plan_grid``)
and never more: a block that waits on another block's flag must not wait on one that was never
scheduled. The first ``compute_blocks`` blocks take the compute role; the remaining blocks (the
SMs "held back") are free for communication roles in fused kernels. Blocks of lower index produce,
higher ones consume (the simulator runs blocks in index order; docs/design.md §3).

Compute block ``b`` visits entries ``b, b + compute_blocks, b + 2 * compute_blocks, ...`` of an
order table of tile ids (``grouped_order`` for a plain GEMM, ``sched.reduce`` for the fused
kernels). Grouped order: the blocks running at one moment cover a compact ``group_m``-row band of
tiles, so the A rows and B columns they read stay in L2 instead of streaming from HBM once per
tile. Where the inputs arrive over time (AllGather + GEMM), ``gather_order`` visits tile rows in
the order their rows of A arrive (``arrival_order``), grouped within each arrival.
"""
from dataclasses import dataclass

import numpy as np

from ..errors import MkValueError


def cdiv(a, b):
    """ceil(a / b) for non-negative integers."""
    return (a + b - 1) // b


def tile_coords_host(t, tiles_m, tiles_n, group_m):
    """Grouped raster order: linear tile ``t`` -> (tile_m, tile_n).

    Tiles are visited in bands of ``group_m`` tile rows; inside a band the row index moves
    fastest (column-major), so consecutive tiles share the B columns and the band shares A rows.
    The last band may be shorter. A bijection on [0, tiles_m * tiles_n); ``t`` may be an array.
    """
    per_band = group_m * tiles_n
    band = t // per_band
    first_m = band * group_m
    rows = np.minimum(tiles_m - first_m, group_m)
    r = t - band * per_band
    return first_m + r % rows, r // rows


def grouped_order(tiles_m, tiles_n, group_m):
    """Tile ids ``tile_m * tiles_n + tile_n`` in grouped raster order (int32, a compute role's
    order table)."""
    tm, tn = tile_coords_host(np.arange(tiles_m * tiles_n), tiles_m, tiles_n, group_m)
    return (tm * tiles_n + tn).astype(np.int32)


def default_group_m(tiles_m, tiles_n, blocks):
    """Band height that makes the tiles in flight (about ``blocks``) roughly square. A
    group_m sweep on one H200 was not conclusive (benchmarks/NOTES.md: machine-to-machine
    spread exceeded the effect), so this rule stays."""
    g = 1
    while g * g < blocks and g < tiles_m:
        g *= 2
    return max(1, min(g, tiles_m))


#: the plain GEMM's band height, in tile rows, where all its tiles run in one wave (at most
#: one a compute block): bands of 2-4 rows run the one-wave few-tile shapes (2048 x 1024,
#: 1024 x 1024) faster than whole tile columns and the others no slower; past one wave the
#: band keeps :func:`default_group_m`'s L2 reuse (measurements: benchmarks/NOTES.md)
ONE_WAVE_GROUP_M = 4


def gemm_group_m(tiles_m, tiles_n, blocks):
    """The plain GEMM's band height (``Gemm(group_m=None)``): :func:`default_group_m`, but at
    most :data:`ONE_WAVE_GROUP_M` where the tiles all run in one wave. Every tile is then in
    flight at once, so the band's L2 reuse is moot; it only sets which tiles neighbouring
    blocks run, and a few rows measured faster than a whole column (why is not known: the
    blocks' placement on the SMs is the GPU's)."""
    g = default_group_m(tiles_m, tiles_n, blocks)
    return min(g, ONE_WAVE_GROUP_M) if tiles_m * tiles_n <= blocks else g


@dataclass(frozen=True)
class GridPlan:
    """A persistent grid: ``grid`` co-resident blocks, the first ``compute_blocks`` compute."""
    grid: int
    compute_blocks: int
    blocks_per_sm: int
    sms: int
    reserved_sms: int

    @property
    def other_blocks(self):
        """Blocks held back for other roles (communication, controller)."""
        return self.grid - self.compute_blocks


def plan_grid(sms, blocks_per_sm, reserved_sms=0):
    """Size a persistent grid to what is co-resident and hold ``reserved_sms`` SMs back.

    sms: multiprocessors on the device; blocks_per_sm: occupancy of the kernel (from the
    occupancy API: registers, shared memory and block size decide it). Raises MkValueError when the
    hold-back leaves no SM to compute on.
    """
    if sms < 1 or blocks_per_sm < 1:
        raise MkValueError(f"need at least one SM and one block per SM (got {sms}, {blocks_per_sm})")
    if not 0 <= reserved_sms < sms:
        raise MkValueError(f"reserved_sms must be in [0, {sms - 1}] on a {sms}-SM device, "
                         f"got {reserved_sms}")
    grid = sms * blocks_per_sm
    return GridPlan(grid=grid, compute_blocks=(sms - reserved_sms) * blocks_per_sm,
                    blocks_per_sm=blocks_per_sm, sms=sms, reserved_sms=reserved_sms)


def arrival_order(rank, local, g, nodes):
    """World ranks in the order their shards (slices) reach ``rank``, which is ``local`` of
    ``g`` GPUs per node on ``nodes`` nodes (int32): its own; this node's other GPUs, the
    previous GPU first (each GPU pushes to its next one first, ``primitives.peer_after``);
    then each other node's, the previous node first, its rail peer's first (that one comes
    straight through the proxy, the others are forwarded inside this node after it)."""
    out = [rank]
    base = rank - local
    out += [base + (local - j) % g for j in range(1, g)]
    node = base // g
    for i in range(1, nodes):
        nb = ((node - i) % nodes) * g
        out += [nb + (local - j) % g for j in range(g)]
    return np.array(out, np.int32)


def gather_order(m, shard_rows, bm, tiles_n, arrival, group_m):
    """Tile ids of C = AllGather(A) @ B in the order their rows of A arrive (int32, a compute
    role's order table): A's rows ``[r * shard_rows, (r + 1) * shard_rows)`` come from world
    rank r, ranks arrive in ``arrival`` order (:func:`arrival_order`); a tile row waits for
    the last shard it touches (a ragged tile row may span two). Tile rows that arrive together
    are visited in grouped raster order (bands of ``group_m`` rows), one arrival after another,
    so a band never waits on a later shard than its rows need."""
    tiles_m = cdiv(m, bm)
    when = np.empty(len(arrival), np.int64)
    when[np.asarray(arrival)] = np.arange(len(arrival))
    first = np.arange(tiles_m) * bm
    last = np.minimum(first + bm, m) - 1
    ready = np.maximum(when[first // shard_rows], when[last // shard_rows])
    out = []
    for w in np.unique(ready):
        rows = np.flatnonzero(ready == w)
        tm, tn = tile_coords_host(np.arange(len(rows) * tiles_n), len(rows), tiles_n,
                                  max(1, min(group_m, len(rows))))
        out.append(rows[tm] * tiles_n + tn)
    return np.concatenate(out).astype(np.int32)
