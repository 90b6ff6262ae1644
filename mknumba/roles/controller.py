"""The adaptive SM split (paper §3.2): blocks move between compute and communication between
work items, toward a target the controller derives from measured progress and the work left.

A fused kernel that runs adaptively has ``flexible`` blocks that draw work from two kinds of
queues (``roles.blocks.take``): compute items (tiles) and communication items (e.g. a tile to
reduce). Before each item a block calls :func:`decide`, which

- estimates the cost per item of each kind from what the blocks have measured so far
  (nanoseconds and items, summed in ``ctl`` by :func:`account`; the sums grow across calls, so
  a later call starts from the earlier calls' estimates, and nothing is reset between calls);
- sets the target number of communication blocks that equalizes the predicted time left of
  both kinds: ``n_s = B * R_s C_s / (R_p C_p + R_s C_s)`` (paper eq. 2; R: items not yet
  taken, C: cost per item, B: ``flexible``), or the kernel's initial split while a kind has no
  measurement yet;
- moves the block to communication when fewer blocks than the target are there, back to
  compute when more are, and forces the move when the block's own kind has nothing left.

Nothing waits here: a decision is a few atomics on ``ctl``. The kernel decides what a block in
each role does; for a compute -> communication kernel (GEMM + ReduceScatter / AllReduce) a
communication block whose item is not ready yet computes a tile instead of waiting, so a
target that runs ahead of the work costs no idle SM (``kernels.gemm_reduce``).

For a communication -> compute kernel (AllGather + GEMM, Ring Attention) :func:`make_dispatch`
is the whole loop's head: one thread picks a flexible block's next item (the controller's
role, a ticket of that queue; a held tile whose inputs have not arrived waits behind
communication items while any are left). A kernel calls it block-wide (``next_block``), or
from the one thread that hands out its block's work (the sm_90a attention tile's producer
lane, whose consumers never meet it at a block-wide barrier: ``next_item``).

``ctl``: uint64 [CTL_WORDS]: ns and items per kind, and the count of blocks in the
communication role (every block leaves it before it ends, so the count is 0 between calls).
"""
import numpy as np
from numba import cuda

from .. import primitives as prim
from .blocks import ticket

COMPUTE, COMM = 0, 1                     # the two roles a flexible block can take
(CTL_NS_COMPUTE, CTL_N_COMPUTE, CTL_NS_COMM, CTL_N_COMM, CTL_ACTIVE_COMM) = range(5)
CTL_WORDS = 8
CTL_LOG = 32                       # decisions logged per block and call (log)
Q_COMPUTE, Q_COMM = 0, 1           # make_dispatch's work queues (roles.blocks.take)
QUEUES = 2
END = -1                           # make_dispatch: no item left
#: make_dispatch's state, one thread's: role, the held compute item (-1: none), whether each
#: queue may still have items, decisions logged
(S_ROLE, S_HELD, S_COMPUTE_OPEN, S_COMM_OPEN, S_LOGGED) = range(5)
STATE = 5


@cuda.jit(device=True)
def target(ctl, flexible, left_p, left_s, initial):
    """Communication blocks wanted now (thread 0): eq. 2 of the paper from the measured costs
    per item, ``initial`` until both kinds have a measurement; at least one while
    communication is left, at most ``flexible - 1`` while compute is left."""
    n_p, n_s = ctl[CTL_N_COMPUTE], ctl[CTL_N_COMM]
    if left_s <= 0:
        want = 0
    elif left_p <= 0:
        want = flexible
    elif n_p == 0 or n_s == 0:
        want = initial
    else:
        # F * S / (P + S) rounded, with the costs per item (ns / n) multiplied out, and no
        # divide: ptxas calls a subroutine for a float64 divide, and any call serializes
        # every wgmma of the kernel. Binary search for the largest w in [0, F] with
        # (2w - 1)(P + S) <= 2 F S.
        work_p = np.float64(left_p) * np.float64(ctl[CTL_NS_COMPUTE]) * np.float64(n_s)
        work_s = np.float64(left_s) * np.float64(ctl[CTL_NS_COMM]) * np.float64(n_p)
        lo, hi = np.int64(0), np.int64(flexible)
        while lo < hi:
            mid = (lo + hi + 1) >> 1
            if np.float64(2 * mid - 1) * (work_p + work_s) <= \
                    2.0 * np.float64(flexible) * work_s:
                lo = mid
            else:
                hi = mid - 1
        want = lo
    if left_s > 0 and want < 1:
        want = 1
    if left_p > 0 and want > flexible - 1:
        want = flexible - 1
    return want


