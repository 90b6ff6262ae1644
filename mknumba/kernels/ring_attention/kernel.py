"""Ring Attention's kernel: the send, forward and compute roles (see the package docstring),
and the kernel that hands blocks to them by index."""
import math

import numpy as np
from numba import cuda, types

from ... import primitives as prim
from ...errors import ROLE_BITS, ROLE_COMPUTE, ROLE_RECV
from ...roles.attention import (HEAD_DIM_MAX, LOG2E, RUN_BYTES, SM90_BUILDS, SM90_CONSUMERS,
                                SM90_ROWS, SM90_THREADS, attend_slice, load_row, sm90_functions,
                                store_row)
from ...roles import controller as ctl_
from ...roles.blocks import begin, copy_by, copy_tile, publish, record, stamp, wait
from ...roles.send import enqueue
from ...sched.sequence import position
from ..launch import array_type

Bits4D, Bits7D = array_type(np.uint16, 4), array_type(np.uint16, 7)
F32x3, Words, Flags = array_type(np.float32, 3), array_type(np.uint64, 1), array_type(np.uint32, 1)
Cfg, Record, Ints = array_type(np.int64, 1), array_type(np.int64, 1), array_type(np.int32, 1)

Trace = array_type(np.int64, 2)

#: the launch's small integers (``launch.pack``): me is the world rank, local the rank in the
#: node of g GPUs, words the uint64 words of one rank's K (and of its V), pool the first
#: compute block (send and forward blocks before it). The adaptive build
#: (``comm_sms="adaptive"``) reads ncomm (its communication items: the parts of this rank's
#: slice pushed to the node's other GPUs), init_comm (flexible blocks that start in the
#: communication role) and trace (stamp the items).
CFG_FIELDS = ("batch", "seq", "heads", "kv_heads", "d", "me", "world", "parts", "causal",
              "zigzag", "local", "g", "nodes", "words", "win_kv", "win_arrive", "pool", "ncomm",
              "init_comm", "trace")
(C_BATCH, C_SEQ, C_HEADS, C_KV_HEADS, C_D, C_ME, C_WORLD, C_PARTS, C_CAUSAL, C_ZIGZAG,
 C_LOCAL, C_G, C_NODES, C_WORDS, C_WIN_KV, C_WIN_ARRIVE, C_POOL, C_NCOMM, C_INIT_COMM,
 C_TRACE) = range(len(CFG_FIELDS))

# the adaptive build's trace rows (``trace=True``): globaltimer stamps by block (block_*), by
# part of this rank's slice (send_*: between nodes stored in this GPU's slot and handed to
# the proxy; push_*: pushed to the node's other GPUs, push_block the block that did it), by
# query tile in the queue's order (tile_*, tile_block); then the controller's decision log
# (roles.controller.log)
(T_BLOCK_START, T_BLOCK_END, T_SEND_START, T_SEND_STAGED, T_PUSH_START, T_PUSH_DONE,
 T_PUSH_BLOCK, T_TILE_START, T_TILE_DONE, T_TILE_BLOCK, T_CTL_N) = range(11)
TRACE_EVENTS = ("block_start", "block_end", "send_start", "send_staged", "push_start",
                "push_done", "push_block", "tile_start", "tile_done", "tile_block", "ctl_n")
TRACE_ROWS = len(TRACE_EVENTS) + 2 * ctl_.CTL_LOG
# the named barrier of the sm_90a tile's consumer warpgroups in the adaptive build (the tile's
# own ping-pong turns take 1 and 2)
BAR_CONSUMERS = 3
POOL_STATE = ctl_.STATE              # (a global: numba sizes local arrays by constants)


@cuda.jit(device=True, inline=True)
def part_words(cfg, part, slot, src):
    """Part ``part`` of a slice, in uint64 words: (its first word in K (and in V), its words,
    the first word of slice ``src`` in slot ``slot`` of a GPU's slots, the words of K)."""
    n, parts = cfg[C_WORDS], cfg[C_PARTS]
    chunk = prim.udiv32(n + parts - 1, parts)
    off = part * chunk
    return off, max(0, min(chunk, n - off)), (slot * cfg[C_WORLD] + src) * 2 * n, n


