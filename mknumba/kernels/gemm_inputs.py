"""What a GEMM-based op derives from its inputs on every call: B's layout, and tensor maps.

The tile reads B as it is given (no copy): a row-major [n, k] matrix (K contiguous), a
column-major [k, n] view of one (``w.T``, the same memory), or a row-major [k, n] matrix (N
contiguous, ``a @ b`` as written), which the tile builds named ``"<kind>:kn"`` read
(``roles.compute.kn_kind``; on sm_90a TMA boxes of 64 N-columns and a transposed wgmma B). An op
keeps one launch per layout of B (:class:`LayoutLaunches`).

On sm_90a the tile reads A and B through TMA tensor maps, which hold addresses only (no data):
:class:`TensorMaps`, one row per (A, B, B's layout) met so far (``tensor_maps.MapTable``); a
tile that stores C through a tensor map too (``TileBuild.c_map``) has C's map in the row and
C's address in the key.
"""
import threading

import numpy as np
from numba import cuda

from .. import _compat  # noqa: F401
from ..errors import MkError, MkValueError
from ..roles import compute
from .launch import Launch, Slot, compile_kernel, param
from .streams import is_capturing
from .tensor_maps import MAP_WORDS, MapTable, tensor_map


def b_mode(B, b_layout, n, k, op):
    """How the tile reads B: "nk" (given as row-major [n, k]), "view" (a column-major [k, n]
    view of a row-major [n, k] matrix: read as [n, k]) or "kn" (row-major [k, n]: read as it is
    by a ``":kn"`` tile build). :func:`b_kn` of the mode says which build."""
    if b_layout == "nk":
        if B.shape != (n, k) or not B.row_major:
            raise MkValueError(f"{op}: b (b_layout='nk') must be a row-major [{n}, {k}] array, "
                               f"got shape {tuple(B.shape)} with strides {tuple(B.strides)} "
                               "(elements)")
        return "nk"
    if B.shape != (k, n):
        raise MkValueError(f"{op}: b must be [{k}, {n}] ([k, n]), got {B.shape}")
    if B.col_major:
        return "view"
    if B.row_major:
        return "kn"
    raise MkValueError(f"{op}: b ([k, n]) must be row-major, or a column-major view such as "
                       f"w.T of a row-major [n, k] w; got strides {tuple(B.strides)} "
                       "(elements)")


def b_kn(mode):
    """Whether the tile reads B of this :func:`b_mode` as [k, n] (else as [n, k])."""
    return mode == "kn"


def b_shape(mode, n, k):
    """B's shape as the kernel's parameter for this :func:`b_mode`."""
    return (k, n) if b_kn(mode) else (n, k)


class LayoutLaunches:
    """An op's launches, one per layout of B (``kn``: False for [n, k], True for [k, n], the
    tile build ``compute.kn_kind(kind)``), each a compiled kernel and its
    :class:`~mknumba.kernels.launch.Launch`.

    ``builds(kind) -> (TileBuild, threads, kernel)`` (``roles.compute.KernelBuilds``);
    ``values``: every kernel argument but B, ``b_name``; ``b_shapes[kn]``: B's shape in either
    layout; ``grid``: blocks (one per SM: co-resident). The layout ``first`` is made at once
    (the op's planning; [n, k] instead when the build has no [k, n] twin, a probe's); the
    other at the first call with it, which is refused inside a CUDA graph capture (loading a
    kernel there is not replayed); that compile is not joined across ranks (a call is not
    collective on the host), so the peers' waits in such a call count it. ``lock``: held by
    a call from its binds to its launch, whichever layout it takes."""

    def __init__(self, builds, kind, values, b_name, b_shapes, grid, first, op):
        self.builds, self.kind, self.values, self.op = builds, kind, values, op
        self.b_name, self.b_shapes, self.grid = b_name, b_shapes, grid
        self.lock = threading.Lock()
        self._made = {}
        if first:
            try:
                compute.kn_kind(kind, op)
            except MkValueError:
                first = False
        self._made[bool(first)] = self._make(bool(first))

    def _make(self, kn):
        tb, threads, kernel = self.builds(compute.kn_kind(self.kind, self.op) if kn
                                          else self.kind)
        compiled, bps = compile_kernel(kernel, threads, tb.smem_bytes)
        if bps < 1:
            raise MkError(f"{self.op}: the kernel does not fit on an SM")
        return Launch(kernel, compiled, dict(self.values, **{self.b_name: Slot(
            self.b_shapes[kn])}), self.grid, threads, tb.smem_bytes)

    def __call__(self, kn, stream):
        """The launch of layout ``kn`` (call with :attr:`lock` held)."""
        launch = self._made.get(kn)
        if launch is None:
            if is_capturing(stream):
                what = "row-major [k, n]" if kn else "[n, k] (or w.T)"
                raise MkError(f"{self.op}: the first call with b {what} is inside a CUDA graph "
                              "capture; call once with that layout of b before capturing (it "
                              "compiles the kernel for it)")
            launch = self._made[kn] = self._make(kn)
        return launch


