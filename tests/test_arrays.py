"""The public bf16 helpers NumPy users move data in and out with (``mk.bf16_array``,
``mk.to_float32``), against an independent float64 rounding, in the simulator."""
import textwrap

from mpi_util import run_python

SCRIPT = textwrap.dedent("""
    import numpy as np
    from numba import cuda
    import mknumba as mk

    rng = np.random.default_rng()
    x = rng.standard_normal(1000) * 10.0 ** rng.integers(-30, 30, 1000)
    x[:4] = [0.0, -0.0, np.inf, np.nan]
    h = mk.bf16_array(x)
    try:
        import ml_dtypes
        assert h.dtype == ml_dtypes.bfloat16, h.dtype
    except ImportError:
        assert h.dtype == np.uint16, h.dtype
    # independent reference: nearest bf16 by float64 distance to the two neighbours
    f = np.asarray(x, np.float32)
    u = f.view(np.uint32) & np.uint32(0xFFFF0000)
    lo, hi = u.view(np.float32).astype(np.float64), (u + np.uint32(0x10000)).view(np.float32)
    d_lo, d_hi = np.abs(f - lo), np.abs(hi.astype(np.float64) - f)
    back = mk.to_float32(h)
    assert back.dtype == np.float32 and back.shape == x.shape
    fin = np.isfinite(f) & np.isfinite(hi)
    want = np.where(d_hi[fin] < d_lo[fin], hi[fin], lo[fin])
    tie = d_hi[fin] == d_lo[fin]
    even = np.where((u[fin] >> 16) & 1, hi[fin], lo[fin])
    want = np.where(tie, even, want)
    assert (back[fin] == want).all(), "rounding"
    assert back[2] == np.inf and np.isnan(back[3]) and np.signbit(back[1])
    # out of an op's output: a device array of bf16 bits (the simulator's), bits on the host
    bits = np.asarray(h).view(np.uint16)
    assert (mk.to_float32(cuda.to_device(bits))[fin] == want).all()
    assert (mk.to_float32(bits.view(np.int16))[fin] == want).all()
    for bad in (np.zeros(3, np.float32), cuda.to_device(np.zeros(3, np.float64))):
        try:
            mk.to_float32(bad)
        except mk.MkValueError as e:
            assert "bf16" in str(e)
        else:
            raise AssertionError("a float array was read as bf16")
    print("bf16 helpers ok")
""")


def test_bf16_helpers_round_trip():
    assert "bf16 helpers ok" in run_python(SCRIPT)
