"""AllGatherGemm: the tile order (host), multi-rank runs in the simulator (1x2 with every check,
1x4, 2x1 and 2x2 through the proxy) and on GPUs. The checks live in
``tests/mpi/allgather_gemm_checks.py``; the sm_90a compile check in ``test_compile.py``.

Simulator shapes are ragged and tiny (every simulated call costs about a second): m = 80 on
two ranks is 40 rows each, so the 32-row tile row 1 spans both shards; parts of 16 rows (16,
16, 8) do not line up with the tiles either; n = 40 leaves a partial tile column.
"""
import numpy as np
import pytest

from mpi_util import SharedLaunch, run_mpi

from mknumba.sched.tiles import arrival_order, gather_order

SIM = ("m=80", "n=40", "k=8", "part_rows=16")


def _passes(out, check, n):
    assert out.count(f"PASS {check} ") == n, out[-4000:]


# ---- the tile order (host) ----------------------------------------------------------------------
def test_arrival_order_local_then_node_then_rail_peer_first():
    # world rank 5 = node 1, local 1 of 4 GPUs per node, 3 nodes
    assert arrival_order(5, 1, 4, 3).tolist() == [5, 4, 7, 6, 1, 0, 3, 2, 9, 8, 11, 10]
    assert arrival_order(1, 1, 2, 1).tolist() == [1, 0]
    assert arrival_order(0, 0, 1, 2).tolist() == [0, 1]