@cuda.jit(device=True)
def push_part(k_src, k_off, v_src, v_off, kv_ptrs, kv_words, part, cfg, flags, flag_ptrs, slot,
              src, epoch):
    """Part ``part`` of slice ``src`` (its K words at ``k_src[k_off:]``, its V at
    ``v_src[v_off:]``) -> every other GPU of the node, into its slot ``src``; then publish
    that GPU's flags[src, part]. Block-wide (:func:`push_part_by` for a group of warps)."""
    off, cnt, base, n = part_words(cfg, part, slot, src)
    g, local = cfg[C_G], cfg[C_LOCAL]
    for j in range(1, g):
        p = prim.peer_after(local, j, g)
        to = prim.peer_view(kv_ptrs, p, kv_words)
        copy_tile(k_src, k_off + off, to, base + off, cnt)
        copy_tile(v_src, v_off + off, to, base + n + off, cnt)
        publish(prim.peer_view(flag_ptrs, p, flags), src * cfg[C_PARTS] + part, epoch)


@cuda.jit(device=True, inline=True)
def push_part_by(k_src, k_off, v_src, v_off, kv_ptrs, kv_words, part, cfg, flags, flag_ptrs,
                 slot, src, epoch, tid, threads):
    """:func:`push_part` by the sm_90a tile's consumer warpgroups (``threads`` threads, this
    one ``tid``), which meet at their own named barrier before their thread 0 publishes."""
    off, cnt, base, n = part_words(cfg, part, slot, src)
    g, local = cfg[C_G], cfg[C_LOCAL]
    for j in range(1, g):
        p = prim.peer_after(local, j, g)
        to = prim.peer_view(kv_ptrs, p, kv_words)
        copy_by(k_src, k_off + off, to, base + off, cnt, tid, threads)
        copy_by(v_src, v_off + off, to, base + n + off, cnt, tid, threads)
        prim.bar_sync(BAR_CONSUMERS, threads)
        if tid == 0:
            prim.release(prim.peer_view(flag_ptrs, p, flags), src * cfg[C_PARTS] + part, epoch,
                         True)


@cuda.jit(device=True, inline=True)
def stage_part(p, k_words, v_words, kv_words, rail, ring, head, tail, cfg, slot, epoch,
               deadline, err, rank, me, world, parts, n):
    """Between nodes: part ``p`` of this rank's K and V -> this GPU's own slot, then one
    command per rail peer to the proxy (the peer's arrive[me, k|v, p] set there). False (the
    whole block) when a command could not be queued (recorded). me, world, parts, n: cfg's
    (the caller's, already loaded)."""
    chunk = prim.udiv32(n + parts - 1, parts)
    off = p * chunk
    cnt = max(0, min(chunk, n - off))
    own = (slot * world + me) * 2 * n
    copy_tile(k_words, off, kv_words, own + off, cnt)
    copy_tile(v_words, off, kv_words, own + n + off, cnt)
    sent = cuda.shared.array(1, np.int32)
    cuda.syncthreads()
    if cuda.threadIdx.x == 0:
        prim.fence_sys()          # the copies, before the proxy reads them
        sent[0] = 1
        for i in range(rail.shape[0]):
            for hv in range(2):
                at = (own + hv * n + off) * 8
                if sent[0] and not enqueue(
                        ring, head, tail, rail[i], cfg[C_WIN_KV], at,
                        cfg[C_WIN_KV], at, cnt * 8, p, cfg[C_WIN_ARRIVE],
                        (me * 2 + hv) * parts + p, epoch, deadline, err, rank):
                    sent[0] = 0   # recorded; the peers' waits expire too
    cuda.syncthreads()
    return sent[0] != 0


@cuda.jit(device=True, inline=True)
def forward_part(p, kv_words, kv_ptrs, flags, flag_ptrs, arrive, rail, cfg, slot, epoch,
                 deadline, err, rank, world, parts, n):
    """Between nodes: for each rail peer, once part ``p`` of its K and V has landed here
    (arrive), push it to every other GPU of the node. False on a timeout (recorded)."""
    for i in range(rail.shape[0]):
        src = rail[i]
        for hv in range(2):
            if not wait(arrive, (src * 2 + hv) * parts + p, epoch, deadline, err, rank,
                        ROLE_RECV):
                return False
        at = (slot * world + src) * 2 * n
        push_part(kv_words, at, kv_words, at + n, kv_ptrs, kv_words, p, cfg, flags, flag_ptrs,
                  slot, src, epoch)
    return True


