"""The launch frame (``kernels.launch``): inputs read fresh at every call, the device call
counter across the 2**32 wrap, several ops on one comm, free, rank agreement, bf16 spellings;
on GPUs also CUDA graphs (torch.cuda.graph, and cuda.bindings capture on a numba stream), two
streams, arrays on the wrong GPU. The checks live in ``tests/mpi/frame_checks.py``. Without a
GPU also the one-node graph launch's host side: its node parameters' layout, its mode switch.

Simulator shapes are the smallest that still split work between the ranks (m = 64: one 32-row
tile row per rank, n = 32, k = 8): every simulated call costs seconds on two cores, so the
1x2 checks share one mpiexec launch.
"""
import pytest

from mpi_util import SharedLaunch, run_mpi

SIM_SHAPE = ("m=64", "n=32", "k=8", "gm=32", "gn=32", "gk=8", "ag=24")
SIM_CHECKS = ("inplace", "wrap", "alternate", "free", "capture", "disagree", "dtypes", "overlap",
              "finalized", "refused", "closed", "options", "planned")


def _passes(out, check, n):
    assert out.count(f"PASS {check} ") == n, out[-4000:]


# The simulator runs share one mpiexec start (each its own mk.init and layout).
TWO = SharedLaunch(2)
TWO.add("test_sim_1x2_frame_checks", "frame_checks.py", ",".join(SIM_CHECKS), *SIM_SHAPE)
TWO.add("test_sim_2x1_wrap", "frame_checks.py", "wrap", *SIM_SHAPE,
        env={"MKNUMBA_GPUS_PER_NODE": "1", "MKNUMBA_TRANSPORT": "sim:ordered"})


# ---- simulator ----------------------------------------------------------------------------------
@pytest.mark.slow
def test_sim_1x2_frame_checks(request):
    """Every simulator check on one node of two GPUs, in one launch: fused ops with a and b
    updated in place between calls (b row-major and as a column-major view), the wrap of the
    call counter and epoch after ``_start_at(2**32 - 3)``, ops called in turn, free, calls that
    would allocate inside a capture, ranks that disagree, the bf16 spellings, outputs over
    inputs refused, ops of a finalized Comm, a call one rank refuses and the others launch,
    ranks that leave planning together (one compiling late, or failing)."""
    out = TWO.output(request)
    for check in SIM_CHECKS:
        _passes(out, check, 2)
    assert out.count("topology 1x2") == 2 * len(SIM_CHECKS), out[-4000:]
    assert out.count("frame=(3, 4)") == 2, out[-4000:]     # calls 2**32 + 3, epoch 4 (not 0)


@pytest.mark.slow
def test_sim_2x1_wrap(request):
    """Across the wrap between two nodes (the proxy's sim transport): ``_start_at`` also sets
    the network flags and chunk counters."""
    out = TWO.output(request)
    _passes(out, "wrap", 2)
    assert out.count("topology 2x1") == 2 and out.count("frame=(3, 4)") == 2, out[-4000:]


# ---- GPUs -------------------------------------------------------------------------------------
# Two ranks may share one GPU (MKNUMBA_ALLOW_SHARED_GPU); never NVLink multicast.
GPU_ENV = {"NCCL_NVLS_ENABLE": "0", "MKNUMBA_ALLOW_SHARED_GPU": "1"}
GPU_SHAPE = ("m=2048", "n=1536", "k=512", "gm=1000", "gn=776", "gk=264", "ag=100000")


@pytest.mark.gpu
@pytest.mark.parametrize("arrays", ["torch", "numba"])
def test_gpu_1x2_frame_checks(arrays):
    out = run_mpi("frame_checks.py", 2, ",".join(SIM_CHECKS), *GPU_SHAPE, f"arrays={arrays}",
                  simulator=False, env=GPU_ENV)
    for check in SIM_CHECKS:
        _passes(out, check, 2)
    assert out.count("frame=(3, 4)") == 2, out[-4000:]