@cuda.jit(device=True)
def choose(ctl, role, can_p, can_s, left_p, left_s, flexible, initial):
    """One thread decides for its block, between work items: ``(role, target)``, the role the
    block takes next.

    role: its current role (COMPUTE or COMM); can_p / can_s: whether this block still has
    draws of that kind to make (each block draws every queue until it sees the end); left_p /
    left_s: items of each kind no block has taken yet. A block that can draw only one kind
    takes it; else it moves toward :func:`target`, checked against the count of
    communication blocks with one atomic, so blocks deciding at once do not all move.
    A block whose threads part into groups that never meet at a block-wide barrier (the
    sm_90a attention tile's producer and consumers) calls this from the thread that hands
    out its work; others call :func:`decide`.
    """
    want = target(ctl, flexible, left_p, left_s, initial)
    new = role
    if role == COMPUTE and can_s and (not can_p or left_p <= 0 or left_s > 0):
        old = np.int64(cuda.atomic.add(ctl, CTL_ACTIVE_COMM, np.uint64(1)))
        if not can_p or left_p <= 0 or old < want:
            new = COMM
        else:
            cuda.atomic.sub(ctl, CTL_ACTIVE_COMM, np.uint64(1))
    elif role == COMM and can_p and (not can_s or left_s <= 0 or left_p > 0):
        old = np.int64(cuda.atomic.sub(ctl, CTL_ACTIVE_COMM, np.uint64(1)))
        if not can_s or left_s <= 0 or old > want:
            new = COMPUTE
        else:
            cuda.atomic.add(ctl, CTL_ACTIVE_COMM, np.uint64(1))
    return new, want


@cuda.jit(device=True)
def decide(ctl, role, can_p, can_s, left_p, left_s, flexible, initial):
    """Block-wide, between work items: :func:`choose` by thread 0, its answer ``(role,
    target)`` for every thread."""
    out = cuda.shared.array(2, np.int64)
    if cuda.threadIdx.x == 0:
        out[0], out[1] = choose(ctl, role, can_p, can_s, left_p, left_s, flexible, initial)
    cuda.syncthreads()
    new, want = out[0], out[1]
    cuda.syncthreads()           # read by all before the next decision rewrites it
    return new, want


@cuda.jit(device=True, inline=True)
def count(ctl, role, sign):
    """One thread: count its block into (``sign`` 1) or out of (-1) the communication role
    when ``role`` is COMM."""
    if role == COMM:
        if sign > 0:
            cuda.atomic.add(ctl, CTL_ACTIVE_COMM, np.uint64(1))
        else:
            cuda.atomic.sub(ctl, CTL_ACTIVE_COMM, np.uint64(1))


@cuda.jit(device=True)
def enter(ctl, role):
    """A block starts in ``role`` (thread 0 counts a communication block in)."""
    if cuda.threadIdx.x == 0:
        count(ctl, role, 1)


@cuda.jit(device=True)
def leave(ctl, role):
    """A block ends in ``role`` (thread 0 counts a communication block out)."""
    if cuda.threadIdx.x == 0:
        count(ctl, role, -1)


@cuda.jit(device=True)
def account(ctl, role, start):
    """Thread 0, after a barrier that closes one item of ``role`` begun at ``start``
    (``globaltimer``): add its duration to that role's measurement."""
    if cuda.threadIdx.x == 0:
        ns = prim.globaltimer() - start
        i = CTL_NS_COMPUTE if role == COMPUTE else CTL_NS_COMM
        cuda.atomic.add(ctl, i, np.uint64(ns))
        cuda.atomic.add(ctl, i + 1, np.uint64(1))


@cuda.jit(device=True)
def left(queue, q, call, n, workers):
    """Items of work queue ``q`` (``roles.blocks.take``) no block has taken yet this call."""
    first = (np.int64(call) - 1) * (n + workers)
    taken = (np.int64(prim.atomic_add_relaxed(queue, q, np.uint32(0))) - first) & 0xFFFFFFFF
    return n - taken if taken < n else 0


@cuda.jit(device=True)
def log(on, trace, row_n, row0, blk, j, max_entries, role, want):
    """Tracing: entry ``j`` (this call's, counted by the caller from 0) of block ``blk``'s
    decision log in ``trace``: rows ``row0 + 2j`` hold the times, ``row0 + 2j + 1``
    ``target * 16 + role``; ``trace[row_n, blk] = j + 1`` counts them (entries past
    ``max_entries`` are dropped). Thread 0 writes (:func:`log_by` for the one thread that
    decides). Returns ``j + 1``."""
    if cuda.threadIdx.x == 0:
        log_by(on, trace, row_n, row0, blk, j, max_entries, role, want)
    return j + 1


