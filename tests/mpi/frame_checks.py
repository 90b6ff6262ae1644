"""Checks of the launch frame (``kernels.launch``), run under mpiexec:

    mpiexec -n N python -m mpi4py tests/mpi/frame_checks.py CHECK[,CHECK...] [key=value ...]

keys: m, n, k (the fused ops' shape: [m, k] @ [k, n] per rank; ReduceScatter needs m to be
ranks x whole tiles), gm, gn, gk (the plain Gemm's shape), ag (AllGather elements per rank,
float32), arrays=numba|torch (torch: GPU only), calls (graph replays), seed, fused=0 (leave
the fused ops out: a diagnosis aid). Inputs come from ``rand_bits(seed, rank, call, ...)``, so
every rank regenerates the others' inputs for its float64 reference without communicating.

Checks (each prints ``PASS <check> rank <r> ...`` on every rank; any failure exits non-zero):

  inplace    GemmReduceScatter and GemmAllReduce called 3 times on the same a and b, both
             updated in place with fresh data between calls (b row-major [k, n], then b a
             column-major view of a row-major [n, k]: ``bt.T`` for torch and the simulator;
             numba's own ``.T`` is a copy, see Arrays.col_view), with ``out=`` (one array,
             poisoned before each call) and without; AllGather with x updated in place. Each
             result against a float64 reference of the inputs as they were at that call: an op
             keeps no copy of an input.
  wrap       GemmReduceScatter, GemmAllReduce, AllGather: ``_start_at(2**32 - 3)``, then 6 calls
             back to back across the wrap of the call counter and the epoch (which skips 0),
             every result checked, then the device counter read back (``op.frame.read()``) and
             compared with ``primitives.next_epoch_host``. The plain Gemm likewise, through
             ``op.frame.set`` after a first call (its counter is made at the first call).
  alternate  a GemmReduceScatter, a GemmAllReduce and an AllGather on one comm, called in
             turn for 4 rounds back to back, each round in another graph launch mode (off,
             stable, always, stable: ``kernels.launch.set_graph_launch``), every result checked.
  free       a call after ``free()`` raises MkError; a second ``free()`` returns quietly
             (AllGatherGemm too; its other frame checks are in ``allgather_gemm_checks.py``).
  capture    inside a CUDA graph capture (every stream reads as captured: ``capturing``), a call
             of mk.Gemm, either fused op or AllGather that leaves out ``out=`` is refused
             (MkError naming the op, "capture" and "out="); nothing is launched.
  disagree   AllGather planned with other dtypes / shapes on the ranks (2.5 against 2 too),
             AllGatherGemm with another k, RingAttention with other send_blocks: MkValueError
             on every rank, naming the field and both values; AllGather with shape (2.5,) or
             dtype "bogus" on every rank: MkValueError.
  dtypes     every spelling of bf16 (ml_dtypes.bfloat16, uint16 and int16 bits; torch.bfloat16)
             into mknumba.gemm; float32 refused by gemm, the fused ops and AllGather, naming
             the op.
  overlap    an output laid over an input or another output is refused (gemm, both fused ops,
             AllGatherGemm, AllGather with x in another rank's row of out), naming both;
             AllGather with x = out[me] gathers in place; a fused op that refused a call
             refuses the next one (MkError).
  options    a negative or zero group_m (GemmReduceScatter, GemmAllReduce, AllGatherGemm,
             mk.Gemm), chunk_bytes (GemmReduceScatter; was clamped to a tile), compute_blocks,
             send_blocks or threads (RingAttention) is refused at plan time, naming the op and
             the option; so are a fractional or zero part_rows, comm_sms, collect_sms
             (AllGatherGemm), send_blocks (AllGather), unit_tokens and a negative capacity
             (MoeDispatchGemm), which were truncated or clamped; an AllGather input in the other byte order ('>f4') is refused at the
             call.
  closed     every fused op ended on every rank (``_end_calls``) and launched past the host's
             guard, as a graph's replay is: its kernel returns at once (output poisoned, no
             timeout), ``synchronize()`` says the op ended.
  finalized  ops planned on a second Comm, which is then finalized: every call refuses
             (MkError), free() is quiet, planning on it and its barrier refuse.
  refused    (2+ ranks) rank 0 refuses a call the others launch and retries at once: the
             retry is refused (MkError), the others time out instead of returning data
             (AllGather, GemmReduceScatter; waits bounded at 2 s); a launch past the host's
             guard (``op._call``, as a graph's replay is) then writes nothing on rank 0, and
             every rank's frame ends closed.
  planned    (2+ ranks) the ranks leave planning together: rank 1 compiles late (twice the
             2 s bound of the waits) and the first calls of AllGather and GemmReduceScatter,
             made at once, pair and are checked; rank 1's compile fails while planning each
             op: every other rank raises MkError naming rank 1 (no op left to wait for it).
GPU only (arrays=torch unless said):
  graph      torch.cuda.graph capture of mk.Gemm (every rank) and, with 2 or more ranks, of
             both fused ops: one capture, ``calls`` replays (default 100), each after fresh data
             is copied into the captured inputs and the captured output is poisoned, each
             checked; ordinary calls of the same op between replays (every 10th), checked; the
             call counter afterwards counts every launch and replay.
  cugraph    mk.gemm captured on a numba stream through cuda.bindings (cuStreamBeginCapture ...
             cuGraphLaunch), numba device arrays, ``calls`` launches with fresh data, ordinary
             calls between them.
  streams    each op called alternately on two torch streams, back to back: right results.
  wrongdev   (2 GPUs) an array on another GPU than the op's is refused with MkValueError.
  dropped    (arrays=numba) calls on numba streams dropped at once (destroyed): the next call
             on another stream, synchronize() and free() after them, every result checked.
  replayed   (2+ ranks; arrays=torch or numba) a CUDA graph of an AllGather's and a
             GemmReduceScatter's call, captured on every rank and replayed once (checked);
             then rank 0 refuses a call the others launch, and replays the graph: the replay
             writes nothing, and the others' call times out instead of pairing with it
             (waits bounded at 2 s). Torch: an AllGather called on another stream during its
             capture is refused on every rank, which ends it there: the graph's replay writes
             nothing.
"""
import contextlib
import math
import sys
import time
import warnings

import numpy as np

import mknumba as mk
from mknumba._compat import SIMULATOR
from mknumba.arrays import from_bf16_bits, operand, to_bf16_bits
from mknumba.kernels.launch import graph_launch, set_graph_launch
from mknumba.primitives import next_epoch_host
from numba import cuda

WRAP_START = 2 ** 32 - 3
NAN_BITS = 0x7FC0


# ---- data and references ------------------------------------------------------------------------
def rand_bits(opts, shape, *key):
    """Fresh random bf16 bits (uint16), the same on every rank for one key: any rank can
    regenerate any rank's inputs of any call for its reference."""
    rng = np.random.default_rng([opts["seed"], *key])
    return to_bf16_bits(rng.standard_normal(shape, dtype=np.float32))


def rand_f32(opts, shape, *key):
    rng = np.random.default_rng([opts["seed"], 7, *key])
    return rng.standard_normal(shape, dtype=np.float32)


def bits_f64(b):
    return from_bf16_bits(np.asarray(b).view(np.uint16)).astype(np.float64)


def matmul_sum(pairs):
    """float64 sum of a @ b over ``pairs`` of bf16 bits (on the GPU when torch is there)."""
    if not SIMULATOR and _torch() is not None:
        torch = _torch()
        acc = None
        for a, b in pairs:
            p = (torch.from_numpy(bits_f64(a)).cuda() @ torch.from_numpy(bits_f64(b)).cuda())
            acc = p if acc is None else acc + p
        return acc.cpu().numpy()
    return sum(bits_f64(a) @ bits_f64(b) for a, b in pairs)


def check_close(got_bits, ref, what):
    """Every element written (no NaN poison left) and relative Frobenius error <= 1e-2."""
    got = bits_f64(got_bits)
    assert got.shape == ref.shape, f"{what}: shape {got.shape}, expected {ref.shape}"
    bad = int(np.sum(~np.isfinite(got)))
    assert bad == 0, f"{what}: {bad} of {got.size} outputs unwritten (NaN)"
    err = float(np.linalg.norm(got - ref) / np.linalg.norm(ref))
    assert err <= 1e-2, f"{what}: relative error {err:.3g}"
    return err


_TORCH = []


def _torch():
    if not _TORCH:
        try:
            import torch
        except ImportError:
            torch = None
        _TORCH.append(torch)
    return _TORCH[0]


