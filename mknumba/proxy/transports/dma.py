"""One host, emulated nodes: the copy engine moves each payload GPU to GPU, then the flag follows.

Peer buffers are reached through CUDA IPC. Modes:
- ordered (like InfiniBand RC): the arrival flag is a stream memory write after the copy on the
  same stream; the driver fences before it, so the flag lands after the payload.
- completion (like EFA SRD write-with-immediate): after the copy the stream writes the chunk's
  immediate into the receiver's completion queue (shared host memory, device-mapped); the
  receiving proxy polls it and publishes the flag on its own stream.
Submission runs compiled (:mod:`._cudrv`): the proxy thread calls one ``nogil`` function per
batch, which makes the driver calls without the interpreter.
Environment: ``MKNUMBA_DMA_COPY`` = ``each`` (one cuMemcpyDtoDAsync per command, default) or
``batch`` (one cuMemcpyBatchAsync per batch, CUDA 12.8+ drivers).
"""
import os
import time

import numpy as np

from ...errors import MkError, MkValueError
from ..imm import FlagShadow, encode_imm
from ..ring import MAX_WINDOWS
from . import _cudrv as drv_mod
from .base import COMPLETION, Transport


def _address(arr):
    """Device address of a numba device array (host arrays: their address, for host-memory
    driver stand-ins in tests)."""
    cai = getattr(arr, "__cuda_array_interface__", None)
    if cai is not None:
        return int(cai["data"][0])
    return int(np.asarray(arr).ctypes.data)


