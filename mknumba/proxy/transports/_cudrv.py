"""The CUDA driver entry points the dma transport calls, and its compiled submission loop.

Why compiled: from Python one driver call costs about 5 µs (docs/design.md §6), too slow for 200,000
commands/s. :func:`dma_issue` and :func:`dma_progress` run inside the proxy's compiled loop
(:mod:`..engine`) and call the driver through ctypes function pointers from ``libcuda.so.1``: per
batch, one ``cuMemcpyDtoDAsync`` per run of adjacent commands (:func:`coalesce`; or one
``cuMemcpyBatchAsync`` for the whole batch) and one ``cuStreamBatchMemOp`` carrying every
command's completion write (arrival flag, or completion-queue entry), in stream order after the
copies, each write after the driver's memory fence. Batches of at least ``N_EVENT_BYTES`` write those completions on a
second stream that waits on an event recorded after their copies (one event, re-recorded: a wait
takes the record current at the time of the call).

The symbol names are the versioned ones cuda.h maps the API names to (CUDA 13 headers):
cuMemcpyDtoDAsync_v2, cuStreamBatchMemOp_v2, cuMemcpyBatchAsync_v2 (no failIdx argument), ...
"""
import ctypes
from collections import namedtuple

import numpy as np
from numba import njit

from ...errors import MkError
from ..clock import now_ns
from ..cq import entry_value, entry_word, take_entries
from ..imm import imm_of, shadow_publish

U64, U32, INT = ctypes.c_uint64, ctypes.c_uint32, ctypes.c_int
CU_STREAM_NON_BLOCKING = 1
CU_STREAM_MEM_OP_WRITE_VALUE_32, CU_STREAM_MEM_OP_WRITE_VALUE_64 = 2, 5
MEMOP_WORDS = 6   # sizeof(CUstreamBatchMemOpParams) / 8: op, address, value, flags, alias, pad
CU_MEMHOSTREGISTER_PORTABLE, CU_MEMHOSTREGISTER_DEVICEMAP = 1, 2
CU_EVENT_DISABLE_TIMING = 2
COPY_EACH, COPY_BATCH = 0, 1

# name -> (symbol, argument types); every pointer travels as uint64 (same ABI on x86-64)
_SIGS = {
    "copy": ("cuMemcpyDtoDAsync_v2", [U64, U64, U64, U64]),            # dst, src, bytes, stream
    "memops": ("cuStreamBatchMemOp_v2", [U64, U32, U64, U32]),         # stream, n, params, flags
    "copy_batch": ("cuMemcpyBatchAsync_v2", [U64, U64, U64, U64, U64, U64, U64, U64]),
    "ctx_get": ("cuCtxGetCurrent", [U64]),
    "ctx_set": ("cuCtxSetCurrent", [U64]),
    "stream_create": ("cuStreamCreate", [U64, U32]),
    "stream_destroy": ("cuStreamDestroy_v2", [U64]),
    "stream_sync": ("cuStreamSynchronize", [U64]),
    "stream_query": ("cuStreamQuery", [U64]),
    "host_register": ("cuMemHostRegister_v2", [U64, U64, U32]),
    "host_unregister": ("cuMemHostUnregister", [U64]),
    "host_devptr": ("cuMemHostGetDevicePointer_v2", [U64, U64, U32]),
    "error_string": ("cuGetErrorString", [INT, U64]),
    "event_create": ("cuEventCreate", [U64, U32]),
    "event_destroy": ("cuEventDestroy_v2", [U64]),
    "event_record": ("cuEventRecord", [U64, U64]),                     # event, stream
    "stream_wait_event": ("cuStreamWaitEvent", [U64, U64, U32]),       # stream, event, flags
}


class Driver:
    """ctypes function pointers into libcuda (``lib`` may be a stand-in for tests)."""

    def __init__(self, lib=None):
        self.lib = lib if lib is not None else ctypes.CDLL("libcuda.so.1")
        for name, (sym, args) in _SIGS.items():
            try:
                f = getattr(self.lib, sym)
            except AttributeError:
                if name == "copy_batch":      # older drivers: fall back to one call per copy
                    setattr(self, name, None)
                    continue
                raise
            f.restype, f.argtypes = INT, args
            setattr(self, name, f)
        # issue() is compiled for one function type; without the batch entry point it gets a
        # stand-in of the same signature that is never called
        self.copy_batch_fn = self.copy_batch or _NO_COPY_BATCH

    def error_text(self, rc):
        s = ctypes.c_char_p()
        self.error_string(int(rc), ctypes.addressof(s))
        return s.value.decode() if s.value else f"CUDA error {rc}"

    def ok(self, rc, what):
        if rc != 0:
            raise MkError(f"{what} failed: {self.error_text(rc)} ({rc})")

    def call(self, name, *args):
        self.ok(getattr(self, name)(*args), _SIGS[name][0])

    def out(self, name, *args):
        """Call an entry point whose first argument is an output pointer; return the value."""
        v = U64(0)
        self.call(name, ctypes.addressof(v), *args)
        return v.value


