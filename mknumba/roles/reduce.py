"""Reduction roles' tile moves: sum bf16 tiles from several GPUs or buffers, copy tiles.

Sums round once: two operands with packed bf16 adds (the exact sum, rounded), more operands
accumulated in fp32 and rounded at the end.

All buffers are 1-d ``uint64`` arrays: one word = 4 bf16 values, so every load and store over
NVLink moves 8 bytes (n % 8 == 0 is checked by the ops). A tile region is addressed as
``(array, offset, row_stride)`` in words: a tile of a row-major ``[m, n]`` matrix has
``offset = row0 * n/4 + col0/4`` and ``row_stride = n/4``; a tile-major stage slot has
``offset = slot * bm * bn/4`` and ``row_stride = bn/4``. ``rows x wcols`` words are moved.

Every function is called by all threads of a block and ends with the block's stores issued;
the caller publishes with ``roles.blocks.publish`` (barrier, system fence, release store).
"""
import numpy as np
from numba import cuda

from .. import primitives as prim
from .compute import bf16_hi_to_f32, bf16_to_f32

_LO32, _S32 = np.uint64(0xFFFFFFFF), np.uint64(32)


@cuda.jit(device=True, inline=True)
def _halves(w):
    """A word as two uint32 of two bf16 each (low, high)."""
    return np.uint32(w & _LO32), np.uint32(w >> _S32)


@cuda.jit(device=True, inline=True)
def add_word(acc, k, w):
    """acc[k .. k+3] += the four bf16 of word ``w`` (exact widening: shifts and masks)."""
    lo, hi = _halves(w)
    acc[k] += bf16_to_f32(lo)
    acc[k + 1] += bf16_hi_to_f32(lo)
    acc[k + 2] += bf16_to_f32(hi)
    acc[k + 3] += bf16_hi_to_f32(hi)


@cuda.jit(device=True, inline=True)
def pack_word(acc, k):
    """acc[k .. k+3] -> one word of four bf16 (round to nearest even, two instructions)."""
    return (np.uint64(prim.pack_bf16x2(acc[k + 1], acc[k]))
            | (np.uint64(prim.pack_bf16x2(acc[k + 3], acc[k + 2])) << _S32))


@cuda.jit(device=True, inline=True)
def add_words(a, b):
    """Word of the four lane-wise sums of two words of bf16, each exact sum rounded once (two
    packed adds instead of unpack, add and round: the two-operand sums of 1x2 and 2x1)."""
    alo, ahi = _halves(a)
    blo, bhi = _halves(b)
    return (np.uint64(prim.add_bf16x2(alo, blo))
            | (np.uint64(prim.add_bf16x2(ahi, bhi)) << _S32))


#: Words each thread keeps in flight per source: ``ROWS`` tile rows x 2 columns 32 words apart
#: (288 threads x 8 words = 18 KiB per block and source). Measured per block (288 threads,
#: benchmarks/probe_tile_moves.py): local copy ~19 GB/s, pull from a peer ~11, push ~21, sum of
#: two local tiles ~19 with packed adds (7 when every value was widened, added and rounded:
#: instructions, not bytes in flight, were the limit). 8 rows, or issuing the next group's
#: loads before storing the current one, gained under 5%.
ROWS = 4
WORDS = 2 * ROWS
LANES = 4 * WORDS      # fp32 accumulators per thread


@cuda.jit(device=True, inline=True)
def _warp_rows():
    """Warp-per-row mapping: (first row, row step, lane). A warp walks whole tile rows, each lane
    two words 32 apart, so a warp's loads are 256-byte coalesced runs and no thread divides."""
    return cuda.threadIdx.x // 32, cuda.blockDim.x // 32, cuda.threadIdx.x % 32


@cuda.jit(device=True, inline=True)
def _at(r, c, u, rstep):
    """Row and column of word ``u`` (0..WORDS-1) of the thread's group at (r, c)."""
    return r + (u >> 1) * rstep, c + (u & 1) * 32


