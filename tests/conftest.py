"""Shared test configuration: the ``gpu`` and ``slow`` markers and compiling for sm_90a
without a GPU."""
import os
import sys

import pytest

sys.path.insert(0, os.path.dirname(__file__))


def _gpu_available():
    if os.environ.get("NUMBA_ENABLE_CUDASIM") == "1":
        return False
    try:
        from numba import cuda
        return cuda.is_available()
    except Exception:
        return False


HAVE_GPU = _gpu_available()


def pytest_configure(config):
    config.addinivalue_line("markers", "gpu: needs a CUDA GPU (skipped cleanly without one)")
    config.addinivalue_line("markers", "slow: a slow simulator run or sm_90a link (pytest -m "
                                       "\"not slow\" leaves them out; CI runs all)")


def pytest_collection_modifyitems(config, items):
    if HAVE_GPU:
        return
    skip = pytest.mark.skip(reason="no CUDA GPU on this machine (run benchmarks/run_gpu.sh on one)")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


@pytest.fixture
def fake_sm90(monkeypatch):
    """Let device functions compile for sm_90 on a machine without a CUDA driver.

    numba-cuda asks the current device for its compute capability when it compiles a device
    function; compile_ptx(cc=...) alone does not cover that call.
    """
    import mknumba  # noqa: F401  (numpy compatibility first)
    import numba.cuda.dispatcher as disp
    if not HAVE_GPU:
        monkeypatch.setattr(disp, "get_current_device",
                            lambda: type("FakeSm90", (), {"compute_capability": (9, 0)})())
    yield (9, 0, "a")
