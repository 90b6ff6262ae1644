"""Diagnostic: what the sm90 GEMM tile's fixed cost per tile is made of (one GPU).

    python benchmarks/probe_gemm_tile.py [--out PATH] [--ks 512,1024,2048,8192]

Why: with the first epilogue (``direct`` below) our GEMM at m = n = 8192 grew with K at cuBLAS's
rate but started about 0.1 ms higher (benchmarks/NOTES.md, GEMM tile): some 6.5 µs per
128 x 256 tile that cuBLAS does not pay, a third of a tile at small K, where the compute role is
the fused 1x2 kernels' critical path. This probe found the stores to be that cost; the staged
epilogue is now the library's.

The persistent GEMM is timed with variants of the tile beside cuBLAS (torch.matmul), same run:

  direct          epilogue 0: 4-byte stores straight from the accumulator layout (each warp
                  store touches 8 rows), then thread 0 fences and releases the tile flag
  direct-noflag   the same stores, no flag (so no fence waiting for them to drain)
  nostore         no epilogue stores at all (output left unwritten: timing only)
  nostore-noflag  neither
  staged          the library's tile (epilogue 2): stmatrix into a 2 KB per-warp staging area,
                  then 16-byte stores of whole rows
  staged-noflag   the same without the flag
  publisher       direct stores; a tenth warp publishes the flag (the fence stalls only it)
  staged-publisher  both changes
  pingpong        the ping-pong tile ("sm90:pp", cuda/gemm_pingpong.cu): 128 x 128 tiles, each
                  warpgroup a whole tile, one warpgroup's epilogue under the other's MMAs

(The direct and no-store epilogues are ``benchmarks/cuda/gemm_epilogues.cu``: the library's
``roles/cuda/gemm_tile.cu`` with its epilogue swapped, ``PROBE_EPILOGUE``; the publisher warp is
the library's ``MK_PUBLISHER``. This probe registers the builds the library does not run with
``roles.compute.register_tile``, after which ``mk.Gemm`` and the fused ops take their names as
``tile=``.)
Variants that write the output are checked against cuBLAS (relative error <= 1e-2). The table
ends with a least-squares fit ``ms = fixed + slope * K`` per variant, the fixed part per tile.
"""
import argparse
import os
import sys

import numpy as np

import common

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

from mknumba.kernels import gemm as G  # noqa: E402
from mknumba.roles import compute  # noqa: E402
from numba import cuda  # noqa: E402

#: variant -> (tile build, publish the tile flag); builds are ``roles.compute.tile_build`` names,
#: ``sm90:e<E>p<P>`` the probe's: epilogue E (0 direct, 1 none, 2 the library's), publisher P
VARIANTS = {"direct": ("sm90:e0p0", True), "direct-noflag": ("sm90:e0p0", False),
            "nostore": ("sm90:e1p0", True), "nostore-noflag": ("sm90:e1p0", False),
            "staged": ("sm90", True), "staged-noflag": ("sm90", False),
            "publisher": ("sm90:e0p1", True), "staged-publisher": ("sm90:e2p1", True),
            "pingpong": ("sm90:pp", True)}


def _without_flag(tile):
    @cuda.jit(device=True)
    def tile_without_flag(smem, tmaps, a, b, c, c_row0, addend, adds, m, n, k, tile_m, tile_n,
                          seq):
        tile(smem, tmaps, a, b, c, c_row0, addend, adds, m, n, k, tile_m, tile_n, seq)
        return 0    # no thread publishes: the compute role skips the fence and the flag
    return tile_without_flag


EPILOGUES = os.path.join(os.path.dirname(os.path.abspath(__file__)), "cuda", "gemm_epilogues.cu")


def register(tile):
    """Make a probe build ``sm90:e<E>p<P>`` known to the library (once)."""
    try:
        compute.tile_build(tile)
    except Exception:       # noqa: BLE001 - not one of the library's: register it
        epilogue, publisher = int(tile[6]), tile[8] == "1"
        b = compute.sm90_build(publisher, helper=EPILOGUES,
                               defines=f"#define PROBE_EPILOGUE {epilogue}\n")
        compute.register_tile(tile, b._replace(timing_only=epilogue == 1))


