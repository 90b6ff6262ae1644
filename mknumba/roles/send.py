"""Inter-node send role: publish a transfer command into the proxy's ring (paper §3.3).

A send block calls :func:`enqueue` once per ready chunk. The payload stays in GPU memory; the
48-byte command tells the host proxy what to move where and which flag announces it.

Arguments shared by every call (from ``comm.proxy.device_args()``):
    ring: uint32[slots * CMD_WORDS], mapped host memory (the proxy reads it)
    head: uint32[1], device memory: the ticket counter, advanced only by GPU atomics
    tail: uint32[1], mapped host memory: the proxy's consumed count, i.e. the credits
"""
import numpy as np
from numba import cuda

from .. import _compat  # noqa: F401  (numpy compatibility before numba.cuda compiles)
from ..errors import ROLE_SEND_CREDIT
from ..primitives import atomic_add_relaxed, st_release_sys, wait_flag
from ..proxy.ring import CMD_WORDS, W_SEQ, slot_base, write_body

CREDIT_PAUSE_NS = 4096
_write_body = cuda.jit(device=True, inline=True)(write_body)
_slot_base = cuda.jit(device=True, inline=True)(slot_base)


@cuda.jit(device=True)
def enqueue(ring, head, tail, peer, src_win, src_off, dst_win, dst_off, nbytes, chunk,
            flag_win, flag_slot, epoch, deadline, err, rank):
    """Publish one command; False (and an error record) if no credit came before ``deadline``.

    Takes a ticket, waits (bounded) until the proxy has freed the ticket's slot, writes the body,
    then commits the header with a system-scope release so the proxy never sees a header
    before its body. A full ring makes the caller wait; it never overwrites.
    peer: destination world rank; *_win: window ids from ``Proxy.register``; offsets and
    nbytes in bytes; epoch: the value the peer's flag ``flag_slot`` takes on arrival;
    deadline: a ``globaltimer()`` value; err: int64[8] error record; rank: this world rank.
    """
    slots = ring.shape[0] // CMD_WORDS
    ticket = atomic_add_relaxed(head, 0, 1)
    # Credit: the slot is free once the proxy's consumed count reaches ticket + 1 - slots
    # (wrap-safe, so the same bounded flag wait serves as the credit wait). ``tail`` is host
    # memory: back off up to 4 µs between polls, leaving PCIe to the GPU's command fetches.
    if not wait_flag(tail, 0, np.int64(ticket) + 1 - slots, deadline, err, rank,
                     ROLE_SEND_CREDIT, CREDIT_PAUSE_NS):
        return False
    base = _slot_base(ticket, slots)
    _write_body(ring, base, peer, src_win, src_off, dst_win, dst_off, nbytes, chunk,
                flag_win, flag_slot, epoch)
    st_release_sys(ring, base + W_SEQ, np.uint32((np.int64(ticket) + 1) & 0xFFFFFFFF))
    return True


@cuda.jit(device=True)
def enqueue_rail(proxy, rail, win, off, nbytes, chunk, flag_win, flag_slot, epoch, deadline,
                 err, rank):
    """Block-wide: one command per rail peer (``rail``: their world ranks), each moving
    ``nbytes`` at byte ``off`` of window ``win`` here to the same place there, then setting
    their ``flags[flag_slot]`` (window ``flag_win``) to ``epoch``. Thread 0 enqueues; the
    data must already be visible to the proxy (a system fence, e.g. ``blocks.publish``).
    False for the whole block if a credit never came (recorded; the peers' waits expire too),
    so it can end together. proxy: ``(ring, head, tail)``."""
    ring, head, tail = proxy
    sent = cuda.shared.array(1, np.int32)
    if cuda.threadIdx.x == 0:
        sent[0] = 1
        for i in range(rail.shape[0]):
            if sent[0] and not enqueue(ring, head, tail, rail[i], win, off, win, off, nbytes,
                                       chunk, flag_win, flag_slot, epoch, deadline, err, rank):
                sent[0] = 0
    cuda.syncthreads()
    ok = sent[0] != 0
    cuda.syncthreads()   # read by all before a later call could rewrite it
    return ok
