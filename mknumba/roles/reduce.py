"""Reduction roles' tile moves: sum bf16 tiles from several GPUs or buffers in fp32, copy tiles.

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
from .compute import bf16_to_f32, f32_to_bf16

_M16 = np.uint64(0xFFFF)
_S16, _S32, _S48 = np.uint64(16), np.uint64(32), np.uint64(48)


@cuda.jit(device=True, inline=True)
def lane(w, i):
    """bf16 value ``i`` (0..3) of word ``w``, as float32."""
    return bf16_to_f32(np.uint32((w >> np.uint64(16 * i)) & _M16))


@cuda.jit(device=True, inline=True)
def pack4(x0, x1, x2, x3):
    """Four float32 -> one word of four bf16 (round to nearest even)."""
    return (np.uint64(f32_to_bf16(x0)) | (np.uint64(f32_to_bf16(x1)) << _S16)
            | (np.uint64(f32_to_bf16(x2)) << _S32) | (np.uint64(f32_to_bf16(x3)) << _S48))


@cuda.jit(device=True, inline=True)
def _warp_rows():
    """Warp-per-row mapping: (first row, row step, lane). A warp walks whole tile rows, each lane
    two words 32 apart, so a warp's loads are 256-byte coalesced runs and no thread divides."""
    return cuda.threadIdx.x // 32, cuda.blockDim.x // 32, cuda.threadIdx.x % 32


@cuda.jit(device=True)
def reduce_peers(ptrs, template, members, me, src_off, src_stride,
                 dst, dst_off, dst_stride, dst2, dst2_off, dst2_stride, both, rows, wcols):
    """dst (and dst2 when ``both``) <- sum over the ``members`` local GPUs of their tile.

    ptrs: the symmetric buffer's address table (``SymmetricBuffer.ptrs``); template: this rank's
    buffer (``peer_view`` takes shape and dtype from it). Peers are read starting with the next
    one (``me + 1``), so the G owners reading at one moment spread over different links.
    Accumulates in fp32, rounds once. Each thread keeps four words (two rows x two columns) in
    flight per peer: NVLink loads are latency-bound, so bytes in flight set the rate.
    """
    r0, rstep, ln = _warp_rows()
    for r in range(r0, rows, 2 * rstep):
        r2 = r + rstep
        for c in range(ln, wcols, 64):
            c2 = c + 32
            ok01 = c2 < wcols
            ok10 = r2 < rows
            ok11 = ok01 and ok10
            s00 = src_off + r * src_stride + c
            s10 = s00 + rstep * src_stride
            a = cuda.local.array(16, np.float32)
            for i in range(16):
                a[i] = np.float32(0.0)
            for j in range(members):
                p = me + 1 + j
                if p >= members:
                    p -= members
                v = prim.peer_view(ptrs, p, template)
                w00 = v[s00]
                w01 = v[s00 + 32] if ok01 else np.uint64(0)
                w10 = v[s10] if ok10 else np.uint64(0)
                w11 = v[s10 + 32] if ok11 else np.uint64(0)
                for i in range(4):
                    a[i] += lane(w00, i)
                    a[4 + i] += lane(w01, i)
                    a[8 + i] += lane(w10, i)
                    a[12 + i] += lane(w11, i)
            d = dst_off + r * dst_stride + c
            e = dst2_off + r * dst2_stride + c
            out = pack4(a[0], a[1], a[2], a[3])
            dst[d] = out
            if both:
                dst2[e] = out
            if ok01:
                out = pack4(a[4], a[5], a[6], a[7])
                dst[d + 32] = out
                if both:
                    dst2[e + 32] = out
            if ok10:
                out = pack4(a[8], a[9], a[10], a[11])
                dst[d + rstep * dst_stride] = out
                if both:
                    dst2[e + rstep * dst2_stride] = out
            if ok11:
                out = pack4(a[12], a[13], a[14], a[15])
                dst[d + rstep * dst_stride + 32] = out
                if both:
                    dst2[e + rstep * dst2_stride + 32] = out


@cuda.jit(device=True)
def combine_remote(own, own_off, recv, recv_off, recv_step, nsrc,
                   dst, dst_off, dst_stride, dst2, dst2_off, dst2_stride, both, rows, wcols, bwords):
    """dst (and dst2) <- own node's partial (tile-major) + ``nsrc`` rail peers' partials.

    own/recv: tile-major stage buffers (row stride ``bwords`` = bn/4); the s-th rail peer's
    tile starts at ``recv_off + s * recv_step``. All reads are local memory.
    """
    r0, rstep, ln = _warp_rows()
    for r in range(r0, rows, rstep):
        for c in range(ln, wcols, 32):
            t = r * bwords + c
            w = own[own_off + t]
            a0 = lane(w, 0)
            a1 = lane(w, 1)
            a2 = lane(w, 2)
            a3 = lane(w, 3)
            for s in range(nsrc):
                w = recv[recv_off + s * recv_step + t]
                a0 += lane(w, 0)
                a1 += lane(w, 1)
                a2 += lane(w, 2)
                a3 += lane(w, 3)
            out = pack4(a0, a1, a2, a3)
            dst[dst_off + r * dst_stride + c] = out
            if both:
                dst2[dst2_off + r * dst2_stride + c] = out


@cuda.jit(device=True)
def copy_tile_2d(src, src_off, src_stride, dst, dst_off, dst_stride, rows, wcols):
    """dst tile <- src tile, ``rows x wcols`` words (src may be a peer's buffer); each thread
    issues four loads before its stores (bytes in flight, as in ``reduce_peers``)."""
    r0, rstep, ln = _warp_rows()
    for r in range(r0, rows, 2 * rstep):
        r2 = r + rstep
        for c in range(ln, wcols, 64):
            ok01 = c + 32 < wcols
            ok10 = r2 < rows
            s = src_off + r * src_stride + c
            s2 = s + rstep * src_stride
            w00 = src[s]
            w01 = src[s + 32] if ok01 else np.uint64(0)
            w10 = src[s2] if ok10 else np.uint64(0)
            w11 = src[s2 + 32] if ok01 and ok10 else np.uint64(0)
            d = dst_off + r * dst_stride + c
            d2 = d + rstep * dst_stride
            dst[d] = w00
            if ok01:
                dst[d + 32] = w01
            if ok10:
                dst[d2] = w10
                if ok01:
                    dst[d2 + 32] = w11


@cuda.jit(device=True)
def chunk_arrive(counts, ready, chunk, target, epoch):
    """One more tile of ``chunk`` is in the stage; the last one publishes the chunk.

    counts: uint32 per-chunk counters that only grow (``chunk_tiles`` per call, never reset), so
    after call number ``i`` a chunk of ``k`` tiles holds ``i * k`` (mod 2**32) and the tile that
    brings it to ``target = i * k`` is the last. The barrier gathers every thread's stores under
    thread 0, whose system fence orders them before the (release) count; the last arriver's
    fence after its read-modify-write acquires the other tiles' counts before it releases
    ``ready[chunk] = epoch`` to the send role (and, through it, to the copy engine or NIC).
    """
    cuda.syncthreads()
    if cuda.threadIdx.x == 0:
        prim.fence_sys()
        old = prim.atomic_add_release(counts, chunk, 1)
        if ((np.int64(old) + 1) & 0xFFFFFFFF) == target:
            prim.fence_sys()
            prim.st_release_sys(ready, chunk, epoch)
