"""What every benchmark shares: timing on the slowest rank, result records, JSON output.

Records follow DESIGN.md §8: one dict per measured point, ratios as baseline_ms / ours_ms.
"""
import argparse
import datetime
import json
import os
import shlex
import sys


def parse_args(ranks, extra=None):
    """``--out PATH`` (JSON list of records) and ``--ranks`` (print how many ranks, exit)."""
    p = argparse.ArgumentParser()
    p.add_argument("--out", default=None)
    p.add_argument("--ranks", action="store_true", help="print the ranks this benchmark needs")
    for args, kw in (extra or []):
        p.add_argument(*args, **kw)
    a = p.parse_args()
    if a.ranks:
        print(ranks)
        sys.exit(0)
    return a


def command_line():
    launcher = os.environ.get("MKNUMBA_LAUNCHER", "")
    return " ".join(filter(None, [launcher, "python", *map(shlex.quote, sys.argv)]))


def gpu_name():
    import torch
    return torch.cuda.get_device_name()


def time_ms(fn, iters, warmup=3, mpi=None):
    """Mean ms per call of ``fn`` over ``iters`` back-to-back calls (one sync at the end),
    after ``warmup`` calls; with ``mpi``, ranks start together and the slowest rank counts."""
    import torch
    for _ in range(warmup):
        fn()
    torch.cuda.synchronize()
    if mpi is not None:
        mpi.Barrier()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(iters):
        fn()
    end.record()
    torch.cuda.synchronize()
    ms = start.elapsed_time(end) / iters
    return mpi.allreduce(ms, op=_max()) if mpi is not None else ms


def _max():
    from mpi4py import MPI
    return MPI.MAX


def record(kernel, shape, *, dtype, world, topology, transport, ours_ms, baseline,
           baseline_ms, floor_ms, **extra):
    rec = dict(kernel=kernel, shape={k.lower(): v for k, v in shape.items()}, dtype=dtype,
               world=world, topology=topology, transport=transport, ours_ms=ours_ms,
               baseline=baseline, baseline_ms=baseline_ms,
               speedup=(baseline_ms / ours_ms) if ours_ms and baseline_ms else None,
               floor_ms=floor_ms, gpu=gpu_name(),
               date=datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d"),
               command=command_line())
    rec.update(extra)
    return rec


def write(records, path):
    if path:
        os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
        with open(path, "w") as f:
            json.dump(records, f, indent=1)