# The compute role's waits say which array they watch in their role codes (errors.ROLE_BITS),
# so that a timeout names it (``op._flag_name``): array 0 arrive, 1 flags, 2 the mailbox
# between a block's producer and its consumers (sm_90a adaptive pool).
COMPUTE_PUSHED = ROLE_COMPUTE | 1 << ROLE_BITS
COMPUTE_MAILBOX = ROLE_COMPUTE | 2 << ROLE_BITS


@cuda.jit(device=True, inline=True)
def slice_flags(src, flags, arrive, cfg):
    """Where the parts of slice ``src`` (not this rank's) announce they are in this GPU's
    slot: (flag array, first index, count, the role code of a compute wait on it). A rail
    peer's land through the proxy, K and V apart (arrive[src, k|v, p]); every other one is
    pushed by a GPU of this node (flags[src, p])."""
    parts = cfg[C_PARTS]
    if prim.umod32(src, cfg[C_G]) == cfg[C_LOCAL]:
        return arrive, src * 2 * parts, 2 * parts, ROLE_COMPUTE
    return flags, src * parts, parts, COMPUTE_PUSHED


@cuda.jit(device=True)
def slice_ready(src, flags, arrive, cfg, epoch, deadline, err, rank, block_wide):
    """Wait until every part of slice ``src`` (not this rank's) is in this GPU's slot
    (:func:`slice_flags`). ``block_wide``: all threads of the block call this (one poller, the
    others at a barrier); else one thread does. False on timeout."""
    fl, first, count, role = slice_flags(src, flags, arrive, cfg)
    for i in range(count):
        if block_wide:
            ok = wait(fl, first + i, epoch, deadline, err, rank, role)
        else:
            ok = prim.wait_flag(fl, first + i, epoch, deadline, err, rank, role)
        if not ok:
            return False
    return True


@cuda.jit(device=True, inline=True)
def query_tile(k, worker, workers, batch, heads, tiles, rows, causal):
    """The k-th query tile of compute block ``worker`` (of ``workers``): ``(b, h, row0)``, or
    b == batch past the last. Blocks take tiles in turn, snaking (every other round in
    reverse), so that their totals come out even; causal: the row tiles with the most keys
    first (rows are in position order), every head of one row tile together."""
    it = k * workers + (worker if k % 2 == 0 else workers - 1 - worker)
    bh = batch * heads
    if it >= bh * tiles:
        return batch, 0, 0
    # 32-bit divides (prim.udiv32): this runs beside the sm90 tile's wgmma
    if causal:
        rt = prim.udiv32(it, bh)
        b = prim.udiv32(it - rt * bh, heads)
        return b, it - rt * bh - b * heads, (tiles - 1 - rt) * rows
    r = prim.udiv32(it, tiles)
    b = prim.udiv32(r, heads)
    return b, r - b * heads, (it - r * tiles) * rows


# The compute role, in two builds with one argument list: worker (0 ..) of ``workers`` compute
# blocks takes the query tiles ``query_tile`` gives it; ``slot`` is this call's slot parity.
@cuda.jit(device=True)
def compute_simt(worker, workers, q, k, v, out, lse, kv, user_maps, slot_maps, runs, flags,
                 arrive, order, cfg, scale, slot, epoch, deadline, err, rank):
    """The SIMT twin: one query row per thread (``roles.attention``); reads q, k, v and the
    slots ``kv`` directly."""
    batch, seq, heads, kv_heads, d = cfg[C_BATCH], cfg[C_SEQ], cfg[C_HEADS], cfg[C_KV_HEADS], \
        cfg[C_D]
    me, world = cfg[C_ME], cfg[C_WORLD]
    causal, zigzag = cfg[C_CAUSAL] != 0, cfg[C_ZIGZAG] != 0
    qrow = cuda.local.array(HEAD_DIM_MAX, np.float32)
    acc = cuda.local.array(HEAD_DIM_MAX, np.float32)
    rows = cuda.blockDim.x
    tiles = (seq + rows - 1) // rows
    group = heads // kv_heads
    for n in range(tiles * batch * heads):
        b, h, row0 = query_tile(n, worker, workers, batch, heads, tiles, rows, causal)
        if b == batch:
            break
        row = row0 + cuda.threadIdx.x
        active = row < seq
        m = np.float32(-math.inf)
        lsum = np.float32(0.0)
        qpos = 0
        if active:
            load_row(q, b, row, h, d, qrow, scale)
            qpos = position(row, me, seq, world, zigzag)
            for e in range(d):
                acc[e] = np.float32(0.0)
        for j in range(world):
            src = order[j]
            ks, vs = k, v
            if src != me:
                if not slice_ready(src, flags, arrive, cfg, epoch, deadline, err, rank, True):
                    return
                ks, vs = kv[slot, src, 0], kv[slot, src, 1]
            if active:
                m, lsum = attend_slice(qrow, acc, m, lsum, ks, vs, b, h // group, d, seq, qpos,
                                       src, seq, world, zigzag, causal)
        if active:
            store_row(out, lse, acc, m, lsum, b, row, h, d)