@pytest.mark.gpu
def test_gpu_2x1_wrap():
    env = dict(GPU_ENV, MKNUMBA_GPUS_PER_NODE="1", MKNUMBA_TRANSPORT="dma:ordered")
    out = run_mpi("frame_checks.py", 2, "wrap", *GPU_SHAPE, "arrays=torch", simulator=False,
                  env=env)
    _passes(out, "wrap", 2)
    assert out.count("topology 2x1") == 2, out[-4000:]


@pytest.mark.gpu
def test_gpu_graph_gemm_one_process():
    """mk.Gemm captured by torch.cuda.graph, and mk.gemm captured on a numba stream through
    cuda.bindings: 100 replays each with fresh data in the captured inputs, ordinary calls
    between them, every output checked."""
    out = run_mpi("frame_checks.py", 1, "graph,cugraph", *GPU_SHAPE, simulator=False,
                  env=GPU_ENV)
    _passes(out, "graph", 1)
    _passes(out, "cugraph", 1)
    assert "ops=1 replays=100" in out, out[-4000:]


@pytest.mark.gpu
def test_gpu_graph_gemm_tail_split():
    """mk.Gemm captured by torch.cuda.graph at a shape "auto" runs with the tail split (512 x
    28672 x 4096 on an H200: whole tiles, then the last round's tiles in K slices and folds),
    20 replays with fresh data and ordinary calls between them, every output checked."""
    out = run_mpi("frame_checks.py", 1, "graph", "gm=512", "gn=28672", "gk=4096", "fused=0",
                  "calls=20", simulator=False, env=GPU_ENV)
    _passes(out, "graph", 1)
    assert "ops=1 replays=20" in out, out[-4000:]


@pytest.mark.gpu
def test_gpu_1x2_graph_fused():
    """Both fused ops (and the Gemm on each rank) captured by torch.cuda.graph on two ranks:
    every replay is a new call with a new epoch on both ranks."""
    out = run_mpi("frame_checks.py", 2, "graph", *GPU_SHAPE, simulator=False, env=GPU_ENV)
    _passes(out, "graph", 2)
    assert out.count("ops=3 replays=100") == 2, out[-4000:]


@pytest.mark.gpu
@pytest.mark.parametrize("arrays", ["torch", "numba"])
def test_gpu_1x2_graph_replay_after_the_op_ended(arrays):
    """A CUDA graph captured before an op ended on a rank (a refused call, a call beside the
    capture) replays as nothing there, so it cannot pair with the others' calls."""
    out = run_mpi("frame_checks.py", 2, "replayed", *GPU_SHAPE, f"arrays={arrays}",
                  simulator=False, env=GPU_ENV)
    _passes(out, "replayed", 2)
    beside = "AllGather-beside-capture" if arrays == "torch" else "GemmReduceScatter"
    assert out.count(beside) >= 2, out[-4000:]


@pytest.mark.gpu
def test_gpu_1x2_two_streams():
    out = run_mpi("frame_checks.py", 2, "streams", *GPU_SHAPE, simulator=False, env=GPU_ENV)
    _passes(out, "streams", 2)


@pytest.mark.gpu
def test_gpu_1x2_streams_dropped_after_a_call():
    """Calls on numba streams the caller drops at once: the next call on another stream,
    synchronize(), free() and the Comm's finalize after them (mk.Gemm, both fused ops,
    AllGather; each result checked)."""
    out = run_mpi("frame_checks.py", 2, "dropped", *GPU_SHAPE, "arrays=numba",
                  simulator=False, env=GPU_ENV)
    _passes(out, "dropped", 2)
    assert out.count("ops=4") == 2, out[-4000:]


@pytest.mark.gpu
def test_gpu_array_on_wrong_gpu():
    torch = pytest.importorskip("torch")
    if torch.cuda.device_count() < 2:
        pytest.skip(f"needs 2 GPUs (an array on the other one); this machine has "
                    f"{torch.cuda.device_count()}")
    out = run_mpi("frame_checks.py", 2, "wrongdev", *GPU_SHAPE, simulator=False,
                  env={"NCCL_NVLS_ENABLE": "0"})
    _passes(out, "wrongdev", 2)


