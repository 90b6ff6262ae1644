"""The fused GEMM + reduction kernel: its roles, each a device function, and the kernel that
hands blocks to them in block order (the role table is in :mod:`mknumba.kernels.gemm_reduce`).

Every role takes ``ctx = (epoch, call, deadline, err, rank, trace)`` and returns False when one
of its waits timed out (the error record says which), so the block can end.
"""
import numpy as np
from numba import cuda, types

from ... import _compat  # noqa: F401  (numpy alias before numba compiles)
from ... import primitives as prim
from ..._compat import SIMULATOR
from ...errors import ROLE_BITS, ROLE_INTRA, ROLE_RECV, ROLE_SEND
from ...roles import compute
from ...roles import controller as ctl_
from ...roles.blocks import begin, poll, publish, publish_peers, record, stamp, take, wait
from ...roles.reduce import chunk_arrive, copy_tile_2d, sum_local, reduce_peers
from ...roles.send import enqueue
from ..launch import array_type

Bits2D, Bits4D = array_type(np.uint16, 2), array_type(np.uint16, 4)
Words, Flags = array_type(np.uint64, 1), array_type(np.uint32, 1)
Ints, Cmds = array_type(np.int32, 1), array_type(np.int32, 2)
Cfg, Record, Trace = array_type(np.int64, 1), array_type(np.int64, 1), array_type(np.int64, 2)

#: cfg: the small integers of a launch, one int64 array, by name (``launch.pack``).
CFG_FIELDS = ("m", "n", "tiles_n", "me", "g", "nodes", "out_row0", "compute", "reduce_end",
              "send_end", "recv_end", "allreduce", "stage_slots", "recv_slots", "nfinal",
              "recv_chunks", "chunk", "ncmds", "win_stage", "win_recv", "win_arrive", "nred",
              "npull", "words", "trace", "join", "deliver", "direct", "fold", "out_shared",
              "adaptive", "flex_pull", "init_comm")
(C_M, C_N, C_TILES_N, C_ME, C_G, C_NODES, C_OUT_ROW0, C_COMPUTE, C_REDUCE_END, C_SEND_END,
 C_RECV_END, C_ALLREDUCE, C_STAGE_SLOTS, C_RECV_SLOTS, C_NFINAL, C_RECV_CHUNKS, C_CHUNK,
 C_NCMDS, C_WIN_STAGE, C_WIN_RECV, C_WIN_ARRIVE, C_NRED, C_NPULL, C_WORDS, C_TRACE,
 C_JOIN, C_DELIVER, C_DIRECT, C_FOLD, C_OUT_SHARED, C_ADAPTIVE, C_FLEX_PULL,
 C_INIT_COMM) = range(33)
Q_REDUCE, Q_PULL, Q_COMPUTE = 0, 1, 2      # the work queues (roles.blocks.take)
QUEUES = 3
# Which flag array a wait watched, in its role code (errors.ROLE_BITS), so that a timeout
# names it (``op.GemmReduce._flag_name``): the intra-node role's array 0 is the final flags
# (pull), array 1 + j local GPU j's partials; the receive role's array 0 the arrival flags,
# array 1 this GPU's stage slots (its own node's sum).
INTRA_PARTIAL_OF = ROLE_INTRA | 1 << ROLE_BITS       # plus j << ROLE_BITS
RECV_OWN_SUM = ROLE_RECV | 1 << ROLE_BITS

# trace rows (``trace=True``): globaltimer stamps, one row per event, indexed by the role's item
# (tile_*: by position in the compute order; tile_block: which block computed it; block_*,
# compute_end and ctl_n: by block); then the controller's decision log (roles.controller.log)
(T_BLOCK_START, T_BLOCK_END, T_RED_READY, T_RED_DONE, T_SEND_READY, T_SEND_ENQUEUED,
 T_RECV_ARRIVED, T_RECV_DONE, T_PULL_DONE, T_PULL_READY, T_TILE_START, T_TILE_DONE,
 T_TILE_BLOCK, T_COMPUTE_END, T_CTL_N) = range(15)
TRACE_EVENTS = ("block_start", "block_end", "reduce_ready", "reduce_done", "send_ready",
                "send_enqueued", "recv_arrived", "recv_done", "pull_done", "pull_ready",
                "tile_start", "tile_done", "tile_block", "compute_end", "ctl_n")