@cuda.jit(device=True, inline=True)
def _idx(off, stride, rr, cc):
    """Word index as uint64: numba skips the negative-index fix-up it adds to signed indices."""
    return np.uint64(off + rr * stride + cc)


@cuda.jit(device=True, inline=True)
def _load(src, off, stride, r, c, rstep, rows, wcols, w):
    """w[u] <- the group's words of a tile (0 outside it); all loads issue before any use."""
    for u in range(WORDS):
        rr, cc = _at(r, c, u, rstep)
        w[u] = src[_idx(off, stride, rr, cc)] if rr < rows and cc < wcols else np.uint64(0)


@cuda.jit(device=True, inline=True)
def _store(w, dst, off, stride, r, c, rstep, rows, wcols):
    for u in range(WORDS):
        rr, cc = _at(r, c, u, rstep)
        if rr < rows and cc < wcols:
            dst[_idx(off, stride, rr, cc)] = w[u]


@cuda.jit(device=True, inline=True)
def _zero(acc):
    for i in range(LANES):
        acc[i] = np.float32(0.0)


@cuda.jit(device=True, inline=True)
def _accumulate(acc, w):
    for u in range(WORDS):
        add_word(acc, 4 * u, w[u])


@cuda.jit(device=True, inline=True)
def _pack(acc, w):
    for u in range(WORDS):
        w[u] = pack_word(acc, 4 * u)


@cuda.jit(device=True, inline=True)
def _add2(w, x):
    """w <- w + x lane-wise (two operands: packed bf16 adds, one rounding)."""
    for u in range(WORDS):
        w[u] = add_words(w[u], x[u])


@cuda.jit(device=True, inline=True)
def _push(w, ptrs, template, members, me, off, stride, r, c, rstep, rows, wcols):
    """Store the group's words into every other member's ``template`` buffer (NVLink stores:
    a block pushes about twice the bytes per second it can pull, benchmarks/NOTES.md)."""
    for j in range(1, members):
        _store(w, prim.peer_view(ptrs, prim.peer_after(me, j, members), template), off, stride,
               r, c, rstep, rows, wcols)


@cuda.jit(device=True)
def reduce_peers(ptrs, template, members, me, src_off, src_stride,
                 dst, dst_off, dst_stride, push, rows, wcols):
    """dst <- sum over the ``members`` local GPUs of their tile at ``src_off`` of ``template``.

    ptrs: the symmetric buffer's address table (``SymmetricBuffer.ptrs``); template: this rank's
    buffer (``peer_view`` takes shape and dtype from it). Peers are read starting with the next
    one (``me + 1``), so the G owners reading at one moment spread over different links.
    ``push`` (AllReduce): the sum also overwrites the tile in every other member's buffer, where
    that GPU copies it out; each thread rewrites only words it has already read.
    Two members: packed bf16 adds; more: fp32 accumulation. Either way each output is rounded
    once. ``WORDS`` loads per thread in flight per peer.
    """
    r0, rstep, ln = _warp_rows()
    acc = cuda.local.array(LANES, np.float32)
    w = cuda.local.array(WORDS, np.uint64)
    x = cuda.local.array(WORDS, np.uint64)
    for j in range(prim.steps(r0, rows, ROWS * rstep)):
        r = r0 + j * ROWS * rstep
        for c in range(ln, wcols, 64):
            if members == 2:
                p = 1 - me
                _load(prim.peer_view(ptrs, p, template), src_off, src_stride, r, c, rstep,
                      rows, wcols, w)
                _load(prim.peer_view(ptrs, me, template), src_off, src_stride, r, c, rstep,
                      rows, wcols, x)
                _add2(w, x)
            else:
                _zero(acc)
                for j in range(members):
                    p = prim.peer_after(me, 1 + j, members)
                    _load(prim.peer_view(ptrs, p, template), src_off, src_stride, r, c, rstep,
                          rows, wcols, w)
                    _accumulate(acc, w)
                _pack(acc, w)
            _store(w, dst, dst_off, dst_stride, r, c, rstep, rows, wcols)
            if push:
                _push(w, ptrs, template, members, me, src_off, src_stride, r, c, rstep, rows,
                      wcols)


