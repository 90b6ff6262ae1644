"""GemmReduceScatter / GemmAllReduce: schedule tables, sm_90a compile + link without a GPU,
multi-rank runs under the simulator (1x2, 2x1 both completion modes, 2x2) and on GPUs."""
import os
import re
import textwrap

import numpy as np
import pytest

from mpi_util import SharedLaunch, run_mpi, run_python

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

import mknumba  # noqa: E402,F401
from mknumba.sched.reduce import ReducePlan  # noqa: E402


# ---- schedule (host tables) -------------------------------------------------------------------
def _plans(allreduce, nodes, G, m=None, n=96, bm=32, bn=32, k=3):
    W = nodes * G
    m = m or W * 64
    return {nd * G + l: ReducePlan(allreduce, m, n, bm, bn, nodes, G, nd, l, k, 2)
            for nd in range(nodes) for l in range(G)}


@pytest.mark.parametrize("allreduce", [False, True])
@pytest.mark.parametrize("nodes,G", [(1, 2), (2, 1), (2, 2), (3, 2), (2, 4)])
def test_plan_tables_agree_across_ranks(allreduce, nodes, G):
    plans = _plans(allreduce, nodes, G)
    tiles = plans[0].tiles_m * plans[0].tiles_n
    for node in range(nodes):
        ranks = [node * G + l for l in range(G)]
        # every rank of a node computes every tile, in one order
        for r in ranks:
            assert sorted(plans[r].order.tolist()) == list(range(tiles))
            assert (plans[r].order == plans[ranks[0]].order).all()
        # each tile is reduced by exactly one GPU per node
        red = np.concatenate([plans[r].red_tiles for r in ranks])
        assert sorted(red.tolist()) == list(range(tiles))
    for r, p in plans.items():
        # the network needs go first: tiles another node needs precede the rest in compute order
        if nodes > 1 and not allreduce:
            dest = (p.order // p.tiles_n) // (p.tiles_m // p.world) // G
            remote = dest != p.node
            assert not (remote[1:] & ~remote[:-1]).any()
        # every send command lands exactly the tiles its receiver expects, where it expects them
        stage_tile = {int(s): int(t) for t, s in zip(p.red_tiles, p.red_slots)}
        for q, dest, s0, nt, d0, flag in p.cmds[:p.n_cmds]:
            rp = plans[int(dest)]
            assert rp.local == p.local and rp.node != p.node          # rail peer
            src, i0 = divmod(int(d0), rp.n_final)
            for j in range(nt):
                assert stage_tile[s0 + j] == rp.final_tiles[i0 + j]
            assert flag == src * rp.recv_chunks + i0 // 3
            assert p.chunk_tiles[q] == nt
        # only 1/G of the output leaves each GPU, once per remote node that needs it
        if nodes > 1:
            sent = p.cmds[:p.n_cmds, 3].sum()
            want = (tiles // G) * ((nodes - 1) if allreduce else (nodes - 1) / nodes)
            assert abs(sent - want) <= G, (sent, want)


def test_compute_order_feeds_every_local_owner_evenly():
    """ReduceScatter on one node: the row blocks' tiles alternate, so each GPU's reduce role
    gets tiles from the first wave on (not after a whole row block) and no GPU is left reducing
    alone at the end; within a row block, bands of group_m rows walk the columns."""
    p = ReducePlan(False, 1024, 256, 32, 32, 1, 2, 0, 0, 4, 2)     # 32 x 8 tiles, 2 row blocks
    owner = (p.order // p.tiles_n) // (p.tiles_m // 2)
    assert (owner[0::2] == 0).all() and (owner[1::2] == 1).all()
    mine = p.order[owner == 0]
    assert mine[:4].tolist() == [0, 8, 1, 9]        # band of rows 0-1 (group_m = 2), row fastest
    # the same order on the other GPU, its own tiles in the same relative positions
    q = ReducePlan(False, 1024, 256, 32, 32, 1, 2, 0, 1, 4, 2)
    assert (q.order == p.order).all() and (q.red_tiles == p.order[owner == 1]).all()


def test_fold_order_puts_own_row_block_last():
    """fold: each GPU computes the row blocks other GPUs own first (so their partials reach
    the owners early) and its own last; it has no reduce pass."""
    for local in range(2):
        p = ReducePlan(False, 1024, 256, 32, 32, 1, 2, 0, local, 4, 2, fold=True)
        owner = (p.order // p.tiles_n) // (p.tiles_m // 2)
        half = len(p.order) // 2
        assert (owner[:half] != local).all() and (owner[half:] == local).all()
        assert sorted(p.order.tolist()) == list(range(p.tiles_m * p.tiles_n))
        assert len(p.red_tiles) == 0
    with pytest.raises(mknumba.MkValueError, match="fold"):
        ReducePlan(True, 1024, 256, 32, 32, 1, 2, 0, 0, 4, 2, fold=True)


def test_reduce_scatter_needs_whole_tile_row_blocks():
    with pytest.raises(mknumba.MkValueError, match="row blocks"):
        ReducePlan(False, 100, 64, 32, 32, 1, 2, 0, 0, 4, 2)


# ---- sm_90a compile + link, no GPU ------------------------------------------------------------
COMPILE_SCRIPT = textwrap.dedent("""
    import sys
    import numba.cuda.dispatcher as disp
    disp.get_current_device = lambda: type("D", (), {"compute_capability": (9, 0)})()
    from numba import types
    from numba.cuda import compiler
    from mknumba.kernels.gemm_reduce import kernel as K
    from mknumba.kernels.launch import signature

    build, threads, kernel = K.build(sys.argv[1])
    sig = signature(kernel)          # the kernel's own declaration
    lib, _ = compiler._compile_pyfunc_with_fixup(
        kernel.py_func, sig, device=False, cc=(9, 0, "a"),
        launch_bounds=(threads, 1), lto=True, abi="numba")
    lib._lto = True
    cubin = lib.get_cubin(cc=(9, 0, "a"))
    ptx = lib.get_lto_ptx(cc=(9, 0, "a")).replace("\\\\x00", "")
    assert ptx.count("wgmma.mma_async") >= 4, "wgmma missing"
    for instr in ("st.release.sys", "ld.acquire.sys", "atom.add.release.gpu", "fence.acq_rel.sys"):
        assert instr in ptx, instr
    assert "multimem" not in ptx                  # never NVLink multicast
    print("linked", len(bytes(cubin.code)))
""")


@pytest.mark.slow
def test_fused_kernel_compiles_for_sm90a():
    """The fused kernel around the plain staged tile reading B as [k, n]. (Around the fused
    ops' default tile, the staged + publisher one: tests/test_compile.py, gemm_reduce.)"""
    pytest.importorskip("cuda.bindings.nvjitlink")
    assert "linked" in run_python(COMPILE_SCRIPT, "sm90:kn", simulator=False, timeout=900)


# ---- simulator, several ranks (tiny shapes: every thread is a Python thread) -------------------
def _passes(out, n):
    assert out.count("PASS") == n, out[-3000:]


# The simulator runs of 2 ranks (1x2 and 2x1) share one mpiexec start, those of 4 ranks
# another: each run is a set of options of fused_checks.py in its own mk.init.
TWO, FOUR = SharedLaunch(2), SharedLaunch(4)
SIM_1X2 = [("on", "mixed", "on"), ("on", "off", "off"), ("off", "on", "off")]
for _d, _s, _f in SIM_1X2:
    TWO.add(f"test_sim_1x2_both_kernels[{_d}-{_s}-{_f}]", "fused_checks.py", "both", 128, 64,
            16, 2, "numba", 0, "auto", _d, _s, _f)


@pytest.mark.parametrize("deliver,shared,fold", [
    SIM_1X2[0],
    pytest.param(*SIM_1X2[1], marks=pytest.mark.slow),
    pytest.param(*SIM_1X2[2], marks=pytest.mark.slow)])
def test_sim_1x2_both_kernels(deliver, shared, fold, request):
    """deliver: compute blocks write the tiles the other GPU owns into its
    inbox; off: the owner loads them from the other GPU. shared: AllReduce into its shared
    output, which the owner writes on both GPUs when delivering (direct), else through the
    copy; mixed: rank 0 into its shared output, rank 1 into an array of its own, which it
    copies out of its shared output. fold: ReduceScatter's owner adds the delivered tile in
    its own tile's epilogue."""
    out = TWO.output(request)
    _passes(out, 4)
    assert out.count("join=0") == 4, out[-2000:]       # blocks run one at a time here
    assert out.count(f"deliver={int(deliver == 'on')}") == 4, out[-2000:]
    direct = int(deliver == "on" and shared != "off")
    assert re.findall(r"gemm_allreduce rank \d+ .*?direct=(\d)", out) == [str(direct)] * 2, \
        out[-2000:]
    assert re.findall(r"gemm_reducescatter rank \d+ .*?fold=(\d)", out) == \
        [str(int(fold == "on"))] * 2, out[-2000:]


def test_sim_one_rank_is_the_plain_gemm():
    """One rank has nothing to reduce: the ops run the plain GEMM into ``out`` (fused_checks
    traces runs of 3 calls or fewer, which keeps the fused kernel: 4 calls here), every call
    with numba arrays through its checked path (the hot path takes tensors)."""
    out = run_mpi("fused_checks.py", 1, "both", 64, 32, 8, 4, "numba")
    _passes(out, 2)
    assert out.count("solo=1") == 2 and out.count("checked_calls=4 ") == 2, out[-2000:]


for _mode in ("ordered", "completion"):
    TWO.add(f"test_sim_2x1_both_kernels[{_mode}]", "fused_checks.py", "both", 128, 32, 8, 2,
            "numba", 1, env={"MKNUMBA_GPUS_PER_NODE": "1", "MKNUMBA_TRANSPORT": f"sim:{_mode}"})


@pytest.mark.parametrize("mode", ["ordered", "completion"])
@pytest.mark.slow
def test_sim_2x1_both_kernels(mode, request):
    _passes(TWO.output(request), 4)


TWO.add("test_sim_1x2_adaptive_across_the_wrap", "fused_checks.py", "both", 128, 64, 16, 2,
        "numba", 0, "auto", "auto", "off", "auto", "adaptive", 2**32 - 1)


def test_sim_1x2_adaptive_across_the_wrap(request):
    """comm_sms='adaptive' (roles.controller): blocks take tiles and reduce (AllReduce: then
    pull) items from queues and change role between them; two calls from just short of 2**32
    calls (the call counter, the epoch and the queues' tickets wrap), each against the float64
    reference, the trace of the last one saved and checked (fused_checks)."""
    out = TWO.output(request)
    _passes(out, 4)
    assert out.count("adaptive=1") == 4, out[-2000:]
    assert out.count("calls_seen=1 ") == 4, out[-2000:]     # 2**32 + 1 calls, mod 2**32


TWO.add("test_sim_2x1_adaptive", "fused_checks.py", "rs", 128, 32, 8, 2, "numba", 1, "auto",
        "auto", "off", "auto", "adaptive",
        env={"MKNUMBA_GPUS_PER_NODE": "1", "MKNUMBA_TRANSPORT": "sim:completion"})


def test_sim_2x1_adaptive(request):
    """The controller between two nodes: compute and reduce blocks are flexible, send and
    receive keep their blocks; the network chunks are counted as reduce items finish."""
    out = TWO.output(request)
    _passes(out, 2)
    assert out.count("adaptive=1") == 2, out[-2000:]


def test_adaptive_refuses_what_it_cannot_do():
    """comm_sms: a number, None or 'adaptive'; adaptive with join or fold is refused before
    anything is allocated."""
    from types import SimpleNamespace
    from mknumba.kernels.gemm_rs import GemmReduceScatter
    op = SimpleNamespace(adaptive=True, name="GemmReduceScatter")
    for bad in (dict(join=True, fold=None), dict(join=None, fold=True)):
        with pytest.raises(mknumba.MkValueError, match="adaptive"):
            GemmReduceScatter._check_adaptive(op, **bad)
    GemmReduceScatter._check_adaptive(op, None, None)


def test_controller_target_is_eq2_rounded():
    """roles.controller.target (run as Python): the paper's eq. 2, B * R_s C_s / (R_p C_p +
    R_s C_s) rounded, from the measured ns and items, computed without a divide (a float64
    divide is a call in SASS, which would serialize the kernel's wgmma); clamped to [1, B-1]
    while both kinds have work; the initial split until both kinds are measured."""
    from mknumba.roles import controller as C
    target = getattr(C.target, "py_func", None) or C.target.fn
    rng = np.random.default_rng()
    for _ in range(500):
        F = int(rng.integers(2, 133))
        lp, ls = (int(x) for x in rng.integers(1, 5000, 2))
        ctl = np.zeros(C.CTL_WORDS, np.uint64)
        ctl[[C.CTL_NS_COMPUTE, C.CTL_NS_COMM]] = rng.integers(1, 10**9, 2)
        ctl[[C.CTL_N_COMPUTE, C.CTL_N_COMM]] = rng.integers(1, 10**4, 2)
        P = lp * float(ctl[C.CTL_NS_COMPUTE]) / float(ctl[C.CTL_N_COMPUTE])
        S = ls * float(ctl[C.CTL_NS_COMM]) / float(ctl[C.CTL_N_COMM])
        want = min(max(int(np.floor(F * S / (P + S) + 0.5)), 1), F - 1)
        assert target(ctl, F, lp, ls, 3) == want, (F, lp, ls, ctl)
    ctl = np.zeros(C.CTL_WORDS, np.uint64)
    assert target(ctl, 10, 5, 5, 3) == 3                  # nothing measured: the initial split
    assert target(ctl, 10, 0, 5, 3) == 10 and target(ctl, 10, 5, 0, 3) == 0


def test_timeline_layout():
    """mknumba.timeline: lanes never overlap, the SMs-per-role counter follows the blocks'
    segments, a decision log becomes segments."""
    from mknumba import timeline as T
    ev = [(0, 10), (5, 15), (10, 20), (12, 13), (20, 30)]
    lane = T.lanes(ev)
    for a in range(len(ev)):
        for b in range(a + 1, len(ev)):
            if lane[a] == lane[b]:
                assert ev[a][1] <= ev[b][0] or ev[b][1] <= ev[a][0], (ev[a], ev[b])
    assert max(lane) + 1 == 3                    # (5,15), (10,20), (12,13) overlap at 12
    segs = [(0, "compute", 0, 10), (1, "reduce", 0, 20), (0, "reduce", 10, 20)]
    counts = T.sms_over_time(segs)
    idle = {r: 0 for r in T.ROLES}
    assert counts[0] == (0, dict(idle, compute=1, reduce=1))
    assert counts[1][0] == 10 and counts[1][1]["reduce"] == 2 and counts[1][1]["compute"] == 0
    assert counts[-1] == (20, idle)
    assert T.segments_from_log(5, 40, [(5, 0, 1), (20, 1, 2), (20, 1, 2)],
                               ("compute", "reduce")) == [("compute", 5, 20),
                                                          ("reduce", 20, 40)]
    doc = T.chrome_trace([T.Timeline(0, dict(compute=[(100, 200, 7, 0)]),
                                     [(0, "compute", 100, 200)], [(100, 0, 0, 1)], {})])
    x = [e for e in doc["traceEvents"] if e["ph"] == "X"]
    assert x == [dict(ph="X", name="compute 7", cat="compute", pid=0, tid=1, ts=0.0,
                      dur=0.1, args=dict(item=7, block=0))]
    doc = T.chrome_trace([T.Timeline(0, dict(send=[(0, 5, 3, 1), (5, 9, 3, 1, "push")]),
                                     [], [], {})])               # a named item
    assert [e["name"] for e in doc["traceEvents"] if e["ph"] == "X"] == ["send 3", "push 3"]


FOUR.add("test_sim_1x4_both_kernels", "fused_checks.py", "both", 128, 32, 8, 2, "numba", 0,
         "auto", "on", "off", "on", env={"MKNUMBA_GPUS_PER_NODE": "4"})


def test_sim_1x4_both_kernels(request):
    """Four GPUs on one node: each owner sums its tile and three delivered inbox planes
    (ReduceScatter: in its own tile's epilogue, fold)."""
    out = FOUR.output(request)
    _passes(out, 8)
    assert out.count("deliver=1") == 8, out[-2000:]
    assert out.count("fold=1") == 4, out[-2000:]


FOUR.add("test_sim_2x2_both_kernels", "fused_checks.py", "both", 128, 32, 8, 2, "numba", 1,
         env={"MKNUMBA_GPUS_PER_NODE": "2", "MKNUMBA_TRANSPORT": "sim:completion"})


@pytest.mark.slow
def test_sim_2x2_both_kernels(request):
    _passes(FOUR.output(request), 8)


FOUR.add("test_sim_2x2_allreduce_shared_output", "fused_checks.py", "ar", 128, 32, 8, 2,
         "numba", 1, "auto", "auto", "on",
         env={"MKNUMBA_GPUS_PER_NODE": "2", "MKNUMBA_TRANSPORT": "sim:ordered"})


@pytest.mark.slow
def test_sim_2x2_allreduce_shared_output(request):
    """Between nodes the receive role writes the finished tile into every local GPU's shared
    output (no copy)."""
    out = FOUR.output(request)
    _passes(out, 4)
    assert out.count("direct=1") == 4, out[-2000:]


# ---- GPUs -------------------------------------------------------------------------------------
GPU_ENV = {"NCCL_NVLS_ENABLE": "0"}


@pytest.mark.gpu
def test_gpu_1x2_hundred_calls_torch():
    out = run_mpi("fused_checks.py", 2, "both", 2048, 1536, 512, 100, "torch",
                  simulator=False, env=GPU_ENV)
    _passes(out, 4)
    assert out.count("join=1") == 4, out[-2000:]       # the GPU default: idle blocks join


@pytest.mark.gpu
def test_gpu_one_rank_torch_calls():
    """One rank: the ops run the plain GEMM into ``out``, from the second call on through
    mk.Gemm's hot path (``GemmReduce.__call__``; only the first call takes its checked path):
    six calls of fresh tensors, ragged n and k, the outputs poisoned, each result against a
    float64 reference."""
    out = run_mpi("fused_checks.py", 1, "both", 1024, 776, 264, 6, "torch", simulator=False,
                  env=GPU_ENV)
    _passes(out, 2)
    assert out.count("solo=1 ") == 2 and out.count("checked_calls=1 ") == 2, out[-2000:]


@pytest.mark.gpu
def test_gpu_1x2_reduce_scatter_fold_hundred_calls():
    """Each owner computes its row block last and adds the delivered partials in the GEMM
    epilogue: 100 back-to-back calls, torch tensors."""
    out = run_mpi("fused_checks.py", 2, "rs", 2048, 1536, 512, 100, "torch", 0, "auto", "on",
                  "off", "on", simulator=False, env=GPU_ENV)
    _passes(out, 2)
    assert out.count("fold=1") == 2, out[-2000:]


@pytest.mark.gpu
def test_gpu_1x2_allreduce_shared_output_hundred_calls():
    """The owners write both GPUs' shared output directly; each call's result is copied out on
    the stream before the next call, whose peer writes must wait for that copy."""
    out = run_mpi("fused_checks.py", 2, "ar", 2048, 1536, 512, 100, "torch", 0, "auto", "on",
                  "on", simulator=False, env=GPU_ENV)
    _passes(out, 2)
    assert out.count("direct=1") == 2, out[-2000:]


@pytest.mark.gpu
@pytest.mark.parametrize("join,deliver", [("on", "on"), ("off", "off")])
def test_gpu_1x2_ragged_numba(join, deliver):
    """Ragged last tile column and row (AllReduce takes any m), several calls, numba arrays;
    idle compute blocks joining the reduce and pull queues and tiles delivered to their owners,
    and neither."""
    out = run_mpi("fused_checks.py", 2, "ar", 1000, 776, 264, 5, "numba", 0, join, deliver,
                  simulator=False, env=GPU_ENV)
    _passes(out, 2)
    assert out.count(f"join={int(join == 'on')} deliver={int(deliver == 'on')}") == 2, \
        out[-2000:]


@pytest.mark.gpu
@pytest.mark.parametrize("mode", ["ordered", "completion"])
def test_gpu_2x1_dma(mode):
    env = dict(GPU_ENV, MKNUMBA_GPUS_PER_NODE="1", MKNUMBA_TRANSPORT=f"dma:{mode}")
    _passes(run_mpi("fused_checks.py", 2, "both", 2048, 1024, 256, 100, "torch", 2,
                    simulator=False, env=env), 4)


def test_split_table_is_the_recorded_sweep(monkeypatch):
    """sched/split.py's RECORDED is what benchmarks/results/fused.json measured."""
    import json
    import mknumba._compat
    from mknumba.sched import split
    monkeypatch.setattr(mknumba._compat, "SIMULATOR", False)   # choose() reads the table
    with open(os.path.join(ROOT, "benchmarks", "results", "fused.json")) as f:
        assert split.RECORDED == split.from_sweep(json.load(f))
    for (kernel, topo), rows in split.RECORDED.items():    # a recorded shape gets its row
        for m, k, sms, deliver, fold in rows:
            assert split.choose(kernel, topo, m, m, k, 132) == (sms, deliver, fold), \
                (kernel, topo, m, k)


def test_ranks_must_plan_the_same_exchange():
    """An op whose ranks disagree on what they write into each other's memory is refused at
    construction, naming the difference in the caller's terms (here one rank delivers
    partials, the other not), through the one rank-agreement check (``Comm.agree``)."""
    from types import SimpleNamespace
    from mknumba.kernels.gemm_rs import GemmReduceScatter
    from mknumba.runtime import Comm
    op = SimpleNamespace(name="GemmReduceScatter", m=256, n=64, k=16, bm=32, bn=32,
                         chunk_tiles=4, group_m=2, deliver=True, fold=False, shared_out=False)

    def agree(theirs):
        """Comm.agree of this op's fields, the other rank's made from ours by ``theirs``."""
        group = SimpleNamespace(Get_rank=lambda: 0,
                                allgather=lambda mine: [mine, (mine[0], theirs(mine[1]))])
        node = SimpleNamespace(allgather=lambda mine: [mine, mine])     # the scope
        comm = SimpleNamespace(_group=lambda scope: (group, (0, 1)), _check_open=lambda: None,
                               node_comm=node, meet=lambda group, what: None)
        Comm.agree(comm, op.name, GemmReduceScatter._agreement(op))
    agree(lambda mine: mine)
    with pytest.raises(mknumba.MkValueError,
                       match=r"rank 0 of the world, against rank 1\): deliver: True here, "
                             r"False there"):
        agree(lambda mine: dict(mine, deliver=False))


@pytest.mark.parametrize("direct", [False, True])
def test_role_split_when_a_gpu_owns_no_tiles(direct):
    """AllReduce with fewer tile rows than GPUs per node: some GPU reduces and finishes
    nothing, and still gets a valid split (one block per communication role at least; with
    the shared output written directly, pull only waits: one block)."""
    from types import SimpleNamespace
    from mknumba.kernels.gemm_ar import GemmAllReduce
    plan = ReducePlan(True, 32, 64, 32, 32, 2, 2, 0, 1, 4, 1)   # 1 tile row, G = 2, local 1
    assert len(plan.red_tiles) == 0 and plan.n_final == 0
    op = SimpleNamespace(comm_sms=16, plan=plan, allreduce=True, topology="2x2", adaptive=False,
                         name="GemmAllReduce", direct=direct)
    GemmAllReduce._roles(op, 132, 2, 2)
    rb = op.role_blocks
    assert sum(rb.values()) == 132 and min(rb["reduce"], rb["send"], rb["recv"], rb["pull"]) >= 1
    assert rb["pull"] == (1 if direct else (16 - rb["send"]) // 4)