CTL_LOG = ctl_.CTL_LOG
TRACE_ROWS = len(TRACE_EVENTS) + 2 * CTL_LOG

_BYTE = np.dtype(np.uint8) if SIMULATOR else np.uint8
_MASK32 = 0xFFFFFFFF


def make_kernel(build, threads, adaptive=False):
    """The persistent kernel around one tile build (``roles.compute.TileBuild``), with the
    static split or (``adaptive``) the controller's. Each role is a device function below; the
    kernel at the end hands blocks to them in block order."""
    bm, bn = build.shape
    tile_init = build.init
    compute_tile = compute.make_compute_tile(build, compute.TO_OWNER)
    bw = bn // 4                      # words (4 bf16) per tile row
    tile_words = bm * bw
    tile_bytes = tile_words * 8
    bounds = {} if SIMULATOR else {"launch_bounds": (threads, 1)}

    # Every role takes ``ctx = (epoch, call, deadline, err, rank, trace)`` and returns False
    # when one of its waits timed out (the error record holds which), so the block can end.
    # The roles are inlined into the kernel: compiled apart, each would define the static
    # shared arrays of roles.blocks.wait and take again, and the link refuses the duplicates.

    @cuda.jit(device=True, inline=True)
    def origin(t, tiles_n):
        """First row (elements) and column (words) of tile ``t``."""
        tm = prim.udiv32(t, tiles_n)
        return tm * bm, (t - tm * tiles_n) * bw

    @cuda.jit(device=True, inline=True)
    def push_target(cfg, out_ptrs, out, out_off, part_ptrs, part, part_off):
        """Where an AllReduce owner writes a finished tile for the other local GPUs: straight
        into their shared output (``C_DIRECT``, fixed when the op is planned, so every GPU
        agrees), else into their partials,
        which each then copies out (pull role). (address table, this GPU's array, offset)."""
        if cfg[C_DIRECT] != 0:        # out may be the caller's array: only its type is used
            return out_ptrs, out, out_off
        return part_ptrs, part, part_off

    @cuda.jit(device=True, inline=True)
    def red_flag(cfg, tile_flags, tile_flag_ptrs, j, t, tiles):
        """Where the ``j``-th partial of tile ``t`` is announced: (flags, index, system, the
        local GPU whose partial it is). Delivered: plane j of this GPU (its own tile, then its
        inbox: plane j from the GPU j places after it); else every local GPU's own tile, read
        over NVLink."""
        me, G = cfg[C_ME], cfg[C_G]
        if cfg[C_DELIVER] != 0:
            return tile_flags, np.int64(j * tiles + t), True, prim.peer_after(me, j, G)
        src = prim.peer_after(me, 1 + j, G)
        return prim.peer_view(tile_flag_ptrs, src, tile_flags), np.int64(t), G > 1, src

    @cuda.jit(device=True, inline=True)
    def reduce_ready(cfg, node, t, tiles, epoch):
        """Block-wide, no wait: whether every local GPU's partial of tile ``t`` is there."""
        tile_flags, tile_flag_ptrs = node[2], node[3]
        for j in range(cfg[C_G]):
            flags, idx, system, _ = red_flag(cfg, tile_flags, tile_flag_ptrs, j, t, tiles)
            if not poll(flags, idx, epoch, system):
                return False
        return True

    @cuda.jit(device=True, inline=True)
    def reduce_wait(cfg, node, t, tiles, ctx):
        """Block-wide bounded wait for every local GPU's partial of tile ``t``."""
        tile_flags, tile_flag_ptrs = node[2], node[3]
        epoch, call, deadline, err, rank, trace = ctx
        for j in range(cfg[C_G]):
            flags, idx, system, src = red_flag(cfg, tile_flags, tile_flag_ptrs, j, t, tiles)
            if not wait(flags, idx, epoch, deadline, err, rank,
                        INTRA_PARTIAL_OF + (src << ROLE_BITS), system):
                return False
        return True

    @cuda.jit(device=True, inline=True)
    def reduce_work(cfg, tables, node, net, out, out_ptrs, it, ctx):
        """One reduce item whose partials are all there (:func:`reduce_wait`): the ``it``-th
        tile this GPU owns, summed (fp32) and written: 1 node, to ``out`` (AllReduce: also into
        every local peer's partials, or with a shared output and delivery straight into its
        ``out``, then their final flags); nodes > 1, to a stage slot for the network, counting
        it into its chunk."""
        order, red_tiles, red_slots, red_chunks, chunk_tiles = tables
        part, part_ptrs, tile_flags, tile_flag_ptrs, final_flags, final_flag_ptrs = node
        stage, red_flags, chunk_count, chunk_ready = net
        epoch, call, deadline, err, rank, trace = ctx
        tr = cfg[C_TRACE] != 0
        m, wn, me, G = cfg[C_M], cfg[C_N] // 4, cfg[C_ME], cfg[C_G]
        nodes, allreduce, deliver = cfg[C_NODES], cfg[C_ALLREDUCE] != 0, cfg[C_DELIVER] != 0
        part_base = (call & 1) * cfg[C_WORDS]
        plane = m * wn                # words per plane of partials
        t = red_tiles[it]
        stamp(tr, trace, T_RED_READY, it)
        r0, c0 = origin(t, cfg[C_TILES_N])
        rows = min(bm, m - r0)
        wcols = min(bw, wn - c0)
        src = part_base + r0 * wn + c0
        if nodes == 1:
            dst = (r0 - cfg[C_OUT_ROW0]) * wn + c0
            if deliver:               # all G partials are local: plane 0 + planes 1..G-1
                to_ptrs, to, to_off = push_target(cfg, out_ptrs, out, dst, part_ptrs,
                                                  part, src)
                sum_local(part, src, part, src + plane, plane, G - 1, out, dst, wn,
                          to_ptrs, to, G, me, to_off, wn, allreduce, rows, wcols, wn)
            else:
                reduce_peers(part_ptrs, part, G, me, src, wn, out, dst, wn, allreduce,
                             rows, wcols)
            if allreduce:
                publish_peers(final_flag_ptrs, final_flags, G, me, t, epoch)
        else:
            stage_base = (call & 1) * cfg[C_STAGE_SLOTS] * tile_words
            s = red_slots[it]
            reduce_peers(part_ptrs, part, G, me, src, wn, stage,
                         stage_base + s * tile_words, bw, False, rows, wcols)
            publish(red_flags, s, epoch, False)           # read by this GPU's receive
            q = red_chunks[it]
            if q >= 0:
                chunk_arrive(chunk_count, chunk_ready, q,
                             (np.int64(call) * chunk_tiles[q]) & _MASK32, epoch)
        stamp(tr, trace, T_RED_DONE, it)

    @cuda.jit(device=True, inline=True)
    def reduce_role(cfg, tables, node, net, out, out_ptrs, queue, workers, ctx):
        """Intra-node reduce: for each tile this GPU owns, taken from the reduce queue, wait
        until every local GPU's partial is there, then :func:`reduce_work`."""
        tiles = tables[0].shape[0]
        while True:
            it = take(queue, Q_REDUCE, ctx[1], cfg[C_NRED], workers)
            if it >= cfg[C_NRED]:
                break
            if not reduce_wait(cfg, node, tables[1][it], tiles, ctx):
                return False
            reduce_work(cfg, tables, node, net, out, out_ptrs, it, ctx)
        return True

    @cuda.jit(device=True, inline=True)
    def send_role(cfg, cmds, chunk_ready, proxy, first, step, ctx):
        """Inter-node send (thread 0): for each of this block's commands (chunk, rail peer),
        wait until the chunk's tiles are all staged, then enqueue it to the proxy (payload
        stage -> the rail peer's recv, then its arrival flag)."""
        ring, head, tail = proxy
        epoch, call, deadline, err, rank, trace = ctx
        tr = cfg[C_TRACE] != 0
        stage_base = (call & 1) * cfg[C_STAGE_SLOTS] * tile_words
        recv_base = (call & 1) * cfg[C_RECV_SLOTS] * tile_words
        for j in range(prim.steps(first, cfg[C_NCMDS], step)):
            c = first + j * step
            q = cmds[c, 0]
            if not prim.wait_flag(chunk_ready, q, epoch, deadline, err, rank, ROLE_SEND, 100,
                                  False):
                return False
            stamp(tr, trace, T_SEND_READY, c)
            if not enqueue(ring, head, tail, cmds[c, 1], cfg[C_WIN_STAGE],
                           (stage_base + cmds[c, 2] * tile_words) * 8, cfg[C_WIN_RECV],
                           (recv_base + cmds[c, 4] * tile_words) * 8, cmds[c, 3] * tile_bytes,
                           q, cfg[C_WIN_ARRIVE], cmds[c, 5], epoch, deadline, err, rank):
                return False
            stamp(tr, trace, T_SEND_ENQUEUED, c)
        return True

    @cuda.jit(device=True, inline=True)
    def receive_role(cfg, tables, node, net, out, out_ptrs, first, step, ctx):
        """Inter-node receive: for each tile this GPU finishes, wait for its chunk from every
        rail peer and for this node's own sum, add them (fp32) into ``out``; AllReduce with
        G > 1: also into every local peer's partials (a shared output: its ``out``), then
        their final flags."""
        final_tiles, final_slots = tables
        part, part_ptrs, tile_flags, tile_flag_ptrs, final_flags, final_flag_ptrs = node
        stage, recv, arrive, red_flags = net
        epoch, call, deadline, err, rank, trace = ctx
        tr = cfg[C_TRACE] != 0
        m, wn, me, G = cfg[C_M], cfg[C_N] // 4, cfg[C_ME], cfg[C_G]
        part_base = (call & 1) * cfg[C_WORDS]
        stage_base = (call & 1) * cfg[C_STAGE_SLOTS] * tile_words
        recv_base = (call & 1) * cfg[C_RECV_SLOTS] * tile_words
        nsrc = cfg[C_NODES] - 1
        nfinal = cfg[C_NFINAL]
        bcast = cfg[C_ALLREDUCE] != 0 and G > 1
        for j in range(prim.steps(first, nfinal, step)):
            i = first + j * step
            for s in range(nsrc):
                if not wait(arrive, s * cfg[C_RECV_CHUNKS] + prim.udiv32(i, cfg[C_CHUNK]),
                            epoch, deadline, err, rank, ROLE_RECV):
                    return False
            stamp(tr, trace, T_RECV_ARRIVED, i)
            fs = final_slots[i]
            if not wait(red_flags, fs, epoch, deadline, err, rank, RECV_OWN_SUM, False):
                return False
            t = final_tiles[i]
            r0, c0 = origin(t, cfg[C_TILES_N])
            dst = (r0 - cfg[C_OUT_ROW0]) * wn + c0
            to_ptrs, to, to_off = push_target(cfg, out_ptrs, out, dst, part_ptrs, part,
                                              part_base + r0 * wn + c0)
            sum_local(stage, stage_base + fs * tile_words, recv, recv_base + i * tile_words,
                      nfinal * tile_words, nsrc, out, dst, wn, to_ptrs, to, G, me, to_off, wn,
                      bcast, min(bm, m - r0), min(bw, wn - c0), bw)
            if bcast:
                publish_peers(final_flag_ptrs, final_flags, G, me, t, epoch)
            stamp(tr, trace, T_RECV_DONE, i)
        return True

    @cuda.jit(device=True, inline=True)
    def pull_work(cfg, pull_tiles, part, out, out_ptrs, it, ctx):
        """One pull item whose final flag is set: copy the ``it``-th pulled tile to ``out``
        (the owner pushed the sum into this GPU's partials, or with ``C_DIRECT`` into its
        shared output); when ``out`` is that shared output (``C_OUT_SHARED``) nothing to
        copy."""
        epoch, call, deadline, err, rank, trace = ctx
        tr = cfg[C_TRACE] != 0
        stamp(tr, trace, T_PULL_READY, it)
        if cfg[C_OUT_SHARED] == 0:
            m, wn = cfg[C_M], cfg[C_N] // 4
            r0, c0 = origin(pull_tiles[it], cfg[C_TILES_N])
            src, src_off = part, (call & 1) * cfg[C_WORDS] + r0 * wn + c0
            if cfg[C_DIRECT] != 0:            # the owner wrote it into my shared output
                src, src_off = prim.peer_view(out_ptrs, cfg[C_ME], out), r0 * wn + c0
            copy_tile_2d(src, src_off, wn, out, r0 * wn + c0, wn, min(bm, m - r0),
                         min(bw, wn - c0))
        stamp(tr, trace, T_PULL_DONE, it)

    @cuda.jit(device=True, inline=True)
    def pull_role(cfg, pull_tiles, part, final_flags, out, out_ptrs, queue, workers, ctx):
        """AllReduce, G > 1: for each tile another local GPU owns, taken from the pull queue,
        wait for its final flag, then :func:`pull_work`, so that the call ends with its output
        complete."""
        epoch, call, deadline, err, rank, trace = ctx
        while True:
            it = take(queue, Q_PULL, call, cfg[C_NPULL], workers)
            if it >= cfg[C_NPULL]:
                break
            if not wait(final_flags, pull_tiles[it], epoch, deadline, err, rank, ROLE_INTRA):
                return False
            pull_work(cfg, pull_tiles, part, out, out_ptrs, it, ctx)
        return True

    @cuda.jit(device=True, inline=True)
    def static_tiles(smem, tmaps, a, b, order, cfg, blk, blocks, epoch, where, trace):
        """The static compute role: tiles ``order[blk::blocks]``, each stamped when traced."""
        tr = cfg[C_TRACE] != 0
        tile_init(smem, tmaps)
        cuda.syncthreads()
        seq = 0
        i = blk           # no range() with a run-time step, no 64-bit divide: see udiv32
        while i < order.shape[0]:
            stamp(tr, trace, T_TILE_START, i)
            compute_tile(smem, tmaps, a, b, order[i], cfg[C_TILES_N], seq, epoch, where)
            stamp(tr, trace, T_TILE_DONE, i)
            i += blocks
            seq += 1

    @cuda.jit(device=True, inline=True)
    def flex_compute(smem, tmaps, a, b, order, cfg, where, queue, ctl, flex, blk, seq, ctx):
        """Adaptive: take the next tile of the compute queue and compute it. (taken?, seq)."""
        epoch, call, deadline, err, rank, trace = ctx
        tr = cfg[C_TRACE] != 0
        i = take(queue, Q_COMPUTE, call, order.shape[0], flex)
        if i >= order.shape[0]:
            return False, seq
        start = prim.globaltimer()
        stamp(tr, trace, T_TILE_START, i)
        record(tr, trace, T_TILE_BLOCK, i, blk)
        compute_tile(smem, tmaps, a, b, order[i], cfg[C_TILES_N], seq, epoch, where)
        cuda.syncthreads()            # every thread's part of the tile, then its cost
        stamp(tr, trace, T_TILE_DONE, i)
        ctl_.account(ctl, ctl_.COMPUTE, start)
        return True, seq + 1

    @cuda.jit(device=True, inline=True)
    def flexible_pool(smem, tmaps, a, b, order, cfg, where, tables, node, net, out, out_ptrs,
                      pull_tiles, queue, ctl, blk, ctx):
        """Adaptive split (``roles.controller``): blocks [0, flex) take tiles from the compute
        queue and reduce (1 node, AllReduce: then pull) items from theirs, the role of each
        next item decided by the controller. A communication block whose item is not ready
        computes tiles meanwhile (polls, no wait) while any are left; then its waits are the
        bounded waits of the static roles. Every block draws every queue until it sees its
        end (``take`` counts each worker once past the end)."""
        epoch, call, deadline, err, rank, trace = ctx
        tr = cfg[C_TRACE] != 0
        flex = cfg[C_REDUCE_END]
        tiles = order.shape[0]
        nred, npull = cfg[C_NRED], cfg[C_NPULL]
        tile_init(smem, tmaps)
        cuda.syncthreads()
        role = ctl_.COMM if blk >= cfg[C_COMPUTE] else ctl_.COMPUTE
        ctl_.enter(ctl, role)
        seq, nlog = 0, 0
        comp_open, red_open = True, True
        pull_open = cfg[C_FLEX_PULL] != 0 and npull > 0
        held = 0                      # the item this block holds: 0 none, 1 reduce, 2 pull
        it = np.int64(0)
        ok = True
        while True:
            # one call site of the tile (flex_compute, below): the tile is inlined where it
            # is called, and each copy would repeat the whole GEMM tile in the kernel
            if held != 0:
                t = tables[1][it] if held == 1 else pull_tiles[it]
                ready = (reduce_ready(cfg, node, t, tiles, epoch) if held == 1 else
                         poll(node[4], t, epoch, True))
                if ready or not comp_open:    # else compute a tile meanwhile, below
                    if held == 1:
                        if not reduce_wait(cfg, node, t, tiles, ctx):
                            ok = False
                            break
                        start = prim.globaltimer()
                        reduce_work(cfg, tables, node, net, out, out_ptrs, it, ctx)
                    else:
                        if not wait(node[4], t, epoch, deadline, err, rank, ROLE_INTRA):
                            ok = False
                            break
                        start = prim.globaltimer()
                        pull_work(cfg, pull_tiles, node[0], out, out_ptrs, it, ctx)
                    cuda.syncthreads()
                    ctl_.account(ctl, ctl_.COMM, start)
                    held = 0
                    continue
            else:
                if not (comp_open or red_open or pull_open):
                    break
                left_p = ctl_.left(queue, Q_COMPUTE, call, tiles, flex)
                left_s = ctl_.left(queue, Q_REDUCE, call, nred, flex)
                if pull_open:
                    left_s += ctl_.left(queue, Q_PULL, call, npull, flex)
                new, want = ctl_.decide(ctl, role, comp_open, red_open or pull_open, left_p,
                                        left_s, flex, cfg[C_INIT_COMM])
                if new != role or nlog == 0:
                    nlog = ctl_.log(tr, trace, T_CTL_N, len(TRACE_EVENTS), blk, nlog, CTL_LOG,
                                    new, want)
                role = new
                if role == ctl_.COMM:
                    if red_open:
                        it = take(queue, Q_REDUCE, call, nred, flex)
                        if it >= nred:
                            red_open = False
                        else:
                            held = 1
                    else:
                        it = take(queue, Q_PULL, call, npull, flex)
                        if it >= npull:
                            pull_open = False
                        else:
                            held = 2
                    continue
            comp_open, seq = flex_compute(smem, tmaps, a, b, order, cfg, where, queue, ctl,
                                          flex, blk, seq, ctx)
        ctl_.leave(ctl, role)
        return ok

    # One copy of the GEMM tile per kernel (it is inlined where it is called: two copies
    # doubled ptxas's time and spilled registers), so each build keeps one way of handing out
    # tiles; the other is a stub its cfg never reaches (the op pairs cfg[C_ADAPTIVE] with it).
    @cuda.jit(device=True, inline=True)
    def no_tiles(smem, tmaps, a, b, order, cfg, blk, blocks, epoch, where, trace):
        pass

    @cuda.jit(device=True, inline=True)
    def no_pool(smem, tmaps, a, b, order, cfg, where, tables, node, net, out, out_ptrs,
                pull_tiles, queue, ctl, blk, ctx):
        return False

    compute_loop = no_tiles if adaptive else static_tiles
    flexible_role = flexible_pool if adaptive else no_pool

    @cuda.jit(**bounds)
    def gemm_reduce_kernel(
            a: Bits2D, b: Bits2D, tmaps: Words, part_c: Bits4D, part: Words, part_ptrs: Words,
            tile_flags: Flags, tile_flag_ptrs: Words, final_flags: Flags, final_flag_ptrs: Words,
            out: Words, out_ptrs: Words, out_c: Bits2D, cfg: Cfg,
            order: Ints, owner_of_row: Ints, red_tiles: Ints, red_slots: Ints, red_chunks: Ints,
            chunk_tiles: Ints, cmds: Cmds, final_tiles: Ints, final_slots: Ints,
            pull_tiles: Ints,
            stage: Words, recv: Words, arrive: Flags, red_flags: Flags, chunk_count: Flags,
            chunk_ready: Flags, ring: Flags, head: Flags, tail: Flags,
            frame: Words, timeout_ns: types.uint64, err: Record, rank: types.int64,
            trace: Trace, queue: Flags, ctl: Words):
        """a [m, k], b [n, k] (or [k, n] with a ":kn" tile build), part_c [2, P, m, n]: bf16
        bits (per slot, plane 0 this GPU's partials, planes 1..G-1 its inbox when
        delivering); part: the same memory as uint64
        words [2 * P * m * n/4] (symmetric); out: uint64 words of the bf16 output (out_ptrs:
        its address table when it is the op's shared output, cfg[C_DIRECT]; out_c: the same
        memory as bf16 bits [out rows, n], where a folding compute role writes); stage/recv:
        tile-major uint64 [2 * slots * bm * bn/4]; flags uint32; tables int32 (sched.reduce);
        ring/head/tail: the proxy's command ring (``roles.send``); frame: the op's call counter
        (``kernels.lifetime.Frame``); trace int64 [TRACE_EVENTS, items] (written only when
        cfg[C_TRACE]); queue uint32 [QUEUES]: the reduce, pull and (adaptive) compute work
        queues' ticket counters; ctl uint64 [roles.controller.CTL_WORDS]: the controller's
        measurements (adaptive, cfg[C_ADAPTIVE]: blocks [0, C_REDUCE_END) are flexible)."""
        smem = cuda.shared.array(0, dtype=_BYTE)
        epoch, call = begin(frame)
        if call == 0:
            return       # the op has ended on this rank: a graph replayed after it
        blk = cuda.blockIdx.x
        tr = cfg[C_TRACE] != 0
        join = cfg[C_JOIN] != 0
        n_compute = cfg[C_COMPUTE]
        reduce_end, send_end, recv_end = cfg[C_REDUCE_END], cfg[C_SEND_END], cfg[C_RECV_END]
        node = (part, part_ptrs, tile_flags, tile_flag_ptrs, final_flags, final_flag_ptrs)
        stamp(tr, trace, T_BLOCK_START, blk)
        deadline = prim.globaltimer() + timeout_ns           # bounds fold's inbox waits too
        where = (part_c, part_ptrs, owner_of_row, tile_flags, tile_flag_ptrs, order.shape[0],
                 cfg[C_ME], cfg[C_G], call & 1, cfg[C_DELIVER] != 0, cfg[C_FOLD] != 0, out_c,
                 cfg[C_OUT_ROW0], (deadline, err, rank))
        if cfg[C_ADAPTIVE] != 0 and blk < reduce_end:
            if flexible_role(smem, tmaps, a, b, order, cfg, where,
                             (order, red_tiles, red_slots, red_chunks, chunk_tiles), node,
                             (stage, red_flags, chunk_count, chunk_ready), out, out_ptrs,
                             pull_tiles, queue, ctl, blk,
                             (epoch, call, deadline, err, rank, trace)):
                stamp(tr, trace, T_BLOCK_END, blk)
            return
        if blk < n_compute:
            compute_loop(smem, tmaps, a, b, order, cfg, blk, n_compute, epoch, where, trace)
            stamp(tr, trace, T_COMPUTE_END, blk)
            if not join:
                stamp(tr, trace, T_BLOCK_END, blk)
                return
            cuda.syncthreads()        # then join the reduce (and pull) queues below
        ctx = (epoch, call, prim.globaltimer() + timeout_ns, err, rank, trace)
        # who draws from the work queues (each worker once past the end: roles.blocks.take
        # counts them): the role's own blocks, and with join the compute blocks (reduce queue)
        # and every compute and reduce block (pull queue)
        red_workers = reduce_end - (0 if join else n_compute)
        pulls = blk >= recv_end or (join and blk < reduce_end)
        pull_workers = cuda.gridDim.x - recv_end + (reduce_end if join else 0)
        ok = True
        if blk < reduce_end:
            ok = reduce_role(cfg, (order, red_tiles, red_slots, red_chunks, chunk_tiles),
                             node, (stage, red_flags, chunk_count, chunk_ready), out, out_ptrs,
                             queue, red_workers, ctx)
        elif blk < send_end:
            # one thread sends, so only its ok may turn False: send blocks never reach the
            # block-wide pull role below, where a split block would hang at a barrier
            if cuda.threadIdx.x == 0:
                ok = send_role(cfg, cmds, chunk_ready, (ring, head, tail), blk - reduce_end,
                               send_end - reduce_end, ctx)
        elif blk < recv_end:
            ok = receive_role(cfg, (final_tiles, final_slots), node,
                              (stage, recv, arrive, red_flags), out, out_ptrs, blk - send_end,
                              recv_end - send_end, ctx)
        if ok and pulls and cfg[C_NPULL] > 0:
            ok = pull_role(cfg, pull_tiles, part, final_flags, out, out_ptrs, queue,
                           pull_workers, ctx)
        if ok:
            stamp(tr, trace, T_BLOCK_END, blk)

    return gemm_reduce_kernel


_BUILDS = {adaptive: compute.KernelBuilds(
    lambda b, threads, adaptive=adaptive: make_kernel(b, threads, adaptive))
    for adaptive in (False, True)}


def build(kind, adaptive=False):
    """(roles.compute.TileBuild, threads per block, kernel) of a tile build name with the
    static or the adaptive split."""
    return _BUILDS[bool(adaptive)](kind)
