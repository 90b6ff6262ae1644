"""Diagnostic: what one dma-transport driver call costs on the host, by kind of call.

    mpirun -n 2 -x MKNUMBA_GPUS_PER_NODE=1 python benchmarks/probe_dma.py

Rank 0 times N calls of each kind on one stream (host seconds per call, then the wait for the
stream), rank 1 only hosts the destination. Kinds: 256-byte copy to the peer (IPC) or to local
memory; the same with one batched memop of 8 flag writes per 8 copies, to the peer's device
memory or to pinned host memory; memops alone. Each kind runs twice: on an idle GPU, and while
a kernel polls mapped host memory as a send role waiting for credits does.

    ... probe_dma.py --ce

Copy-engine throughput without the proxy: rank 0 queues 1 GiB of back-to-back peer copies of
one chunk size behind a kernel that sleeps 40 ms (so the host's issue rate cannot limit them),
on 1, 2 or 4 streams taken in turn, and times them with events. This is the most a transport that
issues one copy per command could reach, beside one large copy.
"""
import argparse
import time

import numpy as np

import mknumba
from mknumba.primitives import globaltimer, ld_acquire_sys
from mknumba.proxy.transports import _cudrv as drv
from numba import cuda

N = 4000


@cuda.jit
def spin(stop, counter):
    """What a send role does while it waits for credits: poll mapped host memory."""
    while ld_acquire_sys(stop, 0) == 0:
        cuda.atomic.add(counter, 0, 1)


@cuda.jit
def sleep_ns(ns):
    """Hold the stream for ``ns`` without touching host memory."""
    t0 = globaltimer()
    while globaltimer() - t0 < ns:
        pass


def copy_engine(comm, t, wb):
    """Rank 0: GB/s of 1 GiB of queued peer copies, by chunk size and stream count."""
    if comm.rank != 0:
        return
    d = t.drv
    src, peer = int(t.src_base[wb]), int(t.dst_base[wb, 1])
    span = 64 << 20
    total = 1 << 30
    sleep_ns[1, 1](np.int64(1000))     # compile
    cuda.synchronize()
    for chunk in (span, 4 << 20, 1 << 20, 256 << 10):
        for nstreams in (1, 2, 4):
            streams = [cuda.stream() for _ in range(nstreams)]
            handles = [int(getattr(s.handle, "value", s.handle)) for s in streams]
            gate, start = cuda.event(), cuda.event()
            sleep_ns[1, 1, streams[0]](np.int64(40_000_000))
            gate.record(streams[0])
            for s in streams[1:]:
                gate.wait(s)
            start.record(streams[0])
            n = total // chunk
            t0 = time.perf_counter()
            for i in range(n):
                off = (i * chunk) % span
                d.call("copy", peer + off, src + off, chunk, handles[i % nstreams])
            host = time.perf_counter() - t0
            ends = []
            for s in streams:
                e = cuda.event()
                e.record(s)
                ends.append(e)
            cuda.synchronize()
            ms = max(cuda.event_elapsed_time(start, e) for e in ends)
            ok = "" if host < 0.035 else "  (host issue outlasted the gate: host-bound)"
            print(f"ce {chunk >> 10:6d} KiB x {n:5d} on {nstreams} stream(s): "
                  f"{total / ms / 1e6:7.1f} GB/s; host {1e6 * host / n:5.2f} us/copy{ok}",
                  flush=True)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--ce", action="store_true", help="copy-engine throughput only")
    args = ap.parse_args()
    comm = mknumba.init(gpus_per_node=1, transport="dma:ordered")
    proxy = comm.proxy
    buf = comm.alloc_symmetric(((64 if args.ce else 1) << 20,), np.uint8)
    flags = comm.alloc_flags(4096)
    wb, wf = proxy.register(buf), proxy.register(flags)
    t = proxy.transport
    if args.ce:
        copy_engine(comm, t, wb)
    elif comm.rank == 0:
        d, s = t.drv, t.drv.out("stream_create", drv.CU_STREAM_NON_BLOCKING)
        src = int(t.src_base[wb])
        peer, local = int(t.dst_base[wb, 1]), int(t.dst_base[wb, 0])
        host = np.zeros(4096, np.uint32)
        hflags = drv.CU_MEMHOSTREGISTER_PORTABLE | drv.CU_MEMHOSTREGISTER_DEVICEMAP
        d.call("host_register", host.ctypes.data, host.nbytes, hflags)
        hdev = d.out("host_devptr", host.ctypes.data, 0)
        params = np.zeros(8 * drv.MEMOP_WORDS, np.uint64)
        addr, val = np.zeros(8, np.uint64), np.arange(8, dtype=np.uint64)

        def memop(base):
            addr[:] = base + 4 * np.arange(8, dtype=np.uint64)
            return drv.write_values(d.memops, s, addr, val, 8, False, params)

        done = set()
        kinds = {
            "copy->peer": lambda i: d.copy(peer + 256 * (i % 4096), src, 256, s),
            "copy->local": lambda i: d.copy(local + 256 * (i % 4096), src + (1 << 19), 256, s),
            "copy->peer+memop(peer)": lambda i: d.copy(peer + 256 * (i % 4096), src, 256, s)
            or (memop(int(t.dst_base[wf, 1])) if i % 8 == 7 else 0),
            "copy->peer+memop(host)": lambda i: d.copy(peer + 256 * (i % 4096), src, 256, s)
            or (memop(hdev) if i % 8 == 7 else 0),
            "memop(peer) x8": lambda i: memop(int(t.dst_base[wf, 1])),
            "memop(local) x8": lambda i: memop(int(t.dst_base[wf, 0])),
            "memop(host) x8": lambda i: memop(hdev),
        }
        stop = cuda.mapped_array(1, np.uint32)
        counter = cuda.to_device(np.zeros(1, np.int64))
        other = cuda.stream()
        for name, f in list(kinds.items()) * 2:
            busy = name in done
            done.add(name)
            if busy:
                stop[0] = 0
                spin[4, 64, other](stop, counter)
                time.sleep(0.01)
            for i in range(200):
                assert f(i) == 0, name
            d.call("stream_sync", s)
            t0 = time.perf_counter()
            for i in range(N):
                f(i)
            t1 = time.perf_counter()
            d.call("stream_sync", s)
            t2 = time.perf_counter()
            if busy:
                stop[0] = 1
                other.synchronize()
            print(f"{name + (' (kernel spinning)' if busy else ''):44s} host {1e6 * (t1 - t0) / N:7.2f} us/call, "
                  f"then stream drain {1e3 * (t2 - t1):7.2f} ms", flush=True)
        d.call("host_unregister", host.ctypes.data)
    comm.barrier()
    comm.finalize()


if __name__ == "__main__":
    main()
