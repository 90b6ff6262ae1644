"""The host op: :class:`Gemm` plans each shape and layout of B once per GPU (:class:`_Plan`: the
kernel the rules of ``plan`` pick, its order table and flags, the tensor maps, the prepared
launch), and a call binds its arrays' addresses and launches; :func:`gemm` is the same as a
function.
"""
import threading

import numpy as np

from ..._compat import SIMULATOR
from ...arrays import (check_device, is_torch, new_output, operand, refuse_overlap, torch_ptr,
                       unshared)
from ...errors import (ERR_SET, ERR_WORDS, MkError, MkValueError, positive_ints,
                       raise_if_timed_out)
from ...roles import compute
from ...runtime import default_timeout_ns
from ...sched.tiles import cdiv, gemm_group_m, grouped_order, plan_grid
from ..gemm_inputs import NoTensorMaps, TensorMaps, b_kn, b_mode, b_shape
from ..launch import Launch, Slot, compile_kernel
from ..lifetime import Frame
from ..streams import StreamOrder, is_capturing, outputs_in_capture, stream_handle
from .kernel import _build
from .plan import (_fold_parts, _sim_safe, check_shapes, check_tile_name, kind_for, pp_auto_name,
                   pp_for, pp_shape_for, shared_bps, split_k_for, split_order, split_slices,
                   tail_split_for, tms_for)
from numba import cuda

