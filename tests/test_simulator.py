"""Work-arounds for numba's CUDA simulator (mknumba/_compat.py) hold."""
import textwrap

from mpi_util import run_python

# numba's simulator looks a block's static shared array up by the calling line and creates it
# when missing, without a lock: two simulated threads switched between the lookup and the store
# get two arrays. Here a lookup that waits (bounded) for the other thread to look up too forces
# exactly that interleaving every time: unlocked, both miss and make an array each; with the
# lock in _compat the second waits for the first, whose wait times out, and finds its array.
# The same run checks numba's own (unlocked) lookup fails it, so the check can fail.
RACE = textwrap.dedent("""
    import sys
    import threading
    import numpy as np
    import mknumba  # noqa: F401  (applies the work-arounds)
    from numba.cuda.simulator import kernelapi

    class Racing(dict):
        def __init__(self):
            self.barrier = threading.Barrier(2)

        def get(self, key, default=None):
            found = super().get(key, default)
            try:                  # return only once the other thread has looked up too
                self.barrier.wait(timeout=0.5)
            except threading.BrokenBarrierError:
                pass
            return found

    def arrays():
        shared = kernelapi.FakeCUDAShared(0)
        shared._allocations = Racing()
        got = []

        def thread():
            got.append(shared.array((4,), np.float32))    # one line: one static array
        ts = [threading.Thread(target=thread) for _ in range(2)]
        for t in ts:
            t.start()
        for t in ts:
            t.join()
        return len({id(a) for a in got})

    print("locked", arrays())

    def numba_array(self, shape, dtype, alignment=None):    # numba's lookup, unlocked
        frame = sys._getframe(1)
        caller = (frame.f_code.co_filename, frame.f_lineno)
        res = self._allocations.get(caller)
        if res is None:
            res = self._allocations[caller] = np.empty(shape, dtype)
        return res
    kernelapi.FakeCUDAShared.array = numba_array
    print("unlocked", arrays())
""")


def test_static_shared_array_is_one_per_block_under_thread_switches():
    out = run_python(RACE)
    assert "locked 1" in out and "unlocked 2" in out, out


# _compat also replaces two pieces of numba's simulator for speed, with the same rules: the
# block manager (woken by its threads at barriers and exits instead of polling them) and the
# swap of a function's ``cuda`` global for the fake module around each simulated call.
# roles.compute widens bf16 from a table in the simulator.
BLOCKS = textwrap.dedent("""
    import numpy as np
    import mknumba  # noqa: F401  (applies the work-arounds)
    from numba import cuda
    from mknumba.roles import compute as C

    @cuda.jit(device=True)
    def lane():
        return cuda.threadIdx.x          # the fake module's, inside the swap

    @cuda.jit
    def rounds(out, counts):
        smem = cuda.shared.array(64, np.int64)
        t = lane()
        v = t
        for r in range(5):               # each round reads a neighbour's value of the last
            smem[t] = v
            cuda.syncthreads()
            v = smem[(t + 1) % cuda.blockDim.x] + 1
            cuda.syncthreads()
        counts[cuda.blockIdx.x, 0] = cuda.syncthreads_count(t % 3 == 0)
        counts[cuda.blockIdx.x, 1] = cuda.syncthreads_and(t < 64)
        counts[cuda.blockIdx.x, 2] = cuda.syncthreads_or(t == 5)
        if t >= 48:                      # the rest still meet at barriers without them
            return
        cuda.syncthreads()
        out[cuda.blockIdx.x, t] = v

    out = np.full((3, 64), -1, np.int64)
    counts = np.zeros((3, 3), np.int64)
    rounds[3, 64](out, counts)
    want = (np.arange(64) + 5) % 64 + 5
    assert (out[:, :48] == want[:48]).all() and (out[:, 48:] == -1).all(), out
    assert (counts == [22, 1, 1]).all(), counts
    import numba.cuda as real
    assert globals()["cuda"] is real and lane.fn.__globals__["cuda"] is real   # swapped back

    import time

    def nap(s):                          # host Python, which a simulated thread may call
        time.sleep(s)

    @cuda.jit
    def late(out):
        smem = cuda.shared.array(1, np.int64)
        t = cuda.threadIdx.x
        if t == 1:                       # ends while the others wait for thread 0
            nap(0.1)
            return
        if t == 0:
            nap(0.3)
            smem[0] = 42
        cuda.syncthreads()
        out[t] = smem[0]

    out = np.zeros(16, np.int64)
    late[1, 16](out)
    assert out[1] == 0 and (out[[0] + list(range(2, 16))] == 42).all(), out

    @cuda.jit
    def fails(out):
        if cuda.threadIdx.x == 7:
            raise ValueError("thread seven")
        cuda.syncthreads()
        out[cuda.threadIdx.x] = 1

    try:
        fails[1, 16](np.zeros(16, np.int64))
    except ValueError as e:
        assert "tid=[7, 0, 0]" in str(e) and "thread seven" in str(e), e
    else:
        raise AssertionError("a thread's exception did not reach the launch")
    print("blocks ok")

    rng = np.random.default_rng(0)
    low = rng.integers(0, 1 << 16, 1 << 16)
    for i in range(1 << 16):
        for got, want in ((C.bf16_to_f32(np.uint16(i)), C.bf16_to_f32_bits(np.uint16(i))),
                          (C.bf16_hi_to_f32(np.uint32(i << 16 | low[i])),
                           C.bf16_hi_to_f32_bits(np.uint32(i << 16 | low[i])))):
            assert type(got) is type(want) is np.float32, (i, type(got), type(want))
            assert got.view(np.uint32) == want.view(np.uint32), (i, got, want)
    print("bf16 table ok")
""")


def test_simulator_speedups_keep_numbas_rules():
    """Barriers (syncthreads and its count/and/or forms, threads that returned early left out,
    none passed before the last live thread arrives),
    a thread's exception raised by the launch, the fake ``cuda`` inside a device function and
    the real one back after the launch; the bf16 table equals the conversion functions on every
    input."""
    out = run_python(BLOCKS)
    assert "blocks ok" in out and "bf16 table ok" in out, out
