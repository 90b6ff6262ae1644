"""How a sequence is split over the ranks of a ring (sequence parallelism).

``contiguous``: rank r holds positions [r * s, (r + 1) * s) of the global sequence (s: the
local length). ``zigzag``: the sequence is cut into 2W chunks of s/2 and rank r holds chunks r
and 2W - 1 - r, so under a causal mask every rank has the same work: its early chunk sees few
keys and its late chunk many (docs/design.md).
"""
import numpy as np
from numba import cuda

from ..errors import MkValueError

LAYOUTS = ("contiguous", "zigzag")


@cuda.jit(device=True, inline=True)
def position(i, rank, seq_local, world, zigzag):
    """Global position of local row ``i`` of ``rank`` (device and host)."""
    if not zigzag:
        return rank * seq_local + i
    half = seq_local // 2
    if i < half:
        return rank * half + i
    return (2 * world - 1 - rank) * half + i - half


def runs(rank, seq_local, world, layout):
    """A rank's positions as two runs, ``(base0, split, base1)``: local row i is at
    ``base0 + i`` for i < split, else ``base1 + (i - split)`` (how the sm_90a attention tile
    takes them; increasing in i for both layouts)."""
    if layout == "contiguous":
        return rank * seq_local, seq_local, (rank + 1) * seq_local
    half = seq_local // 2
    return rank * half, half, (2 * world - 1 - rank) * half


def positions(rank, seq_local, world, layout):
    """NumPy array of the global positions of a rank's local rows."""
    i = np.arange(seq_local)
    base0, split, base1 = runs(rank, seq_local, world, layout)
    return np.where(i < split, base0 + i, base1 + i - split)


def check_layout(layout, seq_local, what):
    if layout not in LAYOUTS:
        raise MkValueError(f"{what}: layout must be one of {LAYOUTS}, got {layout!r}")
    if layout == "zigzag" and seq_local % 2:
        raise MkValueError(f"{what}: the zigzag layout needs an even seq_local (two chunks per "
                           f"rank), got {seq_local}")


def shard(x, rank, world, layout="zigzag", axis=1):
    """Rank ``rank``'s part of a full sequence ``x`` (NumPy array or PyTorch tensor) along
    ``axis`` (default 1: ``[batch, seq, heads, head_dim]``)."""
    seq = x.shape[axis]
    if seq % (2 * world if layout == "zigzag" else world):
        raise MkValueError(f"shard: a sequence of {seq} does not split into "
                           f"{'2 x ' if layout == 'zigzag' else ''}{world} equal parts")
    check_layout(layout, seq // world, "shard")
    idx = positions(rank, seq // world, world, layout)
    if type(x).__module__.split(".")[0] == "torch":
        import torch
        return x.index_select(axis, torch.as_tensor(idx, device=x.device)).contiguous()
    return np.ascontiguousarray(np.take(x, idx, axis=axis))


def unshard(parts, layout="zigzag", axis=1):
    """The full sequence from every rank's part (in rank order), the inverse of :func:`shard`."""
    world, seq_local = len(parts), parts[0].shape[axis]
    order = np.concatenate([positions(r, seq_local, world, layout) for r in range(world)])
    inverse = np.argsort(order)
    if type(parts[0]).__module__.split(".")[0] == "torch":
        import torch
        full = torch.cat(list(parts), dim=axis)
        return full.index_select(axis, torch.as_tensor(inverse, device=full.device))
    return np.take(np.concatenate(parts, axis=axis), inverse, axis=axis)
