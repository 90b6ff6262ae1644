"""mknumba.gemm: scheduler, SIMT twin (simulator), sm_90a compile + link without a GPU, validation.

GPU tests (marked ``gpu``) skip without a CUDA device.
"""
import os
import shutil
import subprocess
import textwrap

import numpy as np
import pytest

from mpi_util import run_python

import mknumba  # noqa: E402,F401
from mknumba.errors import MkValueError  # noqa: E402
from mknumba.sched.tiles import (cdiv, default_group_m, gemm_group_m, plan_grid,  # noqa: E402
                                 tile_coords_host)
from numba import cuda  # noqa: E402

requires_gpu = pytest.mark.skipif(not cuda.is_available(), reason="needs a CUDA GPU")


# ---- scheduler ----------------------------------------------------------------------------------
@pytest.mark.parametrize("tiles_m,tiles_n,group_m", [(5, 7, 2), (64, 32, 16), (1, 1, 4), (3, 9, 8),
                                                     (33, 5, 16)])
def test_tile_order_is_a_bijection(tiles_m, tiles_n, group_m):
    seen = [tile_coords_host(t, tiles_m, tiles_n, group_m) for t in range(tiles_m * tiles_n)]
    assert sorted(seen) == [(i, j) for i in range(tiles_m) for j in range(tiles_n)]


def test_tile_order_groups_rows():
    # The first group_m * tiles_n tiles stay inside the first band of group_m tile rows,
    # row index fastest: consecutive tiles share a B column.
    order = [tile_coords_host(t, 64, 32, 16) for t in range(16 * 32)]
    assert {m for m, _ in order} == set(range(16))
    assert order[:3] == [(0, 0), (1, 0), (2, 0)]
    assert order[16] == (0, 1)


def test_plan_grid_holds_back_sms():
    p = plan_grid(132, 1, 16)
    assert (p.grid, p.compute_blocks, p.other_blocks) == (132, 116, 16)
    p = plan_grid(132, 2, 8)
    assert (p.grid, p.compute_blocks, p.other_blocks) == (264, 248, 16)
    with pytest.raises(ValueError):
        plan_grid(132, 1, 132)
    with pytest.raises(ValueError):
        plan_grid(132, 1, -1)


def test_default_group_m():
    assert default_group_m(64, 32, 132) == 16
    assert default_group_m(2, 32, 132) == 2
    assert cdiv(257, 128) == 3
    # the plain GEMM: bands of at most 4 rows where every tile runs in one wave, else the same
    assert gemm_group_m(16, 8, 132) == 4 and default_group_m(16, 8, 132) == 16
    assert gemm_group_m(8, 16, 128) == 4 and gemm_group_m(2, 32, 132) == 2
    assert gemm_group_m(16, 9, 132) == 16 and gemm_group_m(64, 32, 132) == 16


# ---- SIMT twin under the simulator (own process: the simulator is chosen at import) ------------
SIM_SCRIPT = textwrap.dedent("""
    import numpy as np
    from numba import cuda
    from mknumba.kernels.gemm import Gemm
    from mknumba.roles.compute import SIMT_TILE

    def bf16(x):
        u = x.astype(np.float32).view(np.uint32)
        return ((u + 0x7FFF + ((u >> 16) & 1)) >> 16).astype(np.uint16)

    def f32(b):
        return (b.astype(np.uint32) << 16).view(np.float32)

    rng = np.random.default_rng(1)
    # odd multiples of the tile: ragged last tile row/column, several tiles per block; B as
    # [n, k], row-major [k, n] (read as it is) and a column-major [k, n] view of an [n, k]
    # array; b updated in place between the two calls (same address, new values)
    for m, n, k, layout, reserved in [(40, 72, 24, "nk", 0), (70, 40, 16, "kn", 1),
                                      (3 * SIMT_TILE[0] + 5, 2 * SIMT_TILE[1] + 8, 8, "nk", 2),
                                      (16, 40, 8, "kn_view", 0)]:
        a = bf16(rng.standard_normal((m, k)))
        op = Gemm(reserved_sms=reserved)
        out = cuda.to_device(np.full((m, n), 0x7FC0, np.uint16))  # poisoned: NaN
        db = None
        for call in range(2):  # two calls: epochs advance, flags follow
            b_nk = bf16(rng.standard_normal((n, k)))
            b = b_nk if layout in ("nk", "kn_view") else np.ascontiguousarray(b_nk.T)
            if db is None:
                db = cuda.to_device(b)
            else:
                db.copy_to_device(b)
            out.copy_to_device(np.full((m, n), 0x7FC0, np.uint16))
            op(cuda.to_device(a), db.T if layout == "kn_view" else db,
               b_layout="nk" if layout == "nk" else "kn", out=out)
        c = f32(out.copy_to_host())
        ref = f32(a).astype(np.float64) @ f32(b_nk).T.astype(np.float64)
        err = np.linalg.norm(c - ref) / np.linalg.norm(ref)
        tiles = -(-m // SIMT_TILE[0]) * -(-n // SIMT_TILE[1])
        flags = op.tile_flags(m, n, k, "nk" if layout == "nk" else "kn").copy_to_host()
        assert np.isfinite(c).all(), "unwritten outputs"
        assert err < 1e-2, (m, n, k, layout, err)
        assert op.calls() == (2, 2) and len(flags) == tiles and (flags == 2).all(), flags
        print("ok", m, n, k, layout, reserved, err)

    # the sm_90a builds, the opt-in ones among them, are refused by name before any launch
    from mknumba.errors import MkValueError
    from mknumba.kernels.gemm import gemm
    for tile in ("sm90", "sm90:kn", "sm90:pp", "sm90:pp:kn", "sm90:tms", "sm90:tms:kn"):
        try:
            Gemm(tile=tile)(cuda.to_device(a), cuda.to_device(a), b_layout="nk")
        except MkValueError as e:
            assert "needs a Hopper GPU" in str(e), e
        try:
            gemm(cuda.to_device(a), cuda.to_device(a), b_layout="nk", tile=tile)
        except MkValueError as e:
            assert "needs a Hopper GPU" in str(e), e
            print("refused", tile)
""")


def test_simt_twin_in_simulator():
    out = run_python(SIM_SCRIPT)
    assert out.count("ok") == 4 and out.count("refused") == 6, out


# ---- split-K (few output tiles, long K) -------------------------------------------------------
def test_split_k_rule_and_order():
    """The rule splits only few tiles over long K; slices are whole k-steps, none empty; the
    units are every slice of every tile, then the fold units (bands of each tile's rows, as
    many as keep them to one round of the blocks); the simulator's block order is checked (a
    fold must not wait on a later block there)."""
    from mknumba.kernels.gemm.plan import (_sim_safe, fold_parts_for, split_k_for,
                                           split_order, split_slices)
    assert split_k_for(16, 14336, 132) == 8          # 512 x 1024: 132 // 16 slices
    assert split_k_for(32, 8192, 132) == 4           # 1024 x 1024: 128 k-steps
    assert split_k_for(32, 2048, 132) == 2           # 32 k-steps: 2 slices of 16
    assert split_k_for(64, 4096, 132) == 2           # 2048 x 1024, 512 x 4096
    assert split_k_for(16, 4096, 132) == 4           # 512 x 1024 x 4096: 64 k-steps
    assert split_k_for(16, 1984, 132) == 1           # K too short: 31 k-steps
    assert split_k_for(67, 14336, 132) == 1          # more than half the blocks have a tile
    assert split_k_for(2048, 8192, 132) == 1
    assert split_slices(4096, 8) == (8, 512)
    assert split_slices(4104, 8) == (8, 576)         # 65 k-steps: 9 per slice, the last 2
    assert split_slices(200, 8) == (4, 64)           # no more slices than k-steps
    assert split_slices(136, 2) == (2, 128)          # 3 k-steps: 2 + 1
    assert split_slices(136, 3) == (3, 64)           # the last 8 deep
    assert split_slices(100, 1) == (1, 100) and split_slices(64, 4) == (1, 64)
    order = np.array([0, 2, 1, 3], np.int32)
    units = split_order(order, 3)
    assert units.dtype == np.int32 and list(units[:4]) == [0, 2, 1, 3]
    assert list(units[8:12]) == [8, 10, 9, 11] and list(units[12:]) == [12, 14, 13, 15]
    assert split_order(order, 1) is order
    units = split_order(order, 3, parts=2)               # two fold units a tile
    assert len(units) == 20 and list(units[:12]) == list(split_order(order, 3)[:12])
    assert list(units[12:16]) == [12, 14, 13, 15] and list(units[16:]) == [16, 18, 17, 19]
    assert _sim_safe(1, 3, 4) and _sim_safe(4, 3, 4) and _sim_safe(2, 2, 2)
    assert not _sim_safe(2, 2, 4) and not _sim_safe(1, 4, 4)
    assert _sim_safe(1, 2, 4, parts=2) and not _sim_safe(1, 3, 4, parts=2)   # 5th unit: block 0
    # fold units a tile: one round of the blocks, bands of at least 16 rows, at most 8
    assert fold_parts_for(16, 132, 128) == 8             # 512 x 1024: 128 units of 16 rows
    assert fold_parts_for(32, 132, 128) == 4             # 1024 x 1024
    assert fold_parts_for(64, 132, 128) == 2 and fold_parts_for(67, 132, 128) == 1
    assert fold_parts_for(2, 132, 128) == 8              # FOLD_MAX_PARTS
    assert fold_parts_for(1, 4, 32) == 2                 # the SIMT tile: 16-row bands at least
    assert fold_parts_for(16, 124, 128) == 4             # 8 SMs held back: 4 x 16 <= 124


