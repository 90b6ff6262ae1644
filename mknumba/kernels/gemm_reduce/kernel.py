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
from ...errors import ROLE_INTRA, ROLE_RECV, ROLE_SEND
from ...roles import compute
from ...roles.blocks import begin, publish, publish_peers, stamp, take, wait
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
              "npull", "words", "trace", "join", "deliver", "direct", "fold", "out_shared")
(C_M, C_N, C_TILES_N, C_ME, C_G, C_NODES, C_OUT_ROW0, C_COMPUTE, C_REDUCE_END, C_SEND_END,
 C_RECV_END, C_ALLREDUCE, C_STAGE_SLOTS, C_RECV_SLOTS, C_NFINAL, C_RECV_CHUNKS, C_CHUNK,
 C_NCMDS, C_WIN_STAGE, C_WIN_RECV, C_WIN_ARRIVE, C_NRED, C_NPULL, C_WORDS, C_TRACE,
 C_JOIN, C_DELIVER, C_DIRECT, C_FOLD, C_OUT_SHARED) = range(30)
Q_REDUCE, Q_PULL = 0, 1          # the work queues (roles.blocks.take)

# trace rows (``trace=True``): globaltimer stamps, one row per event, indexed by the role's item
(T_BLOCK_START, T_BLOCK_END, T_RED_READY, T_RED_DONE, T_SEND_READY, T_SEND_ENQUEUED,
 T_RECV_ARRIVED, T_RECV_DONE, T_PULL_DONE) = range(9)
TRACE_EVENTS = ("block_start", "block_end", "reduce_ready", "reduce_done", "send_ready",
                "send_enqueued", "recv_arrived", "recv_done", "pull_done")

_BYTE = np.dtype(np.uint8) if SIMULATOR else np.uint8
_MASK32 = 0xFFFFFFFF


