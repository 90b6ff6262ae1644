"""mknumba.gemm against cuBLAS (PyTorch) on one GPU: correctness, SASS check, timings.

    python benchmarks/bench_gemm.py --out benchmarks/results/gemm.json [--sass-dir DIR] [--tile T]
    python benchmarks/bench_gemm.py --grid --out benchmarks/results/gemm_grid.json [--tile T]
        [--split-k S] [--shapes MxNxK,...] [--pp-shapes BMxBN,...] [--group-m G,...]

For every shape: a correctness check on fresh random inputs (poisoned output, relative Frobenius
error against an fp32 reference), then the median time of cuBLAS (torch.matmul, same operand
layout: A [M, K], B [N, K]) and of ours (0, 8, 16, 32 SMs held back), the five's repetitions
alternating, and with all SMs ours and cuBLAS with B row-major [K, N] (records with
``b_layout`` "kn"; the others "nk").
Writes the records of docs/design.md §8 and prints a table last. ``--tile``: the Gemm build
timed (default ``"sm90"``, the 128 x 256 tile; ``"auto"``: the op's choice per shape and held-back
count, e.g. a tail split where the blocks left make a ragged last round).

``--grid``: issue 23's grid instead (M in 512..16384, N in 1024..28672, K in 512..14336, 144
shapes), both layouts of B, all SMs: per shape one correctness check per layout and ours beside
cuBLAS (``torch.matmul`` on the same operands), each timed for about 10 ms a repetition,
the two's repetitions alternating.
``benchmarks/plot_gemm_grid.py`` renders the result (geometric mean, worst points, a heat map).
``--split-k S``: ``Gemm(split_k=S)`` (1: no split; default: the op's rule), each record saying
how many slices ran (``slices``); ``--shapes``: only these shapes (e.g. to sweep S on a few).
``--pp-shapes``: the ping-pong tile shapes "auto" may choose (``kernels.gemm.plan.PP_TILE_COST``
restricted to these; ``128x128``: the rule without the smaller tiles); each record names the
tile shape its plan ran (``tile_shape``). ``--group-m``: one op per value, ``Gemm(group_m=G)``
(the tile order's band height, ``sched.tiles.grouped_order``; "auto": the op's rule), timed
in turn beside cuBLAS at every shape, each record naming its ``group_m``; ``--tile`` in
``--grid`` takes several builds the same way (each record names its ``tile``).
``--fold-parts P``: a split tile's fold in at most P units (``kernels.gemm.plan.FOLD_MAX_PARTS``;
1: one unit a tile), each record saying how many ran (``fold_parts``).
"""
import argparse
import datetime
import itertools
import json
import os
import shutil
import subprocess
import sys

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

import torch  # noqa: E402

import mknumba  # noqa: E402,F401
import mknumba.kernels.gemm.plan as G  # noqa: E402
from mknumba.kernels.gemm import Gemm  # noqa: E402

SQUARE = [(4096, 4096, 4096), (8192, 8192, 8192)]
TP = [(m, 8192, k) for m in (4096, 8192, 16384) for k in (1024, 2048, 4096)]
ODD = [(128 * 3 + 5, 256 * 2 + 8, 64 * 3 + 8), (1000, 776, 1096), (4160, 8184, 1032)]
RESERVED = (0, 8, 16, 32)
GRID_M = (512, 1024, 2048, 4096, 8192, 16384)
GRID_N = (1024, 4096, 8192, 28672)
GRID_K = (512, 1024, 2048, 4096, 8192, 14336)


def rel_err(c, a, b_nk):
    ref = a.float() @ b_nk.float().T
    return ((c.float() - ref).norm() / ref.norm()).item()


def check(op, m, n, k, layout="nk"):
    a = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
    b_nk = torch.randn(n, k, device="cuda", dtype=torch.bfloat16)
    b = {"nk": b_nk, "kn": b_nk.T.contiguous(), "kn_view": b_nk.T}[layout]
    out = torch.full((m, n), float("nan"), device="cuda", dtype=torch.bfloat16)
    op(a, b, b_layout="nk" if layout == "nk" else "kn", out=out)
    torch.cuda.synchronize()
    assert torch.isfinite(out).all().item(), "unwritten (NaN) outputs"
    return rel_err(out, a, b_nk)


def iters_for(flops, rep_s=0.01, rate=6e14):
    """Back-to-back calls in one timed repetition: about ``rep_s`` at ``rate`` FLOP/s."""
    return max(3, min(500, int(rep_s * rate / flops)))


