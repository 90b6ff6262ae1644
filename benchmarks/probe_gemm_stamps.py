"""Where the sm90 GEMM tile's time goes: a per-block timeline of mk.Gemm (diagnostic, one GPU).

    timeout 300 python benchmarks/probe_gemm_stamps.py --out $OUT/gemm_stamps.json
        [--variants sm90,st,...] [--shapes m,n,k[,split] ...] [--layouts nk,kn]

Builds the library's tile with its probe hooks defined (``benchmarks/cuda/gemm_stamps.cu``:
clock64 and %globaltimer per event, one thread recording each, a few stores a tile) and runs
it through ``mk.Gemm`` beside the library's own builds and torch.matmul (cuBLAS), same run,
same operands (B [n, k] as ``w.T``; with ``--layouts`` also or instead B [k, n] row-major,
through each build's ``:kn`` twin). Per shape and split of K (None: ``split_k_for``'s pick):

- every variant's us per call (median of back-to-back calls), torch / ours, and its relative
  error against an fp32 reference (each variant's output is checked, stamped builds too);
- for the stamped builds, from the median of three stamped launches: per compute block (mean /
  max over the blocks that ran work items) the time in the role's wait for an item's inputs (a
  split-K fold's flags), the tile's ramp (entry to k-step 0's data), its main loop (k-step 0's
  data to the last MMA retired; ``waits``: the part spent waiting for k-steps 1..'s data), its
  epilogue (stores issued, then the consumers' barrier), the gaps between items (the tile
  flag's release and the role's loop), init (block start to its first item); start skew (first
  block start to last), tail (first block done to last), span (first start to last done) and
  wall - span (launch and teardown); the fraction of the wall time the consumers spent in main
  loops; the producer's first load of a tile against the consumers' entry; the two warpgroups'
  skew; for split-K folds the flag latency (last slice done -> fold's wait over) and the
  fold's own time.

Variants (``--variants``; a shape runs those of its list that are asked for):
  sm90     the library's tile (mk.Gemm's default)
  e2p1     the library's fused-ops build: a tenth warp publishes the tile flags, the consumer
           warpgroups no longer meet at a barrier per tile
  pp       the ping-pong tile (128 x 128 tiles, 6-stage ring, one warpgroup's epilogue under
           the other's MMAs)
  g4, g64  sm90 with group_m 4 / 64 (the tile order; the default is sched.default_group_m)
  tms      the tensor-store tile ("sm90:tms"): each consumer warp's chunks leave by TMA stores
           nobody waits for (two 2 KB buffers per warp, the 4-stage ring kept), no consumer
           barrier or flag per tile (the flags go out at each block's end); whole tiles only
  st       sm90 with stamps      st:p1  e2p1 with stamps      st:tms  tms with stamps
  st:s3    st with a 3-stage ring (MK_STAGES 3): how much the 4th stage's latency cover buys
  pp:<BM>x<BN>  the smaller ping-pong tiles ("sm90:pp:128x64", ":64x128", ":64x64")
  ppd:, ppr:, ppdr:<BM>x<BN>  the ping-pong tile's variants (compute.SM90_PP_VARIANTS): d
           each MMA's descriptors advanced by an add from the slot's (MK_PP_DESC_ITER), r the
           early ramp (each block's first order entry prefetched before its setup)
  st:pp, st:pp:<BM>x<BN>  the ping-pong tiles with stamps (each item's events from its owning
           warpgroup's thread 0 or 128, so the summary covers the tiles of even seq: every
           tile where a block runs one, as at issue 23's few-tile shapes)
  st:ppd:, st:ppr:, st:ppdr:<BM>x<BN>  those variants with stamps
  st:nowait  st without the per-k-step wait timing (the stamps' own cost, against sm90)

Every step is printed before it runs and bounded (faulthandler: a step past its limit dumps
the stacks and exits), so a hang is attributable. Results: ``--out`` (JSON: per shape the
timings and each stamped build's summary) and ``<out>.npz`` (the raw stamps of each summary:
uint64 [blocks, items + 1, 16 events, (clock64, globaltimer)], events as EVENTS below).
"""
import os

