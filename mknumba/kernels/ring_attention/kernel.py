"""Ring Attention's kernel: the send, forward and compute roles (see the package docstring),
and the kernel that hands blocks to them by index."""
import math

import numpy as np
from numba import cuda, types

from ... import primitives as prim
from ...errors import ROLE_COMPUTE, ROLE_RECV
from ...roles.attention import (HEAD_DIM_MAX, LOG2E, RUN_BYTES, SM90_BUILDS, SM90_CONSUMERS,
                                SM90_ROWS, SM90_THREADS, attend_slice, load_row, sm90_functions,
                                store_row)
from ...roles.blocks import begin, copy_tile, publish, wait
from ...roles.send import enqueue
from ...sched.sequence import position
from ..launch import array_type

Bits4D, Bits7D = array_type(np.uint16, 4), array_type(np.uint16, 7)
F32x3, Words, Flags = array_type(np.float32, 3), array_type(np.uint64, 1), array_type(np.uint32, 1)
Cfg, Record, Ints = array_type(np.int64, 1), array_type(np.int64, 1), array_type(np.int32, 1)

#: the launch's small integers (``launch.pack``): me is the world rank, local the rank in the
#: node of g GPUs, words the uint64 words of one rank's K (and of its V)
CFG_FIELDS = ("batch", "seq", "heads", "kv_heads", "d", "me", "world", "parts", "causal",
              "zigzag", "local", "g", "nodes", "words", "win_kv", "win_arrive")
(C_BATCH, C_SEQ, C_HEADS, C_KV_HEADS, C_D, C_ME, C_WORLD, C_PARTS, C_CAUSAL, C_ZIGZAG,
 C_LOCAL, C_G, C_NODES, C_WORDS, C_WIN_KV, C_WIN_ARRIVE) = range(len(CFG_FIELDS))



@cuda.jit(device=True)
def push_part(k_src, k_off, v_src, v_off, kv_ptrs, kv_words, part, cfg, flags, flag_ptrs, slot,
              src, epoch):
    """Part ``part`` of slice ``src`` (its K words at ``k_src[k_off:]``, its V at
    ``v_src[v_off:]``) -> every other GPU of the node, into its slot ``src``; then publish
    that GPU's flags[src, part]."""
    n, parts = cfg[C_WORDS], cfg[C_PARTS]
    chunk = prim.udiv32(n + parts - 1, parts)
    off = part * chunk
    cnt = max(0, min(chunk, n - off))
    g, local = cfg[C_G], cfg[C_LOCAL]
    base = (slot * cfg[C_WORLD] + src) * 2 * n
    for j in range(1, g):
        p = prim.peer_after(local, j, g)
        to = prim.peer_view(kv_ptrs, p, kv_words)
        copy_tile(k_src, k_off + off, to, base + off, cnt)
        copy_tile(v_src, v_off + off, to, base + n + off, cnt)
        publish(prim.peer_view(flag_ptrs, p, flags), src * parts + part, epoch)


@cuda.jit(device=True)
def slice_ready(src, flags, arrive, cfg, epoch, deadline, err, rank, block_wide):
    """Wait until every part of slice ``src`` (not this rank's) is in this GPU's slot: a rail
    peer's lands through the proxy (``arrive``, K and V apart), every other one is pushed by a
    GPU of this node (``flags``). ``block_wide``: all threads of the block call this (one
    poller, the others at a barrier); else one thread does. False on timeout."""
    parts = cfg[C_PARTS]
    from_rail = prim.umod32(src, cfg[C_G]) == cfg[C_LOCAL]
    for p in range(parts):
        for hv in range(2 if from_rail else 1):
            fl, idx = flags, src * parts + p
            if from_rail:
                fl, idx = arrive, (src * 2 + hv) * parts + p
            if block_wide:
                ok = wait(fl, idx, epoch, deadline, err, rank, ROLE_COMPUTE)
            else:
                ok = prim.wait_flag(fl, idx, epoch, deadline, err, rank, ROLE_COMPUTE)
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


