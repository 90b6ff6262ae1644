"""Multi-rank checks of MoeDispatchGemm, run under mpiexec:

    mpiexec -n N python -m mpi4py tests/mpi/moe_dispatch_checks.py CHECK[,CHECK...] [key=value ...]

keys: hidden, ffn, experts, top_k, max_tokens, calls (rounds of the routing patterns), seed,
comm_sms (pack, forward and pull blocks; 0: the op's choice), unit (tokens per flag; 0: the
op's choice), wrap (1: ``calls`` starts an op just short of the epoch's wrap; 0 not: a
completion-mode proxy keeps its own record of the flags it set, which ``_start_at`` does not
move), ehf (1: ``calls`` passes w as [E/W, hidden, ffn] for uniform, zipf and one; 0: every
pattern on the "efh" op, one op, no transposes), replays (``graph``), arrays=numba|torch
(torch: GPU only), adaptive (1: every op with ``comm_sms="adaptive"``, the controller's
split; ``calls`` then also checks the controller's state). Inputs come from ``rand_bits(seed, rank, call, ...)``
(``frame_checks``), so every rank regenerates every rank's tokens and routing for its float64
reference without communicating.

Routing patterns (one call each, fresh T per rank and call, T <= max_tokens):
  uniform  each token to top_k distinct experts, uniformly
  zipf     hot experts: expert i drawn with weight 1 / (i + 1)^2, top_k distinct
  one      every slot of every token of every rank to expert 0, T = max_tokens on every rank:
           the worst case the default capacity is planned for (duplicate experts per token)
  silent   rank 1 sends nothing (T = 0); the others uniform
  cold     only rank 0's experts get tokens: every other rank receives nothing

Checks (each prints ``PASS <check> rank <r> ...`` on every rank; any failure exits non-zero):

  calls     two ops on one comm called in turn, back to back, ``calls`` rounds of every
            pattern: w [E/W, hidden, ffn] (read as [k, n]) for uniform, zipf and one, on
            an op started at ``_start_at(2**32 - 3)`` so its calls cross the epoch's wrap; w
            [E/W, ffn, hidden] (w_layout="efh") for silent and cold; w fresh per call,
            topk_weights on every other call (on 2+ ranks, in turn: one rank with, the
            next without), out and the layout poisoned. After one
            synchronisation, per call: counts and offsets, every row's (source, token, slot)
            as a set per expert in source-rank order, the weights, and out against a float64
            reference of x[token] @ w[expert] (rows past the received ones untouched); the
            call counters. With adaptive=1: each op's controller measured exactly
            the tiles and pull items of its calls (from the counts: ``bm``-row tile rows per
            expert, ``chunks`` pulls each), no block is left counted in the communication
            role, and the queues hold the tickets of the epoch rule after the calls (from
            the wrap).
  inplace   one op (w [E/W, hidden, ffn], read as it is): the same x, topk_idx,
            topk_weights and w arrays, w updated in place between 2 calls, out= and layout=
            reused (out and the layout's weights poisoned again): the second result follows
            the update (with tensors, the second call is the hot path's, weighted).
  bad       refused with MkValueError before anything is launched, naming the op and the
            argument, each on an op of its own (which then refuses every later call, on 2+
            ranks): x's hidden, a float32 x, T > max_tokens, int64 topk_idx, topk_idx's
            shape, w's shape, a float32 w, out's shape, topk_weights' dtype; at planning:
            experts not divisible by the world, top_k > experts, hidden not a multiple of 8,
            unit_tokens=0.
  badid     rank 0 routes two pairs to expert ids out of range (E at token 1 slot 1, -1 at its
            last token; every rank's call launches): rank 0's synchronize() raises
            MkValueError naming topk_idx[1, 1] = E, the other ranks' raises nothing; every
            rank's rows are right without those pairs; the next call (fresh routing) works
            on every rank and raises nothing.
  graph     (GPU) a call inside a CUDA graph capture (torch.cuda.graph for arrays=torch,
            cuStreamBeginCapture on a numba stream for numba) that would allocate out or the
            layout is refused with MkError naming out= and layout=; then one capture with
            out= and layout= and ``replays`` replays, each with fresh tokens, routing
            (uniform, zipf, one in turn; T = max_tokens, fixed by the capture) and weights in
            the captured inputs, out and the layout poisoned, each checked; an ordinary call
            half-way; the call counter counts every launch.
  disagree  ranks planning different hidden (then max_tokens): MkValueError on every rank.
  capacity  capacity=8 rows, every token to rank 0's first expert: rank 0's synchronize()
            raises MkCapacityError naming the rows and the capacity; its next call refuses;
            the other ranks finish.
  timeout   (2+ ranks) only rank 0 calls, with a 3 s bound (1 s in the simulator): the
            wait for rank 1's counts expires; synchronize() raises MkTimeoutError naming the
            op, rank, role and flag; the next call refuses (``check_peer_never_calls``).
"""
import numpy as np

