"""Persistent GEMM on one GPU: ``mknumba.gemm(a, b)`` = a @ b, bf16 in and out, fp32 accumulation.

The kernel is the compute role on its own (``roles.compute.make_compute_role``, the same role
the fused kernels run): a persistent grid (``sched.plan_grid``) whose first ``compute_blocks``
blocks walk the output tiles in grouped raster order (``sched.grouped_order``), computing each
with the role's tile function and publishing each finished tile ``t = tile_m * tiles_n + tile_n``
with ``tile_flags[t] = epoch``. The blocks held back (``reserved_sms``) return at once here; in
the fused kernels they run the communication roles and consume those flags.

Tile implementations: ``"sm90"`` (TMA + wgmma, Hopper, 128 x 256 tiles), ``"sm90:pp"`` (opt-in:
the ping-pong schedule, 128 x 128 tiles, ``roles.compute.SM90_PINGPONG_TILE``) or ``"simt"`` (the
generic twin: the CUDA simulator and GPUs without sm_90a), each reading B as given: [n, k] (or a
``w.T`` view of one), or row-major [k, n] through its ``":kn"`` build
(``kernels.gemm_inputs``). Calls go through the launch frame (``kernels.launch``): planned once
per shape and layout of B, then an address bind and one driver launch.
"""
import threading

import numpy as np

from .. import _compat  # noqa: F401  (numpy alias before numba compiles anything)
from .._compat import SIMULATOR
from ..arrays import check_device, is_torch, new_output, operand, torch_ptr
from ..errors import MkError, MkValueError
from ..roles import compute
from ..roles.blocks import begin
from ..sched.tiles import cdiv, default_group_m, grouped_order, plan_grid
from .gemm_inputs import NoTensorMaps, TensorMaps, b_kn, b_mode, b_shape
from .launch import (Frame, Launch, Slot, StreamOrder, array_type, compile_kernel, is_capturing,
                     outputs_in_capture, stream_handle)
from numba import cuda, types

__all__ = ["gemm", "Gemm"]

Bits2D, Bits3D = array_type(np.uint16, 2), array_type(np.uint16, 3)
Words64, Flags, Ints = array_type(np.uint64, 1), array_type(np.uint32, 1), array_type(np.int32, 1)

# The simulator sizes dynamic shared arrays with dtype.itemsize, so it needs a dtype instance.
_BYTE = np.dtype(np.uint8) if SIMULATOR else np.uint8


def _make_kernel(build, threads):
    """The persistent kernel around one tile build (``roles.compute.TileBuild``)."""
    bounds = {} if SIMULATOR else {"launch_bounds": (threads, 1)}
    compute_role = compute.make_compute_role(build, compute.OWN_TILE)
    bn, n_dim = build.shape[1], 1 if build.b_kn else 0

    @cuda.jit(**bounds)
    def gemm_kernel(a: Bits2D, b: Bits2D, c: Bits2D, c_planes: Bits3D, tmaps: Words64,
                    tile_flags: Flags, frame: Words64, order: Ints, compute_blocks: types.int64):
        """a [m, k], b [n, k] (or [k, n] with a ":kn" tile build), c [m, n]: bf16 bits;
        c_planes: c as [1, m, n] (the tile's addend argument, which the plain GEMM never
        reads); tmaps: the tensor maps of a and b (sm90); tile_flags uint32[tiles] := epoch when done; frame: the op's call counter
        (``kernels.launch.Frame``); order int32[tiles] (sched.grouped_order)."""
        smem = cuda.shared.array(0, dtype=_BYTE)
        epoch, call = begin(frame)
        if cuda.blockIdx.x >= compute_blocks:
            return  # held back for other roles; nothing else runs in a plain GEMM
        compute_role(smem, tmaps, a, b, order, (b.shape[n_dim] + bn - 1) // bn, cuda.blockIdx.x,
                     compute_blocks, epoch, (c, tile_flags, False, c_planes))  # flags: this GPU

    return gemm_kernel


_KERNELS = {}   # tile build name -> the persistent kernel around it
_SIM_SMS = 4  # a small "device" for the simulator: 4 SMs, one block each