def compute_sm90_role(build="sm90"):
    """The compute role on the sm_90a tile (``roles/cuda/attention_tile.cu`` as ``build``, a
    name in ``roles.attention.SM90_BUILDS``, compiles it): the producer lane waits for each
    slice and queues its KV tiles; the consumers fold every slice into a query tile of 128
    rows held in registers."""
    (attn_init, attn_producer_regs, attn_consumer_regs, attn_load_q, attn_load_kv,
     attn_tile) = sm90_functions(build)

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
                attn_load_q(smem, user, b, h * d, row0, d, q_seq)
                q_seq += 1
                for j in range(world):
                    src = order[j]
                    k_map = user + 128
                    if src != me:
                        if live and not slice_ready(src, flags, arrive, cfg, epoch, deadline,
                                                    err, rank, False):
                            live = 0          # recorded; the tiles pass through uncopied
                        k_map = slots + ((slot * world + src) * 2) * 128
                    kv_seq = attn_load_kv(smem, k_map, k_map + 128, b, prim.udiv32(h, group) * d,
                                          d, seq,
                                          row0, q_run, q_run + RUN_BYTES * (j + 1), causal,
                                          kv_seq, live)
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


_KERNELS = {}


def make_kernel(tile):
    """The Ring Attention kernel with the compute role of ``tile`` ("simt", or a build of the
    sm90 tile: "sm90" or another name in ``roles.attention.SM90_BUILDS``)."""
    if tile in _KERNELS:
        return _KERNELS[tile]
    sm90 = tile in SM90_BUILDS
    compute = compute_sm90_role(tile) if sm90 else compute_simt
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
                              err: Record, rank: types.int64):
        """q/out [batch, seq, heads, d], k/v [batch, seq, kv_heads, d]: bf16 bits; lse [batch,
        heads, seq] fp32; k_words/v_words: k and v as uint64 words; kv: the symmetric slots [2,
        world, 2 (k, v), batch, seq, kv_heads, d] (kv_words the same memory as words, kv_ptrs
        its address table); flags [world * parts], arrive [world * 2 * parts] (set by the
        proxy); order int32 [world]: the slices in compute order; rail int32: the rail peers'
        world ranks; ring/head/tail: the proxy's command ring; user_maps, slot_maps, runs: the
        sm_90a tile's tensor maps and positions (unused by the SIMT twin); frame: the op's call
        counter."""
        epoch, call = begin(frame)
        deadline = prim.globaltimer() + timeout_ns
        me, world, parts, nodes, n = cfg[C_ME], cfg[C_WORLD], cfg[C_PARTS], cfg[C_NODES], \
            cfg[C_WORDS]
        slot = call & 1
        blk = cuda.blockIdx.x
        if blk < parts:                                           # ---- send role
            if nodes > 1:     # to the other nodes first: the slowest link starts at launch
                chunk = prim.udiv32(n + parts - 1, parts)
                off = blk * chunk
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
                                    cfg[C_WIN_KV], at, cnt * 8, blk, cfg[C_WIN_ARRIVE],
                                    (me * 2 + hv) * parts + blk, epoch, deadline, err, rank):
                                sent[0] = 0   # recorded; the peers' waits expire too
                cuda.syncthreads()
                if sent[0] == 0:
                    return                    # the whole block, together
            push_part(k_words, 0, v_words, 0, kv_ptrs, kv_words, blk, cfg, flags, flag_ptrs,
                      slot, me, epoch)
            return
        first = parts
        if nodes > 1:
            first = 2 * parts
            if blk < first:                                       # ---- forward role
                p = blk - parts
                for i in range(rail.shape[0]):
                    src = rail[i]
                    for hv in range(2):
                        if not wait(arrive, (src * 2 + hv) * parts + p, epoch, deadline, err,
                                    rank, ROLE_RECV):
                            return
                    at = (slot * world + src) * 2 * n
                    push_part(kv_words, at, kv_words, at + n, kv_ptrs, kv_words, p, cfg, flags,
                              flag_ptrs, slot, src, epoch)
                return
        compute(blk - first, cuda.gridDim.x - first, q, k, v, out, lse, kv,  # ---- compute
                user_maps, slot_maps, runs, flags, arrive, order, cfg, scale, slot, epoch,
                deadline, err, rank)

    _KERNELS[tile] = ring_attention_kernel
    return ring_attention_kernel
