"""Device primitives: ordered loads and stores, atomics, fences, timers and the bounded flag wait.

Every kernel in mknumba synchronises through this one module. On the GPU each primitive is one
inline-PTX instruction emitted through ``@intrinsic`` with side effects and a memory clobber: a
plain load in a ``while`` loop is hoisted out of it, and ``cuda.atomic.*`` are relaxed at the
default scope, so neither can carry cross-GPU ordering. Under numba's CUDA simulator
(``NUMBA_ENABLE_CUDASIM=1``) each primitive has a pure-Python twin with the same signature.

Scopes: ``gpu`` orders against other blocks of the same GPU; ``sys`` against peer GPUs (NVLink)
and the host proxy. Flags written by another GPU or by the host are read with ``sys`` scope.

Element types: 32- and 64-bit integer arrays (flags, counters, epochs, error records).
Two packed-bf16 instructions (``pack_bf16x2``, ``add_bf16x2``) serve the reduction roles' sums.
"""
import threading
import time

import numpy as np

from ._compat import SIMULATOR
from .errors import (ERR_BLOCK, ERR_EXPECTED, ERR_FLAG, ERR_KIND, ERR_RANK, ERR_ROLE, ERR_SEEN,
                     ERR_SET, KIND_TIMEOUT)
from numba import cuda

__all__ = ["ld_acquire", "ld_acquire_sys", "st_release", "st_release_sys", "st_relaxed",
           "atomic_add_release",
           "atomic_add_release_sys", "atomic_add_relaxed", "fence_gpu", "fence_sys",
           "fence_proxy_async", "bar_sync", "nanosleep", "prefetch_l1",
           "globaltimer", "peer_view", "peer_after", "data_ptr", "epoch_reached", "wait_flag", "record_timeout",
           "record_error",
           "acquire", "release", "record", "pack_bf16x2", "add_bf16x2",
           "epoch_of", "epoch_of_host", "next_epoch_host", "FRAME_WORDS", "FRAME_CLOSED"]

#: An op's call counter on its GPU (``kernels.lifetime.Frame``, ``roles.blocks.begin``): one
#: uint64 of tickets, one per block of every launch so far.
FRAME_WORDS = 1
#: The counter's top bit: the op has ended on this rank (``Frame.close``), so a launch that
#: still comes (a CUDA graph's replay) does nothing. Tickets never reach it (2**63 blocks).
FRAME_CLOSED = np.uint64(1 << 63)