def _build(kind):
    """(roles.compute.TileBuild, persistent kernel) of a tile build name."""
    b = compute.tile_build(kind)
    if kind not in _KERNELS:
        _KERNELS[kind] = _make_kernel(b, b.threads)
    return b, _KERNELS[kind]


def check_shapes(m, n, k, op="mknumba.gemm"):
    if min(m, n, k) < 1:
        raise MkValueError(f"{op}: empty GEMM (m={m}, n={n}, k={k})")
    if k % 8 or n % 8:
        raise MkValueError(f"{op}: k={k} and n={n} must be multiples of 8: rows of A, B and C "
                           "must be 16-byte aligned for the bulk tensor copies; pad them (m may "
                           "be any size)")


def fused_tile(tile, op):
    """``(kind, TileBuild)`` a fused op runs for its ``tile=`` option: :func:`kind_for`, with
    "auto" on sm_90a the build whose own warp publishes tile flags
    (``roles.compute.SM90_FUSED_TILE``); a timing-only build, or one for mk.Gemm only (the
    ping-pong tile), is refused."""
    kind = kind_for(tile, op)
    if tile == "auto" and kind == "sm90":
        kind = compute.SM90_FUSED_TILE
    build = compute.tile_build(kind)
    if build.timing_only:
        raise MkValueError(f"{op}: tile build {tile!r} leaves the output unwritten "
                           "(timing only)")
    if build.gemm_only:
        raise MkValueError(f"{op}: tile build {tile!r} is for mknumba.Gemm only so far (not "
                           f"checked in the fused kernels); use 'auto', 'sm90' or "
                           f"{compute.SM90_FUSED_TILE!r}")
    return kind, build


def check_tile_name(tile):
    """Refuse (MkValueError) a ``tile=`` option that names no tile build: "auto", the
    library's builds (the sm_90a ones also in the simulator, which refuses them when they
    would run: :func:`kind_for`) or a registered one."""
    if tile != "auto" and not compute.is_sm90_name(tile):
        compute.tile_build(tile)   # "simt", another build of the tile (probes), or MkValueError


def kind_for(tile, op="mknumba.gemm"):
    """The tile build a ``tile=`` option picks on this machine (see :class:`Gemm`)."""
    check_tile_name(tile)
    if SIMULATOR:
        if tile not in ("auto", "simt"):
            raise MkValueError(f"{op}: the {tile} tile needs a Hopper GPU; the simulator runs "
                               "'simt'")
        return "simt"
    cc = tuple(cuda.get_current_device().compute_capability)
    if tile == "auto":
        return "sm90" if cc == (9, 0) else "simt"
    if compute.tile_build(tile).tma and cc != (9, 0):
        raise MkValueError(f"{op}: the {tile} tile needs compute capability 9.0, this GPU "
                           f"has {cc}")
    return tile


_drv = None


def current_device():
    """The CUDA ordinal of this thread's current context (None in the simulator)."""
    global _drv
    if SIMULATOR:
        return None
    if _drv is None:
        from cuda.bindings import driver as _drv
    err, dev = _drv.cuCtxGetDevice()
    return int(dev) if err == 0 else None