os.environ.setdefault("MKNUMBA_TIMEOUT_S", "10")   # a stuck split-K fold reports within 10 s

import argparse  # noqa: E402
import faulthandler  # noqa: E402
import json  # noqa: E402
import sys  # noqa: E402
import warnings  # noqa: E402

import numpy as np  # noqa: E402

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

import common  # noqa: E402

HERE = os.path.dirname(os.path.abspath(__file__))
STAMPS_CU = os.path.join(HERE, "cuda", "gemm_stamps.cu")

#: gemm_stamps.cu's events, in its order (EV_*); "waits" holds (cycles, longest) instead
EVENTS = ["begin", "ready", "enter", "enter1", "first0", "first1", "main0", "main1", "stored0",
          "stored1", "done", "produce", "slot", "produced", "waits"]
EV = {name: i for i, name in enumerate(EVENTS)}
NEV = 16          # PROBE_EVENTS
ITEMS = 64        # PROBE_ITEMS: work items per block with a row (more are not recorded)

#: stamped builds: name -> (compute.sm90_build's publisher, tms and pingpong, defines for
#: gemm_stamps.cu)
STAMPED = {"st": (False, False, False, ""), "st:p1": (True, False, False, ""),
           "st:s3": (False, False, False, "#define MK_STAGES 3\n"),
           "st:nowait": (False, False, False, "#define PROBE_WAITS 0\n"),
           "st:tms": (False, True, False, ""), "st:pp": (False, False, True, "")}
STAMPED.update({f"st:pp:{bm}x{bn}": (False, False, (bm, bn), "")
                for bm, bn in ((128, 64), (64, 128), (64, 64))})
#: the stamped builds of the ping-pong tile's variants -> their letters (compute.SM90_PP_VARIANTS)
STAMPED_PP = {f"st:pp{letters}:{bm}x{bn}": letters for letters in ("d", "r", "dr")
              for bm, bn in ((128, 128), (128, 64), (64, 128), (64, 64))}
STAMPED.update({name: (False, False, tuple(int(x) for x in name.split(":")[-1].split("x")), "")
                for name in STAMPED_PP})
#: the library's builds: name -> Gemm options
LIBRARY = {"sm90": dict(tile="sm90"), "e2p1": dict(tile="sm90:e2p1"),
           "pp": dict(tile="sm90:pp"), "g4": dict(tile="sm90", group_m=4),
           "g64": dict(tile="sm90", group_m=64), "tms": dict(tile="sm90:tms")}
LIBRARY.update({f"pp:{shape}": dict(tile=f"sm90:pp:{shape}")
                for shape in ("128x64", "64x128", "64x64")})
LIBRARY.update({f"pp{letters}:{shape}": dict(tile=f"sm90:pp{letters}:{shape}")
                for letters in ("d", "r", "dr")
                for shape in ("128x128", "128x64", "64x128", "64x64")})
#: variants that compute whole tiles only (no split-K): skipped where the shape splits K
WHOLE_TILES = {"tms", "st:tms"} | {v for v in list(LIBRARY) + list(STAMPED) if "pp" in v}
SHORT_K = ["sm90", "e2p1", "tms", "pp", "g4", "g64", "st", "st:nowait", "st:p1", "st:tms",
           "st:s3"]


def _pp_variants(shape):
    """The ping-pong variants of one tile shape, plain and stamped (LIBRARY, STAMPED_PP)."""
    return [f"pp{x}:{shape}" for x in ("d", "r", "dr")] + \
        [f"st:pp{x}:{shape}" for x in ("d", "r", "dr")]


