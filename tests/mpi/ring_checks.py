"""Multi-rank checks of RingAttention, run under mpiexec.

    mpiexec -n N python tests/mpi/ring_checks.py BATCH SEQ_LOCAL HEADS KV_HEADS HEAD_DIM CALLS
        [ARRAYS [graph | adaptive]]

For each layout (contiguous, zigzag) and mask (full, causal): CALLS calls back to back with
fresh random inputs (the same global sequence on every rank, from one seed, sharded by the
layout) and poisoned outputs (NaN), then each rank's out and lse are compared with a float64
NumPy reference of the whole sequence, restricted to this rank's rows (relative Frobenius error
of out <= 1e-2, lse within 1e-3). ARRAYS: numba (bf16 bits) or torch (GPU only). Prints
``PASS ring <layout> causal=<0|1> rank <r> ...``.

adaptive: the same checks of an op planned with ``comm_sms="adaptive"`` and ``trace=True``,
its call counter set to 2**32 - 2 first (the calls cross the epoch's wrap); then the
controller's state (no block left in the communication role, every tile and part measured
once per call, the queues' tickets), which blocks did the tiles and parts (flexible ones), and
the saved trace (rank 0). Prints ``PASS adaptive ring ...``.

graph (GPU): instead, for each layout and mask, a CUDA graph capture of a call
(torch.cuda.graph for torch, cuStreamBeginCapture on a numba stream for numba; ``GraphCapture``
in frame_checks), every rank capturing and replaying: a call that would allocate out and lse
is refused inside the capture with MkError naming out= and lse=; then one capture with out=
and lse= and CALLS replays, each with a fresh global sequence copied into the captured q, k, v
and out and lse poisoned, each checked as above; an ordinary call half-way; the call counter
counts every launch. Prints ``PASS graph ring <layout> causal=<0|1> rank <r> ...``.
"""
import sys

import numpy as np

import mknumba as mk
from mknumba._compat import SIMULATOR
from mknumba.arrays import from_bf16_bits, to_bf16_bits
from mknumba.sched.sequence import positions, shard
from numba import cuda


