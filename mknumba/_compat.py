"""Work-arounds for the versions we run on, applied before numba.cuda compiles anything; and
the choice of numba's CUDA simulator where no GPU is visible."""
import os
import sys

import numpy as np

# numpy 2.5 removed np.row_stack, but numba-cuda 0.30.4 still registers an overload for it
# when the first kernel compiles (docs/design.md §6). The alias is exact: row_stack was vstack.
if not hasattr(np, "row_stack"):
    np.row_stack = np.vstack



def _gpu_visible():
    """Whether this process may see a CUDA GPU, judged without initialising CUDA (a process
    that forks later keeps a usable driver): the driver's library loads and a device node
    exists, and CUDA_VISIBLE_DEVICES does not hide them all."""
    import ctypes
    import glob
    if os.environ.get("CUDA_VISIBLE_DEVICES") in ("", "-1"):
        return False
    try:
        ctypes.CDLL("libcuda.so.1")
    except OSError:
        return False
    return bool(glob.glob("/dev/nvidia[0-9]*")) or os.path.exists("/dev/dxg")   # dxg: WSL


#: True when mknumba chose the simulator itself: no GPU visible and NUMBA_ENABLE_CUDASIM unset
#: (set it to 0 to refuse, 1 to ask for the simulator); numba.cuda not imported yet.
AUTO_SIMULATOR = ("NUMBA_ENABLE_CUDASIM" not in os.environ and "numba.cuda" not in sys.modules
                  and not _gpu_visible())
if AUTO_SIMULATOR:
    os.environ["NUMBA_ENABLE_CUDASIM"] = "1"

from numba.core import config as _config  # noqa: E402

if AUTO_SIMULATOR:
    _config.reload_config()
    rank = os.environ.get("PMI_RANK", os.environ.get("OMPI_COMM_WORLD_RANK", "0"))
    if rank == "0":       # once per job, not once per rank
        print("mknumba: no CUDA GPU visible, so numba's CUDA simulator stands in (small sizes "
              "only; NUMBA_ENABLE_CUDASIM=0 refuses)", file=sys.stderr, flush=True)

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
