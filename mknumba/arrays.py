"""Arrays in and out, for every op: one check of what a caller hands us, before any launch.

Any CUDA array goes in without a copy: PyTorch tensors, numba and CuPy device arrays (the CUDA
array interface), anything else that speaks DLPack (through CuPy). Under numba's simulator NumPy
arrays stand in for device arrays. :func:`operand` checks one argument against what the op
takes (dtype, shape, layout, device, alignment) and raises :class:`~mknumba.MkValueError`
naming the op and the argument; what passes is an :class:`Operand`: an address and a layout,
which a launch binds (``kernels.launch.Launch.bind``).

bfloat16 comes in four spellings, all read as the same 16 bits: PyTorch's ``torch.bfloat16``,
``ml_dtypes.bfloat16`` (how NumPy code holds bf16), and the raw bits as ``uint16`` or
``int16``. :func:`bf16_array` and :func:`to_float32` move NumPy data in and out;
:func:`to_bf16_bits` and :func:`from_bf16_bits` do the same on the raw bits.
"""
import math
import sys

import numpy as np
from numba import cuda

from ._compat import SIMULATOR
from .errors import MkValueError

__all__ = ["Operand", "operand", "check_device", "refuse_overlap", "shared_bytes", "unshared",
           "new_output", "BF16", "to_bf16_bits", "from_bf16_bits", "bf16_array", "to_float32",
           "is_torch", "torch_ptr"]

#: the dtype names read as bf16 bits
BF16 = ("bfloat16", "uint16", "int16")
_BF16_HINT = ("bfloat16 (torch.bfloat16, ml_dtypes.bfloat16, or its bits as uint16/int16)")


def dtype_name(dtype):
    """The name of an element type as a caller spells it: a string ("bfloat16"), a NumPy
    dtype or scalar type (ml_dtypes.bfloat16 too) or a PyTorch dtype (torch.bfloat16)."""
    return (getattr(dtype, "__name__", None) or str(dtype)).split(".")[-1]


def check_bf16(op, dtype):
    """MkValueError naming ``op`` unless ``dtype`` (any spelling: :func:`dtype_name`) is
    bfloat16, the element type the fused GEMMs are planned for."""
    if dtype_name(dtype) not in ("bfloat16", "bf16"):
        raise MkValueError(f"{op}: dtype must be bfloat16, got {dtype}")


def to_bf16_bits(x):
    """NumPy floats -> bf16 bits (uint16), rounded to nearest even; NaN stays NaN."""
    u = np.ascontiguousarray(x, np.float32).view(np.uint32)
    bits = ((u + 0x7FFF + ((u >> 16) & 1)) >> 16).astype(np.uint16)
    nan = np.isnan(np.ascontiguousarray(x, np.float32))
    return np.where(nan, np.uint16(0x7FC0), bits)


def from_bf16_bits(bits):
    """bf16 bits (uint16/int16, or an ml_dtypes.bfloat16 array) -> float32, exactly."""
    b = np.ascontiguousarray(bits)
    return (b.view(np.uint16).astype(np.uint32) << 16).view(np.float32)


def bf16_array(x):
    """NumPy floats (any array-like) -> a host bf16 array that every op takes (copy it to the
    GPU, or pass it as it is in the simulator): ``ml_dtypes.bfloat16`` where ml_dtypes is
    installed (``pip install ml_dtypes``), else the bits as uint16. Rounded to nearest even."""
    bits = to_bf16_bits(x)
    try:
        import ml_dtypes
    except ImportError:
        return bits
    return bits.view(ml_dtypes.bfloat16)


def to_float32(a):
    """A bf16 array -> a NumPy float32 array on the host, exactly: what an op returns (a numba
    or CuPy device array of bf16 bits, a PyTorch tensor on any device) or a host array
    (``ml_dtypes.bfloat16``, uint16/int16 bits). Other dtypes raise MkValueError."""
    if is_torch(a):
        import torch
        if a.dtype != torch.bfloat16:
            raise MkValueError(f"to_float32: a bfloat16 tensor, not {a.dtype}")
        return a.detach().to("cpu", torch.float32).numpy()
    if hasattr(a, "copy_to_host"):
        a = a.copy_to_host()          # numba device array (the simulator's too)
    elif hasattr(a, "get") and hasattr(a, "__cuda_array_interface__"):
        a = a.get()                   # CuPy
    a = np.asarray(a)
    if a.dtype.name not in BF16:
        raise MkValueError(f"to_float32: a bf16 array ({_BF16_HINT}), not {a.dtype}")
    return from_bf16_bits(a)


_TORCH_TENSOR = []