def reference(q, k, v, causal):
    """float64 attention over the whole sequence: (out [b, S, h, d], lse [b, h, S])."""
    b, S, h, d = q.shape
    g = h // k.shape[2]
    out, lse = np.zeros(q.shape), np.zeros((b, h, S))
    for bi in range(b):
        for hi in range(h):
            s = q[bi, :, hi] @ k[bi, :, hi // g].T / np.sqrt(d)
            if causal:
                s = np.where(np.arange(S)[None, :] <= np.arange(S)[:, None], s, -np.inf)
            mx = s.max(1, keepdims=True)
            p = np.exp(s - mx)
            den = p.sum(1, keepdims=True)
            out[bi, :, hi] = p / den @ v[bi, :, hi // g]
            lse[bi, hi] = (mx + np.log(den))[:, 0]
    return out, lse


def to_device(bits, arrays):
    if arrays == "torch":
        import torch
        return torch.from_numpy(bits.view(np.int16)).cuda().view(torch.bfloat16)
    return cuda.to_device(bits) if not SIMULATOR else bits.copy()


def to_host(x, arrays):
    if arrays == "torch":
        import torch
        return x.view(torch.int16).cpu().numpy().view(np.uint16) if x.dtype == torch.bfloat16 \
            else x.cpu().numpy()
    return x.copy_to_host() if hasattr(x, "copy_to_host") else np.asarray(x)


def run(comm, dims, calls, arrays, layout, causal, adaptive=False):
    b, s, h, hk, d = dims
    W, r = comm.size, comm.rank
    op = mk.RingAttention(comm, b, s, h, hk, d, causal=causal, layout=layout,
                          **(dict(comm_sms="adaptive", trace=True) if adaptive else {}))
    start = 2 ** 32 - 2 if adaptive else 0
    if adaptive:
        comm.barrier()             # no peer is still in a call that writes our flags
        op._start_at(start)
        comm.barrier()             # nobody's next call publishes before every rank is set
    rng = np.random.default_rng(77)                  # one global sequence on every rank
    sent, got = [], []
    for _ in range(calls):
        full = [to_bf16_bits(rng.standard_normal((b, W * s, n, d))) for n in (h, hk, hk)]
        sent.append(full)
        mine = [to_device(shard(x, r, W, layout), arrays) for x in full]
        if arrays == "torch":
            import torch
            out = torch.full((b, s, h, d), float("nan"), device="cuda", dtype=torch.bfloat16)
            lse = torch.full((b, h, s), float("nan"), device="cuda")
        else:
            out = to_device(np.full((b, s, h, d), 0x7FC0, np.uint16), arrays)
            lse = to_device(np.full((b, h, s), np.nan, np.float32), arrays)
            if not SIMULATOR:
                lse = cuda.to_device(np.full((b, h, s), np.nan, np.float32))
        got.append(op(*mine, out=out, lse=lse))
    op.synchronize()
    worst = 0.0
    rows = positions(r, s, W, layout)
    for it, (full, (out, lse)) in enumerate(zip(sent, got)):
        ro, rl = reference(*(from_bf16_bits(x).astype(np.float64) for x in full), causal)
        o = from_bf16_bits(to_host(out, arrays)).astype(np.float64)
        L = to_host(lse, arrays).astype(np.float64)
        assert np.isfinite(o).all() and np.isfinite(L).all(), f"call {it}: unwritten outputs"
        err = np.linalg.norm(o - ro[:, rows]) / np.linalg.norm(ro[:, rows])
        lerr = np.abs(L - rl[:, :, rows]).max()
        assert err <= 1e-2 and lerr <= 1e-3, f"call {it}: out rel err {err:.3g}, lse {lerr:.3g}"
        worst = max(worst, err)
    if adaptive:
        check_controller(comm, op, start, calls, f"{layout}-{int(causal)}")
    op.free()
    return worst


def check_controller(comm, op, start, calls, tag):
    """An adaptive op after ``calls`` calls from ``_start_at(start)``, synchronised."""
    import json
    import os
    import tempfile
    from mknumba.roles import controller as C
    ev = op.trace_events()
    rb = op.role_blocks
    pool = range(rb["send"] + rb["forward"], op.grid)
    assert (ev["block_start"][:op.grid] > 0).all() and (ev["block_end"][:op.grid] > 0).all()
    for blk in pool:                 # every flexible block decided at least once, in order
        log = ev["controller"][blk]
        assert log and all(t1 <= t2 for (t1, _, _), (t2, _, _) in zip(log, log[1:])), log
        assert all(x in (C.COMPUTE, C.COMM) and 0 <= w <= rb["compute"] for _, x, w in log)
    for first, last, who, n in (("tile_start", "tile_done", "tile_block", op.tiles),
                                ("push_start", "push_done", "push_block", op.ncomm)):
        assert (ev[first][:n] > 0).all() and (ev[last][:n] >= ev[first][:n]).all(), first
        assert all(ev[who][i] in pool for i in range(n)), (who, ev[who][:n], list(pool))
    ctl = op.ctl.copy_to_host()
    assert ctl[C.CTL_ACTIVE_COMM] == 0, f"blocks left in the communication role: {ctl}"
    assert ctl[C.CTL_N_COMPUTE] == op.tiles * calls, ctl
    assert ctl[C.CTL_N_COMM] == op.ncomm * calls, ctl
    q = op.queue.copy_to_host().astype(np.int64)
    for i, n in ((C.Q_COMPUTE, op.tiles), (C.Q_COMM, op.ncomm)):
        if n:                        # a queue with no items is never drawn
            assert q[i] == (start + calls) * (n + rb["compute"]) % 2 ** 32, (i, q[i], n)
    path = os.path.join(tempfile.gettempdir(), f"mk-ring-trace-{os.getpid()}-{tag}.json")
    path = comm.mpi.bcast(path, root=0)
    if op.save_trace(path) is not None:
        with open(path) as f:
            events = json.load(f)["traceEvents"]
        os.remove(path)
        names = {e["name"].split()[0] for e in events if e["ph"] == "X"}
        assert "compute" in names and (op.ncomm == 0 or "push" in names), names
        assert any(e["name"] == "controller target" for e in events), "no decisions"


def graph(comm, dims, replays, arrays, layout, causal):
    from frame_checks import Arrays, GraphCapture
    b, s, h, hk, d = dims
    W, r = comm.size, comm.rank
    rows = positions(r, s, W, layout)
    A = Arrays(arrays)
    op = mk.RingAttention(comm, b, s, h, hk, d, causal=causal, layout=layout)

    def sequence(i):               # the global q, k, v of call i, the same on every rank
        rng = np.random.default_rng([77, i])
        return [to_bf16_bits(rng.standard_normal((b, W * s, n, d))) for n in (h, hk, hk)]

    def outputs():
        return A.poisoned((b, s, h, d)), A.poisoned((b, h, s), np.float32)

    def check(full, out, lse, what):
        ro, rl = reference(*(from_bf16_bits(x).astype(np.float64) for x in full), causal)
        o = from_bf16_bits(A.host(out)).astype(np.float64)
        L = A.host(lse).astype(np.float64)
        assert np.isfinite(o).all() and np.isfinite(L).all(), f"{what}: unwritten outputs"
        err = np.linalg.norm(o - ro[:, rows]) / np.linalg.norm(ro[:, rows])
        lerr = np.abs(L - rl[:, :, rows]).max()
        assert err <= 1e-2 and lerr <= 1e-3, f"{what}: out rel err {err:.3g}, lse {lerr:.3g}"
        return err

    full = sequence(0)
    q, k, v = (A.dev(shard(x, r, W, layout)) for x in full)    # the captured inputs
    out, lse = outputs()
    cap = GraphCapture(A)
    cap.warm(lambda: op(q, k, v, out=out, lse=lse, **cap.kw))
    worst = check(full, out, lse, "warm-up")
    try:
        cap.capture(lambda: op(q, k, v, out=out, **cap.kw))
    except mk.MkError as e:
        assert all(w in str(e) for w in ("RingAttention", "capture", "out=", "lse=")), str(e)
    else:
        raise AssertionError("a call that allocates lse inside a capture was not refused")
    comm.barrier()
    replay = cap.capture(lambda: op(q, k, v, out=out, lse=lse, **cap.kw))
    launches = 1
    for i in range(1, replays + 1):
        full = sequence(i)
        for dst, x in zip((q, k, v), full):
            A.put(dst, shard(x, r, W, layout))
        A.poison(out)
        A.poison(lse)
        replay()
        launches += 1
        worst = max(worst, check(full, out, lse, f"replay {i}"))
        if i == replays // 2:      # an ordinary call, other arrays
            full = sequence(1000)
            o2, l2 = outputs()
            op(*(A.dev(shard(x, r, W, layout)) for x in full), out=o2, lse=l2)
            launches += 1
            worst = max(worst, check(full, o2, l2, "ordinary call between replays"))
    op.synchronize()
    assert op.frame.read()[0] == launches, f"frame {op.frame.read()}, {launches} launches made"
    comm.barrier()
    op.free()
    return worst


def main():
    dims = tuple(int(x) for x in sys.argv[1:6])
    calls = int(sys.argv[6])
    arrays = sys.argv[7] if len(sys.argv) > 7 else "numba"
    check, tag = (graph, "graph ring") if sys.argv[8:] == ["graph"] else (run, "ring")
    if sys.argv[8:] == ["adaptive"]:
        check, tag = (lambda *a: run(*a, adaptive=True)), "adaptive ring"
    with mk.init() as comm:
        if arrays == "torch":
            import torch
            torch.cuda.set_device(comm.device_id)
        for layout in ("contiguous", "zigzag"):
            for causal in (False, True):
                worst = check(comm, dims, calls, arrays, layout, causal)
                print(f"PASS {tag} {layout} causal={int(causal)} rank {comm.rank} topology "
                      f"{comm.nodes}x{comm.local_size} dims={dims} calls={calls} "
                      f"max_rel_err={worst:.2e}", flush=True)
        comm.barrier()


if __name__ == "__main__":
    main()