import mknumba as mk
from frame_checks import (GraphCapture, bits_f64, check_close, check_peer_never_calls,
                          expected_after, rand_bits, run_checks, say, _refused)
from mknumba._compat import SIMULATOR

PATTERNS = ("uniform", "zipf", "one", "silent", "cold")


def tokens_of(opts, rank, key, pattern):
    if pattern == "one" or opts.get("fixed_tokens") or pattern == "badid" and rank == 0:
        return opts["max_tokens"]
    if pattern == "silent" and rank == 1:
        return 0
    rng = np.random.default_rng([opts["seed"], 11, rank, *key])
    return int(rng.integers(1, opts["max_tokens"] + 1))


def routing(opts, world, rank, key, pattern):
    """(topk_idx int32 [T, top_k], topk_weights float32 [T, top_k]) of ``rank``'s call."""
    T, E, K = tokens_of(opts, rank, key, pattern), opts["experts"], opts["top_k"]
    rng = np.random.default_rng([opts["seed"], 12, rank, *key])
    if pattern == "one":
        idx = np.zeros((T, K), np.int32)
    else:
        pool = E // world if pattern == "cold" else E    # badid: uniform, then two bad
        p = 1.0 / (np.arange(pool) + 1.0) ** 2 if pattern == "zipf" else np.ones(pool)
        p = p / p.sum()
        idx = np.array([rng.choice(pool, K, replace=False, p=p) for _ in range(T)],
                       np.int32).reshape(T, K)
    if pattern == "badid" and rank == 0:        # the first, then a later one
        idx[1, K - 1] = E
        idx[T - 1, 0] = -1
    return idx, rng.random((T, K), dtype=np.float32)


def inputs(opts, world, rank, key, pattern):
    T = tokens_of(opts, rank, key, pattern)
    x = rand_bits(opts, (T, opts["hidden"]), rank, *key, 0)
    return (x, *routing(opts, world, rank, key, pattern))


def weights_of(opts, world, rank, key):
    """w bits [E / W, hidden, ffn] of ``rank``'s call."""
    El = opts["experts"] // world
    return rand_bits(opts, (El, opts["hidden"], opts["ffn"]), rank, *key, 1)


def make_op(comm, opts, **kw):
    sms = "adaptive" if opts["adaptive"] else opts["comm_sms"] or None
    return mk.MoeDispatchGemm(comm, opts["hidden"], opts["ffn"], opts["experts"], opts["top_k"],
                              opts["max_tokens"], comm_sms=sms,
                              unit_tokens=opts["unit"] or None, **kw)


def poisoned(op, A):
    out = A.poisoned((op.capacity, op.ffn))
    El, cap = op.local_experts, op.capacity
    buf = np.full(mk.MoeLayout.words(El, cap), -1, np.int32)
    buf[mk.MoeLayout.parts(El, cap)[3][1]:].view(np.float32)[:] = np.nan     # the weights
    return out, mk.MoeLayout(A.dev(buf), El, cap)