def is_torch(x):
    """True for a PyTorch tensor (without importing PyTorch)."""
    if not _TORCH_TENSOR:
        torch = sys.modules.get("torch")
        if torch is None:
            return False
        _TORCH_TENSOR.append(torch.Tensor)
    return isinstance(x, _TORCH_TENSOR[0])


class Operand:
    """A checked array argument: ``ptr`` (device address; in the simulator the NumPy array's),
    ``shape``, ``strides`` (in elements), ``itemsize``, ``dtype`` (its name, as the caller
    holds it), ``torch`` (a PyTorch tensor), ``device`` (CUDA ordinal, None where unknown),
    ``row_major`` (C-contiguous), ``col_major`` (a 2-d array stored column after column: the
    transposed view of a row-major one, like ``w.T``) and ``host``: in the simulator, the
    NumPy array itself."""

    __slots__ = ("name", "ptr", "shape", "_strides", "itemsize", "dtype", "torch", "device",
                 "host", "source", "row_major", "_col")

    @property
    def strides(self):
        if self._strides is None:                 # a PyTorch tensor's, read when needed
            self._strides = tuple(self.source.stride())
        return self._strides

    @property
    def nbytes(self):
        """The bytes from ``ptr`` on that the array covers (it is dense: row- or column-major)."""
        return math.prod(self.shape) * self.itemsize

    @property
    def col_major(self):
        if self._col is None:
            self._col = (len(self.shape) == 2 and self.strides[0] == 1
                         and self.strides[1] == self.shape[0])
        return self._col

    def as_param(self, dtype, shape):
        """This memory as a kernel parameter of ``dtype`` and ``shape`` (C order): the address
        on the GPU; in the simulator a device-array view of the same NumPy memory."""
        if not SIMULATOR:
            return self.ptr
        from numba.cuda.simulator.cudadrv.devicearray import FakeCUDAArray
        flat = self.host.reshape(-1) if self.row_major else self.host.T.reshape(-1)
        return FakeCUDAArray(flat.view(dtype).reshape(shape))

    def part(self, start, dtype, shape):
        """The elements of this row-major array from index ``start`` on (flat, in its own
        items) as a kernel parameter of ``dtype`` (the same item size) and ``shape``: one
        array holding several parameters (``moe_dispatch.MoeLayout``)."""
        if not self.row_major or np.dtype(dtype).itemsize != self.itemsize:
            raise TypeError(f"{self.name}: a part is read from a row-major array as items of "
                            f"its own size ({self.itemsize} B), not {np.dtype(dtype)}")
        if not SIMULATOR:
            return self.ptr + start * self.itemsize
        from numba.cuda.simulator.cudadrv.devicearray import FakeCUDAArray
        n = int(np.prod(shape))
        return FakeCUDAArray(self.host.reshape(-1)[start:start + n].view(dtype).reshape(shape))


def _row_major(shape, strides):
    if 0 in shape:
        return True           # nothing to lay out (a rank with no tokens this call)
    expect = 1
    for s, n in zip(reversed(shape), reversed(strides)):
        if n != expect and s != 1:
            return False
        expect *= s
    return True


_TORCH_NAMES = {}
_TORCH_BF16 = None


def torch_ptr(x, shape, device, strides=None, dtype=None, align=16):
    """The address of PyTorch tensor ``x`` when it is exactly what a plan expects: ``dtype``
    (a torch dtype; default bf16), ``shape``, C-contiguous (or with these element
    ``strides``), on GPU ``device``, ``align``-byte aligned; else None, and the caller runs
    :func:`operand` for the full check and its message. A few C calls: the hot path of a
    call with tensors."""
    global _TORCH_BF16
    if _TORCH_BF16 is None:
        _TORCH_BF16 = sys.modules["torch"].bfloat16
    if (x.dtype is (dtype or _TORCH_BF16) and x.shape == shape and x.get_device() == device
            and (x.is_contiguous() if strides is None else x.stride() == strides)):
        p = x.data_ptr()
        if p % align == 0:
            return p
    return None


