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

``ctl``: uint64 [CTL_WORDS]: ns and items per kind, and the count of blocks in the
communication role (every block leaves it before it ends, so the count is 0 between calls).
"""
import numpy as np
from numba import cuda

from .. import primitives as prim

COMPUTE, COMM = 0, 1                     # the two roles a flexible block can take
(CTL_NS_COMPUTE, CTL_N_COMPUTE, CTL_NS_COMM, CTL_N_COMM, CTL_ACTIVE_COMM) = range(5)
CTL_WORDS = 8
CTL_LOG = 32                       # decisions logged per block and call (log)


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
def decide(ctl, role, can_p, can_s, left_p, left_s, flexible, initial):
    """Block-wide, between work items: ``(role, target)``, the role this block takes next.

    role: its current role (COMPUTE or COMM); can_p / can_s: whether this block still has
    draws of that kind to make (each block draws every queue until it sees the end); left_p /
    left_s: items of each kind no block has taken yet. A block that can draw only one kind
    takes it; else it moves toward :func:`target`, checked against the count of
    communication blocks with one atomic, so blocks deciding at once do not all move.
    """
    out = cuda.shared.array(2, np.int64)
    if cuda.threadIdx.x == 0:
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
        out[0] = new
        out[1] = want
    cuda.syncthreads()
    new, want = out[0], out[1]
    cuda.syncthreads()           # read by all before the next decision rewrites it
    return new, want


@cuda.jit(device=True)
def enter(ctl, role):
    """A block starts in ``role`` (thread 0 counts a communication block in)."""
    if cuda.threadIdx.x == 0 and role == COMM:
        cuda.atomic.add(ctl, CTL_ACTIVE_COMM, np.uint64(1))


@cuda.jit(device=True)
def leave(ctl, role):
    """A block ends in ``role`` (thread 0 counts a communication block out)."""
    if cuda.threadIdx.x == 0 and role == COMM:
        cuda.atomic.sub(ctl, CTL_ACTIVE_COMM, np.uint64(1))


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
    ``max_entries`` are dropped). Returns ``j + 1``."""
    if on and cuda.threadIdx.x == 0 and blk < trace.shape[1]:
        if j < max_entries:
            trace[row0 + 2 * j, blk] = prim.globaltimer()
            trace[row0 + 2 * j + 1, blk] = want * 16 + role
        trace[row_n, blk] = j + 1
    return j + 1
