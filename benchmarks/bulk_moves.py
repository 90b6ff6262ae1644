"""Tile moves through the TMA engine (sm_90a), for ``probe_tile_moves.py``: an alternative to the
reduce and pull roles' plain loads that lost (kept here, out of the library, as the base for a
double-buffered version).

Same contract as :mod:`.reduce` (uint64 word buffers, tiles addressed as ``(array, offset,
row_stride)`` in words, called by every thread of the block), but the bytes travel as bulk
copies (``cuda/tile_moves.cu``): one warp hands all rows of a tile to the copy engine of the SM,
the block sums them in shared memory, the warp hands the result rows back. The idea: a whole
tile in flight per block instead of 18 KB. Measured on an H200 it is slower per block than the
plain loads (pull + sum 5.4 vs 11.2 GB/s, ``benchmarks/probe_tile_moves.py``; loads, sum and
stores of a tile run one after the other), so the fused ops move tiles with plain loads.

The bulk path takes two local GPUs and tiles whose rows are whole 16-byte units at 16-byte
aligned addresses (n % 8 == 0), at most 128 x 512 bytes; anything else goes to the plain-load
functions of :mod:`.reduce`, so callers need not check.
``seq`` is a per-block count of bulk moves (the mbarrier's phase); each function returns the
count after its move.
"""
import os

import numpy as np
from numba import cuda, types

import mknumba
from mknumba._compat import SIMULATOR
from mknumba.primitives import data_ptr, peer_view
from mknumba.roles.compute import linked_source
from mknumba.roles.reduce import copy_tile_2d, reduce_peers

HELPER = os.path.join(os.path.dirname(os.path.abspath(__file__)), "cuda", "tile_moves.cu")
SM90_CUH = os.path.join(os.path.dirname(mknumba.__file__), "roles", "cuda", "sm90.cuh")
ROWS_MAX, ROW_BYTES_MAX = 128, 512        # must match tile_moves.cu
SMEM_BYTES = 2 * ROWS_MAX * ROW_BYTES_MAX + 8 + 128

_BULK = {}     # MK_BULK_WAIT -> (init, reduce_peers, copy_tile_2d, drain)


