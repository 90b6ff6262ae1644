"""What a GEMM-based op derives from its inputs on every call: B as [n, k], and tensor maps.

The tile reads B as a row-major [n, k] matrix (K contiguous). A column-major [k, n] view of one
(``w.T``) is that already; a row-major [k, n] B is transposed into the op's scratch buffer by
:class:`Transposer`, **on every call**, on the call's stream ahead of the kernel: an op never
reuses a copy of an input, so a weight updated in place between calls is read as it is at the
call (and a captured CUDA graph replays the transpose too).

On sm_90a the tile reads A and B through TMA tensor maps, which hold addresses only (no data):
:class:`TensorMaps`, one row per (A, B) address pair met so far (``tensor_maps.MapTable``).
"""
import numpy as np
from numba import cuda

from .. import _compat  # noqa: F401
from .._compat import SIMULATOR
from ..errors import MkError, MkValueError
from ..roles import compute
from ..sched.tiles import cdiv
from .launch import Launch, Slot, array_type, compile_kernel, is_capturing, param
from .tensor_maps import MapTable, tensor_map

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


class FirstCallScratch:
    """What an op makes at the first call that needs it (a transposer: it allocates the
    scratch the transposed copy lives in), kept for the op's lifetime (a captured graph may
    refer to it). ``make()`` makes it; a first such call inside a CUDA graph capture is
    refused with ``refusal`` (allocating there would not be replayed)."""

    def __init__(self, make, refusal):
        self.make, self.refusal, self.made = make, refusal, None

    def __call__(self, stream):
        if self.made is None:
            if is_capturing(stream):
                raise MkError(self.refusal)
            self.made = self.make()
        return self.made

    @classmethod
    def transposer(cls, k, n, op):
        """A :class:`Transposer` of a row-major [k, n] B, made at the first call with one."""
        return cls(lambda: Transposer(k, n),
                   f"{op}: the first call with a row-major b is inside a CUDA graph capture; "
                   "call once before capturing (it allocates the transposed copy's buffer), or "
                   "pass w.T")


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
class TensorMaps(MapTable):
    """The tile's tensor maps of A [m, k] and B [n, k] (``uint64[32]`` per address pair), boxes
    of 64 (k) x the tile's rows, in a :class:`tensor_maps.MapTable`."""

    ROW = 32

    def __init__(self, m, n, k, capacity=64):
        self.m, self.n, self.k = m, n, k
        super().__init__(self._encode, self.ROW, capacity)

    def _encode(self, key):
        (a, b), bk, (bm, bn) = key, compute.SM90_BK, compute.SM90_TILE
        return np.concatenate([tensor_map(a, (self.k, self.m), (bk, bm)),
                               tensor_map(b, (self.k, self.n), (bk, bn))])

    def __call__(self, a_ptr, b_ptr, stream):
        """Device address of the maps of (a_ptr, b_ptr), written on ``stream`` when new."""
        return self.row((a_ptr, b_ptr), stream)


class NoTensorMaps:
    """The SIMT tile reads A and B directly: one zero row stands in for the maps."""

    def __init__(self):
        self.dev = cuda.to_device(np.zeros(TensorMaps.ROW, np.uint64))
        self.addr = param(self.dev)

    def __call__(self, a_ptr, b_ptr, stream):
        return self.addr
