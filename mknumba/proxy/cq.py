"""Completion queues in shared host memory: the emulated NIC's "receive completion" path.

Completion-based transports on one host (``dma`` and ``sim`` in completion mode) deliver each
chunk's immediate (see :mod:`.imm`) into the receiver's queue *after* the payload has landed; the
receiving proxy polls its queue and publishes the arrival flag, as an EFA receiver does with
write-with-immediate completions.

Each rank owns one POSIX shared-memory segment, uint64 words:
    entries[size, depth]  row s: entries from sender s; entry k holds (seq + 1) << 32 | imm
    consumed[size]        how many entries of row s this receiver has taken (its only writer)
A sender writes only its row of each peer's segment, so every word has one writer.
"""
import os
import secrets
import time
from multiprocessing import resource_tracker, shared_memory

import numpy as np
from numba import njit

from ..errors import MkTimeoutError

_PAGE = 4096


@njit(nogil=True, inline="always")
def entry_word(sender, seq, depth):
    """Word index, within the receiver's segment, of ``sender``'s entry number ``seq``."""
    return sender * depth + seq % depth


@njit(nogil=True, inline="always")
def entry_value(seq, imm):
    """The entry word: (seq + 1) << 32 | imm (seq mod 2**32; 0 never names an entry)."""
    return (np.uint64((seq + 1) & 0xFFFFFFFF) << np.uint64(32)) | np.uint64(imm)


@njit(nogil=True)
def take_entries(entries, consumed, taken, me, out):
    """Receiver: move every ready entry (per sender, in order) into ``out`` as immediates and
    give the entries back (``consumed``). Returns how many; stops when ``out`` is full.

    entries: uint64[senders, depth]; consumed: uint64[senders] (shared: the senders read it);
    taken: int64[senders] (private); out: uint32[>= 1].
    """
    depth = entries.shape[1]
    n = 0
    for s in range(entries.shape[0]):
        if s == me:
            continue
        t = taken[s]
        while n < out.shape[0]:
            e = entries[s, t % depth]
            if np.int64(e >> np.uint64(32)) != ((t + 1) & 0xFFFFFFFF):
                break
            out[n] = np.uint32(e & np.uint64(0xFFFFFFFF))
            n += 1
            t += 1
        if t != taken[s]:
            taken[s] = t
            consumed[s] = t           # after the entries were read: the sender may reuse them
    return n


class CompletionQueues:
    """This rank's inbound queues plus its views of every peer's (collective over comm.mpi)."""

    def __init__(self, comm, depth=4096):
        self.rank, self.size, self.depth = comm.rank, comm.size, int(depth)
        nwords = self.size * self.depth + self.size
        nbytes = -(-nwords * 8 // _PAGE) * _PAGE          # whole pages: cuMemHostRegister wants them
        name = f"mkcq_{os.getpid()}_{self.rank}_{secrets.token_hex(4)}"   # unique across runs
        self._own = shared_memory.SharedMemory(name=name, create=True, size=nbytes)
        np.ndarray(nwords, np.uint64, buffer=self._own.buf)[:] = 0
        names = comm.mpi.allgather(name)
        self._segs = []
        self.words = []           # per rank: uint64[nwords] view of that rank's segment
        for r, n in enumerate(names):
            seg = self._own if r == self.rank else shared_memory.SharedMemory(name=n)
            if r != self.rank:
                resource_tracker.unregister(seg._name, "shared_memory")
            self._segs.append(seg)
            self.words.append(np.ndarray(nwords, np.uint64, buffer=seg.buf))
        self.nbytes = nbytes
        mine = self.words[self.rank]
        self.entries = mine[:self.size * self.depth].reshape(self.size, self.depth)
        self.consumed = mine[self.size * self.depth:]
        self.sent = np.zeros(self.size, np.int64)       # entries we reserved in each peer's row
        self.taken = np.zeros(self.size, np.int64)      # entries we took from each sender
        comm.mpi.Barrier()   # every segment zeroed before anyone pushes

    def host_address(self, rank):
        """Address of ``rank``'s segment in this process (for cuMemHostRegister)."""
        return self.words[rank].ctypes.data

    # -- sender side ----------------------------------------------------------------------------
    def reserve(self, peer, n, deadline_ns, progress):
        """Reserve ``n`` entries in ``peer``'s row for us; returns the first sequence number.

        Waits while the peer has not consumed enough (calling ``progress()`` meanwhile, so two
        proxies waiting on each other still drain their own queues); MkTimeoutError past the
        deadline (``time.monotonic_ns`` clock).
        """
        if n > self.depth:
            raise ValueError(f"batch of {n} exceeds completion queue depth {self.depth}")
        consumed = self.words[peer][self.size * self.depth:]
        while self.sent[peer] + n - int(consumed[self.rank]) > self.depth:
            progress()
            if time.monotonic_ns() > deadline_ns:
                raise MkTimeoutError(f"rank {self.rank} proxy: rank {peer}'s completion queue "
                                     f"stayed full (its proxy stopped consuming?)")
        seq0 = int(self.sent[peer])
        self.sent[peer] += n
        return seq0

    def push(self, peer, seq0, imms):
        """Host-side delivery (simulator): write the entries into ``peer``'s segment."""
        _push(self.words[peer], self.rank, self.depth, seq0, np.asarray(imms, np.uint32))

    # -- receiver side --------------------------------------------------------------------------
    def poll(self, limit=256):
        """Take every ready entry from every sender -> uint32 immediates (per-sender order)."""
        out = np.empty(limit, np.uint32)
        return out[:take_entries(self.entries, self.consumed, self.taken, self.rank, out)]

    def close(self):
        self.words = self.entries = self.consumed = None
        for r, seg in enumerate(self._segs):
            seg.close()
            if r == self.rank:
                seg.unlink()
        self._segs = []


@njit(nogil=True)
def _push(words, sender, depth, seq0, imms):
    for i in range(imms.shape[0]):
        words[entry_word(sender, seq0 + i, depth)] = entry_value(seq0 + i, imms[i])
