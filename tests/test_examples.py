"""The examples run as the README says (CPU-only machines: numba's simulator at a small size)
and check their own results: a wrong result exits non-zero, which fails these tests."""
import os

import pytest

from mpi_util import ROOT, run_mpi

EXAMPLES = os.path.join(ROOT, "examples")


@pytest.mark.slow
def test_readme_main_example_ring_attention():
    """As written in the README: no NUMBA_ENABLE_CUDASIM. Without a GPU the library picks the
    simulator itself and says so once (not once per rank)."""
    from conftest import HAVE_GPU
    out = run_mpi(os.path.join(EXAMPLES, "ring_attention.py"), 4, timeout=300,
                  env={"NUMBA_ENABLE_CUDASIM": None})
    assert "Ring attention over 4 ranks" in out and "OK" in out, out[-3000:]
    if not HAVE_GPU:
        assert out.count("numba's CUDA simulator stands in") == 1, out[-3000:]


@pytest.mark.slow
def test_allgather_example():
    out = run_mpi(os.path.join(EXAMPLES, "allgather.py"), 4, timeout=300)
    assert "3 calls match NumPy" in out, out[-3000:]


@pytest.mark.slow
def test_gemm_reduce_scatter_example():
    out = run_mpi(os.path.join(EXAMPLES, "gemm_reduce_scatter.py"), 2, timeout=600)
    for op in ("GemmReduceScatter", "GemmAllReduce"):
        line = next((x for x in out.splitlines() if x.startswith(f"{op}: ")), "")
        assert line.endswith("2 calls match NumPy"), out[-3000:]


@pytest.mark.gpu
def test_examples_on_gpu():
    """The README's first command and the other examples on GPUs, at their GPU sizes (ranks
    share the GPUs where there are fewer)."""
    out = run_mpi(os.path.join(EXAMPLES, "ring_attention.py"), 2, timeout=300, simulator=False)
    assert "Ring attention over 2 ranks" in out and "OK" in out, out[-3000:]
    out = run_mpi(os.path.join(EXAMPLES, "allgather.py"), 2, timeout=300, simulator=False)
    assert "3 calls match NumPy" in out, out[-3000:]