# ---- the graph launch (CPU checks of its host side) ---------------------------------------------
def test_graph_node_params_layout():
    """``_KernelNodeParams`` is CUDA_KERNEL_NODE_PARAMS_v1 of cuda.h, which the unversioned
    cuGraphAddKernelNode and cuGraphExecKernelNodeSetParams take: func, grid x/y/z, block
    x/y/z, sharedMemBytes, kernelParams, extra."""
    import ctypes
    from mknumba.kernels.launch import _KernelNodeParams as P
    offsets = {name: getattr(P, name).offset for name, _ in P._fields_}
    assert offsets == {"func": 0, "grid": 8, "block": 20, "shared_mem_bytes": 32,
                       "kernel_params": 40, "extra": 48}, offsets
    assert ctypes.sizeof(P) == 56
    p = P(0x1234, (132, 1, 1), (288, 1, 1), 1000, None, 0x5678)
    raw = (ctypes.c_uint * 14).from_buffer_copy(p)
    assert list(raw[2:9]) == [132, 1, 1, 288, 1, 1, 1000]


def test_graph_launch_mode_is_checked():
    """MKNUMBA_GRAPH_LAUNCH takes stable, always or off; anything else is refused at import,
    naming the variable."""
    import os
    import subprocess
    import sys
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    env = dict(os.environ, MKNUMBA_GRAPH_LAUNCH="sometimes", NUMBA_ENABLE_CUDASIM="1",
               PYTHONPATH=os.pathsep.join([root, os.environ.get("PYTHONPATH", "")]))
    p = subprocess.run([sys.executable, "-c", "import mknumba.kernels.launch"], env=env,
                       capture_output=True, text=True, timeout=120)
    assert p.returncode != 0
    assert "MKNUMBA_GRAPH_LAUNCH must be stable, always or off" in p.stderr, p.stderr[-2000:]


def test_set_graph_launch():
    """The graph launch mode: "always" unless MKNUMBA_GRAPH_LAUNCH said otherwise; each mode
    set at run time reads back; anything else is refused and leaves the mode as it was."""
    import os
    from mknumba.errors import MkValueError
    from mknumba.kernels import launch
    before = launch.graph_launch()
    assert before == os.environ.get("MKNUMBA_GRAPH_LAUNCH", "always")
    try:
        for mode in ("off", "stable", "always"):
            launch.set_graph_launch(mode)
            assert launch.graph_launch() == mode
        with pytest.raises(MkValueError, match="stable, always or off, not 'sometimes'"):
            launch.set_graph_launch("sometimes")
        assert launch.graph_launch() == "always"
    finally:
        launch.set_graph_launch(before)


# ---- binds that repeat the last call's (CPU check of kernels.launch.Launch.binder) ------------
def test_a_binder_repeating_its_last_values_keeps_the_slots_right(monkeypatch):
    """A binder called with the values of the launch's last binds writes nothing and tells the
    graph launch that its node's parameters are current; after another binder or a bind by
    name touched a shared slot, the same values are written again and the node refreshed.
    The parameter buffer is real; the driver launch is recorded instead."""
    import ctypes
    import threading
    import types
    from mknumba.kernels import launch

    monkeypatch.setattr(launch, "SIMULATOR", False)
    monkeypatch.setattr(launch, "_GRAPH_MODE", [launch._ALWAYS])
    L = object.__new__(launch.Launch)
    buf = (ctypes.c_char * 24)()
    L._data = {n: ctypes.c_void_p.from_buffer(buf, 8 * i) for i, n in enumerate("xyz")}
    L.lock, L._binders = threading.Lock(), {}
    L._fn, L.grid, L.threads, L.smem, L._extra_addr = 1, 2, 3, 0, 0
    L._graph = types.SimpleNamespace(exec=7, node=8, params=9)
    L._synced, L._bound_since_launch, L._last_bind = True, False, (None, None)
    refreshed = []

    def driver(fn, grid, threads, smem, stream, extra, graph, node, params, refresh):
        refreshed.append(refresh)
        return 0
    L._launch = driver
    slots = lambda: [L._data[n].value for n in "xyz"]       # noqa: E731
    xy, yz = L.binder("x", "y"), L.binder("y", "z")
    xy(0, 1, 2)
    assert slots()[:2] == [1, 2] and refreshed == [True]
    xy(0, 1, 2)                                  # the same: nothing written, node current
    assert refreshed[-1] is False
    yz(0, 5, 6)                                  # y shared: the next xy must write it back
    assert slots() == [1, 5, 6] and refreshed[-1] is True
    xy(0, 1, 2)
    assert slots() == [1, 2, 6] and refreshed[-1] is True
    L.bind("x", 9)                               # a bind by name: xy writes x again
    xy(0, 1, 2)
    assert slots() == [1, 2, 6] and refreshed[-1] is True
    xy(0, 1, 3)
    assert slots() == [1, 3, 6] and refreshed[-1] is True
    xy(0, 1, 3)
    assert refreshed[-1] is False
    yz(0, 1, 3)                                  # the same values through another binder
    assert slots() == [1, 1, 3] and refreshed[-1] is True


