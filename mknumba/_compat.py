"""Work-arounds for the versions we run on, applied before numba.cuda compiles anything."""
import numpy as np

# numpy 2.5 removed np.row_stack, but numba-cuda 0.30.4 still registers an overload for it
# when the first kernel compiles (DESIGN.md §6). The alias is exact: row_stack was vstack.
if not hasattr(np, "row_stack"):
    np.row_stack = np.vstack

from numba.core import config as _config  # noqa: E402

# Persistent kernels launch one block per SM role on purpose; numba's low-occupancy warning
# would fire on every launch.
_config.CUDA_LOW_OCCUPANCY_WARNINGS = 0

#: True when numba's CUDA simulator (NUMBA_ENABLE_CUDASIM=1) stands in for the GPU.
SIMULATOR = bool(_config.ENABLE_CUDASIM)


if SIMULATOR:
    import sys
    import threading

    from numba.core import types as _types
    from numba.cuda.simulator import kernelapi as _kernelapi
    from numba.np import numpy_support as _numpy_support

    _shared_lock = threading.Lock()
    _dynamic_shared = _kernelapi.FakeCUDAShared.array

    def _shared_array(self, shape, dtype, alignment=None):
        """numba's simulator finds a block's static shared array by the calling line and
        creates it when missing, without a lock: two simulated threads switched between the
        lookup and the store got two arrays, and one never saw the other's writes (seen as
        unwritten outputs of a transposed B on a loaded 2-core machine). Same lookup, locked."""
        if shape == 0 or alignment is not None:        # one dynamic buffer / numba's error
            return _dynamic_shared(self, shape, dtype, alignment)
        if isinstance(dtype, _types.Type):
            dtype = _numpy_support.as_dtype(dtype)
        frame = sys._getframe(1)
        caller = (frame.f_code.co_filename, frame.f_lineno)
        with _shared_lock:
            res = self._allocations.get(caller)
            if res is None:
                res = self._allocations[caller] = np.empty(shape, dtype)
        return res

    _kernelapi.FakeCUDAShared.array = _shared_array
