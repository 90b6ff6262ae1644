"""Work-arounds for numba's CUDA simulator (mknumba/_compat.py) hold."""
import textwrap

from mpi_util import run_python

# Forty launches of a kernel whose 256 threads share one static shared array, with Python
# switching threads as often as it can. numba's unlocked lookup gave some threads a second
# array (measured: 4 of 40 launches wrong); the locked one in _compat gives none.
RACE = textwrap.dedent("""
    import sys
    import numpy as np
    import mknumba  # noqa: F401  (applies the work-arounds)
    from numba import cuda

    @cuda.jit
    def transpose_kernel(src, dst):     # dst = src.T through one static shared tile
        tile = cuda.shared.array((32, 33), dtype=np.uint16)
        tx, ty, rows = cuda.threadIdx.x % 32, cuda.threadIdx.x // 32, cuda.blockDim.x // 32
        for j in range(ty, 32, rows):
            tile[j, tx] = src[j, tx]
        cuda.syncthreads()
        for j in range(ty, 32, rows):
            dst[j, tx] = tile[tx, j]

    sys.setswitchinterval(1e-6)
    rng = np.random.default_rng(0)
    wrong = 0
    for _ in range(40):
        src = rng.integers(0, 60000, (32, 32)).astype(np.uint16)
        dst = np.zeros((32, 32), np.uint16)
        transpose_kernel[1, 256](src, dst)
        wrong += not np.array_equal(dst, src.T)
    print("wrong", wrong)
""")


def test_static_shared_array_is_one_per_block_under_thread_switches():
    out = run_python(RACE)
    assert "wrong 0" in out, out