# ---- calls on two streams during a capture (CPU check of kernels.streams.StreamOrder) --------
def test_call_beside_a_capture_is_refused_and_ends_the_op(monkeypatch):
    """A call on another stream while the op's calls are being captured is refused
    (MkValueError naming both streams) before any driver call, and the refusal ends a fused
    op on this rank like every refusal (``OpLifetime._end_calls``): the other ranks may have
    launched that call: no later call, and its frame closed so that no replay of the graph
    launches either. The hot paths refuse it in ``StreamOrder.enter``, outside
    ``_checked_call``, so the op's stream order tells the op itself. Streams are stand-in
    handles; whether a stream captures is stubbed, and so is the frame."""
    from mknumba import MkError
    from mknumba.errors import MkValueError
    from mknumba.kernels import lifetime, streams

    capturing = {0x10}
    monkeypatch.setattr(streams, "SIMULATOR", False)
    monkeypatch.setattr(streams, "is_capturing", lambda stream: stream in capturing)

    class Comm:
        size = 2

        def adopt(self, op):
            pass

    class Op(lifetime.OpLifetime):
        name, members = "SomeOp", 2

    class Frame:
        def close(self, stream=None):
            closed.append(stream)

    closed = []
    op = Op()
    op._plan_on(Comm())
    op.frame = Frame()
    op.streams.enter(0x10)               # the capturing stream: the first call, taken
    op.streams.enter(0x10)
    with pytest.raises(MkValueError, match="SomeOp: called on stream 0x20 while a CUDA graph "
                       "capture of its calls is in progress on stream 0x10"):
        op.streams.enter(0x20)
    assert op.streams.last == 0x10       # still ordered after the capture's calls
    with pytest.raises(MkError, match="SomeOp: called after a call it refused here"):
        op._check_live()
    assert closed == [0x10]              # the frame closed (off the capturing stream)
    op.streams.enter(0x10)               # the capture itself goes on

    alone = streams.StreamOrder("Gemm")   # a one-GPU op's order: refused, nothing to end
    alone.enter(0x10)
    with pytest.raises(MkValueError, match="Gemm: called on stream 0x20"):
        alone.enter(0x20)


