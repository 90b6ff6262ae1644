"""Ring Attention (sequence parallel, paper §4): every rank's queries attend to every rank's keys.

    op = mk.RingAttention(comm, batch, seq_local, heads, kv_heads, head_dim, causal=True,
                          layout="zigzag")
    out, lse = op(q, k, v)   # q [batch, seq_local, heads, d], k/v [batch, seq_local, kv_heads, d]

Within a step the attention of each KV slice is independent of the others, so one persistent
launch overlaps moving the slices with computing on those already here. Slots and flags are
indexed by world rank. Roles, by block index (P parts per slice):

  send     [0, P)       several nodes: part p of this rank's K and V -> this GPU's own slot,
                          then one command per rail peer to the proxy (the slice goes once to
                          each other node, at launch; the proxy sets arrive[me, k|v, p] there);
                          then part p -> every other GPU of the node, into its slot for this
                          rank (NVLink stores, the next GPU first); publish flags[me, p] there
  forward  [P, 2P)      several nodes: for each rail peer src: wait arrive[src, k and v, p];
                          push part p of slot src to every other GPU of the node; publish
                          flags[src, p] there
  compute  [.., grid)   for each tile of query rows (batch, head, rows), one query row per
                          thread: attend to the local slice, then to the others in ``order``
                          (this node's GPUs in ring order, then the other nodes') as each
                          arrives (flags[src, :], or arrive[src, ...] for a rail peer's); the
                          running max, denominator and output stay in fp32 across slices (the
                          LSE merge, ``roles.attention``); out (bf16) and lse (fp32) written once

Slots are double-buffered by call parity (``slot = call & 1``): a rank cannot start call e+2
before every peer has finished call e (its call e+1 waited on their call e+1 slices), so a
slot is never rewritten while a peer still reads it. Causal attention masks each key by the
global positions of the layout (``sched.sequence``: contiguous, or zigzag for equal work).

The compute role runs on the Hopper tile (``roles/cuda/attention_tile.cu``: TMA + wgmma, 128
query rows per block, the producer lane waiting for each slice's flags before it queues the
slice's KV tiles) where the GPU is sm_90a and head_dim is 64 or 128, and on its SIMT twin (one
query row per thread, plain loads) elsewhere, the simulator included.
"""
import math

import numpy as np
from numba import cuda, types

from .. import primitives as prim
from .._compat import SIMULATOR
from ..arrays import new_output, operand
from ..errors import (ERR_WORDS, ROLE_COMPUTE, ROLE_RECV, MkError, MkValueError,
                      raise_if_timed_out)
from ..roles.attention import (HEAD_DIM_MAX, LOG2E, RUN_BYTES, SM90_CONSUMERS, SM90_HEAD_DIMS,
                               SM90_ROWS, SM90_SMEM_BYTES, SM90_THREADS, attend_slice, load_row,
                               sm90_functions, store_row)
from ..roles.blocks import begin, copy_tile, publish, wait
from ..roles.send import enqueue
from ..sched.sequence import check_layout, position, runs
from ..sched.tiles import arrival_order
from .launch import (Frame, Launch, Slot, StreamOrder, array_type, compile_kernel, pack, param,
                     stream_handle)
from .tensor_maps import MAP_WORDS, MapTable, tensor_map

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


def compute_sm90_role():
    """The compute role on the sm_90a tile (``roles/cuda/attention_tile.cu``): the producer
    lane waits for each slice and queues its KV tiles; the consumers fold every slice into a
    query tile of 128 rows held in registers."""
    attn_init, attn_load_q, attn_load_kv, attn_tile = sm90_functions()

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
        if tid >= SM90_CONSUMERS:                        # the producer warp: one lane
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
    """The Ring Attention kernel with the compute role of ``tile`` ("sm90" or "simt")."""
    if tile in _KERNELS:
        return _KERNELS[tile]
    compute = compute_sm90_role() if tile == "sm90" else compute_simt
    # one block of the sm90 tile per SM: ptxas may take up to 65536 / 288 registers a thread
    bounds = {"launch_bounds": (SM90_THREADS, 1)} if tile == "sm90" else {}

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


