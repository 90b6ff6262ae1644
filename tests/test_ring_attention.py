"""Ring Attention: sequence layouts (host), the kernel compiled for sm_90a without a GPU, one
GPU and 1x2 / 1x4 / 2x1 / 2x2 rings in the simulator against a float64 reference, bad input,
the adaptive split (1x2); on GPUs the same checks at larger sizes."""
import textwrap

import numpy as np
import pytest

from mpi_util import SharedLaunch, run_mpi, run_python

import mknumba  # noqa: E402,F401
from mknumba.sched.sequence import positions, shard, unshard  # noqa: E402


@pytest.mark.parametrize("layout", ["contiguous", "zigzag"])
@pytest.mark.parametrize("world", [1, 2, 4])
def test_shard_unshard_round_trip(layout, world):
    x = np.random.default_rng(0).standard_normal((2, world * 6, 3, 4))
    parts = [shard(x, r, world, layout) for r in range(world)]
    assert all(p.shape == (2, 6, 3, 4) for p in parts)
    assert np.array_equal(unshard(parts, layout), x)
    rows = np.concatenate([positions(r, 6, world, layout) for r in range(world)])
    assert sorted(rows.tolist()) == list(range(world * 6))      # every row exactly once


def test_zigzag_balances_causal_work():
    """Under a causal mask each query row attends to (its position + 1) keys: zigzag gives
    every rank the same total, contiguous gives the last rank W times... more than the first."""
    W, s = 4, 8
    work = {lay: [int((positions(r, s, W, lay) + 1).sum()) for r in range(W)]
            for lay in ("contiguous", "zigzag")}
    assert len(set(work["zigzag"])) == 1
    assert work["contiguous"][-1] > 3 * work["contiguous"][0]


@pytest.mark.slow
def test_ring_kernel_compiles_for_sm90a():
    """Both builds of the kernel (SIMT and sm90 compute roles), for their own declaration,
    compile to PTX for sm_90a without a GPU."""
    script = textwrap.dedent("""
        import numba.cuda.dispatcher as disp
        disp.get_current_device = lambda: type("D", (), {"compute_capability": (9, 0)})()
        from numba import cuda
        from mknumba.kernels.launch import signature
        from mknumba.kernels.ring_attention import make_kernel
        for tile in ("simt", "sm90"):
            k = make_kernel(tile)
            ptx, _ = cuda.compile_ptx(k.py_func, signature(k), cc=(9, 0))
            assert "atom.add.relaxed.gpu.u64" in ptx and "st.release.sys" in ptx, "flags"
            assert "ld.acquire.sys" in ptx, "the wait polls with acquire loads"
            if tile == "sm90":
                assert "mk_attn_sm90_load_kv" in ptx and "mk_attn_sm90_tile" in ptx
            print("compiled", tile, len(ptx))
    """)
    assert "compiled" in run_python(script, simulator=False)


ONE_GPU = textwrap.dedent("""
    import numpy as np
    from numba import cuda
    import mknumba as mk
    import ml_dtypes
    from ring_checks import reference as ref      # tests/mpi: the float64 reference
    rng = np.random.default_rng(1)

    # seq 11 is not a multiple of the tile; 4 heads over 2 KV heads (GQA); ml_dtypes bf16 in
    for causal in (False, True):
        f = [rng.standard_normal(s).astype(np.float32) for s in [(2, 11, 4, 8), (2, 11, 2, 8),
                                                                (2, 11, 2, 8)]]
        x = [a.astype(ml_dtypes.bfloat16) for a in f]
        out, lse = mk.attention(*x, causal=causal)
        ro, rl = ref(*(a.astype(np.float64) for a in x), causal)
        o = mk.from_bf16_bits(out.copy_to_host())
        err = np.linalg.norm(o - ro) / np.linalg.norm(ro)
        lerr = np.abs(lse.copy_to_host() - rl).max()
        assert err < 1e-2 and lerr < 1e-3, (causal, err, lerr)
        print("ok", causal, err, lerr)
    for bad, words in [(lambda: mk.attention(f[0], f[1], f[2]),
                        ("mknumba.attention", "float32")),
                       (lambda: mk.RingAttention(None, 1, 8, 4, 3, 8), ("kv_heads",)),
                       (lambda: mk.RingAttention(None, 1, 8, 4, 2, 12), ("head_dim",)),
                       (lambda: mk.RingAttention(None, 1, 7, 4, 2, 8, layout="zigzag"),
                        ("even",)),
                       (lambda: mk.RingAttention(None, 1, 8, 4, 2, 8, comm_sms=4),
                        ("comm_sms=4", "'adaptive'")),
                       (lambda: mk.RingAttention(None, 1, 8, 4, 2, 8, trace=True),
                        ("trace=True", "comm_sms='adaptive'")),
                       (lambda: mk.attention(x[0], x[1][:, :5], x[2]), ("k", "shape"))]:
        try:
            bad()
        except mk.MkValueError as e:
            assert all(w in str(e) for w in words), (str(e), words)
        else:
            raise AssertionError(f"no MkValueError for {words}")
    print("refused")
    from frame_checks import capturing     # every stream reads as being captured
    with capturing():
        for kw, words in [({}, ("mknumba.attention", "capture", "out= and lse=")),
                          (dict(out=out), ("without lse=",)),
                          (dict(out=out, lse=lse, scale=0.5), ("attention", "first call"))]:
            try:
                mk.attention(*x, causal=True, **kw)
            except mk.MkError as e:
                assert all(w in str(e) for w in words), (str(e), words)
            else:
                raise AssertionError(f"no MkError inside a capture for {words}")
    print("refused in a capture")
""")


