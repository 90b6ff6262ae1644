"""Proxy + transport benchmark on two (emulated) nodes, beside NCCL send/recv in the same run.

    mpirun --allow-run-as-root --bind-to none -n 2 -x MKNUMBA_GPUS_PER_NODE=1 \\
        -x NCCL_NVLS_ENABLE=0 python benchmarks/bench_proxy.py [--transport dma:ordered] \\
        [--copy each|batch]

Measures, rank 0 -> rank 1 (records with kernel "proxy" appended to
benchmarks/results/proxy.json; one run replaces its own transport's earlier records):
(a) commands/s and host time per command: a kernel enqueues many 256-byte chunks (not adjacent,
    so each is its own copy);
(b) bandwidth for chunks of 64 KiB .. 4 MiB, beside NCCL and a raw copy-engine copy (adjacent
    chunks, which the dma transport merges into fewer copies; then 1 MiB chunks with gaps);
(c) one-way latency of a 4 KiB chunk: ping-pong through both proxies, beside NCCL ping-pong.
"""
import argparse
import datetime
import json
import os
import sys
import time

import numpy as np

import mknumba
from mknumba.errors import ROLE_RECV
from mknumba.primitives import globaltimer, wait_flag
from mknumba.roles.send import enqueue
from numba import cuda

# Bytes of the source/destination windows: a run of (b) never reuses a destination, as a send
# role would not before its receiver consumed it (with 64 MiB, 1 MiB chunk j and j + 64 shared
# one, and a batch holding both may not be merged: dma keeps overlapping writes in ring order).
SPAN = 1 << 30
REF_BYTES = 64 << 20     # the raw copy-engine reference: one copy of this size
NFLAGS = 1 << 18


@cuda.jit
def send_many(ring, head, tail, peer, n, nbytes, stride, epoch, timeout_ns, err, rank):
    deadline = globaltimer() + timeout_ns
    for j in range(cuda.grid(1), n, cuda.gridsize(1)):
        off = (j * stride) % SPAN
        if not enqueue(ring, head, tail, peer, 0, off, 1, off, nbytes, j, 2, j, epoch, deadline,
                       err, rank):
            return


@cuda.jit
def wait_all(flags, n, epoch, timeout_ns, err, rank):
    deadline = globaltimer() + timeout_ns
    for j in range(cuda.grid(1), n, cuda.gridsize(1)):
        if not wait_flag(flags, j, epoch, deadline, err, rank, ROLE_RECV):
            return


@cuda.jit
def ping_pong(ring, head, tail, flags, peer, first, iters, nbytes, epoch0, timeout_ns, err, rank):
    """One thread. The first rank sends into the peer's flag slot 0 and waits on its slot 1;
    the other waits on slot 0 and answers into slot 1."""
    deadline = globaltimer() + timeout_ns
    for i in range(iters):
        e = epoch0 + i
        if not first and not wait_flag(flags, 0, e, deadline, err, rank, ROLE_RECV):
            return
        slot = 0 if first else 1
        if not enqueue(ring, head, tail, peer, 0, 0, 1, 0, nbytes, i, 2, slot, e, deadline,
                       err, rank):
            return
        if first and not wait_flag(flags, 1, e, deadline, err, rank, ROLE_RECV):
            return


