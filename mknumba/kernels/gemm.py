"""Persistent GEMM on one GPU: ``mknumba.gemm(a, b)`` = a @ b, bf16 in and out, fp32 accumulation.

The kernel is the compute role on its own (``roles.compute.make_compute_role``, the same role
the fused kernels run): a persistent grid (``sched.plan_grid``) whose first ``compute_blocks``
blocks walk the output tiles in grouped raster order (``sched.grouped_order``), computing each
with the role's tile function and publishing each finished tile ``t = tile_m * tiles_n + tile_n``
with ``tile_flags[t] = epoch``. The blocks held back (``reserved_sms``) return at once here; in
the fused kernels they run the communication roles and consume those flags.

Tile implementations: ``"sm90"`` (TMA + wgmma, Hopper, 128 x 256 tiles) or ``"simt"`` (the generic
twin: the CUDA simulator and GPUs without sm_90a).
"""
import threading

import numpy as np

from .. import _compat  # noqa: F401  (numpy alias before numba compiles anything)
from .._compat import SIMULATOR
from ..errors import MkValueError
from ..roles import compute
from ..sched.tiles import cdiv, default_group_m, grouped_order, plan_grid
from .launch import Prepared
from numba import cuda

__all__ = ["gemm", "Gemm"]


# The simulator sizes dynamic shared arrays with dtype.itemsize, so it needs a dtype instance.
_BYTE = np.dtype(np.uint8) if SIMULATOR else np.uint8


def _make_kernel(tile_init, tile, bm, bn, threads):
    """The persistent kernel around one tile implementation."""
    bounds = {} if SIMULATOR else {"launch_bounds": (threads, 1)}
    compute_role = compute.make_compute_role(tile_init, tile, compute.OWN_TILE)

    @cuda.jit(**bounds)
    def gemm_kernel(a, b, c, tmaps, tile_flags, epoch, order, compute_blocks, c_planes):
        """a [m, k], b [n, k], c [m, n]: bf16 bits; order int32[tiles] (sched.grouped_order);
        tile_flags uint32[tiles] := epoch when done; c_planes: c as [1, m, n] (the tile's
        addend argument, which the plain GEMM never reads)."""
        smem = cuda.shared.array(0, dtype=_BYTE)
        if cuda.blockIdx.x >= compute_blocks:
            return  # held back for other roles; nothing else runs in a plain GEMM
        compute_role(smem, tmaps, a, b, order, (b.shape[0] + bn - 1) // bn, cuda.blockIdx.x,
                     compute_blocks, epoch, (c, tile_flags, False, c_planes))  # flags: this GPU

    return gemm_kernel


@cuda.jit
def _transpose_kernel(src, dst):
    """dst[j, i] = src[i, j] for 16-bit elements, through a padded 32 x 32 shared tile."""
    tile = cuda.shared.array((32, 33), dtype=np.uint16)
    r0 = cuda.blockIdx.y * 32
    c0 = cuda.blockIdx.x * 32
    tx = cuda.threadIdx.x
    ty = cuda.threadIdx.y
    for j in range(ty, 32, cuda.blockDim.y):
        if r0 + j < src.shape[0] and c0 + tx < src.shape[1]:
            tile[j, tx] = src[r0 + j, c0 + tx]
    cuda.syncthreads()
    for j in range(ty, 32, cuda.blockDim.y):
        if c0 + j < src.shape[1] and r0 + tx < src.shape[0]:
            dst[c0 + j, r0 + tx] = tile[tx, j]


_KERNELS = {}   # tile build name -> the persistent kernel around it
_SIM_SMS = 4  # a small "device" for the simulator: 4 SMs, one block each


def _build(kind):
    """(roles.compute.TileBuild, persistent kernel) of a tile build name."""
    b = compute.tile_build(kind)
    if kind not in _KERNELS:
        _KERNELS[kind] = _make_kernel(b.init, b.tile, *b.shape, b.threads)
    return b, _KERNELS[kind]