def test_sim_one_gpu_attention_and_bad_input():
    pytest.importorskip("ml_dtypes")
    out = run_python(ONE_GPU)
    assert out.count("ok") == 2 and "refused in a capture" in out, out


def _passes(out, n):
    assert out.count("PASS ring") == 4 * n, out[-3000:]


# The runs of 2 ranks share one mpiexec start, those of 4 another (each its own mk.init and
# layout).
LAUNCH = {2: SharedLaunch(2), 4: SharedLaunch(4)}
SIM_RINGS = [("1x2", 2, 2, None), ("1x4", 4, 4, None), ("2x1", 2, 1, "sim:ordered"),
             ("2x2", 4, 2, "sim:completion")]
for _id, _ranks, _gpn, _transport in SIM_RINGS:
    LAUNCH[_ranks].add(f"test_sim_ring[{_id}]", "ring_checks.py", 1, 6, 2, 1, 16, 2,
                       env={"MKNUMBA_GPUS_PER_NODE": str(_gpn), "MKNUMBA_TRANSPORT": _transport})
LAUNCH[2].add("test_sim_1x2_adaptive_across_the_wrap", "ring_checks.py", 1, 6, 2, 1, 16, 2,
              "numba", "adaptive", env={"MKNUMBA_GPUS_PER_NODE": "2"})


@pytest.mark.parametrize("ranks", [
    pytest.param(2, id="1x2"),
    pytest.param(4, id="1x4", marks=pytest.mark.slow),
    pytest.param(2, id="2x1", marks=pytest.mark.slow),
    pytest.param(4, id="2x2", marks=pytest.mark.slow)])
def test_sim_ring(ranks, request):
    """Both layouts, causal and not, GQA, seq_local 6 (a partial tile of 8 rows), 2 calls;
    between nodes the slices go through the proxy (both completion modes) and, on 2x2, are
    forwarded inside the node."""
    _passes(LAUNCH[ranks].output(request), ranks)


def test_sim_1x2_adaptive_across_the_wrap(request):
    """comm_sms="adaptive" (``roles.controller``): the compute blocks also push this rank's
    slice, each next item the controller's; both layouts, causal and not, 2 calls from call
    2**32 - 2 (across the epoch's wrap) against the float64 reference; the controller's
    counts, the queues' tickets, which blocks did the items, the saved trace."""
    out = LAUNCH[2].output(request)
    assert out.count("PASS adaptive ring") == 4 * 2, out[-3000:]


@pytest.mark.gpu
def test_gpu_attention_one_gpu():
    """mk.attention on the GPU's own tile (sm90 on an H200) and its SIMT twin against float64
    PyTorch: d 64 and 128, causal and not, GQA, ragged lengths, 100 calls."""
    out = run_mpi("attention_checks.py", 1, simulator=False)
    assert out.count("PASS attention") == 11, out[-4000:]


@pytest.mark.gpu
def test_gpu_ring_1x2_hundred_calls_torch():
    out = run_mpi("ring_checks.py", 2, 2, 256, 4, 2, 64, 100, "torch", simulator=False,
                  env={"NCCL_NVLS_ENABLE": "0"})
    _passes(out, 2)


@pytest.mark.gpu
def test_gpu_ring_2x1_dma_numba():
    out = run_mpi("ring_checks.py", 2, 1, 200, 4, 4, 128, 10, "numba", simulator=False,
                  env={"NCCL_NVLS_ENABLE": "0", "MKNUMBA_GPUS_PER_NODE": "1",
                       "MKNUMBA_TRANSPORT": "dma:ordered"})
    _passes(out, 2)


@pytest.mark.gpu
def test_gpu_ring_1x2_adaptive():
    """comm_sms="adaptive" on the GPU's tile (sm90 on an H200: the producer lane hands each
    item to the consumer warpgroups): 30 calls with fresh inputs into poisoned outputs, across
    the epoch's wrap, each against the reference; the controller's state and trace."""
    out = run_mpi("ring_checks.py", 2, 2, 256, 4, 2, 64, 30, "torch", "adaptive",
                  simulator=False,
                  env={"NCCL_NVLS_ENABLE": "0", "MKNUMBA_ALLOW_SHARED_GPU": "1"})
    assert out.count("PASS adaptive ring") == 4 * 2, out[-4000:]


@pytest.mark.gpu
@pytest.mark.parametrize("arrays", ["torch", "numba"])
def test_gpu_ring_1x2_graph(arrays):
    """Captured in a CUDA graph on every rank (torch.cuda.graph / a numba stream through
    cuda.bindings), both layouts, causal and not: a capture that would allocate lse is refused;
    20 replays with a fresh sequence in the captured q, k, v, each checked; an ordinary call
    between them."""
    out = run_mpi("ring_checks.py", 2, 2, 256, 4, 2, 64, 20, arrays, "graph", simulator=False,
                  env={"NCCL_NVLS_ENABLE": "0", "MKNUMBA_ALLOW_SHARED_GPU": "1"})
    assert out.count("PASS graph ring") == 4 * 2, out[-4000:]
