"""What announcing its tiles costs the unsplit mk.Gemm (diagnostic, one GPU, one variant a run).

    python benchmarks/probe_flag_cost.py VARIANT [--shapes MxNxK,...] [--out PATH]

VARIANT, each in its own process (the patches act on the kernels' first compile):

- ``library``: the op as it is: whole tiles record their flags with no fence
  (``primitives.record``; ``roles.compute.make_compute_role(publish=False)``);
- ``release``: every tile's flag released, as before (``publish=True`` patched in: a fence
  that waits for the tile's stores, and the tensor-store tile's drain waits for the writes);
- ``noticket``: the library without the call's ticket (``roles.blocks.begin`` replaced by a
  constant epoch: timing only, the epochs are wrong).

Per shape (B [n, k]): microseconds per call of ours and of torch.matmul (cuBLAS) on the same
operands, alternating (``bench_gemm.time_ms``), and the relative error against an fp32
reference (computed before timing). Records ``kernel: "gemm_flag_cost"``.
"""
import argparse
import os
import sys

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

import numpy as np  # noqa: E402
import torch  # noqa: E402
from numba import cuda  # noqa: E402

import common  # noqa: E402
from bench_gemm import iters_for, time_ms  # noqa: E402
from mknumba import primitives as prim  # noqa: E402
from mknumba.kernels import gemm as G  # noqa: E402
from mknumba.kernels.gemm import kernel as gemm_kernel  # noqa: E402
from mknumba.roles import compute  # noqa: E402

SHAPES = "4096x1024x512,512x8192x512,1024x4096x1024,8192x1024x512,2048x2048x512," \
         "512x1024x512,512x4096x2048,2048x1024x1024,8192x8192x8192"


def patch(variant):
    if variant == "release":
        role = compute.make_compute_role
        compute.make_compute_role = lambda *a, **k: role(*a, **{**k, "publish": True})
    elif variant == "noticket":
        @cuda.jit(device=True)
        def begin_constant(frame):
            return prim.epoch_of(np.int64(1)), np.int64(1)
        gemm_kernel.begin = begin_constant
    elif variant != "library":
        raise SystemExit(f"unknown variant {variant!r}")


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("variant", choices=("library", "release", "noticket"))
    p.add_argument("--shapes", default=SHAPES)
    p.add_argument("--out", default=None)
    args = p.parse_args()
    patch(args.variant)
    op, records = G.Gemm(), []
    for s in args.shapes.split(","):
        m, n, k = (int(x) for x in s.split("x"))
        a = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
        b = torch.randn(n, k, device="cuda", dtype=torch.bfloat16)
        c = torch.full((m, n), float("nan"), device="cuda", dtype=torch.bfloat16)
        op(a, b.T, out=c)
        ref = a.float() @ b.float().T
        err = ((c.float() - ref).norm() / ref.norm()).item()       # NaN if unwritten
        t, tb = time_ms(lambda: op(a, b.T, out=c), iters_for(2.0 * m * n * k),
                        lambda: torch.matmul(a, b.T, out=c))
        plan = next(p for key, p in op._plans.items() if key[:3] == (m, n, k))
        records.append(dict(kernel="gemm_flag_cost", variant=args.variant,
                            shape=dict(m=m, n=n, k=k), b_layout="nk", gpu=common.gpu_name(),
                            command=common.command_line(), ours_us=t * 1e3,
                            baseline_us=tb * 1e3, speedup=tb / t, rel_err=err,
                            tile_shape=list(plan.tile_shape), slices=plan.slices))
        print(f"{args.variant:9s} {m}x{n}x{k}: ours {t * 1e3:8.2f} us cuBLAS {tb * 1e3:8.2f} "
              f"ratio {tb / t:.3f} err {err:.1e} tile {plan.tile_shape}", flush=True)
    common.write(records, args.out)


if __name__ == "__main__":
    main()
