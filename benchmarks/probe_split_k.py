"""Where split-K's time goes in mk.Gemm (diagnostic, one process, one GPU).

    python benchmarks/probe_split_k.py [--splits 2,4,8] [--layouts nk,kn] [--out PATH]
        [m,n,k ...]

Per shape and layout of B, microseconds per call (median of repetitions of back-to-back calls,
as bench_gemm.py times; every column timed twice, in order and then in reverse order, the
faster pass kept: ``time_again``) of:

- ``torch``: torch.matmul (cuBLAS) on the same operands;
- ``auto1``: ``Gemm(split_k=1)``, what the op runs unsplit (at K <= ``TMS_MAX_K`` the
  tensor-store tile, else the sm90 tile; the splits run the sm90 tile);
- ``unsplit``: ``Gemm(tile="sm90", split_k=1)``, the sm90 tile's kernel without split-K;
- ``split1``: the same tile's split-K kernel running whole tiles (one slice: every unit a
  tile into C), i.e. what the split kernel's code alone costs (generic stores, its
  registers);
- per S in ``--splits``: ``sS`` the op with ``split_k=S`` (slices and folds), ``sS.sl`` the
  same plan with the folds left out of the work order (the slices alone; C is not written, so
  it is not checked), and ``sS.fold`` = sS - sS.sl: what the folds add to the critical path.

The slices-only and split1 runs patch the op module's plan-time helpers inside this probe only
(``kernels.gemm.op.split_order`` and ``kernels.gemm.op._build``: the names ``_Plan`` calls);
the library has no such switch.
Full runs are checked against an fp32 reference (relative Frobenius error). Also printed: how
many slices ``split_k_for`` picks (``rule``).
"""
import argparse
import contextlib
import functools
import json
import os
import sys

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

import torch  # noqa: E402

from mknumba.kernels.gemm import op as G  # noqa: E402
from mknumba.roles.compute import tile_build  # noqa: E402
from mknumba.sched.tiles import cdiv  # noqa: E402

SHAPES = [(512, 1024, 14336), (1024, 1024, 8192), (2048, 1024, 4096), (512, 4096, 4096),
          (1024, 4096, 8192), (512, 1024, 1024), (512, 1024, 4096)]


@contextlib.contextmanager
def slices_only():
    """Plans made inside leave every fold out of the work order."""
    orig = G.split_order

    def no_folds(order, slices, tail=None, parts=1):
        units = orig(order, slices, tail, parts)   # the folds: parts x the (tail or all) tiles
        return units if slices == 1 else units[:len(units) - parts * (tail or len(order))]
    G.split_order = no_folds
    try:
        yield
    finally:
        G.split_order = orig


@contextlib.contextmanager
def split_kernel_unsplit():
    """Plans made inside run the split-K kernel even with one slice (tile builds that have a
    split kernel: those with a fold)."""
    orig = G._build
    G._build = lambda kind, split=False: orig(kind, split or tile_build(kind).fold is not None)
    try:
        yield
    finally:
        G._build = orig