class RingAttention:
    """Plan once, call many times: attention over a sequence split across the ranks of a node.

    comm: the :class:`mknumba.Comm` (None: one GPU, see :func:`attention`); the ring is
    its world, node by node (rank order is sequence order, ``layout``); batch, seq_local
    (this rank's rows), heads, kv_heads (grouped-query attention: heads % kv_heads == 0),
    head_dim (a multiple of 8, at most 128); causal; layout: how the global sequence is split
    ("contiguous" or "zigzag", ``sched.sequence``; shard and unshard with
    ``mknumba.sched.sequence.shard``/``unshard``); scale (default 1/sqrt(head_dim)); tile:
    "auto" (the sm_90a tile where it applies: a Hopper GPU, head_dim 64 or 128), "sm90" or
    "simt"; threads (the SIMT twin's rows per block), send_blocks and compute_blocks (blocks
    per role) are tuning knobs.
    Every rank must pass the same values (checked). Calls are asynchronous on the stream of
    the inputs; :meth:`synchronize` waits and raises any device-side timeout.
    """

    name = "RingAttention"

    def __init__(self, comm, batch, seq_local, heads, kv_heads, head_dim, *, causal=False,
                 layout="contiguous", scale=None, tile="auto", send_blocks=None, threads=None,
                 compute_blocks=None):
        dims = dict(batch=batch, seq_local=seq_local, heads=heads, kv_heads=kv_heads,
                    head_dim=head_dim)
        for key, value in dims.items():
            if int(value) != value or value < 1:
                raise MkValueError(f"{self.name}: {key} must be a positive integer, got {value}")
        self.batch, self.seq, self.heads, self.kv_heads, self.d = (int(x) for x in dims.values())
        if self.heads % self.kv_heads:
            raise MkValueError(f"{self.name}: heads={heads} must be a multiple of "
                               f"kv_heads={kv_heads}")
        if self.d % 8 or self.d > HEAD_DIM_MAX:
            raise MkValueError(f"{self.name}: head_dim={head_dim} is not supported: a multiple "
                               f"of 8, at most {HEAD_DIM_MAX}")
        check_layout(layout, self.seq, self.name)
        self.causal, self.layout = bool(causal), layout
        self.scale = float(scale) if scale is not None else 1.0 / math.sqrt(self.d)
        self.comm = comm
        self.world = comm.size if comm is not None else 1
        self.me = comm.rank if comm is not None else 0
        self.nodes = comm.nodes if comm is not None else 1
        self.local = comm.local_rank if comm is not None else 0
        self.g = comm.local_size if comm is not None else 1
        if comm is not None:
            comm.agree(self.name, dict(dims, causal=self.causal, layout=layout,
                                       scale=self.scale))
        self.device = comm.device_id if comm is not None else (
            None if SIMULATOR else cuda.get_current_device().id)
        self.tile = self._tile_for(tile)
        if self.tile == "sm90":
            if threads is not None:
                raise MkValueError(f"{self.name}: threads= sets the SIMT twin's rows per block; "
                                   f"the sm90 tile runs {SM90_THREADS} threads")
            self.threads, smem, rows = SM90_THREADS, SM90_SMEM_BYTES, SM90_ROWS
        else:
            self.threads, smem = int(threads or (8 if SIMULATOR else 128)), 0
            rows = self.threads
        self.words = self.batch * self.seq * self.kv_heads * self.d // 4   # of K, and of V
        self.parts = 0
        if self.world > 1:    # parts of a slice, each a flag; none of them empty
            chunk = -(-self.words // int(send_blocks or (1 if SIMULATOR else 8)))
            self.parts = -(-self.words // chunk)
        tiles = self.batch * self.heads * -(-self.seq // rows)
        sms = 2 if SIMULATOR else cuda.get_current_device().MULTIPROCESSOR_COUNT
        comm_blocks = self.parts * (2 if self.nodes > 1 else 1)
        # the sm90 tile takes a whole SM (shared memory): one block per SM beside the movers
        fit = max(1, sms - comm_blocks) if self.tile == "sm90" else 4 * sms
        self.compute_blocks = int(compute_blocks or min(tiles, fit))
        self._allocate()
        self.streams = StreamOrder(self.name)
        kernel = make_kernel(self.tile)
        compiled, bps = compile_kernel(kernel, self.threads, smem)
        grid = comm_blocks + self.compute_blocks
        self.frame = Frame(grid)
        if not SIMULATOR and (self.parts or self.tile == "sm90") and grid > bps * sms:
            raise MkValueError(f"{self.name}: {grid} blocks are more than fit on the GPU at "
                               f"once ({bps} per SM)")
        cfg = pack(CFG_FIELDS, batch=self.batch, seq=self.seq, heads=self.heads,
                   kv_heads=self.kv_heads, d=self.d, me=self.me, world=self.world,
                   parts=self.parts, causal=self.causal, zigzag=layout == "zigzag",
                   local=self.local, g=self.g, nodes=self.nodes, words=self.words,
                   win_kv=self._wins[0], win_arrive=self._wins[1])
        b, s, h, hk, d = self.batch, self.seq, self.heads, self.kv_heads, self.d
        self.launch = Launch(kernel, compiled, dict(
            q=Slot((b, s, h, d)), k=Slot((b, s, hk, d)), v=Slot((b, s, hk, d)),
            out=Slot((b, s, h, d)), lse=Slot((b, h, s)), k_words=Slot((self.words,)),
            v_words=Slot((self.words,)), **self._device_args,
            order=cuda.to_device(self.order()), **self._tile_args(),
            frame=self.frame.words, cfg=cuda.to_device(cfg), scale=np.float32(self.scale),
            timeout_ns=self.timeout_ns, err=self.err, rank=self.me), grid, self.threads, smem)
        self.freed = False

    def _tile_for(self, tile):
        if tile not in ("auto", "sm90", "simt"):
            raise MkValueError(f"{self.name}: tile must be 'auto', 'sm90' or 'simt', got {tile!r}")
        cc = None if SIMULATOR else tuple(cuda.get_current_device().compute_capability)
        fits = cc == (9, 0) and self.d in SM90_HEAD_DIMS
        if tile == "sm90" and not fits:
            raise MkValueError(f"{self.name}: the sm90 tile needs a Hopper GPU (here: "
                               f"{'the simulator' if cc is None else cc}) and head_dim 64 or "
                               f"128 (here: {self.d})")
        return "sm90" if tile == "sm90" or (tile == "auto" and fits) else "simt"

    def _tile_args(self):
        """The sm90 tile's launch arguments: the caller's q, k, v tensor maps (one row per
        address triple, bound per call), each slot's K and V maps, the positions of this rank's
        rows and of every slice in compute order (``sched.sequence.runs``)."""
        W, layout = self.world, self.layout
        table = [runs(self.me, self.seq, W, layout)]
        table += [runs(int(src), self.seq, W, layout) for src in self.order()]
        args = dict(runs=cuda.to_device(np.array(table, np.int32).ravel()))
        if self.tile != "sm90":
            self.user_maps = None
            dummy = cuda.to_device(np.zeros(MAP_WORDS, np.uint64))
            return dict(args, user_maps=dummy, slot_maps=dummy)
        b, s, h, hk, d = self.batch, self.seq, self.heads, self.kv_heads, self.d
        box = (64, SM90_ROWS, 1)

        def encode(key):
            q, k, v = key
            return np.concatenate([tensor_map(q, (h * d, s, b), box),
                                   tensor_map(k, (hk * d, s, b), box),
                                   tensor_map(v, (hk * d, s, b), box)])
        self.user_maps = MapTable(encode, 3 * MAP_WORDS)
        slots = np.zeros((max(W, 2) * 4, MAP_WORDS), np.uint64)
        if W > 1:             # [slot, src, k|v] -> the map of that [b, s, kv_heads * d] slice
            base, elems = param(self._device_args["kv"]), b * s * hk * d
            for i in range(4 * W):
                slots[i] = tensor_map(base + i * elems * 2, (hk * d, s, b), box)
        return dict(args, user_maps=Slot((3 * MAP_WORDS,)),
                    slot_maps=cuda.to_device(slots.ravel()))

    def order(self):
        """The world ranks whose slices this rank attends to, in order: its own, this node's
        other GPUs in ring order (the previous GPU's first), then each other node's, its
        rail peer's first (that slice arrives directly, the others forwarded)."""
        return arrival_order(self.me, self.local, self.g, self.nodes)

    def _allocate(self):
        """The symmetric slots for other ranks' K and V (one per world rank), their flags, the
        network's arrival flags and proxy windows, the error record."""
        b, s, hk, d, W = self.batch, self.seq, self.kv_heads, self.d, self.world
        comm = self.comm
        self._buffers, self._wins = [], (0, 0)
        z64, z32 = np.zeros(1, np.uint64), np.zeros(1, np.uint32)
        if W > 1:
            kv = comm.alloc_symmetric((2 * W * 2 * self.words,), np.uint64)
            fl = comm.alloc_flags(W * self.parts)
            self._buffers = [kv, fl]
            args = dict(kv=kv.local.view(np.uint16).reshape(2, W, 2, b, s, hk, d),
                        kv_words=kv.local, kv_ptrs=kv.ptrs, flags=fl.local, flag_ptrs=fl.ptrs)
            self._flag_arrays = [fl.local]
        else:                     # one GPU: no slots to fill, the kernel reads k and v
            args = dict(kv=cuda.to_device(np.zeros((1, 1, 1, 1, 1, 1, 4), np.uint16)),
                        kv_words=cuda.to_device(z64), kv_ptrs=cuda.to_device(z64),
                        flags=cuda.to_device(z32), flag_ptrs=cuda.to_device(z64))
            self._flag_arrays = []
        if self.nodes > 1:
            if comm.proxy is None:
                raise MkError(f"{self.name}: {self.nodes} nodes need the proxy, which this "
                              "Comm did not start")
            arrive = comm.alloc_flags(W * 2 * self.parts)
            self._buffers.append(arrive)
            self._flag_arrays.append(arrive.local)
            self._wins = (comm.proxy.register(kv), comm.proxy.register(arrive))
            ring, head, tail = comm.proxy.device_args()
            args.update(arrive=arrive.local, ring=ring, head=head, tail=tail,
                        rail=cuda.to_device(np.array(comm.rail_peers, np.int32)))
        else:
            args.update(arrive=cuda.to_device(z32), ring=cuda.mapped_array(12, np.uint32),
                        head=cuda.to_device(z32), tail=cuda.mapped_array(1, np.uint32),
                        rail=cuda.to_device(np.zeros(1, np.int32)))
        self._device_args = args
        if comm is not None:
            self.err, self.timeout_ns = comm.new_error_record(), comm.timeout_ns
        else:
            from ..runtime import default_timeout_ns
            self.err = cuda.mapped_array(ERR_WORDS, dtype=np.int64)
            self.err[:] = 0
            self.timeout_ns = default_timeout_ns()

    def __call__(self, q, k, v, out=None, lse=None, stream=None):
        """q [batch, seq_local, heads, d], k and v [batch, seq_local, kv_heads, d] (bf16) ->
        ``(out, lse)``: out like q (bf16), lse [batch, heads, seq_local] fp32 (natural log).
        PyTorch tensors in -> tensors out; other arrays (bf16 as ml_dtypes.bfloat16 or bits as
        uint16/int16) -> numba arrays (out as bf16 bits, uint16)."""
        if self.freed:
            raise MkError(f"{self.name}: called after free()")
        self._check_error(f"{self.name} (an earlier call)")
        b, s, h, hk, d, dev = self.batch, self.seq, self.heads, self.kv_heads, self.d, self.device
        Q = operand(q, self.name, "q", shape=(b, s, h, d), device_id=dev, align=8)
        K = operand(k, self.name, "k", shape=(b, s, hk, d), device_id=dev, align=8)
        V = operand(v, self.name, "v", shape=(b, s, hk, d), device_id=dev, align=8)
        if not Q.torch == K.torch == V.torch:
            raise MkValueError(f"{self.name}: q, k and v must all be PyTorch tensors or all "
                               "device arrays")
        if out is None:
            out = new_output(q, Q.torch, (b, s, h, d))
        if lse is None:
            lse = new_output(q, Q.torch, (b, h, s), "float32")
        O = operand(out, self.name, "out", shape=(b, s, h, d), device_id=dev, align=8)
        L_ = operand(lse, self.name, "lse", dtypes=("float32",), shape=(b, h, s),
                     device_id=dev, align=4)
        st = stream_handle(stream, dev if Q.torch else None)
        L = self.launch
        u16 = np.uint16
        with L.lock:                      # one call at a time binds and launches
            self.streams.enter(st)
            L.bind("q", Q.as_param(u16, (b, s, h, d)))
            L.bind("k", K.as_param(u16, (b, s, hk, d)))
            L.bind("v", V.as_param(u16, (b, s, hk, d)))
            L.bind("k_words", K.as_param(np.uint64, (self.words,)))
            L.bind("v_words", V.as_param(np.uint64, (self.words,)))
            L.bind("out", O.as_param(u16, (b, s, h, d)))
            L.bind("lse", L_.as_param(np.float32, (b, h, s)))
            if self.user_maps is not None:
                L.bind("user_maps", self.user_maps.row((Q.ptr, K.ptr, V.ptr), st))
            L(st)
        return out, lse

    def _check_error(self, what):
        if self.comm is not None:
            self.comm.check(self.err, what)
        else:
            raise_if_timed_out(self.err, what)

    def synchronize(self, stream=None):
        """Wait for this rank's calls (on ``stream``, default the stream of the last call);
        raise MkTimeoutError if a device wait expired."""
        if self.comm is not None:
            self.comm.synchronize(stream if stream is not None else (self.streams.last or 0))
        elif not SIMULATOR:
            cuda.synchronize()
        self._check_error(self.name)

    def _start_at(self, calls):
        """Tests: set this rank's state as if ``calls`` calls had run (see GemmReduce)."""
        self.synchronize()
        self.frame.start_at(calls, self._flag_arrays)

    def free(self):
        """Collective: release the op's symmetric buffers (waits for this rank's calls)."""
        if self.freed:
            return
        self.synchronize()
        for buf in self._buffers:
            self.comm.free(buf)
        self._buffers = []
        self.freed = True


_SINGLE = {}    # one op per shape and GPU, kept (a captured graph may refer to it)


def attention(q, k, v, causal=False, scale=None, out=None, lse=None, stream=None,
              tile="auto"):
    """Attention on one GPU: q [batch, seq, heads, d], k and v [batch, seq, kv_heads, d] (bf16)
    -> ``(out, lse)``, out like q (bf16) and lse [batch, heads, seq] (fp32, natural log);
    causal masks keys after each query; tile: as for :class:`RingAttention`. The compute role
    of :class:`RingAttention` on a world of one (planned once per shape; ``attention.op(...)``
    returns that plan, e.g. to see which tile it runs)."""
    if not hasattr(q, "shape") or len(q.shape) != 4 or not hasattr(k, "shape") or \
            len(k.shape) != 4:
        raise MkValueError("mknumba.attention: q, k and v must be 4-d [batch, seq, heads, d]")
    op = _single(tuple(int(x) for x in q.shape), int(k.shape[2]), causal, scale, tile)
    return op(q, k, v, out=out, lse=lse, stream=stream)


def _single(q_shape, kv_heads, causal=False, scale=None, tile="auto"):
    b, s, h, d = q_shape
    key = (b, s, h, kv_heads, d, bool(causal), scale, tile,
           None if SIMULATOR else cuda.get_current_device().id)
    if key not in _SINGLE:
        _SINGLE[key] = RingAttention(None, b, s, h, kv_heads, d, causal=causal, scale=scale,
                                     tile=tile)
    return _SINGLE[key]


attention.op = _single


__all__ = ["RingAttention", "attention"]
