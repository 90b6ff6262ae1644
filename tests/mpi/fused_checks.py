"""Multi-rank checks of GemmReduceScatter and GemmAllReduce, run under mpiexec.

    mpiexec -n N python tests/mpi/fused_checks.py KERNEL M N K [ITERATIONS] [ARRAYS] [CHUNK_TILES]
        [JOIN] [DELIVER] [SHARED] [FOLD] [COMM_SMS] [START_AT]

KERNEL: rs | ar | both. ARRAYS: numba (bf16 bits in uint16 device arrays) or torch (GPU only).
CHUNK_TILES: tiles per network chunk (default: the op's; small values exercise the counters).
JOIN, DELIVER: the ops' options ("auto": the op's choice). SHARED=on: AllReduce
into its shared output (``shared_out``, ``out=None``), copied after each call on the stream:
the next call's peers write into it, and must not before that copy is done; SHARED=mixed:
rank 0 so, the others into arrays of their own (copied out of their shared outputs). FOLD=on:
ReduceScatter's owners add the delivered partials in their GEMM epilogue (``fold``).
COMM_SMS: a number, or "adaptive" (the controller moves blocks between compute and reduce).
START_AT: the ops first take the state of that many earlier calls (``_start_at``, e.g.
4294967295: the calls cross the wrap of the call counter, the epoch and the queues' tickets).
Each call gets fresh random inputs (never zeros) and a poisoned (NaN) output; the calls run
back to back with no host synchronisation (short runs check the role trace of the last call,
with one synchronisation before it), then every output is compared with a float64 NumPy
reference of the same bf16 inputs (relative Frobenius error <= 1e-2, every element written).
Traced runs also write the trace with ``op.save_trace`` and check it (rank 0): it parses, it
has a track for every role with items, an event per item, times monotone per track, the SMs
per role counter (and with the controller, its target).
Prints ``PASS <kernel> rank <r> ...`` per op; any failure exits non-zero.
"""
import sys

import numpy as np

import mknumba as mk
from mknumba._compat import SIMULATOR
from mknumba.kernels.gemm_ar import GemmAllReduce
from mknumba.kernels.gemm_rs import GemmReduceScatter
from numba import cuda
from trace_checks import check_saved_trace as saved_trace


def bf16_bits(x):
    u = np.ascontiguousarray(x, np.float32).view(np.uint32)
    return ((u + 0x7FFF + ((u >> 16) & 1)) >> 16).astype(np.uint16)


def bits_f64(b):
    return (np.asarray(b).astype(np.uint32) << 16).view(np.float32).astype(np.float64)


def run(comm, Op, m, n, k, iterations, arrays, rng, chunk_tiles, join, deliver,
        shared=False, fold=None, comm_sms=None, start_at=0):
    from mknumba.kernels.gemm.plan import kind_for
    from mknumba.roles.compute import tile_build
    chunk = None
    if chunk_tiles:
        bm, bn = tile_build(kind_for("auto")).shape       # the tile "auto" picks here
        chunk = chunk_tiles * bm * bn * 2
    traced = iterations <= 3        # short runs also check the role trace of the last call
    shared = shared and Op is GemmAllReduce
    into_shared = shared and (shared != "mixed" or comm.rank == 0)   # else: our own arrays
    fold = fold if Op is GemmReduceScatter else None
    op = Op(comm, m, n, k, chunk_bytes=chunk, trace=traced, join=join,
            deliver=deliver, shared_out=bool(shared), fold=fold, comm_sms=comm_sms)
    if start_at:
        op._start_at(start_at)
    op.checked_calls = 0      # one rank: the plain GEMM's calls that took its checked path
    if op.solo:
        gemm_call = op._solo_gemm._call

        def counted(*args):
            op.checked_calls += 1
            return gemm_call(*args)
        op._solo_gemm._call = counted
    rows = op.out_shape()[0]
    sent, outs = [], []
    for it in range(iterations):
        if traced and it == iterations - 1:
            op.synchronize()      # the last call's stamps alone: an item it skips shows as 0
            op.clear_trace()
        a = bf16_bits(rng.standard_normal((m, k)))
        b = bf16_bits(rng.standard_normal((k, n)))
        sent.append((a, b))
        if arrays == "torch":
            import torch
            ta = torch.from_numpy(a.view(np.int16)).cuda().view(torch.bfloat16)
            tb = torch.from_numpy(b.view(np.int16)).cuda().view(torch.bfloat16)
            if into_shared:
                op.output(torch=True).fill_(float("nan"))   # poisoned, in stream order
                outs.append(op(ta, tb).clone())
            else:
                out = torch.full((rows, n), float("nan"), device="cuda", dtype=torch.bfloat16)
                outs.append(op(ta, tb, out=out))
        else:
            out = cuda.to_device(np.full((rows, n), 0x7FC0, np.uint16))   # NaN bits
            if into_shared:
                op.output().copy_to_device(out)
                res = op(cuda.to_device(a), cuda.to_device(b))
                out.copy_to_device(res)
                outs.append(out)
            else:
                outs.append(op(cuda.to_device(a), cuda.to_device(b), out=out))
    op.synchronize()
    if traced:
        check_trace(op)
    worst = 0.0
    for it, ((a, b), out) in enumerate(zip(sent, outs)):
        parts = comm.mpi.allgather((a, b))
        ref = sum(bits_f64(x) @ bits_f64(y) for x, y in parts)
        if Op is GemmReduceScatter:
            ref = ref[comm.rank * rows:(comm.rank + 1) * rows]
        if arrays == "torch":
            import torch
            got = bits_f64(out.view(torch.int16).cpu().numpy().view(np.uint16))
        else:
            got = bits_f64(out.copy_to_host())
        assert np.isfinite(got).all(), f"{op.name} call {it}: {np.sum(~np.isfinite(got))} " \
                                       "outputs unwritten (NaN)"
        err = np.linalg.norm(got - ref) / np.linalg.norm(ref)
        assert err <= 1e-2, f"{op.name} call {it}: relative error {err:.3g}"
        worst = max(worst, err)
    op.calls_seen = None if op.solo else op.frame.read()[0]      # the device's call counter
    op.free()
    return worst, op