@cuda.jit(device=True)
def sum_local(own, own_off, recv, recv_off, recv_step, nsrc, dst, dst_off, dst_stride,
              ptrs, template, members, me, push_off, push_stride, push, rows, wcols, bwords):
    """dst <- a partial tile + ``nsrc`` more, all in this GPU's memory: the node's sum and the
    rail peers' (receive role: tile-major stage buffers, row stride ``bwords`` = bn/4), or this
    GPU's own tile and what the other local GPUs delivered into its inbox planes (1-node
    reduce: row stride ``bwords`` = n/4). The s-th extra tile starts at
    ``recv_off + s * recv_step``. ``push``
    (AllReduce, G > 1): the result also goes to ``push_off`` of every other local GPU's
    ``template`` buffer (``ptrs``: its address table), where that GPU copies it out. One
    source: packed bf16 adds; more: fp32 accumulation; each output rounded once.
    """
    r0, rstep, ln = _warp_rows()
    acc = cuda.local.array(LANES, np.float32)
    w = cuda.local.array(WORDS, np.uint64)
    x = cuda.local.array(WORDS, np.uint64)
    for j in range(prim.steps(r0, rows, ROWS * rstep)):
        r = r0 + j * ROWS * rstep
        for c in range(ln, wcols, 64):
            _load(own, own_off, bwords, r, c, rstep, rows, wcols, w)
            if nsrc == 1:
                _load(recv, recv_off, bwords, r, c, rstep, rows, wcols, x)
                _add2(w, x)
            elif nsrc > 1:
                _zero(acc)
                for s in range(nsrc):
                    _load(recv, recv_off + s * recv_step, bwords, r, c, rstep, rows, wcols, x)
                    if s == 0:
                        _accumulate(acc, w)     # after the first source's loads are in flight
                    _accumulate(acc, x)
                _pack(acc, w)
            _store(w, dst, dst_off, dst_stride, r, c, rstep, rows, wcols)
            if push:
                _push(w, ptrs, template, members, me, push_off, push_stride, r, c, rstep,
                      rows, wcols)


@cuda.jit(device=True)
def copy_tile_2d(src, src_off, src_stride, dst, dst_off, dst_stride, rows, wcols):
    """dst tile <- src tile, ``rows x wcols`` words (src may be a peer's buffer); ``WORDS``
    loads per thread in flight before its stores."""
    r0, rstep, ln = _warp_rows()
    w = cuda.local.array(WORDS, np.uint64)
    for j in range(prim.steps(r0, rows, ROWS * rstep)):
        r = r0 + j * ROWS * rstep
        for c in range(ln, wcols, 64):
            _load(src, src_off, src_stride, r, c, rstep, rows, wcols, w)
            _store(w, dst, dst_off, dst_stride, r, c, rstep, rows, wcols)


@cuda.jit(device=True)
def chunk_arrive(counts, ready, chunk, target, epoch):
    """One more tile of ``chunk`` is in the stage; the last one publishes the chunk.

    counts: uint32 per-chunk counters that only grow (``chunk_tiles`` per call, never reset), so
    after call number ``i`` a chunk of ``k`` tiles holds ``i * k`` (mod 2**32) and the tile that
    brings it to ``target = i * k`` is the last. The barrier gathers every thread's stores under
    thread 0, whose fence orders them before the (release) count; the last arriver's fence
    after its read-modify-write acquires the other tiles' counts before it releases
    ``ready[chunk] = epoch`` to the send role. GPU scope throughout: only this GPU's send role
    reads ``ready``, and its system-scope ring commit carries the stage's stores on to the copy
    engine or NIC (release is cumulative).
    """
    cuda.syncthreads()
    if cuda.threadIdx.x == 0:
        prim.fence_gpu()
        old = prim.atomic_add_release(counts, chunk, 1)
        if ((np.int64(old) + 1) & 0xFFFFFFFF) == target:
            prim.release(ready, chunk, epoch, False)