# ---- tensor maps (sm_90a) -------------------------------------------------------------------------
class TensorMaps(MapTable):
    """The tile's tensor maps of A [m, k] and B (``uint64[32]`` per address pair and layout of
    B), in a :class:`tensor_maps.MapTable`, for a tile build of ``shape`` (BM, BN)
    (``roles.compute.TileBuild.shape``): A in boxes of 64 (k) x BM rows; B [n, k] in boxes of
    64 (k) x BN rows, or B [k, n] (``b_kn``) in 64 (n) x 64 (k) panels, the tile's columns
    then being BN / 64 such panels side by side (:func:`b_map`; ``cuda/gemm_common.cuh``,
    produce_tile).

    ``slices`` > 1 (split-K, ``kernels.gemm``): a row holds ``slices`` such pairs, pair j
    seeing A and B from k = j * ``kc`` on, to the end of K (a slice that ends past K reads
    zeros there), so every slice runs the same k-steps; pair 0 sees all of K, as the one pair
    of an unsplit table does (the tail split's whole tiles read through it).

    ``c_map`` (one slice only): a third map after the pair, of C [m, n] (contiguous) in boxes
    of 64 columns x 16 rows (one consumer warp's chunk, ``cuda/gemm_tile.cu`` MK_TMA_STORE);
    C's address is then part of the row's key."""

    ROW = 32
    C_BOX = (64, 16)

    def __init__(self, m, n, k, shape, capacity=64, slices=1, kc=0, c_map=False):
        if c_map and slices > 1:
            raise MkValueError("a tile that stores C through a tensor map takes no split-K")
        self.m, self.n, self.k, self.shape = m, n, k, tuple(shape)
        self.slices, self.kc, self.c_map = slices, kc, bool(c_map)
        super().__init__(self._encode, self._row_words(), capacity)

    def _row_words(self):
        return self.ROW * self.slices + MAP_WORDS * self.c_map

    def _encode(self, key):
        (a, b, kn, c), bk, (bm, bn) = key, compute.SM90_BK, self.shape
        maps = []
        for j in range(self.slices):
            k0 = j * self.kc
            maps += [tensor_map(a + 2 * k0, (self.k - k0, self.m), (bk, bm), self.k),
                     b_map(b + 2 * k0 * (self.n if kn else 1), self.n, self.k - k0, kn, bn,
                           None if kn else self.k)]
        if self.c_map:
            maps.append(tensor_map(c, (self.n, self.m), self.C_BOX))
        return np.concatenate(maps)

    def __call__(self, a_ptr, b_ptr, stream, b_kn=False, c_ptr=None):
        """Device address of the maps of (a_ptr, b_ptr) with B [n, k] (or [k, n]: ``b_kn``)
        and, with ``c_map``, C at ``c_ptr``, written on ``stream`` when new."""
        return self.row((a_ptr, b_ptr, bool(b_kn), c_ptr if self.c_map else None), stream)


def kn_one_copy(n):
    """Whether the tile loads a k-step of B [k, n] in one copy of all its 64-column panels
    (a 3-d tensor map) rather than one copy per panel: where n is a whole number of panels
    (a ragged last panel would read past each row's end). The device's twin,
    ``b_kn_one_copy`` in ``roles/cuda/gemm_common.cuh``, must agree: it picks the copy that
    the map's rank serves."""
    return n % 64 == 0


def b_map(ptr, n, k, kn, bn, pitch=None):
    """The tensor map of the tile's B at ``ptr``: [n, k] (boxes of the tile's ``bn`` rows), or
    [k, n] when ``kn`` (``pitch``: see :func:`tensor_map`; [k, n] takes none). B [k, n] is
    read in 64-column panels, 8 KB apart in the ring's slot: with :func:`kn_one_copy` seen as
    (64 columns, k rows, n / 64 panels), whose box of ``bn`` / 64 panels lands them so in one
    copy; else as [k, n], one 64 x 64 box per panel."""
    bk = compute.SM90_BK
    if not kn:
        return tensor_map(ptr, (k, n), (bk, bn), pitch)
    if kn_one_copy(n):
        return tensor_map(ptr, (64, k, n // 64), (64, bk, bn // 64), strides=(2 * n, 128))
    return tensor_map(ptr, (n, k), (64, bk))


class SlotMaps(TensorMaps):
    """:class:`TensorMaps` of A in the two slots ``slots`` (addresses) of AllGatherGemm's
    gathered A, one per call parity, with one B: a row holds slot 0's pair, then slot 1's,
    keyed by B's address and layout alone, so a call finds both with one lookup
    (:meth:`pair`)."""

    def __init__(self, slots, m, n, k, shape):
        self.slots = tuple(slots)
        super().__init__(m, n, k, shape)

    def _row_words(self):
        return 2 * self.ROW

    def _encode(self, key):
        b, kn = key
        return np.concatenate([TensorMaps._encode(self, (a, b, kn, None)) for a in self.slots])

    def pair(self, b_ptr, stream, b_kn):
        """Device addresses of slot 0's and slot 1's maps with B at ``b_ptr`` ([k, n] when
        ``b_kn``), written on ``stream`` when new."""
        row = self.row((b_ptr, b_kn), stream)
        return row, row + 8 * self.ROW

    def __call__(self, *args, **kwargs):
        raise TypeError("SlotMaps rows are keyed by B alone: call pair(b_ptr, stream, b_kn)")


class NoTensorMaps:
    """The SIMT tile reads A and B directly: one zero row (of ``words``) stands in for the
    maps."""

    def __init__(self, words=None):
        self.words = words or TensorMaps.ROW
        self.dev = cuda.to_device(np.zeros(self.words, np.uint64))
        self.addr = param(self.dev)

    def __call__(self, a_ptr, b_ptr, stream, b_kn=False, c_ptr=None):
        return self.addr

    def pair(self, b_ptr, stream, b_kn):
        """Both slots' stand-in (:meth:`SlotMaps.pair`)."""
        return self.addr, self.addr
