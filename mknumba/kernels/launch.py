"""The launch frame: how every op plans its persistent kernel once and launches it cheaply.

A kernel declares its parameters once, in its own signature, with numba types as annotations:

    @cuda.jit
    def gemm_kernel(a: Bits2D, b: Bits2D, c: Bits2D, ..., frame: Words64, ...):

Everything else derives from that declaration: :func:`signature` (the types the op compiles for
at plan time, and the types the tests compile for without a GPU), the positions of the arguments
in a prepared launch, and the names an op uses to hand arrays to it.

A call then does three things, in this order:

1. **check** its operands (``mknumba.arrays.operand``: dtype, shape, layout, device);
2. **bind** their addresses into the :class:`Launch`, which holds the kernel's arguments
   converted once, at plan time, in the one buffer the driver copies at launch, so a call
   rewrites a few pointers and nothing else. A launch
   never keeps a copy of an input: what an op derives from an input (a transposed B) is
   recomputed on the stream by every call, ahead of the kernel;
3. **launch** on the caller's stream through a one-node CUDA graph made at plan time
   (``cuGraphLaunch``; :func:`set_graph_launch` "always", the default), its node's parameters
   first refreshed from the buffer when they changed (``cuGraphExecKernelNodeSetParams``,
   which touches no launch already queued): 2.4 us of host time against 7.2 us for a
   ``cuLaunchKernel`` of the same kernel on an H200 host. On a stream being captured into the
   caller's graph (where a graph launch is refused), the kernel itself (``cuLaunchKernel``),
   which a capture records as a kernel node. "stable" launches through the graph only a call
   that repeats the last call's addresses, "off" never.

The call number and the epoch live on the GPU (:class:`~mknumba.kernels.lifetime.Frame`): each
block takes a ticket when it starts (``roles.blocks.begin``) and derives them from it. So a
launch has no argument that changes from call to call, and a captured CUDA graph replays
correctly: each replay is a new call with a new epoch. The host never needs to know the epoch.

The frame's other two modules: :mod:`mknumba.kernels.streams` (the caller's stream, graph
captures, one order of an op's calls across streams) and :mod:`mknumba.kernels.lifetime` (the
call counter, and an op's life around its calls: planning, checked calls, ``free``).
"""
import ctypes
import os
import threading
import weakref

import numpy as np
from numba import cuda, types

from .. import _compat  # noqa: F401  (numpy alias before numba compiles anything)
from .._compat import SIMULATOR
from ..arrays import c_strides
from ..errors import MkError, MkValueError

__all__ = ["array_type", "params", "signature", "compile_kernel", "pack", "Slot", "param",
           "Launch", "set_graph_launch", "graph_launch"]


def array_type(dtype, ndim):
    """The numba type of a C-contiguous ``ndim``-d array of ``dtype`` (a kernel annotation)."""
    from numba.np.numpy_support import from_dtype
    return types.Array(from_dtype(np.dtype(dtype)), ndim, "C")


def params(kernel):
    """``[(name, numba type)]`` of a kernel's parameters, from its annotations (dispatcher or
    plain function). A parameter without an annotation is an error: the declaration is whole."""
    import inspect
    fn = getattr(kernel, "py_func", kernel)
    out = []
    for name, p in inspect.signature(fn).parameters.items():
        if p.annotation is inspect.Parameter.empty:
            raise TypeError(f"{fn.__name__}: parameter {name!r} has no type annotation")
        out.append((name, p.annotation))
    return out


def signature(kernel):
    """The tuple of numba types a kernel is compiled for (its declaration, :func:`params`)."""
    return tuple(t for _, t in params(kernel))


def compile_kernel(kernel, threads, smem_bytes):
    """Compile ``kernel`` (a ``cuda.jit`` dispatcher) for its declared signature on the current
    GPU, raise its dynamic shared memory limit to ``smem_bytes`` and return ``(compiled, blocks
    per SM)``. In the simulator: ``(kernel, 1)``."""
    if SIMULATOR:
        return kernel, 1
    compiled = kernel.compile(signature(kernel))
    cufunc = compiled._codelibrary.get_cufunc()
    ctx = cuda.current_context()
    if smem_bytes > 48 * 1024:
        _set_max_dynamic_smem(cufunc, smem_bytes, ctx.device.id)
    bps = ctx.get_active_blocks_per_multiprocessor(cufunc, threads, smem_bytes)
    return compiled, int(bps)


