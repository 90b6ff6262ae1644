"""Render benchmarks/results/fused.json: speedup over cuBLAS + NCCL and fraction of the floor.

    python benchmarks/plot_fused.py [benchmarks/results/fused.json] [--png OUT.png]

Prints one line per point (kernel, topology, shape, ours, baseline, speedup, reach = the speedup
at the floor (baseline / floor, the most any schedule could get), floor, ours/floor as
floor_ms / ours_ms, communication share of the unfused time, target met? and whether the target
is above reach) and writes a PNG
with one panel per (kernel, topology): bars of the speedup, a marker at floor speedup
(baseline / floor, the best any schedule could reach).
"""
import json
import os
import sys

HERE = os.path.dirname(os.path.abspath(__file__))


def target(r):
    """The issue's bar: >= 1.15x where communication is >= 30% of the unfused time, else >= 0.95x."""
    need = 1.15 if r.get("comm_share", 0) >= 0.30 else 0.95
    return need, r["speedup"] >= need


def table(recs):
    print(f"{'kernel':19s} {'topo':4s} {'m':>6s} {'k':>5s} {'ours_ms':>8s} {'base_ms':>8s} "
          f"{'speedup':>7s} {'reach':>6s} {'floor_ms':>8s} {'of_floor':>8s} {'comm':>5s} {'sms':>4s}"
          "  target")
    for r in recs:
        need, ok = target(r)
        s = r["shape"]
        print(f"{r['kernel']:19s} {r['topology']:4s} {s['m']:6d} {s['k']:5d} {r['ours_ms']:8.3f} "
              f"{r['baseline_ms']:8.3f} {r['speedup']:7.2f} {r['baseline_ms'] / r['floor_ms']:6.2f} "
              f"{r['floor_ms']:8.3f} {r['floor_ms'] / r['ours_ms']:8.0%} "
              f"{r.get('comm_share', 0):5.0%} {r.get('sms_reserved', 0):4d}  >={need:.2f} "
              f"{'ok' if ok else 'MISSED'}"
              f"{' (above reach)' if not ok and need > r['baseline_ms'] / r['floor_ms'] else ''}")


def plot(recs, png):
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    panels = sorted({(r["kernel"], r["topology"]) for r in recs})
    fig, axes = plt.subplots(1, len(panels), figsize=(4.2 * len(panels), 3.6), squeeze=False)
    for ax, (kern, topo) in zip(axes[0], panels):
        rs = [r for r in recs if r["kernel"] == kern and r["topology"] == topo]
        labels = [f"{r['shape']['m'] // 1024}K\nk={r['shape']['k']}" for r in rs]
        x = range(len(rs))
        ax.bar(x, [r["speedup"] for r in rs], color=["tab:green" if target(r)[1] else "tab:red"
                                                    for r in rs])
        ax.plot(x, [r["baseline_ms"] / r["floor_ms"] for r in rs], "k_", markersize=14,
                label="floor (baseline / floor)")
        ax.axhline(1.0, color="gray", lw=0.8)
        ax.set_xticks(list(x))
        ax.set_xticklabels(labels, fontsize=7)
        ax.set_title(f"{kern} {topo}", fontsize=9)
        ax.set_ylabel("speedup over cuBLAS + NCCL")
    axes[0][0].legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(png, dpi=120)
    print("wrote", png)


def main(argv):
    png = None
    if "--png" in argv:
        i = argv.index("--png")
        png = argv[i + 1]
        argv = argv[:i] + argv[i + 2:]
    path = argv[0] if argv else os.path.join(HERE, "results", "fused.json")
    with open(path) as f:
        recs = json.load(f)
    table(recs)
    try:
        plot(recs, png or os.path.splitext(path)[0] + ".png")
    except ImportError:
        print("(matplotlib missing: no PNG)")


if __name__ == "__main__":
    main(sys.argv[1:])