def sm90_load_tile(build="sm90"):
    """The sm_90a tile's producer lane for one query tile (``build`` as in
    :func:`compute_sm90_role`), of the static role and of the flexible pool alike."""
    _, _, _, attn_load_q, attn_load_kv, _ = sm90_functions(build)

    @cuda.jit(device=True, inline=True)
    def load_tile(smem, b, h, row0, maps, dims, sync, slot, epoch, deadline, err, rank, q_seq,
                  kv_seq, live):
        """Query tile (b, h, row0): its Q, then the KV tiles of each slice in ``order``, a
        slice's once it is here (``slice_ready``). maps: (user, slots, q_run, group): the
        tensor maps' and positions' addresses, heads per KV head; dims: (seq, d, me, world,
        causal); sync: (flags, arrive, order, cfg). Returns (kv_seq, live): live 0 once a wait
        timed out (recorded; the tiles pass through uncopied)."""
        user, slots, q_run, group = maps
        seq, d, me, world, causal = dims
        flags, arrive, order, cfg = sync
        attn_load_q(smem, user, b, h * d, row0, d, q_seq)
        for j in range(world):
            src = order[j]
            k_map = user + 128
            if src != me:
                if live and not slice_ready(src, flags, arrive, cfg, epoch, deadline, err, rank,
                                            False):
                    live = 0
                k_map = slots + ((slot * world + src) * 2) * 128
            kv_seq = attn_load_kv(smem, k_map, k_map + 128, b, prim.udiv32(h, group) * d, d,
                                  seq, row0, q_run, q_run + RUN_BYTES * (j + 1), causal, kv_seq,
                                  live)
        return kv_seq, live
    return load_tile


def compute_sm90_role(build="sm90"):
    """The compute role on the sm_90a tile (``roles/cuda/attention_tile.cu`` as ``build``, a
    name in ``roles.attention.SM90_BUILDS``, compiles it): the producer lane waits for each
    slice and queues its KV tiles; the consumers fold every slice into a query tile of 128
    rows held in registers."""
    attn_init, attn_producer_regs, attn_consumer_regs, _, _, attn_tile = sm90_functions(build)
    load_tile = sm90_load_tile(build)

    @cuda.jit(device=True)
    def compute_sm90(worker, workers, q, k, v, out, lse, kv, user_maps, slot_maps, runs, flags,
                     arrive, order, cfg, scale, slot, epoch, deadline, err, rank):
        """Reads through tensor maps: user_maps of q, k, v (128 bytes apart), slot_maps of
        each slot's K and V ([slot, src, k|v]); runs: the positions of this rank's rows, then
        of each slice in ``order``."""
        batch, seq, heads, kv_heads, d = cfg[C_BATCH], cfg[C_SEQ], cfg[C_HEADS], \
            cfg[C_KV_HEADS], cfg[C_D]
        me, world, causal = cfg[C_ME], cfg[C_WORLD], cfg[C_CAUSAL]
        smem = cuda.shared.array(0, np.uint8)
        attn_init(smem)
        cuda.syncthreads()
        tiles = (seq + SM90_ROWS - 1) // SM90_ROWS
        group = prim.udiv32(heads, kv_heads)
        q_run = prim.data_ptr(runs)
        user, slots = prim.data_ptr(user_maps), prim.data_ptr(slot_maps)
        tid = cuda.threadIdx.x
        q_seq = 0
        kv_seq = 0
        if tid >= SM90_CONSUMERS:                   # the producer warpgroup: one lane
            attn_producer_regs()
            if tid != SM90_CONSUMERS:
                return
            live = 1
            for n in range(tiles * batch * heads):
                b, h, row0 = query_tile(n, worker, workers, batch, heads, tiles, SM90_ROWS,
                                        causal)
                if b == batch:
                    break
                kv_seq, live = load_tile(smem, b, h, row0, (user, slots, q_run, group),
                                         (seq, d, me, world, causal),
                                         (flags, arrive, order, cfg), slot, epoch, deadline,
                                         err, rank, q_seq, kv_seq, live)
                q_seq += 1
            return
        attn_consumer_regs()
        for n in range(tiles * batch * heads):                # the consumers
            b, h, row0 = query_tile(n, worker, workers, batch, heads, tiles, SM90_ROWS, causal)
            if b == batch:
                break
            kv_seq = attn_tile(smem, out, lse, b, h, heads, seq, d, row0, q_run,
                               q_run + RUN_BYTES, world, causal, scale * LOG2E, kv_seq, q_seq)
            q_seq += 1
    return compute_sm90