# ---- tensor-map rows and captures (CPU check of kernels.tensor_maps.MapTable's rule) ----------
def test_map_rows_written_in_a_capture_are_rewritten_before_their_first_eager_use(monkeypatch):
    """A row first written inside a capture exists only in the graph's copy, so its first use
    outside a capture writes it again (once); rows of other keys meanwhile are served from
    the table without asking whether the stream captures; a full table during a capture is
    refused. The device side is stubbed: host rows stand in, copies are recorded."""
    import numpy as np
    from mknumba.errors import MkError
    from mknumba.kernels import tensor_maps

    class Table(tensor_maps.MapTable):
        def _new_table(self):
            self.dev = self.host = np.zeros((self.capacity, self.words), np.uint64)
            self.base, self.used = 1 << 20, 0
            self._tables.append((self.dev, self.host))

        def _copy(self, addr, src, stream):
            copies.append((addr, capturing[0]))

    copies, capturing, asked = [], [False], []

    def is_capturing(stream):
        asked.append(stream)
        return capturing[0]

    monkeypatch.setattr(tensor_maps, "is_capturing", is_capturing)
    t = Table(lambda key: np.full(4, key[0], np.uint64), 4, capacity=3)
    a = t.row((1,), 7)                        # eager: written once
    assert copies == [(a, False)] and (t.host[0] == 1).all()
    capturing[0] = True
    b = t.row((2,), 7)                        # new inside a capture: the graph's copy only
    assert b != a and copies[-1] == (b, True)
    assert t.row((2,), 7) == b and len(copies) == 2     # again in the capture: nothing new
    capturing[0] = False
    del asked[:]
    assert t.row((1,), 7) == a and asked == [] and len(copies) == 2   # other keys: no query
    assert t.row((2,), 7) == b and copies[-1] == (b, False)           # rewritten, eagerly
    assert t.row((2,), 7) == b and len(copies) == 3                   # and only once
    t.row((3,), 7)                            # the table is full now
    capturing[0] = True
    with pytest.raises(MkError, match="during a CUDA graph capture"):
        t.row((4,), 7)


# ---- the stream of an op's last call (CPU check of kernels.streams.StreamHandle) ----------------
def test_an_op_holds_the_stream_object_of_its_last_call(monkeypatch):
    """A stream object's handle keeps the object alive (a dropped numba or CuPy stream is
    destroyed, and the op uses its last stream after the call); it reads as the plain handle;
    the legacy default stream and raw handles stay plain ints. Streams are stand-ins."""
    import gc
    import weakref

    from mknumba.kernels import streams

    monkeypatch.setattr(streams, "SIMULATOR", False)

    class CupyLike:
        def __init__(self, ptr):
            self.ptr = ptr

    s = CupyLike(0x1234)
    alive = weakref.ref(s)
    h = streams.stream_handle(s)
    assert h == 0x1234 and hash(h) == hash(0x1234) and f"{h:#x}" == "0x1234"
    order = streams.StreamOrder("SomeOp")
    order.enter(h)                       # the first call: nothing to order behind
    del s, h
    gc.collect()
    assert alive() is not None           # held by the op's last stream
    order.last = None
    gc.collect()
    assert alive() is None               # and by nothing else
    assert type(streams.stream_handle(CupyLike(0))) is int    # the legacy stream: nothing held
    assert type(streams.stream_handle(0x20)) is int


# ---- a plan that fails on one rank (CPU check of OpLifetime._planning_ends) -------------------
def test_a_failed_plan_ends_the_op_and_leaves_its_comm():
    """An op whose planning raises inside ``_planning_ends`` takes no calls and is disowned by
    its Comm (whose finalize would otherwise tend it); one that plans is kept. The members'
    allgather is stubbed as one rank's."""
    from mknumba import MkError
    from mknumba.kernels import lifetime

    class Group:
        def Get_size(self):
            return 1

    class Comm:
        size, mpi = 1, Group()

        def __init__(self):
            self.ops = []

        def adopt(self, op):
            self.ops.append(op)

        def disown(self, op):
            self.ops.remove(op)

    class Op(lifetime.OpLifetime):
        name = "SomeOp"

    comm = Comm()
    good, bad = Op(), Op()
    for op in (good, bad):
        op._plan_on(comm)
    with good._planning_ends():
        pass
    with pytest.raises(RuntimeError, match="the compile"):
        with bad._planning_ends():
            raise RuntimeError("the compile")
    assert comm.ops == [good] and bad.frame is None
    with pytest.raises(MkError, match="SomeOp: called after its planning failed"):
        bad._check_live()
    good._check_live()