# ---- operand handling ---------------------------------------------------------------------------
class _Operand:
    """A 2-D bf16 device operand: the numba view the kernel takes (16-bit ints) + where it lives."""

    def __init__(self, x, name):
        self.torch = None
        mod = type(x).__module__.split(".")[0]
        if mod == "torch":
            import torch
            if not x.is_cuda:
                raise MkValueError(f"{name} is on {x.device}; mknumba.gemm needs CUDA tensors")
            if x.dtype != torch.bfloat16:
                raise MkValueError(f"{name} has dtype {x.dtype}; mknumba.gemm takes bfloat16")
            self.torch = x
            self.device = x.device.index
            x = x.view(torch.int16)
            self.arr = cuda.as_cuda_array(x) if x.dim() == 2 else None
            self.shape = tuple(x.shape)
            self.strides = tuple(s * 2 for s in x.stride())
        elif isinstance(x, np.ndarray):
            raise MkValueError(f"{name} is a host (numpy) array; pass a device array "
                               "(numba, CuPy, PyTorch)")
        elif (hasattr(x, "copy_to_host") if SIMULATOR else cuda.is_cuda_array(x)):
            arr = x if SIMULATOR else cuda.as_cuda_array(x)
            if str(getattr(x, "dtype", arr.dtype)) not in ("bfloat16", "uint16", "int16"):
                raise MkValueError(f"{name} has dtype {arr.dtype}; mknumba.gemm takes bfloat16 "
                                   "(or its bits as uint16/int16)")
            if arr.dtype.itemsize != 2:
                raise MkValueError(f"{name} has {arr.dtype.itemsize}-byte elements, not bf16")
            self.arr, self.device = arr, None
            self.shape, self.strides = tuple(arr.shape), tuple(arr.strides)
        else:
            raise MkValueError(f"{name} ({type(x).__name__}) is not a device array")
        if len(self.shape) != 2:
            raise MkValueError(f"{name} must be 2-D, got shape {self.shape}")

    @property
    def row_major(self):
        return self.strides[1] == 2 and self.strides[0] == 2 * self.shape[1]

    @property
    def col_major(self):
        return self.strides[0] == 2 and self.strides[1] == 2 * self.shape[0]



def _ptr(arr):
    return arr.__cuda_array_interface__["data"][0]


def _view(arr, shape, strides):
    """A numba view of ``arr``'s memory with another shape and strides (no copy)."""
    class _Desc:
        __cuda_array_interface__ = dict(arr.__cuda_array_interface__, shape=shape, strides=strides)
    desc = _Desc()
    desc.owner = arr
    return cuda.as_cuda_array(desc)


def check_aligned(arr, name, what):
    """The tiles store 16 bytes at a time and the reduction roles 8: refuse an array whose
    address is not 16-byte aligned (a view at an odd offset) before anything launches."""
    if not SIMULATOR and _ptr(arr) % 16:
        raise MkValueError(f"{what}: {name} starts at {_ptr(arr):#x}, not 16-byte aligned")


def _check_shapes(m, n, k):
    if min(m, n, k) < 1:
        raise MkValueError(f"empty GEMM (m={m}, n={n}, k={k})")
    if k % 8 or n % 8:
        raise MkValueError(f"k={k} and n={n} must be multiples of 8: rows of A, B and C must be "
                           "16-byte aligned for the bulk tensor copies; pad them (m may be any size)")


# ---- tensor maps (sm90) -------------------------------------------------------------------------
def _tensor_map(ptr, rows, k, box_rows):
    """CUtensorMap of a row-major [rows, k] bf16 matrix, boxes of 64 (k) x box_rows, 128B swizzle."""
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


def _load(disp, argtypes, build):
    """Compile ``disp`` for ``argtypes``, raise its dynamic shared memory limit to the tile
    build's, and return (kernel, blocks per SM) for the current GPU."""
    kern = disp.compile(argtypes)
    cufunc = kern._codelibrary.get_cufunc()
    ctx = cuda.current_context()
    if build.smem_bytes > 48 * 1024:
        _set_max_dynamic_smem(cufunc, build.smem_bytes, ctx.device.id)
    bps = ctx.get_active_blocks_per_multiprocessor(cufunc, build.threads, build.smem_bytes)
    return kern, max(1, int(bps))