def make_kernel(tile_init, tile, bm, bn, threads):
    """The persistent kernel around one tile build. Each role is a device function below; the
    kernel at the end hands blocks to them in block order."""
    compute_role = compute.make_compute_role(tile_init, tile, compute.TO_OWNER)
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
    def reduce_role(cfg, tables, node, net, out, out_ptrs, queue, workers, ctx):
        """Intra-node reduce: for each tile this GPU owns, taken from the reduce
        queue, wait until every local GPU's partial is there, sum them (fp32), and write the
        sum: 1 node, to ``out`` (AllReduce: also into every local peer's partials, or with a
        shared output and delivery straight into its ``out``, then their final flags); nodes >
        1, to a stage slot for the network, counting it into its chunk."""
        order, red_tiles, red_slots, red_chunks, chunk_tiles = tables
        part, part_ptrs, tile_flags, tile_flag_ptrs, final_flags, final_flag_ptrs = node
        stage, red_flags, chunk_count, chunk_ready = net
        epoch, call, deadline, err, rank, trace = ctx
        tr = cfg[C_TRACE] != 0
        m, wn, me, G = cfg[C_M], cfg[C_N] // 4, cfg[C_ME], cfg[C_G]
        nodes, allreduce, deliver = cfg[C_NODES], cfg[C_ALLREDUCE] != 0, cfg[C_DELIVER] != 0
        part_base = (call & 1) * cfg[C_WORDS]
        stage_base = (call & 1) * cfg[C_STAGE_SLOTS] * tile_words
        plane = m * wn                # words per plane of partials
        tiles = order.shape[0]
        while True:
            it = take(queue, Q_REDUCE, call, cfg[C_NRED], workers)
            if it >= cfg[C_NRED]:
                break
            t = red_tiles[it]
            r0, c0 = origin(t, cfg[C_TILES_N])
            rows = min(bm, m - r0)
            wcols = min(bw, wn - c0)
            src = part_base + r0 * wn + c0
            for j in range(G):
                if deliver:           # plane j of this GPU: its own tile, then its inbox
                    ok = wait(tile_flags, j * tiles + t, epoch, deadline, err, rank, ROLE_INTRA)
                else:                 # every local GPU's own tile, over NVLink
                    ok = wait(prim.peer_view(tile_flag_ptrs, prim.peer_after(me, 1 + j, G),
                                             tile_flags), t, epoch, deadline, err, rank,
                              ROLE_INTRA, G > 1)
                if not ok:
                    return False
            stamp(tr, trace, T_RED_READY, it)
            if nodes == 1:
                dst = (r0 - cfg[C_OUT_ROW0]) * wn + c0
                if deliver:           # all G partials are local: plane 0 + planes 1..G-1
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
                s = red_slots[it]
                reduce_peers(part_ptrs, part, G, me, src, wn, stage,
                             stage_base + s * tile_words, bw, False, rows, wcols)
                publish(red_flags, s, epoch, False)           # read by this GPU's receive
                q = red_chunks[it]
                if q >= 0:
                    chunk_arrive(chunk_count, chunk_ready, q,
                                 (np.int64(call) * chunk_tiles[q]) & _MASK32, epoch)
            stamp(tr, trace, T_RED_DONE, it)
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
            if not wait(red_flags, fs, epoch, deadline, err, rank, ROLE_RECV, False):
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
    def pull_role(cfg, pull_tiles, part, final_flags, out, out_ptrs, queue, workers, ctx):
        """AllReduce, G > 1: for each tile another local GPU owns, taken from the
        pull queue, wait for its final flag (the owner pushed the sum into this GPU's
        partials, or with ``C_DIRECT`` into its shared output), then copy it to ``out``
        (local); when ``out`` is that shared output (``C_OUT_SHARED``) only wait, so that the
        call ends with its output complete."""
        epoch, call, deadline, err, rank, trace = ctx
        tr = cfg[C_TRACE] != 0
        m, wn = cfg[C_M], cfg[C_N] // 4
        part_base = (call & 1) * cfg[C_WORDS]
        while True:
            it = take(queue, Q_PULL, call, cfg[C_NPULL], workers)
            if it >= cfg[C_NPULL]:
                break
            t = pull_tiles[it]
            if not wait(final_flags, t, epoch, deadline, err, rank, ROLE_INTRA):
                return False
            if cfg[C_OUT_SHARED] == 0:
                r0, c0 = origin(t, cfg[C_TILES_N])
                src, src_off = part, part_base + r0 * wn + c0
                if cfg[C_DIRECT] != 0:        # the owner wrote it into my shared output
                    src, src_off = prim.peer_view(out_ptrs, cfg[C_ME], out), r0 * wn + c0
                copy_tile_2d(src, src_off, wn, out, r0 * wn + c0, wn, min(bm, m - r0),
                             min(bw, wn - c0))
            stamp(tr, trace, T_PULL_DONE, it)
        return True

    @cuda.jit(**bounds)
    def gemm_reduce_kernel(
            a: Bits2D, bt: Bits2D, tmaps: Words, part_c: Bits4D, part: Words, part_ptrs: Words,
            tile_flags: Flags, tile_flag_ptrs: Words, final_flags: Flags, final_flag_ptrs: Words,
            out: Words, out_ptrs: Words, out_c: Bits2D, cfg: Cfg,
            order: Ints, owner_of_row: Ints, red_tiles: Ints, red_slots: Ints, red_chunks: Ints,
            chunk_tiles: Ints, cmds: Cmds, final_tiles: Ints, final_slots: Ints,
            pull_tiles: Ints,
            stage: Words, recv: Words, arrive: Flags, red_flags: Flags, chunk_count: Flags,
            chunk_ready: Flags, ring: Flags, head: Flags, tail: Flags,
            frame: Words, timeout_ns: types.uint64, err: Record, rank: types.int64,
            trace: Trace, queue: Flags):
        """a [m, k], bt [n, k], part_c [2, P, m, n]: bf16 bits (per slot, plane 0 this GPU's
        partials, planes 1..G-1 its inbox when delivering); part: the same memory as uint64
        words [2 * P * m * n/4] (symmetric); out: uint64 words of the bf16 output (out_ptrs:
        its address table when it is the op's shared output, cfg[C_DIRECT]; out_c: the same
        memory as bf16 bits [out rows, n], where a folding compute role writes); stage/recv:
        tile-major uint64 [2 * slots * bm * bn/4]; flags uint32; tables int32 (sched.reduce);
        ring/head/tail: the proxy's command ring (``roles.send``); frame: the op's call counter
        (``kernels.launch.Frame``); trace int64 [TRACE_EVENTS, items] (written only when
        cfg[C_TRACE]); queue uint32 [2]: the reduce and pull work queues' ticket counters."""
        smem = cuda.shared.array(0, dtype=_BYTE)
        epoch, call = begin(frame)
        blk = cuda.blockIdx.x
        tr = cfg[C_TRACE] != 0
        join = cfg[C_JOIN] != 0
        n_compute = cfg[C_COMPUTE]
        reduce_end, send_end, recv_end = cfg[C_REDUCE_END], cfg[C_SEND_END], cfg[C_RECV_END]
        node = (part, part_ptrs, tile_flags, tile_flag_ptrs, final_flags, final_flag_ptrs)
        stamp(tr, trace, T_BLOCK_START, blk)
        if blk < n_compute:
            deadline = prim.globaltimer() + timeout_ns       # bounds fold's inbox waits
            compute_role(smem, tmaps, a, bt, order, cfg[C_TILES_N], blk, n_compute, epoch,
                         (part_c, part_ptrs, owner_of_row, tile_flags, tile_flag_ptrs,
                          order.shape[0], cfg[C_ME], cfg[C_G], call & 1, cfg[C_DELIVER] != 0,
                          cfg[C_FOLD] != 0, out_c, cfg[C_OUT_ROW0], (deadline, err, rank)))
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


#: build(tile build name) -> (roles.compute.TileBuild, threads per block, kernel)
build = compute.KernelBuilds(make_kernel)