# ---- the adaptive split (roles.controller) -------------------------------------------------
# The compute blocks are the controller's flexible pool: compute items are the query tiles (in
# ``query_tile``'s order, from a queue), communication items the parts of this rank's slice
# pushed to the node's other GPUs (between nodes the send blocks stay fixed: they store the
# slice and hand it to the proxy; forward stays fixed). No push waits (a part comes from k and
# v), so a block whose next query tile's slices have not all arrived pushes a part meanwhile
# while any are left; then the tile, whose waits are the bounded ones of the static role.
# Roles change between query tiles only: on the sm_90a tile the producer lane picks each item
# (``roles.controller.make_dispatch``'s next_item) and hands it to the consumer warpgroups
# through a mailbox in shared memory, since the two never meet at a block-wide barrier
# (setmaxnreg), and runs ahead into the next tile as in the static role.

@cuda.jit(device=True)
def slices_arrived(args, i):
    """One thread, no wait: whether every other rank's slice is in this GPU's slot (the flags
    :func:`slice_ready` waits on). args: (flags, arrive, order, cfg, epoch); every query tile
    ``i`` reads every slice."""
    flags, arrive, order, cfg, epoch = args
    for j in range(1, order.shape[0]):             # order[0] is this rank's own
        fl, first, count, _ = slice_flags(order[j], flags, arrive, cfg)
        for f in range(count):
            if not prim.epoch_reached(prim.acquire(fl, first + f, True), epoch):
                return False
    return True


pool_start, next_item, next_block, pool_stop = ctl_.make_dispatch(slices_arrived)


@cuda.jit(device=True, inline=True)
def query_tiles(cfg, rows):
    """Query tiles of this rank: (batch, head, tiles of ``rows`` rows)."""
    return cfg[C_BATCH] * cfg[C_HEADS] * prim.udiv32(cfg[C_SEQ] + rows - 1, rows)


@cuda.jit(device=True)
def pool_simt(first, io, sync, ctx, move, adapt):
    """The flexible pool on the SIMT twin (the simulator's), block-wide: each item from the
    controller's dispatch; a query tile is the static role's (``compute_simt`` with as many
    workers as tiles does exactly the tile ``worker``). io: (q, k, v, out, lse, kv,
    user_maps, slot_maps, runs); sync: (flags, arrive, order, cfg); ctx: (scale, slot, epoch,
    call, deadline, err, rank, timeout_ns); move: (k_words, v_words, kv_ptrs, kv_words,
    flag_ptrs); adapt: (queue, ctl, trace)."""
    q, k, v, out, lse, kv, user_maps, slot_maps, runs = io
    flags, arrive, order, cfg = sync
    scale, slot, epoch, call, deadline, err, rank, _ = ctx
    k_words, v_words, kv_ptrs, kv_words, flag_ptrs = move
    queue, ctl, trace = adapt
    blk = cuda.blockIdx.x
    tr = cfg[C_TRACE] != 0
    flex = cuda.gridDim.x - first
    tiles, ncomm = query_tiles(cfg, cuda.blockDim.x), cfg[C_NCOMM]
    st = cuda.local.array(POOL_STATE, np.int64)
    if cuda.threadIdx.x == 0:
        pool_start(st, ctl, ctl_.COMM if blk - first < cfg[C_INIT_COMM] else ctl_.COMPUTE,
                   ncomm)
    while True:
        kind, it = next_block(st, ctl, queue, call, (tiles, ncomm), flex, cfg[C_INIT_COMM],
                              (tr, trace, T_CTL_N, len(TRACE_EVENTS), blk),
                              (flags, arrive, order, cfg, epoch))
        if kind == ctl_.END:
            break
        start = prim.globaltimer()
        if kind == ctl_.COMM:
            stamp(tr, trace, T_PUSH_START, it)
            record(tr, trace, T_PUSH_BLOCK, it, blk)
            push_part(k_words, 0, v_words, 0, kv_ptrs, kv_words, it, cfg, flags, flag_ptrs,
                      slot, cfg[C_ME], epoch)
            stamp(tr, trace, T_PUSH_DONE, it)
        else:
            stamp(tr, trace, T_TILE_START, it)
            record(tr, trace, T_TILE_BLOCK, it, blk)
            compute_simt(it, tiles, q, k, v, out, lse, kv, user_maps, slot_maps, runs, flags,
                         arrive, order, cfg, scale, slot, epoch, deadline, err, rank)
            cuda.syncthreads()        # every thread's rows, then the tile's end
            stamp(tr, trace, T_TILE_DONE, it)
        ctl_.account(ctl, kind, start)
    if cuda.threadIdx.x == 0:
        pool_stop(st, ctl)
    stamp(tr, trace, T_BLOCK_END, blk)