_NO_COPY_BATCH = ctypes.CFUNCTYPE(INT, *_SIGS["copy_batch"][1])(lambda *a: 801)


def batch_attrs():
    """One CUmemcpyAttributes (24 bytes): source read in stream order, no hints, no flags."""
    a = np.zeros(6, np.int32)
    a[0] = 1          # CU_MEMCPY_SRC_ACCESS_ORDER_STREAM
    return a


# knobs: uint64 settings of a DmaCtx
(N_STREAM, N_FLAG_STREAM, N_COPY_MODE, N_COMPLETION, N_ME, N_DEPTH, N_TIMEOUT_NS, N_WRITE_STREAM,
 N_EVENT, N_EVENT_BYTES) = range(10)
NKNOBS = 10
MEMOP_MAX = 128          # cuStreamBatchMemOp takes fewer than 256 operations per call
ERR_COPY, ERR_MEMOPS, ERR_CQ_FULL, ERR_EVENT = 1_000_000, 2_000_000, 3_000_000, 4_000_000

#: Everything the compiled issue/progress use, rebuilt by DmaTransport.compiled().
DmaCtx = namedtuple("DmaCtx", [
    "fn_copy", "fn_memops", "fn_copy_batch", "fn_record", "fn_wait", "clock", "knobs",
    "copies",                                              # copies issued so far (stats)
    "src_base", "dst_base",                                # window addresses (this rank; all)
    "dsts", "srcs", "sizes", "keys", "order",              # copies; coalesce's sort scratch
    "write_addr", "write_val", "params", "attrs", "attr_idx",
    "cq_dev", "cq_sent", "peer_consumed",                  # sender side of completion queues
    "entries", "consumed", "taken", "shadow", "shadow_off",  # receiver side
    "imms", "flag_addr", "flag_val", "fparams"])


@njit(nogil=True)
def dma_issue(ctx, peer, batch):
    """Copy each command's payload, then one batched memop with every completion write: the
    arrival flags (ordered) or completion-queue entries (completion), in stream order after
    the copies of the batch. batch: COMMAND_DTYPE[n <= MEMOP_MAX]. Returns 0 or an error code (ERR_* +
    the CUDA error)."""
    n = batch.shape[0]
    kn = ctx.knobs
    me = np.int64(kn[N_ME])
    if kn[N_COMPLETION]:
        depth = np.int64(kn[N_DEPTH])
        sent = ctx.cq_sent[peer]
        deadline = now_ns(ctx.clock) + np.int64(kn[N_TIMEOUT_NS])
        while sent + n - np.int64(ctx.peer_consumed[peer][me]) > depth:   # peer's queue full
            if dma_progress(ctx) < 0 or now_ns(ctx.clock) > deadline:
                return ERR_CQ_FULL
        for i in range(n):
            c = batch[i]
            ctx.write_addr[i] = ctx.cq_dev[peer] + np.uint64(8 * entry_word(me, sent + i, depth))
            ctx.write_val[i] = entry_value(sent + i, imm_of(c.flag_win, c.flag_slot, c.epoch))
        ctx.cq_sent[peer] = sent + n
    else:
        for i in range(n):
            c = batch[i]
            ctx.write_addr[i] = ctx.dst_base[c.flag_win, peer] + np.uint64(4) * np.uint64(c.flag_slot)
            ctx.write_val[i] = c.epoch
    stream = kn[N_STREAM]             # the copies, then (small batches) their completion writes
    k, overlap = coalesce(ctx, peer, batch)
    ctx.copies[0] += k
    # cuMemcpyBatchAsync runs a batch's copies in no set order: writes that overlap go one by one
    if kn[N_COPY_MODE] == COPY_EACH or overlap:
        for i in range(k):
            rc = ctx.fn_copy(ctx.dsts[i], ctx.srcs[i], ctx.sizes[i], stream)
            if rc != 0:
                return ERR_COPY + rc
    else:
        rc = ctx.fn_copy_batch(ctx.dsts.ctypes.data, ctx.srcs.ctypes.data, ctx.sizes.ctypes.data,
                               k, ctx.attrs.ctypes.data, ctx.attr_idx.ctypes.data, 1, stream)
        if rc != 0:
            return ERR_COPY + rc
    # A large batch writes its completions on a second stream behind an event: its copy stream
    # goes straight on to the next batch's copies instead of idling while the writes (and the
    # fence before them) wait for these copies to drain. Small batches skip the two extra calls.
    wstream = stream
    nbytes = np.uint64(0)
    for i in range(k):
        nbytes += ctx.sizes[i]
    if nbytes >= kn[N_EVENT_BYTES]:
        rc = ctx.fn_record(kn[N_EVENT], stream)
        if rc == 0:
            rc = ctx.fn_wait(kn[N_WRITE_STREAM], kn[N_EVENT], 0)
        if rc != 0:
            return ERR_EVENT + rc
        wstream = kn[N_WRITE_STREAM]
    return write_values(ctx.fn_memops, wstream, ctx.write_addr, ctx.write_val, n,
                        kn[N_COMPLETION] != 0, ctx.params)