class DmaTransport(Transport):
    name = "dma"

    def __init__(self, comm, completion="ordered", copy=None, cq_depth=4096, driver=None,
                 max_batch=256):
        super().__init__(comm, completion)
        self.drv = driver or drv_mod.Driver()
        copy = (copy or os.environ.get("MKNUMBA_DMA_COPY", "each")).lower()
        if copy not in ("each", "batch"):
            raise MkValueError(f"MKNUMBA_DMA_COPY must be 'each' or 'batch', not {copy!r}")
        if copy == "batch" and self.drv.copy_batch is None:
            copy = "each"     # the driver predates cuMemcpyBatchAsync
        self.copy = copy
        self._copy_mode = drv_mod.COPY_BATCH if copy == "batch" else drv_mod.COPY_EACH
        # Comm bound this thread to the GPU's primary context; the proxy thread adopts it.
        self.ctx = self.drv.out("ctx_get")
        self.stream = self.drv.out("stream_create", drv_mod.CU_STREAM_NON_BLOCKING)
        self.flag_stream = self.drv.out("stream_create", drv_mod.CU_STREAM_NON_BLOCKING)
        size = comm.size
        self.src_base = np.zeros(MAX_WINDOWS, np.uint64)
        self.dst_base = np.zeros((MAX_WINDOWS, size), np.uint64)
        self._ipc = []
        n = max_batch
        self._params = np.zeros(n * drv_mod.MEMOP_WORDS, np.uint64)
        self._dsts, self._srcs, self._sizes = (np.zeros(n, np.uint64) for _ in range(3))
        self._wa, self._wv = np.zeros(n, np.uint64), np.zeros(n, np.uint64)
        self._attrs, self._attr_idx = drv_mod.batch_attrs(), np.zeros(1, np.uint64)
        self._fparams = np.zeros(4096 * drv_mod.MEMOP_WORDS, np.uint64)
        self.shadow = FlagShadow()
        self.cq = None
        self._cq_dev = np.zeros(size, np.uint64)
        self._registered_host = []
        if completion == COMPLETION:
            from ..cq import CompletionQueues
            self.cq = CompletionQueues(comm, cq_depth)
            flags = drv_mod.CU_MEMHOSTREGISTER_PORTABLE | drv_mod.CU_MEMHOSTREGISTER_DEVICEMAP
            for r in range(size):
                if r == comm.rank:
                    continue
                host = self.cq.host_address(r)
                self.drv.call("host_register", host, self.cq.nbytes, flags)
                self._registered_host.append(host)
                self._cq_dev[r] = self.drv.out("host_devptr", host, 0)
        self.timeout_ns = comm.timeout_ns

    # -- windows -----------------------------------------------------------------------------------
    def _register(self, w):
        comm, buf = self.comm, w.buf
        self.src_base[w.id] = _address(buf.local)
        known = {r: buf.peers[i] for i, r in enumerate(buf.scope_ranks or ())}
        if len(known) < comm.size:   # the same on every rank: buffers of one scope
            from numba import cuda
            from numba.cuda.cudadrv.devicearray import DeviceNDArray
            handles = comm.mpi.allgather(buf.local.get_ipc_handle())
            ctx = cuda.current_context()
        for r in range(comm.size):
            if r in known:
                arr = known[r]
            elif r == comm.rank:
                arr = buf.local
            else:
                ipc = handles[r]._ipc_handle
                if not ipc.can_access_peer(ctx):
                    raise MkError(f"dma transport: rank {r}'s GPU is not peer-accessible")
                arr = DeviceNDArray(gpu_data=ipc.open_direct(ctx), **handles[r]._array_desc)
                self._ipc.append(ipc)
            self.dst_base[w.id, r] = _address(arr)
        if w.is_flags:
            self.shadow.add_window(w.id, w.nbytes // 4)

    # -- proxy thread ------------------------------------------------------------------------------
    def thread_init(self):
        self.drv.call("ctx_set", self.ctx)

    def submit(self, peer, batch):
        self.check_command(peer, batch)
        n = len(batch)
        if self.cq is None:
            drv_mod.flag_writes(batch, peer, self.dst_base, self._wa, self._wv)
            wide = False
        else:
            seq0 = self.cq.reserve(peer, n, time.monotonic_ns() + self.timeout_ns, self.progress)
            imms = encode_imm(batch["flag_win"], batch["flag_slot"], batch["epoch"])
            self._wa[:n] = self._cq_dev[peer] + np.uint64(8) * self.cq.word_index(seq0, n).astype(
                np.uint64)
            self._wv[:n] = self.cq.entry_values(seq0, imms)
            wide = True
        d = self.drv
        rc = drv_mod.issue(batch, peer, self.src_base, self.dst_base, self._wa, self._wv, wide,
                           self._copy_mode, d.copy, d.memops, d.copy_batch_fn, self.stream,
                           self._params, self._dsts, self._srcs, self._sizes, self._attrs,
                           self._attr_idx)
        if rc:
            what = "cuMemcpy" if rc < 2_000_000 else "cuStreamBatchMemOp"
            raise MkError(f"dma transport: {what} for rank {peer} failed: "
                          f"{d.error_text(rc % 1_000_000)} ({rc % 1_000_000})")

    def progress(self):
        if self.cq is None:
            return 0
        imms = self.cq.poll(limit=len(self._fparams) // drv_mod.MEMOP_WORDS)
        if len(imms) == 0:
            return 0
        wins, slots, epochs = self.shadow.publish(imms)
        addr = self.dst_base[wins, self.comm.rank] + np.uint64(4) * slots.astype(np.uint64)
        rc = drv_mod.write_values(self.drv.memops, self.flag_stream, addr,
                                  epochs.astype(np.uint64), len(imms), False, self._fparams)
        if rc:
            raise MkError(f"dma transport: publishing {len(imms)} flags failed: "
                          f"{self.drv.error_text(rc % 1_000_000)}")
        return len(imms)

    def flush(self, deadline_ns):
        self.drv.call("stream_sync", self.stream)
        self.drv.call("stream_sync", self.flag_stream)

    def close(self):
        for s in (self.stream, self.flag_stream):
            self.drv.stream_destroy(s)
        for h in self._registered_host:
            self.drv.host_unregister(h)
        self._registered_host = []
        if self.cq is not None:
            self.cq.close()
        for ipc in self._ipc:
            ipc.close()
        self._ipc = []