@cuda.jit(device=True, inline=True)
def log_by(on, trace, row_n, row0, blk, j, max_entries, role, want):
    """:func:`log` by the calling thread (the one that called :func:`choose`)."""
    if on and blk < trace.shape[1]:
        if j < max_entries:
            trace[row0 + 2 * j, blk] = prim.globaltimer()
            trace[row0 + 2 * j + 1, blk] = want * 16 + role
        trace[row_n, blk] = j + 1
    return j + 1


def make_dispatch(ready):
    """``(start, next_item, next_block, stop)`` for a flexible block whose compute items need
    inputs other blocks or GPUs move (communication -> compute): ``ready(args, i)`` (one
    thread, no wait) says whether compute item ``i``'s inputs are all here.

    ``start(st, ctl, role, ncomm)``: one thread, before the first item; st: int64
    [STATE] of that thread (``cuda.local.array``), role: the block's first role, ncomm: the
    communication items. ``next_item(st, ctl, queue, call, counts, flex, initial, log_at,
    args)``: one thread: ``(kind, item)`` the block does next, kind COMPUTE or COMM, or END;
    counts: (compute items, communication items); flex: flexible blocks; initial: the
    target until both kinds are measured (:func:`target`); log_at: (on, trace, row_n, row0,
    blk) for :func:`log_by`. A compute item is held until ``ready``, the block taking
    communication items meanwhile while any are left (they never wait), then done anyway
    (its own waits are the bounded ones of the static role). ``next_block``: the same,
    block-wide (thread 0 holds st). ``stop(st, ctl)``: one thread, after END.
    """
    @cuda.jit(device=True, inline=True)
    def start(st, ctl, role, ncomm):
        st[S_ROLE] = role
        st[S_HELD] = -1
        st[S_COMPUTE_OPEN] = 1
        st[S_COMM_OPEN] = 1 if ncomm > 0 else 0
        st[S_LOGGED] = 0
        count(ctl, role, 1)

    @cuda.jit(device=True)
    def next_item(st, ctl, queue, call, counts, flex, initial, log_at, args):
        tiles, ncomm = counts
        while True:
            held = st[S_HELD]
            if held >= 0:
                if st[S_COMM_OPEN] != 0 and not ready(args, held):
                    it = ticket(queue, Q_COMM, call, ncomm, flex)
                    if it < ncomm:
                        return COMM, it
                    st[S_COMM_OPEN] = 0
                    continue
                st[S_HELD] = -1
                return COMPUTE, held
            if st[S_COMPUTE_OPEN] == 0 and st[S_COMM_OPEN] == 0:
                return END, np.int64(0)
            role = st[S_ROLE]
            new, want = choose(ctl, role, st[S_COMPUTE_OPEN] != 0, st[S_COMM_OPEN] != 0,
                               left(queue, Q_COMPUTE, call, tiles, flex),
                               left(queue, Q_COMM, call, ncomm, flex), flex, initial)
            if new != role or st[S_LOGGED] == 0:
                on, trace, row_n, row0, blk = log_at
                st[S_LOGGED] = log_by(on, trace, row_n, row0, blk, st[S_LOGGED], CTL_LOG, new,
                                      want)
            st[S_ROLE] = new
            if new == COMM:
                it = ticket(queue, Q_COMM, call, ncomm, flex)
                if it < ncomm:
                    return COMM, it
                st[S_COMM_OPEN] = 0
            else:
                i = ticket(queue, Q_COMPUTE, call, tiles, flex)
                if i < tiles:
                    st[S_HELD] = i
                else:
                    st[S_COMPUTE_OPEN] = 0

    @cuda.jit(device=True)
    def next_block(st, ctl, queue, call, counts, flex, initial, log_at, args):
        out = cuda.shared.array(2, np.int64)
        if cuda.threadIdx.x == 0:
            out[0], out[1] = next_item(st, ctl, queue, call, counts, flex, initial, log_at,
                                       args)
        cuda.syncthreads()
        kind, item = out[0], out[1]
        cuda.syncthreads()       # read by all before the next call rewrites it
        return kind, item

    @cuda.jit(device=True, inline=True)
    def stop(st, ctl):
        count(ctl, st[S_ROLE], -1)

    return start, next_item, next_block, stop
