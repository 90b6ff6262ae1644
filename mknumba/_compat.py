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