def _set_max_dynamic_smem(cufunc, nbytes, device_id):
    """numba never raises the 48 KB default (numba-cuda issue #94)."""
    from cuda.bindings import driver as drv
    attr = drv.CUfunction_attribute.CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES
    (err,) = drv.cuKernelSetAttribute(attr, nbytes, cufunc.handle, drv.CUdevice(device_id))
    if err != drv.CUresult.CUDA_SUCCESS:  # a handle loaded as a plain function, not a library kernel
        (err,) = drv.cuFuncSetAttribute(drv.CUfunction(int(cufunc.handle)), attr, nbytes)
    if err != drv.CUresult.CUDA_SUCCESS:
        raise MkError(f"could not raise the dynamic shared memory limit to {nbytes} B: {err}")


def pack(fields, **values):
    """An int64 array of ``values`` in the order of ``fields`` (a kernel's ``cfg``), every field
    given by name exactly once."""
    missing = [f for f in fields if f not in values]
    extra = [f for f in values if f not in fields]
    if missing or extra:
        raise TypeError(f"cfg: missing {missing}, unknown {extra}")
    return np.array([int(values[f]) for f in fields], np.int64)


class Slot:
    """A placeholder for an array argument bound per call (:meth:`Launch.bind`): its shape in
    elements of the parameter's declared dtype."""

    def __init__(self, shape):
        self.shape = tuple(int(s) for s in shape)


def _cai(x):
    """(address, shape, strides in bytes, itemsize) of a device array."""
    d = x.__cuda_array_interface__
    itemsize = np.dtype(d["typestr"]).itemsize
    shape = tuple(d["shape"])
    return d["data"][0], shape, tuple(d.get("strides") or c_strides(shape, itemsize)), itemsize


def param(arr):
    """A device array of the op's own as a bound parameter (:meth:`Launch.bind`): its address
    on the GPU, the array itself in the simulator."""
    return arr if SIMULATOR else arr.__cuda_array_interface__["data"][0]