def operand(x, op, name, *, dtypes=BF16, shape=None, ndim=None, device_id=None,
            layouts=("row",), align=16):
    """Check ``x`` for argument ``name`` of ``op`` and return its :class:`Operand`.

    dtypes: accepted dtype names (``BF16``: every spelling of bf16). shape: required extents
    (None in it: any). layouts: "row" (C-contiguous) and/or "col" (a 2-d column-major view,
    e.g. ``w.T``). device_id: the GPU the array must live on. align: required address
    alignment in bytes (the tiles move 16 bytes at a time).
    """
    o = Operand()
    o.name, o.source, o._col, o.host, o._strides = name, x, None, None, None
    if is_torch(x):                          # the common case, kept to a few C calls
        o.torch = True
        o.device = x.get_device()
        if o.device < 0:
            raise MkValueError(f"{op}: {name} is on {x.device}; {op} takes CUDA tensors")
        o.ptr, o.shape, o.itemsize = x.data_ptr(), x.shape, x.element_size()
        o.row_major = x.is_contiguous()
        o.dtype = _TORCH_NAMES.get(x.dtype) or _TORCH_NAMES.setdefault(x.dtype,
                                                                         str(x.dtype)[6:])
    else:
        o.torch = False
        _describe(o, x, op, name)
        o.row_major = _row_major(o.shape, o.strides)
    if o.dtype not in dtypes:
        want = _BF16_HINT if tuple(dtypes) == BF16 else " or ".join(dtypes)
        raise MkValueError(f"{op}: {name} has dtype {o.dtype}; {op} takes {want}")
    if ndim is not None and len(o.shape) != ndim:
        raise MkValueError(f"{op}: {name} is {len(o.shape)}-d with shape {o.shape}; "
                           f"{ndim}-d expected")
    if shape is not None and o.shape != shape and (len(shape) != len(o.shape) or any(
            s is not None and s != a for s, a in zip(shape, o.shape))):
        want = tuple("*" if s is None else s for s in shape)
        raise MkValueError(f"{op}: {name} has shape {tuple(o.shape)}, {want} expected")
    if not ((o.row_major and "row" in layouts) or ("col" in layouts and o.col_major)):
        what = " or ".join({"row": "row-major (C-contiguous)",
                            "col": "a column-major view of a row-major array (like w.T)"}[k]
                           for k in layouts)
        raise MkValueError(f"{op}: {name} must be {what}; got shape {o.shape} with strides "
                           f"{tuple(o.strides)} (elements)")
    if device_id is not None:
        check_device(o, op, device_id)
    if align and not SIMULATOR and o.ptr % align:
        raise MkValueError(f"{op}: {name} starts at {o.ptr:#x}, not {align}-byte aligned "
                           "(a view at an odd offset?)")
    return o


def refuse_overlap(op, outputs, inputs):
    """MkValueError if one of ``outputs`` shares memory with one of ``inputs`` or with another
    output (Operands; None left out): an op reads its inputs while it writes its outputs, so
    an output laid over an input would be computed from values the op itself overwrote."""
    outputs = [o for o in outputs if o is not None]
    inputs = [x for x in inputs if x is not None]
    hit = shared_bytes([(o.ptr, o.nbytes) for o in outputs], [(x.ptr, x.nbytes) for x in inputs])
    if hit is not None:
        o, x = outputs[hit[0]], (inputs + outputs)[hit[1]]
        raise MkValueError(f"{op}: {o.name} shares memory with {x.name}, which the op "
                           f"{'reads' if hit[1] < len(inputs) else 'writes'} while it writes "
                           f"{o.name}; pass an {o.name} of its own")


def shared_bytes(outputs, inputs):
    """``(i, j)`` for the first output ``outputs[i]`` that shares bytes with ``(inputs +
    outputs)[j]``, another output counted; None when every output has its bytes to itself
    (an empty array shares none).
    Spans are ``(address, bytes)`` pairs: the test under :func:`refuse_overlap` and
    :func:`unshared`."""
    for i, (p, n) in enumerate(outputs):
        end = p + n
        for j, (q, m) in enumerate(inputs):
            if q < end and p < q + m and m:
                return i, j
        for j in range(i + 1, len(outputs)):
            q, m = outputs[j]
            if q < end and p < q + m and m:
                return i, len(inputs) + j
    return None


def unshared(seen, ptrs, sizes, outputs):
    """The hot paths' check: True when none of the first ``outputs`` arrays at addresses
    ``ptrs`` (None: no array) shares a byte with another of them (:func:`shared_bytes`).
    ``sizes``: their bytes, fixed by the op's plan, so the answer depends on ``ptrs`` alone
    and is remembered in the set ``seen``: a call on the arrays of an earlier call pays one
    lookup. False sends the call to the checked path, whose :func:`refuse_overlap` names the
    arrays."""
    if ptrs in seen:
        return True
    spans = [(p, n) if p else (0, 0) for p, n in zip(ptrs, sizes)]    # None: no bytes
    if shared_bytes(spans[:outputs], spans[outputs:]) is not None:
        return False
    if len(seen) >= 64:       # a bounded memory of address sets
        seen.clear()
    seen.add(ptrs)
    return True


