"""The AllGather + GEMM kernel: its roles, each a device function, and the kernel that hands
blocks to them in block order (the role table is in :mod:`mknumba.kernels.allgather_gemm`).

Every role takes ``ctx = (epoch, call, deadline, err, rank)`` and returns False when one of
its waits timed out (the error record says which), so the block can end. With cfg[C_TRACE]
(``trace=True``) each role stamps its items into ``trace`` (rows ``TRACE_EVENTS``,
``roles.blocks.stamp``); off, a stamp is one branch. A shard's rows move as
``uint64`` words (4 bf16, ``roles.reduce.copy_tile_2d``); a part of a shard is ``rows`` whole
rows of ``k / 4`` words, contiguous in every buffer.
"""
import numpy as np
from numba import cuda, types

from ... import _compat  # noqa: F401  (numpy alias before numba compiles)
from ... import primitives as prim
from ..._compat import SIMULATOR
from ...errors import ROLE_COMPUTE, ROLE_INTRA, ROLE_RECV
from ...roles import compute
from ...roles import controller as ctl_
from ...roles.blocks import launch_context, publish, record, stamp, wait
from ...roles.reduce import copy_tile_2d
from ...roles.send import enqueue_rail
from ..launch import array_type

Bits2D, Bits3D = array_type(np.uint16, 2), array_type(np.uint16, 3)
Words, Flags, Ints = array_type(np.uint64, 1), array_type(np.uint32, 1), array_type(np.int32, 1)
Cfg, Record, Trace = array_type(np.int64, 1), array_type(np.int64, 1), array_type(np.int64, 2)

#: cfg: the small integers of a launch, one int64 array, by name (``launch.pack``). me: world
#: rank, local: rank in the node of g GPUs; shard: rows per rank (m / world); rows: rows per
#: part of a shard (its last part may be shorter), parts: parts per shard; *_end: the roles'
#: block ranges (compute and collect after forward, in either order); win_*: the proxy's
#: windows; collect: this call fills the caller's gathered A; trace: stamp the roles' items.
#: The adaptive build (``comm_sms="adaptive"``) reads nstage / ncomm: its communication items
#: (parts to store here, then parts to push), init_comm: its blocks that start in the
#: communication role.
CFG_FIELDS = ("m", "n", "k", "shard", "rows", "parts", "me", "local", "g", "nodes", "world",
              "tiles_n", "send_end", "forward_end", "compute_start", "compute_end",
              "collect_start", "collect_end", "win_gathered", "win_flags", "collect", "trace",
              "nstage", "ncomm", "init_comm")
(C_M, C_N, C_K, C_SHARD, C_ROWS, C_PARTS, C_ME, C_LOCAL, C_G, C_NODES, C_WORLD, C_TILES_N,
 C_SEND_END, C_FORWARD_END, C_COMPUTE_START, C_COMPUTE_END, C_COLLECT_START, C_COLLECT_END,
 C_WIN_GATHERED, C_WIN_FLAGS, C_COLLECT, C_TRACE, C_NSTAGE, C_NCOMM,
 C_INIT_COMM) = range(len(CFG_FIELDS))
# the adaptive build's work queues (roles.blocks.take)
Q_COMPUTE, Q_COMM, QUEUES = ctl_.Q_COMPUTE, ctl_.Q_COMM, ctl_.QUEUES
POOL_STATE = ctl_.STATE              # (a global: numba sizes local arrays by constants)

# trace rows (``trace=True``): globaltimer stamps, one row per event, indexed by block
# (block_*), by part of this rank's shard (send_*: stored in this GPU's gathered A, flag
# published, between nodes handed to the proxy; push_*: stored into every other GPU of the
# node), by rail peer and part (forward_*: i * parts + p), by collect item and by position
# in the tile order (tile_*); the adaptive build adds which block did a tile, a part stored
# here and a part pushed (*_block) and its controller's decision log (roles.controller.log)
(T_BLOCK_START, T_BLOCK_END, T_SEND_START, T_SEND_STAGED, T_PUSH_START, T_PUSH_DONE,
 T_FORWARD_READY, T_FORWARD_DONE, T_COLLECT_READY, T_COLLECT_DONE, T_TILE_START,
 T_TILE_DONE, T_TILE_BLOCK, T_SEND_BLOCK, T_PUSH_BLOCK, T_CTL_N) = range(16)
