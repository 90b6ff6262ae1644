"""Multi-rank checks of AllGatherGemm, run under mpiexec:

    mpiexec -n N python -m mpi4py tests/mpi/allgather_gemm_checks.py CHECK[,CHECK...] [key=value ...]

keys: m (rows of the gathered A: world x this rank's rows), n, k, calls, part_rows (0: the op's
choice), arrays=numba|torch (torch: GPU only), seed, ag (the AllGather's float32 elements). Inputs come from ``rand_bits(seed, rank,
call, ...)`` (``frame_checks``), so every rank regenerates the others' shards for its float64
reference without communicating.

Checks (each prints ``PASS <check> rank <r> ...`` on every rank; any failure exits non-zero):

  calls     one op planned with gathered=True and trace=True: ``calls`` calls back to back,
            each with fresh random a and b and a poisoned (NaN) out; b alternately row-major
            [k, n] and the column-major view ``w.T`` of a row-major [n, k] w; every other call
            and the last also into a poisoned gathered A of the caller's. After one
            synchronisation: every out against a float64 reference of AllGather(a) @ b
            (relative Frobenius error <= 1e-2, every element written) and every gathered A bit
            for bit. The last call's role trace: every block, part and tile stamped, in order
            (a tile done after the start of the own parts it reads); ``op.save_trace`` read
            back on rank 0 (``trace_checks``): an event per part sent (and pushed to the
            node's other GPUs, forwarded, collected) and per tile, on its role's tracks.
  inplace   one a and one b (row-major, then a column-major view) updated in place with fresh
            data between 2 calls, the first with out=, the second without: each result follows
            the update.
  bad       arguments refused with MkValueError before anything is launched, naming the op
            and the argument, each on an op of its own (which then refuses every later call,
            on 2+ ranks): a's shape, a float32 a, b's shape, out's shape, a strided b,
            gathered= on an op planned without it, gathered's shape; and at planning: m not
            divisible by the world, n not a multiple of 8. Inside a CUDA graph capture
            (``frame_checks.capturing``: every stream reads as captured), MkError for a call
            without out= and for the first call with b as a view ``w.T``.
  disagree  ranks planning different k (then n): MkValueError on every rank naming the field
            and both values.
  wrap      ``_start_at(2**32 - 2)``, then 2 calls back to back across the wrap of the call
            counter and the epoch (which skips 0), every result checked, then the device
            counter and every part's flag read back.
  alternate an AllGatherGemm and an AllGather on one comm called in turn, back to back, for
            2 rounds, every result checked.
  graph     (GPU) one op planned with gathered=True, every rank capturing and replaying
            (torch.cuda.graph for arrays=torch, cuStreamBeginCapture on a numba stream for
            numba; ``GraphCapture`` in frame_checks): a call without out= is refused inside
            the capture with MkError naming out=; then one graph of two calls, the first with
            b row-major [k, n] into out and the gathered A into a buffer of the caller's, the
            second with b as the view ``w.T`` into out2 (with torch the hot path), and
            ``calls`` replays, each with fresh a and b copied into the captured inputs and
            out, out2 and the gathered A poisoned, each checked; an ordinary call half-way;
            the call counter counts every launch.
  adaptive  one op planned with comm_sms="adaptive" (``roles.controller``), gathered=True and
            trace=True, started at ``_start_at(2**32 - 2)``: ``calls`` calls back to back
            across the wrap of the call counter, the epoch and the work queues' tickets, as in
            ``calls`` (fresh inputs, poisoned outputs, b alternately row-major and w.T, the
            gathered A on odd and last calls), each against the float64 reference; then the
            last call's trace as ``calls`` checks it, every flexible block's decision log,
            every item's block among the flexible ones, the controller's measurements of both
            kinds and no block left counted in the communication role; the frame, the flags
            and the queues' tickets read back.
  timeout   (2+ ranks) only rank 0 calls, with a 3 s bound (1 s in the simulator): its
            compute role's wait for the other ranks' rows expires, and synchronize() raises
            MkTimeoutError naming the op, the rank, the role and the flag within the bound
            (plus the simulator's slack); the next call refuses.
"""

import numpy as np

import mknumba as mk
from frame_checks import (GraphCapture, ag_out, ag_ref, bits_f64, capturing, check_close,
                          check_peer_never_calls, expected_after, rand_bits, rand_f32,
                          run_checks, same_bits, say, _refused)
from mknumba._compat import SIMULATOR
from trace_checks import check_saved_trace


def shard_rows(comm, opts):
    return opts["m"] // comm.size