_SIM_SMS = 4  # a small "device" for the simulator: 4 SMs, one block each


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

    ``Gemm(tile="auto", reserved_sms=0, group_m=None, split_k=None)``: each call is one
    persistent launch,
    planned once per shape and layout (compiled, tables built, arguments converted); a later
    call of that shape binds its arrays' addresses and launches. Plans are kept for the op's
    lifetime (a captured CUDA graph may refer to them); the first call of a shape must not be
    inside a capture. After a call, ``tile_flags(m, n, k, b_layout)[t] == epoch`` for every
    output tile ``t = tile_m * tiles_n + tile_n`` of the plan's build (128 x 256 tiles; where
    "auto" takes a ping-pong tile, its shape: :func:`pp_shape_for`). ``split_k``: slices of K
    per output tile (split-K: ``kernels.gemm.kernel``): None lets :func:`split_k_for` choose
    by shape, and where it does not split, :func:`tail_split_for` split the last round's tiles
    (the tail split); an int forces at most that many for every tile (1: no split, nor a tail
    split; fewer when K has fewer 64-deep steps). ``group_m``: the tiles' order in bands of
    that many tile rows (``sched.tiles``); None: :func:`~mknumba.sched.tiles.gemm_group_m`.

    ``tile``: "auto" runs, on a Hopper GPU (sm_90a), a ping-pong build where 128 x 256 tiles
    are few and K <= ``plan.PP_MAX_K``, or fill their rounds poorly and K <=
    ``plan.TMS_MAX_K`` (:func:`pp_for`; only with ``split_k`` None; ``"sm90:pp"`` or a smaller
    tile's, :func:`pp_shape_for`, in the variant of :func:`pp_auto_name`), the tensor-store
    build ``"sm90:tms"`` for other shapes it does not split (nor their tail) with K <=
    ``plan.TMS_MAX_K``, and the default ``"sm90"`` elsewhere (chosen per shape; the SIMT twin
    without sm_90a); or a build by name (``kernels.gemm``):
    ``"sm90"``, ``"sm90:pp"`` (and ``"sm90:pp:128x64"``, ``":64x128"``, ``":64x64"``; and
    their variants, e.g. ``"sm90:ppdr:128x64"``) and ``"sm90:tms"`` (these whole tiles only:
    ``split_k`` None or 1, no tail split), ``"simt"``.
    """

    name = "mknumba.gemm"

    def __init__(self, tile="auto", reserved_sms=0, group_m=None, split_k=None):
        check_tile_name(tile)
        group_m = positive_ints(self.name, group_m=group_m)["group_m"]
        if split_k is not None and (isinstance(split_k, bool) or not isinstance(
                split_k, (int, np.integer)) or split_k < 1):
            raise MkValueError(f"{self.name}: split_k must be None (chosen by shape) or an "
                               f"int >= 1 (1: no split), got {split_k!r}")
        if split_k is not None and split_k > 1 and compute.whole_tiles_only(tile):
            raise MkValueError(f"{self.name}: tile={tile!r} takes no split_k (it computes "
                               "whole tiles only); pass split_k=None or 1")
        self.tile, self.reserved_sms, self.group_m = tile, int(reserved_sms), group_m
        self.split_k = None if split_k is None else int(split_k)
        self.frame = None     # the call counter of the last GPU used
        self._frames = {}     # device -> (tile build, Frame, error record): one per GPU
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
        if stream is None and self._hot_call(a, b, b_layout, out):
            return out
        return self._call(a, b, b_layout, out, stream)

    def _hot_call(self, a, b, b_layout, out):
        """The hot path (a call on the current torch stream): launched (True) when ``out`` is
        given and the tensors are exactly what the last call with tensors had (its plan, B's
        layout, shape and strides, the GPU) and no split's fold timed out; else False, and the
        caller takes the checked path."""
        hot = self._hot
        if hot is None or out is None or b_layout != hot[0]:
            return False
        _, plan, dev, b_shape, b_strides = hot      # the last call's, with tensors
        pa = torch_ptr(a, (plan.m, plan.k), dev) if is_torch(a) else None
        pb = pa and torch_ptr(b, b_shape, dev, b_strides)
        pc = pb and torch_ptr(out, (plan.m, plan.n), dev)
        if not (pc and unshared(plan.unshared, (pc, pa, pb), plan.sizes, 1)
                and current_device() == dev and not (plan.slices > 1 and plan.err[ERR_SET])):
            return False
        s = stream_handle(None, dev)
        with plan.launch.lock:
            self.streams.enter(s)
            plan.run(pa, pb, pc, s)
        return True

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
        refuse_overlap(self.name, (C,), (A, B))
        key = (m, n, k, mode, A.device)
        plan = self._plans.get(key)
        if plan is None:
            plan = self._plan(key, s)
        raise_if_timed_out(plan.err, f"{self.name} (a split-K fold of an earlier call)")
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
        """(tile build, Frame, error record) of ``device``, made with the first plan there:
        the record (int64[ERR_WORDS], mapped) says which fold of a split timed out, if one
        did."""
        if device not in self._frames:
            self._frames[device] = (kind_for(self.tile), Frame(grid),
                                    cuda.mapped_array(ERR_WORDS, np.int64))
            self._frames[device][2][:] = 0
        if self._frames[device][1].grid != grid:     # shared_bps keeps them equal
            raise MkError(f"{self.name}: a plan of {grid} blocks on a call counter of "
                          f"{self._frames[device][1].grid}")
        return self._frames[device]

    def _start_at(self, calls):
        """Tests: as if ``calls`` calls had run on the last GPU used (its counter and every
        flag of its plans), e.g. just short of 2**32, to run the next calls across the wrap.
        Only between calls, after they finished."""
        dev = next(d for d, f in self._frames.items() if f[1] is self.frame)
        cuda.synchronize()
        self.frame.start_at(calls, [plan.flags for key, plan in self._plans.items()
                                    if key[4] == dev])

    def tile_flags(self, m, n, k, b_layout="kn"):
        """The tile flags of the plan for this shape (device uint32 array)."""
        return self._plan_of(m, n, k, b_layout).tile_flags

    def _plan_of(self, m, n, k, b_layout="kn"):
        """The plan a call of this shape and layout of B ("nk", or any [k, n] one) made."""
        for (pm, pn, pk, mode, _), plan in self._plans.items():
            if (pm, pn, pk) == (m, n, k) and (mode == "nk") == (b_layout == "nk"):
                return plan
        raise MkValueError(f"{self.name}: no call of shape {m} x {n} x {k} yet")

    def calls(self):
        """(calls, epoch) of the last call (reads the device counter: waits for it); raises
        MkTimeoutError if a split's fold timed out."""
        if self.frame is None:
            return (0, 0)
        got = self.frame.read()
        self._raise_if_timed_out(self.name)
        return got

    def _raise_if_timed_out(self, what):
        """MkTimeoutError (naming ``what``) if a split's fold timed out, on any GPU."""
        for _, _, err in self._frames.values():
            raise_if_timed_out(err, what)


def _device_sms():
    """SMs of the current GPU (the simulator's small device: ``_SIM_SMS``)."""
    return _SIM_SMS if SIMULATOR else cuda.get_current_device().MULTIPROCESSOR_COUNT


class _Plan:
    """One shape and layout of B of a :class:`Gemm`: the compiled kernel, its order table and
    flags, the tensor maps, and the prepared :class:`~mknumba.kernels.launch.Launch`."""

    def __init__(self, op, m, n, k, mode, device):
        kind = kind_for(op.tile) if device not in op._frames else op._frames[device][0]
        self.b_kn = b_kn(mode)
        base = kind = compute.kn_kind(kind, op.name) if self.b_kn else kind
        if op.tile == "auto" and op.split_k is None and \
                pp_for(kind, m, n, k, max(1, _device_sms() - op.reserved_sms)):
            # one block an SM, as the default tile; its tile shape by the tiles' count
            kind = pp_auto_name(pp_shape_for(m, n, max(1, _device_sms() - op.reserved_sms)))
            kind = compute.kn_kind(kind, op.name) if self.b_kn else kind
        elif op.tile == "auto" and tms_for(kind, k) and (op.split_k or 1) == 1:
            kind = compute.kn_kind(compute.SM90_TMS_TILE, op.name) if self.b_kn else \
                compute.SM90_TMS_TILE
        build, kernel = _build(kind)
        if build.gemm_only and (op.split_k or 1) > 1:
            raise MkValueError(f"{op.name}: tile={op.tile!r} takes no split_k (it computes "
                               "whole tiles only); pass split_k=None or 1")
        compiled, bps = compile_kernel(kernel, build.threads, build.smem_bytes)
        sms = _device_sms()
        # every plan of the op launches one grid (its call counter counts blocks); a split's
        # own kernel is checked against it below
        known = op._frames[device][1].grid if device in op._frames else None
        bps = shared_bps(known, sms, bps, op.name)
        try:
            grid = plan_grid(sms, bps, op.reserved_sms)
        except ValueError as e:
            raise MkValueError(f"{op.name}: {e}") from None
        bm, bn = build.shape
        tiles_m, tiles_n = cdiv(m, bm), cdiv(n, bn)
        tiles, blocks = tiles_m * tiles_n, grid.compute_blocks
        group_m = op.group_m or gemm_group_m(tiles_m, tiles_n, blocks)
        split = split_k_for(tiles, k, blocks) if op.split_k is None else op.split_k
        # the tail split where the rule leaves the shape unsplit, with a tile build that can
        # start its ring afresh and runs split units (not the whole-tile builds), and not
        # where "auto" takes the tensor-store tile: at K <= TMS_MAX_K its epilogue gains more
        # than a split tail's slices of at most 32 k-steps do (an H200: benchmarks/NOTES.md)
        self.tail, base_build = 0, compute.tile_build(base)
        if op.split_k is None and split == 1 and kind == base and \
                base_build.reinit is not None and not base_build.gemm_only:
            self.tail, split = tail_split_for(tiles, k, blocks)
            if SIMULATOR and not _sim_safe(self.tail, split_slices(k, split)[0], blocks):
                self.tail, split = 0, 1      # a fold would wait on a later simulated block
        if kind != base and build.shape == base_build.shape and split_slices(k, split)[0] > 1:
            # "auto" splits this shape (or its tail): the default tile (the tensor-store
            # tile's shape, so the same tiles), whose split kernel is compiled and checked
            # against the grid below (the ping-pong tiles, of other shapes, run whole: pp_for
            # takes them instead of a split)
            kind = base
            build, kernel = _build(kind)
        self.slices, self.kc = split_slices(k, split if build.fold is not None else 1)
        self.parts = (_fold_parts(self.tail or tiles, self.slices, blocks, bm)
                      if self.slices > 1 else 1)
        if SIMULATOR and not _sim_safe(self.tail or tiles, self.slices, blocks, self.parts):
            raise MkValueError(f"{op.name}: split_k={self.slices} with {tiles} tiles on "
                               f"{blocks} blocks: the simulator runs blocks one at a time, and "
                               "a fold would wait on a later block; take fewer slices, or "
                               "tiles a multiple of the blocks")
        if self.slices > 1:
            # the split kernel runs the same grid (the op's call counter counts its blocks), so
            # it must fit as many blocks per SM: a fold waits on blocks that must be running
            kernel = _build(kind, "tail" if self.tail else True)[1]
            compiled, split_bps = compile_kernel(kernel, build.threads, build.smem_bytes)
            if split_bps < bps and self.tail:      # the rule's choice: then no tail split
                self.tail, self.slices, self.kc, self.parts = 0, 1, k, 1
                kernel = _build(kind)[1]
                compiled, _ = compile_kernel(kernel, build.threads, build.smem_bytes)
            elif split_bps < bps:
                raise MkError(f"{op.name}: the split-K kernel fits {split_bps} blocks per SM, "
                              f"the GEMM's grid has {bps}; pass split_k=1")
        _, frame, self.err = op._counter(device, grid.grid)
        self.m, self.n, self.k, self.mode, self.tile_shape = m, n, k, mode, build.shape
        self.sizes = (2 * m * n, 2 * m * k, 2 * k * n)      # c, a, b (bf16): arrays.unshared
        self.unshared = set()
        self.kind = kind          # the tile build's name
        # flags start at the last call's epoch, which no later call's reaches (a fresh 0 would
        # read as reached past 2**31 calls: primitives.epoch_reached)
        self.flags = cuda.to_device(np.full((self.slices + 1) * tiles, frame.read()[1],
                                            np.uint32))
        self.tile_flags = self.flags[:tiles]     # the tiles' own; then the slices' (split_units)
        self.order = cuda.to_device(split_order(grouped_order(tiles_m, tiles_n, int(group_m)),
                                                self.slices, self.tail or None, self.parts))
        split = self.slices > 1
        # the workspace: plane 1 + j holds slice j's partials (plane 0, the addend's own
        # plane, is never read); one slice: C as [1, m, n] stands in, never read either
        self.ws = cuda.device_array((self.slices + 1, m, n), np.uint16) if split else None
        # a pair of maps per slice; the first sees all of K, as the unsplit maps do: the tail
        # split's whole tiles read through it
        self.tmaps = (TensorMaps(m, n, k, build.shape, slices=self.slices, kc=self.kc,
                                 c_map=build.c_map)
                      if build.tma else NoTensorMaps(TensorMaps.ROW * self.slices))
        words = self.tmaps.words
        self.launch = Launch(kernel, compiled, dict(
            a=Slot((m, k)), b=Slot(b_shape(mode, n, k)), c=Slot((m, n)),
            ws=self.ws if split else Slot((1, m, n)), tmaps=Slot((words,)),
            flags=self.flags, frame=frame.words, order=self.order, compute_blocks=blocks,
            tiles=tiles, slices=self.slices, kc=self.kc, parts=self.parts,
            timeout_ns=default_timeout_ns(), err=self.err),
            grid.grid, build.threads, build.smem_bytes)

    def run(self, a, b, c, stream):
        """Bind the parameters (``Operand.as_param``: addresses on the GPU) of A, B as given
        and C, derive the tensor maps (C's too for a build that stores through one), and
        launch on ``stream``."""
        maps = self.tmaps(a, b, stream, self.b_kn, c)
        if self.slices == 1:
            self.launch.binder("a", "b", "c", "ws", "tmaps")(
                stream, a, b, c, c if not SIMULATOR else c.reshape((1, self.m, self.n)), maps)
        else:
            self.launch.binder("a", "b", "c", "tmaps")(stream, a, b, c, maps)


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