def pool_sm90_role(build="sm90"):
    """The flexible pool on the sm_90a tile (``build`` as in :func:`compute_sm90_role`): the
    producer lane picks each item and posts it in a mailbox (``box``: items posted, items
    taken by the consumers, the item: a query tile >= 0, a part ``-2 - p``, END -1); for a
    tile it then loads Q and the KV tiles as the static role does. The consumers take each
    item (thread 0 counts it taken once all 256 have read it, at their named barrier) and
    compute the tile or push the part."""
    attn_init, attn_producer_regs, attn_consumer_regs, _, _, attn_tile = sm90_functions(build)
    load_tile = sm90_load_tile(build)

    @cuda.jit(device=True)
    def pool_sm90(first, io, sync, ctx, move, adapt):
        """Arguments as :func:`pool_simt`'s."""
        q, k, v, out, lse, kv, user_maps, slot_maps, runs = io
        flags, arrive, order, cfg = sync
        scale, slot, epoch, call, deadline, err, rank, timeout_ns = ctx
        k_words, v_words, kv_ptrs, kv_words, flag_ptrs = move
        queue, ctl, trace = adapt
        batch, seq, heads, kv_heads, d = cfg[C_BATCH], cfg[C_SEQ], cfg[C_HEADS], \
            cfg[C_KV_HEADS], cfg[C_D]
        me, world, causal = cfg[C_ME], cfg[C_WORLD], cfg[C_CAUSAL]
        blk = cuda.blockIdx.x
        tr = cfg[C_TRACE] != 0
        flex = cuda.gridDim.x - first
        ncomm = cfg[C_NCOMM]
        smem = cuda.shared.array(0, np.uint8)
        box = cuda.shared.array(3, np.int32)
        attn_init(smem)
        tid = cuda.threadIdx.x
        if tid == 0:
            box[0] = 0
            box[1] = 0
        cuda.syncthreads()
        tiles = (seq + SM90_ROWS - 1) // SM90_ROWS
        total = tiles * batch * heads
        group = prim.udiv32(heads, kv_heads)
        q_run = prim.data_ptr(runs)
        user, slots = prim.data_ptr(user_maps), prim.data_ptr(slot_maps)
        q_seq = 0
        kv_seq = 0
        if tid >= SM90_CONSUMERS:                   # the producer warpgroup: one lane
            attn_producer_regs()
            if tid != SM90_CONSUMERS:
                return
            # the dispatch's state in shared memory: the producer's registers are few
            st = cuda.shared.array(POOL_STATE, np.int64)
            pool_start(st, ctl, ctl_.COMM if blk - first < cfg[C_INIT_COMM] else ctl_.COMPUTE,
                       ncomm)
            live = 1
            while True:
                kind, it = next_item(st, ctl, queue, call, (total, ncomm), flex,
                                     cfg[C_INIT_COMM],
                                     (tr, trace, T_CTL_N, len(TRACE_EVENTS), blk),
                                     (flags, arrive, order, cfg, epoch))
                # the consumers took the last item (box[0]: this lane's count of items
                # posted): the mailbox is free
                if not prim.wait_flag(box, 1, box[0], deadline, err, rank, COMPUTE_MAILBOX,
                                      100, False):
                    break
                box[2] = it if kind == ctl_.COMPUTE else -2 - it if kind == ctl_.COMM else -1
                prim.release(box, 0, box[0] + 1, False)
                if kind == ctl_.END:
                    break
                if kind == ctl_.COMM:
                    continue
                b, h, row0 = query_tile(it, 0, 1, batch, heads, tiles, SM90_ROWS, causal)
                kv_seq, live = load_tile(smem, b, h, row0, (user, slots, q_run, group),
                                         (seq, d, me, world, causal),
                                         (flags, arrive, order, cfg), slot, epoch, deadline,
                                         err, rank, q_seq, kv_seq, live)
                q_seq += 1
            pool_stop(st, ctl)
            return
        attn_consumer_regs()
        taken = 0
        posted = cuda.shared.array(1, np.int32)
        while True:                                           # the consumers
            # Thread 0 alone waits for the next item, so all 256 agree on whether it came,
            # and waits at least timeout_ns from now: once the launch's deadline passed the
            # producer's own waits fail at once and it reaches its next post (or END) soon, and
            # a tile it posts must be consumed, or its KV loads would wait for the ring forever.
            if tid == 0:
                now = prim.globaltimer()
                posted[0] = prim.wait_flag(box, 0, taken + 1, max(deadline, now + timeout_ns),
                                           err, rank, COMPUTE_MAILBOX, 100, False)
            prim.bar_sync(BAR_CONSUMERS, SM90_CONSUMERS)     # the answer and the item, for all
            came = posted[0]
            got = box[2]
            prim.bar_sync(BAR_CONSUMERS, SM90_CONSUMERS)     # all have read them: free
            if not came:
                return
            taken += 1
            if tid == 0:
                prim.release(box, 1, taken, False)
            if got == -1:
                break
            start = prim.globaltimer()
            if got < -1:
                p = -2 - got
                stamp(tr, trace, T_PUSH_START, p)
                record(tr, trace, T_PUSH_BLOCK, p, blk)
                push_part_by(k_words, 0, v_words, 0, kv_ptrs, kv_words, p, cfg, flags,
                             flag_ptrs, slot, me, epoch, tid, SM90_CONSUMERS)
                stamp(tr, trace, T_PUSH_DONE, p)
                ctl_.account(ctl, ctl_.COMM, start)
                continue
            stamp(tr, trace, T_TILE_START, got)
            record(tr, trace, T_TILE_BLOCK, got, blk)
            b, h, row0 = query_tile(got, 0, 1, batch, heads, tiles, SM90_ROWS, causal)
            kv_seq = attn_tile(smem, out, lse, b, h, heads, seq, d, row0, q_run,
                               q_run + RUN_BYTES, world, causal, scale * LOG2E, kv_seq, q_seq)
            q_seq += 1
            stamp(tr, trace, T_TILE_DONE, got)           # warpgroup 0's end
            ctl_.account(ctl, ctl_.COMPUTE, start)
        stamp(tr, trace, T_BLOCK_END, blk)
    return pool_sm90