def test_split_k_option_is_checked():
    from mknumba.kernels.gemm import Gemm
    for bad in (0, -2, 2.0, "4", True):
        with pytest.raises(MkValueError, match="split_k"):
            Gemm(split_k=bad)
    assert Gemm(split_k=np.int64(3)).split_k == 3 and Gemm().split_k is None
    # the whole-tile builds refuse a split when the op is made (also in the simulator, which
    # refuses their tiles only when a call would run them)
    for tile in ("sm90:pp", "sm90:pp:kn", "sm90:tms", "sm90:tms:kn"):
        with pytest.raises(MkValueError, match=f"tile='{tile}' takes no split_k"):
            Gemm(tile=tile, split_k=2)
        assert Gemm(tile=tile, split_k=1).split_k == 1 and Gemm(tile=tile).split_k is None


def test_group_m_option_is_checked():
    """A band height that is not a positive integer is refused when the op is made (a negative
    one scheduled tiles out of range and skipped others: wrong output, no error)."""
    from mknumba.kernels.gemm import Gemm
    for bad in (0, -1, 1.5, "2"):
        with pytest.raises(MkValueError, match="mknumba.gemm: group_m must be a positive"):
            Gemm(group_m=bad)
    assert Gemm(group_m=np.int64(4)).group_m == 4 and Gemm().group_m is None


def test_plans_of_one_op_share_its_grid():
    """shared_bps: a Gemm's plans may run kernels that fit different blocks per SM ("auto":
    the tensor-store build or the default one by shape; B's two layouts), but its call
    counter numbers launches of one grid: a plan launches the counter's grid, fewer blocks per
    SM than fit, or more (a split then checks its kernel's fit: _Plan)."""
    from mknumba.errors import MkError
    from mknumba.kernels.gemm.plan import shared_bps
    assert shared_bps(None, 132, 2) == 2          # the first plan sets the grid
    assert shared_bps(264, 132, 2) == 2           # the same grid
    assert shared_bps(132, 132, 2) == 1           # fewer than fit: co-resident
    assert shared_bps(264, 132, 1) == 2           # whole tiles: more than fit run later
    with pytest.raises(MkError, match="launches of 200 blocks"):
        shared_bps(200, 132, 2)


#: the simulator scripts' runner of split GEMMs (SPLIT_SCRIPT, TAIL_SCRIPT)
SPLIT_RUN = textwrap.dedent("""
    import os
    import numpy as np
    from numba import cuda
    import mknumba.kernels.gemm.op as G       # Gemm, and _SIM_SMS: the simulated SMs
    from mknumba.arrays import from_bf16_bits as f32, to_bf16_bits as bf16
    from mknumba.errors import MkTimeoutError, MkValueError

    rng = np.random.default_rng(7)

    def run(op, m, n, k, layout, calls=2, start=None):
        # fresh a and b each call, written into the same arrays (same addresses: the tensor
        # map rows and the workspace are reused), out poisoned (NaN) before each call; each
        # result against a float64 reference of that call's inputs
        da = cuda.to_device(np.zeros((m, k), np.uint16))
        db = cuda.to_device(np.zeros((n, k) if layout != "kn" else (k, n), np.uint16))
        out = cuda.to_device(np.zeros((m, n), np.uint16))
        worst = 0.0
        for call in range(calls):
            a = bf16(rng.standard_normal((m, k)))
            b_nk = bf16(rng.standard_normal((n, k)))
            da.copy_to_device(a)
            db.copy_to_device(np.ascontiguousarray(b_nk.T) if layout == "kn" else b_nk)
            out.copy_to_device(np.full((m, n), 0x7FC0, np.uint16))
            op(da, db.T if layout == "kn_view" else db, b_layout="nk" if layout == "nk" else
               "kn", out=out)
            if call == 0 and start is not None:
                op._start_at(start)       # after a first call made the plan and its flags
                continue
            c = f32(out.copy_to_host())
            ref = f32(a).astype(np.float64) @ f32(b_nk).T.astype(np.float64)
            err = np.linalg.norm(c - ref) / np.linalg.norm(ref)
            assert np.isfinite(c).all(), "unwritten outputs"
            assert err < 1e-2, (m, n, k, layout, call, err)
            worst = max(worst, err)
        return next(iter(op._plans.values())), worst

    def expect_timeout(op, call, flag):
        # call() ran a fold whose slices do not come: its wait ended at the deadline and was
        # recorded; the op raises it (calls(), and the next call, before it launches)
        call()
        for attempt in (op.calls, call):
            try:
                attempt()
                raise AssertionError("no timeout raised")
            except MkTimeoutError as e:
                assert "compute role" in str(e) and f"flag {flag} to reach epoch 2" in str(e), e
        print("ok timeout")
""")

SPLIT_SCRIPT = SPLIT_RUN + textwrap.dedent("""
    # (m, n, k, B's layout, split_k, blocks of the simulated GPU, slices and fold units a
    # tile expected): ragged m, n and K (no K a multiple of slices * 64), B as [n, k], row-major
    # [k, n] and a w.T view; None: the op's rule (one tile, K of 33 k-steps: 2 slices); two
    # fold units of 16 rows (m = 20: both bands hold rows; m <= 16: the second none), or one
    # where a second would wait on a later block here (3 slices); blocks=2: each block runs
    # two slices and then a fold
    for m, n, k, layout, split, blocks, slices, parts in [
            (2, 8, 2056, "nk", None, 4, 2, 2), (4, 16, 264, "kn", 3, 4, 3, 1),
            (3, 16, 136, "kn_view", 2, 4, 2, 2), (20, 24, 1032, "nk", 2, 4, 2, 2),
            (8, 40, 136, "nk", 2, 2, 2, 1)]:
        G._SIM_SMS = blocks
        op = G.Gemm(split_k=split)
        plan, err = run(op, m, n, k, layout)
        tiles = len(plan.tile_flags)
        assert (plan.slices, plan.parts) == (slices, parts), (plan.slices, plan.parts)
        flags = plan.flags.copy_to_host()
        assert op.calls() == (2, 2) and len(flags) == (slices + 1) * tiles and \
            (flags == 2).all(), flags
        print("ok", m, n, k, layout, split, slices, f"{err:.1e}")

    # across the 2**32 wrap of the call counter: epochs 2**32 - 1, then 1
    G._SIM_SMS = 4
    op = G.Gemm(split_k=3)
    plan, err = run(op, 4, 16, 264, "kn", calls=3, start=2**32 - 2)
    assert op.calls() == (0, 1), op.calls()
    assert (plan.flags.copy_to_host() == 1).all(), plan.flags.copy_to_host()
    print("ok wrap", f"{err:.1e}")

    # a fold that would wait on a later block of the simulator is refused before any launch
    try:
        run(G.Gemm(split_k=2), 8, 40, 136, "nk", calls=1)
    except MkValueError as e:
        assert "simulator" in str(e)
        print("ok refused")

    # a fold whose slices do not come (moved ahead of them): its wait ends at the deadline
    # and is recorded; the op raises it (calls(), and the next call, before it launches)
    os.environ["MKNUMBA_TIMEOUT_S"] = "0.2"        # read when the op plans a shape
    op = G.Gemm(split_k=3)
    plan, _ = run(op, 2, 8, 136, "nk", calls=1)
    plan.order.copy_to_device(np.roll(plan.order.copy_to_host(), 1))
    da, db = cuda.to_device(np.zeros((2, 136), np.uint16)), cuda.to_device(np.zeros((8, 136),
                                                                                     np.uint16))
    expect_timeout(op, lambda: op(da, db, b_layout="nk", out=cuda.device_array((2, 8),
                                                                             np.uint16)), 1)
""")