#: (m, n, k, split_k (None: the op's rule), variants)
SHAPES = [(8192, 8192, 512, 1, SHORT_K),
          (4096, 4096, 512, 1, SHORT_K),
          (8192, 8192, 8192, 1, ["sm90", "e2p1", "tms", "st", "st:p1", "st:tms", "st:s3"]),
          (512, 1024, 14336, 1, ["sm90", "st"]),
          (512, 1024, 14336, 4, ["sm90", "st"]),
          (2048, 1024, 4096, None, ["sm90", "st"]),
          # few tiles (issue 23): the ping-pong shapes "auto" takes there, one tile a block
          # (and the variants of compute.SM90_PP_VARIANTS at each shape's own tile)
          (512, 4096, 512, 1, ["pp", "st:pp"] + _pp_variants("128x128")),
          (512, 4096, 8192, 1, ["pp", "st:pp"] + _pp_variants("128x128")),
          (1024, 1024, 512, 1, ["pp:128x64", "st:pp:128x64"] + _pp_variants("128x64")),
          (1024, 1024, 8192, 1, ["pp:128x64", "st:pp:128x64"] + _pp_variants("128x64")),
          (512, 1024, 512, 1, ["pp:64x64", "st:pp:64x64"] + _pp_variants("64x64")),
          (512, 1024, 8192, 1, ["pp:64x64", "st:pp:64x64"] + _pp_variants("64x64"))]


def step(msg, fn, limit_s=90):
    """Print ``msg``, run ``fn`` with a watchdog: past ``limit_s`` the stacks are dumped and
    the process exits (a hung kernel or compile is named by the last line printed)."""
    print(f"  .. {msg}", flush=True)
    faulthandler.dump_traceback_later(limit_s, exit=True)
    try:
        return fn()
    finally:
        faulthandler.cancel_dump_traceback_later()


class Stamps:
    """The stamp buffer (one per process: its address is compiled into the stamped builds) and
    the stamped tile builds, registered with ``roles.compute.register_tile`` as
    ``probe:<name>``; the compute role's wait for a work item's inputs is wrapped with the
    role-level stamps for those builds only (``kernels.gemm.kernel.split_units`` patched here)."""

    def __init__(self, blocks, buf=None):
        """Rows for ``blocks`` blocks; ``buf``: anything with ``data_ptr()`` standing in for
        the buffer (compile checks without a GPU), else a new zeroed int64 tensor."""
        from mknumba.kernels.gemm import kernel as G
        self.blocks = blocks
        if buf is None:
            import torch
            buf = torch.zeros(blocks * (ITEMS + 1) * NEV * 2, dtype=torch.int64, device="cuda")
        self.buf = buf
        self.role_stamp = {}          # a stamped build's tile function -> its stamp function
        self._split_units = G.split_units
        G.split_units = self.split_units

    def defines(self, extra):
        return (f"#define PROBE_STAMPS {self.buf.data_ptr():#x}ull\n#define PROBE_ITEMS {ITEMS}"
                f"\n#define PROBE_BLOCKS {self.blocks}\n" + extra)

    def register(self, name, kn=False):
        """Make the stamped build ``name`` (STAMPED) known as tile ``probe:<name>``, or with
        ``kn`` its build reading B as [k, n] as ``probe:<name>:kn`` (what ``Gemm(tile=
        "probe:<name>")`` runs for a row-major [k, n] b)."""
        from mknumba.roles import compute
        from numba import cuda, types
        tile = f"probe:{name}" + (":kn" if kn else "")
        publisher, tms, pingpong, extra = STAMPED[name]
        variant = {compute.SM90_PP_VARIANTS[x]: True for x in STAMPED_PP.get(name, "")}
        defines = self.defines(extra)
        build = compute.sm90_build(publisher, b_kn=kn, pingpong=pingpong, helper=STAMPS_CU,
                                   defines=defines, tms=tms, **variant)
        # the role's stamp function from the very file the tile links (sm90_tile_functions
        # appends the build's defines so): one definition of the tile there
        path = compute.linked_source(STAMPS_CU, defines + compute.sm90_defines(
            publisher, b_kn=kn, tms=tms, pingpong=pingpong,
            desc_iter=variant.get("desc_iter", False)))
        self.role_stamp[build.tile] = cuda.declare_device(
            "mk_probe_role_stamp", types.int32(types.int32), link=[path], abi="c")
        compute.register_tile(tile, build)
        return tile

    def split_units(self, build, split=True):
        unit, place, ready = self._split_units(build, split)
        stamp = self.role_stamp.get(build.tile)
        if stamp is None:
            return unit, place, ready
        from numba import cuda
        begin, done = np.int32(EV["begin"]), np.int32(EV["ready"])

        @cuda.jit(device=True, inline=True)
        def stamped_ready(where, u, adds, epoch):
            stamp(begin)
            ok = ready(where, u, adds, epoch)
            stamp(done)
            return ok
        return unit, place, stamped_ready

    def run(self, fn):
        """The stamps of one call of ``fn``: uint64 [blocks, ITEMS + 1, NEV, 2]."""
        import torch
        self.buf.zero_()
        torch.cuda.synchronize()
        fn()
        torch.cuda.synchronize()
        return self.buf.cpu().numpy().view(np.uint64).reshape(self.blocks, ITEMS + 1, NEV, 2)