def _set_max_dynamic_smem(cufunc, nbytes, device_id):
    from cuda.bindings import driver as drv
    attr = drv.CUfunction_attribute.CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES
    (err,) = drv.cuKernelSetAttribute(attr, nbytes, cufunc.handle, drv.CUdevice(device_id))
    if err != drv.CUresult.CUDA_SUCCESS:  # a handle loaded as a plain function, not a library kernel
        (err,) = drv.cuFuncSetAttribute(drv.CUfunction(int(cufunc.handle)), attr, nbytes)
    if err != drv.CUresult.CUDA_SUCCESS:
        raise RuntimeError(f"could not raise the dynamic shared memory limit to {nbytes} B: {err}")


class Gemm:
    """C = A @ B on one GPU, with a per-tile completion flag other roles can wait on.

    ``Gemm(tile="auto", reserved_sms=0, group_m=None)`` plans once; each call is one persistent
    launch. After a call, ``tile_flags[t] == epoch`` for every output tile
    ``t = tile_m * tiles_n + tile_n`` that the kernel finished. Repeated calls on the same PyTorch
    tensors with ``out=`` reuse the prepared launch (a few tens of microseconds of host time).
    """

    def __init__(self, tile="auto", reserved_sms=0, group_m=None):
        if tile not in ("auto", "sm90", "simt"):
            compute.tile_build(tile)   # another build of the tile (probes), or MkValueError
        self.tile, self.reserved_sms, self.group_m = tile, int(reserved_sms), group_m
        self.epoch = 0
        self.tile_flags = None
        self._lock = threading.Lock()
        self._compiled = {}   # (kind, argtypes) -> (dispatcher, compiled kernel, blocks_per_sm)
        self._tmaps = {}      # (ptr_a, ptr_b, m, n, k) -> device uint64[32]
        self._orders = {}     # (device, tiles_m, tiles_n, group_m) -> int32 tile order
        self._launches = {}   # torch call signature -> prepared _Launch

    # -- public entry ---------------------------------------------------------------------------
    def __call__(self, a, b, b_layout="kn", out=None, stream=None):
        """a: [m, k] bf16; b: [k, n] (b_layout="kn", as in a @ b) or [n, k] ("nk", a @ b.T).

        Arrays: PyTorch bf16 CUDA tensors (result: a tensor, computed on the current torch stream),
        or numba/CuPy device arrays holding bf16 bits as uint16/int16 (result: a numba array).
        """
        key = _torch_key(a, b, b_layout, out)
        launch = self._launches.get(key) if key is not None else None
        if launch is None:
            launch = self._prepare(a, b, b_layout, out, stream)
            if key is not None and launch.cacheable:
                if len(self._launches) > 64:
                    self._launches.clear()
                self._launches[key] = launch
        result = launch.run(self)
        return out if out is not None else result

    # -- planning -------------------------------------------------------------------------------
    def _prepare(self, a, b, b_layout, out, stream):
        if b_layout not in ("kn", "nk"):
            raise MkValueError(f"b_layout must be 'kn' (b is [k, n]) or 'nk' (b is [n, k]), "
                               f"got {b_layout!r}")
        A, B = _Operand(a, "a"), _Operand(b, "b")
        if (A.torch is None) != (B.torch is None):
            raise MkValueError("a and b must both be PyTorch tensors or both be device arrays")
        if A.torch is not None and A.device != B.device:
            raise MkValueError(f"a is on cuda:{A.device} and b on cuda:{B.device}")
        m, k = A.shape
        kb, n = B.shape if b_layout == "kn" else B.shape[::-1]
        if kb != k:
            raise MkValueError(f"inner dimensions differ: a is [{m}, {k}], b ({b_layout}) gives "
                               f"k={kb}")
        _check_shapes(m, n, k)
        if not A.row_major:
            raise MkValueError("a must be row-major and contiguous ([m, k], k contiguous)")
        if A.torch is None:
            return self._plan(A, B, b_layout, m, n, k, out, stream if stream is not None else 0)
        import torch
        with cuda.gpus[A.device]:
            s = cuda.external_stream(torch.cuda.current_stream(A.device).cuda_stream)
            return self._plan(A, B, b_layout, m, n, k, out, s)

    def _plan(self, A, B, b_layout, m, n, k, out, stream):
        kind = self._kind()
        copy_b = b_layout == "kn" and not B.col_major
        bt = self._b_as_nk(B, b_layout, n, k, stream)
        c, c_arr = self._output(A, out, m, n, stream)
        build = compute.tile_build(kind)
        bm, bn = build.shape
        tiles = cdiv(m, bm) * cdiv(n, bn)
        with self._lock:
            if self.tile_flags is None or self.tile_flags.size < tiles:
                self.tile_flags = cuda.to_device(np.zeros(max(tiles, 1024), np.uint32),
                                                 stream=stream)
        tmaps = (self._tensor_maps(A.arr, bt, m, n, k, stream) if build.tma
                 else cuda.to_device(np.zeros(32, np.uint64), stream=stream))
        order = self._order(1, 1, 1, stream)      # the argument types; replaced below
        args = [A.arr, bt, c_arr, tmaps, self.tile_flags, np.uint32(1), order, np.int64(0),
                c_arr.reshape((1, m, n))]
        kernel, bps = self._kernel(kind, args)
        sms = _SIM_SMS if SIMULATOR else cuda.get_current_device().MULTIPROCESSOR_COUNT
        try:
            plan = plan_grid(sms, bps, self.reserved_sms)
        except ValueError as e:
            raise MkValueError(str(e)) from None
        tiles_m, tiles_n = cdiv(m, bm), cdiv(n, bn)
        group_m = self.group_m or default_group_m(tiles_m, tiles_n, plan.compute_blocks)
        args[6] = self._order(tiles_m, tiles_n, group_m, stream)
        args[7] = np.int64(plan.compute_blocks)
        return _Launch(Prepared(kernel, args, plan.grid, build.threads, build.smem_bytes, stream,
                                (5,), c),                  # argument 5: the epoch
                       device=A.device, cacheable=out is not None and not copy_b)

    def _kind(self):
        if SIMULATOR:
            if self.tile not in ("auto", "simt"):
                raise MkValueError(f"the {self.tile} tile needs a Hopper GPU; the simulator runs "
                                   "'simt'")
            return "simt"
        cc = tuple(cuda.get_current_device().compute_capability)
        if self.tile == "auto":
            return "sm90" if cc == (9, 0) else "simt"
        if compute.tile_build(self.tile).tma and cc != (9, 0):
            raise MkValueError(f"the {self.tile} tile needs compute capability 9.0, this GPU "
                               f"has {cc}")
        return self.tile

    def _kernel(self, kind, args):
        """The kernel compiled for these argument types (dynamic smem limit raised), occupancy."""
        import numba
        argtypes = tuple(numba.typeof(x) for x in args)
        key = (kind, argtypes)
        if key not in self._compiled:
            build, disp = _build(kind)
            if SIMULATOR:
                self._compiled[key] = (disp, 1)
            else:
                self._compiled[key] = _load(disp, argtypes, build)
        return self._compiled[key]

    def _order(self, tiles_m, tiles_n, group_m, stream):
        device = None if SIMULATOR else cuda.get_current_device().id   # one table per GPU
        key = (device, tiles_m, tiles_n, int(group_m))
        if key not in self._orders:
            if len(self._orders) > 32:
                self._orders.clear()
            self._orders[key] = cuda.to_device(grouped_order(*key[1:]), stream=stream)
        return self._orders[key]

    def _tensor_maps(self, a, bt, m, n, k, stream):
        key = (_ptr(a), _ptr(bt), m, n, k)
        if key not in self._tmaps:
            if len(self._tmaps) > 32:
                self._tmaps.clear()
            host = np.concatenate([_tensor_map(_ptr(a), m, k, compute.SM90_TILE[0]),
                                   _tensor_map(_ptr(bt), n, k, compute.SM90_TILE[1])])
            self._tmaps[key] = cuda.to_device(host, stream=stream)
        return self._tmaps[key]

    @staticmethod
    def _b_as_nk(B, b_layout, n, k, stream):
        """B as a row-major [n, k] numba array: as given, a transposed view, or a transposed copy."""
        if b_layout == "nk":
            if not B.row_major:
                raise MkValueError("b ([n, k]) must be row-major and contiguous")
            return B.arr
        if B.col_major:  # a [k, n] view of a row-major [n, k] matrix (e.g. w.T): no copy
            return _view(B.arr, (n, k), (2 * k, 2))
        if not B.row_major:
            raise MkValueError("b ([k, n]) must be contiguous (row- or column-major)")
        if B.torch is not None:
            import torch
            dst = cuda.as_cuda_array(torch.empty((n, k), dtype=torch.int16, device=B.torch.device))
        else:
            dst = cuda.device_array((n, k), dtype=B.arr.dtype, stream=stream)
        _transpose_kernel[(cdiv(n, 32), cdiv(k, 32)), (32, 8), stream](B.arr, dst)
        return dst

    @staticmethod
    def _output(A, out, m, n, stream):
        if out is None:
            if A.torch is not None:
                import torch
                out = torch.empty((m, n), dtype=torch.bfloat16, device=A.torch.device)
            else:
                out = cuda.device_array((m, n), dtype=np.uint16, stream=stream)
        C = _Operand(out, "out")
        if C.shape != (m, n) or not C.row_major:
            raise MkValueError(f"out must be a contiguous row-major [{m}, {n}] array")
        check_aligned(C.arr, "out", "mknumba.gemm")
        return out, C.arr