class Arrays:
    """Device arrays of one kind: "numba" (numba device arrays of bf16 bits; simulator arrays
    under the simulator) or "torch" (torch.bfloat16 / float32 CUDA tensors)."""

    def __init__(self, kind):
        self.kind = kind
        if kind == "torch":
            assert not SIMULATOR, "arrays=torch needs a GPU"
            self.torch = _torch()

    def _t(self, host):
        torch = self.torch
        if host.dtype == np.uint16:
            return torch.from_numpy(host.view(np.int16)).view(torch.bfloat16)
        return torch.from_numpy(host)

    def dev(self, host):
        """A new device array holding ``host`` (uint16: bf16 bits; or float32)."""
        host = np.ascontiguousarray(host)
        if self.kind == "torch":
            return self._t(host).cuda()
        return cuda.to_device(host)

    def put(self, d, host):
        """Overwrite device array ``d`` in place (same address) with ``host``."""
        host = np.ascontiguousarray(host)
        if self.kind == "torch":
            d.copy_(self._t(host))
        else:
            d.copy_to_device(host)

    def host(self, d):
        """A device array back on the host (bf16 as uint16 bits)."""
        if self.kind == "torch":
            torch = self.torch
            if d.dtype == torch.bfloat16:
                return d.view(torch.int16).cpu().numpy().view(np.uint16)
            return d.cpu().numpy()
        return np.asarray(d.copy_to_host())

    def col_view(self, d):
        """The [k, n] column-major view of a row-major [n, k] device array ``d``, no copy. (A
        numba device array's ``.T`` is a transposed copy, made by a kernel at that moment: an
        in-place update of ``d`` would not reach it. The simulator's and torch's are views.)"""
        if self.kind == "torch" or SIMULATOR:
            return d.T
        return cuda.as_cuda_array(_ColumnMajor(d))

    def poisoned(self, shape, dtype=np.uint16):
        """A new device array of NaN (bf16 bits 0x7FC0, or float32 NaN)."""
        return self.dev(_nan(shape, dtype))

    def poison(self, d):
        if self.kind == "torch":
            torch = self.torch
            if d.dtype == torch.bfloat16:
                d.view(torch.int16).fill_(NAN_BITS)
            else:
                d.fill_(float("nan"))
        else:
            d.copy_to_device(_nan(d.shape, np.dtype(d.dtype)))


class GraphCapture:
    """CUDA graphs of an op's calls (GPU), for arrays of ``A``'s kind: torch.cuda.graph (the
    calls run on PyTorch's current stream; ``kw`` is empty), or cuStreamBeginCapture on a numba
    stream (the calls pass ``**kw``: ``stream=`` that stream). ``warm(fn)``: ``fn``'s calls
    before any capture (torch: on a side stream, as torch.cuda.graph asks); ``capture(fn)``:
    a graph of what ``fn`` launches, returned as a function that replays it (numba: and waits
    for it; torch: on the current stream). Graphs live as long as this object."""

    def __init__(self, A):
        self.torch = A.torch if A.kind == "torch" else None
        self.graphs = []
        self.kw = {}
        if self.torch is None:
            from cuda.bindings import driver as drv
            from mknumba.kernels.streams import stream_handle
            self.drv, self.stream = drv, cuda.stream()
            self.handle = drv.CUstream(stream_handle(self.stream))
            self.kw = dict(stream=self.stream)

    def warm(self, fn):
        if self.torch is None:
            fn()
            self.stream.synchronize()
            return
        torch = self.torch
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            fn()
        torch.cuda.current_stream().wait_stream(side)

    def capture(self, fn):
        if self.torch is not None:
            self.graphs.append(self.torch.cuda.CUDAGraph())
            with self.torch.cuda.graph(self.graphs[-1]):
                fn()
            return self.graphs[-1].replay
        drv, h = self.drv, self.handle

        def ok(res, what):
            err = res[0]
            assert err == drv.CUresult.CUDA_SUCCESS, f"{what}: {err}"
            return res[1] if len(res) > 1 else None
        ok(drv.cuStreamBeginCapture(h, drv.CUstreamCaptureMode.CU_STREAM_CAPTURE_MODE_THREAD_LOCAL),
           "cuStreamBeginCapture")
        try:
            fn()
        finally:
            graph = ok(drv.cuStreamEndCapture(h), "cuStreamEndCapture")
        gexec = ok(drv.cuGraphInstantiate(graph, 0), "cuGraphInstantiate")
        self.graphs.append((graph, gexec))

        def replay():
            ok(drv.cuGraphLaunch(gexec, h), "cuGraphLaunch")
            self.stream.synchronize()
        return replay


class _ColumnMajor:
    """``__cuda_array_interface__`` of a row-major [n, k] device array read as [k, n]."""

    def __init__(self, d):
        cai = dict(d.__cuda_array_interface__)
        n, k = cai["shape"]
        item = np.dtype(cai["typestr"]).itemsize
        cai.update(shape=(k, n), strides=(item, k * item))
        self.__cuda_array_interface__ = cai
        self.base = d


def _nan(shape, dtype):
    if np.dtype(dtype) == np.uint16:
        return np.full(shape, NAN_BITS, np.uint16)
    return np.full(shape, np.nan, dtype)


def fused_ops(comm, opts, kinds=("rs", "ar")):
    """The fused GEMMs ``kinds`` ("rs", "ar") planned on ``comm`` (:func:`op_makers`)."""
    if not opts["fused"]:       # fused=0: the other ops' checks alone (diagnosis)
        return []
    make = op_makers(comm, opts)
    return [make[{"rs": "GemmReduceScatter", "ar": "GemmAllReduce"}[k]]() for k in kinds]


def fused_ref(comm, opts, op, key):
    """The expected output of ``op``'s call whose inputs on rank r were
    ``rand_bits(.., r, *key, 0/1)`` (a [m, k], b [k, n])."""
    m, n, k = opts["m"], opts["n"], opts["k"]
    pairs = [(rand_bits(opts, (m, k), r, *key, 0), rand_bits(opts, (k, n), r, *key, 1))
             for r in range(comm.size)]
    ref = matmul_sum(pairs)
    if not op.allreduce:
        rows = op.out_shape()[0]
        ref = ref[comm.rank * rows:(comm.rank + 1) * rows]
    return ref


def fused_inputs(comm, opts, key):
    m, n, k = opts["m"], opts["n"], opts["k"]
    return rand_bits(opts, (m, k), comm.rank, *key, 0), rand_bits(opts, (k, n), comm.rank, *key, 1)


def ag_ref(comm, opts, *key):
    """What an AllGather (scope "node") of ``rand_f32(.., r, *key)`` gives: the node's ranks'."""
    return np.stack([rand_f32(opts, (opts["ag"],), r, *key) for r in comm.topology.node_ranks])


def ag_out(comm, opts, A):
    return A.poisoned((comm.local_size, opts["ag"]), np.float32)


def same_bits(got, ref, what):
    assert got.shape == ref.shape, f"{what}: shape {got.shape}, expected {ref.shape}"
    assert np.array_equal(got.view(np.uint32), ref.view(np.uint32)), \
        f"{what}: gathered data differ from the inputs of that call"


def say(check, comm, what):
    print(f"PASS {check} rank {comm.rank} topology {comm.nodes}x{comm.local_size} {what}",
          flush=True)


def check_peer_never_calls(comm, make_op, call, words, bound_s):
    """The timeout check of an op on 2+ ranks: ``make_op()`` with every wait bounded by
    ``bound_s`` (as ``mk.init(timeout_s=...)``), then only rank 0 calls (``call(op)``): its
    wait for the others expires, and synchronize() raises MkTimeoutError within the bound
    (plus the simulator's slack) with ``words`` in its message; the next call refuses. Every
    rank frees the op."""
    saved, comm.timeout_ns = comm.timeout_ns, int(bound_s * 1e9)
    try:
        op = make_op()
    finally:
        comm.timeout_ns = saved
    if comm.rank == 0:                       # nobody else calls: their part never comes
        t0 = time.monotonic()
        call(op)
        try:
            op.synchronize()
        except mk.MkTimeoutError as e:
            took, msg = time.monotonic() - t0, str(e)
            slack = 60.0 if SIMULATOR else 2.0     # the simulator runs blocks one by one
            assert took <= bound_s + slack, f"raised after {took:.1f} s, bound {bound_s} s"
            for w in words:
                assert w in msg, f"{w!r} not in: {msg}"
        else:
            raise AssertionError("a call whose peers never called did not time out")
        try:                                 # the op stays poisoned: later calls refuse
            call(op)
        except mk.MkTimeoutError:
            pass
        else:
            raise AssertionError("a timed-out op accepted another call")
    comm.barrier()
    op.free()
    say("timeout", comm, f"bound={bound_s}s")


def run_checks(checks, defaults, strings=("arrays",)):
    """The main of an op's check program: ``argv[1]`` names checks of ``checks`` (comma
    list), ``key=value`` arguments override ``defaults`` (integers, except ``strings``); each
    check runs as ``check(comm, opts, Arrays(opts["arrays"]))`` on one Comm, timed."""
    names = sys.argv[1].split(",")
    opts = dict(defaults)
    for arg in sys.argv[2:]:
        key, value = arg.split("=", 1)
        assert key in opts, f"unknown option {key}"
        opts[key] = value if key in strings else int(value)
    for name in names:
        assert name in checks, f"unknown check {name}; one of {sorted(checks)}"
    with mk.init() as comm:
        if not SIMULATOR and opts["arrays"] == "torch":
            _torch().cuda.set_device(comm.device_id)
        A = Arrays(opts["arrays"])
        for name in names:
            t0 = time.perf_counter()
            checks[name](comm, opts, A)
            print(f"time {name} rank {comm.rank} {time.perf_counter() - t0:.1f}s", flush=True)
        comm.barrier()