class Launch:
    """A kernel's arguments converted once; each call binds the per-call addresses and launches.

    ``kernel``: the dispatcher (its annotations declare the parameters); ``compiled``: what
    :func:`compile_kernel` returned for it; ``values``: ``{name: value}`` for every parameter
    (device arrays, scalars, or a :class:`Slot` for an array bound per call); ``grid`` blocks
    of ``threads`` threads with ``smem`` bytes of dynamic shared memory.
    """

    def __init__(self, kernel, compiled, values, grid, threads, smem):
        declared = params(kernel)
        names = [n for n, _ in declared]
        missing = [n for n in names if n not in values]
        extra = [n for n in values if n not in names]
        if missing or extra:
            raise TypeError(f"{kernel.py_func.__name__}: missing arguments {missing}, "
                            f"unknown {extra}")
        self.grid, self.threads, self.smem = int(grid), int(threads), int(smem)
        self.compiled = compiled
        self.lock = threading.Lock()  # held by a call from its binds to its launch
        self.values = dict(values)    # the arrays stay alive as long as the launch refers to them
        self._binders = {}            # names -> binder (see :meth:`binder`)
        if SIMULATOR:
            self.kernel = compiled
            self.names = names
            self.args = dict(values)
            return
        self._cvals = []
        self._slots = {}         # name -> index in _cvals of the data pointer a bind rewrites
        for name, ty in declared:
            self._flatten(name, ty, values[name])
        self._pack()
        from cuda.bindings import driver as drv
        handle = compiled._codelibrary.get_cufunc().handle
        err, fn = drv.cuKernelGetFunction(handle)   # the kernel in the current context
        if err != drv.CUresult.CUDA_SUCCESS:
            fn = drv.CUfunction(int(handle))
        self._fn, self._launch = int(fn), _driver_launch()
        self._graph = _OneKernelGraph(self._fn, self.grid, self.threads, self.smem,
                                      self._extra_addr)
        self._synced = True       # the graph's node holds the buffer's parameters
        self._bound_since_launch = False    # a bind() by name since the last launch
        self._last_bind = (None, None)      # (binder, its values): what the slots hold now

    def _flatten(self, name, ty, value):
        """numba's kernel ABI: an array is (meminfo, parent, nitems, itemsize, data, shape...,
        strides...); a scalar is its C type."""
        if isinstance(ty, types.Array):
            if isinstance(value, Slot):
                itemsize = np.dtype(str(ty.dtype)).itemsize
                shape = value.shape
                strides = c_strides(shape, itemsize)
                ptr = 0
            else:
                ptr, shape, strides, itemsize = _cai(value)
                if np.dtype(str(ty.dtype)).itemsize != itemsize:
                    raise TypeError(f"argument {name}: {itemsize}-byte elements, declared {ty}")
            if len(shape) != ty.ndim:
                raise TypeError(f"argument {name}: {len(shape)}-d, declared {ty}")
            c = ctypes.c_ssize_t
            self._slots[name] = len(self._cvals) + 4
            self._cvals += [ctypes.c_void_p(0), ctypes.c_void_p(0),
                            c(int(np.prod(shape, dtype=np.int64))), c(itemsize),
                            ctypes.c_void_p(ptr)]
            self._cvals += [c(s) for s in shape] + [c(s) for s in strides]
        elif isinstance(ty, types.Integer):
            self._cvals.append(getattr(ctypes, f"c_{ty}")(int(value)))
        elif ty == types.float32:
            self._cvals.append(ctypes.c_float(value))
        elif ty == types.float64:
            self._cvals.append(ctypes.c_double(value))
        else:
            raise TypeError(f"argument {name}: type {ty} is not supported by the launch frame")

    def _pack(self):
        """The parameters as the kernel holds them: one buffer, each at its aligned offset
        (the driver copies it whole: ``CU_LAUNCH_PARAM_BUFFER_POINTER``, cheaper than one
        pointer per parameter for kernels with hundreds of them)."""
        offsets, end = [], 0
        for v in self._cvals:
            align = ctypes.alignment(type(v))
            end = (end + align - 1) // align * align
            offsets.append(end)
            end += ctypes.sizeof(v)
        self._buffer = (ctypes.c_char * max(end, 8))()
        base = ctypes.addressof(self._buffer)
        for v, off in zip(self._cvals, offsets):
            ctypes.memmove(base + off, ctypes.addressof(v), ctypes.sizeof(v))
        # the per-call pointers; written only by bind() and the binders' go, whose memory of
        # the last binds (_last_bind) relies on it
        self._data = {name: ctypes.c_void_p.from_buffer(self._buffer, offsets[i])
                      for name, i in self._slots.items()}
        self._size = ctypes.c_size_t(end)
        # CU_LAUNCH_PARAM_BUFFER_POINTER (1), buffer, CU_LAUNCH_PARAM_BUFFER_SIZE (2), &size,
        # CU_LAUNCH_PARAM_END (0)
        self._extra = (ctypes.c_void_p * 5)(1, base, 2, ctypes.addressof(self._size), 0)
        self._extra_addr = ctypes.addressof(self._extra)

    def bind(self, name, x):
        """Point array argument ``name`` at ``x``: an address (GPU), or in the simulator an
        array already shaped as the parameter is declared (``arrays.Operand.as_param``)."""
        if SIMULATOR:
            self.args[name] = x
        else:
            self._data[name].value = x
            self._bound_since_launch = True
            self._last_bind = (None, None)

    def binder(self, *names):
        """``go(stream, *values)``: bind ``names``, in this order, to ``values`` and launch on
        ``stream``: a hot path's binds and launch in one call (a bind by name costs a method
        call and a lookup each). Call ``go`` with :attr:`lock` held, as :meth:`bind`. Made
        once per tuple of names."""
        go = self._binders.get(names)
        if go is None:
            go = self._binders[names] = self._make_binder(names)
        return go

    def _make_binder(self, names):
        if SIMULATOR:
            def go(stream, *values):
                self.args.update(zip(names, values))
                self.kernel[self.grid, self.threads, 0, self.smem](
                    *[self.args[n] for n in self.names])
            return go
        slots = [self._data[n] for n in names]
        launch, fn, grid, threads = self._launch, self._fn, self.grid, self.threads
        smem, extra = self.smem, self._extra_addr
        g = self._graph
        graph, node, node_params = g.exec, g.node, g.params
        mode = _GRAPH_MODE

        def go(stream, *values):
            # a call that repeats the last binds (this binder's, none by name since) finds
            # its values in the slots already: one tuple compare instead of a read per slot
            changed = False
            if self._last_bind != (go, values):
                changed = self._bound_since_launch
                for slot, v in zip(slots, values):
                    if slot.value != v:
                        slot.value = v
                        changed = True
                self._bound_since_launch = False
                self._last_bind = (go, values)
            if changed:
                self._synced = False
            # "stable": a call whose parameters changed launches the kernel itself, and the
            # graph's node is refreshed only by a call that repeats the last one's
            m = mode[0]
            use = graph if m == _ALWAYS or (m == _STABLE and not changed) else 0
            err = launch(fn, grid, threads, smem, int(stream), extra, use, node, node_params,
                         not self._synced)    # int: a StreamHandle would slow the dispatch
            if err > 0:
                _launch_failed(err)
            if err == 0 and use:          # launched through the graph, now in step
                self._synced = True
        return go

    def __call__(self, stream=0):
        """Launch on ``stream`` (a raw stream handle, int) with the bound arguments."""
        self.binder()(stream)