if not SIMULATOR:
    from llvmlite import ir
    from numba import types
    from numba.core import cgutils
    from numba.core.errors import TypingError
    from numba.core.extending import intrinsic

    def _elem(arr_ty):
        """PTX type suffix and register constraint for an integer array's element."""
        if not isinstance(arr_ty, types.Array) or not isinstance(arr_ty.dtype, types.Integer):
            raise TypingError(f"mknumba primitive needs an integer array, got {arr_ty}")
        bits = arr_ty.dtype.bitwidth
        if bits == 32:
            return "b32", "u32", "r"
        if bits == 64:
            return "b64", "u64", "l"
        raise TypingError(f"mknumba primitive needs 32- or 64-bit elements, got {arr_ty.dtype}")

    def _elem_ptr(context, builder, arr_ty, arr, idx, idx_ty):
        ary = context.make_array(arr_ty)(context, builder, arr)
        idx = context.cast(builder, idx, idx_ty, types.intp)
        return cgutils.get_item_pointer(context, builder, arr_ty, ary, [idx], wraparound=False)

    def _asm(builder, ret, argtys, text, constraints, args):
        fnty = ir.FunctionType(ret, argtys)
        clobbered = ",".join(filter(None, [constraints, "~{memory}"]))
        return builder.call(ir.InlineAsm(fnty, text, clobbered, side_effect=True), args)

    def _make_load(scope):
        @intrinsic
        def load(typingctx, arr, idx):
            b, _, c = _elem(arr)

            def codegen(context, builder, sig, args):
                ptr = _elem_ptr(context, builder, sig.args[0], args[0], args[1], sig.args[1])
                return _asm(builder, ptr.type.pointee, [ptr.type],
                            f"ld.acquire.{scope}.{b} $0, [$1];", f"={c},l", [ptr])
            return arr.dtype(arr, idx), codegen
        return load

    def _make_store(scope, sem="release"):
        @intrinsic
        def store(typingctx, arr, idx, val):
            b, _, c = _elem(arr)

            def codegen(context, builder, sig, args):
                ptr = _elem_ptr(context, builder, sig.args[0], args[0], args[1], sig.args[1])
                v = context.cast(builder, args[2], sig.args[2], sig.args[0].dtype)
                _asm(builder, ir.VoidType(), [ptr.type, v.type],
                     f"st.{sem}.{scope}.{b} [$0], $1;", f"l,{c}", [ptr, v])
                return context.get_dummy_value()
            return types.none(arr, idx, val), codegen
        return store

    def _make_add(sem, scope):
        @intrinsic
        def add(typingctx, arr, idx, val):
            _, u, c = _elem(arr)

            def codegen(context, builder, sig, args):
                ptr = _elem_ptr(context, builder, sig.args[0], args[0], args[1], sig.args[1])
                v = context.cast(builder, args[2], sig.args[2], sig.args[0].dtype)
                return _asm(builder, v.type, [ptr.type, v.type],
                            f"atom.add.{sem}.{scope}.{u} $0, [$1], $2;", f"={c},l,{c}", [ptr, v])
            return arr.dtype(arr, idx, val), codegen
        return add

    def _make_fence(scope):
        @intrinsic
        def fence(typingctx):
            def codegen(context, builder, sig, args):
                _asm(builder, ir.VoidType(), [], f"fence.acq_rel.{scope};", "", [])
                return context.get_dummy_value()
            return types.none(), codegen
        return fence

    def _pure(builder, ret, argtys, text, constraints, args):
        """Inline PTX without side effects: arithmetic the compiler may schedule freely."""
        return builder.call(ir.InlineAsm(ir.FunctionType(ret, argtys), text, constraints,
                                         side_effect=False), args)

    def _make_packed(text, arg_ty, reg):
        """A two-operand packed-bf16 instruction ``text`` on two ``arg_ty`` values -> uint32."""
        @intrinsic
        def op(typingctx, x, y):
            def codegen(context, builder, sig, args):
                a, b = (context.cast(builder, v, t, arg_ty) for v, t in zip(args, sig.args))
                return _pure(builder, ir.IntType(32), [a.type, b.type], text, f"=r,{reg},{reg}",
                             [a, b])
            return types.uint32(x, y), codegen
        return op

    #: pack_bf16x2(hi, lo): two float32 -> uint32 of two bf16 (``hi`` in the upper half), each
    #: rounded to nearest even. add_bf16x2(a, b): lane-wise sum of two uint32s of two bf16 each,
    #: the exact sum rounded once to nearest even, as ``a * 1.0 + b`` (``fma.rn.bf16x2``: sm_80
    #: and later; ``add.bf16x2`` would need sm_90 and the SIMT kernel serves older GPUs).
    pack_bf16x2 = _make_packed("cvt.rn.bf16x2.f32 $0, $1, $2;", types.float32, "f")
    add_bf16x2 = _make_packed("{ .reg .b32 one; mov.b32 one, 0x3F803F80; "
                              "fma.rn.bf16x2 $0, $1, one, $2; }", types.uint32, "r")

    ld_acquire, ld_acquire_sys = _make_load("gpu"), _make_load("sys")
    st_release, st_release_sys = _make_store("gpu"), _make_store("sys")
    st_relaxed = _make_store("gpu", "relaxed")
    atomic_add_release, atomic_add_release_sys = _make_add("release", "gpu"), _make_add("release", "sys")
    atomic_add_relaxed = _make_add("relaxed", "gpu")
    fence_gpu, fence_sys = _make_fence("gpu"), _make_fence("sys")

    @intrinsic
    def fence_proxy_async(typingctx):
        """Order this thread's view of global memory (generic proxy: plain and acquire loads,
        other threads' and GPUs' stores it has acquired) before the bulk tensor copies (TMA,
        the async proxy) it issues next. A flag acquired, then data read by TMA, needs it in
        between: the acquire alone orders generic-proxy accesses only."""
        def codegen(context, builder, sig, args):
            _asm(builder, ir.VoidType(), [], "fence.proxy.async.global;", "", [])
            return context.get_dummy_value()
        return types.none(), codegen

    @intrinsic
    def bar_sync(typingctx, barrier, threads):
        """Named barrier ``barrier`` (1-15; 0 is syncthreads') for ``threads`` threads (whole
        warps): a group of a block's warps meets without the others, e.g. the sm_90a
        attention tile's consumer warpgroups apart from its producer warpgroup."""
        def codegen(context, builder, sig, args):
            i32 = ir.IntType(32)
            b, t = (context.cast(builder, v, ty, types.int32) for v, ty in zip(args, sig.args))
            _asm(builder, ir.VoidType(), [i32, i32], "bar.sync $0, $1;", "r,r", [b, t])
            return context.get_dummy_value()
        return types.none(barrier, threads), codegen

    @intrinsic
    def nanosleep(typingctx, ns):
        """Suspend the calling thread for about ``ns`` nanoseconds (0..1e6)."""
        def codegen(context, builder, sig, args):
            v = context.cast(builder, args[0], sig.args[0], types.uint32)
            _asm(builder, ir.VoidType(), [v.type], "nanosleep.u32 $0;", "r", [v])
            return context.get_dummy_value()
        return types.none(ns), codegen

    @intrinsic
    def prefetch_l1(typingctx, arr, idx):
        """Start bringing ``arr[idx]``'s line into this SM's L1 (no value, no ordering): a
        plain load of it later, after other work, then finds it there instead of waiting for
        an L2 round trip."""
        _elem(arr)

        def codegen(context, builder, sig, args):
            ptr = _elem_ptr(context, builder, sig.args[0], args[0], args[1], sig.args[1])
            _asm(builder, ir.VoidType(), [ptr.type], "prefetch.global.L1 [$0];", "l", [ptr])
            return context.get_dummy_value()
        return types.none(arr, idx), codegen

    @intrinsic
    def globaltimer(typingctx):
        """Nanoseconds from the GPU's global timer (coarse ticks, monotonic)."""
        def codegen(context, builder, sig, args):
            return _asm(builder, ir.IntType(64), [], "mov.u64 $0, %globaltimer;", "=l", [])
        return types.uint64(), codegen

    @intrinsic
    def peer_view(typingctx, ptrs, peer, template):
        """``template``'s shape and dtype over the address ``ptrs[peer]``: a peer's symmetric buffer."""
        if not isinstance(template, types.Array):
            raise TypingError("peer_view: template must be an array")

        def codegen(context, builder, sig, args):
            ptrs_ty, peer_ty, tmpl_ty = sig.args
            addr = builder.load(_elem_ptr(context, builder, ptrs_ty, args[0], args[1], peer_ty))
            tmpl = context.make_array(tmpl_ty)(context, builder, args[2])
            out = context.make_array(sig.return_type)(context, builder)
            out.meminfo = cgutils.get_null_value(out.meminfo.type)
            out.parent = cgutils.get_null_value(out.parent.type)
            out.nitems = tmpl.nitems
            out.itemsize = tmpl.itemsize
            out.data = builder.inttoptr(addr, out.data.type)
            out.shape = tmpl.shape
            out.strides = tmpl.strides
            return out._getvalue()
        return template.copy(readonly=False)(ptrs, peer, template), codegen

    @intrinsic
    def udiv32(typingctx, a, b):
        """``a // b`` for integers in [0, 2**32) as a 32-bit divide (int64 result). A 64-bit
        divide by a run-time value is a subroutine call in SASS, and any call in a kernel makes
        ptxas serialize every wgmma in it: kernels that run the Hopper tiles divide with this."""
        def codegen(context, builder, sig, args):
            i32 = ir.IntType(32)
            q = builder.udiv(builder.trunc(args[0], i32), builder.trunc(args[1], i32))
            return builder.zext(q, ir.IntType(64))
        return types.int64(a, b), codegen

    @intrinsic
    def data_ptr(typingctx, arr):
        """The address of ``arr``'s first element, as uint64 (to hand to linked helpers)."""
        def codegen(context, builder, sig, args):
            ary = context.make_array(sig.args[0])(context, builder, args[0])
            return builder.ptrtoint(ary.data, ir.IntType(64))
        return types.uint64(arr), codegen