@pytest.mark.parametrize("shard,bm", [(64, 32), (40, 32), (10, 32)])
def test_tile_order_follows_arrival(shard, bm):
    """Every tile once; a tile row comes after every shard it reads has arrived, and all tile
    rows of one arrival before the next arrival's (a ragged tile row that spans two shards
    waits for the later one)."""
    arrival = arrival_order(2, 0, 2, 2)              # [2, 3, 0, 1]
    m, tiles_n = 4 * shard, 3
    order = gather_order(m, shard, bm, tiles_n, arrival, 2)
    tiles_m = -(-m // bm)
    assert sorted(order.tolist()) == list(range(tiles_m * tiles_n))
    when = np.argsort(arrival)
    tm = order // tiles_n
    ready = [max(when[r // shard] for r in range(t * bm, min(m, t * bm + bm))) for t in tm]
    assert ready == sorted(ready)
    if shard % bm == 0:
        assert ready[0] == 0                         # this rank's own rows first


# ---- simulator, several ranks -------------------------------------------------------------------
# The runs of 2 ranks share one mpiexec start, those of 4 another (each its own mk.init and
# layout).
TWO, FOUR = SharedLaunch(2), SharedLaunch(4)
SIM_1X2_CHECKS = ("calls", "inplace", "bad", "disagree", "wrap", "alternate", "adaptive",
                  "timeout")
TWO.add("test_sim_1x2_every_check", "allgather_gemm_checks.py", ",".join(SIM_1X2_CHECKS), *SIM,
        "calls=3")
TWO.add("test_sim_2x1_through_the_proxy", "allgather_gemm_checks.py", "calls", *SIM, "calls=2",
        env={"MKNUMBA_GPUS_PER_NODE": "1", "MKNUMBA_TRANSPORT": "sim:ordered"})


def test_sim_1x2_every_check(request):
    """3 calls back to back (b row-major and as w.T, the gathered A into a buffer of the
    caller's), a and b updated in place, bad input, ranks that disagree, the wrap of the call
    counter, alternating with an AllGather, comm_sms="adaptive" (3 calls across the wrap), a
    peer that never calls: one launch."""
    out = TWO.output(request)
    for check in SIM_1X2_CHECKS:
        _passes(out, check, 2)
    assert out.count("topology 1x2") == 2 * len(SIM_1X2_CHECKS), out[-4000:]


@pytest.mark.slow
def test_sim_2x1_through_the_proxy(request):
    """Each shard goes to the other node through the proxy (ordered: data, then flag)."""
    out = TWO.output(request)
    _passes(out, "calls", 2)
    assert out.count("topology 2x1") == 2, out[-4000:]


FOUR.add("test_sim_2x2_forwarded_inside_the_node", "allgather_gemm_checks.py", "calls,wrap",
         "m=40", "n=16", "k=8", "part_rows=4", "calls=2",
         env={"MKNUMBA_GPUS_PER_NODE": "2", "MKNUMBA_TRANSPORT": "sim:completion"})


@pytest.mark.slow
def test_sim_2x2_forwarded_inside_the_node(request):
    """Each shard crosses to the other node once, to its rail peer (completion mode: the
    receiving proxy sets the flag), which forwards it to the other GPU of its node. 10 rows
    per rank: one tile row spans four shards. Then across the wrap of the call counter: the
    receiving proxy restores each epoch from its low bits and the flag's last value, which
    ``_start_at`` must set too (``Comm.flags_set``)."""
    out = FOUR.output(request)
    _passes(out, "calls", 4)
    _passes(out, "wrap", 4)
    assert out.count("'forward': 1") == 4, out[-4000:]


FOUR.add("test_sim_1x4_four_shards", "allgather_gemm_checks.py", "calls", *SIM, "calls=2")


@pytest.mark.slow
def test_sim_1x4_four_shards(request):
    """Four GPUs of one node: each rank's 20 rows are broadcast to three peers, and a 32-row
    tile row spans two shards (parts of 16 rows straddle them too)."""
    out = FOUR.output(request)
    assert out.count("PASS calls ") == 4, out[-4000:]
    assert out.count("topology 1x4") == 4, out[-4000:]


# ---- GPUs -------------------------------------------------------------------------------------
GPU_ENV = {"NCCL_NVLS_ENABLE": "0"}
GPU_SHAPE = ("m=2000", "n=776", "k=264")        # ragged in every dimension on 128 x 256 x 64


@pytest.mark.gpu
def test_gpu_1x2_twenty_calls_torch():
    """20 calls back to back with torch tensors (b row-major and as w.T, the gathered A into
    a tensor of the caller's every other call), in-place updates, bad input, the wrap, a
    peer that never calls."""
    checks = ("calls", "inplace", "bad", "wrap", "timeout")
    out = run_mpi("allgather_gemm_checks.py", 2, ",".join(checks), *GPU_SHAPE, "calls=20",
                  "arrays=torch", simulator=False, env=GPU_ENV)
    for check in checks:
        _passes(out, check, 2)


@pytest.mark.gpu
def test_gpu_1x2_adaptive():
    """comm_sms="adaptive" (``roles.controller``): 20 calls back to back across the wrap,
    fresh inputs, poisoned outputs, each against the reference; the controller's log,
    measurements and queues after them."""
    out = run_mpi("allgather_gemm_checks.py", 2, "adaptive", *GPU_SHAPE, "calls=20",
                  simulator=False, env=dict(GPU_ENV, MKNUMBA_ALLOW_SHARED_GPU="1"))
    _passes(out, "adaptive", 2)
    assert out.count("adaptive=1") == 2, out[-4000:]


@pytest.mark.gpu
def test_gpu_2x1_dma_numba():
    """Two emulated nodes: the shards through the dma transport's copy engine; n a whole
    number of 64-column panels (B [k, n] read in one copy per k-step, ``gemm_inputs.b_map``;
    the other tests' n = 776 reads it a panel at a time)."""
    env = dict(GPU_ENV, MKNUMBA_GPUS_PER_NODE="1", MKNUMBA_TRANSPORT="dma:ordered")
    out = run_mpi("allgather_gemm_checks.py", 2, "calls", *GPU_SHAPE, "n=1024", "calls=10",
                  simulator=False, env=env)
    _passes(out, "calls", 2)


@pytest.mark.gpu
@pytest.mark.parametrize("arrays", ["torch", "numba"])
def test_gpu_1x2_graph(arrays):
    """Captured in a CUDA graph on every rank (torch.cuda.graph / a numba stream through
    cuda.bindings): a capture that would allocate out is refused; one graph of two calls (b
    row-major with the gathered A collected, b as w.T), 20 replays with fresh a and b in the
    captured inputs, each checked; an ordinary call between them."""
    out = run_mpi("allgather_gemm_checks.py", 2, "graph", *GPU_SHAPE, "calls=20",
                  f"arrays={arrays}", simulator=False,
                  env=dict(GPU_ENV, MKNUMBA_ALLOW_SHARED_GPU="1"))
    _passes(out, "graph", 2)