def _launch_failed(err):
    from cuda.bindings import driver as drv
    raise MkError(f"kernel launch failed: {drv.CUresult(err)}"
                  + (" (is this GPU's context current?)" if err in (201, 400) else ""))


_LAUNCH = []
_OFF, _STABLE, _ALWAYS = 0, 1, 2
_GRAPH_MODES = {"off": _OFF, "stable": _STABLE, "always": _ALWAYS}
#: when a launch goes through its one-node graph (:class:`_OneKernelGraph`), read by every call:
#: [_ALWAYS] (every call, the node's parameters refreshed when they changed), [_STABLE] (a call
#: whose parameters are those of the call before) or [_OFF] (never); :func:`set_graph_launch`
_GRAPH_MODE = [_ALWAYS]


def set_graph_launch(mode):
    """When a launch goes through its op's one-node CUDA graph instead of ``cuLaunchKernel``:
    "always" (the default), "stable" (only a call that repeats the last call's addresses) or
    "off" (never). Takes effect from the next call of every op. The environment's
    ``MKNUMBA_GRAPH_LAUNCH`` sets it at import. Both launches run the same kernel with the
    same parameters; a graph launch costs the host less (:mod:`mknumba.kernels.launch`)."""
    if mode not in _GRAPH_MODES:
        raise MkValueError(f"graph launch mode must be stable, always or off, not {mode!r}")
    _GRAPH_MODE[0] = _GRAPH_MODES[mode]


def graph_launch():
    """The graph launch mode in effect (:func:`set_graph_launch`)."""
    return next(name for name, m in _GRAPH_MODES.items() if m == _GRAPH_MODE[0])


try:
    set_graph_launch(os.environ.get("MKNUMBA_GRAPH_LAUNCH", "always"))
except MkValueError:
    raise MkValueError(f"MKNUMBA_GRAPH_LAUNCH must be stable, always or off, not "
                       f"{os.environ['MKNUMBA_GRAPH_LAUNCH']!r}") from None


