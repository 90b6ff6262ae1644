"""What the tail split does for mk.Gemm's wave-quantized shapes (diagnostic, one GPU).

    python benchmarks/probe_tail_split.py [--layouts nk,kn] [--force 2] [--out PATH]
        [m,n,k[,reserved_sms] ...]

Per shape and layout of B, microseconds per call (``probe_split_k.measure``: median of
repetitions of back-to-back calls; each column timed again in reverse order, the faster pass
kept: ``probe_split_k.time_again``) of, in one run:

- ``torch``: torch.matmul (cuBLAS) on the same operands;
- ``off``: ``Gemm(split_k=1)``, what the op ran before the tail split ("auto": the
  tensor-store tile for K <= TMS_MAX_K, else sm90; whole tiles only);
- ``sm90``: ``Gemm(tile="sm90", split_k=1)``, the unsplit kernel of the tile the tail split
  runs (the tail split's phase 1 alone would be this without its last round);
- ``on``: ``Gemm()``, the rule's choice (``kernels.gemm.tail_split_for``: the ``tail`` and
  its slices ``s`` are printed; none: the same kernel as ``off``);
- ``forced``: where the rule takes no tail split but the last round leaves at least half the
  blocks idle, the tail split with ``--force`` slices (``tail_split_for`` patched inside this
  probe only), else blank.

Every run is checked against an fp32 reference (relative Frobenius error; FAIL above 1e-2 or
NaN: unwritten). ``reserved_sms`` (4th field) holds SMs back from the compute blocks, as the
fused ops do; the ratios are torch / ours.
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
from mknumba.sched.tiles import cdiv  # noqa: E402
from probe_split_k import layouts, measure, time_again  # noqa: E402

SHAPES = [(512, 28672, 1024, 0), (512, 28672, 2048, 0), (512, 28672, 4096, 0),
          (512, 28672, 8192, 0), (4096, 28672, 4096, 0), (16384, 8192, 1024, 0),
          (4096, 4096, 4096, 8), (4096, 4096, 4096, 16)]


@contextlib.contextmanager
def forced_tail(s):
    """Plans made inside split any tail that leaves half the blocks idle into ``s`` slices."""
    orig = G.tail_split_for

    def force(tiles, k, blocks):
        tail = tiles % blocks
        return (tail, s) if tiles > blocks and 0 < tail <= blocks // 2 else (0, 1)
    G.tail_split_for = force
    try:
        yield
    finally:
        G.tail_split_for = orig


def main():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--layouts", default="nk,kn")
    p.add_argument("--force", type=int, default=2, help="slices of the 'forced' runs")
    p.add_argument("--out", default=None, help="JSON of the rows")
    p.add_argument("shapes", nargs="*", help="m,n,k[,reserved_sms]")
    args = p.parse_args()
    shapes = [tuple(int(x) for x in s.split(",")) for s in args.shapes] or SHAPES
    torch.manual_seed(0)
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    bm, bn = 128, 256     # the sm90 tile (roles.compute.SM90_TILE)
    cols = ["torch", "off", "sm90", "on", "forced"]
    print(f"{'shape':>18} {'B':>2} {'tiles':>5} {'blk':>4} {'tail':>4} {'s':>2} " +
          " ".join(f"{c:>8}" for c in cols) + "  torch/off torch/on  (us per call)", flush=True)
    rows = []
    for shape in shapes:
        m, n, k, reserved = shape if len(shape) == 4 else (*shape, 0)
        tiles, blocks = cdiv(m, bm) * cdiv(n, bn), sms - reserved
        tail, s = G.tail_split_for(tiles, k, blocks)
        idle = tiles > blocks and 0 < tiles % blocks <= blocks // 2
        for layout, operands in layouts(m, n, k, args.layouts):
            row = dict(m=m, n=n, k=k, reserved_sms=reserved, layout=layout, tiles=tiles,
                       blocks=blocks, tail=tail, slices=s, errs={})
            run = functools.partial(measure, row, *operands)
            run("torch", lambda a, b, out: torch.matmul(a, b, out=out))
            run("off", G.Gemm(split_k=1, reserved_sms=reserved))
            run("sm90", G.Gemm(tile="sm90", split_k=1, reserved_sms=reserved))
            on = G.Gemm(reserved_sms=reserved)
            run("on", on)
            assert next(iter(on._plans.values())).tail == tail
            if not tail and idle:
                run("forced", G.Gemm(reserved_sms=reserved), forced_tail(args.force))
                row["forced_slices"] = args.force
            time_again(row)
            rows.append(row)
            bad = [key for key, e in row["errs"].items() if not e <= 1e-2]   # NaN: unwritten
            print(f"{m}x{n}x{k:<6}{'r' + str(reserved) if reserved else '':>4} {layout:>2} "
                  f"{tiles:>5} {blocks:>4} {tail:>4} {s:>2} " +
                  " ".join(f"{row[c_]:8.1f}" if c_ in row else f"{'':>8}" for c_ in cols) +
                  f"  {row['torch'] / row['off']:9.3f} {row['torch'] / row['on']:8.3f}" +
                  f"  max err {max(row['errs'].values()):.1e}" +
                  (f" FAIL {bad}" if bad else ""), flush=True)
    if args.out:
        with open(args.out, "w") as f:
            json.dump(rows, f, indent=1)


if __name__ == "__main__":
    main()
