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
import time
from multiprocessing import resource_tracker, shared_memory

import numpy as np

from ..errors import MkTimeoutError

_PAGE = 4096


class CompletionQueues:
    """This rank's inbound queues plus its views of every peer's (collective over comm.mpi)."""

    def __init__(self, comm, depth=4096):
        self.rank, self.size, self.depth = comm.rank, comm.size, int(depth)
        nwords = self.size * self.depth + self.size
        nbytes = -(-nwords * 8 // _PAGE) * _PAGE          # whole pages: cuMemHostRegister wants them
        name = f"mkcq_{os.getpid()}_{self.rank}_{id(self) & 0xFFFFFF:x}"
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
        self._ks = np.arange(self.depth, dtype=np.int64)
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

    def word_index(self, seq0, n):
        """Word offsets (within a peer's segment) of our entries seq0 .. seq0+n-1."""
        return self.rank * self.depth + (seq0 + self._ks[:n]) % self.depth

    @staticmethod
    def entry_values(seq0, imms):
        """uint64 entry words: (seq + 1) << 32 | imm, seq mod 2**32."""
        seqs = (seq0 + 1 + np.arange(len(imms), dtype=np.int64)) & 0xFFFFFFFF
        return ((seqs.astype(np.uint64) << np.uint64(32))
                | np.asarray(imms, np.uint32).astype(np.uint64))

    def push(self, peer, seq0, imms):
        """Host-side delivery (simulator): write the entries into ``peer``'s segment."""
        self.words[peer][self.word_index(seq0, len(imms))] = self.entry_values(seq0, imms)

    # -- receiver side --------------------------------------------------------------------------
    def poll(self, limit=256):
        """Take every ready entry from every sender -> uint32 immediates (per-sender order)."""
        out = []
        for s in range(self.size):
            if s == self.rank:
                continue
            t = int(self.taken[s])
            k = self._ks[:min(limit, self.depth)]
            got = self.entries[s, (t + k) % self.depth]
            ready = (got >> np.uint64(32)).astype(np.int64) == ((t + 1 + k) & 0xFFFFFFFF)
            n = len(k) if ready.all() else int(np.argmin(ready))
            if n:
                out.append((got[:n] & np.uint64(0xFFFFFFFF)).astype(np.uint32))
                self.taken[s] = t + n
                self.consumed[s] = t + n          # give the sender its entries back
        return np.concatenate(out) if out else np.zeros(0, np.uint32)

    def close(self):
        self.words = self.entries = self.consumed = None
        for r, seg in enumerate(self._segs):
            seg.close()
            if r == self.rank:
                seg.unlink()
        self._segs = []
