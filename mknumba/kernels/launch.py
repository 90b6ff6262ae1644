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

The call number and the epoch live on the GPU (:class:`Frame`): each block takes a ticket when
it starts (``roles.blocks.begin``) and derives them from it. So a launch has no argument that
changes from call to call, and a captured CUDA graph replays correctly: each replay is a new
call with a new epoch. The host never needs to know the epoch.
"""
import contextlib
import ctypes
import os
import threading
import warnings
import weakref

import numpy as np
from numba import cuda, types

from .. import _compat  # noqa: F401  (numpy alias before numba compiles anything)
from .._compat import SIMULATOR
from ..arrays import c_strides
from ..errors import MkError, MkValueError, raise_if_timed_out
from ..primitives import FRAME_CLOSED, FRAME_WORDS, epoch_of_host

__all__ = ["array_type", "params", "signature", "compile_kernel", "pack", "Slot", "param",
           "Launch", "Frame", "StreamHandle", "stream_handle", "StreamOrder", "is_capturing",
           "outputs_in_capture", "OpLifetime", "set_graph_launch", "graph_launch"]


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


class Frame:
    """An op's call counter on its GPU: one uint64 of tickets (``primitives.FRAME_WORDS``),
    one per block of every launch so far, for launches of ``grid`` blocks.

    Each block of a launch takes a ticket when it starts (``roles.blocks.begin``), so launches
    on one stream, graph replays among them, number themselves: call c holds tickets
    [(c - 1) * grid, c * grid). Epochs follow ``primitives.epoch_of_host``: 1, 2, ...,
    2**32 - 1, 1, ... (never 0, which fresh flags hold).
    """

    def __init__(self, grid):
        self.grid = int(grid)
        self.words = cuda.to_device(np.zeros(FRAME_WORDS, np.uint64))
        self.shut = False         # close() took effect (then a second close does nothing)

    def read(self):
        """``(calls mod 2**32, epoch)`` of the last call that started (waits for the device)."""
        calls = (int(self.words.copy_to_host()[0]) & ~int(FRAME_CLOSED)) // self.grid
        return calls & 0xFFFFFFFF, epoch_of_host(calls)

    def closed(self):
        """Whether :meth:`close` has taken effect (waits for the device)."""
        return bool(int(self.words.copy_to_host()[0]) & int(FRAME_CLOSED))

    def close(self, stream=None):
        """The op has ended on this rank (``OpLifetime._end_calls``, ``free``): from now on a
        launch of it does nothing (``roles.blocks.begin``), e.g. a CUDA graph captured before
        and replayed after, which would otherwise pair with the other ranks' calls or touch
        freed buffers. It sets the counter's top byte, so :meth:`read` still counts the calls.
        ``stream``: the stream of the op's last call, behind which the close is queued, and
        waited for (the earlier calls end or time out within the bound); None, or a stream
        that is capturing a graph (which must not take it): a stream of its own. The wait is
        allowed during another stream's capture (this thread's capture mode relaxed). Once
        closed, a second close returns at once: it would only wait on ``stream`` again, which
        may be gone by then (a Comm's finalize closes the frames of ops already freed)."""
        if self.shut:
            return
        if SIMULATOR:
            self.words.copy_to_device(self.words.copy_to_host() | FRAME_CLOSED)
            self.shut = True
            return
        from cuda.bindings import driver as drv
        ok = drv.CUresult.CUDA_SUCCESS
        err, mode = drv.cuThreadExchangeStreamCaptureMode(
            drv.CUstreamCaptureMode.CU_STREAM_CAPTURE_MODE_RELAXED)
        if err != ok:
            raise MkError(f"could not close an op's call counter: {err}")
        own = None
        try:
            if stream is None or is_capturing(stream):
                err, own = drv.cuStreamCreate(drv.CUstream_flags.CU_STREAM_NON_BLOCKING)
                own = own if err == ok else None
            h = own if own is not None else drv.CUstream(stream)
            top = self.words.__cuda_array_interface__["data"][0] + 7     # the top byte, LE
            if err == ok:
                (err,) = drv.cuMemsetD8Async(top, int(FRAME_CLOSED) >> 56, 1, h)
            if err == ok:
                (err,) = drv.cuStreamSynchronize(h)
        finally:
            if own is not None:
                drv.cuStreamDestroy(own)
            drv.cuThreadExchangeStreamCaptureMode(mode)
        if err != ok:
            raise MkError(f"could not close an op's call counter: {err}")
        self.shut = True

    def set(self, calls, epoch=None):
        """Pretend ``calls`` calls have run (tests start near the wrap); ``epoch``, if given,
        must be theirs. Only between calls; the op's flags must agree (``_start_at``)."""
        if epoch is not None and epoch != epoch_of_host(calls):
            raise MkValueError(f"call {calls} has epoch {epoch_of_host(calls)}, not {epoch}")
        counter_at(self.words, [self.grid], calls)
        self.shut = False         # the counter as those calls left it: open

    def start_at(self, calls, flags=(), comm=None):
        """Set the op's state as if ``calls`` calls had run: the counter (:meth:`set`) and
        every epoch flag array in ``flags`` at the last call's epoch (tests start near the
        wrap; only between calls, after a synchronisation). ``comm``: the flags' Comm, whose
        proxy (if any) is told (``Comm.flags_set``)."""
        epoch = epoch_of_host(calls)
        self.set(calls)
        for f in flags:
            f.copy_to_device(np.full(f.shape, epoch, np.uint32))
        if comm is not None:
            comm.flags_set(flags, epoch)


# ---- ticket counters ----------------------------------------------------------------------------
def counter_at(counter, per_call, calls):
    """Set a ticket counter (a device array: the frame's words, a work queue, chunk counts) to
    what ``calls`` calls leave in it, each call drawing ``per_call`` tickets from its entries
    (an entry per index; missing ones draw none), modulo the counter's width."""
    t = np.zeros(counter.shape, np.uint64)
    t[:len(per_call)] = np.asarray(per_call, np.uint64) * np.uint64(calls)
    counter.copy_to_device(t.astype(counter.dtype))


# ---- streams ------------------------------------------------------------------------------------
class StreamHandle(int):
    """A raw stream handle that keeps the stream object it came from alive (``stream``). An op
    keeps the stream of its last call (:class:`StreamOrder`) and uses it after the call: to
    order a call on another stream behind it, in ``synchronize()``, to close its call counter.
    By then the caller may have dropped the object, and a numba or CuPy stream is destroyed
    with it: its handle would name freed driver state."""


def stream_handle(stream, torch_device=None):
    """The raw handle (int) of ``stream``: None (with torch tensors, PyTorch's current stream on
    ``torch_device``; else the legacy default stream, 0), an int, a numba stream, a CuPy stream
    (``.ptr``) or a PyTorch stream (``.cuda_stream``). A stream object's handle holds the
    object (:class:`StreamHandle`). A raw handle (an int, or a PyTorch external stream made
    current) must stay valid until the op's next call on another stream, its
    ``synchronize()`` and ``free()``; PyTorch's own streams are never destroyed."""
    if SIMULATOR:
        return 0
    if stream is None:
        if torch_device is None:
            return 0
        return _torch_current_stream(torch_device)
    if isinstance(stream, int):
        return stream
    handle = None
    for attr in ("cuda_stream", "ptr"):
        if hasattr(stream, attr):
            handle = int(getattr(stream, attr))
            break
    else:
        handle = getattr(stream, "handle", None)
        if handle is not None:
            handle = int(getattr(handle, "value", handle) or 0)
    if handle is not None:
        if not handle:
            return 0                 # the legacy default stream: nothing to keep alive
        held = StreamHandle(handle)
        held.stream = stream
        return held
    raise MkValueError(f"stream: expected a CUDA stream (numba, CuPy, PyTorch) or a raw handle, "
                       f"got {type(stream).__name__}")


_raw_stream = None


def _torch_current_stream(device):
    global _raw_stream
    if _raw_stream is None:
        import torch
        _raw_stream = getattr(torch._C, "_cuda_getCurrentRawStream", None) or (
            lambda d: torch.cuda.current_stream(d).cuda_stream)
    return _raw_stream(device)


def is_capturing(stream):
    """True while ``stream`` (a raw handle) is being captured into a CUDA graph."""
    if SIMULATOR:
        return False
    from cuda.bindings import driver as drv
    err, status = drv.cuStreamIsCapturing(drv.CUstream(stream))
    if err != drv.CUresult.CUDA_SUCCESS:
        raise MkError(f"cuStreamIsCapturing failed: {err}")
    return status != drv.CUstreamCaptureStatus.CU_STREAM_CAPTURE_STATUS_NONE


def outputs_in_capture(op, stream, **outputs):
    """Refuse (MkError) a call on a capturing ``stream`` that leaves out one of ``outputs``
    (name -> the array given, or None): the call would allocate it there, and every replay
    would write into it after the caller dropped it (numba then frees it for reuse)."""
    if all(x is not None for x in outputs.values()) or not is_capturing(stream):
        return
    names = " and ".join(f"{name}=" for name in outputs)
    missing = ", ".join(f"{name}=" for name, x in outputs.items() if x is None)
    raise MkError(f"{op}: a call inside a CUDA graph capture must pass {names} (the arrays the "
                  f"graph's replays write); without {missing} it would allocate here")


class StreamOrder:
    """Keeps an op's calls in one order when they come on different streams.

    The call counter (:class:`Frame`) numbers launches in the order they start, so two calls of
    one op must not run at once. A call on another stream than the last one first makes its
    stream wait for the last call's (an event). A capturing stream takes no such dependency: a
    graph's replays run wherever they are replayed, ordered by the caller like any other work
    on that stream (``torch.cuda.graph`` synchronises the device before it captures). A call on
    another stream while a capture is in progress is refused: it could run during the capture's
    own calls. ``refused(why)``, if given, is told first (``OpLifetime._end_calls``).
    """

    def __init__(self, name, refused=None):
        self.name, self.last, self._refused = name, None, refused
        self._event = None
        self._lock = threading.Lock()

    def enter(self, stream):
        if SIMULATOR or stream == self.last:
            return
        with self._lock:
            last, self.last = self.last, stream
            if last is None or is_capturing(stream):
                return
            if is_capturing(last):
                self.last = last
                e = MkValueError(
                    f"{self.name}: called on stream {stream:#x} while a CUDA graph capture of "
                    f"its calls is in progress on stream {last:#x}; call it on the capturing "
                    "stream, or after the capture ends")
                if self._refused is not None:    # the hot paths refuse here, not in a check
                    self._refused(f"a call it refused here ({e})")
                raise e
            from cuda.bindings import driver as drv
            if self._event is None:
                err, self._event = drv.cuEventCreate(
                    drv.CUevent_flags.CU_EVENT_DISABLE_TIMING)
            (err,) = drv.cuEventRecord(self._event, drv.CUstream(last))
            if err == drv.CUresult.CUDA_SUCCESS:
                (err,) = drv.cuStreamWaitEvent(drv.CUstream(stream), self._event, 0)
            if err != drv.CUresult.CUDA_SUCCESS:
                raise MkError(f"{self.name}: could not order stream {stream:#x} after "
                              f"{last:#x}: {err}")


class OpLifetime:
    """What an op on a Comm does around its calls (a mixin): :meth:`_plan_on` first at plan
    time; each call through :meth:`_checked_call`; :meth:`synchronize`, :meth:`free`,
    :meth:`_start_at`. The op sets ``name`` (before :meth:`_plan_on`), ``err`` (its error
    record), ``frame`` (its :class:`Frame`), ``_buffers`` (its symmetric buffers) and
    ``_epoch_flags`` (its epoch flag arrays on this GPU)."""

    def _plan_on(self, comm):
        """Plan time, first: the op lives on ``comm`` (None: a one-GPU op) until :meth:`free`
        or ``comm.finalize()``, which frees it too (``Comm.adopt``). ``freed``: the op takes
        no more calls (also after a call this rank could not launch: ``_ended``). Its calls
        keep one order across streams (``streams``)."""
        self.comm, self.freed, self.finalized, self._ended = comm, False, False, None
        self.frame = None        # set once planned (a plan that raises before leaves none)
        me = weakref.ref(self)           # (no cycle: a dropped op is freed at once)
        self.streams = StreamOrder(self.name, refused=lambda why: me()._end_calls(why))
        if comm is not None:
            comm.adopt(self)

    @contextlib.contextmanager
    def _planning_ends(self, group=None):
        """Plan time, last: ``with`` around everything after the plan's last collective step
        (the kernel's compile and link among it). Every member leaves it together, so no
        member's first call starts its bounded waits while another is still compiling (on a
        loaded host a link takes minutes, and those waits would time out); and a member that
        raises in it makes every member raise, instead of leaving them to wait for it. An op
        whose planning failed takes no calls and leaves its Comm (whose finalize would
        otherwise tend it). ``group``: the op's members (an mpi4py communicator; default the
        Comm's world)."""
        failed = None
        try:
            yield
        except BaseException as e:    # noqa: BLE001 (raised again below, on this rank too)
            failed = e
        group = group if group is not None else getattr(self.comm, "mpi", None)
        why = None if failed is None else f"{type(failed).__name__}: {failed}"
        if group is not None and group.Get_size() > 1:
            said = group.allgather(why)
            others = [(r, w) for r, w in enumerate(said) if w is not None]
            if failed is None and others:
                r, w = others[0]
                failed = MkError(f"{self.name}: rank {r} of its members failed to plan it ({w}); "
                                 "it takes no calls here either")
                why = f"rank {r}'s planning failed"
        if failed is not None:
            self.freed, self._ended = True, f"its planning failed ({why})"
            if self.comm is not None:
                self.comm.disown(self)
            raise failed

    def _check_live(self):
        """MkError if the op takes no more calls: after :meth:`free`, its Comm's finalize, or
        a call this rank did not launch (:meth:`_end_calls`)."""
        if self.freed:
            raise MkError(f"{self.name}: called after " + (
                self._ended if self._ended else
                "its Comm was finalized" if self.finalized else "free()"))

    def _checked_call(self, call, *args):
        """``call(*args)``: a call with every check, after :meth:`_check_live` and
        :meth:`_check_error`. That may raise an earlier call's error, and ``call`` may
        refuse its arguments (MkValueError), before anything is launched; in an op of several
        ranks the others may have launched that call, so this rank then takes no later one
        (:meth:`_end_calls`). (``call``'s other refusals, MkError inside a CUDA graph capture,
        leave the op as it was: every rank captures alike.)"""
        self._check_live()
        try:
            self._check_error(f"{self.name} (an earlier call)")
        except MkError as e:          # an earlier call's error, raised instead of this launch
            self._end_calls(f"an error here ({e})")
            raise
        try:
            return call(*args)
        except MkValueError as e:
            self._end_calls(f"a call it refused here ({e})")
            raise

    def _check_error(self, what):
        """Raise what the op's calls left in its error record (a timeout, a capacity overflow,
        an expert id out of range: MoE), or a failed proxy first (``Comm.check``)."""
        if self.comm is not None:
            self.comm.check(self.err, what)
        else:
            raise_if_timed_out(self.err, what)

    def _end_calls(self, why):
        """This rank raised instead of launching a call that the other ranks may have
        launched, so none of its later calls may pair with theirs (ops of 2+ members): it
        takes no more calls (``freed``; :meth:`free` still releases the buffers), while the
        others' launch times out. (Counting the call as made instead would not do: a quick
        retry would publish the next epoch, which meets the others' waits for the refused
        call, and they would read stale data.) The end is host state, not the error record,
        which a kernel may write first; and the frame is closed (:meth:`Frame.close`), so a CUDA
        graph of the op's calls captured before replays as nothing here."""
        if self._pairs() and not self.freed:
            self.freed, self._ended = True, why
            self._close_frame()

    def _pairs(self):
        """Whether the op's calls pair with other ranks' (2+ members, a call counter)."""
        return (self.comm is not None and getattr(self, "members", self.comm.size) > 1
                and self.frame is not None)

    def _close_frame(self):
        """:meth:`Frame.close` behind the op's last call: its graphs' replays launch nothing
        from now on. On the way to raising an error, so a failure to close warns rather than
        replacing that error."""
        if self.frame is None:
            return
        try:
            self.frame.close(self.streams.last)
        except Exception as e:      # noqa: BLE001 (the error being raised matters more)
            warnings.warn(f"{self.name}: could not close its call counter ({e}); a CUDA graph "
                          "of its calls captured earlier may still launch", RuntimeWarning)

    def _wait(self, stream=None):
        """Wait for this rank's calls on ``stream`` (default the stream of the last call)."""
        stream = stream if stream is not None else (self.streams.last or 0)
        if self.comm is not None:
            self.comm.synchronize(stream)
        elif not SIMULATOR:
            cuda.synchronize()

    def _counters(self):
        """``[(device array, tickets one call draws from each entry)]``: the ticket counters
        besides the frame's that every call advances alike (:func:`counter_at`; work queues,
        chunk counts), which :meth:`_start_at` sets to ``calls`` calls' worth. None here."""
        return []

    def synchronize(self, stream=None):
        """Wait for this rank's calls (on ``stream``, default the stream of the last call);
        raise the error a device wait or check recorded (MkTimeoutError, ...). Such an error
        stays (the next call raises it, then the op takes no more), and from now on a CUDA
        graph of the op's calls replays as nothing here (:meth:`Frame.close`); an expert id
        out of range (MoE, MkValueError) is cleared once raised, and the op goes on. After the
        op ended on this rank (:meth:`_end_calls`), MkError: a replay since wrote nothing."""
        self._wait(stream)
        try:
            self._check_error(self.name)
        except MkValueError:
            raise
        except MkError:
            if self._pairs() and not self.freed:
                self._close_frame()
            raise
        if self._ended:
            raise MkError(f"{self.name}: ended on this rank by {self._ended}; a CUDA graph of "
                          "its calls replayed since then launched nothing")

    def free(self):
        """Collective: release the op's symmetric buffers (waits for this rank's calls); a CUDA
        graph of its calls replays as nothing after it (while the op object lives: the counter
        that says so is the op's)."""
        if self.freed and (self.finalized or not self._buffers):
            return
        self._wait()
        self._close_frame()      # a graph's replays must not touch the freed buffers
        for buf in self._buffers:
            self.comm.free(buf)
        self._buffers = []
        self.freed, self._ended = True, None

    def _start_at(self, calls):
        """Tests: set this rank's state as if ``calls`` calls had run (the frame, every epoch
        flag, and the ticket counters of :meth:`_counters`), e.g. just short of 2**32, to run
        the next calls across the wrap. Collective in effect: every rank must do it with the
        same ``calls`` between calls, after synchronising."""
        self.synchronize()
        self.frame.start_at(calls, self._epoch_flags, self.comm)
        for counter, per_call in self._counters():
            counter_at(counter, per_call, calls)