def test_split_k_in_simulator():
    """Split-K on the SIMT twin: against float64 references, inputs changed in place, outputs
    poisoned, the rule's choice and forced ones, several units per block, the wrap, a fold's
    bounded wait."""
    assert run_python(SPLIT_SCRIPT).count("ok") == 8


def test_tail_split_rule_and_order():
    """The tail split's rule at issue 23's shapes on an H200 (132 blocks, fewer with SMs held
    back): the last round's tiles, when at most half the blocks get one, cut into slices
    that all run at once, none shorter than SPLIT_MIN_STEPS k-steps, one slice fewer when that
    divides K evenly; the order runs the other tiles whole first."""
    from mknumba.kernels.gemm.plan import _sim_safe, split_order, tail_split_for
    # 512 x 28672: 448 tiles, 3 rounds + 52
    assert tail_split_for(448, 1024, 132) == (0, 1)      # 16 k-steps: one slice's worth
    for k in (2048, 4096, 8192):
        assert tail_split_for(448, k, 132) == (52, 2)    # 132 // 52 slices
    assert tail_split_for(512, 4096, 124) == (16, 4)     # 4096^3, 8 SMs held back: 4 + 16
    assert tail_split_for(512, 4096, 116) == (48, 2)     # 16 held back: 4 + 48
    assert tail_split_for(512, 4096, 132) == (0, 1)      # 116 of 132: no idle half
    # many rounds: a split tail saves less than TAIL_MIN_GAIN (4096 / 8192 x 28672, 16384 x
    # 8192: 28, 55 and 32 rounds)
    for tiles in (3584, 7168, 4096):
        assert tail_split_for(tiles, 8192, 132) == (0, 1)
    assert tail_split_for(2 * 132 + 40, 4096, 132) == (40, 2)   # 3 does not divide 64 k-steps
    assert tail_split_for(2 * 132 + 40, 3072, 132) == (40, 3)   # 48 k-steps: 3 does
    assert tail_split_for(2 * 132 + 4, 8192, 132) == (4, 4)     # TAIL_MAX_SLICES
    assert tail_split_for(2 * 132 + 26, 6144, 132) == (26, 4)   # 96 k-steps: 5 -> 4
    assert tail_split_for(2 * 132 + 26, 4480, 132) == (26, 4)   # 70: 4 (3 divides no better)
    assert tail_split_for(100, 8192, 132) == (0, 1) and tail_split_for(264, 8192, 132) == (0, 1)
    order = np.array([0, 2, 1, 4, 3], np.int32)
    units = split_order(order, 2, tail=2)                # tiles 4 and 3 of 5 in 2 slices
    assert units.dtype == np.int32
    assert list(units) == [0, 2, 1, 4, 3, 9, 8, 14, 13], list(units)
    assert list(split_order(order, 2)) == list(split_order(order, 2, tail=5))
    # the simulator meets every slice before its fold when all of the tail's units run in
    # one round, in blocks up to the fold's
    assert _sim_safe(1, 2, 4) and _sim_safe(1, 3, 4) and _sim_safe(2, 2, 6)
    assert not _sim_safe(2, 2, 4) and not _sim_safe(1, 4, 4)


def test_auto_takes_the_pingpong_tile_where_tiles_are_few():
    """"auto"'s ping-pong rule (``pp_for``) at issue 23's few-tile shapes on an H200 (132
    blocks): where 128 x 256 tiles are at most half the blocks, up to K = 8192 and where
    split-K would take at most 7 slices; never for other builds, many tiles, or K = 14336
    (split-K's slices win there)."""
    from mknumba.kernels.gemm.plan import pp_for
    for m, n in ((512, 4096), (2048, 1024), (512, 1024), (1024, 1024)):   # 64 / 16 / 32 tiles
        assert all(pp_for(kind, m, n, k, 132) for k in (512, 1024, 2048, 4096)
                   for kind in ("sm90", "sm90:kn"))
        assert pp_for("sm90", m, n, 8192, 132) == ((m, n) != (512, 1024))   # 16 tiles: 8 slices
        assert not pp_for("sm90", m, n, 14336, 132)
    assert pp_for("sm90", 512, 1024, 8192, 116)             # 16 SMs held back: 7 slices
    assert not pp_for("sm90", 512, 8192, 1024, 132)         # 128 tiles: more than half
    assert pp_for("sm90", 512, 8192, 1024, 300)             # ... of 132, not of 300 blocks
    assert not pp_for("simt", 512, 1024, 512, 132) and not pp_for("sm90:tms", 512, 1024, 512,
                                                                   132)