else:  # ---- simulator twins: same names, same meaning, plain Python -------------------------
    _lock = threading.Lock()   # atomics are atomic within one process only (docs/design.md §4)
    _sim_arrays = {}           # token -> array: what a simulated peer pointer refers to

    def sim_register(token, array):
        """Make ``peer_view`` resolve the simulated address ``token`` to ``array``."""
        _sim_arrays[int(token)] = array

    def sim_unregister(token):
        _sim_arrays.pop(int(token), None)

    def ld_acquire(arr, idx):
        return arr[idx]

    ld_acquire_sys = ld_acquire

    def st_release(arr, idx, val):
        arr[idx] = val

    st_release_sys = st_relaxed = st_release

    def atomic_add_release(arr, idx, val):
        with _lock:
            old = arr[idx]
            bits = 8 * np.dtype(arr.dtype).itemsize    # wraps like the GPU's unsigned add
            arr[idx] = (int(old) + int(val)) & ((1 << bits) - 1)
        return old

    atomic_add_release_sys = atomic_add_relaxed = atomic_add_release

    def fence_gpu():
        pass

    fence_sys = fence_proxy_async = fence_gpu    # the simulator has no async proxy

    def bar_sync(barrier, threads):
        # the simulator has no named barriers; its builds call this only where every thread
        # of the block does
        cuda.syncthreads()

    def nanosleep(ns):
        time.sleep(max(int(ns), 1000) * 1e-9)  # yields the GIL to the other simulated threads

    def globaltimer():
        return time.monotonic_ns()

    def prefetch_l1(arr, idx):
        pass     # the simulator has no caches

    def peer_view(ptrs, peer, template):
        arr = _sim_arrays[int(ptrs[peer])]
        if arr.shape != tuple(template.shape) or arr.dtype != template.dtype:
            arr = arr.view(template.dtype).reshape(template.shape)   # as on the GPU
        return arr

    def data_ptr(arr):
        raise NotImplementedError("data_ptr has no meaning in the simulator")

    def udiv32(a, b):
        return (int(a) & 0xFFFFFFFF) // (int(b) & 0xFFFFFFFF)

    def pack_bf16x2(hi, lo):
        from .roles.compute import f32_to_bf16    # (roles import this module: load it late)
        return np.uint32((int(f32_to_bf16(hi)) << 16) | int(f32_to_bf16(lo)))

    def add_bf16x2(a, b):
        from .roles.compute import bf16_to_f32, f32_to_bf16
        a, b = int(a), int(b)
        hi = float(bf16_to_f32(a >> 16)) + float(bf16_to_f32(b >> 16))   # exact in float64
        lo = float(bf16_to_f32(a)) + float(bf16_to_f32(b))
        return np.uint32((int(f32_to_bf16(hi)) << 16) | int(f32_to_bf16(lo)))


