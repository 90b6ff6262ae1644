"""The tile moves of the reduction roles (roles/reduce.py) on ragged tiles, against NumPy.

One block of the sm90 kernel's width (288 threads: 9 warps; one warp in the simulator, whose
threads are slow Python threads) sums three
"GPUs'" bf16 tiles (three buffers on one device, reached through an address table like
``peer_view`` does for NVLink peers), combines a stage tile with two received ones, pushes the
results into the other "GPUs'" buffers (AllReduce) or leaves them alone, and copies a tile. Tiles are ragged (37 x 70 words, 5 x 66 in the simulator: neither the row nor the column
steps divide them), and
outputs start poisoned, so a word left unwritten shows. Runs in the simulator
(CI) and on a GPU.
"""

import pytest

from mpi_util import run_python

SCRIPT = r"""
import numpy as np
from numba import cuda
import mknumba
from mknumba import primitives as prim
from mknumba._compat import SIMULATOR
from mknumba.roles.reduce import sum_local, copy_tile_2d, reduce_peers

W, R0, C0, POISON = 80, 3, 5, 0x7FC07FC07FC07FC0
THREADS, ROWS, WCOLS = (32, 5, 66) if SIMULATOR else (288, 37, 70)


def bf16_words(x):          # float32 [.., 4k] -> uint64 words of 4 bf16
    u = np.ascontiguousarray(x, np.float32).view(np.uint32)
    b = ((u + 0x7FFF + ((u >> 16) & 1)) >> 16).astype(np.uint16)
    return b.view(np.uint64)


def words_f32(w):
    return (np.asarray(w).view(np.uint16).astype(np.uint32) << 16).view(np.float32)


@cuda.jit
def k_reduce(ptrs, template, members, me, out, push):
    reduce_peers(ptrs, template, members, me, R0 * W + C0, W, out, 0, WCOLS, push, ROWS, WCOLS)


@cuda.jit
def k_combine(own, recv, nsrc, out, ptrs, template, members, me, push):
    sum_local(own, 0, recv, 0, ROWS * WCOLS, nsrc, out, 0, WCOLS, ptrs, template, members,
              me, R0 * W + C0, W, push, ROWS, WCOLS, WCOLS)


@cuda.jit
def k_copy(src, dst):
    copy_tile_2d(src, R0 * W + C0, W, dst, 0, WCOLS, ROWS, WCOLS)


rng = np.random.default_rng(5)
vals = [rng.standard_normal((64, 4 * W)).astype(np.float32) for _ in range(3)]
hosts = [bf16_words(v).reshape(-1) for v in vals]
devs = [cuda.to_device(h) for h in hosts]
if SIMULATOR:
    toks = [1000 + i for i in range(3)]
    for t, d in zip(toks, devs):
        prim.sim_register(t, d)
    ptrs = cuda.to_device(np.array(toks, np.uint64))
else:
    ptrs = cuda.to_device(np.array([d.__cuda_array_interface__["data"][0] for d in devs],
                                   np.uint64))
f32 = [words_f32(h).reshape(64, 4 * W) for h in hosts]


# Bit-exact: the float32 sum of ``terms`` in the kernel's order, rounded once to bf16. (Two
# bf16 terms: rounding their float32 sum to bf16 gives the same bits as rounding the exact sum,
# since 24 >= 2 * 8 + 2 bits; so this also checks the packed adds' single rounding.)
def check(got_words, terms, what):
    rows, cols = terms[0].shape
    got = np.asarray(got_words).reshape(rows, cols // 4)
    assert (got != POISON).all(), f"{what}: {int((got == POISON).sum())} words unwritten"
    acc = np.zeros((rows, cols), np.float32)
    for t in terms:
        acc = acc + t.astype(np.float32)
    want = bf16_words(acc).reshape(rows, cols // 4)
    bad = int((got != want).sum())
    assert bad == 0, f"{what}: {bad} of {got.size} words differ from the fp32 sum rounded once"


# Every other member's buffer holds ``got`` in the tile when ``push`` and is otherwise
# unchanged; this member's own buffer and the non-members' buffers are never touched.
def check_pushed(me, members, push, got, what):
    for p in range(3):
        now = devs[p].copy_to_host().reshape(64, W)
        want = hosts[p].reshape(64, W).copy()
        if push and p != me and p < members:
            want[R0:R0 + ROWS, C0:C0 + WCOLS] = np.asarray(got).reshape(ROWS, WCOLS)
        bad = int((now != want).sum())
        assert bad == 0, f"{what}: buffer of member {p}: {bad} words wrong"
        devs[p].copy_to_device(hosts[p])          # fresh inputs for the next case


# three members: fp32 accumulation (peers me+1, me+2, me); two: packed bf16 adds
for members in (3, 2):
    for me in ((members - 1,) if SIMULATOR else range(members)):
        terms = [f32[(me + 1 + j) % members][R0:R0 + ROWS, 4 * C0:4 * (C0 + WCOLS)]
                 for j in range(members)]
        for push in (True, False):
            out = cuda.to_device(np.full(ROWS * WCOLS, POISON, np.uint64))
            k_reduce[1, THREADS](ptrs, devs[me], members, me, out, push)
            what = f"reduce_peers members={members} me={me} push={push}"
            check(out.copy_to_host(), terms, what)
            check_pushed(me, members, push, out.copy_to_host(), what)

tiles = [bf16_words(rng.standard_normal((ROWS, 4 * WCOLS))).reshape(-1) for _ in range(3)]
own, recv = cuda.to_device(tiles[0]), cuda.to_device(np.concatenate(tiles[1:]))
for nsrc, members, me, push in ((2, 3, 1, True), (1, 2, 0, True), (1, 3, 2, False)):
    out = cuda.to_device(np.full(ROWS * WCOLS, POISON, np.uint64))
    k_combine[1, THREADS](own, recv, nsrc, out, ptrs, devs[me], members, me, push)
    what = f"sum_local nsrc={nsrc} members={members} push={push}"
    check(out.copy_to_host(), [words_f32(t).reshape(ROWS, -1) for t in tiles[:1 + nsrc]], what)
    check_pushed(me, members, push, out.copy_to_host(), what)

dst = cuda.to_device(np.full(ROWS * WCOLS, POISON, np.uint64))
k_copy[1, THREADS](devs[1], dst)
want = hosts[1].reshape(64, W)[R0:R0 + ROWS, C0:C0 + WCOLS].reshape(-1)
assert (dst.copy_to_host() == want).all(), "copy_tile_2d"

print("reduce roles ok")
"""


def _run(sim):
    out = run_python(SCRIPT, simulator=sim, timeout=900)
    assert "reduce roles ok" in out
    return out


def test_tile_moves_in_simulator():
    _run(sim=True)


@pytest.mark.gpu
def test_tile_moves_on_gpu():
    _run(sim=False)
