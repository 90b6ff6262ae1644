"""GPU runs of the proxy (2 GPUs: two emulated nodes over the dma transport)."""
import pytest

from mpi_util import run_mpi

pytestmark = pytest.mark.gpu


def _two_gpus():
    from numba import cuda
    return len(cuda.gpus) >= 2


@pytest.mark.parametrize("spec,flags,copy", [
    ("dma:ordered", "inline", "batch"), ("dma:completion", "inline", "batch"),
    ("dma:ordered", "event", "batch"), ("dma:completion", "event", "batch"),
    ("dma:ordered", "event", "each"), ("dma:completion", "inline", "each")])
def test_dma_stress_10k_commands(spec, flags, copy):
    """Every byte and flag, through a 16-slot ring; "event": every batch (however small) writes
    its completions on the second stream, behind an event recorded after its copies ("inline":
    none does, each writes them on its copy stream); "batch" (the default copy) falls back to
    "each" where the driver lacks cuMemcpyBatchAsync."""
    if not _two_gpus():
        pytest.skip("needs 2 GPUs")
    env = {"MKNUMBA_GPUS_PER_NODE": "1", "MKNUMBA_PROXY_SLOTS": "16", "NCCL_NVLS_ENABLE": "0",
           "MKNUMBA_DMA_COPY": copy,
           "MKNUMBA_DMA_EVENT_BYTES": "0" if flags == "event" else str(1 << 40)}
    out = run_mpi("proxy_stress.py", 2, spec, 10000, simulator=False, timeout=300, env=env)
    assert "every byte and flag checked" in out
