"""MoeDispatchGemm: multi-rank runs in the simulator (1x2, every check in one launch) and on
GPUs. The checks live in ``tests/mpi/moe_dispatch_checks.py``; the sm_90a link check in
``test_compile.py``.

Simulator shapes are tiny (every simulated call costs about a second): hidden 16, ffn 24 (a
partial 32-column tile), 4 experts (2 per rank), top-2, up to 12 tokens per rank, 4 tokens
per flag, so a rank's tokens span three units and the worst case (every slot of every token
to one expert: 48 rows) spans two tile rows. 1x4 (not in CI, about 20 s on two cores):
``mpiexec -n 4 python -m mpi4py tests/mpi/moe_dispatch_checks.py calls,bad,capacity
experts=8 max_tokens=8`` with NUMBA_ENABLE_CUDASIM=1.
"""
import pytest

from mpi_util import run_mpi

SIM = ("comm_sms=6", "unit=4")       # 2 pack and 4 pull blocks: every role strides


def _passes(out, check, n):
    assert out.count(f"PASS {check} ") == n, out[-4000:]


def test_sim_1x2_every_check():
    """Five routings (uniform, Zipf-hot, every token to one expert, a rank that sends
    nothing, experts and a rank that receive nothing) on two ops called in turn across the
    epoch's wrap, w updated in place, bad input, ranks that disagree, a capacity overflow, a
    peer that never calls: one launch."""
    checks = ("calls", "inplace", "bad", "disagree", "capacity", "timeout")
    out = run_mpi("moe_dispatch_checks.py", 2, ",".join(checks), *SIM)
    for check in checks:
        _passes(out, check, 2)
    assert out.count("topology 1x2") == 2 * len(checks), out[-4000:]


class _Comm:
    """What planning reads of a Comm, for a topology of several nodes."""
    size, rank, nodes, local_size = 4, 0, 2, 2

    def agree(self, what, fields):
        pass


def test_several_nodes_refused_clearly():
    import mknumba as mk
    with pytest.raises(mk.MkValueError, match="one node for now .* 2 nodes of 2 GPUs"):
        mk.MoeDispatchGemm(_Comm(), 64, 64, 8, 2, 16)


# ---- GPUs -------------------------------------------------------------------------------------
GPU_ENV = {"NCCL_NVLS_ENABLE": "0"}
GPU_SHAPE = ("hidden=264", "ffn=776", "experts=8", "top_k=2", "max_tokens=300")  # ragged tiles


@pytest.mark.gpu
def test_gpu_1x2_torch():
    """The same checks on two GPUs with torch tensors (the sm90 TMA + wgmma tile), 4 rounds
    of the five routings."""
    checks = ("calls", "inplace", "bad", "disagree", "capacity", "timeout")
    out = run_mpi("moe_dispatch_checks.py", 2, ",".join(checks), *GPU_SHAPE, "calls=4",
                  "arrays=torch", simulator=False, env=GPU_ENV)
    for check in checks:
        _passes(out, check, 2)