def inputs(comm, opts, rank, *key):
    """(a, b) bits of ``rank``'s call ``key``: a [m / world, k], b [k, n]."""
    s, n, k = shard_rows(comm, opts), opts["n"], opts["k"]
    return rand_bits(opts, (s, k), rank, *key, 0), rand_bits(opts, (k, n), rank, *key, 1)


def gathered_ref(comm, opts, *key):
    """Every rank's a of call ``key``, in world rank order: the gathered A (bits)."""
    return np.concatenate([inputs(comm, opts, r, *key)[0] for r in range(comm.size)])


def reference(comm, opts, *key):
    """float64 AllGather(a) @ b of this rank's call ``key``."""
    return bits_f64(gathered_ref(comm, opts, *key)) @ bits_f64(inputs(comm, opts, comm.rank,
                                                                      *key)[1])


def make_op(comm, opts, **kw):
    return mk.AllGatherGemm(comm, opts["m"], opts["n"], opts["k"],
                            part_rows=opts["part_rows"] or None, **kw)


def b_arg(A, b_bits, layout):
    """(device array holding b, what to pass as b): row-major [k, n], or the column-major
    [k, n] view of a row-major [n, k] copy."""
    if layout == "row":
        d = A.dev(b_bits)
        return d, d
    d = A.dev(np.ascontiguousarray(b_bits.T))
    return d, A.col_view(d)


# ---- calls --------------------------------------------------------------------------------------
def check_calls(comm, opts, A):
    run_calls(comm, opts, A, make_op(comm, opts, gathered=True, trace=True))


def run_calls(comm, opts, A, op, start=0, check="calls"):
    """``calls`` checked calls of ``op``, whose call counter is at ``start``; the trace."""
    m, n, k = opts["m"], opts["n"], opts["k"]
    results = []
    keep = []                       # inputs stay alive until the calls are done
    for call in range(opts["calls"]):
        key = (1, call)
        a_bits, b_bits = inputs(comm, opts, comm.rank, *key)
        a = A.dev(a_bits)
        db, b = b_arg(A, b_bits, "row" if call % 2 == 0 else "col")
        out = A.poisoned((m, n))
        g = A.poisoned((m, k)) if call % 2 == 1 or call == opts["calls"] - 1 else None
        res = op(a, b, out=out, gathered=g)
        assert res is out, "out= given, another array returned"
        results.append((key, out, g))
        keep.append((a, db, b))
    op.synchronize()
    worst = 0.0
    for key, out, g in results:
        worst = max(worst, check_close(A.host(out), reference(comm, opts, *key),
                                       f"call {key[1]}"))
        if g is not None:
            got = A.host(g)
            want = gathered_ref(comm, opts, *key)
            assert np.array_equal(got, want), \
                f"call {key[1]}: gathered A differs in {np.sum(got != want)} of {got.size}"
    want = expected_after(start, opts["calls"])
    assert op.frame.read() == want, (op.frame.read(), want)
    check_trace(comm, op)
    if op.adaptive:
        check_controller(op, start, opts["calls"])
    op.free()
    say(check, comm, f"m={m} n={n} k={k} calls={opts['calls']} parts={op.parts} "
                     f"part_rows={op.part_rows} roles={op.role_blocks} arrays={A.kind} "
                     f"adaptive={int(op.adaptive)} max_rel_err={worst:.2e}")


def check_adaptive(comm, opts, A, start=2 ** 32 - 2):
    op = make_op(comm, opts, gathered=True, trace=True, comm_sms="adaptive")
    comm.barrier()                   # no peer is still in a call that writes our flags
    op._start_at(start)
    comm.barrier()                   # nobody's next call publishes before every rank is set
    run_calls(comm, opts, A, op, start, "adaptive")


