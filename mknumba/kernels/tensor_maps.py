"""TMA tensor maps (sm_90a): how a tile's bulk copies see a row-major array in global memory.

A CUtensorMap holds an address, the array's dims and strides and the box a copy moves; no
data. The linked tiles read it from device memory (16 uint64 words, 128 bytes, 64-byte
aligned). :class:`MapTable` keeps an op's maps there, one row per tuple of input addresses met
so far: a row is written once and never reused for other addresses, so a captured CUDA graph
that refers to a row stays right.
"""
import numpy as np
from numba import cuda

from ..errors import MkError, MkValueError
from .streams import is_capturing

MAP_WORDS = 16      # one CUtensorMap, in uint64 words


def tensor_map(ptr, dims, box, pitch=None, strides=None):
    """CUtensorMap of a row-major bf16 array at ``ptr`` as 16 uint64 words.

    dims: the array's extents innermost first (a [rows, cols] matrix is ``(cols, rows)``);
    box: the extents one copy moves, innermost first; the inner box is 64 elements (128
    bytes: the 128B swizzle that wgmma reads). Parts of a box past the array read as zeros.
    pitch: elements from one row to the next of a 2-d array (default ``dims[0]``: contiguous;
    more for a block of columns of a wider array, e.g. a slice of K). strides: bytes from one
    index to the next of each of ``dims[1:]``, for a view that is not a plain row-major array
    (they need not increase: ``gemm_inputs.b_map``'s panels of B [k, n])."""
    from cuda.bindings import driver as drv
    u64, u32 = drv.cuuint64_t, drv.cuuint32_t
    if strides is None and pitch is not None:
        strides = [2 * int(pitch)]
    elif strides is None:
        strides = 2 * np.cumprod([int(x) for x in dims[:-1]], dtype=np.int64)
    err, tmap = drv.cuTensorMapEncodeTiled(
        drv.CUtensorMapDataType.CU_TENSOR_MAP_DATA_TYPE_BFLOAT16, len(dims), ptr,
        [u64(int(x)) for x in dims], [u64(int(x)) for x in strides],
        [u32(int(x)) for x in box], [u32(1)] * len(dims),
        drv.CUtensorMapInterleave.CU_TENSOR_MAP_INTERLEAVE_NONE,
        drv.CUtensorMapSwizzle.CU_TENSOR_MAP_SWIZZLE_128B,
        drv.CUtensorMapL2promotion.CU_TENSOR_MAP_L2_PROMOTION_L2_256B,
        drv.CUtensorMapFloatOOBfill.CU_TENSOR_MAP_FLOAT_OOB_FILL_NONE)
    if err != drv.CUresult.CUDA_SUCCESS:
        shape = " x ".join(str(int(x)) for x in reversed(dims))
        raise MkValueError(f"cuTensorMapEncodeTiled failed ({err}) for a [{shape}] bf16 array at "
                           f"{ptr:#x}: is it 16-byte aligned, with rows a multiple of 16 bytes?")
    return np.array([int(w) for w in tmap.opaque], dtype=np.uint64)


class MapTable:
    """Device rows of ``words`` uint64: ``encode(key)`` for each key (a tuple of addresses) met
    so far. ``capacity`` rows per table; a full table is kept (a graph may refer to it) and a
    new one started, except during a capture, which is refused (call once outside the capture
    with the same arrays first). A row first written inside a capture is written by the graph
    only, so the next call outside a capture writes it again before using it."""

    def __init__(self, encode, words, capacity=64):
        self.encode, self.words, self.capacity = encode, words, capacity
        self._tables = []
        self._rows = {}           # key -> device address of the row
        self._sources = {}        # key -> address of the row's pinned host copy
        self._pending = set()     # rows written only inside a capture so far
        self._new_table()

    def _new_table(self):
        self.dev = cuda.device_array((self.capacity, self.words), np.uint64)
        self.host = cuda.pinned_array((self.capacity, self.words), np.uint64)
        self.base = self.dev.__cuda_array_interface__["data"][0]
        self.used = 0
        self._tables.append((self.dev, self.host))

    def row(self, key, stream):
        """Device address of the row for ``key``, written on ``stream`` when new."""
        addr = self._rows.get(key)
        if addr is None or (self._pending and key in self._pending):
            addr = self._miss(key, stream)   # the only path that asks whether we capture
        return addr

    def _miss(self, key, stream):
        capturing = is_capturing(stream)
        addr = self._rows.get(key)
        if addr is None:
            addr = self._add(key, stream, capturing)
            if capturing:
                self._pending.add(key)
        elif key in self._pending and not capturing:
            self._copy(addr, self._sources[key], stream)
            self._pending.discard(key)
        return addr

    def _add(self, key, stream, capturing):
        if self.used == self.capacity:
            if capturing:
                raise MkError(f"{self.capacity} new input addresses during a CUDA graph "
                              "capture; call once before capturing with the same arrays")
            self._rows.clear()
            self._sources.clear()
            self._new_table()
        i = self.used
        self.host[i, :] = self.encode(key)
        nbytes = self.words * 8
        addr, src = self.base + i * nbytes, self.host.ctypes.data + i * nbytes
        self._copy(addr, src, stream)
        self.used += 1
        self._rows[key], self._sources[key] = addr, src
        return addr

    def _copy(self, addr, src, stream):
        from cuda.bindings import driver as drv
        (err,) = drv.cuMemcpyHtoDAsync(addr, src, self.words * 8, drv.CUstream(stream))
        if err != drv.CUresult.CUDA_SUCCESS:
            raise MkError(f"writing a tensor map failed: {err}")