def bulk_functions(wait=0):
    """The bulk moves of ``cuda/tile_moves.cu`` built with ``MK_BULK_WAIT=wait`` (0: a move
    returns with its stores written; 1: with them read out of shared memory, ``drain`` before a
    flag). Returns ``(init, reduce_peers, copy_tile_2d, drain)``; sm_90a only."""
    if wait in _BULK:
        return _BULK[wait]
    with open(SM90_CUH) as f:      # the library's sm_90a helpers, pasted before this file
        sm90 = f.read()
    helper = linked_source(HELPER, (f"#define MK_BULK_WAIT {wait}\n" if wait else "") + sm90)
    u64, i32, i64 = types.uint64, types.int32, types.int64
    init_fn = cuda.declare_device("mk_bulk_init", i32(u64), link=[helper], abi="c")
    drain_fn = cuda.declare_device("mk_bulk_drain", i32(u64), link=[helper], abi="c")
    move_fn = cuda.declare_device(
        "mk_bulk_move", i32(u64, i32, u64, u64, i64, i32, u64, i64, u64, i64, i32, i32, i32),
        link=[helper], abi="c")

    @cuda.jit(device=True)
    def bulk_init(smem):
        """Once per block before its first move (contains a block barrier)."""
        init_fn(data_ptr(smem))

    @cuda.jit(device=True)
    def bulk_drain(smem):
        """Before publishing a flag for data this block's moves stored (a block barrier)."""
        drain_fn(data_ptr(smem))

    @cuda.jit(device=True)
    def bulk_reduce_peers(smem, seq, ptrs, template, members, me, src_off, src_stride,
                          dst, dst_off, dst_stride, push, rows, wcols):
        """:func:`.reduce.reduce_peers` (same arguments after ``smem, seq``); returns seq."""
        if members == 2:
            src = data_ptr(template) + np.uint64(8 * src_off)
            out = data_ptr(dst) + np.uint64(8 * dst_off)
            peer = data_ptr(peer_view(ptrs, 1 - me, template)) + np.uint64(8 * src_off)
            if _fits(rows, wcols, src | peer, src_stride, out, dst_stride):
                # the peer's partial (NVLink) and ours; the sum overwrites the peer's (push)
                move_fn(data_ptr(smem), np.int32(seq), peer, src, np.int64(8 * src_stride),
                        np.int32(2), out, np.int64(8 * dst_stride), peer,
                        np.int64(8 * src_stride), np.int32(2 if push else 1), np.int32(rows),
                        np.int32(8 * wcols))
                return seq + 1
        reduce_peers(ptrs, template, members, me, src_off, src_stride, dst, dst_off, dst_stride,
                     push, rows, wcols)
        return seq

    @cuda.jit(device=True)
    def bulk_copy_tile_2d(smem, seq, src, src_off, src_stride, dst, dst_off, dst_stride, rows,
                          wcols):
        """:func:`.reduce.copy_tile_2d` (same arguments after ``smem, seq``); returns seq."""
        a = data_ptr(src) + np.uint64(8 * src_off)
        b = data_ptr(dst) + np.uint64(8 * dst_off)
        if not _fits(rows, wcols, a, src_stride, b, dst_stride):
            copy_tile_2d(src, src_off, src_stride, dst, dst_off, dst_stride, rows, wcols)
            return seq
        move_fn(data_ptr(smem), np.int32(seq), a, np.uint64(0), np.int64(8 * src_stride),
                np.int32(1), b, np.int64(8 * dst_stride), np.uint64(0), np.int64(0),
                np.int32(1), np.int32(rows), np.int32(8 * wcols))
        return seq + 1

    _BULK[wait] = (bulk_init, bulk_reduce_peers, bulk_copy_tile_2d, bulk_drain)
    return _BULK[wait]


@cuda.jit(device=True, inline=True)
def _fits(rows, wcols, a, a_stride, b, b_stride):
    """Rows of whole 16-byte units, addresses (a, b: bytes) and strides (words) 16-byte
    aligned, the tile within one shared-memory buffer."""
    return (wcols % 2 == 0 and a_stride % 2 == 0 and b_stride % 2 == 0
            and (a & np.uint64(15)) == 0 and (b & np.uint64(15)) == 0
            and 0 < rows <= ROWS_MAX and 0 < wcols * 8 <= ROW_BYTES_MAX)


# ---- the same calling sequence over plain loads (simulator, GPUs before Hopper, A/B runs) ------
@cuda.jit(device=True)
def threads_init(smem):
    pass


@cuda.jit(device=True)
def threads_reduce_peers(smem, seq, ptrs, template, members, me, src_off, src_stride, dst,
                         dst_off, dst_stride, push, rows, wcols):
    reduce_peers(ptrs, template, members, me, src_off, src_stride, dst, dst_off, dst_stride,
                 push, rows, wcols)
    return seq


@cuda.jit(device=True)
def threads_copy_tile_2d(smem, seq, src, src_off, src_stride, dst, dst_off, dst_stride, rows,
                         wcols):
    copy_tile_2d(src, src_off, src_stride, dst, dst_off, dst_stride, rows, wcols)
    return seq


@cuda.jit(device=True)
def threads_drain(smem):
    pass


#: the ways to move tiles (``move_functions``): "bulk:w1" is bulk with MK_BULK_WAIT=1
MOVES = ("bulk", "bulk:w1", "threads")


def move_functions(name):
    """(init, reduce_peers, copy_tile_2d, drain) of a name in MOVES (bulk: sm_90a only)."""
    if name == "threads":
        return threads_init, threads_reduce_peers, threads_copy_tile_2d, threads_drain
    if name in MOVES and not SIMULATOR:
        return bulk_functions(1 if name == "bulk:w1" else 0)
    raise ValueError(f"no tile moves {name!r} here")