def check_controller(op, start, calls):
    """An adaptive op after ``calls`` calls from ``_start_at(start)``, synchronised."""
    from mknumba.kernels.allgather_gemm.kernel import Q_COMM, Q_COMPUTE
    from mknumba.roles import controller as C
    ev = op.trace_events()
    rb = op.role_blocks
    flex0 = rb["send"] + rb["forward"]
    flex = range(flex0, flex0 + rb["compute"])
    for b in flex:                   # every flexible block decided at least once, in order
        log = ev["controller"][b]
        assert log and all(t1 <= t2 for (t1, _, _), (t2, _, _) in zip(log, log[1:])), (b, log)
        assert all(r in (C.COMPUTE, C.COMM) and 0 <= w <= rb["compute"] for _, r, w in log)
    for row, n in (("tile_block", len(op.order)), ("push_block", op.ncomm - op.nstage),
                   ("send_block", op.nstage)):
        assert all(ev[row][i] in flex for i in range(n)), (row, ev[row][:n], list(flex))
    ctl = op.ctl.copy_to_host()
    assert ctl[C.CTL_ACTIVE_COMM] == 0, f"blocks left in the communication role: {ctl}"
    assert ctl[C.CTL_N_COMPUTE] == len(op.order) * calls, ctl   # every item measured
    assert ctl[C.CTL_N_COMM] == op.ncomm * calls, ctl
    q = op.queue.copy_to_host().astype(np.int64)
    for i, n in ((Q_COMPUTE, len(op.order)), (Q_COMM, op.ncomm)):
        if n:                        # a queue with no items is never drawn
            assert q[i] == (start + calls) * (n + rb["compute"]) % 2 ** 32, (i, q[i], n)


