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


def test_operand_refuses_the_other_byte_order():
    """An array whose dtype is stored in the other byte order ('>u2', '>f4': NumPy names them
    uint16 and float32 too) would be read with its bytes swapped: refused, naming the op, the
    argument and the byte order. Checked on a stand-in CUDA array (no GPU needed), or in the
    simulator (which takes NumPy arrays only) on NumPy arrays."""
    import numpy as np
    import pytest
    from mknumba._compat import SIMULATOR
    from mknumba.arrays import operand
    from mknumba.errors import MkValueError

    class Cai:
        def __init__(self, typestr):
            self.__cuda_array_interface__ = dict(shape=(4, 8), typestr=typestr, strides=None,
                                                 data=(0x10000, False), version=3)

    def array(typestr):
        return np.zeros((4, 8), typestr) if SIMULATOR else Cai(typestr)
    for typestr, dtypes in (("|u1", ("uint8",)), ("<u2", ("uint16",))):
        assert operand(array(typestr), "Op", "x", dtypes=dtypes, align=0).dtype == dtypes[0]
    for typestr, dtypes in ((">u2", ("uint16",)), (">f4", ("float32",))):
        with pytest.raises(MkValueError, match=f"Op: x has dtype {typestr} .byte order '>'"):
            operand(array(typestr), "Op", "x", dtypes=dtypes, align=0)


def test_positive_ints():
    """Counts and dimensions: positive integers as ints, None passed through; anything else
    refused naming the op and the field."""
    import numpy as np
    import pytest
    from mknumba.errors import MkValueError, positive_ints
    assert positive_ints("Op", a=3, b=np.int64(2), c=4.0, d=None) == dict(a=3, b=2, c=4, d=None)
    for bad in (0, -1, 1.5, "2", float("inf"), float("nan"), [1]):
        with pytest.raises(MkValueError, match="Op: a must be a positive integer"):
            positive_ints("Op", a=bad)


def test_plan_dtype_spellings():
    """The fused ops' dtype= takes bfloat16 as a string, NumPy's ml_dtypes type (the class,
    which they refused as "<class 'ml_dtypes.bfloat16'>") or its dtype; anything else is
    refused naming the op."""
    import ml_dtypes
    import numpy as np
    import pytest
    import mknumba as mk
    from mknumba.arrays import check_bf16, dtype_name
    for d in ("bfloat16", "bf16", ml_dtypes.bfloat16, np.dtype(ml_dtypes.bfloat16)):
        check_bf16("SomeOp", d)
        assert dtype_name(d) in ("bfloat16", "bf16")
    for d in (np.uint16, np.float16, "float32"):
        with pytest.raises(mk.MkValueError, match="SomeOp: dtype must be bfloat16"):
            check_bf16("SomeOp", d)


def test_unshared_counts_outputs_among_absent_arrays():
    """A None address (no array) keeps its place: the first ``outputs`` places are the
    outputs whether or not one is absent (inputs that overlap each other are fine)."""
    from mknumba.arrays import unshared
    assert unshared(set(), (1000, None, 5000, 5010), (100, 100, 50, 50), 2)
    assert not unshared(set(), (1000, None, 5000, 1050), (100, 100, 50, 50), 2)