# ---- inplace ------------------------------------------------------------------------------------
def check_inplace(comm, opts, A):
    """One a, one b, updated in place between calls; the result follows the update."""
    m, n, k = opts["m"], opts["n"], opts["k"]
    worst = 0.0
    for oi, op in enumerate(fused_ops(comm, opts)):
        rows = op.out_shape()[0]
        out = A.poisoned((rows, n))
        for layout in ("row", "col"):
            tag = (1, oi, 0 if layout == "row" else 1)
            a_bits, b_bits = fused_inputs(comm, opts, tag + (0,))
            da = A.dev(a_bits)
            if layout == "row":
                db = A.dev(b_bits)                      # row-major [k, n], read as it is
                b_arg = db
            else:
                db = A.dev(np.ascontiguousarray(b_bits.T))   # row-major [n, k] ...
                b_arg = A.col_view(db)                       # ... passed as its [k, n] view
                view, base = (operand(x, "test", "b", layouts=("row", "col"), align=0)
                              for x in (b_arg, db))
                assert view.col_major and view.ptr == base.ptr, "not a view of b's memory"
            for call in range(3):
                key = tag + (call,)
                if call:        # new values, same addresses
                    a_bits, b_bits = fused_inputs(comm, opts, key)
                    A.put(da, a_bits)
                    A.put(db, b_bits if layout == "row" else np.ascontiguousarray(b_bits.T))
                A.poison(out)
                if call != 1:
                    res = op(da, b_arg, out=out)
                    assert res is out, f"{op.name}: out= given, another array returned"
                else:
                    res = op(da, b_arg)
                what = f"{op.name} b {layout}-major call {call} ({'out=' if call != 1 else 'new'})"
                worst = max(worst, check_close(A.host(res), fused_ref(comm, opts, op, key), what))
        op.synchronize()
        op.free()
    # AllGather, x updated in place
    shape = (opts["ag"],)
    ag = mk.AllGather(comm, shape, "float32")
    x = A.dev(rand_f32(opts, shape, comm.rank, 2, 0))
    out = ag_out(comm, opts, A)
    for call in range(3):
        if call:
            A.put(x, rand_f32(opts, shape, comm.rank, 2, call))
        A.poison(out)
        res = ag(x, out=out) if call != 1 else ag(x)
        same_bits(A.host(res), ag_ref(comm, opts, 2, call), f"AllGather call {call}")
    ag.synchronize()
    ag.free()
    say("inplace", comm, f"m={m} n={n} k={k} arrays={A.kind} max_rel_err={worst:.2e}")


# ---- wrap -------------------------------------------------------------------------------------
def expected_after(start, calls):
    """(calls, epoch) after ``calls`` more calls from ``_start_at(start)``."""
    epoch = (start - 1) % 0xFFFFFFFF + 1
    for _ in range(calls):
        epoch = next_epoch_host(epoch)
    return (start + calls) & 0xFFFFFFFF, epoch


def check_wrap(comm, opts, A, calls=6):
    m, n, k = opts["m"], opts["n"], opts["k"]
    want = expected_after(WRAP_START, calls)
    assert want == (3, 4), want      # epochs 2**32-2, 2**32-1, 1, 2, 3, 4: never 0
    start_epoch = (WRAP_START - 1) % 0xFFFFFFFF + 1
    worst = 0.0
    for oi, op in enumerate(fused_ops(comm, opts)):
        comm.barrier()                 # no peer is still in a call that writes our flags
        op._start_at(WRAP_START)
        comm.barrier()                 # nobody's next call publishes before every rank is set
        assert op.frame.read() == (WRAP_START, start_epoch), op.frame.read()
        rows = op.out_shape()[0]
        outs = []
        for call in range(calls):      # back to back, fresh inputs, poisoned outputs
            a_bits, b_bits = fused_inputs(comm, opts, (2, oi, call))
            out = A.poisoned((rows, n))
            outs.append((op(A.dev(a_bits), A.dev(b_bits), out=out), call))
        op.synchronize()
        for out, call in outs:
            worst = max(worst, check_close(A.host(out), fused_ref(comm, opts, op, (2, oi, call)),
                                           f"{op.name} call {call} after _start_at(2**32-3)"))
        got = op.frame.read()
        assert got == want, f"{op.name}: frame (calls, epoch) = {got}, expected {want}"
        op.free()
    # AllGather
    shape = (opts["ag"],)
    ag = mk.AllGather(comm, shape, "float32")
    comm.barrier()
    ag._start_at(WRAP_START)
    comm.barrier()
    outs = []
    for call in range(calls):
        out = ag_out(comm, opts, A)
        outs.append(ag(A.dev(rand_f32(opts, shape, comm.rank, 3, call)), out=out))
    ag.synchronize()
    for call, out in enumerate(outs):
        same_bits(A.host(out), ag_ref(comm, opts, 3, call),
                  f"AllGather call {call} after _start_at(2**32-3)")
    got = ag.frame.read()
    assert got == want, f"AllGather: frame (calls, epoch) = {got}, expected {want}"
    flags = ag.flags.local.copy_to_host().reshape(comm.local_size, -1)
    peers = [p for p in range(comm.local_size) if p != comm.local_rank]
    assert (flags[peers] == want[1]).all(), f"AllGather: peers' flags {flags[peers]}, " \
                                            f"expected epoch {want[1]}"
    ag.free()
    # the plain Gemm: no _start_at (no flags anyone waits on), the frame set directly, after
    # a first call (which makes the counter on the caller's GPU)
    gm, gn, gk = opts["gm"], opts["gn"], opts["gk"]
    g = mk.Gemm()
    a_bits = rand_bits(opts, (gm, gk), comm.rank, 4, 99, 0)
    b_bits = rand_bits(opts, (gk, gn), comm.rank, 4, 99, 1)
    out = g(A.dev(a_bits), A.dev(b_bits), out=A.poisoned((gm, gn)))
    check_close(A.host(out), matmul_sum([(a_bits, b_bits)]), "mknumba.Gemm first call")
    assert g.calls() == (1, 1), g.calls()
    g.frame.set(WRAP_START, start_epoch)
    assert g.calls() == (WRAP_START, start_epoch), g.calls()
    outs = []
    for call in range(calls):
        a_bits = rand_bits(opts, (gm, gk), comm.rank, 4, call, 0)
        b_bits = rand_bits(opts, (gk, gn), comm.rank, 4, call, 1)
        outs.append((g(A.dev(a_bits), A.dev(b_bits), out=A.poisoned((gm, gn))), a_bits, b_bits))
    for call, (out, a_bits, b_bits) in enumerate(outs):
        worst = max(worst, check_close(A.host(out), matmul_sum([(a_bits, b_bits)]),
                                       f"mknumba.Gemm call {call} after frame.set"))
    assert g.calls() == want, f"Gemm: frame (calls, epoch) = {g.calls()}, expected {want}"
    flags = g.tile_flags(gm, gn, gk).copy_to_host()
    assert (flags == want[1]).all(), f"Gemm: tile flags {flags}, expected epoch {want[1]}"
    say("wrap", comm, f"m={m} n={n} k={k} arrays={A.kind} frame={want} "
                      f"max_rel_err={worst:.2e}")


# ---- alternate --------------------------------------------------------------------------------
def check_alternate(comm, opts, A, rounds=4):
    m, n, k = opts["m"], opts["n"], opts["k"]
    ops = fused_ops(comm, opts)
    shape = (opts["ag"],)
    ag = mk.AllGather(comm, shape, "float32")
    results = []
    mode = graph_launch()
    try:
        for r in range(rounds):            # back to back: no host synchronisation
            # each round in another graph launch mode: every op's graph node, left behind by
            # a round that launched the kernel itself, must be refreshed before it launches
            set_graph_launch(("off", "stable", "always", "stable")[r % 4])
            for oi, op in enumerate(ops):
                a_bits, b_bits = fused_inputs(comm, opts, (5, oi, r))
                out = A.poisoned((op.out_shape()[0], n))
                results.append((op, oi, r, op(A.dev(a_bits), A.dev(b_bits), out=out)))
            out = ag_out(comm, opts, A)
            results.append((ag, 2, r, ag(A.dev(rand_f32(opts, shape, comm.rank, 5, r)),
                                         out=out)))
    finally:
        set_graph_launch(mode)
    for op in ops + [ag]:
        op.synchronize()
    worst = 0.0
    for op, oi, r, out in results:
        if op is ag:
            same_bits(A.host(out), ag_ref(comm, opts, 5, r), f"AllGather round {r}")
        else:
            worst = max(worst, check_close(A.host(out), fused_ref(comm, opts, op, (5, oi, r)),
                                           f"{op.name} round {r}"))
    for op in ops + [ag]:
        assert op.frame.read() == (rounds, rounds), (op.name, op.frame.read())
        op.free()
    say("alternate", comm, f"m={m} n={n} k={k} arrays={A.kind} rounds={rounds} "
                           f"max_rel_err={worst:.2e}")


