"""mk.Gemm, with B in both layouts and one or more tile builds, beside torch.matmul at a few
shapes, one process (diagnostic; bench_gemm.py records).

    python benchmarks/probe_gemm_shapes.py [--tiles auto|sm90,sm90:pp,...] [m,n,k ...]

B [n, k] (the weight w, passed as ``w.T``: the tile's K-major B) and B [k, n] row-major (``wt =
w.T.contiguous()``, read as it is by the tile's ":kn" build: TMA boxes of 64 N-columns, a
transposed wgmma B). ``--tiles``: the ``tile=`` options to compare (``roles.compute.tile_build``
names, e.g. "sm90,sm90:pp,sm90:tms": the default tile against the ping-pong and tensor-store
ones). Prints, per shape and layout, torch.matmul's ms per call, then for each tile ms per call
(mean of back-to-back calls after a warm-up), TF/s, the ratio torch / ours and the error
against an fp32 reference.
"""
import argparse

import torch

import mknumba as mk

p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
p.add_argument("--tiles", default="auto", help="comma-separated tile= options of mk.Gemm")
p.add_argument("shapes", nargs="*", help="m,n,k")
args = p.parse_args()
shapes = [tuple(int(x) for x in s.split(",")) for s in args.shapes] or [
    (2048, 2048, 512), (6144, 5120, 1536), (8192, 8192, 8192)]
ops = {tile: mk.Gemm(tile=tile) for tile in args.tiles.split(",")}


def time_ms(fn, m, n, k):
    for _ in range(5):
        fn()
    iters = max(10, int(2e10 / (2 * m * n * k)))
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(iters):
        fn()
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) / iters


for m, n, k in shapes:
    a = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
    w = torch.randn(n, k, device="cuda", dtype=torch.bfloat16)
    wt = w.T.contiguous()                                   # [k, n] row-major
    c = torch.empty(m, n, device="cuda", dtype=torch.bfloat16)
    ref = a.float() @ w.float().T
    for layout, b in (("b[n,k]", w.T), ("b[k,n]", wt)):
        theirs = time_ms(lambda: torch.matmul(a, b, out=c), m, n, k)
        line = [f"gemm {m}x{n}x{k} {layout}: torch.matmul {theirs:.4f} ms;"]
        for tile, op in ops.items():
            c.fill_(float("nan"))
            op(a, b, out=c)
            torch.cuda.synchronize()
            err = ((c.float() - ref).norm() / ref.norm()).item()
            ours = time_ms(lambda: op(a, b, out=c), m, n, k)
            line.append(f"{tile} {ours:.4f} ms ({2 * m * n * k / ours / 1e9:.0f} TF/s), "
                        f"torch/ours {theirs / ours:.3f}, err {err:.1e};")
        print(" ".join(line), flush=True)