def verify(comm, opts, A, op, key, pattern, out, lay, w_bits, weighted, what):
    """Check one call's out and layout on this rank; returns the relative error (0 if no
    rows). weighted: whether every rank's call passed topk_weights, or per rank a list; a row
    from a rank whose call passed none weighs 1."""
    weighted_by = (lambda r: weighted[r]) if isinstance(weighted, list) else (lambda r: weighted)
    W, me, El = comm.size, comm.rank, op.local_experts
    every = [inputs(opts, W, r, key, pattern) for r in range(W)]
    counts, offsets = A.host(lay.counts), A.host(lay.offsets)
    rows, wts, got = A.host(lay.rows), A.host(lay.weights), A.host(out)
    R = 0
    ref = []
    for e in range(El):
        g = me * El + e
        want = [(r, t, j) for r in range(W) for t, j in zip(*np.nonzero(every[r][1] == g))]
        assert counts[e] == len(want), f"{what}: expert {e}: {counts[e]} rows, want {len(want)}"
        assert offsets[e] == R, f"{what}: offsets {offsets.tolist()}, counts {counts.tolist()}"
        have = [tuple(int(v) for v in rows[R + i]) for i in range(len(want))]
        assert [h[0] for h in have] == sorted(h[0] for h in have), \
            f"{what}: expert {e}: rows not in source-rank order: {have}"
        assert sorted(have) == sorted(want), f"{what}: expert {e}: rows {have}, want {want}"
        for i, (r, t, j) in enumerate(have):
            want_w = every[r][2][t, j] if weighted_by(r) else np.float32(1)
            assert wts[R + i] == want_w, f"{what}: weight of row {R + i} (from rank {r})"
            ref.append(bits_f64(every[r][0][t]) @ bits_f64(w_bits[e]))
        R += len(want)
    assert offsets[El] == R, f"{what}: offsets[-1] = {offsets[El]}, {R} rows"
    assert np.all(got[R:] == 0x7FC0), f"{what}: rows past the {R} received were written"
    if R == 0:
        return 0.0
    return check_close(got[:R], np.array(ref), what)


