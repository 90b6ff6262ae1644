"""The simulator's transport: memcpy between shared-memory buffers on one host.

Ordered mode stores the payload, then the flag (x86 keeps stores in order; a locked operation
in between orders glibc's non-temporal stores for large copies too). Completion mode pushes the
chunk's immediate into the receiver's completion queue, and the receiving proxy sets the flag.
"""
import threading
import time
from multiprocessing import resource_tracker, shared_memory

import numpy as np

from ...errors import MkValueError
from ..cq import CompletionQueues
from ..imm import encode_imm
from .base import COMPLETION, Transport


def _store_fence(_lock=threading.Lock()):
    with _lock:   # a LOCK-prefixed instruction: a full store fence on x86
        pass


def world_peer_arrays(comm, buf):
    """uint8 views of every world rank's buffer (attaching segments outside buf's scope)."""
    arrays = [None] * comm.size
    if buf.scope_ranks is not None:
        for i, r in enumerate(buf.scope_ranks):
            arrays[r] = buf.peers[i]
    names = comm.mpi.allgather(getattr(buf, "shm_name", None))
    extra = []
    for r in range(comm.size):
        if arrays[r] is None:
            if names[r] is None:
                raise MkValueError("sim transport: buffer is not shared memory")
            s = shared_memory.SharedMemory(name=names[r])
            resource_tracker.unregister(s._name, "shared_memory")
            extra.append(s)
            arrays[r] = np.ndarray(buf.shape, buf.dtype, buffer=s.buf)
    return [a.reshape(-1).view(np.uint8) for a in arrays], extra


class SimTransport(Transport):
    name = "sim"

    def __init__(self, comm, completion="ordered", cq_depth=1024):
        super().__init__(comm, completion)
        self._bytes = {}     # window id -> per world rank uint8 view
        self._extra = {}     # window id -> segments attached for it
        self.cq = CompletionQueues(comm, cq_depth) if completion == COMPLETION else None
        self.timeout_ns = comm.timeout_ns

    def _register(self, w):
        self._bytes[w.id], self._extra[w.id] = world_peer_arrays(self.comm, w.buf)

    def _unregister(self, w):
        del self._bytes[w.id]
        for seg in self._extra.pop(w.id):
            seg.close()

    def submit(self, peer, batch):
        self.check_command(peer, batch)
        me = self.comm.rank
        for c in batch:
            n, s, d = int(c["nbytes"]), int(c["src_off"]), int(c["dst_off"])
            self._bytes[c["dst_win"]][peer][d:d + n] = self._bytes[c["src_win"]][me][s:s + n]
        _store_fence()
        if self.cq is None:
            for c in batch:
                flags = self._bytes[c["flag_win"]][peer].view(np.uint32)
                flags[c["flag_slot"]] = c["epoch"]
        else:
            imms = encode_imm(batch["flag_win"], batch["flag_slot"], batch["epoch"])
            seq0 = self.cq.reserve(peer, len(batch), time.monotonic_ns() + self.timeout_ns,
                                   self.progress)
            self.cq.push(peer, seq0, imms)

    def progress(self):
        if self.cq is None:
            return 0
        imms = self.cq.poll()
        if len(imms):
            wins, slots, epochs = self.shadow.publish(imms)
            me = self.comm.rank
            for w, s, e in zip(wins, slots, epochs):
                self._bytes[w][me].view(np.uint32)[s] = e
        return len(imms)

    def close(self):
        if self.cq is not None:
            self.cq.close()
        self._bytes = {}
        for segs in self._extra.values():
            for s in segs:
                s.close()
        self._extra = {}