def timeline(raw):
    """(t, f, resolution): t float64 [blocks, ITEMS + 1, NEV] in us from the first block's
    start (NaN: not stamped; the header row's event 0 is the block's start), the SM clock in
    GHz, and the smallest step of %globaltimer seen (ns). Durations inside a block come from
    its clock64 (cycles / f); blocks are aligned by fitting each one's clock to %globaltimer
    (its offset: the mean over its stamps, so coarse timer ticks average out)."""
    clk = raw[..., 0].astype(np.float64)
    gt = raw[..., 1].astype(np.float64)
    seen = raw[..., 0] > 0
    seen[:, :ITEMS, EV["waits"]] = False      # sums of cycles, not times
    seen[:, ITEMS, 1:] = False                # the header's %smid
    rates, steps = [], []
    for b in range(raw.shape[0]):
        c, g = clk[b][seen[b]], gt[b][seen[b]]
        if c.size >= 4 and g.max() - g.min() > 5000:
            rates.append(np.polyfit(g - g.mean(), c - c.mean(), 1)[0])     # cycles per ns
        d = np.diff(np.unique(g))
        if d.size:
            steps.append(d.min())
    f = float(np.median(rates)) if rates else float("nan")
    t = np.full(clk.shape, np.nan)
    for b in range(raw.shape[0]):
        if seen[b].any():
            off = np.mean(gt[b][seen[b]] - clk[b][seen[b]] / f)
            t[b][seen[b]] = clk[b][seen[b]] / f + off
    starts = t[:, ITEMS, 0]
    t = (t - np.nanmin(starts)) / 1e3
    return t, f, float(min(steps)) if steps else float("nan")


def _stats(per_block):
    v = np.asarray(per_block, dtype=np.float64)
    return (round(float(v.mean()), 3), round(float(v.max()), 3)) if v.size else None


def analyse(raw, wall_us, k_steps, order=None, tiles=0, slices=1):
    with warnings.catch_warnings():      # all-NaN rows: blocks or items with no stamps
        warnings.simplefilter("ignore", RuntimeWarning)
        return _analyse(raw, wall_us, k_steps, order, tiles, slices)


