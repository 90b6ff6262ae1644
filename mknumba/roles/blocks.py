"""Block-level building blocks shared by every role: copy a tile, publish it, wait for one.

All threads of the block call these together (they contain ``syncthreads``); thread 0 does the
flag traffic, the others wait at the barrier. That keeps one poller per block, so a waiting
block costs one warp's load traffic rather than a whole block's.
"""
import numpy as np
from numba import cuda

from .. import primitives as prim


@cuda.jit(device=True)
def begin(frame):
    """Every block of a launch calls this first, with all its threads: ``(epoch, call)`` of
    this launch, from the op's call counter ``frame`` (uint64 tickets, ``kernels.lifetime.Frame``).

    Thread 0 takes the next ticket; launches of one op run one after another, so launch c (1,
    2, ...) holds tickets [(c - 1) * grid, c * grid) and ``call = ticket // grid + 1``. Nothing
    is reset, so a launch numbers itself on the GPU (a replayed CUDA graph gets a new epoch each
    time), and should two launches ever overlap, the calls after them are numbered right again.
    ``epoch = primitives.epoch_of(call)``; ``call`` is int64. ``call == 0``: the op has ended
    on this rank (``primitives.FRAME_CLOSED``; a graph replayed after it), and every block of
    the launch returns at once, publishing nothing.
    """
    got = cuda.shared.array(1, np.int64)
    if cuda.threadIdx.x == 0:
        ticket = prim.atomic_add_relaxed(frame, 0, np.uint64(1))
        if ticket >= prim.FRAME_CLOSED:
            got[0] = 0
        else:
            got[0] = np.int64(prim.udiv64_small(ticket, cuda.gridDim.x)) + 1
    cuda.syncthreads()
    call = got[0]
    cuda.syncthreads()   # read by all before a later begin (a next call) could rewrite it
    return prim.epoch_of(call), call


@cuda.jit(device=True, inline=True)
def launch_context(frame, timeout_ns, err, rank):
    """:func:`begin`, then the context every role of a fused kernel takes: ``(epoch, call,
    deadline, err, rank)``, the deadline of every wait ``timeout_ns`` from now (``call == 0``:
    the op has ended here, return)."""
    epoch, call = begin(frame)
    return (epoch, call, prim.globaltimer() + timeout_ns, err, rank)


@cuda.jit(device=True)
def copy_tile(src, src_off, dst, dst_off, n):
    """dst[dst_off : dst_off+n] = src[src_off : src_off+n], by all threads of the block.

    src, dst: 1-d arrays of one dtype (dst may be a peer's buffer from ``peer_view``).
    """
    i = cuda.threadIdx.x        # a while loop: range() with a run-time step divides (64-bit)
    while i < n:
        dst[dst_off + i] = src[src_off + i]
        i += cuda.blockDim.x


@cuda.jit(device=True, inline=True)
def copy_by(src, src_off, dst, dst_off, n, first, threads):
    """:func:`copy_tile` by ``threads`` threads of the block, this one ``first`` of them (a
    group of warps apart from the others, e.g. the sm_90a attention tile's consumers)."""
    i = first
    while i < n:
        dst[dst_off + i] = src[src_off + i]
        i += threads


@cuda.jit(device=True)
def publish(flags, idx, epoch, system=True):
    """Make the block's earlier stores visible, then set ``flags[idx] = epoch``.

    Data before flag: the barrier gathers every thread's stores under thread 0, whose fence
    orders them before its release store of the flag. ``system``: the reader may be a peer GPU
    or the host; False when only blocks of this GPU read the flag (``primitives.release``).
    """
    cuda.syncthreads()
    if cuda.threadIdx.x == 0:
        prim.release(flags, idx, epoch, system)


