"""The host cost of one kernel launch by each way Python can reach ``cuLaunchKernel``
(diagnostic; one process, one GPU).

    python benchmarks/probe_launch.py

A small kernel prepared by ``kernels.launch.Launch`` (its parameters in one packed buffer) is
launched back to back: by the Launch itself, through cuda.bindings, through a ctypes function
pointer with declared argument types, and through the same pointer called from a numba
``njit`` function (what Launch and the dma proxy do). Also times the per-tensor check of
the hot path (``arrays.torch_ptr``) and a few of its pieces. Prints microseconds per call.
"""
import ctypes
import time

import numpy as np
import torch
from numba import cuda, njit

from mknumba.arrays import torch_ptr
from mknumba.kernels.launch import Launch, array_type, compile_kernel

U64, U32, INT = ctypes.c_uint64, ctypes.c_uint32, ctypes.c_int


@cuda.jit
def touch(x: array_type(np.uint64, 1), n: array_type(np.int64, 1)):
    if cuda.grid(1) == 0:
        x[0] += np.uint64(n[0])


def t(name, fn, n=4000):
    for _ in range(100):
        fn()
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    for _ in range(n):
        fn()
    us = (time.perf_counter() - t0) / n * 1e6
    torch.cuda.synchronize()
    print(f"{name:<36} {us:7.2f} us", flush=True)


def main():
    torch.cuda.init()
    x = cuda.to_device(np.zeros(1, np.uint64))
    nn = cuda.to_device(np.ones(1, np.int64))
    compiled, _ = compile_kernel(touch, 128, 0)
    L = Launch(touch, compiled, dict(x=x, n=nn), 132, 128, 0)
    s = torch.cuda.current_stream().cuda_stream
    t("Launch (the library's)", lambda: L(s))
    from cuda.bindings import driver as drv
    dfn, ds = drv.CUfunction(L._fn), drv.CUstream(s)
    t("cuda.bindings cuLaunchKernel", lambda: drv.cuLaunchKernel(
        dfn, 132, 1, 1, 128, 1, 1, 0, ds, None, L._extra_addr))

    lib = ctypes.CDLL("libcuda.so.1")
    f = lib.cuLaunchKernel
    f.restype = INT
    f.argtypes = [U64, U32, U32, U32, U32, U32, U32, U32, U64, U64, U64]
    fn = int(L._fn)
    extra = L._extra_addr
    t("ctypes cuLaunchKernel (argtypes)",
      lambda: f(fn, 132, 1, 1, 128, 1, 1, 0, s, 0, extra))

    g = ctypes.CDLL("libcuda.so.1").cuLaunchKernel
    g.restype = INT
    args = (ctypes.c_void_p(fn), U32(132), U32(1), U32(1), U32(128), U32(1), U32(1), U32(0),
            ctypes.c_void_p(s), ctypes.c_void_p(0), ctypes.c_void_p(extra))
    t("ctypes cuLaunchKernel (prebuilt args)", lambda: g(*args))

    @njit(cache=False)
    def launch_nj(fn, grid, threads, smem, stream, extra):
        return f(fn, grid, 1, 1, threads, 1, 1, smem, stream, 0, extra)

    launch_nj(fn, 132, 128, 0, s, extra)
    t("njit -> ctypes pointer", lambda: launch_nj(fn, 132, 128, 0, s, extra))

    cfg = np.array([fn, 132, 128, 0, s, extra], np.uint64)

    @njit(cache=False)
    def launch_cfg(c):
        return f(c[0], np.uint32(c[1]), 1, 1, np.uint32(c[2]), 1, 1, np.uint32(c[3]), c[4], 0, c[5])

    launch_cfg(cfg)
    t("njit(cfg array) -> ctypes pointer", lambda: launch_cfg(cfg))
    torch.cuda.synchronize()
    calls = int(x.copy_to_host()[0])
    print("kernel ran", calls, "times", flush=True)

    a = torch.randn(2048, 512, device="cuda", dtype=torch.bfloat16)
    wt = torch.randn(2048, 512, device="cuda", dtype=torch.bfloat16).T
    t("torch_ptr(a)", lambda: torch_ptr(a, (2048, 512), 0))
    t("torch_ptr(w.T)", lambda: torch_ptr(wt, (512, 2048), 0, (1, 512)))
    t("a.dtype", lambda: a.dtype)
    t("a.shape == tuple", lambda: a.shape == (2048, 512))
    t("a.get_device()", lambda: a.get_device())
    t("a.is_contiguous()", lambda: a.is_contiguous())
    t("a.data_ptr()", lambda: a.data_ptr())
    t("a.stride() == tuple", lambda: a.stride() == (512, 1))
    t("a.device.index", lambda: a.device.index)


if __name__ == "__main__":
    main()