def _analyse(raw, wall_us, k_steps, order, tiles, slices):
    """Summary (dict) of one stamped launch of ``k_steps`` k-steps per tile item; ``order``:
    the plan's work units in the order blocks take them (block b's item i is ``order[b + i *
    blocks]``), with ``slices`` of ``tiles`` tiles: for the folds' slices."""
    t, f, res = timeline(raw)
    waits = raw[:, :ITEMS, EV["waits"], :].astype(np.float64) / f / 1e3     # us
    started = ~np.isnan(t[:, ITEMS, 0])
    blocks = int(started.sum())
    ev = {name: t[:, :ITEMS, i] for name, i in EV.items() if name != "waits"}
    items = ~np.isnan(ev["done"])
    fold = items & np.isnan(ev["first0"])
    tile = items & ~fold
    active = items.any(axis=1)
    tiled, folding = tile.any(axis=1), fold.any(axis=1)
    per = {}

    def per_block(x, mask, blocks):  # per block: the sum over its items where mask
        return np.where(mask, x, 0.0).sum(axis=1)[blocks]

    # items, init and gaps over the blocks that ran any item; a tile's parts over those that
    # ran tiles; the folds' over those that ran folds (split-K)
    per["items"] = items.sum(axis=1)[active]
    per["init"] = (ev["begin"][:, 0] - t[:, ITEMS, 0])[active]
    per["wait"] = per_block(ev["ready"] - ev["begin"], tile, tiled)
    per["ramp"] = per_block(ev["first0"] - ev["enter"], tile, tiled)
    per["main"] = per_block(ev["main0"] - ev["first0"], tile, tiled)
    per["waits"] = per_block(waits[..., 0], tile, tiled)
    per["store"] = per_block(ev["stored0"] - ev["main0"], tile, tiled)
    per["barrier"] = per_block(ev["done"] - ev["stored0"], tile, tiled)
    per["epilogue"] = per_block(ev["done"] - ev["main0"], tile, tiled)
    gap = ev["begin"][:, 1:] - ev["done"][:, :-1]
    per["gap"] = np.where(items[:, 1:], gap, 0.0).sum(axis=1)[active]
    per["fold_wait"] = per_block(ev["ready"] - ev["begin"], fold, folding)
    per["fold"] = per_block(ev["done"] - ev["enter"], fold, folding)
    last_done = np.nanmax(np.where(items, ev["done"], np.nan), axis=1)[active]
    start = t[:, ITEMS, 0][started]
    span = float(np.nanmax(last_done)) if blocks else float("nan")
    s = {"blocks": blocks, "tile_blocks": int(tiled.sum()), "fold_blocks": int(folding.sum()),
         "distinct_sms": int(np.unique(raw[started, ITEMS, 1, 0]).size), "active_blocks": int(active.sum()), "clock_ghz": round(f, 4),
         "globaltimer_step_ns": res, "wall_us": round(wall_us, 2), "span_us": round(span, 2),
         "launch_teardown_us": round(wall_us - span, 2),
         "skew_us": round(float(start.max() - start.min()), 3),
         "tail_us": round(float(last_done.max() - last_done.min()), 3),
         "per_block": {key: _stats(v) for key, v in per.items()}}
    if tile.any():
        s["main_frac_tile_blocks"] = round(float(per["main"].mean() / wall_us), 4)
        s["main_frac_all"] = round(float(per["main"].sum() / blocks / wall_us), 4)
        s["main_ns_per_kstep"] = round(float(per["main"].sum() / tile.sum() / k_steps * 1e3), 1)
        s["waits_ns_per_kstep"] = round(
            float(per["waits"].sum() / tile.sum() / max(k_steps - 1, 1) * 1e3), 1)
        first = tile.copy()
        first[:, 1:] = False
        later = tile & ~first
        ramp = ev["first0"] - ev["enter"]
        s["ramp_first_item_us"] = _mean(ramp[first])
        s["ramp_later_items_us"] = _mean(ramp[later])
        s["longest_wait_us"] = round(float(np.nanmax(waits[..., 1][tile])), 3)
        s["producer_slot_lead_us"] = _mean((ev["enter"] - ev["slot"])[later])
        s["producer_slot_to_data_us"] = _mean((ev["first0"] - ev["slot"])[later])
        s["wg1_minus_wg0_enter_us"] = _mean((ev["enter1"] - ev["enter"])[tile])
        s["wg1_minus_wg0_main_us"] = _mean((ev["main1"] - ev["main0"])[tile])
        s["wg1_minus_wg0_stored_us"] = _mean((ev["stored1"] - ev["stored0"])[tile])
        s["tile_us"] = _mean((ev["done"] - ev["enter"])[tile])
    if fold.any() and order is not None:
        nb = blocks           # the compute blocks: 0 .. blocks - 1 (no SM held back)
        where = {int(u): (p % nb, p // nb) for p, u in enumerate(order) if p // nb < ITEMS}
        lat, body, after = [], [], []
        for p, u in enumerate(order):
            if u < slices * tiles or p // nb >= ITEMS:
                continue
            b, i = p % nb, p // nb
            tt = (u - slices * tiles) % tiles     # a fold unit: band p of tile tt
            sl = [where[j * tiles + tt] for j in range(slices) if j * tiles + tt in where]
            last = np.nanmax([ev["done"][sb, si] for sb, si in sl] + [np.nan])
            lat.append(ev["ready"][b, i] - last)
            body.append(ev["done"][b, i] - ev["ready"][b, i])
            after.append(ev["done"][b, i] - last)
        s["fold_flag_latency_us"] = _mean(np.array(lat))
        s["fold_body_us"] = _mean(np.array(body))
        s["fold_done_after_last_slice_us"] = _mean(np.array(after))
        s["slices_done_us"] = _mean(np.nanmax(np.where(tile, ev["done"], np.nan), axis=1)[
            tile.any(axis=1)])
    return s


def _mean(x):
    x = np.asarray(x, dtype=np.float64)
    x = x[~np.isnan(x)]
    return round(float(x.mean()), 3) if x.size else None


def show(name, s):
    pb = s["per_block"]

    def cell(key):
        v = pb.get(key)
        return f"{key} {v[0]:.2f}/{v[1]:.2f}" if v else f"{key} -"
    print(f"    {name}: stamps (us; per block sum, mean/max over the blocks that ran such "
          f"items: {s['active_blocks']} of {s['blocks']} ran any, {s['tile_blocks']} tiles, "
          f"{s['fold_blocks']} folds; clock {s['clock_ghz']} GHz, timer step "
          f"{s['globaltimer_step_ns']:.0f} ns)")
    print("      " + "  ".join(cell(k) for k in ("items", "init", "ramp", "main", "waits",
                                                   "store", "barrier", "gap")))
    print("      " + "  ".join(cell(k) for k in ("epilogue", "wait", "fold_wait", "fold")))
    print(f"      wall {s['wall_us']:.1f}  span {s['span_us']:.1f}  launch+teardown "
          f"{s['launch_teardown_us']:.1f}  skew {s['skew_us']:.2f}  tail {s['tail_us']:.2f}")
    rest = {k: v for k, v in s.items() if k not in (
        "per_block", "blocks", "active_blocks", "tile_blocks", "fold_blocks", "clock_ghz", "globaltimer_step_ns", "wall_us",
        "span_us", "launch_teardown_us", "skew_us", "tail_us")}
    print("      " + "  ".join(f"{k} {v}" for k, v in rest.items()), flush=True)


def main():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", default=None, help="JSON of the results (raw stamps: <out>.npz)")
    p.add_argument("--variants", default=None,
                   help="comma-separated subset of the variants (default: each shape's list)")
    p.add_argument("--shapes", nargs="*", default=None,
                   help="m,n,k[,split] (split 0: the op's rule), with every asked variant")
    p.add_argument("--stamped-runs", type=int, default=3)
    p.add_argument("--layouts", default="nk",
                   help="comma-separated layouts of B: nk (a w.T view of [n, k] w), kn "
                        "(row-major [k, n])")
    args = p.parse_args()
    import torch
    from mknumba.kernels.gemm import op as G
    from mknumba.sched.tiles import cdiv
    faulthandler.enable()
    want = set(args.variants.split(",")) if args.variants else None
    shapes = SHAPES
    if args.shapes:
        allv = list(LIBRARY) + list(STAMPED)
        shapes = [(*[int(x) for x in s.split(",")[:3]],
                   (int(s.split(",")[3]) or None) if s.count(",") == 3 else 1, allv)
                  for s in args.shapes]
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    print(f"device: {torch.cuda.get_device_name(0)}, {sms} SMs", flush=True)
    stamps = Stamps(2 * sms)
    tiles_of = {}          # variant -> mk tile name
    records, raws = [], {}
    for (m, n, k, split, variants), layout in [(s, lay) for s in shapes
                                               for lay in args.layouts.split(",")]:
        variants = [v for v in variants if want is None or v in want]
        tiles = cdiv(m, 128) * cdiv(n, 256)
        slices = G.split_slices(k, split or G.split_k_for(tiles, k, sms))[0]
        k_steps = cdiv(G.split_slices(k, slices)[1], 64)
        print(f"== {m}x{n}x{k} B {layout} split {split or 'rule'} -> {slices} slice(s): "
              f"{tiles} tiles of 128x256, {k_steps} k-steps per unit, {sms} SMs", flush=True)
        torch.manual_seed(k + m)
        a = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
        w = torch.randn(n, k, device="cuda", dtype=torch.bfloat16)
        ref = a.float() @ w.float().T
        b = w.T if layout == "nk" else w.T.contiguous()   # [k, n]: a view, or row-major
        c = torch.empty(m, n, device="cuda", dtype=torch.bfloat16)
        iters = max(10, min(200, int(3e3 / (2 * m * n * k / 600e6))))    # ~3 ms at 600 TF/s
        rec = dict(m=m, n=n, k=k, b_layout=layout, split=split, slices=slices, tiles=tiles, variants={},
                   stamps={})

        def timed(fn):
            return common.time_ms(fn, iters, warmup=3, median=True)[1] * 1e3

        rec["torch_us"] = step("torch.matmul", lambda: timed(
            lambda: torch.matmul(a, b, out=c)))
        print(f"    torch {rec['torch_us']:.1f} us", flush=True)
        for v in variants:
            try:
                if v in STAMPED and v not in tiles_of:
                    tiles_of[v] = step(f"register {v}", lambda: stamps.register(v))
                if v in STAMPED and layout == "kn" and (v, "kn") not in tiles_of:
                    tiles_of[v, "kn"] = step(f"register {v} (B [k, n])",
                                             lambda: stamps.register(v, kn=True))
                opts = dict(LIBRARY[v]) if v in LIBRARY else dict(tile=tiles_of[v])
                if v in WHOLE_TILES and slices > 1:
                    continue
                op = G.Gemm(split_k=split, **opts)

                def first():
                    c.fill_(float("nan"))
                    op(a, b, out=c)
                    torch.cuda.synchronize()
                    return ((c.float() - ref).norm() / ref.norm()).item()
                err = step(f"{v}: first call (plans, compiles on first use) and check",
                           first, 240)
                us = step(f"{v}: timing ({iters} calls)", lambda: timed(lambda: op(a, b,
                                                                                  out=c)))
                rec["variants"][v] = dict(us=round(us, 2), err=err,
                                          ratio=round(rec["torch_us"] / us, 4))
                bad = "" if err <= 1e-2 else "  WRONG (relative error > 1e-2)"
                print(f"    {v:10s} {us:8.1f} us  torch/ours {rec['torch_us'] / us:.3f}  "
                      f"err {err:.1e}{bad}", flush=True)
                if v not in STAMPED:
                    continue
                plan = next(iter(op._plans.values()))
                order = plan.order.copy_to_host()
                runs = []
                for r in range(args.stamped_runs):
                    raw = step(f"{v}: stamped launch {r + 1}", lambda: stamps.run(
                        lambda: op(a, b, out=c)))
                    runs.append((analyse(raw, us, k_steps, order, tiles, plan.slices), raw))
                runs.sort(key=lambda x: x[0]["span_us"])
                s, raw = runs[len(runs) // 2]
                s["spans_us"] = [x[0]["span_us"] for x in runs]
                rec["stamps"][v] = s
                used = max(1, s["blocks"])
                raws[f"{m}x{n}x{k}_{layout}_s{slices}_{v}"] = raw[:used]
                if len(order) > ITEMS * used:
                    print(f"    (only the first {ITEMS} items of each block are stamped)")
                show(v, s)
            except Exception as e:     # noqa: BLE001 - reported; the other variants go on
                print(f"    FAILED {v}: {type(e).__name__}: {e}", flush=True)
                rec["variants"][v] = dict(error=f"{type(e).__name__}: {e}")
        records.append(rec)
        if args.out:     # after every shape: a later hang keeps what was measured
            with open(args.out, "w") as fh:
                json.dump(records, fh, indent=1)
            np.savez_compressed(args.out + ".npz", **raws)
    print("done", flush=True)


if __name__ == "__main__":
    main()