@cuda.jit(device=True)
def publish_peers(ptrs, template, members, me, idx, epoch):
    """:func:`publish` into every other local GPU's flags: ``template`` is this GPU's flag
    array, ``ptrs`` its address table. For data this block stored into those GPUs' memory."""
    cuda.syncthreads()
    if cuda.threadIdx.x == 0:
        for j in range(1, members):
            prim.release(prim.peer_view(ptrs, prim.peer_after(me, j, members), template), idx,
                         epoch, True)


@cuda.jit(device=True)
def wait(flags, idx, epoch, deadline, err, rank, role, system=True):
    """Block-wide bounded wait for ``flags[idx]`` to reach ``epoch``; False on timeout.

    Every thread gets the same answer, so the whole block can return together. ``system``:
    as in :func:`publish`, the scope of the writer.
    """
    ok = cuda.shared.array(1, np.int32)
    if cuda.threadIdx.x == 0:
        ok[0] = 1 if prim.wait_flag(flags, idx, epoch, deadline, err, rank, role, 100,
                                    system) else 0
    cuda.syncthreads()
    result = ok[0] != 0
    cuda.syncthreads()  # nobody may overwrite ok[0] in a later wait before all have read it
    return result


@cuda.jit(device=True)
def poll(flags, idx, epoch, system=True):
    """Block-wide, one look and no wait: whether ``flags[idx]`` holds ``epoch`` (acquire, as
    :func:`wait`). For a block that does other work while what it holds is not ready."""
    ok = cuda.shared.array(1, np.int32)
    if cuda.threadIdx.x == 0:
        ok[0] = 1 if prim.epoch_reached(prim.acquire(flags, idx, system), epoch) else 0
    cuda.syncthreads()
    result = ok[0] != 0
    cuda.syncthreads()
    return result


@cuda.jit(device=True)
def take(queue, q, call, n, workers):
    """Block-wide: this block's next item (0 .. n-1) of a work queue shared by ``workers``
    blocks, or ``n`` or more once the call's items are all taken. Items go out in index order,
    so the queue hands out tiles in the order they become ready, each to whichever block is free.

    queue: uint32 ticket counters that only grow (``q`` picks one): every call draws
    ``n + workers`` tickets (each worker draws once past the end, then stops), so call number
    ``call`` (1-based, mod 2**32) starts at ``(call - 1) * (n + workers)`` and nothing is reset.
    A block that returns early (a timeout) leaves the count short; the op is unusable then
    anyway. Relaxed: an item's data travels behind its own flags.
    """
    got = cuda.shared.array(1, np.int64)
    if cuda.threadIdx.x == 0:
        got[0] = ticket(queue, q, call, n, workers)
    cuda.syncthreads()
    i = got[0]
    cuda.syncthreads()   # every thread has read it before the next take overwrites it
    return i


@cuda.jit(device=True, inline=True)
def ticket(queue, q, call, n, workers):
    """:func:`take` by one thread, for a block whose work is handed out by one thread (the
    sm_90a attention tile's producer lane)."""
    first = (np.int64(call) - 1) * (n + workers)
    return (np.int64(prim.atomic_add_relaxed(queue, q, np.uint32(1))) - first) & 0xFFFFFFFF


@cuda.jit(device=True)
def record(on, trace, event, item, value):
    """Tracing: ``trace[event, item] = value`` from thread 0, when ``on`` (and the item has a
    column). Costs one predictable branch when off."""
    if on and cuda.threadIdx.x == 0 and item < trace.shape[1]:
        trace[event, item] = value


@cuda.jit(device=True)
def stamp(on, trace, event, item):
    """Tracing: ``trace[event, item] = globaltimer`` (ns) from thread 0, when ``on``: the host
    turns the rows into a role timeline (``mknumba.timeline``). Off, the clock is not read
    either (it is a volatile read the compiler keeps)."""
    if on:
        record(on, trace, event, item, prim.globaltimer())


@cuda.jit(device=True, inline=True)
def no_stamp(on, trace, event, item):
    """:func:`stamp`'s stand-in for roles built without stamps (any ``trace``: never read)."""
    pass
