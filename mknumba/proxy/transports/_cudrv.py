"""The CUDA driver entry points the dma transport calls, and its compiled submission loop.

Why compiled: from Python one driver call costs about 5 µs (DESIGN.md §6), too slow for 200,000
commands/s. ``issue`` runs in ``@njit(nogil=True)`` and calls the driver through ctypes function
pointers from ``libcuda.so.1``: per batch, one ``cuMemcpyDtoDAsync`` per command (or one
``cuMemcpyBatchAsync`` for the whole batch) and one ``cuStreamBatchMemOp`` carrying every
command's completion write (arrival flag, or completion-queue entry), in stream order after the
copies, each write preceded by the driver's memory fence.

The symbol names are the versioned ones cuda.h maps the API names to (CUDA 13 headers):
cuMemcpyDtoDAsync_v2, cuStreamBatchMemOp_v2, cuMemcpyBatchAsync_v2 (no failIdx argument), ...
"""
import ctypes

import numpy as np
from numba import njit

from ...errors import MkError

U64, U32, INT = ctypes.c_uint64, ctypes.c_uint32, ctypes.c_int
CU_STREAM_NON_BLOCKING = 1
CU_STREAM_MEM_OP_WRITE_VALUE_32, CU_STREAM_MEM_OP_WRITE_VALUE_64 = 2, 5
MEMOP_WORDS = 6   # sizeof(CUstreamBatchMemOpParams) / 8: op, address, value, flags, alias, pad
CU_MEMHOSTREGISTER_PORTABLE, CU_MEMHOSTREGISTER_DEVICEMAP = 1, 2
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


@njit(nogil=True)
def issue(batch, peer, src_base, dst_base, write_addr, write_val, wide, copy_mode, fn_copy,
          fn_memops, fn_copy_batch, stream, params, dsts, srcs, sizes, attrs, attr_idx):
    """Copy each command's payload, then one batched memop with every completion write.

    batch: COMMAND_DTYPE[n]; src_base: uint64[windows] (this rank's window addresses);
    dst_base: uint64[windows, ranks]; write_addr/write_val: uint64[n] completion writes (flag
    words, or completion-queue entries when ``wide``); params: uint64[>= n * MEMOP_WORDS] and
    dsts/srcs/sizes: uint64[>= n], attrs/attr_idx: scratch for cuMemcpyBatchAsync.
    Returns 0 or (the failing call's CUDA error code) + 1_000_000 * (1 copy, 2 memops).
    """
    n = batch.shape[0]
    for i in range(n):
        c = batch[i]
        dsts[i] = dst_base[c.dst_win, peer] + c.dst_off
        srcs[i] = src_base[c.src_win] + c.src_off
        sizes[i] = c.nbytes
        if copy_mode == COPY_EACH:
            rc = fn_copy(dsts[i], srcs[i], sizes[i], stream)
            if rc != 0:
                return rc + 1_000_000
    if copy_mode == COPY_BATCH:
        rc = fn_copy_batch(dsts.ctypes.data, srcs.ctypes.data, sizes.ctypes.data, n,
                           attrs.ctypes.data, attr_idx.ctypes.data, 1, stream)
        if rc != 0:
            return rc + 1_000_000
    return write_values(fn_memops, stream, write_addr, write_val, n, wide, params)


@njit(nogil=True)
def write_values(fn_memops, stream, addr, val, n, wide, params):
    """One cuStreamBatchMemOp writing val[i] (32- or 64-bit) to device address addr[i], i < n.
    Returns 0 or the CUDA error code + 2_000_000."""
    op = CU_STREAM_MEM_OP_WRITE_VALUE_64 if wide else CU_STREAM_MEM_OP_WRITE_VALUE_32
    for i in range(n):
        b = i * MEMOP_WORDS
        params[b] = op
        params[b + 1] = addr[i]
        params[b + 2] = val[i]
        params[b + 3] = 0      # CU_STREAM_WRITE_VALUE_DEFAULT: a memory fence before the write
        params[b + 4] = 0
        params[b + 5] = 0
    if n == 0:
        return 0
    rc = fn_memops(stream, n, params.ctypes.data, 0)
    if rc != 0:
        return rc + 2_000_000
    return 0


@njit(nogil=True)
def flag_writes(batch, peer, flag_base, out_addr, out_val):
    """Arrival-flag writes of an ordered batch: address of flags[flag_slot] on peer, epoch."""
    for i in range(batch.shape[0]):
        c = batch[i]
        out_addr[i] = flag_base[c.flag_win, peer] + np.uint64(4) * np.uint64(c.flag_slot)
        out_val[i] = c.epoch