class _Launch:
    """One prepared launch (``launch.Prepared``) and the device it runs on; ``run`` stamps the
    next epoch and launches."""

    def __init__(self, prepared, device, cacheable):
        self.prepared, self.device, self.cacheable = prepared, device, cacheable

    def run(self, op):
        with op._lock:
            op.epoch = op.epoch % 0xFFFFFFFF + 1  # never 0: fresh flags hold 0
            epoch = op.epoch
        if self.device is None or SIMULATOR:
            return self.prepared.run(epoch)
        with cuda.gpus[self.device]:              # the kernel was loaded in that GPU's context
            return self.prepared.run(epoch)


def _torch_key(a, b, b_layout, out):
    """A key for reusing a prepared launch: same torch tensors (pointers, shapes) and stream."""
    if out is None or type(a).__module__.split(".")[0] != "torch":
        return None
    import torch
    ts = (a, b, out)
    if not all(isinstance(t, torch.Tensor) and t.is_cuda for t in ts):
        return None
    return (b_layout, torch.cuda.current_stream(a.device).cuda_stream) + tuple(
        (t.data_ptr(), tuple(t.shape), tuple(t.stride()), t.dtype, t.device) for t in ts)


_default = {}


def gemm(a, b, b_layout="kn", out=None, stream=None, reserved_sms=0, tile="auto"):
    """C = a @ b (b_layout="kn", b is [k, n]) or a @ b.T (b_layout="nk", b is [n, k]).

    bf16 inputs and output, fp32 accumulation, one persistent launch. ``reserved_sms`` SMs are held
    back from the compute role. m may be any size; n and k must be multiples of 8. B as [n, k]
    (or a column-major [k, n] view of it, like ``w.T``) is the tile's native layout; a row-major
    [k, n] B is transposed into a scratch buffer first (one extra pass over B).
    """
    key = (tile, int(reserved_sms))
    if key not in _default:
        _default[key] = Gemm(tile=tile, reserved_sms=reserved_sms)
    return _default[key](a, b, b_layout=b_layout, out=out, stream=stream)
