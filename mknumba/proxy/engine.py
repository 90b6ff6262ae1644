"""The proxy's loop, compiled (paper §3.3): poll the ring, batch per connection, pace, issue.

One call of :func:`run` works for up to a time slice without the GIL, so a main thread that
holds the GIL (launching kernels, blocked in a CUDA call) cannot starve the proxy, and each
command costs the loop well under a microsecond (a Python loop costs tens). Per round:

  poll      copy the committed prefix of the ring (header ``seq == ticket + 1``) into the
            per-connection queues, then return those slots to the GPU as credits (``tail``)
  batch     a connection with ``max_batch`` queued commands submits them at once; a partial
            batch leaves once its oldest command has waited ``window_ns`` (at once when stopping)
  check     each batch against the window table (``first_bad_command``) before it is issued
  pace      token bucket at the NIC rate with a 50 µs burst; progress keeps running meanwhile
  issue     ``issue(ctx, peer, batch)``: the transport's compiled submission, or :func:`defer`,
            which puts the batch in an outbox for transports written in Python (sim, verbs)
  progress  ``progress(ctx)``: the transport's compiled completion work (publish arrived flags)
  nap       idle for longer than ``spin_ns``: sleep 20 µs per round

``run`` returns at the end of its slice, when asked to yield (``st[S_YIELD]``, e.g. a window
was registered), when stopping and drained, on an error (``st[S_ERR]``), and in outbox mode as
soon as something was deferred or the loop fell idle, so Python can submit and progress.
"""
import numpy as np
from numba import njit

from .clock import nap_us, now_ns
from .ring import CMD_WORDS, COMMAND_DTYPE
from .transports.base import _first_bad

# st: int64 state shared with the Python side (stats are read there, STOP/YIELD written there)
(S_TAIL, S_STOP, S_YIELD, S_PACE_NEXT, S_IDLE_SINCE, S_COMMANDS, S_BATCHES, S_BYTES, S_BUSY_NS,
 S_POLLS, S_ERR, S_ERR_PEER, S_ERR_CODE, S_MAX_ISSUE_NS, S_MAX_GAP_NS, S_LAST_ROUND) = range(16)
NSTATE = 16
# cfg: int64 settings
(K_MAX_BATCH, K_WINDOW_NS, K_SPIN_NS, K_SLICE_NS, K_POLL_LIMIT, K_ME, K_NWIN, K_OUTBOX,
 K_PACE_FS_PER_BYTE) = range(9)
NCFG = 12
# run() results
RC_SLICE, RC_DRAINED, RC_ERROR, RC_DEFERRED, RC_IDLE, RC_YIELD = range(6)
# st[S_ERR] kinds
E_PEER, E_COMMAND, E_ISSUE, E_PROGRESS = 1, 2, 3, 4
BURST_NS = 50_000
NAP_US = 20


class Queues:
    """The per-connection queues and the outbox (host arrays the compiled loop works in)."""

    def __init__(self, size, max_batch, poll_limit):
        cap = poll_limit + max_batch        # full batches leave every round, so this suffices
        self.pending = np.zeros((size, cap), COMMAND_DTYPE)
        self.count = np.zeros(size, np.int64)
        self.oldest = np.zeros(size, np.int64)
        # outbox: the batches one round may defer, and (peer, first, n) of each
        self.outbox = np.zeros(poll_limit + size * max_batch, COMMAND_DTYPE)
        self.out_table = np.zeros((poll_limit + size, 3), np.int64)
        self.out_count = np.zeros(2, np.int64)   # batches, commands

    def outbox_ctx(self):
        return self.outbox, self.out_table, self.out_count

    def take_outbox(self):
        """[(peer, batch)] deferred since the last call (batches are copies)."""
        nb = int(self.out_count[0])
        got = [(int(p), self.outbox[s:s + n].copy()) for p, s, n in self.out_table[:nb]]
        self.out_count[:] = 0
        return got


@njit(nogil=True)
def defer(ctx, peer, batch):
    """Outbox "issue": keep the batch for the Python thread. Returns 0, or 1 if it is full."""
    out, table, count = ctx
    nb, nc, n = count[0], count[1], batch.shape[0]
    if nb >= table.shape[0] or nc + n > out.shape[0]:
        return 1
    for i in range(n):
        out[nc + i] = batch[i]
    table[nb, 0], table[nb, 1], table[nb, 2] = peer, nc, n
    count[0], count[1] = nb + 1, nc + n
    return 0


@njit(nogil=True)
def no_progress(ctx):
    return 0


@njit(nogil=True)
def _fail(st, kind, peer, code):
    st[S_ERR], st[S_ERR_PEER], st[S_ERR_CODE] = kind, peer, code
    return False