# ---- free -------------------------------------------------------------------------------------
def check_free(comm, opts, A):
    a, b = (A.dev(x) for x in fused_inputs(comm, opts, (6,)))
    for op in fused_ops(comm, opts):
        op.free()
        try:
            op(a, b)
        except mk.MkError as e:
            assert "free" in str(e) and op.name in str(e), str(e)
        else:
            raise AssertionError(f"{op.name}: a call after free() did not raise")
        assert op.frame.closed(), f"{op.name}: free() left the frame open (a replay would run)"
        op.free()       # a second free() returns quietly (GemmReduce.free)
    shape = (opts["ag"],)
    ag = mk.AllGather(comm, shape, "float32")
    x = A.dev(rand_f32(opts, shape, comm.rank, 6))
    ag(x)
    ag.free()           # waits for the call
    try:
        ag(x)
    except mk.MkError as e:
        assert "free" in str(e) and "AllGather" in str(e), str(e)
    else:
        raise AssertionError("AllGather: a call after free() did not raise")
    assert ag.frame.closed() and ag.frame.read()[0] == 1, ag.frame.read()   # a count kept
    ag.free()           # a second free() returns quietly, as every op's (OpLifetime.free)
    agg = mk.AllGatherGemm(comm, opts["m"], opts["n"], opts["k"])
    agg.free()
    try:
        agg(a, b)
    except mk.MkError as e:
        assert "free" in str(e) and "AllGatherGemm" in str(e), str(e)
    else:
        raise AssertionError("AllGatherGemm: a call after free() did not raise")
    agg.free()          # a second free() returns quietly, as GemmReduce's
    comm.barrier()
    say("free", comm, "GemmReduceScatter GemmAllReduce AllGather AllGatherGemm")


# ---- capture ----------------------------------------------------------------------------------
def check_capture(comm, opts, A):
    gm, gn, gk = opts["gm"], opts["gn"], opts["gk"]
    ga, gb = (A.dev(rand_bits(opts, shape, comm.rank, 7, i))
              for i, shape in enumerate(((gm, gk), (gk, gn))))
    a, b = (A.dev(x) for x in fused_inputs(comm, opts, (7,)))
    shape = (opts["ag"],)
    ag = mk.AllGather(comm, shape, "float32")
    x = A.dev(rand_f32(opts, shape, comm.rank, 7))
    gemm = mk.Gemm()
    gemm(ga, gb)            # planned: the capture's refusal is about out=, not the first call
    fused = fused_ops(comm, opts)
    with capturing():
        _refused(lambda: gemm(ga, gb), [gemm.name, "capture", "out="], mk.MkError)
        for op in fused:
            _refused(lambda: op(a, b), [op.name, "capture", "out="], mk.MkError)
        _refused(lambda: ag(x), ["AllGather", "capture", "out="], mk.MkError)
    for op in fused + [ag]:
        op.free()
    comm.barrier()
    say("capture", comm, " ".join([gemm.name] + [op.name for op in fused] + ["AllGather"]))


# ---- disagree ---------------------------------------------------------------------------------
def check_disagree(comm, opts, A):
    cases = [("dtype", dict(shape=(16,), dtype="float32" if comm.rank == 0 else "int32"),
              ["'float32'", "'int32'"]),
             ("shape", dict(shape=(16,) if comm.rank == 0 else (8, 2), dtype="float32"),
              ["(16,)", "(8, 2)"])]
    for field, kw, names in cases:
        try:
            op = mk.AllGather(comm, kw["shape"], kw["dtype"])
        except mk.MkValueError as e:
            msg = str(e)
            assert "AllGather" in msg and f"{field}:" in msg, msg
            for name in names:
                assert name in msg, f"{name} not in: {msg}"
        else:
            op.free()
            raise AssertionError(f"AllGather with another {field} per rank was accepted")
    k = opts["k"]
    try:                # the fused ops' caller's terms: AllGatherGemm's inner dimension
        op = mk.AllGatherGemm(comm, opts["m"], opts["n"], k if comm.rank == 0 else k + 8)
    except mk.MkValueError as e:
        msg = str(e)
        assert "AllGatherGemm" in msg and "k:" in msg, msg
        assert f"{k} here" in msg or f"{k} there" in msg, msg
        assert f"{k + 8} here" in msg or f"{k + 8} there" in msg, msg
    else:
        op.free()
        raise AssertionError("AllGatherGemm with another k per rank was accepted")
    # the caller's values, not what planning would make of them: 2.5 is not 2, and a dtype
    # NumPy does not know is refused on every rank after they agree on it
    _refused(lambda: mk.AllGather(comm, (2.5 if comm.rank == 0 else 2,), "float32"),
             ["AllGather", "shape:", "2.5"])
    _refused(lambda: mk.AllGather(comm, (2.5,), "float32"), ["AllGather", "integer", "2.5"])
    _refused(lambda: mk.AllGather(comm, (8,), "bogus"), ["AllGather", "'bogus'", "dtype"])
    _refused(lambda: mk.RingAttention(comm, 1, 8, 2, 1, 16, send_blocks=1 + (comm.rank > 0)),
             ["RingAttention", "send_blocks:"])
    from mknumba.kernels.gemm_rs import GemmReduceScatter
    m, n = opts["m"], opts["n"]
    # the tile order, which the network's final lists take to be every node's
    _refused(lambda: GemmReduceScatter(comm, m, n, k, group_m=1 + (comm.rank > 0)),
             ["GemmReduceScatter", "group_m:"])
    check_one_refuses(comm, opts)
    comm.barrier()      # every rank raised (nobody waits in a collective), and the comm works
    say("disagree", comm, "dtype shape AllGatherGemm:k AllGather:2.5,bogus "
        "RingAttention:send_blocks GemmReduceScatter:group_m one-refuses")


def check_one_refuses(comm, opts):
    """An option only the last rank gets wrong (none of them compared between ranks, or
    checked before the comparison) is refused on that rank, naming it, and on every other
    rank, naming that rank: none is left waiting in a collective of the op's planning."""
    from mknumba.kernels.gemm_ar import GemmAllReduce
    m, n, k, W = opts["m"], opts["n"], opts["k"], comm.size
    last = comm.rank == W - 1

    def bad(value, good=None):
        return value if last else good
    cases = [
        ("GemmAllReduce", "group_m",
         lambda: GemmAllReduce(comm, m, n, k, group_m=bad(-1))),
        ("AllGatherGemm", "comm_sms",
         lambda: mk.AllGatherGemm(comm, m, n, k, comm_sms=bad(1.5))),
        ("RingAttention", "threads",
         lambda: mk.RingAttention(comm, 1, 8, 2, 1, 16, threads=bad(1.5))),
        ("MoeDispatchGemm", "w_layout",
         lambda: mk.MoeDispatchGemm(comm, 32, 32, 2 * W, 2, 4, w_layout=bad("bogus", "ehf"))),
        ("AllGather", "threads",
         lambda: mk.AllGather(comm, (opts["ag"],), "float32", threads=bad(0)))]
    for name, option, make in cases:
        _refused(make, [name, option] if last else [name, f"rank {W - 1} ", "refused to plan"])


# ---- dtypes -----------------------------------------------------------------------------------
def check_dtypes(comm, opts, A):
    import ml_dtypes
    gm, gn, gk = opts["gm"], opts["gn"], opts["gk"]
    a_bits = rand_bits(opts, (gm, gk), comm.rank, 8, 0)
    b_bits = rand_bits(opts, (gk, gn), comm.rank, 8, 1)
    ref = matmul_sum([(a_bits, b_bits)])
    spellings = ["bfloat16", "uint16", "int16"] + (["torch"] if A.kind == "torch" else [])
    for spelling in spellings:
        if spelling == "torch":
            a, b = A.dev(a_bits), A.dev(b_bits)
        else:
            # a device array of bits, viewed as the spelling (numba cannot copy ml_dtypes
            # arrays from the host: no buffer protocol for them)
            dt = {"bfloat16": ml_dtypes.bfloat16, "uint16": np.uint16, "int16": np.int16}[spelling]
            a, b = (cuda.to_device(x).view(dt) for x in (a_bits, b_bits))
            assert np.dtype(a.dtype).name == spelling, a.dtype
        out = mk.gemm(a, b)
        got = A.host(out) if spelling == "torch" else np.asarray(out.copy_to_host())
        check_close(got.view(np.uint16), ref, f"mknumba.gemm with {spelling} inputs")
    f32 = from_bf16_bits(a_bits)
    fa = A.dev(f32) if A.kind == "torch" else cuda.to_device(f32)
    gb = A.dev(b_bits)
    _refused(lambda: mk.gemm(fa, gb), ["mknumba.gemm", "float32", "a"])
    _refused(lambda: mk.gemm(A.dev(a_bits), A.dev(from_bf16_bits(b_bits))),
             ["mknumba.gemm", "float32", "b"])
    if A.kind != "torch":
        f32_out = cuda.to_device(np.zeros((gm, gn), np.float32))
        _refused(lambda: mk.gemm(A.dev(a_bits), gb, out=f32_out),
                 ["mknumba.gemm", "float32", "out"])
    a_bits, b_bits = fused_inputs(comm, opts, (8,))
    fa = A.dev(from_bf16_bits(a_bits))
    for op in fused_ops(comm, opts):
        _refused(lambda: op(fa, A.dev(b_bits)), [op.name, "float32"])
        op.free()
    ag = mk.AllGather(comm, (opts["ag"],), "float32")
    _refused(lambda: ag(A.dev(np.zeros(opts["ag"], np.int32) if A.kind != "torch"
                              else np.zeros(opts["ag"], np.float64))), ["AllGather", "x"])
    ag.free()
    ag = mk.AllGather(comm, (opts["ag"],), ml_dtypes.bfloat16)     # x as bf16 or its bits
    x = rand_bits(opts, (opts["ag"],), comm.rank, 14)
    got = np.asarray(A.host(ag(A.dev(x)))).view(np.uint16)
    want = np.stack([rand_bits(opts, (opts["ag"],), r, 14) for r in comm.topology.node_ranks])
    assert np.array_equal(got, want), "AllGather of bf16 bits: gathered data differ"
    ag.free()
    say("dtypes", comm, " ".join(spellings) + " float32-refused AllGather:bf16-bits")