@cuda.jit(device=True, inline=True)
def umod32(a, b):
    """``a % b`` for integers in [0, 2**32), through :func:`udiv32`."""
    return a - udiv32(a, b) * b


@cuda.jit(device=True, inline=True)
def steps(start, stop, step):
    """How many values ``range(start, stop, step)`` has (step > 0, values below 2**31): loop
    as ``for j in range(steps(a, b, s)): i = a + j * s``, since range() with a run-time step
    divides in 64 bits (see :func:`udiv32`)."""
    return udiv32(max(stop - start + step - 1, 0), step)


@cuda.jit(device=True, inline=True)
def udiv64_small(n, d):
    """``n // d`` for a uint64 n and 0 < d < 2**16, in 32-bit divides (:func:`udiv32`):
    long division in base 2**16, each step's dividend below d * 2**16."""
    q = np.uint64(0)
    r = np.uint64(0)
    for shift in (48, 32, 16, 0):
        cur = (r << np.uint64(16)) | ((n >> np.uint64(shift)) & np.uint64(0xFFFF))
        qd = np.uint64(udiv32(cur, d))
        r = cur - qd * np.uint64(d)
        q = (q << np.uint64(16)) | qd
    return q


@cuda.jit(device=True, inline=True)
def peer_after(me, j, members):
    """The GPU ``j`` places after ``me`` among ``members`` local GPUs, wrapping round (no
    modulo: ``0 <= j <= members``). Starting every GPU's walk at its own next peer spreads
    the NVLink traffic of one moment over different links."""
    p = me + j
    return p - members if p >= members else p


def epoch_of_host(call):
    """The epoch of call number ``call`` (1, 2, ...): 1, 2, ..., 2**32 - 1, then 1 again;
    never 0, which is what fresh flags hold (0 for "no call yet"). The one wrap rule of every
    op (device: :func:`epoch_of`)."""
    return (int(call) - 1) % 0xFFFFFFFF + 1 if call else 0