TRACE_EVENTS = ("block_start", "block_end", "send_start", "send_staged", "push_start",
                "push_done", "forward_ready", "forward_done", "collect_ready", "collect_done",
                "tile_start", "tile_done", "tile_block", "send_block", "push_block", "ctl_n")
TRACE_ROWS = len(TRACE_EVENTS) + 2 * ctl_.CTL_LOG

_BYTE = np.dtype(np.uint8) if SIMULATOR else np.uint8


@cuda.jit(device=True, inline=True)
def part_rows(cfg, p):
    """(first row within the shard, rows) of part ``p`` of a shard."""
    r0 = p * cfg[C_ROWS]
    return r0, min(cfg[C_ROWS], cfg[C_SHARD] - r0)


def make_kernel(build, threads, adaptive=False):
    """The persistent kernel around one tile build (``roles.compute.TileBuild``), with the
    static split or (``adaptive``) the controller's. Each role is a device function below; the
    kernel at the end hands blocks to them in block order."""
    bm = build.shape[0]
    bounds = {} if SIMULATOR else {"launch_bounds": (threads, 1)}

    @cuda.jit(device=True, inline=True)
    def into_out(where, t, tm):
        """Every tile into the caller's ``out`` [m, n], announced by ``tile_flags[t]`` (GPU
        scope: no other GPU reads it); nothing to fold in (``addend``: any [P, m, n] array,
        the tile's unread argument)."""
        out, tile_flags, addend = where[0], where[1], where[2]
        return out, 0, addend, 0, tile_flags, t, False

    @cuda.jit(device=True, inline=True)
    def rows_ready(where, t, adds, epoch):
        """Wait (this thread) until every part of a shard that tile ``t`` reads rows of has
        arrived in this GPU's gathered A: its flag holds the epoch (acquire, system scope:
        peers, the proxy and this GPU's send role write them). A ragged tile row may span two
        shards. Then a proxy fence, so that the sm_90a tile's TMA loads (the async proxy) see
        what the acquire saw. Polls back off to 1 us: every warp of every compute block may
        be polling at the start of a call, while the flags' and rows' NVLink stores land."""
        flags, tiles_n, m, shard, rows, parts = where[3:9]
        deadline, err, rank = where[9]
        r = prim.udiv32(t, tiles_n) * bm
        end = min(m, r + bm)
        while r < end:
            src = prim.udiv32(r, shard)
            p = prim.udiv32(r - src * shard, rows)
            if not prim.wait_flag(flags, src * parts + p, epoch, deadline, err, rank,
                                  ROLE_COMPUTE, 1000):
                return False
            r = src * shard + min((p + 1) * rows, shard)
        prim.fence_proxy_async()
        return True

    compute_role = compute.make_compute_role(build, (into_out, rows_ready),
                                             stamps=(T_TILE_START, T_TILE_DONE))

    @cuda.jit(device=True, inline=True)
    def send_role(cfg, a, gathered, gathered_ptrs, flags, flag_ptrs, rail, proxy, first, step,
                  ctx, trace):
        """This rank's shard, part by part (parts ``first, first + step, ...``): into this
        GPU's gathered A, its flag published here; then, between nodes, one command per rail
        peer to the proxy (the slowest link starts first); then into every other GPU of the
        node (NVLink stores, the next GPU first), its flag published there."""
        epoch, call, deadline, err, rank = ctx
        tr = cfg[C_TRACE] != 0
        kw = cfg[C_K] // 4
        me, parts = cfg[C_ME], cfg[C_PARTS]
        row0 = (call & 1) * cfg[C_M] + me * cfg[C_SHARD]     # my rows in this call's slot
        for jp in range(prim.steps(first, parts, step)):
            p = first + jp * step
            stamp(tr, trace, T_SEND_START, p)
            r0, rows = part_rows(cfg, p)
            at = (row0 + r0) * kw
            copy_tile_2d(a, r0 * kw, kw, gathered, at, kw, rows, kw)
            publish(flags, me * parts + p, epoch)     # system fence: also for the proxy's copy
            if cfg[C_NODES] > 1 and not enqueue_rail(
                    proxy, rail, cfg[C_WIN_GATHERED], at * 8, rows * kw * 8, p,
                    cfg[C_WIN_FLAGS], me * parts + p, epoch, deadline, err, rank):
                return False                  # the whole block, together
            stamp(tr, trace, T_SEND_STAGED, p)
        g, local = cfg[C_G], cfg[C_LOCAL]
        for jp in range(prim.steps(first, parts, step)):
            p = first + jp * step
            stamp(tr, trace, T_PUSH_START, p)
            r0, rows = part_rows(cfg, p)
            for j in range(1, g):
                q = prim.peer_after(local, j, g)
                copy_tile_2d(a, r0 * kw, kw, prim.peer_view(gathered_ptrs, q, gathered),
                             (row0 + r0) * kw, kw, rows, kw)
                publish(prim.peer_view(flag_ptrs, q, flags), me * parts + p, epoch)
            stamp(tr, trace, T_PUSH_DONE, p)
        return True

    @cuda.jit(device=True, inline=True)
    def forward_role(cfg, gathered, gathered_ptrs, flags, flag_ptrs, rail, first, step, ctx,
                     trace):
        """Between nodes, G > 1: each part of each rail peer's shard, once the proxy has set
        its flag here, into every other GPU of the node (NVLink stores), its flag published
        there. Waits only on the proxy (whose commands the send roles enqueue without waiting
        on anything but ring credits), so no forward waits on a forward."""
        epoch, call, deadline, err, rank = ctx
        tr = cfg[C_TRACE] != 0
        kw = cfg[C_K] // 4
        parts, g, local = cfg[C_PARTS], cfg[C_G], cfg[C_LOCAL]
        for i in range(rail.shape[0]):
            src = rail[i]
            row0 = (call & 1) * cfg[C_M] + src * cfg[C_SHARD]
            for jp in range(prim.steps(first, parts, step)):
                p = first + jp * step
                if not wait(flags, src * parts + p, epoch, deadline, err, rank, ROLE_RECV):
                    return False
                stamp(tr, trace, T_FORWARD_READY, i * parts + p)
                r0, rows = part_rows(cfg, p)
                at = (row0 + r0) * kw
                for j in range(1, g):
                    q = prim.peer_after(local, j, g)
                    copy_tile_2d(gathered, at, kw, prim.peer_view(gathered_ptrs, q, gathered),
                                 at, kw, rows, kw)
                    publish(prim.peer_view(flag_ptrs, q, flags), src * parts + p, epoch)
                stamp(tr, trace, T_FORWARD_DONE, i * parts + p)
        return True

    @cuda.jit(device=True, inline=True)
    def collect_role(cfg, gathered, flags, shards, gathered_out, first, step, ctx, trace):
        """The caller's gathered A (``gathered=``): every part of every shard, in arrival
        order, copied out of this GPU's gathered A once its flag holds the epoch (local
        loads and stores). Waits on the send and forward roles, which never wait on it."""
        epoch, call, deadline, err, rank = ctx
        tr = cfg[C_TRACE] != 0
        kw = cfg[C_K] // 4
        parts, shard = cfg[C_PARTS], cfg[C_SHARD]
        slot = (call & 1) * cfg[C_M]
        for j in range(prim.steps(first, cfg[C_WORLD] * parts, step)):
            it = first + j * step
            i = prim.udiv32(it, parts)
            p = it - i * parts
            src = shards[i]
            if not wait(flags, src * parts + p, epoch, deadline, err, rank, ROLE_INTRA):
                return False
            stamp(tr, trace, T_COLLECT_READY, it)
            r0, rows = part_rows(cfg, p)
            at = (src * shard + r0) * kw
            copy_tile_2d(gathered, slot * kw + at, kw, gathered_out, at, kw, rows, kw)
            stamp(tr, trace, T_COLLECT_DONE, it)
        return True


    # ---- the adaptive split (roles.controller) -------------------------------------------------
    # Flexible blocks take tiles from the compute queue and parts of this rank's shard from the
    # communication queue: on one node each part first stored here (nstage items), then each
    # part pushed into every other GPU of the node; between nodes the fixed send blocks store
    # and hand the parts to the proxy, and the pool pushes. No communication item waits (a part
    # comes from ``a``), so a block that holds a tile whose rows have not arrived does one
    # instead, while any are left; then the tile's per-thread waits are the bounded ones of the
    # static role. One call site of the tile (it is inlined where it is called).
    compute_tile = compute.make_compute_tile(build, (into_out, rows_ready))
    tile_init = build.init

    @cuda.jit(device=True, inline=True)
    def rows_arrived(args, i):
        """One thread, no wait: whether every part of a shard that the tile at position ``i``
        of the order reads rows of has arrived (:func:`rows_ready`'s flags). args: (where,
        order, epoch)."""
        where, order, epoch = args
        flags, tiles_n, m, shard, rows, parts = where[3:9]
        r = prim.udiv32(order[i], tiles_n) * bm
        end = min(m, r + bm)
        while r < end:
            src = prim.udiv32(r, shard)
            p = prim.udiv32(r - src * shard, rows)
            if not prim.epoch_reached(prim.acquire(flags, src * parts + p, True), epoch):
                return False
            r = src * shard + min((p + 1) * rows, shard)
        return True

    pool_start, _, next_block, pool_stop = ctl_.make_dispatch(rows_arrived)

    @cuda.jit(device=True, inline=True)
    def part_into(cfg, a, p, dst, dst_flags, row0, epoch):
        """Part ``p`` of this rank's shard into ``dst`` (a gathered A: this GPU's or a peer's
        view, this call's rows from ``row0``), then its flag in ``dst_flags`` (system scope:
        peers and the proxy read them)."""
        kw = cfg[C_K] // 4
        r0, rows = part_rows(cfg, p)
        copy_tile_2d(a, r0 * kw, kw, dst, (row0 + r0) * kw, kw, rows, kw)
        publish(dst_flags, cfg[C_ME] * cfg[C_PARTS] + p, epoch)

    @cuda.jit(device=True, inline=True)
    def stage_only(cfg, a, gathered, flags, rail, proxy, first, step, ctx, trace):
        """Between nodes, the fixed send blocks of the adaptive split: parts ``first, first +
        step, ...`` of this rank's shard stored here (:func:`part_into`), each then handed to
        the proxy, one command per rail peer; the pushes inside the node are the pool's."""
        epoch, call, deadline, err, rank = ctx
        tr = cfg[C_TRACE] != 0
        kw = cfg[C_K] // 4
        row0 = (call & 1) * cfg[C_M] + cfg[C_ME] * cfg[C_SHARD]
        for jp in range(prim.steps(first, cfg[C_PARTS], step)):
            p = first + jp * step
            stamp(tr, trace, T_SEND_START, p)
            part_into(cfg, a, p, gathered, flags, row0, epoch)
            r0, rows = part_rows(cfg, p)
            if not enqueue_rail(proxy, rail, cfg[C_WIN_GATHERED], (row0 + r0) * kw * 8,
                                rows * kw * 8, p, cfg[C_WIN_FLAGS],
                                cfg[C_ME] * cfg[C_PARTS] + p, epoch, deadline, err, rank):
                return False
            stamp(tr, trace, T_SEND_STAGED, p)
        return True

    @cuda.jit(device=True, inline=True)
    def comm_item(cfg, shard_io, it, blk, ctx, trace):
        """Communication item ``it``: below nstage, part ``it`` stored in this GPU's gathered
        A; else part ``it - nstage`` pushed into every other GPU of the node (the next GPU
        first). shard_io: (a, gathered, gathered_ptrs, flags, flag_ptrs)."""
        a, gathered, gathered_ptrs, flags, flag_ptrs = shard_io
        epoch, call = ctx[0], ctx[1]
        tr = cfg[C_TRACE] != 0
        row0 = (call & 1) * cfg[C_M] + cfg[C_ME] * cfg[C_SHARD]     # my rows in this slot
        nstage = cfg[C_NSTAGE]
        if it < nstage:
            stamp(tr, trace, T_SEND_START, it)
            record(tr, trace, T_SEND_BLOCK, it, blk)
            part_into(cfg, a, it, gathered, flags, row0, epoch)
            stamp(tr, trace, T_SEND_STAGED, it)
        else:
            p = it - nstage
            stamp(tr, trace, T_PUSH_START, p)
            record(tr, trace, T_PUSH_BLOCK, p, blk)
            g, local = cfg[C_G], cfg[C_LOCAL]
            for j in range(1, g):
                q = prim.peer_after(local, j, g)
                part_into(cfg, a, p, prim.peer_view(gathered_ptrs, q, gathered),
                          prim.peer_view(flag_ptrs, q, flags), row0, epoch)
            stamp(tr, trace, T_PUSH_DONE, p)

    @cuda.jit(device=True, inline=True)
    def flexible_pool(smem, tmaps, a_slot, b, order, cfg, where, shard_io, queue, ctl, blk,
                      ctx, trace):
        """Blocks [compute_start, compute_end): each next item from the controller's
        dispatch (``roles.controller.make_dispatch``): a tile whose rows are not there yet
        waits behind communication items while any are left."""
        epoch, call = ctx[0], ctx[1]
        tr = cfg[C_TRACE] != 0
        first = cfg[C_COMPUTE_START]
        flex = cfg[C_COMPUTE_END] - first
        tiles_n = cfg[C_TILES_N]
        tile_init(smem, tmaps)
        cuda.syncthreads()
        st = cuda.local.array(POOL_STATE, np.int64)
        if cuda.threadIdx.x == 0:
            pool_start(st, ctl, ctl_.COMM if blk - first < cfg[C_INIT_COMM] else ctl_.COMPUTE,
                       cfg[C_NCOMM])
        seq = 0
        while True:
            kind, it = next_block(st, ctl, queue, call, (order.shape[0], cfg[C_NCOMM]), flex,
                                  cfg[C_INIT_COMM],
                                  (tr, trace, T_CTL_N, len(TRACE_EVENTS), blk),
                                  (where, order, epoch))
            if kind == ctl_.END:
                break
            start = prim.globaltimer()
            if kind == ctl_.COMM:
                comm_item(cfg, shard_io, it, blk, ctx, trace)
            else:
                stamp(tr, trace, T_TILE_START, it)
                record(tr, trace, T_TILE_BLOCK, it, blk)
                compute_tile(smem, tmaps, a_slot, b, order[it], tiles_n, seq, epoch, where)
                seq += 1
            cuda.syncthreads()            # every thread's part of the item, then its cost
            if kind == ctl_.COMPUTE:
                stamp(tr, trace, T_TILE_DONE, it)
            ctl_.account(ctl, kind, start)
        if cuda.threadIdx.x == 0:
            pool_stop(st, ctl)

    @cuda.jit(**bounds)
    def allgather_gemm_kernel(
            a: Words, b: Bits2D, tmaps: Words, tmaps_odd: Words, gathered: Bits3D,
            gathered_words: Words, gathered_ptrs: Words, flags: Flags, flag_ptrs: Words,
            out: Bits2D, gathered_out: Words, tile_flags: Flags, cfg: Cfg, order: Ints,
            shards: Ints, rail: Ints, ring: Flags, head: Flags, tail: Flags, frame: Words,
            timeout_ns: types.uint64, err: Record, rank: types.int64, trace: Trace,
            queue: Flags, ctl: Words):
        """a: this rank's shard [m / world, k] bf16 as uint64 words; b [n, k] bf16 bits ([k, n]
        with a ":kn" tile build); tmaps / tmaps_odd: the tensor maps of A (this GPU's gathered
        A, slot 0 / 1) and b (sm_90a; one zero row for the SIMT tile); gathered [2, m, k]
        bf16 bits: the symmetric gathered A, one slot per call parity (gathered_words: the
        same memory as uint64 words, gathered_ptrs its address table); flags uint32 [world *
        parts] (symmetric, flag_ptrs its address table): part p of world rank r's shard is here
        at flags[r * parts + p]; out [m, n] bf16 bits; gathered_out: the caller's [m, k] as
        words (read only when cfg[C_COLLECT]); tile_flags uint32 [tiles]; order int32 [tiles]
        (``sched.tiles.gather_order``); shards int32 [world]: world ranks in arrival order;
        rail int32: the rail peers' world ranks; ring/head/tail: the proxy's command ring;
        frame: the op's call counter (``kernels.lifetime.Frame``); err: the error record;
        trace int64 [TRACE_EVENTS, items] (written only when cfg[C_TRACE]); the adaptive
        build's queue uint32 [QUEUES] (the compute and communication queues' ticket counters)
        and ctl uint64 [roles.controller.CTL_WORDS] (its measurements).

        Blocks in order: send [0, send_end), forward [send_end, forward_end), then compute
        and collect, each in its cfg range: static collect, compute; adaptive the flexible
        compute blocks, then collect (last: it waits on their stores, and the simulator runs
        blocks in order), and send only between nodes (store each part here and hand it to
        the proxy: the pool stores and pushes inside the node). ``adaptive`` is a constant of
        the kernel: numba compiles only its build's branches (the static build never reads
        queue or ctl)."""
        smem = cuda.shared.array(0, dtype=_BYTE)
        ctx = launch_context(frame, timeout_ns, err, rank)
        epoch, call, deadline = ctx[0], ctx[1], ctx[2]
        if call == 0:
            return       # the op has ended on this rank: a graph replayed after it
        blk = cuda.blockIdx.x
        tr = cfg[C_TRACE] != 0
        stamp(tr, trace, T_BLOCK_START, blk)
        send_end, forward_end = cfg[C_SEND_END], cfg[C_FORWARD_END]
        compute_start, compute_end = cfg[C_COMPUTE_START], cfg[C_COMPUTE_END]
        ok = True
        if blk < send_end:                                            # ---- send
            if adaptive:
                ok = stage_only(cfg, a, gathered_words, flags, rail, (ring, head, tail), blk,
                                send_end, ctx, trace)
            else:
                ok = send_role(cfg, a, gathered_words, gathered_ptrs, flags, flag_ptrs, rail,
                               (ring, head, tail), blk, send_end, ctx, trace)
        elif blk < forward_end:                                       # ---- forward
            ok = forward_role(cfg, gathered_words, gathered_ptrs, flags, flag_ptrs, rail,
                              blk - send_end, forward_end - send_end, ctx, trace)
        elif compute_start <= blk < compute_end:                      # ---- compute
            slot = call & 1
            tiles_n = cfg[C_TILES_N]
            where = (out, tile_flags, gathered, flags, tiles_n, cfg[C_M], cfg[C_SHARD],
                     cfg[C_ROWS], cfg[C_PARTS], (deadline, err, rank))
            if adaptive:
                flexible_pool(smem, tmaps_odd if slot else tmaps, gathered[slot], b, order,
                              cfg, where, (a, gathered_words, gathered_ptrs, flags, flag_ptrs),
                              queue, ctl, blk, ctx, trace)
            else:
                compute_role(smem, tmaps_odd if slot else tmaps, gathered[slot], b, order,
                             tiles_n, blk - compute_start, compute_end - compute_start, epoch,
                             where, tr, trace)
        elif cfg[C_COLLECT] != 0:                                     # ---- collect
            collect_start = cfg[C_COLLECT_START]
            ok = collect_role(cfg, gathered_words, flags, shards, gathered_out,
                              blk - collect_start, cfg[C_COLLECT_END] - collect_start, ctx,
                              trace)
        if ok:                        # a timed-out role's block has no end stamp
            stamp(tr, trace, T_BLOCK_END, blk)

    return allgather_gemm_kernel


#: (roles.compute.TileBuild, threads per block, kernel) of a tile build name, either split
_BUILDS = {False: compute.KernelBuilds(make_kernel),
           True: compute.KernelBuilds(lambda b, threads: make_kernel(b, threads, True))}


def build(kind, adaptive=False):
    """(roles.compute.TileBuild, threads per block, kernel) of a tile build name with the
    static or the adaptive split."""
    return _BUILDS[bool(adaptive)](kind)
