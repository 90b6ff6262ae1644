"""MoeDispatchGemm: multi-rank runs in the simulator (1x2, every check in one launch; 2x1 and
2x2 through the proxy) and on GPUs. The checks live in ``tests/mpi/moe_dispatch_checks.py``; the sm_90a link check in
``test_compile.py``.

Simulator shapes are tiny (every simulated call costs about a second): hidden 16, ffn 24 (a
partial 32-column tile), 4 experts (2 per rank), top-2, up to 12 tokens per rank, 4 tokens
per flag, so a rank's tokens span three units and the worst case (every slot of every token
to one expert: 48 rows) spans two tile rows. 1x4 (not in CI, about 20 s on two cores):
``mpiexec -n 4 python -m mpi4py tests/mpi/moe_dispatch_checks.py calls,bad,capacity
experts=8 max_tokens=8`` with NUMBA_ENABLE_CUDASIM=1.
"""
import pytest

from mpi_util import SharedLaunch, run_mpi

SIM = ("comm_sms=6", "unit=4")       # 2 pack and 4 pull blocks: every role strides


# Between nodes: fewer blocks and smaller sizes (each rank's blocks run one at a time).
SIM_NODES = ("comm_sms=3", "unit=4", "hidden=8", "ffn=8", "ehf=0")
# The runs of 2 ranks share one mpiexec start (each its own mk.init and layout).
TWO = SharedLaunch(2)
SIM_1X2_CHECKS = ("calls", "inplace", "bad", "badid", "disagree", "capacity", "timeout")
TWO.add("test_sim_1x2_every_check", "moe_dispatch_checks.py", ",".join(SIM_1X2_CHECKS), *SIM)
TWO.add("test_sim_1x2_adaptive_across_the_wrap", "moe_dispatch_checks.py", "calls", "unit=4",
        "adaptive=1")
TWO.add("test_sim_2x1_through_the_proxy", "moe_dispatch_checks.py", "calls,badid", *SIM_NODES,
        "max_tokens=8", env={"MKNUMBA_GPUS_PER_NODE": "1", "MKNUMBA_TRANSPORT": "sim:ordered"})


def test_a_layout_is_four_views_of_its_buffer():
    """counts, offsets, rows and weights read and write the buffer's items from where
    ``MoeLayout.parts`` says (weights as float32 bits), unpack and index in that order; a
    buffer that is not an array is refused."""
    import numpy as np
    from mknumba import MkValueError, MoeLayout
    El, cap = 3, 5
    buf = np.arange(MoeLayout.words(El, cap), dtype=np.int32)
    assert MoeLayout.words(El, cap) == 2 * El + 1 + 4 * cap
    assert [p[1] for p in MoeLayout.parts(El, cap)] == [0, 3, 7, 22]
    lay = MoeLayout(buf, El, cap)
    counts, offsets, rows, weights = lay
    assert counts.tolist() == [0, 1, 2] and offsets.tolist() == [3, 4, 5, 6]
    assert rows.shape == (cap, 3) and rows[0].tolist() == [7, 8, 9]
    assert rows[-1].tolist() == [19, 20, 21]
    assert weights.dtype == np.float32 and weights.shape == (cap,)
    lay.weights[:] = 0.5
    lay.rows[1, 2] = -1
    assert (buf[22:].view(np.float32) == 0.5).all() and buf[12] == -1
    assert len(lay) == 4 and lay[1].tolist() == lay.offsets.tolist()
    assert "experts=3, capacity=5" in repr(lay)
    with pytest.raises(MkValueError, match="MoeLayout: buffer must be a device array"):
        MoeLayout([0] * 27, El, cap)


def _passes(out, check, n):
    assert out.count(f"PASS {check} ") == n, out[-4000:]


def test_sim_1x2_every_check(request):
    """Five routings (uniform, Zipf-hot, every token to one expert, a rank that sends
    nothing, experts and a rank that receive nothing) on two ops called in turn across the
    epoch's wrap, w updated in place, bad input, expert ids out of range (found on the
    device), ranks that disagree, a capacity overflow, a peer that never calls: one
    launch."""
    out = TWO.output(request)
    for check in SIM_1X2_CHECKS:
        _passes(out, check, 2)
    assert out.count("topology 1x2") == 2 * len(SIM_1X2_CHECKS), out[-4000:]