def check_calls(comm, opts, A, start=2 ** 32 - 3):
    """Two ops on one comm, called in turn: w [E/W, hidden, ffn] (read as [k, n]) for
    uniform, zipf and one, started just short of the epoch's wrap; w [E/W, ffn, hidden] for
    silent and cold (``ehf=0``: one op, w [E/W, ffn, hidden], for all; ``wrap=0``: from call
    0)."""
    ops = dict(efh=make_op(comm, opts, w_layout="efh"))
    if opts["ehf"]:
        ops["ehf"] = make_op(comm, opts)
    if not opts["wrap"]:
        start = 0
    comm.barrier()                   # no peer is still in a call that writes our flags
    wrapped = "ehf" if opts["ehf"] else "efh"
    if start:
        ops[wrapped]._start_at(start)
    comm.barrier()                   # nobody's next call publishes before every rank is set
    pending, keep = [], []
    n = dict(ehf=0, efh=0)
    for rnd in range(opts["calls"]):
        for i, pattern in enumerate(PATTERNS):
            layout = "efh" if pattern in ("silent", "cold") or not opts["ehf"] else "ehf"
            op = ops[layout]
            key = (1, rnd, i)
            x, idx, wts = inputs(opts, comm.size, comm.rank, key, pattern)
            w_bits = weights_of(opts, comm.size, comm.rank, key)
            weighted = [(i + r) % 2 == 1 for r in range(comm.size)]    # ranks differ
            w = w_bits if layout == "ehf" else np.ascontiguousarray(w_bits.swapaxes(1, 2))
            args = (A.dev(x), A.dev(idx), A.dev(w), A.dev(wts) if weighted[comm.rank] else None)
            out, lay = poisoned(op, A)
            res, res_lay = op(*args, out=out, layout=lay)
            assert res is out and res_lay is lay
            pending.append((op, key, pattern, out, lay, w_bits, weighted))
            keep.append(args)
            n[layout] += 1
    for op in ops.values():
        op.synchronize()
    worst, received = 0.0, []
    items = {id(op): [0, 0] for op in ops.values()}       # tiles and pulls each op ran
    for op, key, pattern, out, lay, w_bits, weighted in pending:
        worst = max(worst, verify(comm, opts, A, op, key, pattern, out, lay, w_bits, weighted,
                                  f"call {key} ({pattern}, w {op.w_layout})"))
        received.append(int(A.host(lay.offsets)[-1]))
        if op.adaptive:
            rows = sum(-(-int(c) // op.bm) for c in A.host(lay.counts))
            items[id(op)][0] += rows * op.tiles_n
            items[id(op)][1] += rows * op.chunks
    want = expected_after(start, n[wrapped])
    for name, op in ops.items():
        got = op.frame.read()
        assert got == (want if name == wrapped else (n[name], n[name])), (name, got, want)
        if op.adaptive:
            check_controller(op, items[id(op)], (start if name == wrapped else 0) + n[name])
    for op in ops.values():
        op.free()
    say("calls", comm, f"calls={sum(n.values())} rows={received} roles={op.role_blocks} "
                       f"arrays={A.kind} wrap={want} adaptive={int(op.adaptive)} "
                       f"max_rel_err={worst:.2e}")


def check_controller(op, items, calls):
    """The adaptive split's state after ``calls`` calls (counted from 0, through the wrap)
    that ran ``items`` = [tiles, pulls]: the controller measured each item once, every block
    left the communication role, each queue drew its planned items plus one ticket per
    flexible block per call (the empty ones in one add: ``kernel.flexible_pool``)."""
    from mknumba.roles import controller as C
    ctl, queue = op.ctl.copy_to_host(), op.queue.copy_to_host()
    assert [int(ctl[C.CTL_N_COMPUTE]), int(ctl[C.CTL_N_COMM])] == items, (ctl.tolist(), items)
    assert ctl[C.CTL_ACTIVE_COMM] == 0, ctl.tolist()
    flex = op.role_blocks["compute"]
    want = [calls * (n + flex) % 2 ** 32 for n in op.queue_items()]
    assert [int(queue[C.Q_COMPUTE]), int(queue[C.Q_COMM])] == want, (queue.tolist(), want)


def check_inplace(comm, opts, A, layout="ehf"):
    op = make_op(comm, opts, w_layout=layout)
    key = (2, 0)
    x, idx, wts = inputs(opts, comm.size, comm.rank, key, "uniform")
    dx, di, dg = A.dev(x), A.dev(idx), A.dev(wts)   # the same tokens and routing on both calls
    w_bits = weights_of(opts, comm.size, comm.rank, key)
    dw = A.dev(w_bits)
    out, lay = poisoned(op, A)
    worst = 0.0
    for call in range(2):
        if call:                              # new weights, same address
            w_bits = weights_of(opts, comm.size, comm.rank, (2, 1))
            A.put(dw, w_bits)
            A.poison(out)
            A.poison(lay.weights)
        op(dx, di, dw, dg, out=out, layout=lay)
        worst = max(worst, verify(comm, opts, A, op, key, "uniform", out, lay, w_bits, True,
                                  f"w {layout} call {call}"))
    op.free()
    say("inplace", comm, f"w {layout} arrays={A.kind} max_rel_err={worst:.2e}")


def check_bad(comm, opts, A):
    H, F, E, K, T = opts["hidden"], opts["ffn"], opts["experts"], opts["top_k"], 4
    El = E // comm.size
    x, idx, wts = inputs(opts, comm.size, comm.rank, (3,), "uniform")
    x, idx, wts = x[:T], idx[:T], wts[:T]
    dx, di, dw = A.dev(x), A.dev(idx), A.dev(weights_of(opts, comm.size, comm.rank, (3,)))
    name = "MoeDispatchGemm"
    big = opts["max_tokens"] + 1
    cap = comm.size * opts["max_tokens"] * K          # make_op's ops: the default capacity
    cases = [
        (lambda op: op(A.dev(rand_bits(opts, (T, H + 8), 3)), di, dw), [name, "x", "shape"]),
        (lambda op: op(A.dev(bits_f64(x).astype(np.float32)), di, dw),
         [name, "x", "float32"]),
        (lambda op: op(A.dev(rand_bits(opts, (big, H), 3)),
                       A.dev(np.zeros((big, K), np.int32)), dw), [name, "max_tokens", str(big)]),
        (lambda op: op(dx, A.dev(idx.astype(np.int64)), dw), [name, "topk_idx", "int64"]),
        (lambda op: op(dx, A.dev(np.zeros((T, K + 1), np.int32)), dw),
         [name, "topk_idx", "shape"]),
        (lambda op: op(dx, di, A.dev(rand_bits(opts, (El, F, H), 3))) if F != H else
         op(dx, di, A.dev(rand_bits(opts, (El + 1, H, F), 3))), [name, "w", "shape"]),
        (lambda op: op(dx, di, A.dev(np.zeros((El, H, F), np.float32))),
         [name, "w", "float32"]),
        (lambda op: op(dx, di, dw, out=A.poisoned((4, F))), [name, "out", "shape"]),
        (lambda op: op(dx, di, dw, topk_weights=A.dev(wts.astype(np.float64))),
         [name, "topk_weights", "float64"]),
        (lambda op: op(dx, di, dw, out=A.poisoned((cap, F)), layout=tuple(poisoned(op, A)[1])),
         [name, "layout", "MoeLayout"]),
        (lambda op: op(dx, di, dw, out=A.poisoned((cap, F)), layout=mk.MoeLayout(
            A.dev(np.zeros(mk.MoeLayout.words(El, cap - 1), np.int32)), El, cap - 1)),
         [name, "layout", f"capacity {cap - 1}"]),
        (lambda op: op(dx, di, dw, out=A.poisoned((cap, F)), layout=mk.MoeLayout(
            A.dev(np.zeros(mk.MoeLayout.words(El, cap), np.float32)), El, cap)),
         [name, "layout.buffer", "float32"])]
    for call, words in cases:        # each on an op of its own: a refusal ends the op
        op = make_op(comm, opts)
        _refused(lambda: call(op), words)
        assert op.frame.read()[0] == 0, "a refused call launched"
        for flags in op._epoch_flags:
            assert not np.asarray(flags.copy_to_host()).any(), "a refused call launched"
        if comm.size > 1:            # the others may have launched it: no later call here
            _refused(lambda: op(dx, di, dw), [name, "refused here"], mk.MkError)
        op.free()
    if comm.size > 1:
        _refused(lambda: mk.MoeDispatchGemm(comm, H, F, comm.size + 1, 1, 4),
                 [name, "divisible", "world"])
    _refused(lambda: mk.MoeDispatchGemm(comm, H, F, E, E + 1, 4), [name, "top_k"])
    _refused(lambda: mk.MoeDispatchGemm(comm, H + 2, F, E, 1, 4),
             [name, f"hidden={H + 2}", "multiples of 8"])
    _refused(lambda: mk.MoeDispatchGemm(comm, H, F, E, 1, 4, unit_tokens=0),
             [name, "unit_tokens must be a positive integer, got 0"])
    comm.barrier()
    say("bad", comm, "x topk_idx w out topk_weights layout experts top_k (expert ids: "
        "badid)")


def check_badid(comm, opts, A):
    op = make_op(comm, opts)
    E, K = opts["experts"], opts["top_k"]
    worst = 0.0
    for i, pattern in enumerate(("badid", "uniform")):
        key = (4, i)
        x, idx, wts = inputs(opts, comm.size, comm.rank, key, pattern)
        w_bits = weights_of(opts, comm.size, comm.rank, key)
        out, lay = poisoned(op, A)
        op(A.dev(x), A.dev(idx), A.dev(w_bits), A.dev(wts), out=out, layout=lay)
        try:
            op.synchronize()
        except mk.MkValueError as e:
            assert comm.rank == 0 and pattern == "badid", f"rank {comm.rank}, {pattern}: {e}"
            for words in ("MoeDispatchGemm", "rank 0", f"topk_idx[1, {K - 1}] = {E}",
                          "expert id", f"0 .. {E - 1}"):
                assert words in str(e), f"{words!r} not in: {e}"
        else:
            assert comm.rank != 0 or pattern != "badid", "an expert id out of range: no error"
        worst = max(worst, verify(comm, opts, A, op, key, pattern, out, lay, w_bits, True,
                                  f"{pattern} call"))
    assert op.frame.read()[0] == 2, op.frame.read()
    comm.barrier()
    op.free()
    say("badid", comm, f"max_rel_err={worst:.2e}")


def check_disagree(comm, opts, A):
    H = opts["hidden"]
    for field, kw in (("hidden", dict(hidden=H if comm.rank == 0 else H + 8)),
                      ("max_tokens", dict(max_tokens=opts["max_tokens"] + comm.rank))):
        args = dict(dict(hidden=H, ffn=opts["ffn"], experts=opts["experts"],
                         top_k=opts["top_k"], max_tokens=opts["max_tokens"]), **kw)
        try:
            op = mk.MoeDispatchGemm(comm, **args)
        except mk.MkValueError as e:
            msg = str(e)
            assert "MoeDispatchGemm" in msg and f"{field}:" in msg, msg
        else:
            op.free()
            raise AssertionError(f"MoeDispatchGemm with another {field} per rank was accepted")
    comm.barrier()
    say("disagree", comm, "hidden max_tokens")


def check_capacity(comm, opts, A):
    op = make_op(comm, opts, capacity=8)
    x, idx, _ = inputs(opts, comm.size, comm.rank, (5,), "one")   # all to expert 0: rank 0
    dx, di = A.dev(x), A.dev(idx)
    dw = A.dev(weights_of(opts, comm.size, comm.rank, (5,)))
    out, lay = poisoned(op, A)
    op(dx, di, dw, out=out, layout=lay)
    rows = comm.size * opts["max_tokens"] * opts["top_k"]
    if comm.rank == 0:
        try:
            op.synchronize()
        except mk.MkCapacityError as e:
            for words in ("MoeDispatchGemm", "rank 0", f"{rows} rows", "the 8 it was planned"):
                assert words in str(e), f"{words!r} not in: {e}"
        else:
            raise AssertionError(f"{rows} rows into a capacity of 8 raised nothing")
        assert np.all(A.host(out) == 0x7FC0), "rows written past the capacity error"
        try:
            op(dx, di, dw)
        except mk.MkCapacityError:
            pass
        else:
            raise AssertionError("an op past its capacity accepted another call")
    else:
        op.synchronize()
    comm.barrier()
    op.free()
    say("capacity", comm, f"rows={rows} capacity=8")


def check_timeout(comm, opts, A):
    bound_s = 1.0 if SIMULATOR else 3.0   # the simulator's blocks each wait it, one by one
    x, idx, _ = inputs(opts, comm.size, 0, (7,), "uniform")
    args = (A.dev(x), A.dev(idx), A.dev(weights_of(opts, comm.size, 0, (7,))))
    check_peer_never_calls(comm, lambda: make_op(comm, opts), lambda op: op(*args),
                           ("MoeDispatchGemm", "rank 0", "role", "waiting on flag", "to reach epoch 1"),
                           bound_s)


def check_graph(comm, opts, A):
    """A CUDA graph capture of a call (GPU): see the module docstring."""
    opts = dict(opts, fixed_tokens=1)         # the captured x has one T
    op = make_op(comm, opts)
    W, T, K = comm.size, opts["max_tokens"], opts["top_k"]
    key0 = (8, 0)
    x, idx, wts = inputs(opts, W, comm.rank, key0, "uniform")
    w_bits = weights_of(opts, W, comm.rank, key0)
    dx, di, dg, dw = A.dev(x), A.dev(idx), A.dev(wts), A.dev(w_bits)   # captured inputs
    out, lay = poisoned(op, A)
    cap = GraphCapture(A)    # warm-up: the cfg of T, the transposer
    cap.warm(lambda: op(dx, di, dw, dg, out=out, layout=lay, **cap.kw))
    call = lambda **kw: op(dx, di, dw, dg, **cap.kw, **kw)   # noqa: E731
    capture = cap.capture
    worst = verify(comm, opts, A, op, key0, "uniform", out, lay, w_bits, True, "warm-up")
    try:
        capture(lambda: call())
    except mk.MkError as e:
        for words in ("MoeDispatchGemm", "capture", "out=", "layout="):
            assert words in str(e), f"{words!r} not in: {e}"
    else:
        raise AssertionError("a call that allocates inside a capture was not refused")
    comm.barrier()
    replay = capture(lambda: call(out=out, layout=lay))
    launches = 1
    for i in range(1, opts["replays"] + 1):
        pattern = ("uniform", "zipf", "one")[i % 3]
        key = (8, i)
        x, idx, wts = inputs(opts, W, comm.rank, key, pattern)
        w_bits = weights_of(opts, W, comm.rank, key)
        for d, h in ((dx, x), (di, idx), (dg, wts), (dw, w_bits)):
            A.put(d, h)
        A.poison(out)
        for d, fill in zip(lay, (-1, -1, -1, np.nan)):
            A.put(d, np.full(tuple(d.shape), fill, np.float32 if fill != -1 else np.int32))
        replay()
        launches += 1
        worst = max(worst, verify(comm, opts, A, op, key, pattern, out, lay, w_bits, True,
                                  f"replay {i} ({pattern})"))
        if i == opts["replays"] // 2:        # an ordinary call, other arrays
            key = (8, 1000)
            x, idx, wts = inputs(opts, W, comm.rank, key, "zipf")
            w_bits = weights_of(opts, W, comm.rank, key)
            o3, l3 = poisoned(op, A)
            op(A.dev(x), A.dev(idx), A.dev(w_bits), A.dev(wts), out=o3, layout=l3)
            launches += 1
            worst = max(worst, verify(comm, opts, A, op, key, "zipf", o3, l3, w_bits, True,
                                      "ordinary call between replays"))
    op.synchronize()
    got = op.frame.read()
    assert got[0] == launches, f"frame {got}, {launches} launches made"
    comm.barrier()
    op.free()
    say("graph", comm, f"replays={opts['replays']} T={T} K={K} arrays={A.kind} "
                       f"max_rel_err={worst:.2e}")


CHECKS = dict(calls=check_calls, inplace=check_inplace, bad=check_bad, badid=check_badid,
              disagree=check_disagree, capacity=check_capacity, timeout=check_timeout,
              graph=check_graph)


def main():
    run_checks(CHECKS, dict(hidden=16, ffn=24, experts=4, top_k=2, max_tokens=12, calls=1,
                            seed=2020, comm_sms=0, unit=0, wrap=1, ehf=1, replays=20,
                            arrays="numba", adaptive=0))

if __name__ == "__main__":
    main()