class Gemm:
    """C = A @ B on one GPU, with a per-tile completion flag other roles can wait on.

    ``Gemm(tile="auto", reserved_sms=0, group_m=None)``: each call is one persistent launch,
    planned once per shape and layout (compiled, tables built, arguments converted); a later
    call of that shape binds its arrays' addresses and launches. Plans are kept for the op's
    lifetime (a captured CUDA graph may refer to them); the first call of a shape must not be
    inside a capture. After a call, ``tile_flags(m, n, k, b_layout)[t] == epoch`` for every
    output tile ``t = tile_m * tiles_n + tile_n``.
    """

    name = "mknumba.gemm"

    def __init__(self, tile="auto", reserved_sms=0, group_m=None):
        check_tile_name(tile)
        self.tile, self.reserved_sms, self.group_m = tile, int(reserved_sms), group_m
        self.frame = None     # the call counter of the last GPU used
        self._frames = {}     # device -> (tile build, Frame): one counter per GPU
        self.streams = StreamOrder(self.name)
        self._plans = {}      # (m, n, k, b mode, device) -> _Plan
        self._hot = None      # (b_layout, plan, device, b's shape, b's strides): the hot path
        self._lock = threading.Lock()

    def __call__(self, a, b, b_layout="kn", out=None, stream=None):
        """a: [m, k] bf16; b: [k, n] (b_layout="kn", as in a @ b) or [n, k] ("nk", a @ b.T).

        Arrays: PyTorch tensors (result: a bf16 tensor, computed on the current torch stream)
        or numba/CuPy device arrays (result: a numba array of bf16 bits, uint16; on
        ``stream``). bf16 as ``torch.bfloat16``, ``ml_dtypes.bfloat16`` or its bits as
        uint16/int16.
        """
        hot = self._hot
        if hot is not None and out is not None and stream is None and b_layout == hot[0]:
            _, plan, dev, b_shape, b_strides = hot      # the last call's, with tensors
            pa = torch_ptr(a, (plan.m, plan.k), dev) if is_torch(a) else None
            pb = pa and torch_ptr(b, b_shape, dev, b_strides)
            pc = pb and torch_ptr(out, (plan.m, plan.n), dev)
            if pc and current_device() == dev:
                s = stream_handle(None, dev)
                with plan.launch.lock:
                    self.streams.enter(s)
                    plan.run(pa, pb, pc, s)
                return out
        return self._call(a, b, b_layout, out, stream)

    def _call(self, a, b, b_layout, out, stream):
        """A call with every check (the first of a shape, or anything but the hot path)."""
        if b_layout not in ("kn", "nk"):
            raise MkValueError(f"{self.name}: b_layout must be 'kn' (b is [k, n]) or 'nk' (b is "
                               f"[n, k]), got {b_layout!r}")
        A = operand(a, self.name, "a", ndim=2)
        if not A.torch and not SIMULATOR:      # a numba/CuPy array: the current GPU's
            check_device(A, self.name, current_device())
        B = operand(b, self.name, "b", ndim=2, layouts=("row", "col"), device_id=A.device)
        if A.torch != B.torch:
            raise MkValueError(f"{self.name}: a and b must both be PyTorch tensors or both be "
                               "device arrays")
        m, k = A.shape
        n = B.shape[1] if b_layout == "kn" else B.shape[0]
        kb = B.shape[0] if b_layout == "kn" else B.shape[1]
        if kb != k:
            raise MkValueError(f"{self.name}: inner dimensions differ: a is [{m}, {k}], b "
                               f"({b_layout}) gives k={kb}")
        check_shapes(m, n, k)
        mode = b_mode(B, b_layout, n, k, self.name)
        given = out is not None
        s = stream_handle(stream, A.device if A.torch else None)
        outputs_in_capture(self.name, s, out=out)
        if out is None:
            out = new_output(a, A.torch, (m, n))
        C = operand(out, self.name, "out", shape=(m, n), device_id=A.device)
        if A.torch != C.torch:
            raise MkValueError(f"{self.name}: out must be a PyTorch tensor exactly when the "
                               "inputs are")
        key = (m, n, k, mode, A.device)
        plan = self._plans.get(key)
        if plan is None:
            plan = self._plan(key, s)
        b_param = B.as_param(np.uint16, b_shape(mode, n, k))
        args = (A.as_param(np.uint16, (m, k)), b_param, C.as_param(np.uint16, (m, n)), s)
        with plan.launch.lock:
            self.streams.enter(s)
            if A.device is not None and A.device != current_device():
                with cuda.gpus[A.device]:
                    plan.run(*args)
            else:
                plan.run(*args)
        # the next call with tensors like these takes the hot path
        self._hot = ((b_layout, plan, A.device, tuple(B.shape), None if mode in ("kn", "nk")
                      else tuple(B.strides))
                     if A.torch and given and stream is None and A.dtype == "bfloat16" and
                     B.dtype == "bfloat16" and C.dtype == "bfloat16" else None)
        return out

    def _plan(self, key, stream):
        m, n, k, mode, device = key
        if device is not None and device != current_device():
            with cuda.gpus[device]:
                return self._plan(key, stream)
        if is_capturing(stream):
            raise MkError(f"{self.name}: the first call of shape {m} x {n} x {k} (b {mode}) "
                          "is inside a CUDA graph capture; call once before capturing (a new "
                          "shape plans, which allocates)")
        with self._lock:
            if key not in self._plans:
                self._plans[key] = _Plan(self, m, n, k, mode, device)
            self.frame = self._frames[device][1]
            return self._plans[key]

    def _counter(self, device, grid):
        """(tile build, Frame) of ``device``, made with the first plan there."""
        if device not in self._frames:
            self._frames[device] = (kind_for(self.tile), Frame(grid))
        return self._frames[device]

    def tile_flags(self, m, n, k, b_layout="kn"):
        """The tile flags of the plan for this shape (device uint32 array)."""
        for (pm, pn, pk, mode, _), plan in self._plans.items():
            if (pm, pn, pk) == (m, n, k) and (mode == "nk") == (b_layout == "nk"):
                return plan.tile_flags
        raise MkValueError(f"{self.name}: no call of shape {m} x {n} x {k} yet")

    def calls(self):
        """(calls, epoch) of the last call (reads the device counter: waits for it)."""
        return self.frame.read() if self.frame is not None else (0, 0)