@njit(nogil=True)
def _poll(st, cfg, words, recs, tail, pending, count, oldest, clock):
    """Copy the committed prefix of the ring into the queues; returns how many (or -1)."""
    slots = recs.shape[0]
    mask = slots - 1
    t = st[S_TAIL]
    limit = min(cfg[K_POLL_LIMIT], slots)
    n = 0
    while n < limit and np.int64(words[((t + n) & mask) * CMD_WORDS]) == ((t + n + 1) & 0xFFFFFFFF):
        n += 1
    if n == 0:
        return 0
    now = now_ns(clock)   # an opaque call: the body loads below stay after the header loads
    size = count.shape[0]
    for i in range(n):
        c = recs[(t + i) & mask]
        p = np.int64(c.peer)
        if p >= size:
            _fail(st, E_PEER, p, 0)
            return -1
        k = count[p]
        if k == 0:
            oldest[p] = now
        pending[p, k] = c
        count[p] = k + 1
    st[S_TAIL] = t + n
    now_ns(clock)         # copies done before the slots go back
    tail[0] = np.uint32((t + n) & 0xFFFFFFFF)
    return n


@njit(nogil=True)
def _submit(st, cfg, p, k, pending, count, win_bytes, issue, progress, ctx, clock):
    """Check, pace and issue the first ``k`` queued commands of connection ``p``."""
    batch = pending[p, :k]
    if _first_bad(batch, p, cfg[K_ME], count.shape[0], win_bytes, cfg[K_NWIN]) >= 0:
        return _fail(st, E_COMMAND, p, k)   # left queued: Python describes it
    nbytes = np.int64(0)
    for i in range(k):
        nbytes += batch[i].nbytes
    if cfg[K_PACE_FS_PER_BYTE] > 0:
        now = now_ns(clock)
        nxt = max(st[S_PACE_NEXT], now - BURST_NS)
        while now < nxt:
            if progress(ctx) < 0:
                return _fail(st, E_PROGRESS, p, 0)
            now = now_ns(clock)
        st[S_PACE_NEXT] = nxt + nbytes * cfg[K_PACE_FS_PER_BYTE] // 1_000_000   # fs -> ns
    t = now_ns(clock)
    rc = issue(ctx, p, batch)
    st[S_MAX_ISSUE_NS] = max(st[S_MAX_ISSUE_NS], now_ns(clock) - t)
    if rc != 0:
        return _fail(st, E_ISSUE, p, rc)
    st[S_COMMANDS] += k
    st[S_BATCHES] += 1
    st[S_BYTES] += nbytes
    rest = count[p] - k
    for i in range(rest):
        pending[p, i] = pending[p, k + i]
    count[p] = rest
    return True


@njit(nogil=True)
def run(st, cfg, words, recs, tail, pending, count, oldest, win_bytes, issue, progress, ctx,
        clock):
    """Run the proxy loop for up to ``cfg[K_SLICE_NS]``; returns an RC_* code (see module doc).

    words: uint32 ring (host view of mapped memory), recs: the same memory as COMMAND_DTYPE;
    tail: uint32[1] credits (mapped); pending/count/oldest: :class:`Queues`; win_bytes: uint64
    bytes per window; issue/progress/ctx: the transport's compiled pair, or defer/no_progress
    with the outbox as ctx.
    """
    start = now_ns(clock)
    max_batch, window = cfg[K_MAX_BATCH], cfg[K_WINDOW_NS]
    outbox = cfg[K_OUTBOX] != 0
    while True:
        t0 = now_ns(clock)
        if st[S_LAST_ROUND] > 0:    # the longest the ring went unwatched (naps excluded)
            st[S_MAX_GAP_NS] = max(st[S_MAX_GAP_NS], t0 - st[S_LAST_ROUND])
        stopping = st[S_STOP] != 0
        n = _poll(st, cfg, words, recs, tail, pending, count, oldest, clock)
        if n < 0:
            return RC_ERROR
        issued = 0
        queued = 0
        for p in range(count.shape[0]):
            while count[p] >= max_batch:
                if not _submit(st, cfg, p, max_batch, pending, count, win_bytes, issue,
                               progress, ctx, clock):
                    return RC_ERROR
                oldest[p] = t0
                issued += 1
            k = count[p]
            if k > 0 and (stopping or t0 - oldest[p] >= window):
                if not _submit(st, cfg, p, k, pending, count, win_bytes, issue, progress, ctx,
                               clock):
                    return RC_ERROR
                issued += 1
            queued += count[p]
        done = progress(ctx)
        if done < 0:
            _fail(st, E_PROGRESS, -1, -done)
            return RC_ERROR
        st[S_POLLS] += 1
        t1 = now_ns(clock)
        if st[S_YIELD] != 0:
            return RC_YIELD
        if n or issued or done:
            st[S_BUSY_NS] += t1 - t0
            st[S_IDLE_SINCE] = t1
            if outbox and issued:
                return RC_DEFERRED
        elif stopping and queued == 0:
            return RC_DRAINED
        elif t1 - st[S_IDLE_SINCE] > cfg[K_SPIN_NS]:
            st[S_LAST_ROUND] = 0
            if outbox:
                return RC_IDLE
            nap_us(NAP_US)
            t1 = now_ns(clock)
        st[S_LAST_ROUND] = t1
        if t1 - start >= cfg[K_SLICE_NS]:
            return RC_SLICE
