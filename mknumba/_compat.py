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

    import numba_cuda
    from numba.cuda.simulator import kernel as _kernel

    # The block runner and the ``cuda`` swap below copy numba-cuda 0.30's simulator internals
    # (its BlockThread's fields, kernelapi's swap registry); other versions keep numba's own.
    _SIM_INTERNALS_0_30 = numba_cuda.__version__.startswith("0.30.")

    class _BlockThread(_kernel.BlockThread):
        """numba's simulated thread, telling its block's manager when the last live thread
        reaches a barrier or a thread ends (numba's manager polls every thread in a loop that
        competes for the GIL with them: a 1x2 fused test run took 16 s with it, 13 s without)."""

        def run(self):
            try:
                super().run()        # records an exception in self.exception
            finally:
                m = self._manager
                with m.changed:
                    m.live -= 1
                    m.changed.notify()

        def syncthreads(self):
            if self.abort:
                raise RuntimeError("abort flag set on syncthreads call")
            m = self._manager
            with m.changed:
                self.syncthreads_blocked = True
                m.blocked += 1
                if m.blocked == m.live:
                    m.changed.notify()
            self.syncthreads_event.wait()
            self.syncthreads_event.clear()
            if self.abort:
                raise RuntimeError("abort flag set on syncthreads clear")

    class _BlockManager(_kernel.BlockManager):
        """numba's BlockManager.run with the same rules (all live threads at the barrier: all
        go on; a thread's exception aborts the others and is raised), woken by the threads
        instead of polling them."""

        def run(self, grid_point, *args):
            self.changed = threading.Condition()

            def target():
                self._f(*args)

            threads = [_BlockThread(target, self, grid_point, point, self._debug)
                       for point in np.ndindex(*self._block_dim)]
            self.live, self.blocked = len(threads), 0      # threads not ended; at a barrier
            with self.changed:
                for t in threads:
                    t.start()
                while True:
                    failed = next((t for t in threads if t.exception), None)
                    if failed is not None:
                        for t in threads:
                            t.abort = True
                            t.syncthreads_blocked = False
                            t.syncthreads_event.set()
                        raise failed.exception[0].with_traceback(failed.exception[1])
                    if self.live == 0:
                        return
                    if self.blocked == self.live:
                        self.blocked = 0
                        for t in threads:
                            if t.syncthreads_blocked:
                                t.syncthreads_blocked = False
                                t.syncthreads_event.set()
                    self.changed.wait()

    if _SIM_INTERNALS_0_30:
        _kernel.BlockManager = _BlockManager

    from numba import cuda as _cuda

    class _SwappedCudaModule:
        """numba's ``kernelapi.swapped_cuda_module`` (around every simulated kernel and device
        function call: the fake ``cuda`` module in the function's globals while any thread is
        inside one of that module's functions), with the same locks and counts, as a plain
        context manager: numba's generator-based one doubled the cost of a device call."""
        __slots__ = ("globs", "gid", "lock", "fake")

        def __init__(self, fn, fake_cuda_module):
            self.globs, self.fake = fn.__globals__, fake_cuda_module
            self.gid = id(self.globs)
            lock = _kernelapi._globals_locks.get(self.gid)
            if lock is None:
                with _kernelapi._locks_register_lock:
                    lock = _kernelapi._globals_locks[self.gid]
            self.lock = lock

        def __enter__(self):
            with self.lock:
                if _kernelapi._swap_refcount[self.gid] == 0:
                    orig = {k: v for k, v in self.globs.items() if v is _cuda}
                    _kernelapi._swap_orig[self.gid] = orig
                    for k in orig:
                        self.globs[k] = self.fake
                _kernelapi._swap_refcount[self.gid] += 1

        def __exit__(self, *exc):
            with self.lock:
                _kernelapi._swap_refcount[self.gid] -= 1
                if _kernelapi._swap_refcount[self.gid] == 0:
                    self.globs.update(_kernelapi._swap_orig.pop(self.gid))
                    del _kernelapi._swap_refcount[self.gid]

    if _SIM_INTERNALS_0_30:
        _kernel.swapped_cuda_module = _SwappedCudaModule
