"""Render benchmark JSON records (docs/design.md §8) as a table: python benchmarks/report.py F.json..."""
import json
import sys


def rows(paths):
    for p in paths:
        try:
            with open(p) as f:
                yield from json.load(f)
        except (OSError, ValueError) as e:
            print(f"(skipping {p}: {e})")


def shape_str(shape):
    return " ".join(f"{k}={v}" for k, v in shape.items())


def main(paths):
    render(rows(paths))


def render(records):
    """Print records (an iterable of dicts) as a table; records without ``kernel`` and ``shape``
    (a probe's own fields: stamps, kernel names) are counted, not shown."""
    cols = ["kernel", "shape", "topo", "transport", "ours_ms", "base", "base_ms", "speedup",
            "tflops", "base_tflops", "floor_ms", "of_floor"]
    table, probes = [], 0
    for r in records:
        if not isinstance(r, dict) or "kernel" not in r or "shape" not in r:
            probes += 1
            continue
        of_floor = r["floor_ms"] / r["ours_ms"] if r.get("floor_ms") and r.get("ours_ms") else None
        extra = f" sms_reserved={r['sms_reserved']}" if r.get("sms_reserved") else ""
        if r["kernel"] == "host_cost":
            extra += f" op={r['op']} graph={int(r['graph'])} host_us={r['host_us']:.2f}"
        table.append([r["kernel"], shape_str(r["shape"]) + extra, r.get("topology", ""),
                      r.get("transport", ""), r.get("ours_ms"), r.get("baseline", ""),
                      r.get("baseline_ms"), r.get("speedup"), r.get("tflops"),
                      r.get("baseline_tflops"), r.get("floor_ms"), of_floor])
    fmt = [lambda v: "" if v is None else (f"{v:.4g}" if isinstance(v, float) else str(v))]
    cells = [[fmt[0](v) for v in row] for row in table]
    widths = [max([len(c)] + [len(row[i]) for row in cells]) for i, c in enumerate(cols)]
    print("  ".join(c.ljust(w) for c, w in zip(cols, widths)))
    for row in cells:
        print("  ".join(v.ljust(w) for v, w in zip(row, widths)))
    if probes:
        print(f"({probes} records without kernel and shape left out: probes' own fields)")


if __name__ == "__main__":
    main(sys.argv[1:])