def time_ms(fn, iters, *others):
    """GPU ms per call of ``fn`` (and of each of ``others``, then a tuple), the median of 5
    repetitions of ``iters`` back-to-back calls. Each repetition queues behind a kernel that
    holds the stream while the host issues the calls, so small shapes time the GPU's work, not
    the host's launch rate (ours and cuBLAS's host costs: bench_host_cost.py). With
    ``others``, the functions' repetitions alternate (fn, other, fn, other, ...), so a drift of
    the GPU's clock over the run weighs on each of them alike."""
    fns = (fn,) + others
    for f in fns:
        for _ in range(3):
            f()
    torch.cuda.synchronize()
    times = [[] for _ in fns]
    hold = int(2e9 * (iters * 30e-6 + 1e-3))     # clock cycles: ~30 us of host time a call
    for _ in range(5):
        for f, ts in zip(fns, times):
            s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            torch.cuda._sleep(hold)
            s.record()
            for _ in range(iters):
                f()
            e.record()
            e.synchronize()
            ts.append(s.elapsed_time(e) / iters)
    med = [sorted(ts)[len(ts) // 2] for ts in times]
    return med[0] if not others else tuple(med)


def sass_report(op, sass_dir):
    """Dump the sm_90a cubin; count HGMMA and local-memory instructions; resource usage."""
    kern = next(iter(op._plans.values())).launch.compiled
    cubin = kern._codelibrary.get_cubin()
    data = getattr(cubin, "code", cubin)
    path = os.path.join(sass_dir, "gemm_sm90.cubin")
    with open(path, "wb") as f:
        f.write(bytes(data))
    tool = shutil.which("cuobjdump") or "/usr/local/cuda/bin/cuobjdump"
    out = {"cubin": path}
    try:
        sass = subprocess.run([tool, "--dump-sass", path], capture_output=True, text=True).stdout
        res = subprocess.run([tool, "--dump-resource-usage", path], capture_output=True,
                             text=True).stdout
        out.update(hgmma=sass.count("HGMMA"), utmaldg=sass.count("UTMALDG"),
                   ldl=sass.count("LDL"), stl=sass.count("STL"),
                   resources=" ".join(l.strip() for l in res.splitlines() if "REG" in l))
        with open(os.path.join(sass_dir, "gemm_sm90.sass"), "w") as f:
            f.write(sass)
    except OSError as e:
        out["error"] = str(e)
    return out


def grid(args, gpu, sms):
    """Issue 23's grid: records with b_layout "nk" and "kn" per shape, all SMs."""
    ops = {(t, g): Gemm(tile=t, split_k=args.split_k, group_m=None if g == "auto" else int(g))
           for t in args.tile.split(",") for g in args.group_m.split(",")}
    records, cmd = [], " ".join([os.path.basename(sys.executable)] + sys.argv)
    date = datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds")
    shapes = ([tuple(int(x) for x in s.split("x")) for s in args.shapes.split(",")]
              if args.shapes else [(m, n, k) for m in GRID_M for n in GRID_N for k in GRID_K])
    for m, n, k in shapes:
        a = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
        b_nk = torch.randn(n, k, device="cuda", dtype=torch.bfloat16)
        b_kn = b_nk.T.contiguous()
        ref = a.float() @ b_nk.float().T
        c = torch.full((m, n), float("nan"), device="cuda", dtype=torch.bfloat16)
        flops, iters = 2.0 * m * n * k, iters_for(2.0 * m * n * k)
        base = dict(kernel="gemm", shape=dict(m=m, n=n, k=k), dtype="bfloat16", world=1,
                    topology="1x1", transport="none", baseline="cublas", gpu=gpu,
                    date=date, command=cmd, sms=sms, sms_reserved=0, split_k=args.split_k)
        for (layout, b_arg), ((tile, g), op) in itertools.product(
                (("nk", b_nk.T), ("kn", b_kn)), ops.items()):
            c.fill_(float("nan"))
            op(a, b_arg, out=c)
            torch.cuda.synchronize()
            err = ((c.float() - ref).norm() / ref.norm()).item()   # NaN if unwritten
            t, tb = time_ms(lambda: op(a, b_arg, out=c), iters,
                            lambda: torch.matmul(a, b_arg, out=c))
            plan = next(p for key, p in op._plans.items()
                        if key[:3] == (m, n, k) and (key[3] == "kn") == (layout == "kn"))
            slices = plan.slices
            records.append(dict(base, tile=tile, b_layout=layout, ours_ms=t, baseline_ms=tb,
                                slices=slices, fold_parts=plan.parts,
                                tile_shape=list(plan.tile_shape), group_m=g,
                                pp_shapes=args.pp_shapes,
                                speedup=tb / t, floor_ms=tb, tflops=flops / t / 1e9,
                                baseline_tflops=flops / tb / 1e9, rel_err=err))
            print(f"{m}x{n}x{k} {layout}: ours {t:.4f} ms cublas {tb:.4f} ms "
                  f"ratio {tb / t:.3f} err {err:.1e} slices {slices} "
                  f"parts {plan.parts} tile {plan.tile_shape[0]}x{plan.tile_shape[1]} "
                  f"group_m {g} {tile}", flush=True)
    return records


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--out", default="benchmarks/results/gemm.json")
    p.add_argument("--sass-dir", default=None)
    p.add_argument("--quick", action="store_true", help="only 8192^3, all reserve values")
    p.add_argument("--grid", action="store_true", help="issue 23's grid of 144 shapes")
    p.add_argument("--tile", default=None,
                   help="the Gemm build (default: auto with --grid, else sm90); --grid: one "
                        "op per build, e.g. auto,sm90:ppr:64x128")
    p.add_argument("--split-k", type=int, default=None,
                   help="Gemm(split_k=S) (--grid; 1: no split; default: the op's rule)")
    p.add_argument("--shapes", default=None, help="--grid: only these, e.g. 512x1024x14336,...")
    p.add_argument("--group-m", default="auto",
                   help="--grid: one op per value, e.g. auto,1 (Gemm(group_m=G))")
    p.add_argument("--fold-parts", type=int, default=None,
                   help="--grid: a split tile's fold in at most this many units "
                        "(kernels.gemm.plan.FOLD_MAX_PARTS; 1: one a tile)")
    p.add_argument("--pp-shapes", default=None,
                   help="--grid: the ping-pong tile shapes 'auto' may take, e.g. 128x128,64x64 "
                        "(default: every shape of kernels.gemm.plan.PP_TILE_COST)")
    args = p.parse_args()
    args.tile = args.tile or ("auto" if args.grid else "sm90")
    if "," in args.tile and not args.grid:
        p.error("--tile: one build outside --grid")
    if args.pp_shapes:
        keep = {tuple(int(x) for x in s.split("x")) for s in args.pp_shapes.split(",")}
        unknown = keep - set(G.PP_TILE_COST)
        if unknown or not keep:
            p.error(f"--pp-shapes: not of {sorted(G.PP_TILE_COST)}: {sorted(unknown)}")
        G.PP_TILE_COST = {s: c for s, c in G.PP_TILE_COST.items() if s in keep}
    if args.fold_parts is not None:
        if args.fold_parts < 1:
            p.error("--fold-parts: at least 1")
        G.FOLD_MAX_PARTS = args.fold_parts
    torch.manual_seed(0)
    gpu = torch.cuda.get_device_name()
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    if args.grid:
        records = grid(args, gpu, sms)
        os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
        with open(args.out, "w") as f:
            json.dump(records, f, indent=1)
        import plot_gemm_grid
        plot_gemm_grid.summary(records)
        return
    ops = {s: Gemm(tile=args.tile, reserved_sms=s) for s in RESERVED}
    shapes = [(8192, 8192, 8192)] if args.quick else SQUARE + TP

    # ---- correctness: every benchmarked shape, odd shapes, both B layouts, the SIMT twin
    errs = {}
    for shape in shapes + ODD:
        errs[shape] = check(ops[0], *shape)
    for shape in shapes:
        errs[shape + ("kn",)] = check(ops[0], *shape, "kn")
    errs["kn"] = check(ops[0], 1000, 776, 1096, "kn")
    errs["kn_ragged"] = check(ops[0], 389, 264, 200, "kn")    # boxes past n left unloaded
    errs["kn_view"] = check(ops[0], 1000, 776, 1096, "kn_view")
    flags = ops[0].tile_flags(1000, 776, 1096, "kn").copy_to_host()   # a flag a tile
    bm, bn = ops[0]._plan_of(1000, 776, 1096, "kn").tile_shape
    assert len(flags) == -(-1000 // bm) * -(-776 // bn) and (flags == flags[0]).all() and \
        0 < flags[0] <= ops[0].calls()[1], "a tile flag did not reach its call's epoch"
    errs["reserved32"] = check(ops[32], 4160, 8184, 1032)
    errs["simt_twin"] = check(Gemm(tile="simt"), 300, 264, 136)
    for key, e in errs.items():
        print(f"check {key}: rel err {e:.2e}", "OK" if e <= 1e-2 else "FAIL", flush=True)

    sass = sass_report(ops[0], args.sass_dir) if args.sass_dir else {}
    print("sass:", sass, flush=True)

    # ---- timings
    records, cmd = [], " ".join([os.path.basename(sys.executable)] + sys.argv)
    date = datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds")
    for (m, n, k) in shapes:
        a = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
        b = torch.randn(n, k, device="cuda", dtype=torch.bfloat16)
        c = torch.empty(m, n, device="cuda", dtype=torch.bfloat16)
        flops = 2.0 * m * n * k
        iters = max(5, int(2e13 / flops))
        # cuBLAS and every hold-back alternating: a drift of the clock (the power limit at
        # large shapes) weighs on each alike, and each S against the all-SM rate of that run
        t_cublas, *t_held = time_ms(lambda: torch.matmul(a, b.T, out=c), iters,
                                    *[(lambda s=s: ops[s](a, b, b_layout="nk", out=c))
                                      for s in RESERVED])
        base = dict(kernel="gemm", shape=dict(m=m, n=n, k=k), dtype="bfloat16", world=1,
                    topology="1x1", transport="none", baseline="cublas", gpu=gpu, date=date,
                    command=cmd, sms=sms, sass=sass or None, tile=args.tile)
        bt = b.T.contiguous()                         # [k, n] row-major, read as it is
        t_kn, t_cublas_kn = time_ms(lambda: ops[0](a, bt, b_layout="kn", out=c), iters,
                                    lambda: torch.matmul(a, bt, out=c))
        records.append(dict(base, b_layout="kn", ours_ms=t_kn, baseline_ms=t_cublas_kn,
                            speedup=t_cublas_kn / t_kn, floor_ms=t_cublas_kn,
                            tflops=flops / t_kn / 1e9, baseline_tflops=flops / t_cublas_kn / 1e9,
                            sms_reserved=0, rel_err=errs.get((m, n, k, "kn"))))
        print(f"{m}x{n}x{k} b [k, n]: ours {t_kn:.3f} ms, cublas {t_cublas_kn:.3f} ms",
              flush=True)
        for s, t in zip(RESERVED, t_held):
            records.append(dict(
                base, b_layout="nk", ours_ms=t, baseline_ms=t_cublas, speedup=t_cublas / t,
                floor_ms=t_cublas, tflops=flops / t / 1e9,
                baseline_tflops=flops / t_cublas / 1e9, sms_reserved=s,
                rel_err=errs.get((m, n, k))))
            print(f"{m}x{n}x{k} reserved {s}: ours {t:.3f} ms, cublas {t_cublas:.3f} ms",
                  flush=True)

    os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
    with open(args.out, "w") as f:
        json.dump(records, f, indent=1)

    # ---- table: ratio to cuBLAS, and each hold-back against (sms - S)/sms of our all-SM rate
    full = {(r["shape"]["m"], r["shape"]["n"], r["shape"]["k"]): r["tflops"]
            for r in records if r["sms_reserved"] == 0 and r["b_layout"] == "nk"}
    print(f"\n{'shape':>18} {'B':>2} {'S':>3} {'ours TF/s':>9} {'cuBLAS':>7} {'ratio':>6} "
          f"{'vs ideal':>8}")
    for r in records:
        sh = (r["shape"]["m"], r["shape"]["n"], r["shape"]["k"])
        ideal = full[sh] * (sms - r["sms_reserved"]) / sms
        print(f"{'x'.join(map(str, sh)):>18} {r['b_layout']:>2} {r['sms_reserved']:>3} "
              f"{r['tflops']:9.1f} {r['baseline_tflops']:7.1f} {r['speedup']:6.3f} "
              f"{r['tflops'] / ideal:8.3f}")
    bad = [k for k, e in errs.items() if not e <= 1e-2]
    print("correctness:", "all <= 1e-2" if not bad else f"FAILED {bad}")


if __name__ == "__main__":
    main()
