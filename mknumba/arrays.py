"""Arrays in and out: accept any CUDA array (numba, CuPy, PyTorch: ``__cuda_array_interface__``
or DLPack) without copies, and check it before anything is launched."""
import numpy as np
from numba import cuda

from ._compat import SIMULATOR
from .errors import MkValueError


def as_device_array(x, name, *, dtype=None, shape=None, ndim=None, device_id=None):
    """View ``x`` as a numba device array after checking it; raise MkValueError otherwise.

    Under the simulator NumPy arrays stand in for device arrays (wrapped, not copied).
    dtype/shape/ndim: what the caller requires (``None`` in ``shape`` accepts any extent).
    device_id: the CUDA device the array must live on.
    """
    arr = _wrap(x, name)
    if dtype is not None and np.dtype(arr.dtype) != np.dtype(dtype):
        raise MkValueError(f"{name}: dtype {np.dtype(arr.dtype)} given, {np.dtype(dtype)} expected")
    if ndim is not None and arr.ndim != ndim:
        raise MkValueError(f"{name}: {arr.ndim}-d array given, {ndim}-d expected")
    if shape is not None:
        if len(shape) != arr.ndim or any(s is not None and s != a
                                         for s, a in zip(shape, arr.shape)):
            want = tuple("*" if s is None else s for s in shape)
            raise MkValueError(f"{name}: shape {tuple(arr.shape)} given, {want} expected")
    if not arr.is_c_contiguous():
        raise MkValueError(f"{name}: must be C-contiguous (row-major); got strides {arr.strides}")
    if device_id is not None and not SIMULATOR and arr.size and _elsewhere(arr):
        raise MkValueError(f"{name}: lives on another GPU; this rank uses GPU {device_id}")
    return arr


def _wrap(x, name):
    if SIMULATOR:
        from numba.cuda.simulator.cudadrv.devicearray import FakeCUDAArray
        if isinstance(x, FakeCUDAArray):
            return x
        if isinstance(x, np.ndarray):
            return FakeCUDAArray(x)
        raise MkValueError(f"{name}: expected a NumPy or simulator device array, got {type(x)}")
    if cuda.is_cuda_array(x):
        # sync=False: numba would otherwise synchronise the producer's stream on every call,
        # a host stall per launch. Kernels run in order on the stream the caller passes.
        return cuda.from_cuda_array_interface(x.__cuda_array_interface__, owner=x, sync=False)
    if hasattr(x, "__dlpack__") and not isinstance(x, np.ndarray):
        return _from_dlpack(x, name)
    if isinstance(x, np.ndarray):
        raise MkValueError(f"{name}: got a host (NumPy) array; mknumba takes GPU arrays "
                           "(numba.cuda.to_device, CuPy, PyTorch on cuda)")
    raise MkValueError(f"{name}: expected a CUDA array (__cuda_array_interface__ or DLPack), "
                       f"got {type(x).__name__}")


def _from_dlpack(x, name):
    try:
        import cupy  # DLPack import without a copy; CuPy then exposes the CUDA array interface
    except ImportError:
        raise MkValueError(f"{name}: DLPack input needs CuPy installed (or pass an object with "
                           "__cuda_array_interface__)") from None
    y = cupy.from_dlpack(x)
    return cuda.from_cuda_array_interface(y.__cuda_array_interface__, owner=y, sync=False)


def _elsewhere(arr):
    """True when ``arr``'s memory belongs to another CUDA context than this thread's current
    one (another GPU). The pointer's device-ordinal attribute read 0 for memory on GPU 1 of
    the 2xH200 machine (2026-11-30), so compare contexts instead; unknown counts as here."""
    try:
        from cuda.bindings import driver as drv
    except ImportError:
        return False
    ptr = arr.__cuda_array_interface__["data"][0]
    err, owner = drv.cuPointerGetAttribute(drv.CUpointer_attribute.CU_POINTER_ATTRIBUTE_CONTEXT,
                                           ptr)
    err2, current = drv.cuCtxGetCurrent()
    if err != drv.CUresult.CUDA_SUCCESS or err2 != drv.CUresult.CUDA_SUCCESS or not int(owner):
        return False
    return int(owner) != int(current)


def empty(shape, dtype):
    """A new uninitialised device array (a NumPy array under the simulator)."""
    return cuda.device_array(shape, dtype)