class Bench:
    def __init__(self, args):
        # Two ranks posing as two nodes of one GPU each: the proxy carries all traffic.
        self.senders = args.senders
        self.comm = comm = mknumba.init(gpus_per_node=1, transport=args.transport)
        assert comm.size == 2 and comm.nodes == 2, "run 2 ranks"
        self.proxy = comm.proxy
        self.src = comm.alloc_symmetric((SPAN,), np.uint8)
        self.dst = comm.alloc_symmetric((SPAN,), np.uint8)
        self.flags = comm.alloc_flags(NFLAGS)
        for b in (self.src, self.dst, self.flags):
            self.proxy.register(b)
        self.err = comm.new_error_record()
        self.epoch = 0
        self.stream = cuda.stream()
        self.stream2 = cuda.stream()
        import torch
        import torch.distributed as dist
        self.torch, self.dist = torch, dist
        port = comm.mpi.bcast(29500 + os.getpid() % 1000, root=0)
        torch.cuda.set_device(comm.device_id)
        dist.init_process_group("nccl", init_method=f"tcp://127.0.0.1:{port}",
                                rank=comm.rank, world_size=2)
        self.tbuf = torch.zeros(SPAN, dtype=torch.uint8, device="cuda")
        self.tbuf2 = torch.zeros(SPAN, dtype=torch.uint8, device="cuda")
        warm = torch.zeros(1, device="cuda")
        dist.all_reduce(warm)
        torch.cuda.synchronize()

    def timed(self, fn):
        """fn() issues the work on this rank; returns the slowest rank's seconds."""
        comm = self.comm
        comm.barrier()
        t0 = time.perf_counter()
        fn()
        comm.synchronize()   # polls, GIL released: the kernels need our proxy thread meanwhile
        self.torch.cuda.synchronize()
        dt = time.perf_counter() - t0
        comm.check(self.err, "bench")
        self.proxy.check()
        return comm.mpi.allreduce(dt, op=__import__("mpi4py").MPI.MAX)

    def transfer(self, n, nbytes, stride=None):
        """Rank 0 sends n chunks ``stride`` bytes apart (default: adjacent); rank 1 waits for
        all flags. Returns seconds."""
        self.epoch += 1
        ring, head, tail = self.proxy.device_args()
        c, e = self.comm, self.epoch

        def go():
            if c.rank == 0:
                blocks, threads = (4, 64) if self.senders > 1 else (1, 1)
                send_many[blocks, threads, self.stream](ring, head, tail, 1, n, nbytes,
                                                        stride or nbytes, e, c.timeout_ns,
                                                        self.err, c.rank)
            else:
                wait_all[8, 128, self.stream](self.flags.local, n, e, c.timeout_ns, self.err,
                                              c.rank)
        return self.timed(go)

    def nccl(self, n, nbytes):
        dist, t = self.dist, self.tbuf

        def go():
            ops = []
            for j in range(n):
                off = (j * nbytes) % SPAN
                v = t[off:off + nbytes]
                ops.append(dist.P2POp(dist.isend if self.comm.rank == 0 else dist.irecv, v,
                                      1 - self.comm.rank))
            for w in dist.batch_isend_irecv(ops):
                w.wait()
        return self.timed(go)

    def ping(self, iters, nbytes):
        ring, head, tail = self.proxy.device_args()
        c = self.comm
        e0 = self.epoch + 1
        self.epoch += iters

        def go():
            ping_pong[1, 1, self.stream](ring, head, tail, self.flags.local, 1 - c.rank,
                                         c.rank == 0, iters, nbytes, e0, c.timeout_ns, self.err,
                                         c.rank)
        return self.timed(go) / (2 * iters)

    def nccl_ping(self, iters, nbytes):
        dist, v = self.dist, self.tbuf[:nbytes]
        peer = 1 - self.comm.rank

        def go():
            for _ in range(iters):
                if self.comm.rank == 0:
                    dist.send(v, peer)
                    dist.recv(v, peer)
                else:
                    dist.recv(v, peer)
                    dist.send(v, peer)
        return self.timed(go) / (2 * iters)

    def copy_engine_gbps(self):
        """Raw copy-engine bandwidth rank 0 -> rank 1 (one big IPC copy), the 80 % reference."""
        t = self.proxy.transport
        if not hasattr(t, "drv"):
            return None
        nbytes = REF_BYTES

        def go():
            if self.comm.rank == 0:
                for _ in range(10):
                    t.drv.call("copy", int(t.dst_base[1, 1]), int(t.src_base[0]), nbytes,
                               t.stream)
                t.drv.call("stream_sync", t.stream)
        return 10 * nbytes / self.timed(go) / 1e9


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--transport", default=os.environ.get("MKNUMBA_TRANSPORT", "dma:ordered"))
    ap.add_argument("--copy", default=None, help="dma copy mode: each | batch")
    ap.add_argument("--batch", type=int, default=None, help="commands per submission (8)")
    ap.add_argument("--senders", type=int, default=256, choices=(1, 256),
                    help="threads enqueueing: 256 in parallel, or 1 in chunk order (as a send "
                         "role does; adjacent chunks then reach the proxy together and merge)")
    ap.add_argument("--commands", type=int, default=200_000)
    ap.add_argument("--out", default=os.path.join(os.path.dirname(__file__), "results",
                                                  "proxy.json"))
    ap.add_argument("--ranks", action="store_true", help="print the ranks this needs (2)")
    args = ap.parse_args()
    if args.ranks:
        print(2)
        return
    if args.copy:
        os.environ["MKNUMBA_DMA_COPY"] = args.copy
    if args.batch:
        os.environ["MKNUMBA_PROXY_BATCH"] = str(args.batch)
    b = Bench(args)
    comm, proxy = b.comm, b.proxy
    tname = f"{proxy.transport.name}:{proxy.transport.completion}"
    if hasattr(proxy.transport, "copy"):
        tname += f":{proxy.transport.copy}"
    if proxy.max_batch != 8:
        tname += f":batch{proxy.max_batch}"
    if args.senders == 1:
        tname += ":in-order"
    if os.environ.get("MKNUMBA_PACE_GBPS"):
        tname += f":paced{os.environ['MKNUMBA_PACE_GBPS']}"
    gpu = cuda.get_current_device().name
    gpu = gpu.decode() if isinstance(gpu, bytes) else gpu
    base = {"kernel": "proxy", "dtype": "uint8", "world": 2, "topology": "2x1",
            "transport": tname, "gpu": gpu, "date": datetime.date.today().isoformat(),
            "command": "mpirun --bind-to none -n 2 -x MKNUMBA_GPUS_PER_NODE=1 python "
            + " ".join(sys.argv)}
    recs = []
    say = print if comm.rank == 0 else (lambda *a, **k: None)

    # warm-up: compile, connect, first-touch
    b.transfer(64, 4096), b.nccl(64, 4096), b.ping(10, 4096), b.nccl_ping(10, 4096)
    copy_gbps = b.copy_engine_gbps()
    say(f"transport {tname}; raw copy-engine GPU0->GPU1: {copy_gbps} GB/s")

    # (a) commands per second, host time per command
    n = min(args.commands, NFLAGS)
    s0 = dict(proxy.stats)
    t = b.transfer(n, 256, stride=512)     # gaps: one copy per command, none merged
    stats = comm.mpi.bcast(dict(proxy.stats), root=0)
    cmds = stats["commands"] - comm.mpi.bcast(s0, root=0)["commands"]
    busy = stats["busy_ns"] - comm.mpi.bcast(s0, root=0)["busy_ns"]
    bat = stats["batches"] - comm.mpi.bcast(s0, root=0)["batches"]
    tn = b.nccl(min(n, 20_000), 256) * n / min(n, 20_000)
    recs.append(dict(base, metric="commands", shape={"chunk_bytes": 256, "commands": n},
                     chunk_bytes=256, ours_ms=t * 1e3, baseline="nccl send/recv (batched)",
                     baseline_ms=tn * 1e3, speedup=tn / t, floor_ms=None,
                     commands_per_s=n / t, host_us_per_command=busy / 1e3 / max(cmds, 1),
                     avg_batch=cmds / max(bat, 1)))
    say(f"(a) {n} x 256 B: {n / t:,.0f} commands/s, host {busy / 1e3 / max(cmds, 1):.2f} "
        f"us/command, avg batch {cmds / max(bat, 1):.2f}; NCCL {n / tn:,.0f} msgs/s")

    # (b) bandwidth
    def copies():   # copy-engine copies the sender's proxy issued (adjacent chunks merge)
        return comm.mpi.bcast(getattr(proxy.transport, "copies_issued", 0), root=0)

    for chunk in (64 << 10, 256 << 10, 1 << 20, 4 << 20):
        n = max(64, min(NFLAGS, (1 << 30) // chunk))
        c0 = copies()
        t = b.transfer(n, chunk)
        per_copy = n / max(copies() - c0, 1)
        tn = b.nccl(n, chunk)
        gbps, ngbps = n * chunk / t / 1e9, n * chunk / tn / 1e9
        floor = n * chunk / (copy_gbps * 1e9) if copy_gbps else None
        recs.append(dict(base, metric="bandwidth", shape={"chunk_bytes": chunk, "chunks": n},
                         chunk_bytes=chunk, ours_ms=t * 1e3, baseline="nccl send/recv",
                         baseline_ms=tn * 1e3, speedup=tn / t,
                         floor_ms=floor * 1e3 if floor else None, gbps=gbps,
                         baseline_gbps=ngbps, copy_engine_gbps=copy_gbps,
                         fraction_of_copy=gbps / copy_gbps if copy_gbps else None,
                         chunks_per_copy=per_copy))
        say(f"(b) {chunk >> 10:5d} KiB x {n}: {gbps:7.1f} GB/s "
            f"({100 * gbps / copy_gbps if copy_gbps else float('nan'):.0f}% of copy engine, "
            f"{per_copy:.2f} chunks per copy); NCCL {ngbps:7.1f} GB/s")

    # (b') chunks that are not adjacent: the dma transport cannot merge their copies
    chunk, n = 1 << 20, 512
    t = b.transfer(n, chunk, stride=2 * chunk)
    gbps = n * chunk / t / 1e9
    recs.append(dict(base, metric="bandwidth_scattered", shape={"chunk_bytes": chunk, "chunks": n},
                     chunk_bytes=chunk, ours_ms=t * 1e3, baseline=None, baseline_ms=None,
                     speedup=None, floor_ms=n * chunk / (copy_gbps * 1e9) * 1e3 if copy_gbps
                     else None, gbps=gbps, copy_engine_gbps=copy_gbps,
                     fraction_of_copy=gbps / copy_gbps if copy_gbps else None))
    say(f"(b') {chunk >> 10:5d} KiB x {n}, every other slot: {gbps:7.1f} GB/s "
        f"({100 * gbps / copy_gbps if copy_gbps else float('nan'):.0f}% of copy engine)")

    # (c) one-way latency, 4 KiB
    iters = 2000
    lat, nlat = b.ping(iters, 4096), b.nccl_ping(iters, 4096)
    recs.append(dict(base, metric="latency", shape={"chunk_bytes": 4096, "iters": iters},
                     chunk_bytes=4096, ours_ms=lat * 1e3, baseline="nccl send/recv ping-pong",
                     baseline_ms=nlat * 1e3, speedup=nlat / lat, floor_ms=None,
                     latency_us=lat * 1e6, baseline_latency_us=nlat * 1e6))
    say(f"(c) 4 KiB one-way latency: {lat * 1e6:.1f} us; NCCL {nlat * 1e6:.1f} us")

    if comm.rank == 0:
        old = json.load(open(args.out)) if os.path.exists(args.out) else []
        old = [r for r in old if r.get("transport") != tname]
        os.makedirs(os.path.dirname(args.out), exist_ok=True)
        json.dump(old + recs, open(args.out, "w"), indent=1)
        print(f"wrote {len(recs)} records to {args.out}")
    b.dist.destroy_process_group()
    comm.finalize()


if __name__ == "__main__":
    main()