def test_sim_1x2_adaptive_across_the_wrap(request):
    """comm_sms="adaptive" (``roles.controller``): the compute blocks also pull the rows, 16
    at a time, each next item the controller's; the five routings (an expert, a rank that
    receives nothing, a rank that sends nothing, every token to one expert) across the epoch's
    wrap against the float64 reference; the controller measured each tile and pull once, and
    the queues hold the epoch rule's tickets."""
    out = TWO.output(request)
    _passes(out, "calls", 2)
    assert out.count("adaptive=1") == 2 and out.count("'pull': 0") == 2, out[-4000:]


def test_sim_2x1_through_the_proxy(request):
    """The five routings across two nodes of one GPU: each rank's meta region and token
    units go to the other node through the proxy (ordered: data, then flag), the forward
    role there announces them; an expert id out of range on one rank."""
    out = TWO.output(request)
    _passes(out, "calls", 2)
    _passes(out, "badid", 2)
    assert out.count("topology 2x1") == 4, out[-4000:]


def test_sim_2x2_pulled_from_the_rail_peer():
    """The five routings on two nodes of two GPUs (completion mode: the receiving proxy sets
    the flags): a GPU pulls another node's tokens over NVLink from its rail peer there."""
    env = {"MKNUMBA_GPUS_PER_NODE": "2", "MKNUMBA_TRANSPORT": "sim:completion"}
    out = run_mpi("moe_dispatch_checks.py", 4, "calls", *SIM_NODES, "experts=8",
                  "max_tokens=6", "wrap=0", env=env)
    _passes(out, "calls", 4)
    assert out.count("topology 2x2") == 4 and out.count("'forward': 1") == 4, out[-4000:]


# ---- GPUs -------------------------------------------------------------------------------------
GPU_ENV = {"NCCL_NVLS_ENABLE": "0"}
GPU_SHAPE = ("hidden=264", "ffn=776", "experts=8", "top_k=2", "max_tokens=300")  # ragged tiles


@pytest.mark.gpu
def test_gpu_1x2_torch():
    """The same checks on two GPUs with torch tensors (the sm90 TMA + wgmma tile), 4 rounds
    of the five routings."""
    checks = ("calls", "inplace", "bad", "badid", "disagree", "capacity", "timeout")
    out = run_mpi("moe_dispatch_checks.py", 2, ",".join(checks), *GPU_SHAPE, "calls=4",
                  "arrays=torch", simulator=False, env=GPU_ENV)
    for check in checks:
        _passes(out, check, 2)


@pytest.mark.gpu
def test_gpu_1x2_adaptive():
    """comm_sms="adaptive" on the GPU's tile, two ranks sharing one GPU or not: 6 rounds of
    the five routings (30 calls) with fresh tokens, routing and weights into poisoned outputs,
    across the epoch's wrap, each against the reference; the controller's state after them."""
    out = run_mpi("moe_dispatch_checks.py", 2, "calls", *GPU_SHAPE, "calls=6", "adaptive=1",
                  "arrays=torch", simulator=False,
                  env=dict(GPU_ENV, MKNUMBA_ALLOW_SHARED_GPU="1"))
    _passes(out, "calls", 2)
    assert out.count("adaptive=1") == 2, out[-4000:]


@pytest.mark.gpu
@pytest.mark.parametrize("arrays", ["torch", "numba"])
def test_gpu_1x2_graph(arrays):
    """Captured in a CUDA graph (torch.cuda.graph / a numba stream through cuda.bindings):
    a capture that would allocate is refused; 20 replays with fresh routing in the captured
    inputs, each checked."""
    out = run_mpi("moe_dispatch_checks.py", 2, "graph", *GPU_SHAPE, f"arrays={arrays}",
                  simulator=False, env=GPU_ENV)
    _passes(out, "graph", 2)


@pytest.mark.gpu
def test_gpu_2x1_dma():
    """Two emulated nodes: meta regions and token units (64 tokens: several per rank)
    through the dma transport's copy engine (4 rounds of the five routings), expert ids out
    of range, a graph capture; ffn a whole number of 64-column panels (w [E/W, hidden, ffn]
    read in one copy per k-step, ``gemm_inputs.b_map``; the other tests' ffn = 776 reads it a
    panel at a time)."""
    env = dict(GPU_ENV, MKNUMBA_GPUS_PER_NODE="1", MKNUMBA_TRANSPORT="dma:ordered")
    out = run_mpi("moe_dispatch_checks.py", 2, "calls,badid,graph", *GPU_SHAPE, "ffn=768",
                  "calls=4", "unit=64", "arrays=torch", simulator=False, env=env)
    for check in ("calls", "badid", "graph"):
        _passes(out, check, 2)
    assert out.count("topology 2x1") == 6, out[-4000:]
