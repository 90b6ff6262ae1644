"""What a GEMM-based op derives from its inputs on every call: B as [n, k], and tensor maps.

The tile reads B as a row-major [n, k] matrix (K contiguous). A column-major [k, n] view of one
(``w.T``) is that already; a row-major [k, n] B is transposed into the op's scratch buffer by
:class:`Transposer`, **on every call**, on the call's stream ahead of the kernel: an op never
reuses a copy of an input, so a weight updated in place between calls is read as it is at the
call (and a captured CUDA graph replays the transpose too).

On sm_90a the tile reads A and B through TMA tensor maps, which hold addresses only (no data).
:class:`TensorMaps` keeps them in device memory, one row per (A, B) address pair met so far;
a row is written once and never reused for another pair, so a captured graph that refers to a
row stays right.
"""
import numpy as np
from numba import cuda

from .. import _compat  # noqa: F401
from .._compat import SIMULATOR
from ..errors import MkError, MkValueError
from ..roles import compute
from ..sched.tiles import cdiv
from .launch import Launch, Slot, array_type, compile_kernel, is_capturing, param

Bits2D = array_type(np.uint16, 2)

TRANSPOSE_TILE = 32


@cuda.jit
def transpose_kernel(src: Bits2D, dst: Bits2D):
    """dst[j, i] = src[i, j] for 16-bit elements: block b takes the 32 x 32 tile b of src's
    row-major tile grid, through a padded shared tile (coalesced reads and writes)."""
    tile = cuda.shared.array((32, 33), dtype=np.uint16)
    tiles_c = (src.shape[1] + 31) // 32
    r0 = (cuda.blockIdx.x // tiles_c) * 32
    c0 = (cuda.blockIdx.x % tiles_c) * 32
    tx = cuda.threadIdx.x % 32
    ty = cuda.threadIdx.x // 32
    rows = cuda.blockDim.x // 32
    for j in range(ty, 32, rows):
        if r0 + j < src.shape[0] and c0 + tx < src.shape[1]:
            tile[j, tx] = src[r0 + j, c0 + tx]
    cuda.syncthreads()
    for j in range(ty, 32, rows):
        if c0 + j < src.shape[1] and r0 + tx < src.shape[0]:
            dst[c0 + j, r0 + tx] = tile[tx, j]


_TRANSPOSE = {}    # device -> compiled transpose


class Transposer:
    """B [k, n] row-major -> the op's scratch [n, k], one launch per call (see module)."""

    def __init__(self, k, n):
        self.k, self.n = k, n
        self.bt = cuda.device_array((n, k), np.uint16)
        threads = 32 if SIMULATOR else 256
        dev = None if SIMULATOR else cuda.get_current_device().id
        if dev not in _TRANSPOSE:
            _TRANSPOSE[dev] = compile_kernel(transpose_kernel, threads, 0)[0]
        self.launch = Launch(transpose_kernel, _TRANSPOSE[dev],
                             dict(src=Slot((k, n)), dst=self.bt),
                             cdiv(k, TRANSPOSE_TILE) * cdiv(n, TRANSPOSE_TILE), threads, 0)
        self.ptr = param(self.bt)

    def __call__(self, b, stream):
        """Transpose ``b`` (a [k, n] row-major parameter: ``Operand.as_param``) into
        :attr:`bt` on ``stream``; returns bt as a parameter."""
        self.launch.bind("src", b)
        self.launch(stream)
        return self.ptr


def b_mode(B, b_layout, n, k, op):
    """How the tile gets B as [n, k]: "nk" (given so), "view" (a column-major [k, n] view of a
    row-major [n, k] matrix: no copy) or "copy" (row-major [k, n]: :class:`Transposer`)."""
    if b_layout == "nk":
        if B.shape != (n, k) or not B.row_major:
            raise MkValueError(f"{op}: b (b_layout='nk') must be a row-major [{n}, {k}] array, "
                               f"got shape {B.shape}")
        return "nk"
    if B.shape != (k, n):
        raise MkValueError(f"{op}: b must be [{k}, {n}] ([k, n]), got {B.shape}")
    if B.col_major:
        return "view"
    if B.row_major:
        return "copy"
    raise MkValueError(f"{op}: b ([k, n]) must be row-major, or a column-major view such as "
                       f"w.T of a row-major [n, k] w; got strides {tuple(B.strides)} "
                       "(elements)")


# ---- tensor maps (sm_90a) -------------------------------------------------------------------------
def tensor_map(ptr, rows, k, box_rows):
    """CUtensorMap of a row-major [rows, k] bf16 matrix, boxes of 64 (k) x box_rows, 128B
    swizzle, as 16 uint64 words."""
    from cuda.bindings import driver as drv
    u64, u32 = drv.cuuint64_t, drv.cuuint32_t
    err, tmap = drv.cuTensorMapEncodeTiled(
        drv.CUtensorMapDataType.CU_TENSOR_MAP_DATA_TYPE_BFLOAT16, 2, ptr, [u64(k), u64(rows)],
        [u64(k * 2)], [u32(compute.SM90_BK), u32(box_rows)], [u32(1), u32(1)],
        drv.CUtensorMapInterleave.CU_TENSOR_MAP_INTERLEAVE_NONE,
        drv.CUtensorMapSwizzle.CU_TENSOR_MAP_SWIZZLE_128B,
        drv.CUtensorMapL2promotion.CU_TENSOR_MAP_L2_PROMOTION_L2_256B,
        drv.CUtensorMapFloatOOBfill.CU_TENSOR_MAP_FLOAT_OOB_FILL_NONE)
    if err != drv.CUresult.CUDA_SUCCESS:
        raise MkValueError(f"cuTensorMapEncodeTiled failed ({err}) for a [{rows}, {k}] bf16 matrix "
                           f"at {ptr:#x}: is it 16-byte aligned?")
    return np.array([int(w) for w in tmap.opaque], dtype=np.uint64)


class TensorMaps:
    """Device rows of ``uint64[32]``: the tensor maps of A [m, k] and B [n, k] for each pair of
    addresses met so far (see module). ``capacity`` rows per table; a full table is kept (a
    graph may refer to it) and a new one started, except during a capture, which is refused
    (call once outside the capture with the same arrays first). A row first written inside a
    capture is written by the graph only, so the next call outside a capture writes it again
    before using it."""

    ROW = 32

    def __init__(self, m, n, k, capacity=64):
        self.m, self.n, self.k, self.capacity = m, n, k, capacity
        self._tables = []
        self._rows = {}           # (a, b) -> device address of the row
        self._sources = {}        # (a, b) -> address of the row's pinned host copy
        self._pending = set()     # rows written only inside a capture so far
        self._new_table()

    def _new_table(self):
        self.dev = cuda.device_array((self.capacity, self.ROW), np.uint64)
        self.host = cuda.pinned_array((self.capacity, self.ROW), np.uint64)
        self.base = self.dev.__cuda_array_interface__["data"][0]
        self.used = 0
        self._tables.append((self.dev, self.host))

    def __call__(self, a_ptr, b_ptr, stream):
        """Device address of the row for (a_ptr, b_ptr), written on ``stream`` when new."""
        addr = self._rows.get((a_ptr, b_ptr))
        if addr is None or self._pending:
            addr = self._miss((a_ptr, b_ptr), stream)
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
        self.host[i, :16] = tensor_map(key[0], self.m, self.k, compute.SM90_TILE[0])
        self.host[i, 16:] = tensor_map(key[1], self.n, self.k, compute.SM90_TILE[1])
        nbytes = self.ROW * 8
        addr, src = self.base + i * nbytes, self.host.ctypes.data + i * nbytes
        self._copy(addr, src, stream)
        self.used += 1
        self._rows[key], self._sources[key] = addr, src
        return addr

    def _copy(self, addr, src, stream):
        from cuda.bindings import driver as drv
        (err,) = drv.cuMemcpyHtoDAsync(addr, src, self.ROW * 8, drv.CUstream(stream))
        if err != drv.CUresult.CUDA_SUCCESS:
            raise MkError(f"writing a tensor map failed: {err}")


class NoTensorMaps:
    """The SIMT tile reads A and B directly: one zero row stands in for the maps."""

    def __init__(self):
        self.dev = cuda.to_device(np.zeros(TensorMaps.ROW, np.uint64))
        self.addr = param(self.dev)

    def __call__(self, a_ptr, b_ptr, stream):
        return self.addr
