"""One host, emulated nodes: the copy engine moves each payload GPU to GPU, then the flag follows.

Peer buffers are reached through CUDA IPC. Modes:
- ordered (like InfiniBand RC): the arrival flag is a stream memory write after the copy on the
  same stream; the driver fences before it, so the flag lands after the payload.
- completion (like EFA SRD write-with-immediate): after the copy the stream writes the chunk's
  immediate into the receiver's completion queue (shared host memory, device-mapped); the
  receiving proxy polls it and publishes the flag on its own stream.
Submission and flag publishing run compiled (:mod:`._cudrv`) inside the proxy's compiled loop,
so the driver calls never wait for the interpreter.
One copy stream: several streams taken in turn did not help (benchmarks/NOTES.md, proxy). A
batch moving at least ``MKNUMBA_DMA_EVENT_BYTES`` (default 256 KiB) writes its completions on a
second stream behind an event, so its copy stream does not wait for them (1 MiB chunks: 66% ->
87% of the copy engine, benchmarks/NOTES.md); smaller batches write them on the copy stream.
``MKNUMBA_DMA_COPY`` = ``batch`` (one cuMemcpyBatchAsync per batch; the default where the
driver has it, CUDA 12.8+: ~9x the commands per second of ``each`` on an H200,
benchmarks/NOTES.md) or ``each`` (one cuMemcpyDtoDAsync per command; also the fallback).
"""
import os

import numpy as np

from ...errors import MkError, MkValueError
from ..clock import new_clock
from ..ring import MAX_WINDOWS
from . import _cudrv as drv_mod
from .base import COMPLETION, Transport

