"""Render the GEMM grid (``bench_gemm.py --grid``): ours against cuBLAS over issue 23's grid.

    python benchmarks/plot_gemm_grid.py [benchmarks/results/gemm_grid.json] [--png OUT.png]

Prints, per layout of B, the geometric mean of cuBLAS time / ours over the grid, how many points
fall below 0.9x, the worst points and the largest relative error; then a table of the ratio by
(M, N) for each K. With matplotlib, ``--png`` writes one heat map per layout: rows (M, N),
columns K, the ratio in each cell.
"""
import json
import math
import os
import sys

HERE = os.path.dirname(os.path.abspath(__file__))


def shape(r):
    s = r["shape"]
    return s["m"], s["n"], s["k"]


def summary(records):
    """The grid's verdict per layout of B (issue 23: geometric mean >= 1.0, no point < 0.9,
    relative error <= 1e-2 everywhere); one verdict per op where the records are of several
    (``bench_gemm.py --grid --tile A,B --group-m G,H``)."""
    ops = sorted({(r.get("tile"), str(r.get("group_m"))) for r in records}, key=str)
    if len(ops) > 1:
        for tile, g in ops:
            print(f"\n== tile {tile}, group_m {g}")
            summary([r for r in records if (r.get("tile"), str(r.get("group_m"))) == (tile, g)])
        return
    for layout in sorted({r["b_layout"] for r in records}):
        recs = [r for r in records if r["b_layout"] == layout]
        ratios = [r["speedup"] for r in recs]
        geo = math.exp(sum(math.log(x) for x in ratios) / len(ratios))
        below = sorted((r for r in recs if r["speedup"] < 0.9), key=lambda r: r["speedup"])
        errs = [r["rel_err"] for r in recs]
        worst_err = max(errs, key=lambda e: float("inf") if e != e else e)
        print(f"B {layout}: {len(recs)} shapes, geometric mean {geo:.3f}x cuBLAS, "
              f"{len(below)} below 0.9x, max rel err {worst_err:.1e}")
        for r in below[:12]:
            m, n, k = shape(r)
            print(f"   {m:>5}x{n:<5}x{k:<5} {r['speedup']:.3f}x  ours {r['tflops']:6.1f} TF/s, "
                  f"cuBLAS {r['baseline_tflops']:6.1f}")
    ks = sorted({shape(r)[2] for r in records})
    print(f"\nratio (cuBLAS time / ours), B [n, k] / B [k, n]\n{'M x N':>12} " +
          " ".join(f"{'K=' + str(k):>11}" for k in ks))
    by = {(shape(r), r["b_layout"]): r["speedup"] for r in records}
    for m, n in sorted({shape(r)[:2] for r in records}):
        cells = []
        for k in ks:
            nk, kn = by.get(((m, n, k), "nk")), by.get(((m, n, k), "kn"))
            cells.append(f"{nk or 0:5.2f}/{kn or 0:<5.2f}")
        print(f"{m:>5}x{n:<6} " + " ".join(cells))


def plot(records, png):
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    layouts = sorted({r["b_layout"] for r in records})
    mn = sorted({shape(r)[:2] for r in records})
    ks = sorted({shape(r)[2] for r in records})
    fig, axes = plt.subplots(1, len(layouts), figsize=(4 + 2 * len(ks), 0.35 * len(mn) + 2),
                             squeeze=False)
    for ax, layout in zip(axes[0], layouts):
        by = {shape(r): r["speedup"] for r in records if r["b_layout"] == layout}
        grid = [[by.get((m, n, k), float("nan")) for k in ks] for m, n in mn]
        im = ax.imshow(grid, cmap="RdYlGn", vmin=0.7, vmax=1.3, aspect="auto")
        ax.set_xticks(range(len(ks)), [str(k) for k in ks])
        ax.set_yticks(range(len(mn)), [f"{m}x{n}" for m, n in mn], fontsize=7)
        ax.set_xlabel("K")
        ax.set_title(f"cuBLAS time / ours, B [{layout[0]}, {layout[1]}]")
        for i, row in enumerate(grid):
            for j, v in enumerate(row):
                ax.text(j, i, f"{v:.2f}", ha="center", va="center", fontsize=6)
        fig.colorbar(im, ax=ax)
    fig.tight_layout()
    fig.savefig(png, dpi=120)
    print("wrote", png)


def main():
    args = sys.argv[1:]
    png = None
    if "--png" in args:
        i = args.index("--png")
        png = args[i + 1]
        del args[i:i + 2]
    path = args[0] if args else os.path.join(HERE, "results", "gemm_grid.json")
    with open(path) as f:
        records = json.load(f)
    summary(records)
    if png:
        plot(records, png)


if __name__ == "__main__":
    main()