class _Plan:
    """One shape and layout of B of a :class:`Gemm`: the compiled kernel, its order table and
    flags, the tensor maps, and the prepared :class:`~mknumba.kernels.launch.Launch`."""

    def __init__(self, op, m, n, k, mode, device):
        kind = kind_for(op.tile) if device not in op._frames else op._frames[device][0]
        self.b_kn = b_kn(mode)
        build, kernel = _build(compute.kn_kind(kind, op.name) if self.b_kn else kind)
        compiled, bps = compile_kernel(kernel, build.threads, build.smem_bytes)
        sms = _SIM_SMS if SIMULATOR else cuda.get_current_device().MULTIPROCESSOR_COUNT
        try:
            grid = plan_grid(sms, bps, op.reserved_sms)
        except ValueError as e:
            raise MkValueError(f"{op.name}: {e}") from None
        bm, bn = build.shape
        tiles_m, tiles_n = cdiv(m, bm), cdiv(n, bn)
        group_m = op.group_m or default_group_m(tiles_m, tiles_n, grid.compute_blocks)
        frame = op._counter(device, grid.grid)[1]
        self.m, self.n, self.k, self.mode = m, n, k, mode
        self.tile_flags = cuda.to_device(np.zeros(tiles_m * tiles_n, np.uint32))
        self.order = cuda.to_device(grouped_order(tiles_m, tiles_n, int(group_m)))
        self.tmaps = TensorMaps(m, n, k, build.shape) if build.tma else NoTensorMaps()
        self.launch = Launch(kernel, compiled, dict(
            a=Slot((m, k)), b=Slot(b_shape(mode, n, k)), c=Slot((m, n)), c_planes=Slot((1, m, n)),
            tmaps=Slot((TensorMaps.ROW,)), tile_flags=self.tile_flags, frame=frame.words,
            order=self.order, compute_blocks=grid.compute_blocks),
            grid.grid, build.threads, build.smem_bytes)

    def run(self, a, b, c, stream):
        """Bind the parameters (``Operand.as_param``: addresses on the GPU) of A, B as given
        and C, derive the tensor maps, and launch on ``stream``."""
        L = self.launch
        L.bind("a", a)
        L.bind("b", b)
        L.bind("c", c)
        L.bind("c_planes", c if not SIMULATOR else
               c.reshape((1, self.m, self.n)))
        L.bind("tmaps", self.tmaps(a, b, stream, self.b_kn))
        L(stream)


_default = {}


def gemm(a, b, b_layout="kn", out=None, stream=None, reserved_sms=0, tile="auto"):
    """C = a @ b (b_layout="kn", b is [k, n]) or a @ b.T (b_layout="nk", b is [n, k]).

    bf16 inputs and output, fp32 accumulation, one persistent launch. ``reserved_sms`` SMs are held
    back from the compute role. m may be any size; n and k must be multiples of 8. B is read as
    it is given, with no copy: [n, k], a column-major [k, n] view of one (like ``w.T``), or
    row-major [k, n].
    """
    key = (tile, int(reserved_sms))
    if key not in _default:
        _default[key] = Gemm(tile=tile, reserved_sms=reserved_sms)
    return _default[key](a, b, b_layout=b_layout, out=out, stream=stream)