@njit(nogil=True)
def coalesce(ctx, peer, batch):
    """Fill ctx.dsts/srcs/sizes with the batch's copies in destination order, a command that
    continues the previous one in both source and destination (same windows) merged into it.

    Why: the copy engine spends about 2 µs per copy (measured: 1 MiB copies queued back to back
    run at 56% of one large copy), and consecutive chunks of a send role are adjacent in both
    its stage and the receiver's buffer. Sorting first lets chunks that several threads
    enqueued out of order merge too; the order of copies within a batch is free because every
    completion write follows all of them (and no copy of a batch reads what another writes: a
    send role reads its own stage and writes a peer's buffer). Destinations that overlap keep
    the ring's order. Returns (copies, whether destinations overlap)."""
    n = batch.shape[0]
    key, order = ctx.keys, ctx.order
    for i in range(n):
        c = batch[i]
        key[i] = ctx.dst_base[c.dst_win, peer] + c.dst_off
        order[i] = i
    for i in range(1, n):          # insertion sort by destination (stable; n is a batch, ~8)
        j, o = i, order[i]
        while j > 0 and key[order[j - 1]] > key[o]:
            order[j] = order[j - 1]
            j -= 1
        order[j] = o
    overlap = False
    for q in range(1, n):
        a, b = order[q - 1], order[q]
        if key[a] + np.uint64(batch[a].nbytes) > key[b]:    # overlap: ring order decides
            overlap = True
            for i in range(n):
                order[i] = i
            break
    k = 0
    prev = 0
    for q in range(n):
        i = order[q]
        c = batch[i]
        d = key[i]
        s = ctx.src_base[c.src_win] + c.src_off
        nb = np.uint64(c.nbytes)
        # same windows too: two allocations that happen to touch stay two copies
        if k > 0 and c.src_win == batch[prev].src_win and c.dst_win == batch[prev].dst_win \
                and ctx.dsts[k - 1] + ctx.sizes[k - 1] == d \
                and ctx.srcs[k - 1] + ctx.sizes[k - 1] == s:
            ctx.sizes[k - 1] += nb
        else:
            ctx.dsts[k] = d
            ctx.srcs[k] = s
            ctx.sizes[k] = nb
            k += 1
        prev = i
    return k, overlap


@njit(nogil=True)
def dma_progress(ctx):
    """Receiver (completion mode): publish the arrival flag of every completion-queue entry
    that has landed, on the flag stream. Returns how many, or -(error code)."""
    kn = ctx.knobs
    if not kn[N_COMPLETION]:
        return 0
    me = np.int64(kn[N_ME])
    n = take_entries(ctx.entries, ctx.consumed, ctx.taken, me, ctx.imms)
    for i in range(n):
        win, slot, e = shadow_publish(ctx.shadow, ctx.shadow_off, ctx.imms[i])
        ctx.flag_addr[i] = ctx.dst_base[win, me] + np.uint64(4 * slot)
        ctx.flag_val[i] = e
    rc = write_values(ctx.fn_memops, kn[N_FLAG_STREAM], ctx.flag_addr, ctx.flag_val, n, False,
                      ctx.fparams)
    return -rc if rc else n


@njit(nogil=True)
def write_values(fn_memops, stream, addr, val, n, wide, params):
    """cuStreamBatchMemOp calls (MEMOP_MAX operations each) writing val[i] (32- or 64-bit) to
    device address addr[i], i < n. Returns 0 or ERR_MEMOPS + the CUDA error code."""
    op = CU_STREAM_MEM_OP_WRITE_VALUE_64 if wide else CU_STREAM_MEM_OP_WRITE_VALUE_32
    for first in range(0, n, MEMOP_MAX):
        m = min(MEMOP_MAX, n - first)
        for j in range(m):
            b = j * MEMOP_WORDS
            params[b] = op
            params[b + 1] = addr[first + j]
            params[b + 2] = val[first + j]
            # CU_STREAM_WRITE_VALUE_DEFAULT: a memory fence before the write (the driver on
            # the H200 hosts refuses NO_MEMORY_BARRIER here with "invalid argument")
            params[b + 3] = 0
            params[b + 4] = 0
            params[b + 5] = 0
        rc = fn_memops(stream, m, params.ctypes.data, 0)
        if rc != 0:
            return ERR_MEMOPS + rc
    return 0