def next_epoch_host(epoch):
    """The epoch after ``epoch`` under :func:`epoch_of_host`."""
    return 1 if int(epoch) >= 0xFFFFFFFF else int(epoch) + 1


@cuda.jit(device=True, inline=True)
def epoch_of(call):
    """:func:`epoch_of_host` on the device: ``call`` int64 >= 1 -> uint32."""
    return np.uint32((np.int64(call) - 1) % 0xFFFFFFFF + 1)


@cuda.jit(device=True, inline=True)
def epoch_reached(value, epoch):
    """True when a flag ``value`` has reached ``epoch``, modulo 2**32 (epochs wrap)."""
    return ((np.int64(value) - np.int64(epoch)) & 0xFFFFFFFF) < 0x80000000


@cuda.jit(device=True, inline=True)
def record_error(err, rank, role, flag_idx, expected, seen, block, kind):
    """Write the error record once (first writer wins): the fields as ``errors`` names them
    for ``kind``; the host turns it into an exception (``errors.raise_if_timed_out``)."""
    if cuda.atomic.cas(err, ERR_SET, 0, 1) == 0:
        err[ERR_RANK] = rank
        err[ERR_ROLE] = role
        err[ERR_FLAG] = flag_idx
        err[ERR_EXPECTED] = expected
        err[ERR_SEEN] = seen
        err[ERR_BLOCK] = block
        err[ERR_KIND] = kind
        fence_sys()


@cuda.jit(device=True)
def record_timeout(err, rank, role, flag_idx, expected, seen):
    """:func:`record_error` of a wait that expired; the host turns it into MkTimeoutError."""
    record_error(err, rank, role, flag_idx, expected, seen, cuda.blockIdx.x, KIND_TIMEOUT)


@cuda.jit(device=True, inline=True)
def acquire(flags, idx, system):
    """Acquire-load ``flags[idx]`` at system scope (written by a peer GPU, the host or a copy
    engine) or GPU scope (written by another block of this GPU: cheaper)."""
    return ld_acquire_sys(flags, idx) if system else ld_acquire(flags, idx)


@cuda.jit(device=True, inline=True)
def release(flags, idx, value, system):
    """Fence, then release-store ``flags[idx] = value`` at system or GPU scope (as ``acquire``).

    A system-scope fence waits until this thread's (and, after a barrier, its block's) writes
    are visible to other GPUs and the host: microseconds when writes are in flight, so flags
    only this GPU reads take GPU scope. A later system-scope release (the send role's ring
    commit) still covers writes ordered before a GPU-scope one: release is cumulative.
    """
    if system:
        fence_sys()
        st_release_sys(flags, idx, value)
    else:
        fence_gpu()
        st_release(flags, idx, value)


@cuda.jit(device=True, inline=True)
def record(flags, idx, value, system):
    """``flags[idx] = value`` with no fence (``release``'s signature): a flag that nothing
    reads before the kernel ends (the host reads it after), so no fence need wait for the
    writes before it, as ``release``'s does for microseconds when stores are in flight."""
    st_relaxed(flags, idx, value)


@cuda.jit(device=True)
def wait_flag(flags, idx, epoch, deadline, err, rank, role, max_pause_ns=100, system=True):
    """Spin until ``flags[idx]`` reaches ``epoch``; False (and an error record) past ``deadline``.

    flags: uint32 array written by a peer GPU, the proxy or another block (acquire at system
    scope, or GPU scope when ``system`` is False: see :func:`acquire`).
    deadline: a ``globaltimer()`` value. The caller returns on False so the kernel can finish.
    max_pause_ns: the pause between polls doubles from 100 ns up to this. Flags in host memory
    want a few µs: each poll is a PCIe read, and many threads polling slow the GPU's own fetch of
    stream work (measured: 256 threads polling made copy-engine commands ~10x slower).
    """
    pause = 100
    seen = acquire(flags, idx, system)
    while not epoch_reached(seen, epoch):
        if globaltimer() > deadline:
            record_timeout(err, rank, role, idx, epoch, seen)
            return False
        nanosleep(pause)
        if pause < max_pause_ns:
            pause = min(pause * 2, max_pause_ns)
        seen = acquire(flags, idx, system)
    return True