#: below this a batch's copies take < 1 µs at the copy engine's rate, so the bubble its
#: completion writes leave is smaller than the two extra driver calls the event path costs
EVENT_BYTES = 256 << 10


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
                 event_bytes=None):
        super().__init__(comm, completion)
        self.drv = driver or drv_mod.Driver()
        copy = (copy or os.environ.get("MKNUMBA_DMA_COPY", "batch")).lower()
        if copy not in ("each", "batch"):
            raise MkValueError(f"MKNUMBA_DMA_COPY must be 'each' or 'batch', not {copy!r}")
        if copy == "batch" and self.drv.copy_batch is None:
            copy = "each"     # the driver predates cuMemcpyBatchAsync
        self.copy = copy
        event_bytes = int(event_bytes if event_bytes is not None
                          else os.environ.get("MKNUMBA_DMA_EVENT_BYTES", EVENT_BYTES))
        if event_bytes < 0:
            raise MkValueError(f"MKNUMBA_DMA_EVENT_BYTES must be >= 0, not {event_bytes}")
        # Comm bound this thread to the GPU's primary context; the proxy thread adopts it.
        self.ctx = self.drv.out("ctx_get")
        self.stream = self.drv.out("stream_create", drv_mod.CU_STREAM_NON_BLOCKING)
        self.flag_stream = self.drv.out("stream_create", drv_mod.CU_STREAM_NON_BLOCKING)
        self.write_stream = self.drv.out("stream_create", drv_mod.CU_STREAM_NON_BLOCKING)
        self.event = self.drv.out("event_create", drv_mod.CU_EVENT_DISABLE_TIMING)
        size = comm.size
        self.src_base = np.zeros(MAX_WINDOWS, np.uint64)
        self.dst_base = np.zeros((MAX_WINDOWS, size), np.uint64)
        self._ipc = {}             # window id -> IPC mappings opened for it
        self._registered_host = []
        n, m = 256, drv_mod.MEMOP_MAX      # a batch (engine: max_batch <= 256); a flag round
        self._scratch = dict(
            dsts=np.zeros(n, np.uint64), srcs=np.zeros(n, np.uint64), sizes=np.zeros(n, np.uint64),
            keys=np.zeros(n, np.uint64), order=np.zeros(n, np.int64),
            write_addr=np.zeros(n, np.uint64), write_val=np.zeros(n, np.uint64),
            params=np.zeros(m * drv_mod.MEMOP_WORDS, np.uint64), attrs=drv_mod.batch_attrs(),
            attr_idx=np.zeros(1, np.uint64), imms=np.zeros(m, np.uint32),
            flag_addr=np.zeros(m, np.uint64), flag_val=np.zeros(m, np.uint64),
            fparams=np.zeros(m * drv_mod.MEMOP_WORDS, np.uint64),
            cq_dev=np.zeros(size, np.uint64), cq_sent=np.zeros(size, np.int64),
            copies=np.zeros(1, np.int64))
        self.cq = None
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
                self._scratch["cq_dev"][r] = self.drv.out("host_devptr", host, 0)
        self.knobs = np.zeros(drv_mod.NKNOBS, np.uint64)
        self.knobs[[drv_mod.N_STREAM, drv_mod.N_FLAG_STREAM, drv_mod.N_COPY_MODE, drv_mod.N_COMPLETION,
                    drv_mod.N_ME, drv_mod.N_DEPTH, drv_mod.N_TIMEOUT_NS, drv_mod.N_WRITE_STREAM,
                    drv_mod.N_EVENT, drv_mod.N_EVENT_BYTES]] = [
            self.stream, self.flag_stream,
            drv_mod.COPY_BATCH if copy == "batch" else drv_mod.COPY_EACH,
            self.cq is not None, comm.rank, cq_depth, comm.timeout_ns, self.write_stream,
            self.event, event_bytes]
        self._clock = new_clock()

    @property
    def copies_issued(self):
        """Copies handed to the copy engine so far (after merging adjacent commands)."""
        return int(self._scratch["copies"][0])

    # -- windows -----------------------------------------------------------------------------------
    def _register(self, w):
        comm, buf = self.comm, w.buf
        self.src_base[w.id] = _address(buf.local)
        known = {r: buf.peers[i] for i, r in enumerate(buf.scope_ranks or ())}
        opened = self._ipc.setdefault(w.id, [])
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
                opened.append(ipc)
            self.dst_base[w.id, r] = _address(arr)

    def _send_streams(self):
        """Streams carrying this rank's sends: copies and their completion writes."""
        return [self.stream, self.write_stream]

    def _all_streams(self):
        return self._send_streams() + [self.flag_stream]

    def quiesce(self, deadline_ns):
        for st in self._send_streams():   # stream work is safe to wait on from any thread
            self.drv.call("stream_sync", st)

    def _unregister(self, w):
        for ipc in self._ipc.pop(w.id, []):
            ipc.close()
        self.src_base[w.id] = 0
        self.dst_base[w.id] = 0

    # -- proxy thread ------------------------------------------------------------------------------
    def thread_init(self):
        self.drv.call("ctx_set", self.ctx)

    def compiled(self):
        d, sc, cq = self.drv, self._scratch, self.cq
        if cq is None:    # placeholders of the same types: the receiver side stays unused
            dummy = np.zeros(1, np.uint64)
            peer_consumed = tuple(dummy for _ in range(self.comm.size))
            entries, consumed, taken = np.zeros((1, 1), np.uint64), dummy, np.zeros(1, np.int64)
        else:
            peer_consumed = tuple(w[cq.size * cq.depth:] for w in cq.words)
            entries, consumed, taken = cq.entries, cq.consumed, cq.taken
        ctx = drv_mod.DmaCtx(
            fn_copy=d.copy, fn_memops=d.memops, fn_copy_batch=d.copy_batch_fn,
            fn_record=d.event_record, fn_wait=d.stream_wait_event, clock=self._clock,
            knobs=self.knobs, src_base=self.src_base, dst_base=self.dst_base,
            peer_consumed=peer_consumed, entries=entries, consumed=consumed, taken=taken,
            shadow=self.shadow.values, shadow_off=self.shadow.offsets, **sc)
        return drv_mod.dma_issue, drv_mod.dma_progress, ctx

    def describe_error(self, code):
        kind, rc = divmod(int(code), drv_mod.ERR_COPY)
        kind *= drv_mod.ERR_COPY
        if kind == drv_mod.ERR_CQ_FULL:
            return ("the peer's completion queue stayed full until the timeout (its proxy "
                    "stopped consuming?)")
        what = {drv_mod.ERR_COPY: "cuMemcpy", drv_mod.ERR_MEMOPS: "cuStreamBatchMemOp"}.get(
            kind, "driver call")
        return f"{what}: {self.drv.error_text(rc)} ({rc})"

    def submit(self, peer, batch):
        """Issue one batch from Python (tests; the proxy issues from its compiled loop)."""
        self.check_command(peer, batch)
        rc = drv_mod.dma_issue(self.compiled()[2], peer, batch)
        if rc:
            raise MkError(f"dma transport: submitting to rank {peer} failed: "
                          f"{self.describe_error(rc)}")

    def progress(self):
        n = drv_mod.dma_progress(self.compiled()[2])
        if n < 0:
            raise MkError(f"dma transport: publishing flags failed: {self.describe_error(-n)}")
        return n

    def flush(self, deadline_ns):
        for st in self._all_streams():
            self.drv.call("stream_sync", st)

    def close(self):
        for st in self._all_streams():
            self.drv.stream_destroy(st)
        if self.event:
            self.drv.event_destroy(self.event)
            self.event = 0
        for h in self._registered_host:
            self.drv.host_unregister(h)
        self._registered_host = []
        if self.cq is not None:
            self.cq.close()
        for opened in self._ipc.values():
            for ipc in opened:
                ipc.close()
        self._ipc = {}