def _driver_launch():
    """``launch(function, grid, threads, smem, stream, params, graph, node, node_params,
    update) -> CUresult``: a launch of a 1-d grid with a packed parameter buffer, from
    compiled code through ctypes pointers into libcuda (through cuda.bindings the same calls
    cost about a microsecond more: benchmarks/probe_launch.py). With a ``graph`` (the exec of
    :class:`_OneKernelGraph`, else 0) the graph is launched, its node's parameters first
    refreshed from the buffer when ``update``; but on a stream being captured (where a graph
    launch is an error that ends the capture) the kernel is launched itself
    (``cuLaunchKernel``), the node left as it was, and the result is -1 if that launch
    succeeded. ``nogil``: a launch that waits for room in the launch queue must not hold up
    the proxy's thread, which the queued kernels wait on."""
    if not _LAUNCH:
        from numba import njit
        lib = ctypes.CDLL("libcuda.so.1")
        u32, u64, i32 = ctypes.c_uint32, ctypes.c_uint64, ctypes.c_int
        kernel = lib.cuLaunchKernel
        kernel.restype = i32
        kernel.argtypes = [u64, u32, u32, u32, u32, u32, u32, u32, u64, u64, u64]
        set_params = lib.cuGraphExecKernelNodeSetParams       # the v1 node parameters
        set_params.restype, set_params.argtypes = i32, [u64, u64, u64]
        launch_graph = lib.cuGraphLaunch
        launch_graph.restype, launch_graph.argtypes = i32, [u64, u64]
        capturing = lib.cuStreamIsCapturing
        capturing.restype, capturing.argtypes = i32, [u64, u64]

        @njit(nogil=True)
        def launch(fn, grid, threads, smem, stream, params, graph, node, node_params, update):
            if graph:
                status = np.ones(1, np.int32)
                err = capturing(stream, status.ctypes.data)
                if err:
                    return err
                if status[0] == 0:            # CU_STREAM_CAPTURE_STATUS_NONE
                    if update:
                        err = set_params(graph, node, node_params)
                        if err:
                            return err
                    return launch_graph(graph, stream)
                err = kernel(fn, grid, 1, 1, threads, 1, 1, smem, stream, 0, params)
                return err if err else -1     # the graph's node was left as it was
            return kernel(fn, grid, 1, 1, threads, 1, 1, smem, stream, 0, params)

        _LAUNCH.append(launch)
    return _LAUNCH[0]


class _KernelNodeParams(ctypes.Structure):
    """CUDA_KERNEL_NODE_PARAMS (the v1 layout, as ``cuGraphAddKernelNode`` and
    ``cuGraphExecKernelNodeSetParams`` take it)."""
    _fields_ = [("func", ctypes.c_void_p), ("grid", ctypes.c_uint * 3),
                ("block", ctypes.c_uint * 3), ("shared_mem_bytes", ctypes.c_uint),
                ("kernel_params", ctypes.c_void_p), ("extra", ctypes.c_void_p)]


class _OneKernelGraph:
    """A CUDA graph of one kernel node, instantiated in the current context: ``exec``,
    ``node`` and ``params`` (the address of its :class:`_KernelNodeParams`, which point at the
    launch's parameter buffer) for :func:`_driver_launch`. ``exec`` is 0 where the driver
    refuses such a graph: the kernel is then always launched itself."""

    def __init__(self, fn, grid, threads, smem, extra):
        self._params = _KernelNodeParams(fn, (grid, 1, 1), (threads, 1, 1), smem, None, extra)
        self.params = ctypes.addressof(self._params)
        self.exec = self.node = 0
        lib = ctypes.CDLL("libcuda.so.1")
        graph, node, exe = ctypes.c_void_p(), ctypes.c_void_p(), ctypes.c_void_p()
        if lib.cuGraphCreate(ctypes.byref(graph), 0):
            return
        self._graph = graph.value
        if lib.cuGraphAddKernelNode(ctypes.byref(node), graph, None, ctypes.c_size_t(0),
                                    ctypes.byref(self._params)) == 0 and \
                lib.cuGraphInstantiateWithFlags(ctypes.byref(exe), graph,
                                                ctypes.c_ulonglong(0)) == 0:
            self.exec, self.node = exe.value, node.value
            # its device-side state now (stream 0), not at its first launch, which may come
            # while kernels of this op on other GPUs wait for it
            lib.cuGraphUpload(exe, None)
        # released with the launch, not at exit (the context may be gone by then)
        weakref.finalize(self, _destroy_graph, lib, self.exec, self._graph).atexit = False


def _destroy_graph(lib, exe, graph):
    if exe:
        lib.cuGraphExecDestroy(ctypes.c_void_p(exe))
    lib.cuGraphDestroy(ctypes.c_void_p(graph))
