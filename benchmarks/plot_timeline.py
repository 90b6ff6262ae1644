"""Draw SMs per role over time from a trace written by ``op.save_trace`` (like the paper's
Figure 7): one panel per rank, the blocks each role holds as stacked steps, the controller's
target number of communication blocks as a dashed line (adaptive split), and the static
split it started from as a dotted line.

    python benchmarks/plot_timeline.py TRACE.json [--png OUT.png] [--ranks 0,1]

The trace comes from e.g. ``benchmarks/trace_fused.py --save-trace TRACE.json`` or any op
built with ``trace=True`` (``AllGatherGemm`` too) and its ``save_trace`` (see
benchmarks/NOTES.md, "How to: timelines"); open the same file in https://ui.perfetto.dev for
the per-item tracks.
"""
import argparse
import json
import os
import sys

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

from mknumba.timeline import ROLES, SMS_COUNTER, TARGET_COUNTER  # noqa: E402

COLORS = dict(compute="tab:blue", reduce="tab:orange", send="tab:green", recv="tab:red",
              pull="tab:purple", forward="tab:brown", collect="tab:olive")


def series(doc, pid):
    """(times_us, {role: counts}, target_times_us, targets) of rank ``pid``."""
    ev = [e for e in doc["traceEvents"] if e.get("pid") == pid and e["ph"] == "C"]
    sms = sorted((e for e in ev if e["name"] == SMS_COUNTER), key=lambda e: e["ts"])
    tgt = sorted((e for e in ev if e["name"] == TARGET_COUNTER), key=lambda e: e["ts"])
    t = [e["ts"] for e in sms]
    counts = {r: [e["args"].get(r, 0) for e in sms] for r in ROLES}
    return t, counts, [e["ts"] for e in tgt], [e["args"]["target"] for e in tgt]


def plot(doc, png, ranks=None):
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    pids = sorted({e["pid"] for e in doc["traceEvents"] if e["ph"] == "C"})
    if ranks is not None:
        pids = [p for p in pids if p in ranks]
    if not pids:
        raise SystemExit("no 'SMs per role' counter in this trace")
    meta = doc.get("otherData", {}).get("ranks", {})
    fig, axes = plt.subplots(len(pids), 1, figsize=(9, 2.6 * len(pids)), squeeze=False,
                             sharex=True)
    for ax, pid in zip(axes[:, 0], pids):
        t, counts, tt, target = series(doc, pid)
        roles = [r for r in ROLES if any(counts[r])]
        ax.stackplot(t, [counts[r] for r in roles], labels=roles, step="post",
                     colors=[COLORS[r] for r in roles], alpha=0.8)
        if tt:
            ax.step(tt, target, where="post", color="k", ls="--", lw=1,
                    label="controller target (comm)")
        m = meta.get(str(pid), {})
        rb = m.get("role_blocks")
        if rb:
            static = sum(v for k, v in rb.items() if k != "compute")
            ax.axhline(static, color="gray", ls=":", lw=1, label=f"table's comm SMs ({static})")
        title = f"rank {pid}"
        if m:
            title += (f": {m.get('op')} m={m.get('m')} n={m.get('n')} k={m.get('k')} "
                      f"{m.get('topology')} {'adaptive' if m.get('adaptive') else 'static'}")
        ax.set_title(title, fontsize=9)
        ax.set_ylabel("SMs")
        ax.legend(fontsize=7, loc="upper right")
    axes[-1, 0].set_xlabel("time (µs)")
    fig.tight_layout()
    fig.savefig(png, dpi=120)
    return png


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("trace")
    p.add_argument("--png", default=None, help="default: the trace's name with .png")
    p.add_argument("--ranks", default=None, help="comma-separated ranks (default: all)")
    a = p.parse_args(argv)
    with open(a.trace) as f:
        doc = json.load(f)
    png = a.png or os.path.splitext(a.trace)[0] + ".png"
    ranks = None if a.ranks is None else {int(x) for x in a.ranks.split(",")}
    print(plot(doc, png, ranks))


if __name__ == "__main__":
    main()
