"""A persistent kernel's launch, marshalled once.

numba converts every argument on every launch: tens of microseconds of host time for a kernel
of many arrays, which is the whole call at small shapes. A :class:`Prepared` launch converts the
arguments once; each later call only rewrites the few uint32 scalars that change (the epoch,
the call number) and launches through ``cuda.core``.
"""
import numpy as np
from numba import cuda

from .._compat import SIMULATOR


class Prepared:
    """``kern``: a compiled kernel (``kernels.gemm._load``; in the simulator the dispatcher),
    ``args`` its arguments, launched on ``grid`` blocks of ``threads`` with ``smem`` bytes of
    dynamic shared memory on ``stream``. ``scalars``: positions of the uint32 arguments that
    :meth:`run` rewrites, in its argument order. ``result``: what :meth:`run` returns;
    ``keep``: objects the launch must keep alive (inputs, scratch copies)."""

    def __init__(self, kern, args, grid, threads, smem, stream, scalars, result=None, keep=()):
        self.kern, self.grid, self.threads, self.smem = kern, grid, threads, smem
        self.args, self.scalars, self.result, self.keep = args, tuple(scalars), result, keep
        self.stream = stream
        if SIMULATOR:
            return
        from cuda.core import LaunchConfig
        if isinstance(stream, int) and stream == 0:
            self.stream = stream = cuda.default_stream()
        self.kernelargs, retr, first = [], [], []
        for ty, v in zip(kern.argument_types, args):
            first.append(len(self.kernelargs))     # an array becomes several C arguments
            kern._prepare_args(ty, v, stream, retr, self.kernelargs)
        self._at = [first[i] for i in self.scalars]
        self.config = LaunchConfig(grid=grid, block=threads, shmem_size=smem)
        self.cukernel = kern._codelibrary.get_cufunc().kernel

    def run(self, *values):
        """Launch with the scalars at ``scalars`` set to ``values``; returns ``result``."""
        if SIMULATOR:
            for i, v in zip(self.scalars, values):
                self.args[i] = np.uint32(v)
            self.kern[self.grid, self.threads, self.stream, self.smem](*self.args)
            return self.result
        from cuda.core import launch
        for j, v in zip(self._at, values):
            self.kernelargs[j].value = v
        launch(self.stream, self.config, self.cukernel, *self.kernelargs)
        return self.result
