"""Where a fused GEMM + ReduceScatter / AllReduce call spends its time: a role timeline.

    mpirun --bind-to none -n 2 python benchmarks/trace_fused.py --topology 2x1 \
        --configs rs:4096:256:48 --calls 20 --out trace.json

Each config ``kernel:m:k_local:comm_sms[:chunk_kib]`` (comm_sms: a number, ``table`` for the
recorded split, or ``adaptive`` for the controller) builds the op with ``trace=True``, warms
up, times 10 calls (skip with ``--no-timed``; the stamps cost a branch and a store per item),
then runs ``--calls`` more back to back, timing each on the stream and on the host, and reads
the stamps of the last one. Per rank it prints, in microseconds from the first block's start:
when the last tile was computed, the first and last tile the reduce role could start and its
last finished tile, when the send role saw the first and last chunk ready and put the last one
in the ring, when the first and last chunk arrived and the last tile was finished; then the
proxy's counters over the burst, each call's host launch time and stream time. ``--nccl``
brings up a NCCL communicator first (as bench_fused does), ``--gc`` controls the collector.
The JSON keeps every stamp. ``--save-trace PREFIX`` also writes each config's last call as a
Chrome / Perfetto trace, ``PREFIX-<kernel>-<m>-<k>-<comm_sms>.json`` (``op.save_trace``), which
``benchmarks/plot_timeline.py`` draws as SMs per role over time.
"""
import gc
import os
import sys
import time

import common

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

from mknumba.kernels.gemm_ar import GemmAllReduce  # noqa: E402
from mknumba.kernels.gemm_rs import GemmReduceScatter  # noqa: E402

OPS = {"rs": GemmReduceScatter, "ar": GemmAllReduce}


def summarize(ev, rb):
    """Microseconds from the first block start to each milestone of the call."""
    t0 = ev["block_start"][ev["block_start"] > 0].min()
    us = lambda x: round((float(x) - t0) / 1e3, 1)    # noqa: E731

    def span(name):
        v = ev[name][ev[name] > 0]
        return (us(v.min()), us(v.max())) if len(v) else (None, None)
    s = {"total": us(ev["block_end"].max()), "compute_end": us(ev["tile_done"].max()),
         "reduce_ready": span("reduce_ready"), "reduce_done": span("reduce_done"),
         "send_ready": span("send_ready"), "send_enqueued": span("send_enqueued"),
         "recv_arrived": span("recv_arrived"), "recv_done": span("recv_done"),
         "pull_done": span("pull_done")}
    ready, enq = ev["send_ready"], ev["send_enqueued"]
    n = int((enq > 0).sum())
    s["enqueue_lag_max_us"] = round(float((enq[:n] - ready[:n]).max()) / 1e3, 1) if n else None
    return s


def main():
    args = common.parse_args(ranks=2, extra=[
        (("--topology",), dict(default="2x1")),
        (("--configs",), dict(default="rs:4096:256:16,ar:4096:256:16")),
        *common.NETWORK_ARGS,
        (("--calls",), dict(type=int, default=1)),
        (("--no-timed",), dict(dest="timed", action="store_false")),
        (("--nccl",), dict(action="store_true")),
        (("--gc",), dict(default="on", choices=("on", "off", "freeze"))),
        (("--save-trace",), dict(default=None, metavar="PREFIX"))])
    import torch
    if args.nccl:      # as bench_fused does: a NCCL communicator up before mknumba starts
        dist = common.init_nccl(29542)
        x = torch.ones(1 << 20, device="cuda")
        dist.all_reduce(x)
        torch.cuda.synchronize()
    print(f"rank cpus {len(os.sched_getaffinity(0))}", flush=True)
    comm, nodes = common.init_topology(args.topology, args)
    torch.cuda.set_device(comm.device_id)
    records = []
    try:
        for spec in args.configs.split(","):
            kern, m, k, sms, *chunk = spec.split(":")
            m, k = int(m), int(k)
            sms = {"table": None, "adaptive": "adaptive"}.get(sms, sms)
            sms = int(sms) if sms not in (None, "adaptive") else sms
            chunk = int(chunk[0]) * 1024 if chunk else None
            torch.manual_seed(comm.rank)
            a = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
            b = torch.randn(m, k, device="cuda", dtype=torch.bfloat16).T
            op = OPS[kern](comm, m, m, k, comm_sms=sms, chunk_bytes=chunk, trace=True)
            if args.gc == "off":            # host pauses of the collector, for comparison
                gc.disable()
            elif args.gc == "freeze":
                gc.collect()
                gc.freeze()
            out = torch.empty(op.out_shape(), device="cuda", dtype=torch.bfloat16)
            for _ in range(3):
                op(a, b, out=out)
            op.synchronize()
            ms = (common.time_ms(lambda: op(a, b, out=out), 10, mpi=comm.mpi) if args.timed
                  else float("nan"))
            op.synchronize()
            before = comm.proxy.stats if comm.proxy else {}
            if comm.proxy:
                comm.proxy.reset_max()
            comm.barrier()
            t = time.perf_counter()
            # args.calls back to back; events between them give each call's time on the
            # stream, the stamps are those of the last call
            marks = [torch.cuda.Event(enable_timing=True) for _ in range(args.calls + 1)]
            marks[0].record()
            launch_us = []
            for i in range(args.calls):
                t1 = time.perf_counter()
                op(a, b, out=out)
                marks[i + 1].record()
                launch_us.append(round((time.perf_counter() - t1) * 1e6))
            op.synchronize()
            wall = (time.perf_counter() - t) * 1e3
            per_call = [round(marks[i].elapsed_time(marks[i + 1]), 3) for i in range(args.calls)]
            after = comm.proxy.stats if comm.proxy else {}
            if args.save_trace:
                op.save_trace(f"{args.save_trace}-{kern}-{m}-{k}-{sms or 'table'}.json")
            ev = op.trace_events()
            rb = ev.pop("role_blocks")
            ev.pop("controller")
            s = summarize(ev, rb)
            s["proxy"] = {key: after[key] - (0 if key.startswith("max") else before[key])
                          for key in after}
            s["launch_us"] = launch_us
            s["per_call_ms"] = per_call
            all_s = comm.mpi.gather(s, root=0)
            all_ev = comm.mpi.gather({key: v.tolist() for key, v in ev.items()}, root=0)
            if comm.rank == 0:
                print(f"== {kern} {args.topology} m={m} k={k} comm_sms={sms} chunk={chunk} "
                      f"pace={args.pace_gbps:g}: {ms:.3f} ms per call (timed), traced call "
                      f"{wall:.3f} ms wall; roles {rb}", flush=True)
                for r, x in enumerate(all_s):
                    print(f"  rank {r}: " + "  ".join(f"{key}={v}" for key, v in x.items()),
                          flush=True)
                records.append(common.record(
                    f"trace_{op.kernel_name}", {"m": m, "n": m, "k": k}, dtype="bfloat16",
                    world=comm.size, topology=args.topology, ours_ms=ms, baseline=None,
                    baseline_ms=None, floor_ms=None, comm_sms=op.comm_sms,
                    controller=op.adaptive,
                    transport=f"dma:{args.mode}" if nodes > 1 else "nvlink",
                    chunk_bytes=chunk, pace_gbps=args.pace_gbps, role_blocks=rb,
                    summary=all_s, events=all_ev))
                common.write(records, args.out)
            op.free()
    finally:
        comm.finalize()


if __name__ == "__main__":
    main()