def time_us(fn, reps=7, target_s=0.005):
    for _ in range(3):
        fn()
    torch.cuda.synchronize()
    s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    s.record()
    fn()
    e.record()
    e.synchronize()
    iters = max(5, min(400, int(target_s * 1e3 / max(s.elapsed_time(e), 1e-3))))
    times = []
    for _ in range(reps):
        s.record()
        for _ in range(iters):
            fn()
        e.record()
        e.synchronize()
        times.append(s.elapsed_time(e) * 1e3 / iters)
    return sorted(times)[len(times) // 2]


def layouts(m, n, k, names):
    """``(layout, (a, b, c, ref))`` per layout in ``names`` ("nk,kn"): random bf16 a [m, k]
    and B as a [k, n] view of an [n, k] array ("nk") or row-major [k, n] ("kn"), the same
    values either way; c [m, n] for the result and ``ref`` its fp32 reference."""
    a = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
    w = torch.randn(n, k, device="cuda", dtype=torch.bfloat16)
    ref = a.float() @ w.float().T
    c = torch.empty(m, n, device="cuda", dtype=torch.bfloat16)
    for layout in names.split(","):
        yield layout, (a, w.T if layout == "nk" else w.T.contiguous(), c, ref)


def measure(row, a, b, c, ref, key, op, ctx=contextlib.nullcontext(), check=True):
    """``row[key]``: us per call of ``op(a, b, out=c)`` (time_us), after a first call (inside
    ``ctx``: it plans) into a poisoned ``c`` whose relative error against ``ref`` goes to
    ``row["errs"][key]`` (unless not ``check``)."""
    c.fill_(float("nan"))
    with ctx:
        op(a, b, out=c)
    torch.cuda.synchronize()
    if check:
        row["errs"][key] = ((c.float() - ref).norm() / ref.norm()).item()
    row[key] = time_us(lambda: op(a, b, out=c))
    row.setdefault("_again", []).append((key, lambda: op(a, b, out=c)))


def time_again(row):
    """Time every column :func:`measure` put in ``row`` once more, in reverse order, and keep
    each column's faster pass: a GPU whose speed drifts over a run would otherwise read the
    columns timed last as slow. ``row["passes"]``: both passes, us per call."""
    again = row.pop("_again")
    row["passes"] = {key: [row[key]] for key, _ in again}
    for key, call in reversed(again):
        t = time_us(call)
        row["passes"][key].append(t)
        row[key] = min(row[key], t)


def main():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--splits", default="2,4,8")
    p.add_argument("--layouts", default="nk,kn")
    p.add_argument("--out", default=None, help="JSON of the rows")
    p.add_argument("shapes", nargs="*", help="m,n,k")
    args = p.parse_args()
    shapes = [tuple(int(x) for x in s.split(",")) for s in args.shapes] or SHAPES
    splits = [int(s) for s in args.splits.split(",")]
    torch.manual_seed(0)
    blocks = torch.cuda.get_device_properties(0).multi_processor_count   # all SMs compute
    bm, bn = 128, 256     # the sm90 tile (roles.compute.SM90_TILE)
    rows = []
    cols = ["torch", "auto1", "unsplit", "split1"] + [f"s{s}{x}" for s in splits
                                             for x in ("", ".sl", ".fold")]
    print(f"{'shape':>16} {'B':>2} {'tiles':>5} {'rule':>4} " +
          " ".join(f"{c:>8}" for c in cols) + "   (us per call; err of each full run)",
          flush=True)
    for m, n, k in shapes:
        tiles = cdiv(m, bm) * cdiv(n, bn)
        rule = G.split_slices(k, G.split_k_for(tiles, k, blocks))[0]
        for layout, operands in layouts(m, n, k, args.layouts):
            row = dict(m=m, n=n, k=k, layout=layout, tiles=tiles, rule=rule, errs={})
            run = functools.partial(measure, row, *operands)
            run("torch", lambda a, b, out: torch.matmul(a, b, out=out))
            run("auto1", G.Gemm(split_k=1))
            run("unsplit", G.Gemm(tile="sm90", split_k=1))
            run("split1", G.Gemm(tile="sm90", split_k=1), split_kernel_unsplit())
            for s in splits:
                run(f"s{s}", G.Gemm(split_k=s))
                run(f"s{s}.sl", G.Gemm(split_k=s), slices_only(), check=False)
            time_again(row)
            for s in splits:
                row[f"s{s}.fold"] = row[f"s{s}"] - row[f"s{s}.sl"]
            rows.append(row)
            bad = [key for key, e in row["errs"].items() if not e <= 1e-2]   # NaN: unwritten
            print(f"{m}x{n}x{k:<6} {layout:>2} {tiles:>5} {rule:>4} " +
                  " ".join(f"{row[c_]:8.1f}" for c_ in cols) +
                  f"   max err {max(row['errs'].values()):.1e}" +
                  (f" FAIL {bad}" if bad else ""), flush=True)
    if args.out:
        with open(args.out, "w") as f:
            json.dump(rows, f, indent=1)
    print("\nfastest split per shape beside the rule's:")
    for r in rows:
        times = [(1, min(r["auto1"], r["unsplit"]))] + [(s, r[f"s{s}"]) for s in splits]
        best = min(times, key=lambda x: x[1])
        print(f"  {r['m']}x{r['n']}x{r['k']} {r['layout']}: best s={best[0]} "
              f"({best[1]:.1f} us), rule s={r['rule']}")


if __name__ == "__main__":
    main()