# ---- overlap ----------------------------------------------------------------------------------
def _shared_views(A, opts, key, *views):
    """Row-major bf16 views ``(offset, shape)`` (in elements) into one device buffer of fresh
    random bits: they share memory where their spans meet."""
    size = max(off + math.prod(shape) for off, shape in views)
    big = A.dev(rand_bits(opts, (size,), *key))
    return [big[off:off + math.prod(shape)].view(*shape) if A.kind == "torch" else
            big[off:off + math.prod(shape)].reshape(shape) for off, shape in views]


def check_overlap(comm, opts, A):
    """An output laid over an input (or another output) is refused on every rank, naming
    both; AllGather's x may be out[me]. A multi-rank op that refused a call refuses every
    later one (the others may have launched it)."""
    gm, gn, gk = opts["gm"], opts["gn"], opts["gk"]
    m, n, k = opts["m"], opts["n"], opts["k"]
    key = (comm.rank, 9)
    a, out = _shared_views(A, opts, key, (0, (gm, gk)), (gm * gk // 2, (gm, gn)))
    _refused(lambda: mk.gemm(a, A.dev(rand_bits(opts, (gk, gn), *key, 1)), out=out),
             ["mknumba.gemm", "out shares memory with a"])
    b, out = _shared_views(A, opts, key, (0, (gk, gn)), (8, (gm, gn)))
    _refused(lambda: mk.gemm(A.dev(rand_bits(opts, (gm, gk), *key, 2)), b, out=out),
             ["mknumba.gemm", "out shares memory with b"])
    for op in fused_ops(comm, opts):
        a, out = _shared_views(A, opts, key, (0, (m, k)), (16, op.out_shape()))
        b = A.dev(rand_bits(opts, (k, n), *key, 3))
        _refused(lambda: op(a, b, out=out), [op.name, "out shares memory with a"])
        a_bits, b_bits = fused_inputs(comm, opts, (10,))
        _refused(lambda: op(A.dev(a_bits), A.dev(b_bits)), [op.name, "refused here"],
                 mk.MkError)
        op.free()
    if opts["fused"] and comm.local_size > 1:
        check_shared_output_input(comm, opts, A)
    agg = mk.AllGatherGemm(comm, m, n, k)
    b, out = _shared_views(A, opts, key, (0, (k, n)), (k * n - 8, (m, n)))
    _refused(lambda: agg(A.dev(rand_bits(opts, (m // comm.size, k), *key, 4)), b, out=out),
             ["AllGatherGemm", "out shares memory with b"])
    agg.free()
    ag = mk.AllGather(comm, (opts["ag"],), "float32")
    out = ag_out(comm, opts, A)
    x = out[comm.local_rank]                  # in place
    A.put(x, rand_f32(opts, (opts["ag"],), comm.rank, 11))
    ag(x, out=out)
    same_bits(A.host(out), ag_ref(comm, opts, 11), "AllGather in place")
    if comm.local_size > 1:
        other = out[(comm.local_rank + 1) % comm.local_size]
        _refused(lambda: ag(other, out=out), ["AllGather", "out shares memory with x"])
    ag.free()
    comm.barrier()
    say("overlap", comm, "gemm fused AllGatherGemm AllGather(in place)")


def check_shared_output_input(comm, opts, A):
    """With delivery the owners write every GPU's shared output on every call (``direct``),
    whatever the call's ``out``: the last result fed back as the next call's ``a`` (a chained
    layer) would be overwritten by the peers while this GPU reads it. Refused, naming it."""
    from mknumba.kernels.gemm_ar import GemmAllReduce
    m, n, k = opts["m"], opts["n"], opts["k"]
    op = GemmAllReduce(comm, m, n, k, shared_out=True, deliver=True)
    assert op.direct, "shared_out with delivery on one node: the owners write it directly"
    a_bits, b_bits = fused_inputs(comm, opts, (15,))
    y = op(A.dev(a_bits), A.dev(b_bits))            # out=None: the shared output
    a = (y.view(-1)[:m * k].view(m, k) if A.kind == "torch" else
         y.reshape(m * n)[:m * k].reshape(m, k))    # the result's first elements as the next a
    out = A.dev(np.full((m, n), 0x7FC0, np.uint16))
    _refused(lambda: op(a, A.dev(b_bits), out=out),
             [op.name, "a shares memory with the shared output"])
    op.free()


# ---- options ----------------------------------------------------------------------------------
def check_options(comm, opts, A):
    """Counts and band heights that would plan a launch skipping its work (a negative group_m
    scheduled no tile: no output, no error; compute_blocks=-1 likewise) are refused when the op
    is planned, naming the op and the option; so is an array in the other byte order (its
    bytes would be read swapped), at the call."""
    m, n, k = opts["m"], opts["n"], opts["k"]
    from mknumba.kernels.gemm_ar import GemmAllReduce
    from mknumba.kernels.gemm_rs import GemmReduceScatter
    for make, name, key, value in [
            (lambda: GemmReduceScatter(comm, m, n, k, group_m=-1), "GemmReduceScatter",
             "group_m", -1),
            (lambda: GemmAllReduce(comm, m, n, k, group_m=0), "GemmAllReduce", "group_m", 0),
            (lambda: GemmReduceScatter(comm, m, n, k, chunk_bytes=-5), "GemmReduceScatter",
             "chunk_bytes", -5),
            (lambda: mk.AllGatherGemm(comm, m, n, k, group_m=-2), "AllGatherGemm", "group_m",
             -2),
            (lambda: mk.RingAttention(comm, 1, 8, 2, 1, 16, compute_blocks=-1),
             "RingAttention", "compute_blocks", -1),
            (lambda: mk.RingAttention(comm, 1, 8, 2, 1, 16, send_blocks=0), "RingAttention",
             "send_blocks", 0),
            (lambda: mk.RingAttention(comm, 1, 8, 2, 1, 16, threads=1.5), "RingAttention",
             "threads", 1.5),
            (lambda: mk.AllGatherGemm(comm, m, n, k, part_rows=2.5), "AllGatherGemm",
             "part_rows", 2.5),
            (lambda: mk.AllGatherGemm(comm, m, n, k, comm_sms=1.5), "AllGatherGemm",
             "comm_sms", 1.5),
            (lambda: mk.AllGatherGemm(comm, m, n, k, gathered=True, collect_sms=0),
             "AllGatherGemm", "collect_sms", 0),
            (lambda: mk.AllGather(comm, (opts["ag"],), "float32", send_blocks=0.5),
             "AllGather", "send_blocks", 0.5),
            (lambda: mk.MoeDispatchGemm(comm, 64, 64, 2 * comm.size, 1, 8, unit_tokens=1.5),
             "MoeDispatchGemm", "unit_tokens", 1.5),
            (lambda: mk.MoeDispatchGemm(comm, 64, 64, 2 * comm.size, 1, 8, capacity=-3),
             "MoeDispatchGemm", "capacity", -3),
            (lambda: mk.Gemm(group_m=-1), "mknumba.gemm", "group_m", -1)]:
        _refused(make, [name, f"{key} must be a positive integer, got {value}"])
    if A.kind != "torch":                  # (a torch tensor has no other byte order)
        ag = mk.AllGather(comm, (opts["ag"],), "float32")
        x = rand_f32(opts, (opts["ag"],), comm.rank, 15)
        try:
            big = A.dev(x.astype(">f4"))
        except (NotImplementedError, TypeError, ValueError):
            big = None                      # numba holds no such array: nothing to refuse
        if big is not None:
            _refused(lambda: ag(big), ["AllGather", "x", ">f4", "byte order"])
        ag.free()
    say("options", comm, "group_m chunk_bytes compute_blocks send_blocks threads part_rows "
        "comm_sms collect_sms unit_tokens capacity byte-order")


# ---- closed -----------------------------------------------------------------------------------
def op_makers(comm, opts):
    """{op name: a function that plans it on ``comm``}, for every op of several ranks (the
    fused GEMMs at the checks' m, n, k; small RingAttention and MoE shapes)."""
    from mknumba.kernels.gemm_ar import GemmAllReduce
    from mknumba.kernels.gemm_rs import GemmReduceScatter
    m, n, k, W = opts["m"], opts["n"], opts["k"], comm.size
    return {"AllGather": lambda: mk.AllGather(comm, (opts["ag"],), "float32"),
            "GemmReduceScatter": lambda: GemmReduceScatter(comm, m, n, k),
            "GemmAllReduce": lambda: GemmAllReduce(comm, m, n, k),
            "AllGatherGemm": lambda: mk.AllGatherGemm(comm, m, n, k),
            "RingAttention": lambda: mk.RingAttention(comm, 1, 8, 2, 1, 16),
            "MoeDispatchGemm": lambda: mk.MoeDispatchGemm(comm, 32, 32, 2 * W, 2, 4)}


def check_closed(comm, opts, A):
    """Every fused kernel returns at once on a closed call counter (``Frame.close``): on every
    rank each op is ended (``_end_calls``), then launched past the host's guard (its inner
    call, as a CUDA graph's replay launches): its output stays poisoned, no flag of the op
    moves on any rank and no wait times out; ``synchronize()`` says the op ended."""
    m, n, k, W = opts["m"], opts["n"], opts["k"], comm.size
    make = op_makers(comm, opts)
    a, b = (A.dev(x) for x in fused_inputs(comm, opts, (14,)))
    cases = [(op, lambda op, out: op._call(a, b, out, None), op.out_shape())
             for op in fused_ops(comm, opts)]
    ag = make["AllGather"]()
    x = A.dev(rand_f32(opts, (opts["ag"],), comm.rank, 14))
    cases.append((ag, lambda op, out: op._call(x, out, None), None))
    agg = make["AllGatherGemm"]()
    shard = A.dev(rand_bits(opts, (m // W, k), comm.rank, 14, 2))
    cases.append((agg, lambda op, out: op._call(shard, b, out, None, None), (m, n)))
    ring = make["RingAttention"]()
    q, kv = (A.dev(rand_bits(opts, shape, comm.rank, 14, i))
             for i, shape in ((3, (1, 8, 2, 16)), (4, (1, 8, 1, 16))))
    cases.append((ring, lambda op, out: op._call(q, kv, kv, out, None, None), (1, 8, 2, 16)))
    moe = make["MoeDispatchGemm"]()
    tokens = A.dev(rand_bits(opts, (4, 32), comm.rank, 14, 5))
    topk = A.dev(np.array([[0, 1], [1, 2], [2, 3], [3, 0]], np.int32) % (2 * W))
    w = A.dev(rand_bits(opts, (2, 32, 32), comm.rank, 14, 6))
    cases.append((moe, lambda op, out: op._call(tokens, topk, w, None, out, None, None),
                  (moe.capacity, moe.ffn)))
    for op, launch, shape in cases:
        op._end_calls("a check's end")
        assert op.frame.closed(), f"{op.name}: not closed"
        out = ag_out(comm, opts, A) if shape is None else A.poisoned(shape)
        launch(op, out)
        _refused(op.synchronize, [op.name, "ended on this rank", "launched nothing"],
                 mk.MkError)
        _all_nan(A, out, f"{op.name}: a launch on a closed frame wrote its output")
        assert op.frame.read()[0] == 1, (op.name, op.frame.read())    # the ticket it drew
        comm.barrier()                   # every rank's launch done: no flag was published
        for flags in op._epoch_flags:
            assert not np.asarray(flags.copy_to_host()).any(), \
                f"{op.name}: a launch on a closed frame published a flag"
        op.free()
    say("closed", comm, " ".join(op.name for op, _, _ in cases))


# ---- finalized --------------------------------------------------------------------------------
def check_finalized(comm, opts, A):
    """Every op of a Comm that was finalized refuses its calls (MkError, nothing launched on
    the freed buffers) and its frame is closed (a graph's replay launches nothing), its free()
    is quiet, and planning on that Comm or its barrier refuses too."""
    c2 = mk.init()
    m, n, k = opts["m"], opts["n"], opts["k"]
    ops = [(op, 2) for op in fused_ops(c2, opts)] + [   # (op, arguments of a call)
        (mk.AllGather(c2, (opts["ag"],), "float32"), 1), (mk.AllGatherGemm(c2, m, n, k), 2),
        (mk.RingAttention(c2, 1, 8, 2, 1, 16), 3),
        (mk.MoeDispatchGemm(c2, 32, 32, 2 * c2.size, 2, 4), 3)]
    c2.finalize()
    for op, args in ops:
        _refused(lambda: op(*[None] * args), [op.name, "after its Comm was finalized"],
                 mk.MkError)
        assert op.frame.closed(), f"{op.name}: the frame is open after finalize (a replay runs)"
        op.free()
    _refused(lambda: mk.AllGather(c2, (8,), "float32"), ["Comm was finalized"], mk.MkError)
    _refused(c2.barrier, ["Comm was finalized"], mk.MkError)
    comm.barrier()
    say("finalized", comm, " ".join(op.name for op, _ in ops))


# ---- refused ----------------------------------------------------------------------------------
def check_refused(comm, opts, A, bound_s=2.0):
    """Rank 0 refuses a call (bad dtype) that the other ranks launch, and retries at once
    with good inputs: the retry is refused too (MkError: the op no longer takes calls on
    rank 0), so it cannot pair with the others' launch of the refused call, which times out
    instead of returning data. Nor can a launch that skips the host's guard, as a CUDA graph
    captured earlier does when replayed (here the op's inner call, ``_call``): the op's
    frame is closed, and that launch writes nothing. Every later call refuses on every
    rank, and every rank's frame ends closed. AllGather, and GemmReduceScatter (work queues,
    double-buffered partials)."""
    ops = _paired_ops(comm, opts, "refused", bound_s)
    for op in ops:
        def good(key):
            return _paired_inputs(comm, opts, A, op, key)
        if comm.rank == 0:
            _refused(lambda: op(*_paired_inputs(comm, opts, A, op, 12, bad=True)), [op.name])
            _refused(lambda: op(*good(13)), [op.name, "refused here"], mk.MkError)
            out = (ag_out(comm, opts, A) if isinstance(op, mk.AllGather) else
                   A.poisoned(op.out_shape()))
            op._call(*good(13), out, None)       # launched past the guard, as a replay is
            _refused(op.synchronize, [op.name, "ended on this rank"], mk.MkError)
            _all_nan(A, out, f"{op.name}: a launch after the op ended wrote its output")
        else:
            op(*good(12))
            _refused(op.synchronize, [op.name, "timed out"], mk.MkTimeoutError)
            _refused(lambda: op(*good(13)), [op.name, "timed out"], mk.MkTimeoutError)
        assert op.frame.closed(), f"{op.name}: rank {comm.rank}'s frame is open after the end"
        comm.barrier()
        op.free()
    say("refused", comm, " ".join(op.name for op in ops))


def _paired_ops(comm, opts, check, bound_s, hook=None):
    """An AllGather and a GemmReduceScatter on 2+ ranks, every wait bounded at ``bound_s``
    (one rank: none, said). ``hook``: run by every compile of theirs (:func:`compiling`)."""
    if comm.size < 2:
        say(check, comm, "one rank: nothing to pair")
        return []
    return [_bounded(comm, bound_s, make, hook) for make in _paired_makers(comm, opts)]


def _paired_makers(comm, opts):
    make = op_makers(comm, opts)
    return [make["AllGather"]] + ([make["GemmReduceScatter"]] if opts["fused"] else [])


def _bounded(comm, bound_s, make, hook=None):
    """``make()`` with every wait of the op bounded at ``bound_s``, ``hook()`` in its compiles."""
    saved, comm.timeout_ns = comm.timeout_ns, int(bound_s * 1e9)
    try:
        with compiling(hook):
            return make()
    finally:
        comm.timeout_ns = saved


@contextlib.contextmanager
def compiling(hook):
    """Every op's kernel compile runs ``hook()`` first (None: nothing), through each op
    module's name for ``kernels.launch.compile_kernel``."""
    from mknumba.kernels import launch
    real = launch.compile_kernel
    if hook is None:
        yield
        return

    def hooked(*args, **kw):
        hook()
        return real(*args, **kw)
    users = [mod for name, mod in list(sys.modules.items())
             if name.startswith("mknumba.") and getattr(mod, "compile_kernel", None) is real]
    for mod in users:
        mod.compile_kernel = hooked
    try:
        yield
    finally:
        for mod in users:
            mod.compile_kernel = real


def check_planned(comm, opts, A, bound_s=2.0):
    """The ranks leave planning together (``OpLifetime._planning_ends``). Rank 1 compiles
    ``2 * bound_s`` late, and each op's first call, straight after planning with every wait
    bounded at ``bound_s``, still pairs (AllGather, GemmReduceScatter; checked). Then rank 1's
    compile raises while planning each of the six ops: rank 1 raises that error, every other
    rank an MkError naming the op, rank 1 and the error, instead of planning an op whose calls
    would wait for rank 1 (AllGather, of scope "node": where rank 1 is in the node)."""
    if comm.size < 2:
        say("planned", comm, "one rank: nothing to pair")
        return
    late = (lambda: time.sleep(2 * bound_s)) if comm.rank == 1 else None
    names = []
    for i, make in enumerate(_paired_makers(comm, opts)):
        op = _bounded(comm, bound_s, make, late)
        x = _paired_inputs(comm, opts, A, op, 40 + i)
        gather = isinstance(op, mk.AllGather)
        out = ag_out(comm, opts, A) if gather else A.poisoned(op.out_shape())
        op(*x, out=out)
        op.synchronize()
        if gather:
            assert np.array_equal(A.host(out), ag_ref(comm, opts, 40 + i)), "AllGather (late)"
        else:
            check_close(A.host(out), fused_ref(comm, opts, op, (40 + i,)), f"{op.name} (late)")
        names.append(op.name + "-late")
        op.free()

    def broken():
        raise RuntimeError("a compile that failed (the check's)")
    for name, make in op_makers(comm, opts).items():
        if name == "AllGather" and 1 not in comm.topology.node_ranks:
            _bounded(comm, bound_s, make).free()   # scope "node": rank 1 is not a member here
            names.append(name + "-apart")
            continue
        if comm.rank == 1:
            e = _refused(lambda: _bounded(comm, bound_s, make, broken), ["the check's"],
                         RuntimeError)
        else:
            e = _refused(lambda: _bounded(comm, bound_s, make, lambda: None),
                         [name, "rank 1", "failed to plan", "the check's"], mk.MkError)
        # the half-planned op lives on in the traceback, as where a caller logs the error:
        # the Comm's finalize at the end of the run must pass it by (not tend its call counter)
        _KEPT.append(e)
        names.append(name + "-failed")
    say("planned", comm, " ".join(names))


_KEPT = []       # errors kept to the end of the run (check_planned)


def _paired_inputs(comm, opts, A, op, key, bad=False):
    """The inputs of a call of one of :func:`_paired_ops` (``bad``: of a dtype it refuses)."""
    if isinstance(op, mk.AllGather):
        x = (np.zeros(opts["ag"], np.float64) if bad else
             rand_f32(opts, (opts["ag"],), comm.rank, key))
        return (A.dev(x),)
    a, b = fused_inputs(comm, opts, (key,))
    return A.dev(from_bf16_bits(a) if bad else a), A.dev(b)


def _refused(fn, words, error=mk.MkValueError):
    """The error ``fn()`` raised, of type ``error`` and naming every one of ``words``."""
    try:
        fn()
    except error as e:
        for w in words:
            assert w in str(e), f"{w!r} not in: {e}"
        return e
    else:
        raise AssertionError(f"not refused (expected {error.__name__} naming {words})")


@contextlib.contextmanager
def capturing():
    """Every stream reads as being captured into a CUDA graph (``streams.is_capturing``, as
    every mknumba module imported it), so that what an op refuses inside a capture can be
    checked in the simulator, which has no graphs. Only for calls refused before a launch."""
    from mknumba.kernels import streams
    real = streams.is_capturing
    mods = [m for m in list(sys.modules.values()) if getattr(m, "__name__", "").startswith(
        "mknumba") and getattr(m, "is_capturing", None) is real]
    for m in mods:
        m.is_capturing = lambda stream: True
    try:
        yield
    finally:
        for m in mods:
            m.is_capturing = real


# ---- GPU: CUDA graphs, streams, devices -------------------------------------------------------
def gemm_and_fused_cases(comm, opts):
    """(name, op, a shape, b shape, out shape, reference of a call key) for a Gemm and, on
    several ranks, both fused ops."""
    gm, gn, gk = opts["gm"], opts["gn"], opts["gk"]
    m, n, k = opts["m"], opts["n"], opts["k"]
    cases = [("gemm", mk.Gemm(), (gm, gk), (gk, gn), (gm, gn), lambda key: matmul_sum(
        [(rand_bits(opts, (gm, gk), comm.rank, *key, 0),
          rand_bits(opts, (gk, gn), comm.rank, *key, 1))]))]
    for op in (fused_ops(comm, opts) if comm.size > 1 else []):
        cases.append((op.name, op, (m, k), (k, n), op.out_shape(),
                      lambda key, op=op: fused_ref(comm, opts, op, key)))
    return cases


def check_graph(comm, opts, A):
    """torch.cuda.graph: one capture, many replays with new data in the captured inputs."""
    torch = _torch()
    replays = opts["calls"]
    cases = gemm_and_fused_cases(comm, opts)
    worst = 0.0
    for ci, (name, op, ashape, bshape, oshape, ref_of) in enumerate(cases):
        def inputs(key):
            return (rand_bits(opts, ashape, comm.rank, *key, 0),
                    rand_bits(opts, bshape, comm.rank, *key, 1))
        a_bits, b_bits = inputs((9, ci, 0))
        a, b = A.dev(a_bits), A.dev(b_bits)          # the captured (static) inputs
        out = A.poisoned(oshape)
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):                # warm-up: plan, compile, first call
            op(a, b, out=out)
        torch.cuda.current_stream().wait_stream(side)
        worst = max(worst, check_close(A.host(out), ref_of((9, ci, 0)), f"{name} warm-up"))
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            op(a, b, out=out)
        launches = 1
        for i in range(1, replays + 1):
            key = (9, ci, i)
            a_bits, b_bits = inputs(key)
            A.put(a, a_bits)
            A.put(b, b_bits)
            A.poison(out)
            graph.replay()
            launches += 1
            worst = max(worst, check_close(A.host(out), ref_of(key), f"{name} replay {i}"))
            if i % 10 == 0:          # an ordinary call between replays, other arrays
                key = (9, ci, 1000 + i)
                o2 = A.poisoned(oshape)
                op(*(A.dev(x) for x in inputs(key)), out=o2)
                launches += 1
                worst = max(worst, check_close(A.host(o2), ref_of(key),
                                               f"{name} ordinary call after replay {i}"))
        torch.cuda.synchronize()
        got = op.frame.read()
        assert got == (launches, launches), f"{name}: frame {got}, {launches} launches made"
        del graph
        if name != "gemm":            # the fused ops hold symmetric buffers
            op.synchronize()
            op.free()
    say("graph", comm, f"ops={len(cases)} replays={replays} max_rel_err={worst:.2e}")


def check_cugraph(comm, opts, A):
    """mk.gemm on a numba stream, captured and replayed through cuda.bindings."""
    from cuda.bindings import driver as drv
    from mknumba.kernels.streams import stream_handle
    gm, gn, gk = opts["gm"], opts["gn"], opts["gk"]
    replays = opts["calls"]

    def ok(res, what):
        err = res[0] if isinstance(res, tuple) else res
        assert err == drv.CUresult.CUDA_SUCCESS, f"{what}: {err}"
        return res[1] if isinstance(res, tuple) and len(res) > 1 else None

    def inputs(key):
        return (rand_bits(opts, (gm, gk), comm.rank, *key, 0),
                rand_bits(opts, (gk, gn), comm.rank, *key, 1))
    s = cuda.stream()
    h = drv.CUstream(stream_handle(s))
    a_bits, b_bits = inputs((10, 0))
    a, b = cuda.to_device(a_bits, stream=s), cuda.to_device(b_bits, stream=s)
    out = cuda.to_device(_nan((gm, gn), np.uint16), stream=s)
    op = mk.Gemm()
    op(a, b, out=out, stream=s)                     # warm-up
    got = out.copy_to_host(stream=s)
    s.synchronize()
    worst = check_close(got, matmul_sum([(a_bits, b_bits)]), "warm-up")
    ok(drv.cuStreamBeginCapture(h, drv.CUstreamCaptureMode.CU_STREAM_CAPTURE_MODE_THREAD_LOCAL),
       "cuStreamBeginCapture")
    op(a, b, out=out, stream=s)
    graph = ok(drv.cuStreamEndCapture(h), "cuStreamEndCapture")
    gexec = ok(drv.cuGraphInstantiate(graph, 0), "cuGraphInstantiate")
    launches = 1
    poison = _nan((gm, gn), np.uint16)
    for i in range(1, replays + 1):
        a_bits, b_bits = inputs((10, i))
        a.copy_to_device(a_bits, stream=s)
        b.copy_to_device(b_bits, stream=s)
        out.copy_to_device(poison, stream=s)
        ok(drv.cuGraphLaunch(gexec, h), "cuGraphLaunch")
        launches += 1
        got = out.copy_to_host(stream=s)
        s.synchronize()
        worst = max(worst, check_close(got, matmul_sum([(a_bits, b_bits)]), f"launch {i}"))
        if i % 10 == 0:
            x_bits, y_bits = inputs((10, 1000 + i))
            o2 = op(cuda.to_device(x_bits, stream=s), cuda.to_device(y_bits, stream=s),
                    stream=s)
            launches += 1
            got = o2.copy_to_host(stream=s)
            s.synchronize()
            worst = max(worst, check_close(got, matmul_sum([(x_bits, y_bits)]),
                                           f"ordinary call after launch {i}"))
    assert op.calls() == (launches, launches), (op.calls(), launches)
    ok(drv.cuGraphExecDestroy(gexec), "cuGraphExecDestroy")
    ok(drv.cuGraphDestroy(graph), "cuGraphDestroy")
    say("cugraph", comm, f"launches={launches} max_rel_err={worst:.2e}")


def check_streams(comm, opts, A, calls=8):
    """One op, two torch streams in turn, back to back."""
    torch = _torch()
    streams = [torch.cuda.Stream(), torch.cuda.Stream()]
    cases = gemm_and_fused_cases(comm, opts)
    shape = (opts["ag"],)
    ag = mk.AllGather(comm, shape, "float32")
    worst = 0.0
    for ci, (name, op, ashape, bshape, oshape, ref_of) in enumerate(cases):
        outs = []
        for i in range(calls):
            key = (11, ci, i)
            with torch.cuda.stream(streams[i % 2]):   # inputs and call on this stream
                a = A.dev(rand_bits(opts, ashape, comm.rank, *key, 0))
                b = A.dev(rand_bits(opts, bshape, comm.rank, *key, 1))
                outs.append((key, a, b, op(a, b, out=A.poisoned(oshape))))
        torch.cuda.synchronize()
        for key, _, _, out in outs:
            worst = max(worst, check_close(A.host(out), ref_of(key), f"{name} call {key[2]}"))
        assert op.frame.read() == (calls, calls), (name, op.frame.read())
    outs = []
    for i in range(calls):
        with torch.cuda.stream(streams[i % 2]):
            x = A.dev(rand_f32(opts, shape, comm.rank, 11, i))
            outs.append((i, x, ag(x)))
    torch.cuda.synchronize()
    for i, _, out in outs:
        same_bits(A.host(out), ag_ref(comm, opts, 11, i), f"AllGather call {i}")
    for name, op, *_ in cases[1:]:
        op.free()
    ag.free()
    say("streams", comm, f"ops={len(cases) + 1} calls={calls} max_rel_err={worst:.2e}")


def check_dropped(comm, opts, A):
    """Calls on numba streams that the caller drops at once (destroyed once collected and
    numba's pending deallocations run): each op's next call on another stream is ordered
    behind the dropped one, then ``synchronize()`` waits on it, then ``free()`` (mk.Gemm, the
    fused ops, AllGather; numba arrays), every result checked. The op holds the stream of
    its last call (``streams.StreamHandle``): a destroyed stream's handle names freed driver
    state (a Comm's finalize crashed on one in ``replayed``)."""
    import gc

    def drop_streams():
        gc.collect()
        cuda.current_context().deallocations.clear()
    cases = gemm_and_fused_cases(comm, opts)
    shape = (opts["ag"],)
    ag = mk.AllGather(comm, shape, "float32")
    worst = 0.0
    for ci, (name, op, ashape, bshape, oshape, ref_of) in enumerate(cases + [
            ("AllGather", ag, None, None, None, None)]):
        outs = []
        for i, on in enumerate(("dropped", None, "dropped", "dropped")):
            key = (12, ci, i)
            if op is ag:
                args = (A.dev(rand_f32(opts, shape, comm.rank, *key)),)
                out = ag_out(comm, opts, A)
            else:
                args = (A.dev(rand_bits(opts, ashape, comm.rank, *key, 0)),
                        A.dev(rand_bits(opts, bshape, comm.rank, *key, 1)))
                out = A.poisoned(oshape)
            op(*args, out=out, stream=cuda.stream() if on else None)
            outs.append((key, out))
            drop_streams()
            if i == 2 and op is not cases[0][1]:
                op.synchronize()          # waits on the dropped stream
        cuda.synchronize()
        for key, out in outs:
            if op is ag:
                same_bits(A.host(out), ag_ref(comm, opts, *key), f"AllGather call {key[2]}")
            else:
                worst = max(worst, check_close(A.host(out), ref_of(key),
                                               f"{name} call {key[2]}"))
        if op is not cases[0][1]:
            comm.barrier()
            op.free()                     # after a call on a dropped stream
    say("dropped", comm, f"ops={len(cases) + 1} max_rel_err={worst:.2e}")


def check_wrongdev(comm, opts, A):
    """An array on another GPU than the op's: MkValueError naming both GPUs."""
    torch = _torch()
    if torch.cuda.device_count() < 2:
        print(f"SKIP wrongdev rank {comm.rank}: needs 2 GPUs", flush=True)
        return
    here = comm.device_id
    other = (here + 1) % torch.cuda.device_count()
    gm, gn, gk = opts["gm"], opts["gn"], opts["gk"]
    m, n, k = opts["m"], opts["n"], opts["k"]

    def t(shape, dev, dtype=torch.bfloat16):
        return torch.zeros(shape, dtype=dtype, device=f"cuda:{dev}")
    words = ["GPU", str(here), str(other)]
    _refused(lambda: mk.gemm(t((gm, gk), here), t((gk, gn), other)), ["mknumba.gemm", "b"] + words)
    _refused(lambda: mk.gemm(t((gm, gk), here), t((gk, gn), here), out=t((gm, gn), other)),
             ["mknumba.gemm", "out"] + words)
    with cuda.gpus[other]:
        nb = cuda.to_device(np.zeros((gk, gn), np.uint16))
    _refused(lambda: mk.gemm(cuda.to_device(np.zeros((gm, gk), np.uint16)), nb),
             ["mknumba.gemm", "b"] + words)
    for op in fused_ops(comm, opts):
        _refused(lambda: op(t((m, k), other), t((k, n), here)), [op.name, "a"] + words)
        _refused(lambda: op(t((m, k), here), t((k, n), here), out=t(op.out_shape(), other)),
                 [op.name, "out"] + words)
        op.free()
    ag = mk.AllGather(comm, (opts["ag"],), "float32")
    _refused(lambda: ag(t((opts["ag"],), other, torch.float32)), ["AllGather", "x"] + words)
    ag.free()
    say("wrongdev", comm, f"gpu={here} other={other}")


def check_replayed(comm, opts, A, bound_s=2.0):
    """See the module docstring: replays of a graph captured before the op ended here."""
    ops = _paired_ops(comm, opts, "replayed", bound_s)
    if not ops:
        return
    g = GraphCapture(A)
    for op in ops:
        gather = isinstance(op, mk.AllGather)
        x = _paired_inputs(comm, opts, A, op, 20)
        out = ag_out(comm, opts, A) if gather else A.poisoned(op.out_shape())
        g.warm(lambda: op(*x, out=out, **g.kw))
        replay = g.capture(lambda: op(*x, out=out, **g.kw))
        A.poison(out)
        replay()
        _synchronize(A)
        if gather:
            assert np.array_equal(A.host(out), ag_ref(comm, opts, 20)), "AllGather replay"
        else:
            check_close(A.host(out), fused_ref(comm, opts, op, (20,)), f"{op.name} replay")
        comm.barrier()
        if comm.rank == 0:
            bad = _paired_inputs(comm, opts, A, op, 21, bad=True)
            _refused(lambda: op(*bad, **g.kw), [op.name])
            A.poison(out)
            replay()
            _synchronize(A)
            _all_nan(A, out, f"{op.name}: a graph replayed after the op ended wrote its output")
            _refused(op.synchronize, [op.name, "ended on this rank"], mk.MkError)
        else:
            op(*_paired_inputs(comm, opts, A, op, 21), **g.kw)
            _refused(op.synchronize, [op.name, "timed out"], mk.MkTimeoutError)
        assert op.frame.closed(), f"{op.name}: rank {comm.rank}'s frame is open after the end"
        comm.barrier()
        op.free()
    names = [op.name for op in ops]
    if A.kind == "torch":                 # a call beside the capture, on every rank
        torch = A.torch
        ag = mk.AllGather(comm, (opts["ag"],), "float32")
        x = A.dev(rand_f32(opts, (opts["ag"],), comm.rank, 22))
        out, out2 = ag_out(comm, opts, A), ag_out(comm, opts, A)
        g.warm(lambda: ag(x, out=out))
        other = torch.cuda.Stream()

        def beside():
            ag(x, out=out)
            with torch.cuda.stream(other):
                _refused(lambda: ag(x, out=out2), ["AllGather", "capture of its calls"])
        replay = g.capture(beside)
        A.poison(out)
        replay()
        _synchronize(A)
        _all_nan(A, out, "AllGather: a graph replayed after a call beside its capture wrote")
        assert ag.frame.closed(), "AllGather's frame is open after a call beside its capture"
        _refused(lambda: ag(x, out=out), ["AllGather", "refused here"], mk.MkError)
        comm.barrier()
        ag.free()
        names.append("AllGather-beside-capture")
    say("replayed", comm, " ".join(names))


def _synchronize(A):
    if A.kind == "torch":
        A.torch.cuda.synchronize()
    else:
        cuda.synchronize()


def _all_nan(A, out, what):
    got = A.host(out)
    assert np.isnan(from_bf16_bits(got) if got.dtype == np.uint16 else got).all(), what


CHECKS = dict(inplace=check_inplace, wrap=check_wrap, alternate=check_alternate,
              free=check_free, capture=check_capture, disagree=check_disagree,
              dtypes=check_dtypes, overlap=check_overlap, finalized=check_finalized,
              refused=check_refused, planned=check_planned, graph=check_graph,
              cugraph=check_cugraph, dropped=check_dropped,
              streams=check_streams, wrongdev=check_wrongdev, replayed=check_replayed,
              closed=check_closed, options=check_options)
GPU_ONLY = ("graph", "cugraph", "streams", "wrongdev", "replayed", "dropped")


def main():
    names = sys.argv[1].split(",")
    opts = dict(m=128, n=64, k=16, gm=40, gn=48, gk=16, ag=24, calls=100, seed=1234,
                fused=1, arrays="numba")
    for arg in sys.argv[2:]:
        key, value = arg.split("=", 1)
        assert key in opts, f"unknown option {key}"
        opts[key] = value if key == "arrays" else int(value)
    for name in names:
        assert name in CHECKS, f"unknown check {name}; one of {sorted(CHECKS)}"
        assert not (SIMULATOR and name in GPU_ONLY), f"{name} needs a GPU"
    if SIMULATOR:   # the simulator's uint32 counters are NumPy scalars: they warn as they wrap
        warnings.filterwarnings("ignore", "overflow encountered in scalar", RuntimeWarning)
    with mk.init() as comm:
        arrays = opts["arrays"]
        if not SIMULATOR and _torch() is not None:
            _torch().cuda.set_device(comm.device_id)
        for name in names:
            A = Arrays("torch" if name in ("graph", "streams", "wrongdev") else
                       "numba" if name == "dropped" else arrays)
            t0 = time.perf_counter()
            CHECKS[name](comm, opts, A)
            print(f"time {name} rank {comm.rank} {time.perf_counter() - t0:.1f}s", flush=True)
        comm.barrier()


if __name__ == "__main__":
    main()