def test_auto_takes_the_pingpong_tile_where_rounds_fill_poorly(monkeypatch):
    """"auto"'s second ping-pong region (``pp_for``): many 128 x 256 tiles whose last round
    leaves blocks idle, where 128 x 128 tiles fill the rounds better, up to TMS_MAX_K (the
    tail split takes the last round beyond); on 132 blocks, of issue 23's grid only 512 x
    28672 (448 tiles, 4 rounds x 1.85 against 7 of 128 x 128)."""
    from mknumba.kernels.gemm import plan as G
    grid = [(m, n, k) for m in (512, 1024, 2048, 4096, 8192, 16384)
            for n in (1024, 4096, 8192, 28672) for k in (512, 1024, 2048, 4096, 8192, 14336)]
    many = [(m, n, k) for m, n, k in grid if (m // 128) * (n // 256) > 66]
    assert {s for s in many if G.pp_for("sm90", *s, 132)} == \
        {(512, 28672, k) for k in (512, 1024, 2048)}
    assert G.pp_shape_for(512, 28672, 132) == (128, 128)
    assert G.pp_for("sm90:kn", 512, 28672, 512, 132) and not G.pp_for("sm90:tms", 512, 28672,
                                                                       512, 132)
    assert not G.pp_for("sm90", 1024, 28672, 512, 132)       # 7 rounds x 1.85 < 14
    assert G.pp_rounds_cost((128, 128), 512, 28672, 132) == 7.0
    monkeypatch.setattr(G, "SM90_TILE_COST", 1.7)              # 4 x 1.7 < 7: the big tiles
    assert not G.pp_for("sm90", 512, 28672, 512, 132)


#: issue 23's few-tile rows on an H200 (132 blocks) -> the ping-pong tile shape "auto" takes
#: there (pp_shape_for with PP_TILE_COST), at the K where pp_for takes one (512 x 1024 x
#: 8192: 8 slices, PP_MAX_SLICES)
PP_PICKS = {(512, 1024): ((64, 64), (512, 1024, 2048, 4096)),     # 128 tiles of 64 x 64
            (1024, 1024): ((128, 64), (512, 1024, 2048, 4096, 8192)),     # 128 of 128 x 64
            (512, 4096): ((128, 128), (512, 1024, 2048, 4096, 8192)),     # 128 of 128 x 128
            (2048, 1024): ((128, 128), (512, 1024, 2048, 4096, 8192))}


def test_auto_pingpong_shape_by_tile_count(monkeypatch):
    """"auto"'s ping-pong tile shape (``pp_shape_for``): over issue 23's 24 shapes of the
    few-tile rows (K 512-14336), where ``pp_for`` takes a ping-pong tile, the shape whose
    rounds of tiles times its cost are least (ties to the larger tile), split-K elsewhere as
    before; fewer blocks or other costs move the pick; a shape left out of PP_TILE_COST is
    never taken (the rule switched off per tile shape)."""
    from mknumba.kernels.gemm import plan as G
    for (m, n), (shape, ks) in PP_PICKS.items():
        for k in (512, 1024, 2048, 4096, 8192, 14336):
            assert G.pp_for("sm90", m, n, k, 132) == (k in ks), (m, n, k)
        assert G.pp_shape_for(m, n, 132) == shape, (m, n)
    assert G.pp_shape_for(1000, 1000, 132) == (128, 64)        # ragged: 8 x 16 tiles
    assert G.pp_shape_for(2048, 1024, 300) == (128, 64)        # 256 tiles in one round
    assert G.pp_shape_for(1024, 1024, 100) == (64, 64)         # 3 rounds x 0.3 < 2 x 0.55
    assert G.pp_shape_for(1152, 1280, 1000) == (64, 64)        # every shape one round
    monkeypatch.setattr(G, "PP_TILE_COST", {(128, 128): 1.0, (64, 128): 0.55, (128, 64): 0.55})
    assert G.pp_shape_for(512, 1024, 132) == (128, 64)         # 64 x 64 off; a tie: taller
    monkeypatch.setattr(G, "PP_TILE_COST", {(128, 128): 1.0})
    assert all(G.pp_shape_for(m, n, 132) == (128, 128) for m, n in PP_PICKS)
    monkeypatch.setattr(G, "PP_TILE_COST", {(128, 128): 1.0, (128, 64): 0.4})
    assert G.pp_shape_for(2048, 1024, 132) == (128, 64)        # 2 rounds x 0.4 < 1


def test_pingpong_builds_by_name(monkeypatch):
    """The ping-pong tile's shapes by name: "sm90:pp" (128 x 128) and "sm90:pp:<BM>x<BN>",
    each also ":kn", are sm_90a builds of whole tiles only that Gemm takes by name (and
    refuses split_k for); no other shape is one. Their rings are as deep as fit an H200 SM
    (with the kernels' static shared memory). Their tensor maps' boxes follow the build's
    shape. Outside the simulator the builds themselves: shape, shared memory, threads, the
    ":kn" twin, the defines of their source, and the fused ops refuse them."""
    import types as pytypes
    from mknumba._compat import SIMULATOR
    from mknumba.kernels.gemm import Gemm, plan as G
    from mknumba.kernels import gemm_inputs
    from mknumba.roles import compute
    names = {(128, 128): "sm90:pp", (128, 64): "sm90:pp:128x64", (64, 128): "sm90:pp:64x128",
             (64, 64): "sm90:pp:64x64"}
    stages = {(128, 128): 6, (128, 64): 8, (64, 128): 8, (64, 64): 13}
    assert set(compute.SM90_PINGPONG_SHAPES) == set(names)
    for shape, name in names.items():
        assert compute.pp_name(shape) == name and compute.pp_stages(shape) == stages[shape]
        smem = compute.sm90_smem_bytes(shape)
        assert smem == stages[shape] * (shape[0] + shape[1]) * 128 + 8 * 16 * 128 + \
            16 * stages[shape] + 16 + 1024
        assert smem + 16 <= 232448 < smem + (shape[0] + shape[1]) * 128   # no slot more fits
        for n in (name, name + ":kn"):
            assert compute.is_sm90_name(n) and compute.whole_tiles_only(n), n
            G.check_tile_name(n)
            with pytest.raises(MkValueError, match=f"tile='{n}' takes no split_k"):
                Gemm(tile=n, split_k=2)
    assert compute.sm90_smem_bytes(True) == compute.sm90_smem_bytes((128, 128))
    for bad in ("sm90:pp:32x64", "sm90:pp:128x128", "sm90:pp:64x256:kn", "sm90:pp:kn:64x64"):
        assert not compute.is_sm90_name(bad)
        with pytest.raises(MkValueError, match="no tile build"):
            G.check_tile_name(bad)
    with pytest.raises(MkValueError, match="no ping-pong tile"):
        compute.pp_shape((64, 256))
    # tensor-map boxes from the build's shape: A 64 (k) x BM, B [n, k] 64 x BN; B [k, n] in
    # 64 x 64 panels, with n a whole number of panels all BN / 64 in one 3-d box (B seen as 64
    # columns x k rows x n / 64 panels: byte strides 2 n from row to row, 128 from panel to
    # panel), else one 2-d box per panel
    maps_made = []
    monkeypatch.setattr(gemm_inputs, "tensor_map",
                        lambda ptr, dims, box, pitch=None, strides=None: maps_made.append(
                            (tuple(dims), tuple(box), strides and tuple(strides))) or
                        np.zeros(16, np.uint64))
    for shape in names:
        bm, bn = shape
        for n, kn in [(1032, False), (1032, True), (1024, False), (1024, True)]:
            maps_made.clear()
            maps = pytypes.SimpleNamespace(m=520, n=n, k=200, shape=shape, slices=1, kc=0,
                                           c_map=False)
            gemm_inputs.TensorMaps._encode(maps, (0, 0, kn, None))
            b = ((n, 200), (64, 64), None) if kn and n % 64 else \
                ((64, 200, n // 64), (64, 64, bn // 64), (2 * n, 128)) if kn else \
                ((200, n), (64, bn), None)
            assert maps_made == [((200, 520), (64, bm), None), b], maps_made
    if SIMULATOR:
        return
    for shape, name in names.items():
        build, kn = compute.tile_build(name), compute.tile_build(compute.kn_kind(name))
        assert build.shape == kn.shape == shape and build.gemm_only and kn.b_kn
        assert build.smem_bytes == kn.smem_bytes == compute.sm90_smem_bytes(shape)
        assert build.threads == 288 and build.tma and not build.b_kn
        assert f"#define MK_PP_BM {shape[0]}\n#define MK_PP_BN {shape[1]}\n" \
            f"#define MK_PP_STAGES {stages[shape]}\n" in compute.sm90_defines(pingpong=shape)
    monkeypatch.setattr(G, "kind_for", lambda tile, op: tile)     # no GPU asked here
    for name in ("sm90:pp:64x64", "sm90:pp:128x64:kn"):
        with pytest.raises(MkValueError, match="mknumba.Gemm only"):
            G.fused_tile(name, "GemmReduce")


def test_pingpong_variants_by_name():
    """The ping-pong tile's variants "sm90:pp<letters>:<BM>x<BN>" (each also ":kn"), letters
    of d (MK_PP_DESC_ITER) and r (the early ramp) in that order: whole-tile sm_90a builds; only
    d adds a define; r is the kernel's (ramp_of: the prefetch of the block's first order
    entry), refused for other tiles. "auto" names one of them per shape (pp_auto_name)."""
    from mknumba.kernels.gemm import plan as G
    from mknumba.roles import compute
    for shape in compute.SM90_PINGPONG_SHAPES:
        for letters in ("d", "r", "dr"):
            name = compute.pp_variant_name(shape, letters)
            assert name == f"sm90:pp{letters}:{shape[0]}x{shape[1]}"
            for n in (name, name + ":kn"):
                assert compute.is_sm90_name(n) and compute.whole_tiles_only(n), n
                G.check_tile_name(n)
        plain = compute.sm90_defines(pingpong=shape)
        assert compute.sm90_defines(pingpong=shape, desc_iter=True) == \
            plain + "#define MK_PP_DESC_ITER 1\n"
        assert "MK_PP_DESC_ITER" not in plain
    for bad in ("", "rd", "x", "dd", "k"):
        with pytest.raises(MkValueError, match="no ping-pong variant"):
            compute.pp_variant_name((64, 64), bad)
    with pytest.raises(MkValueError, match="no tile build"):
        G.check_tile_name("sm90:ppd")
    with pytest.raises(MkValueError, match=r"^GemmReduceScatter: tile='foo': no tile build"):
        G.kind_for("foo", "GemmReduceScatter")     # names the op and its option
    with pytest.raises(MkValueError, match="ping-pong tile's"):
        compute.sm90_tile_functions(desc_iter=True)
    with pytest.raises(MkValueError, match="early ramp"):
        compute.sm90_build(early=True)
    build = compute.TileBuild(None, None, (64, 64), 288, 0, True, False)
    assert compute.ramp_of(build) is compute.no_prefetch
    assert compute.ramp_of(build._replace(early=True)) is compute.prefetch_first
    for shape, letters in G.PP_AUTO_VARIANT.items():
        assert G.pp_auto_name(shape) == f"sm90:pp{letters}:{shape[0]}x{shape[1]}"
        G.check_tile_name(G.pp_auto_name(shape) + ":kn")


TAIL_SCRIPT = SPLIT_RUN + textwrap.dedent("""
    from mknumba.roles.compute import SIMT_TILE
    from mknumba.sched.tiles import gemm_group_m, grouped_order
    import mknumba.kernels.gemm.plan as rules
    rules.SPLIT_MIN_STEPS = 1      # slices of one k-step: the rule splits tiny K here
    os.environ["MKNUMBA_TIMEOUT_S"] = "0.2"   # read when an op plans a shape (the last check)

    # (m, n, k, B's layout, simulated SMs, held back, tail, slices): ragged m, n and K, B as
    # a w.T view of [n, k] and row-major [k, n]; 5 tiles on 4 blocks, 3 slices (the last 8
    # deep), 3 calls across the 2**32 wrap of the call counter (epochs 2**32 - 1, then 1); 14
    # tiles on 6 of 7 blocks: a tail of 2, each block 2 whole tiles first (phase 2's ring
    # starts again at seq 0). The simulator runs blocks one at a time: every tail unit in the
    # first round, the folds last
    for m, n, k, layout, sms, held, tail, slices in [
            (1, 152, 136, "kn_view", 4, 0, 1, 3), (2, 424, 72, "kn", 7, 1, 2, 2)]:
        G._SIM_SMS = sms
        op = G.Gemm(reserved_sms=held)
        wrap = tail == 1
        plan, err = run(op, m, n, k, layout, calls=3 if wrap else 1,
                        start=2**32 - 2 if wrap else None)
        assert (plan.tail, plan.slices) == (tail, slices), (plan.tail, plan.slices)
        tiles_m, tiles_n = -(-m // SIMT_TILE[0]), -(-n // SIMT_TILE[1])
        whole = grouped_order(tiles_m, tiles_n, gemm_group_m(tiles_m, tiles_n, sms - held))
        tiles = tiles_m * tiles_n
        order = plan.order.copy_to_host()
        assert list(order[:tiles - tail]) == list(whole[:tiles - tail])
        assert op.calls() == ((0, 1) if wrap else (1, 1)), op.calls()
        # every tile's flag (phase 1's whole tiles, phase 2's folds) at the epoch, the tail's
        # slices' too, and no other slice flag written
        flags = plan.flags.copy_to_host()
        assert (flags[:tiles] == 1).all(), flags
        for j in range(slices):
            got, mine = flags[(1 + j) * tiles:(2 + j) * tiles], order[tiles - tail:tiles]
            assert (got[mine] == 1).all(), got
            assert (np.delete(got, mine) == (2**32 - 2 if wrap else 0)).all(), got
        print("ok", m, n, k, layout, tiles, "tiles on", sms - held, "blocks", f"{err:.1e}")
        if wrap:
            timed = op, plan, m, n, k, tiles

    # that op again, a fold moved ahead of its tail's slices (phase 2's order rotated)
    op, plan, m, n, k, tiles = timed
    G._SIM_SMS = 4
    order = plan.order.copy_to_host()
    order[tiles - 1:] = np.roll(order[tiles - 1:], 1)      # [whole tiles, fold, slices]
    plan.order.copy_to_device(order)
    da, db = cuda.to_device(np.zeros((m, k), np.uint16)), cuda.to_device(np.zeros((n, k),
                                                                                  np.uint16))
    expect_timeout(op, lambda: op(da, db.T, out=cuda.device_array((m, n), np.uint16)), 9)
""")


def test_tail_split_in_simulator():
    """The tail split on the SIMT twin: whole tiles, then the last round's tiles in slices and
    folds, against float64 references (inputs changed in place, outputs poisoned), each
    layout of B, a tail of 1 and 2 tiles, blocks with several whole tiles; the flags; calls
    across the wrap; a fold's bounded wait."""
    assert run_python(TAIL_SCRIPT).count("ok") == 3


# ---- sm_90a: compile the kernel with the linked helper and link a cubin, without a GPU ---------
COMPILE_SCRIPT = textwrap.dedent("""
    import sys
    import numba.cuda.dispatcher as disp
    # Device functions ask the driver for the current device; there is none here.
    disp.get_current_device = lambda: type("D", (), {"compute_capability": (9, 0)})()
    from numba import types
    from numba.cuda import compiler
    import mknumba.kernels.gemm.kernel as G

    name = sys.argv[2]
    build, kernel = G._build(name)
    from mknumba.kernels.launch import signature
    sig = signature(kernel)          # the kernel's own declaration
    lib, _ = compiler._compile_pyfunc_with_fixup(
        kernel.py_func, sig, device=False, cc=(9, 0, "a"),
        launch_bounds=(build.threads, 1), lto=True, abi="numba")
    lib._lto = True
    cubin = lib.get_cubin(cc=(9, 0, "a"))          # NVVM LTO-IR + NVRTC helper -> nvJitLink
    assert len(bytes(cubin.code)) > 10000
    ptx = lib.get_lto_ptx(cc=(9, 0, "a")).replace("\\x00", "")
    assert ptx.count("wgmma.mma_async") >= 4, "wgmma missing after LTO"
    assert "cp.async.bulk.tensor.2d" in ptx and "mbarrier.try_wait" in ptx
    assert f".maxntid {build.threads}" in ptx
    with open(sys.argv[1], "w") as f:
        f.write(ptx)
    print("linked", len(bytes(cubin.code)))
""")

#: the library's tile builds -> how their epilogue stores, in the linked PTX (their ":kn" twins
#: read B as [k, n]: tests/test_compile.py; the probe's other builds,
#: benchmarks/probe_gemm_tile.py, are compiled when it runs)
STORES = {"sm90": ["stmatrix.sync.aligned.m8n8.x4.shared.b16", "st.global.v4.u32"],
          "sm90:e2p1": ["stmatrix.sync.aligned.m8n8.x4.shared.b16", "st.global.v4.u32"],
          "sm90:pp": ["stmatrix.sync.aligned.m8n8.x4.shared.b16", "st.global.v4.u32"]}


def _ptxas():
    for p in (shutil.which("ptxas"), "/usr/local/cuda/bin/ptxas"):
        if p and os.path.exists(p):
            return p
    return None


@pytest.mark.parametrize("name", list(STORES))
@pytest.mark.slow
def test_sm90_kernel_compiles_and_links(tmp_path, name):
    """The library's tile builds (the plain GEMM's and the fused ops'): each links through
    nvJitLink LTO, stores as its header says, and keeps its accumulators in registers."""
    pytest.importorskip("cuda.bindings.nvjitlink")
    ptx_path = str(tmp_path / "gemm_sm90.ptx")
    assert "linked" in run_python(COMPILE_SCRIPT, ptx_path, name, simulator=False)
    import re
    with open(ptx_path) as f:
        stores = set(re.findall(r"\b(st\.(?:global|shared)\S*|stmatrix\S*)", f.read()))
    # scalar shared stores are the blocks' bookkeeping (barrier words, the call number)
    assert stores - {"st.shared.u32", "st.shared.b32", "st.shared.u64"} == \
        set(STORES[name]), stores
    ptxas = _ptxas()
    if ptxas is None:
        pytest.skip("linked and stores checked; no ptxas here for the register/spill report")
    # Resource report: no stack frame and no spills (the accumulators must stay in registers).
    # nvJitLink may emit a newer PTX ISA than the local ptxas reads; the instructions used here
    # exist since 8.0, so lower the header for this check.
    with open(ptx_path) as f:
        ptx = f.read()
    import re
    ptx = re.sub(r"^\.version \d+\.\d+", ".version 8.0", ptx, flags=re.M)
    with open(ptx_path, "w") as f:
        f.write(ptx)
    r = subprocess.run([ptxas, "-arch=sm_90a", "-v", ptx_path, "-o", str(tmp_path / "g.cubin")],
                       capture_output=True, text=True)
    assert r.returncode == 0, r.stderr
    assert "0 bytes stack frame, 0 bytes spill stores, 0 bytes spill loads" in r.stderr, r.stderr
    regs = int(re.search(r"Used (\d+) registers", r.stderr).group(1))
    threads = 320 if name.endswith("p1") else 288
    assert -(-regs // 8) * 8 * threads <= 65536   # one block per SM fits (8-register units)


# ---- validation (no GPU needed: refused before anything launches) ------------------------------
def test_rejects_host_arrays():
    from mknumba.kernels.gemm import gemm
    a = np.zeros((128, 64), np.uint16)
    with pytest.raises(MkValueError, match="host"):
        gemm(a, a.T.copy())


def test_rejects_bad_shapes_and_layouts():
    from mknumba.kernels.gemm.plan import check_shapes, kind_for
    with pytest.raises(MkValueError, match="multiples of 8"):
        check_shapes(128, 100, 64)
    with pytest.raises(MkValueError, match="multiples of 8"):
        check_shapes(128, 128, 60)
    with pytest.raises(MkValueError, match="empty"):
        check_shapes(0, 128, 64)
    check_shapes(129, 136, 72)  # ragged m and non-tile multiples are handled
    with pytest.raises(MkValueError, match="tile"):
        kind_for("tensorcore")


def test_tile_builds_for_b_as_kn():
    """Each library tile build has a twin reading B as [k, n] (``kn_kind``), the same shape,
    threads and shared memory; a build without one (a probe's) is refused by name."""
    from mknumba._compat import SIMULATOR
    from mknumba.roles import compute
    for kind in ("simt",) + (() if SIMULATOR else ("sm90", "sm90:e2p1", "sm90:pp", "sm90:tms",
                                                   "sm90:pp:128x64", "sm90:pp:64x128",
                                                   "sm90:pp:64x64")):
        base, kn = compute.tile_build(kind), compute.tile_build(compute.kn_kind(kind))
        assert kn.b_kn and not base.b_kn and kn.tile is not base.tile
        assert (kn.shape, kn.threads, kn.smem_bytes, kn.tma, kn.gemm_only) == \
            (base.shape, base.threads, base.smem_bytes, base.tma, base.gemm_only)
    if "test-probe" not in compute._BUILDS:
        compute.register_tile("test-probe", compute.tile_build("simt"))
    with pytest.raises(MkValueError, match="'test-probe' has no variant reading b as"):
        compute.kn_kind("test-probe", "test")


def test_pingpong_build_is_its_own_shape_and_gemm_only(monkeypatch):
    """The ping-pong tile: 128 x 128 tiles (the host's tile counts and tensor-map boxes come
    from the build), a ring that fits an H200 SM's 227 KB, the library's 288 threads; the
    fused ops refuse it by name (fused_tile: mk.Gemm only)."""
    from mknumba._compat import SIMULATOR
    from mknumba.kernels.gemm import plan as G
    from mknumba.roles import compute
    if SIMULATOR:
        pytest.skip("the sm_90a builds are made outside the simulator")
    pp = compute.tile_build("sm90:pp")
    assert pp.shape == (128, 128) and pp.gemm_only and not pp.timing_only and pp.tma
    assert pp.threads == compute.tile_build("sm90").threads == 288
    assert compute.tile_build("sm90").shape == (128, 256)
    assert 200 * 1024 < pp.smem_bytes <= 227 * 1024
    monkeypatch.setattr(G, "kind_for", lambda tile, op: tile)     # no GPU asked here
    for tile in ("sm90:pp", "sm90:pp:kn"):
        with pytest.raises(MkValueError, match="mknumba.Gemm only"):
            G.fused_tile(tile, "GemmReduce")
    assert G.fused_tile("sm90", "GemmReduce")[0] == "sm90"


def test_tms_build_keeps_the_ring_and_is_whole_tiles_only(monkeypatch):
    """The tensor-store tile ("sm90:tms"): the 4-stage ring (4 x 48 KB) and two 2 KB buffers
    per consumer warp (32 KB), barriers and 1 KB of alignment within an H200 block's 227 KB
    (232448 B, with the 16 bytes of static shared memory the kernel declares); C's tensor map
    only without split-K. Outside the simulator: the build's shape, threads, drain and C map,
    no split-K fold (so mk.Gemm's rule never splits it), the fused ops refuse it and mk.Gemm
    refuses split_k for it before compiling anything."""
    from mknumba._compat import SIMULATOR
    from mknumba.kernels.gemm import op, plan as G
    from mknumba.kernels.gemm_inputs import TensorMaps
    from mknumba.roles import compute
    smem = compute.sm90_smem_bytes(tms=True)
    assert smem == 4 * (128 + 256) * 64 * 2 + 8 * 2 * 16 * 128 + 16 * 4 + 16 + 1024
    assert smem - compute.sm90_smem_bytes() == 8 * 16 * 128 and smem + 16 <= 232448
    with pytest.raises(MkValueError, match="no split-K"):
        TensorMaps(512, 1024, 8192, (128, 256), slices=2, kc=4096, c_map=True)
    if SIMULATOR:
        return
    base, tms = compute.tile_build("sm90"), compute.tile_build("sm90:tms")
    assert (tms.shape, tms.threads, tms.smem_bytes, tms.tma) == \
        (base.shape, base.threads, smem, True)
    assert tms.gemm_only and tms.c_map and tms.drain is not None and tms.fold is None
    assert base.drain is None and not base.c_map and not base.gemm_only
    assert base.fold is not None          # split-K folds: the default tile's builds only
    kn = compute.tile_build("sm90:tms:kn")
    assert kn.b_kn and kn.c_map and kn.drain is not None and kn.smem_bytes == smem
    assert kn.fold is None and compute.tile_build("sm90:kn").fold is not None
    for module in (G, op):                                        # no GPU asked here
        monkeypatch.setattr(module, "kind_for", lambda tile, op="": tile)
    for tile in ("sm90:tms", "sm90:tms:kn"):
        with pytest.raises(MkValueError, match="mknumba.Gemm only"):
            G.fused_tile(tile, "GemmReduce")
    gemm_op = op.Gemm(tile="sm90:tms")
    gemm_op.split_k = 2              # past the constructor's check: the plan's own
    with pytest.raises(MkValueError, match="takes no split_k"):
        op._Plan(gemm_op, 512, 1024, 8192, "nk", None)


# ---- on a GPU ---------------------------------------------------------------------------------
@pytest.mark.gpu
@requires_gpu
@pytest.mark.parametrize("m,n,k,layout", [
    (128, 256, 64, "nk"), (1000, 776, 1096, "nk"), (389, 520, 200, "kn"),
    (4160, 8184, 1032, "kn_view"),
    # B row-major [k, n], read as it is (the ":kn" tile): n past a 64-column box and past a
    # whole tile (boxes left unloaded), k not a multiple of the 64-deep k-step, one 8 x 8 B
    (1000, 776, 1096, "kn"), (256, 264, 72, "kn"), (4160, 8184, 1032, "kn"), (130, 8, 8, "kn"),
    (2048, 2048, 512, "kn")])
def test_gemm_matches_fp32_reference(m, n, k, layout):
    """Two calls, b updated in place between them (same tensor, new values): each result
    against an fp32 reference of the inputs at that call."""
    torch = pytest.importorskip("torch")
    from mknumba.kernels.gemm import Gemm
    op = Gemm()
    a = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
    b_nk = torch.randn(n, k, device="cuda", dtype=torch.bfloat16)
    b = {"nk": b_nk, "kn": b_nk.T.contiguous(), "kn_view": b_nk.T}[layout]
    out = torch.empty((m, n), device="cuda", dtype=torch.bfloat16)
    for call in range(2):
        if call:
            fresh = torch.randn(n, k, device="cuda", dtype=torch.bfloat16)
            b.copy_(fresh if layout == "nk" else fresh.T)
            b_nk = fresh
        out.fill_(float("nan"))
        op(a, b, b_layout="nk" if layout == "nk" else "kn", out=out)
        torch.cuda.synchronize()
        ref = a.float() @ b_nk.float().T
        assert torch.isfinite(out).all()
        assert ((out.float() - ref).norm() / ref.norm()).item() <= 1e-2, call
    calls, epoch = op.calls()
    assert calls == 2 and epoch == 2
    tiles = op.tile_flags(m, n, k, "nk" if layout == "nk" else "kn").copy_to_host()
    assert (tiles == epoch).all()


def _twenty_calls(op, m, n, k, layout):
    """20 calls of ``op`` (B [n, k] or row-major [k, n]: ``layout``), a and b rewritten in
    place before each (the same addresses: tensor maps and workspace reused), the output
    poisoned (NaN); each result against an fp32 reference of that call's inputs (relative
    error <= 1e-2: bf16 partials add a rounding per slice). Returns the worst error."""
    torch = pytest.importorskip("torch")
    a = torch.empty(m, k, device="cuda", dtype=torch.bfloat16)
    b_nk = torch.empty(n, k, device="cuda", dtype=torch.bfloat16)
    b = b_nk if layout == "nk" else torch.empty(k, n, device="cuda", dtype=torch.bfloat16)
    out = torch.empty((m, n), device="cuda", dtype=torch.bfloat16)
    worst = 0.0
    for call in range(20):
        a.normal_()
        b_nk.normal_()
        if layout == "kn":
            b.copy_(b_nk.T)
        out.fill_(float("nan"))
        op(a, b, b_layout=layout, out=out)
        torch.cuda.synchronize()
        ref = a.float() @ b_nk.float().T
        assert torch.isfinite(out).all(), call
        err = ((out.float() - ref).norm() / ref.norm()).item()
        assert err <= 1e-2, (call, err)
        worst = max(worst, err)
    return worst


@pytest.mark.gpu
@requires_gpu
@pytest.mark.parametrize("layout", ["nk", "kn"])
@pytest.mark.parametrize("m,n,k,split_k,tile", [
    # issue 23's grid where 128 x 256 tiles leave most SMs idle and K is long (shorter K:
    # "auto" takes the ping-pong tile, pp_for): the op's rule splits
    (512, 1024, 14336, None, "auto"), (1024, 1024, 10240, None, "auto"),
    (2048, 1024, 14336, None, "auto"), (512, 4096, 9216, None, "auto"),
    # ragged m and n, K not a multiple of the slices' 64-deep steps
    (389, 1032, 8264, None, "auto"), (1000, 776, 9000, None, "auto"),
    # forced: several slices per block before the folds (64 tiles, 4 slices: 320 units), and
    # more tiles than blocks (512 tiles: folds after folds)
    (2048, 1024, 8192, 4, "auto"), (4096, 4096, 2048, 2, "auto"),
    # the fused ops' build (a warp of its own publishes the tile flags) forced to split: its
    # folds run the plain build's fold (mk_gemm_sm90_fold), whose flag consumer thread 0
    # releases while the publisher warp leaves; also ragged
    (2048, 1024, 8192, 4, "sm90:e2p1"), (389, 1032, 8264, 2, "sm90:e2p1")])
def test_gemm_split_k_matches_fp32_reference(m, n, k, split_k, tile, layout):
    """Split-K on the GPU: 20 calls (:func:`_twenty_calls`); a forced split cuts exactly
    ``split_k`` slices, in the tile build asked for; every flag at the last call's epoch."""
    from mknumba.kernels.gemm import Gemm
    op = Gemm(tile=tile, split_k=split_k)
    worst = _twenty_calls(op, m, n, k, layout)
    plan = next(iter(op._plans.values()))
    assert plan.slices > 1, "the rule did not split"
    assert split_k is None or plan.slices == split_k, plan.slices
    assert tile == "auto" or plan.kind.startswith(tile), plan.kind
    assert op.calls() == (20, 20)
    assert (plan.flags.copy_to_host() == 20).all()
    print(f"{m}x{n}x{k} {layout} {plan.kind}: {plan.slices} slices of {plan.kc}, folds in "
          f"{plan.parts} units a tile, worst rel err {worst:.1e}")


@pytest.mark.gpu
@requires_gpu
@pytest.mark.parametrize("layout", ["nk", "kn"])
def test_tms_tile_runs_whole_tiles_where_auto_splits(layout):
    """``Gemm(tile="sm90:tms")`` at 512 x 1024 x 8192, where "auto" cuts K into slices: the
    tensor-store build has no fold, so its plan computes whole tiles (16 of 128 x 256, one
    slice), correct in 20 calls (:func:`_twenty_calls`), every tile flag at the last epoch;
    "auto" on the same GPU does split that shape (the split-K rule is what the tile opts out
    of)."""
    from mknumba.kernels.gemm import Gemm
    op, auto = Gemm(tile="sm90:tms"), Gemm()
    worst = _twenty_calls(op, 512, 1024, 8192, layout)
    plan = next(iter(op._plans.values()))
    assert (plan.slices, plan.tail, plan.tile_shape) == (1, 0, (128, 256)), plan.slices
    assert plan.kind == "sm90:tms" + (":kn" if layout == "kn" else ""), plan.kind
    assert op.calls() == (20, 20) and (plan.tile_flags.copy_to_host() == 20).all()
    _twenty_calls(auto, 512, 1024, 8192, layout)
    assert next(iter(auto._plans.values())).slices > 1
    print(f"512x1024x8192 {layout}: sm90:tms whole tiles, worst rel err {worst:.1e}")


@pytest.mark.gpu
@requires_gpu
@pytest.mark.parametrize("layout", ["nk", "kn"])
@pytest.mark.parametrize("m,n,k,reserved,tail", [
    # issue 23's wave-quantized shapes on an H200 (132 SMs): 448 tiles = 3 rounds + 52;
    # 512 tiles on 124 and 116 blocks (4 + 16, 4 + 48); ragged m, n and K (65 k-steps:
    # slices of 33 and 32)
    (512, 28672, 4096, 0, 52), (4096, 4096, 4096, 8, 16), (4096, 4096, 4096, 16, 48),
    (389, 28664, 4104, 0, 52)])
def test_gemm_tail_split_matches_fp32_reference(m, n, k, reserved, tail, layout):
    """The tail split on the GPU (whole tiles, then the last round's tiles in slices and
    folds on a ring started afresh): 20 calls (:func:`_twenty_calls`); every tile flag and
    the tail's slice flags at the last call's epoch."""
    torch = pytest.importorskip("torch")
    from mknumba.kernels.gemm import Gemm
    if torch.cuda.get_device_properties(0).multi_processor_count != 132:
        pytest.skip("the tails named here are an H200's (132 SMs)")
    op = Gemm(reserved_sms=reserved)
    worst = _twenty_calls(op, m, n, k, layout)
    plan = next(iter(op._plans.values()))
    assert plan.tail == tail and plan.slices > 1, (plan.tail, plan.slices)
    assert op.calls() == (20, 20)
    flags, order = plan.flags.copy_to_host(), plan.order.copy_to_host()
    tiles = len(plan.tile_flags)
    assert (flags[:tiles] == 20).all()
    for j in range(plan.slices):
        assert (flags[(1 + j) * tiles:][order[tiles - tail:tiles]] == 20).all(), j
    print(f"{m}x{n}x{k} {layout} reserved {reserved}: tail {tail} in {plan.slices} slices of "
          f"{plan.kc}, worst rel err {worst:.1e}")


@pytest.mark.gpu
@requires_gpu
@pytest.mark.parametrize("layout", ["nk", "kn"])
@pytest.mark.parametrize("m,n,k,shape", [
    (512, 4096, 2048, (128, 128)), (1000, 1000, 1096, (128, 64)), (2048, 1024, 8192, (128, 128)),
    (512, 1024, 2048, (64, 64)), (1024, 1024, 1024, (128, 64)),
    (512, 1024, 4160, (64, 64)), (1024, 1024, 8192, (128, 64))])    # K split-K took before
def test_auto_pingpong_matches_fp32_reference(m, n, k, shape, layout):
    """"auto" on few-tile shapes runs a ping-pong tile of the shape ``pp_shape_for`` picks,
    in the variant ``pp_auto_name`` names (its plan has that many tile flags; ragged m, n and K
    too): 20 calls (:func:`_twenty_calls`), every tile flag at the last call's epoch."""
    torch = pytest.importorskip("torch")
    from mknumba.kernels.gemm import plan as G
    from mknumba.kernels.gemm import Gemm
    if torch.cuda.get_device_properties(0).multi_processor_count != 132:
        pytest.skip("the rule's picks named here are an H200's (132 SMs)")
    op = Gemm()
    worst = _twenty_calls(op, m, n, k, layout)
    plan = next(iter(op._plans.values()))
    bm, bn = shape
    assert plan.tile_shape == shape and plan.slices == 1, (plan.tile_shape, plan.slices)
    # the variant "auto" names for that shape (PP_AUTO_VARIANT), B's layout's build
    assert plan.kind == G.pp_auto_name(shape) + (":kn" if layout == "kn" else ""), plan.kind
    assert len(plan.tile_flags) == -(-m // bm) * -(-n // bn)
    assert op.calls() == (20, 20) and (plan.tile_flags.copy_to_host() == 20).all()
    print(f"{m}x{n}x{k} {layout}: ping-pong tiles {bm}x{bn}, worst rel err {worst:.1e}")


@pytest.mark.gpu
@requires_gpu
@pytest.mark.parametrize("layout", ["nk", "kn"])
@pytest.mark.parametrize("tile", ["sm90:pp:128x64", "sm90:pp:64x128", "sm90:pp:64x64",
                                  "sm90:ppd:128x128", "sm90:ppd:64x64", "sm90:ppdr:64x128",
                                  "sm90:ppdr:128x64", "sm90:ppr:64x64"])
def test_pingpong_shapes_match_fp32_reference(tile, layout):
    """The ping-pong tile's smaller shapes by name, B [n, k] and row-major [k, n] (the ":kn"
    build): per shape 20 calls (:func:`_twenty_calls`: a and b rewritten in place, the output
    poisoned, each result against an fp32 reference), then every tile flag at the last epoch.
    Ragged m and n (no multiple of 64 but n = 8; rows and 64-column chunks partly and wholly
    past the edge), K not a multiple of the 64-deep k-step; from 1-2 tiles (blocks with 0
    tiles, one warpgroup idle) to thousands (every parity of the warpgroups' turns, ring
    slots reused across tiles at every phase). The variants (d: descriptors advanced by adds,
    both layouts of B and both 64-row halves of A; r: the early ramp, blocks past the order's
    end included)."""
    from mknumba.kernels.gemm import Gemm
    from mknumba.roles.compute import tile_build
    op = Gemm(tile=tile)
    bm, bn = tile_build(tile).shape
    for m, n, k in [(130, 8, 8), (200, 136, 72), (1000, 2168, 1096), (389, 1032, 4104),
                    (4160, 8056, 1032)]:
        worst = _twenty_calls(op, m, n, k, layout)
        flags = op.tile_flags(m, n, k, layout).copy_to_host()
        calls, epoch = op.calls()
        assert len(flags) == -(-m // bm) * -(-n // bn) and (flags == epoch).all(), (m, n, k)
        print(f"{tile} {m}x{n}x{k} {layout}: {len(flags)} tiles, worst rel err {worst:.1e}")
    assert op.calls()[0] == 20 * 5


@pytest.mark.gpu
@requires_gpu
def test_gemm_rejects_wrong_dtype_on_gpu():
    torch = pytest.importorskip("torch")
    from mknumba.kernels.gemm import gemm
    a = torch.randn(128, 64, device="cuda")
    with pytest.raises(MkValueError, match="bfloat16"):
        gemm(a, a.T)


@pytest.mark.gpu
@requires_gpu
@pytest.mark.parametrize("layout", ["nk", "kn", "kn_view"])
@pytest.mark.parametrize("tile", ["sm90:pp", "sm90:tms", "sm90:pp:128x64", "sm90:pp:64x128",
                                  "sm90:pp:64x64"])
def test_opt_in_tiles_match_fp32_reference(tile, layout):
    """mk.Gemm's opt-in tiles, each also as its ":kn" twin for row-major B: the ping-pong tile
    ("sm90:pp", and its smaller shapes: the tile counts below are 128 x 128's) and the
    tensor-store tile ("sm90:tms"). 20 calls back to back (one sync at
    the end), each with fresh random inputs into its own poisoned output (a new C address each:
    the tensor-store tile's C maps fill a table and start another), the rows of the buffer
    after C poisoned too and left so, over shapes with 2, 4, 136, 525 and 2079 tiles of
    128 x 128 (2, 2, 72, 270 and 1056 of 128 x 256): on an H200 (132 blocks) blocks with 0, 1,
    2, 3, 4, 15 and 16 tiles (the ping-pong warpgroups' turns at every parity), or 0, 1, 2, 3
    and 8 (the tensor-store warps' two buffers across tiles, the stores drained at the block's
    end), ragged edges in m (warps whose rows start past m), n (chunks of C partly and wholly
    past n, one 8 columns wide) and k; each result against an fp32 reference of its own
    inputs, and every tile flag at the last epoch."""
    torch = pytest.importorskip("torch")
    from mknumba.kernels.gemm import Gemm
    from mknumba.roles.compute import tile_build
    op = Gemm(tile=tile)
    bm, bn = tile_build(tile).shape
    shapes = [(130, 8, 8), (200, 136, 72), (1000, 2168, 1096), (1920, 4480, 200),
              (4160, 8056, 1032)]
    torch.manual_seed(23)
    for m, n, k in shapes:
        runs = []
        for call in range(20):
            a = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
            b_nk = torch.randn(n, k, device="cuda", dtype=torch.bfloat16)
            b = {"nk": b_nk, "kn": b_nk.T.contiguous(), "kn_view": b_nk.T}[layout]
            buf = torch.full((m + bm, n), float("nan"), device="cuda", dtype=torch.bfloat16)
            runs.append((a, b_nk, b, buf))
        torch.cuda.synchronize()
        for a, _, b, buf in runs:
            op(a, b, b_layout="nk" if layout == "nk" else "kn", out=buf[:m])
        torch.cuda.synchronize()
        for call, (a, b_nk, _, buf) in enumerate(runs):
            ref, out = a.float() @ b_nk.float().T, buf[:m]
            assert torch.isfinite(out).all(), (m, n, k, call)
            assert torch.isnan(buf[m:]).all(), ("written past row m", m, n, k, call)
            err = ((out.float() - ref).norm() / ref.norm()).item()
            assert err <= 1e-2, (m, n, k, call, err)
        mode = "nk" if layout == "nk" else "kn"
        flags = op.tile_flags(m, n, k, mode).copy_to_host()
        calls, epoch = op.calls()
        assert len(flags) == -(-m // bm) * -(-n // bn) and (flags == epoch).all(), (m, n, k)
    assert op.calls()[0] == 20 * len(shapes)