_KERNELS = {}


def make_kernel(tile, adaptive=False):
    """The Ring Attention kernel with the compute role of ``tile`` ("simt", or a build of the
    sm90 tile: "sm90" or another name in ``roles.attention.SM90_BUILDS``), with the static
    split or (``adaptive``) the controller's. One declaration for both: ``adaptive`` is a
    constant of the kernel, so numba compiles only the branches of its build (the static
    build never reads queue, ctl or trace: the op binds small placeholders there)."""
    key = (tile, bool(adaptive))
    if key in _KERNELS:
        return _KERNELS[key]
    sm90 = tile in SM90_BUILDS
    compute = compute_sm90_role(tile) if sm90 else compute_simt
    pool_role = pool_sm90_role(tile) if sm90 else pool_simt
    # one block of the sm90 tile per SM: 65536 / 384 registers a thread at launch, then
    # moved from the producer warpgroup to the consumers (attention_tile.cu)
    bounds = {"launch_bounds": (SM90_THREADS, 1)} if sm90 else {}

    @cuda.jit(**bounds)
    def ring_attention_kernel(q: Bits4D, k: Bits4D, v: Bits4D, out: Bits4D, lse: F32x3,
                              k_words: Words, v_words: Words, kv: Bits7D, kv_words: Words,
                              kv_ptrs: Words, flags: Flags, flag_ptrs: Words, arrive: Flags,
                              order: Ints, rail: Ints, ring: Flags, head: Flags, tail: Flags,
                              user_maps: Words, slot_maps: Words, runs: Ints, frame: Words,
                              cfg: Cfg, scale: types.float32, timeout_ns: types.uint64,
                              err: Record, rank: types.int64, queue: Flags, ctl: Words,
                              trace: Trace):
        """q/out [batch, seq, heads, d], k/v [batch, seq, kv_heads, d]: bf16 bits; lse [batch,
        heads, seq] fp32; k_words/v_words: k and v as uint64 words; kv: the symmetric slots [2,
        world, 2 (k, v), batch, seq, kv_heads, d] (kv_words the same memory as words, kv_ptrs
        its address table); flags [world * parts], arrive [world * 2 * parts] (set by the
        proxy); order int32 [world]: the slices in compute order; rail int32: the rail peers'
        world ranks; ring/head/tail: the proxy's command ring; user_maps, slot_maps, runs: the
        sm_90a tile's tensor maps and positions (unused by the SIMT twin); frame: the op's call
        counter. The adaptive build's: queue uint32 [roles.controller.QUEUES] (the query
        tiles' and the parts' ticket counters), ctl uint64 [roles.controller.CTL_WORDS] (its
        measurements), trace int64 [TRACE_ROWS, items] (written only when cfg[C_TRACE]).

        Blocks in order: send [0, parts) and, between nodes, forward [parts, cfg[C_POOL]);
        then compute (adaptive: the controller's flexible pool, which also pushes this rank's
        slice inside the node, so its send blocks exist only between nodes)."""
        epoch, call = begin(frame)
        if call == 0:
            return       # the op has ended on this rank: a graph replayed after it
        deadline = prim.globaltimer() + timeout_ns
        me, world, parts, nodes, n = cfg[C_ME], cfg[C_WORLD], cfg[C_PARTS], cfg[C_NODES], \
            cfg[C_WORDS]
        slot = call & 1
        blk = cuda.blockIdx.x
        tr = adaptive and cfg[C_TRACE] != 0          # the static build has no stamps
        stamp(tr, trace, T_BLOCK_START, blk)
        first = cfg[C_POOL]
        if blk < first:
            ok = True
            if blk < parts:                                       # ---- send role
                if nodes > 1:  # to the other nodes first: the slowest link starts at launch
                    stamp(tr, trace, T_SEND_START, blk)
                    ok = stage_part(blk, k_words, v_words, kv_words, rail, ring, head, tail,
                                    cfg, slot, epoch, deadline, err, rank, me, world, parts, n)
                    stamp(tr, trace, T_SEND_STAGED, blk)
                if ok and not adaptive:       # (adaptive: the pool pushes inside the node)
                    push_part(k_words, 0, v_words, 0, kv_ptrs, kv_words, blk, cfg, flags,
                              flag_ptrs, slot, me, epoch)
            else:                                                 # ---- forward role
                ok = forward_part(blk - parts, kv_words, kv_ptrs, flags, flag_ptrs, arrive,
                                  rail, cfg, slot, epoch, deadline, err, rank, world, parts, n)
            if ok:                             # a timed-out role's block has no end stamp
                stamp(tr, trace, T_BLOCK_END, blk)
            return
        # ---- compute. Nothing may follow it: on the sm_90a tile the producer and consumer
        # paths must not rejoin (ptxas would drop setmaxnreg), so the pool stamps its own end
        if adaptive:
            pool_role(first, (q, k, v, out, lse, kv, user_maps, slot_maps, runs),
                      (flags, arrive, order, cfg),
                      (scale, slot, epoch, call, deadline, err, rank, timeout_ns),
                      (k_words, v_words, kv_ptrs, kv_words, flag_ptrs), (queue, ctl, trace))
        else:
            compute(blk - first, cuda.gridDim.x - first, q, k, v, out, lse, kv, user_maps,
                    slot_maps, runs, flags, arrive, order, cfg, scale, slot, epoch, deadline,
                    err, rank)

    _KERNELS[key] = ring_attention_kernel
    return ring_attention_kernel
