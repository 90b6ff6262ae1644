"""What every benchmark shares: timing on the slowest rank, result records, JSON output.

Records follow docs/design.md §8: one dict per measured point, ratios as baseline_ms / ours_ms.
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


#: Options of the emulated network (topologies with 2+ nodes): ``init_topology`` reads them.
NETWORK_ARGS = [
    (("--pace-gbps",), dict(type=float, default=50.0, help="emulated NIC rate per GPU (0: none)")),
    (("--mode",), dict(default="ordered", help="dma completion mode: ordered | completion"))]


def init_topology(topology, args):
    """``mknumba.init`` for ``"NxG"`` (N nodes of G GPUs): with 2+ nodes the nodes are emulated
    by the dma transport in ``args.mode``, paced to ``args.pace_gbps`` per GPU. Returns
    (comm, nodes)."""
    import mknumba
    nodes, gpn = (int(x) for x in topology.split("x"))
    if nodes > 1 and args.pace_gbps > 0:     # the proxy reads the rate when it starts
        os.environ["MKNUMBA_PACE_GBPS"] = f"{args.pace_gbps:g}"
    try:
        comm = mknumba.init(gpus_per_node=gpn,
                            transport=f"dma:{args.mode}" if nodes > 1 else None)
    finally:
        os.environ.pop("MKNUMBA_PACE_GBPS", None)
    return comm, nodes


def transport_of(comm, args):
    """(topology "NxG", paced, transport name) of a Comm made by :func:`init_topology`."""
    paced = comm.nodes > 1 and args.pace_gbps > 0
    transport = "nvlink" if comm.nodes == 1 else (
        f"dma:{args.mode}@{args.pace_gbps:g}GB/s" if paced else f"dma:{args.mode}")
    return f"{comm.nodes}x{comm.local_size}", paced, transport


def init_nccl(port=29541, device=None):
    """torch.distributed over NCCL on the MPI world; returns the module. device: this rank's
    GPU (default: rank modulo the GPUs visible)."""
    import torch
    import torch.distributed as dist
    from mpi4py import MPI
    rank = MPI.COMM_WORLD.Get_rank()
    torch.cuda.set_device(rank % torch.cuda.device_count() if device is None else device)
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ.setdefault("MASTER_PORT", str(port))
    dist.init_process_group("nccl", rank=rank, world_size=MPI.COMM_WORLD.Get_size(),
                            device_id=torch.device("cuda", torch.cuda.current_device()))
    return dist


def command_line():
    launcher = os.environ.get("MKNUMBA_LAUNCHER", "")
    return " ".join(filter(None, [launcher, "python", *map(shlex.quote, sys.argv)]))


def gpu_name():
    import torch
    return torch.cuda.get_device_name()


def time_ms(fn, iters, warmup=3, mpi=None, median=False):
    """Mean ms per call of ``fn`` over ``iters`` back-to-back calls (one sync at the end),
    after ``warmup`` calls; with ``mpi``, ranks start together and the slowest rank counts.

    median: also return the median of the calls' own times on the stream (events between
    calls), i.e. the steady state without occasional host-side stalls: ``(mean, median)``.
    """
    import torch
    for _ in range(warmup):
        fn()
    torch.cuda.synchronize()
    if mpi is not None:
        mpi.Barrier()
    marks = [torch.cuda.Event(enable_timing=True) for _ in range(iters + 1 if median else 2)]
    marks[0].record()
    for i in range(iters):
        fn()
        if median:
            marks[i + 1].record()
    marks[-1].record()
    torch.cuda.synchronize()
    ms = marks[0].elapsed_time(marks[-1]) / iters
    if mpi is not None:
        ms = mpi.allreduce(ms, op=_max())
    if not median:
        return ms
    per = sorted(marks[i].elapsed_time(marks[i + 1]) for i in range(iters))
    med = per[len(per) // 2]
    return ms, (mpi.allreduce(med, op=_max()) if mpi is not None else med)


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


def run_topologies(args, bench_topology, topologies, port, nccl=True):
    """Each topology ("NxG") in turn on the MPI world: ``bench_topology(comm, dist, args,
    records, log)`` appends records, which are written to ``args.out`` after each topology;
    ``log`` prints on rank 0. One NCCL group (torch.distributed) for all of them (``nccl``
    False: none, ``dist`` None; e.g. for ranks sharing a GPU, which NCCL refuses)."""
    from mpi4py import MPI
    rank = MPI.COMM_WORLD.Get_rank()
    dist = init_nccl(port) if nccl else None
    if dist is None:
        import torch
        torch.cuda.set_device(rank % torch.cuda.device_count())
    records = []

    def log(msg):
        if rank == 0:
            print(msg, flush=True)
    for topo in topologies:
        comm, _ = init_topology(topo, args)
        try:
            bench_topology(comm, dist, args, records, log)
        finally:
            comm.finalize()
        if rank == 0:
            write(records, args.out)           # keep what we have after each topology
    if dist is not None:
        dist.destroy_process_group()