def new_output(like, torch, shape, dtype="bfloat16"):
    """A fresh output of ``shape`` on the device of input ``like``: a PyTorch tensor when the
    inputs are (``torch``), else a numba array (bf16 as its bits, uint16)."""
    if torch:
        t = sys.modules["torch"]
        return t.empty(shape, dtype=getattr(t, dtype), device=like.device)
    return cuda.device_array(shape, np.uint16 if dtype == "bfloat16" else np.dtype(dtype))


def check_device(o, op, device_id):
    """Raise unless operand ``o`` lives on GPU ``device_id`` (where that can be told)."""
    if SIMULATOR:
        return
    if o.device is None:
        o.device = _device_of(o.ptr, device_id)
    if o.device is not None and o.device != device_id:
        raise MkValueError(f"{op}: {o.name} lives on GPU {o.device}; this call runs on GPU "
                           f"{device_id}")


def _describe(o, x, op, name):
    """Fill ``o`` from a non-PyTorch array (CUDA array interface, DLPack; NumPy in the
    simulator)."""
    o.device = None
    if SIMULATOR:
        from numba.cuda.simulator.cudadrv.devicearray import FakeCUDAArray
        if isinstance(x, FakeCUDAArray):
            x = x._ary
        if not isinstance(x, np.ndarray):
            raise MkValueError(f"{op}: {name}: expected a NumPy or simulator device array, "
                               f"got {type(x).__name__}")
        o.host, o.ptr = x, x.__array_interface__["data"][0]
        o.shape, o.itemsize = tuple(x.shape), x.itemsize
        o._strides = tuple(st // x.itemsize for st in x.strides)
        o.dtype = _native_name(x.dtype, op, name)
        return
    o.host = None
    if isinstance(x, np.ndarray):
        raise MkValueError(f"{op}: {name} is a host (NumPy) array; {op} takes GPU arrays "
                           "(numba.cuda.to_device, CuPy, PyTorch on cuda)")
    cai = getattr(x, "__cuda_array_interface__", None)
    if cai is None:
        if not hasattr(x, "__dlpack__"):
            raise MkValueError(f"{op}: {name} ({type(x).__name__}) is not a CUDA array "
                               "(__cuda_array_interface__ or DLPack)")
        try:
            import cupy   # DLPack import without a copy
        except ImportError:
            raise MkValueError(f"{op}: {name}: DLPack input needs CuPy installed (or pass an "
                               "object with __cuda_array_interface__)") from None
        cai = cupy.from_dlpack(x).__cuda_array_interface__
    dt = np.dtype(getattr(x, "dtype", None) or cai["typestr"])
    o.ptr, o.shape, o.itemsize = cai["data"][0], tuple(cai["shape"]), dt.itemsize
    o._strides = tuple(st // dt.itemsize for st in cai.get("strides") or
                       c_strides(o.shape, dt.itemsize))
    o.dtype = _native_name(dt, op, name)


def _native_name(dt, op, name):
    """The dtype's name, for an array in this machine's byte order (the kernels read the bytes
    as they lie: ``'>f4'`` is named float32 too, and would be read swapped)."""
    if not dt.isnative:
        raise MkValueError(f"{op}: {name} has dtype {dt.str} (byte order {dt.byteorder!r}); "
                           f"{op} reads native byte order: pass x.astype(x.dtype.newbyteorder("
                           "'='))")
    return dt.name


def c_strides(shape, itemsize):
    """Byte strides of a C-contiguous array of ``shape``."""
    out, step = [], itemsize
    for n in reversed(shape):
        out.append(step)
        step *= n
    return tuple(reversed(out))


def _device_of(ptr, expected):
    """The CUDA ordinal of the memory at ``ptr``, or None where it cannot be told; ``expected``
    when it belongs to the current context. (The pointer's device-ordinal attribute read 0 for
    memory on GPU 1 of the 2xH200 machine, so this asks for the owning context's device.)"""
    try:
        from cuda.bindings import driver as drv
    except ImportError:
        return None
    err, ctx = drv.cuPointerGetAttribute(drv.CUpointer_attribute.CU_POINTER_ATTRIBUTE_CONTEXT,
                                         ptr)
    if err != drv.CUresult.CUDA_SUCCESS or not int(ctx):
        return None
    err, current = drv.cuCtxGetCurrent()
    if err == drv.CUresult.CUDA_SUCCESS and int(current) == int(ctx):
        return expected
    (err,) = drv.cuCtxPushCurrent(ctx)
    if err != drv.CUresult.CUDA_SUCCESS:
        return None
    err, dev = drv.cuCtxGetDevice()
    drv.cuCtxPopCurrent()
    return int(dev) if err == drv.CUresult.CUDA_SUCCESS else None