def check_trace(comm, op):
    """The last call's stamps (this rank), then its saved trace (rank 0)."""
    ev = op.trace_events()
    P, rb, me = op.parts, op.role_blocks, comm.rank
    assert (ev["block_start"][:op.grid] > 0).all(), "a block has no start stamp"
    assert (ev["block_end"][:op.grid] >= ev["block_start"][:op.grid]).all()
    pushes = P if comm.local_size > 1 or not op.adaptive else 0   # adaptive: items only
    pairs = [("send_start", "send_staged", P), ("push_start", "push_done", pushes),
             ("collect_ready", "collect_done", op.world * P),
             ("tile_start", "tile_done", len(op.order))]
    if rb["forward"]:
        pairs.append(("forward_ready", "forward_done", len(comm.rail_peers) * P))
    for first, last, n in pairs:
        b, a = ev[first][:n], ev[last][:n]
        assert (b > 0).all() and (a >= b).all(), f"{first} -> {last} stamps wrong"
    for i, t in enumerate(op.order):          # a tile ends after its own rows began to move
        r0 = max(t // op.tiles_n * op.bm - me * op.shard, 0)       # in my shard
        r1 = min(t // op.tiles_n * op.bm + op.bm - me * op.shard, op.shard)
        if r0 < r1:
            began = ev["send_start"][r0 // op.part_rows:(r1 - 1) // op.part_rows + 1]
            assert ev["tile_done"][i] >= began.max(), (i, t)
    g = comm.local_size
    check_saved_trace(op, lambda r, meta: dict(
        compute=meta["tiles"], collect=comm.size * meta["parts"],
        send=meta["parts"] * (2 if g > 1 else 1),
        forward=(comm.nodes - 1) * meta["parts"] if meta["role_blocks"]["forward"] else 0))


# ---- inplace ------------------------------------------------------------------------------------
def check_inplace(comm, opts, A):
    m, n = opts["m"], opts["n"]
    op = make_op(comm, opts)
    out = A.poisoned((m, n))
    worst = 0.0
    for li, layout in enumerate(("row", "col")):
        a_bits, b_bits = inputs(comm, opts, comm.rank, 2, li, 0)
        a = A.dev(a_bits)
        db, b = b_arg(A, b_bits, layout)
        for call in range(2):
            key = (2, li, call)
            if call:                  # new values, same addresses
                a_bits, b_bits = inputs(comm, opts, comm.rank, *key)
                A.put(a, a_bits)
                A.put(db, b_bits if layout == "row" else np.ascontiguousarray(b_bits.T))
            A.poison(out)
            res = op(a, b, out=out) if call == 0 else op(a, b)
            worst = max(worst, check_close(A.host(res), reference(comm, opts, *key),
                                           f"b {layout}-major call {call}"))
    op.synchronize()
    op.free()
    say("inplace", comm, f"arrays={A.kind} max_rel_err={worst:.2e}")


# ---- bad input ----------------------------------------------------------------------------------
def check_bad(comm, opts, A):
    m, n, k = opts["m"], opts["n"], opts["k"]
    s = shard_rows(comm, opts)
    a_bits, b_bits = inputs(comm, opts, comm.rank, 3)
    a, b = A.dev(a_bits), A.dev(b_bits)
    name = "AllGatherGemm"
    wide = A.dev(rand_bits(opts, (k, 2 * n), 3))
    cases = [
        (lambda op: op(A.dev(rand_bits(opts, (m, k), 3)), b), [name, "a", "shape"]),
        (lambda op: op(A.dev(bits_f64(a_bits).astype(np.float32)), b), [name, "a", "float32"]),
        (lambda op: op(a, A.dev(rand_bits(opts, (k + 8, n), 3))), [name, "b", "shape"]),
        (lambda op: op(a, b, out=A.poisoned((s, n))), [name, "out", "shape"]),
        (lambda op: op(a, wide[:, :n]), [name, "b", "strides"]),
        (lambda op: op(a, b, gathered=A.poisoned((m, k))), [name, "gathered=True"])]
    for call, words in cases:        # each on an op of its own: a refusal ends the op
        op = make_op(comm, opts)
        _refused(lambda: call(op), words)
        if comm.size > 1:            # the others may have launched it: no later call here
            _refused(lambda: op(a, b), [name, "refused here"], mk.MkError)
        op.free()
    op = make_op(comm, opts)
    with capturing():                # MkError: refused for the capture, the op goes on
        _refused(lambda: op(a, b), [name, "capture", "out="], mk.MkError)
        _refused(lambda: op(a, A.col_view(A.dev(np.ascontiguousarray(b_bits.T))),
                            out=A.poisoned((m, n))), [name, "capture", "first call with b"],
                 mk.MkError)
    op.free()
    op = make_op(comm, opts, gathered=True)
    _refused(lambda: op(a, b, gathered=A.poisoned((s, k))), [name, "gathered", "shape"])
    op.free()
    if comm.size > 1:
        _refused(lambda: mk.AllGatherGemm(comm, comm.size * 8 + 1, n, k),
                 [name, "divisible", "world"])
    _refused(lambda: mk.AllGatherGemm(comm, m, n + 4, k), [name, "multiples of 8"])
    comm.barrier()
    say("bad", comm, "a b out gathered m n")


def check_disagree(comm, opts, A):
    m, n, k = opts["m"], opts["n"], opts["k"]
    for field, kw in (("k", dict(k=k if comm.rank == 0 else k + 8)),
                      ("n", dict(n=n if comm.rank == 0 else n + 8))):
        args = dict(dict(m=m, n=n, k=k), **kw)
        try:
            op = mk.AllGatherGemm(comm, **args)
        except mk.MkValueError as e:
            msg = str(e)
            assert "AllGatherGemm" in msg and f"{field}:" in msg, msg
            want = {"k": (k, k + 8), "n": (n, n + 8)}[field]
            assert all(str(v) in msg for v in want), msg
        else:
            op.free()
            raise AssertionError(f"AllGatherGemm with another {field} per rank was accepted")
    comm.barrier()      # every rank raised (nobody waits in a collective), and the comm works
    say("disagree", comm, "k n")


# ---- wrap and alternate -----------------------------------------------------------------------
def check_wrap(comm, opts, A, start=2 ** 32 - 2, calls=2):
    m, n = opts["m"], opts["n"]
    want = expected_after(start, calls)
    assert want == (0, 1), want      # epochs 2**32-1, then 1: never 0
    op = make_op(comm, opts)
    comm.barrier()                   # no peer is still in a call that writes our flags
    op._start_at(start)
    comm.barrier()                   # nobody's next call publishes before every rank is set
    outs = []
    for call in range(calls):
        key = (4, call)
        a_bits, b_bits = inputs(comm, opts, comm.rank, *key)
        outs.append((key, op(A.dev(a_bits), A.dev(b_bits), out=A.poisoned((m, n)))))
    op.synchronize()
    worst = 0.0
    for key, out in outs:
        worst = max(worst, check_close(A.host(out), reference(comm, opts, *key),
                                       f"call {key[1]} after _start_at(2**32-2)"))
    assert op.frame.read() == want, f"frame (calls, epoch) = {op.frame.read()}, expected {want}"
    flags = op.flags.local.copy_to_host()
    assert (flags == want[1]).all(), f"flags {flags}, expected epoch {want[1]}"
    op.free()
    say("wrap", comm, f"frame={want} max_rel_err={worst:.2e}")


def check_alternate(comm, opts, A, rounds=2):
    m, n = opts["m"], opts["n"]
    op = make_op(comm, opts)
    ag = mk.AllGather(comm, (opts["ag"],), "float32")
    results = []
    for r in range(rounds):          # back to back: no host synchronisation
        a_bits, b_bits = inputs(comm, opts, comm.rank, 5, r)
        results.append((op, r, op(A.dev(a_bits), A.dev(b_bits), out=A.poisoned((m, n)))))
        x = A.dev(rand_f32(opts, (opts["ag"],), comm.rank, 5, r))
        results.append((ag, r, ag(x, out=ag_out(comm, opts, A))))
    op.synchronize()
    ag.synchronize()
    worst = 0.0
    for o, r, out in results:
        if o is ag:
            same_bits(A.host(out), ag_ref(comm, opts, 5, r), f"AllGather round {r}")
        else:
            worst = max(worst, check_close(A.host(out), reference(comm, opts, 5, r),
                                           f"AllGatherGemm round {r}"))
    for o in (op, ag):
        assert o.frame.read() == (rounds, rounds), o.frame.read()
    op.free()
    ag.free()
    say("alternate", comm, f"rounds={rounds} max_rel_err={worst:.2e}")


def check_graph(comm, opts, A):
    m, n, k = opts["m"], opts["n"], opts["k"]
    op = make_op(comm, opts, gathered=True)
    a_bits, b_bits = inputs(comm, opts, comm.rank, 7, 0)
    a = A.dev(a_bits)                                  # the captured inputs and outputs
    db, b = b_arg(A, b_bits, "row")
    dw, w_t = b_arg(A, b_bits, "col")
    out, out2, g = A.poisoned((m, n)), A.poisoned((m, n)), A.poisoned((m, k))

    def calls():
        op(a, b, out=out, gathered=g, **cap.kw)
        op(a, w_t, out=out2, **cap.kw)

    def check(key, what, outs=(out, out2)):
        ref = reference(comm, opts, *key)
        worst = max(check_close(A.host(o), ref, f"{what} out{i or ''}")
                    for i, o in enumerate(outs))
        if len(outs) == 2:
            got, want = A.host(g), gathered_ref(comm, opts, *key)
            assert np.array_equal(got, want), \
                f"{what}: gathered A differs in {np.sum(got != want)} of {got.size}"
        return worst
    cap = GraphCapture(A)
    cap.warm(calls)                                    # both layouts' kernels
    worst = check((7, 0), "warm-up")
    try:
        cap.capture(lambda: op(a, b, **cap.kw))
    except mk.MkError as e:
        assert all(w in str(e) for w in ("AllGatherGemm", "capture", "out=")), str(e)
    else:
        raise AssertionError("a call that allocates out inside a capture was not refused")
    comm.barrier()
    replay = cap.capture(calls)
    launches = 2
    for i in range(1, opts["calls"] + 1):
        key = (7, i)
        a_bits, b_bits = inputs(comm, opts, comm.rank, *key)
        A.put(a, a_bits)
        A.put(db, b_bits)
        A.put(dw, np.ascontiguousarray(b_bits.T))
        for o in (out, out2, g):
            A.poison(o)
        replay()
        launches += 2
        worst = max(worst, check(key, f"replay {i}"))
        if i == opts["calls"] // 2:                    # an ordinary call, other arrays
            key = (7, 1000)
            a_bits, b_bits = inputs(comm, opts, comm.rank, *key)
            o3 = A.poisoned((m, n))
            op(A.dev(a_bits), A.dev(b_bits), out=o3)
            launches += 1
            worst = max(worst, check(key, "ordinary call between replays", (o3,)))
    op.synchronize()
    assert op.frame.read() == (launches, launches), f"frame {op.frame.read()}, {launches} launches"
    comm.barrier()
    op.free()
    say("graph", comm, f"m={m} n={n} k={k} replays={opts['calls']} arrays={A.kind} "
                       f"max_rel_err={worst:.2e}")


def check_timeout(comm, opts, A):
    bound_s = 1.0 if SIMULATOR else 3.0   # the simulator's blocks each wait it, one by one
    m, n = opts["m"], opts["n"]
    a_bits, b_bits = inputs(comm, opts, 0, 6)
    a, b = A.dev(a_bits), A.dev(b_bits)
    check_peer_never_calls(comm, lambda: make_op(comm, opts),
                           lambda op: op(a, b, out=A.poisoned((m, n))),
                           ("AllGatherGemm", "rank 0", "compute role", "of its rows of a)",
                            "to reach epoch 1"),
                           bound_s)


CHECKS = dict(calls=check_calls, inplace=check_inplace, bad=check_bad, disagree=check_disagree,
              wrap=check_wrap, alternate=check_alternate, graph=check_graph,
              timeout=check_timeout, adaptive=check_adaptive)


def main():
    run_checks(CHECKS, dict(m=64, n=40, k=24, calls=4, part_rows=0, seed=4321, arrays="numba",
                            ag=24))

if __name__ == "__main__":
    main()