def build(name):
    """A Gemm that runs the variant ``name``."""
    tile, flag = VARIANTS[name]
    register(tile)
    if not flag:
        b = compute.tile_build(tile)
        tile = f"probe:{name}"
        compute.register_tile(tile, b._replace(tile=_without_flag(b.tile)))
    return G.Gemm(tile=tile)


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--out", default=None)
    p.add_argument("--m", type=int, default=8192)
    p.add_argument("--ks", default="512,1024,2048,8192")
    p.add_argument("--variants", default=",".join(VARIANTS))
    p.add_argument("--ranks", action="store_true")
    args = p.parse_args()
    if args.ranks:
        print(1)
        return
    import torch
    m = n = args.m
    ks = [int(k) for k in args.ks.split(",")]
    names = list(dict.fromkeys(args.variants.split(",")))     # each once, in order
    ops = {}
    for name in names:
        try:    # one build that fails to compile must not cost the others' device time
            ops[name] = build(name)
        except Exception as e:      # noqa: BLE001 (reported, and the variant left out)
            print(f"FAILED {name}: build: {type(e).__name__}: {e}")
    names = [name for name in names if name in ops]
    # tiles per variant: its build's shape (the ping-pong tile's are 128 x 128)
    shapes = {name: compute.tile_build(VARIANTS[name][0]).shape for name in names}
    tiles_of = {name: -(-m // bm) * -(-n // bn) for name, (bm, bn) in shapes.items()}
    tiles = -(-m // compute.SM90_TILE[0]) * -(-n // compute.SM90_TILE[1])
    records, table = [], {}
    for k in ks:
        torch.manual_seed(k)
        a = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
        w = torch.randn(n, k, device="cuda", dtype=torch.bfloat16)     # B as [n, k]
        want = torch.empty(m, n, device="cuda", dtype=torch.bfloat16)
        est_ms = 2 * m * n * k / 600e12 * 1e3          # at ~600 TFLOP/s
        iters = max(10, min(100, int(200 / est_ms)))    # ~0.2 s per variant
        t_cublas = common.time_ms(lambda: torch.matmul(a, w.T, out=want), iters, warmup=5)
        for name in names:
            op = ops[name]
            got = torch.full((m, n), float("nan"), device="cuda", dtype=torch.bfloat16)
            try:
                op(a, w, b_layout="nk", out=got)
                torch.cuda.synchronize()
            except Exception as e:  # noqa: BLE001 (a compile error: reported, then skipped)
                print(f"FAILED {name} k={k}: {type(e).__name__}: {e}")
                continue
            err = None
            if VARIANTS[name][0] != "sm90:e1p0":
                err = ((got.float() - want.float()).norm() / want.float().norm()).item()
                if not err <= 1e-2:
                    print(f"WRONG {name} k={k}: relative error {err}")
            t = common.time_ms(lambda: op(a, w, b_layout="nk", out=got), iters, warmup=5)
            table[(name, k)] = t
            records.append(common.record(
                "gemm_tile_probe", {"m": m, "n": n, "k": k}, dtype="bfloat16", world=1,
                topology="1x1", transport="none", ours_ms=t, baseline="cublas",
                baseline_ms=t_cublas, floor_ms=None, variant=name, rel_err=err,
                tiles=tiles_of[name], tflops=2 * m * n * k / t / 1e9))
        table[("cuBLAS", k)] = t_cublas
        common.write(records, args.out)
    print(f"m = n = {m}, {tiles} tiles of {compute.SM90_TILE} (fixed us/tile: per the "
          "variant's own tiles); ms per call (speedup vs cuBLAS)")
    print(f"{'variant':16s}" + "".join(f"{'k=' + str(k):>16s}" for k in ks)
          + "   fixed us/tile  ms per 1024 k")
    for name in names + ["cuBLAS"]:
        if any((name, k) not in table for k in ks):
            continue
        row = [table[(name, k)] for k in ks]
        cells = "".join(f"{t:8.3f} ({table[('cuBLAS', k)] / t:4.2f})" for t, k in zip(row, ks))
        slope, fixed = np.polyfit(ks, row, 1) if len(ks) > 1 else (float("nan"), float("nan"))
        waves = (tiles_of.get(name, tiles)
                 / torch.cuda.get_device_properties(0).multi_processor_count)
        print(f"{name:16s}{cells}   {fixed * 1e3 / waves:13.2f}  {slope * 1024:13.4f}")


if __name__ == "__main__":
    main()