def check_saved_trace(op):
    """op.save_trace (collective): rank 0 reads the file back and checks it
    (``trace_checks``): an event per computed tile, every role's events on its tracks, the
    controller's target counter with the adaptive split."""
    doc = saved_trace(op, lambda r, meta: dict(compute=meta["tiles"], reduce=None, send=None,
                                                recv=None, pull=None))
    for r in range(op.comm.size) if doc is not None else ():
        if doc["otherData"]["ranks"][str(r)]["adaptive"]:
            assert any(e["ph"] == "C" and e["pid"] == r and e["name"] == "controller target"
                       for e in doc["traceEvents"])
    return doc


def check_trace(op):
    """Every block started and ended; every role item was stamped, after what it waited for;
    the saved trace (check_saved_trace) has an event per item."""
    doc = check_saved_trace(op)
    ev = op.trace_events()
    grid = sum(ev["role_blocks"].values())
    for e in ("block_start", "block_end"):
        assert (ev[e][:grid] > 0).all(), f"{op.name}: a block has no {e} stamp"
    assert (ev["block_end"][:grid] >= ev["block_start"][:grid]).all()
    p = op.plan
    net = op.comm.nodes > 1
    for before, after, n in (("reduce_ready", "reduce_done", len(p.red_tiles)),
                             ("send_ready", "send_enqueued", p.n_cmds if net else 0),
                             ("recv_arrived", "recv_done", p.n_final if net else 0),
                             ("block_start", "pull_done", len(p.pull_tiles))):
        b, a = ev[before][:n], ev[after][:n]
        if before == "block_start":       # pull items have one stamp: after the block began
            b = np.full(n, ev["block_start"][:grid].min())
        assert (b > 0).all() and (a >= b).all(), f"{op.name}: {before} -> {after} stamps wrong"
    if doc is not None:                # rank 0: this rank's events, one per item
        x = [e for e in doc["traceEvents"] if e["ph"] == "X" and e["pid"] == op.comm.rank]
        for role, n in (("compute", len(p.order)), ("reduce", len(p.red_tiles)),
                        ("send", p.n_cmds if net else 0), ("recv", p.n_final if net else 0),
                        ("pull", len(p.pull_tiles))):
            assert sum(e["cat"] == role for e in x) == n, (role, n)
    if op.adaptive:                    # the controller logged each flexible block's start
        flex = op.role_blocks["compute"] + op.role_blocks["reduce"]
        assert all(len(log) >= 1 for log in ev["controller"][:flex])


def main():
    kernel, m, n, k = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), int(sys.argv[4])
    iterations = int(sys.argv[5]) if len(sys.argv) > 5 else 3
    arrays = sys.argv[6] if len(sys.argv) > 6 else "numba"
    chunk_tiles = int(sys.argv[7]) if len(sys.argv) > 7 else 0
    onoff = {"on": True, "off": False}                         # else: the op's choice
    join = onoff.get(sys.argv[8] if len(sys.argv) > 8 else "")
    deliver = onoff.get(sys.argv[9] if len(sys.argv) > 9 else "")
    shared = {"on": True, "mixed": "mixed"}.get(sys.argv[10] if len(sys.argv) > 10 else "",
                                                 False)
    fold = onoff.get(sys.argv[11] if len(sys.argv) > 11 else "")
    comm_sms = sys.argv[12] if len(sys.argv) > 12 else ""
    comm_sms = None if comm_sms in ("", "0") else comm_sms if comm_sms == "adaptive" \
        else int(comm_sms)
    start_at = int(sys.argv[13]) if len(sys.argv) > 13 else 0
    ops = {"rs": [GemmReduceScatter], "ar": [GemmAllReduce],
           "both": [GemmReduceScatter, GemmAllReduce]}[kernel]
    with mk.init() as comm:
        if not SIMULATOR and arrays == "torch":
            import torch
            torch.cuda.set_device(comm.device_id)
        rng = np.random.default_rng(1000 + comm.rank)
        for Op in ops:
            worst, op = run(comm, Op, m, n, k, iterations, arrays, rng, chunk_tiles, join,
                            deliver, shared, fold, comm_sms, start_at)
            print(f"PASS {Op.kernel_name} rank {comm.rank} topology {comm.nodes}x"
                  f"{comm.local_size} m={m} n={n} k={k} calls={iterations} "
                  f"join={int(op.join)} deliver={int(op.deliver)} solo={int(op.solo)} "
                  f"direct={int(op.direct)} fold={int(op.fold)} adaptive={int(op.adaptive)} "
                  f"calls_seen={op.calls_seen} checked_calls={op.checked_calls} "
                  f"max_rel_err={worst:.2e}",
                  flush=True)
        comm.barrier()


if __name__ == "__main__":
    main()
