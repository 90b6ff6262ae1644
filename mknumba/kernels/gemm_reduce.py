"""GEMM + ReduceScatter and GEMM + AllReduce: one persistent kernel, hierarchical reduction.

Every rank computes a partial product ``A_r @ B_r`` (A_r: [m, k_local], B_r: [k_local, n]); the
result is the sum over all ranks, scattered by row blocks (ReduceScatter) or everywhere
(AllReduce). Blocks take roles by index; a role waits only on lower-numbered blocks of its own
GPU or on other ranks (DESIGN.md §3), so the stages below are in block order (the joiners, last
paragraph, are the one exception, and only where the whole grid is resident):

  compute  [0, C)       for t in order[blk::C]:  part[slot][tile t] <- A @ B (bf16)
                          publish tile_flags[t] = epoch         (sys scope if G > 1: peers read it)
                          1 node, deliver: a tile another local GPU owns goes instead into that
                          GPU's inbox plane (NVLink stores), its flag set there
                          RS, fold: an own tile (computed last) waits for its inbox flags, and
                          out[t] <- A @ B + the inbox planes, in the epilogue (no reduce pass)
  reduce   [C, R)       for each tile t this GPU owns (sched.reduce), taken from a queue:
                          wait tile_flags[t] of every local GPU (peer_view; deliver: the own
                          and inbox planes' flags, all local)
                          sum = sum over local GPUs of part[slot][tile t]    (NVLink loads, fp32;
                          deliver: local loads of the planes)
                          1 node, RS: out[t] <- sum          1 node, AR: out[t] <- sum, and
                                                       every local peer's part[t] <- sum (NVLink
                                                       stores; shared output and deliver: its
                                                       out[t]); publish its final_flags[t]
                          nodes > 1: stage[s] <- sum; publish red_flags[s];
                                     chunk counter += 1, the last tile publishes chunk_ready
                                     (both GPU scope: only this GPU's roles read them)
  send     [R, S)       for each (chunk, rail peer) command: wait chunk_ready; enqueue it to the
                          proxy (payload stage -> rail peer's recv, then its arrival flag)
  receive  [S, V)       for each tile t this GPU finishes: wait the arrival flags of its chunk
                          from every rail peer and red_flags of its own node's sum;
                          out[t] <- stage + sum of recv (fp32); AR with G > 1: every local
                          peer's part[t] <- same, publish its final_flags[t]
  pull     [V, grid)    (AR, G > 1) for each tile t another local GPU owns, from a queue:
                          wait final_flags[t] (its owner writes it here); out[t] <- part[t],
                          a local copy (none when the owner wrote this GPU's out[t] itself)

On one node the compute blocks, once their tiles are done, join the reduce queue, and with
AllReduce every compute and reduce block then joins the pull queue (``join``): the end of a call
is NVLink work, and a queue (``roles.blocks.take``) lets every idle SM take the next tile. The
held-back communication SMs carry the reduction while the GEMM runs; the joiners shorten the tail.

Stores rather than loads cross NVLink wherever the roles allow: a block stores over NVLink
about twice as fast as it loads (loads wait a round trip; benchmarks/NOTES.md). So the owner
pushes finished AllReduce tiles to the other local GPUs rather than letting them pull, and on
one node the GEMM's epilogue can deliver each partial tile to its owner (``deliver``). A user's
``out`` is not mapped into the other GPUs, so the owner pushes into their partials and each
copies the tile out; an AllReduce planned with ``shared_out`` owns a symmetric output that
every owner writes into directly (``C_DIRECT``; with delivery or between nodes).

Per GPU only 1/G of the output crosses the network, to its rail peers. Epochs, not resets: flags
take the call's epoch; ``slot = call & 1`` double-buffers ``part``, ``stage`` and ``recv``: a rank
cannot start call e+2 before every peer it exchanges with has finished call e (call e+1 waits on
that peer's call e+1 tiles or finished tiles, which follow its call e in stream order), so a
slot is never rewritten, nor delivered into, while a peer still reads it.
"""
import threading

import numpy as np
from numba import cuda

from .. import _compat  # noqa: F401  (numpy alias before numba compiles)
from .. import primitives as prim
from .._compat import SIMULATOR
from ..errors import ROLE_INTRA, ROLE_RECV, ROLE_SEND, MkError, MkValueError
from ..roles import bulk, compute
from ..roles.blocks import publish, publish_peers, stamp, take_band, wait
from ..roles.reduce import chunk_arrive, sum_local, reduce_peers
from ..roles.send import enqueue
from ..sched import split as sm_split
from ..sched.reduce import ReducePlan, nonempty
from ..sched.tiles import cdiv, default_group_m
from . import gemm as _gemm
from .launch import Prepared

# cfg: small integers of the launch, one int64 array (keeps the kernel signature readable).
(C_M, C_N, C_TILES_N, C_ME, C_G, C_NODES, C_OUT_ROW0, C_COMPUTE, C_REDUCE_END, C_SEND_END,
 C_RECV_END, C_ALLREDUCE, C_STAGE_SLOTS, C_RECV_SLOTS, C_NFINAL, C_RECV_CHUNKS, C_CHUNK,
 C_NCMDS, C_WIN_STAGE, C_WIN_RECV, C_WIN_ARRIVE, C_NRED, C_NPULL, C_WORDS, C_TRACE,
 C_SPLIT, C_JOIN, C_DELIVER, C_DIRECT, C_FOLD, C_OUT_SHARED) = range(31)
Q_REDUCE, Q_PULL = 0, 1          # the work queues (roles.blocks.take)

# trace rows (``trace=True``): globaltimer stamps, one row per event, indexed by the role's item
(T_BLOCK_START, T_BLOCK_END, T_RED_READY, T_RED_DONE, T_SEND_READY, T_SEND_ENQUEUED,
 T_RECV_ARRIVED, T_RECV_DONE, T_PULL_DONE) = range(9)
TRACE_EVENTS = ("block_start", "block_end", "reduce_ready", "reduce_done", "send_ready",
                "send_enqueued", "recv_arrived", "recv_done", "pull_done")

_BYTE = np.dtype(np.uint8) if SIMULATOR else np.uint8
_MASK32 = 0xFFFFFFFF


def _make_kernel(tile_init, tile, bm, bn, threads, moves="threads"):
    """The persistent kernel around one tile build and one way to move tiles within the node
    (``roles.bulk``: TMA bulk copies on sm_90a, plain loads and stores elsewhere). Each role is
    a device function below; the kernel at the end hands blocks to them in block order."""
    compute_role = compute.make_compute_role(tile_init, tile, compute.TO_OWNER)
    move_init, move_reduce, move_copy, move_drain = bulk.move_functions(moves)
    bw = bn // 4                      # words (4 bf16) per tile row
    tile_words = bm * bw
    tile_bytes = tile_words * 8
    bounds = {} if SIMULATOR else {"launch_bounds": (threads, 1)}

    # Every role takes ``ctx = (epoch, call, deadline, err, rank, trace)`` and returns False
    # when one of its waits timed out (the error record holds which), so the block can end.
    # The roles are inlined into the kernel: compiled apart, each would define the static
    # shared arrays of roles.blocks.wait and take again, and the link refuses the duplicates.

    @cuda.jit(device=True, inline=True)
    def origin(t, tiles_n, band, sub):
        """First row (elements) and column (words) of row band ``band`` of tile ``t``."""
        tm = t // tiles_n
        return tm * bm + band * sub, (t - tm * tiles_n) * bw

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
    def reduce_role(smem, cfg, tables, node, net, out, out_ptrs, queue, workers, ctx):
        """Intra-node reduce: for each tile (row band) this GPU owns, taken from the reduce
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
        seq = 0                       # this block's tile moves so far (roles.bulk)
        if nodes == 1:
            move_init(smem)
        split = cfg[C_SPLIT]          # items per tile: bands of bm / split rows (1 node only)
        sub = bm // split
        while True:
            i, it, band = take_band(queue, Q_REDUCE, call, cfg[C_NRED], split, workers)
            if it >= cfg[C_NRED]:
                break
            t = red_tiles[it]
            r0, c0 = origin(t, cfg[C_TILES_N], band, sub)
            rows = min(sub, m - r0)   # <= 0 past a ragged edge: no words, flag still set
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
            stamp(tr, trace, T_RED_READY, i)
            if nodes == 1:
                dst = (r0 - cfg[C_OUT_ROW0]) * wn + c0
                if deliver:           # all G partials are local: plane 0 + planes 1..G-1
                    to_ptrs, to, to_off = push_target(cfg, out_ptrs, out, dst, part_ptrs,
                                                      part, src)
                    sum_local(part, src, part, src + plane, plane, G - 1, out, dst, wn,
                              to_ptrs, to, G, me, to_off, wn, allreduce, rows, wcols, wn)
                else:
                    seq = move_reduce(smem, seq, part_ptrs, part, G, me, src, wn, out, dst,
                                      wn, allreduce, rows, wcols)
                if allreduce:
                    move_drain(smem)                # the pushed tile is written, then its flag
                    publish_peers(final_flag_ptrs, final_flags, G, me, t * split + band,
                                  epoch)
            else:
                s = red_slots[it]
                reduce_peers(part_ptrs, part, G, me, src, wn, stage,
                             stage_base + s * tile_words, bw, False, rows, wcols)
                publish(red_flags, s, epoch, False)           # read by this GPU's receive
                q = red_chunks[it]
                if q >= 0:
                    chunk_arrive(chunk_count, chunk_ready, q,
                                 (np.int64(call) * chunk_tiles[q]) & _MASK32, epoch)
            stamp(tr, trace, T_RED_DONE, i)
        if nodes == 1:
            move_drain(smem)          # no bulk store outlives the block
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
        for c in range(first, cfg[C_NCMDS], step):
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
        for i in range(first, nfinal, step):
            for s in range(nsrc):
                if not wait(arrive, s * cfg[C_RECV_CHUNKS] + i // cfg[C_CHUNK], epoch, deadline,
                            err, rank, ROLE_RECV):
                    return False
            stamp(tr, trace, T_RECV_ARRIVED, i)
            fs = final_slots[i]
            if not wait(red_flags, fs, epoch, deadline, err, rank, ROLE_RECV, False):
                return False
            t = final_tiles[i]
            r0, c0 = origin(t, cfg[C_TILES_N], 0, bm)
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
    def pull_role(smem, cfg, pull_tiles, part, final_flags, out, out_ptrs, queue, workers,
                  ctx):
        """AllReduce, G > 1: for each tile (row band) another local GPU owns, taken from the
        pull queue, wait for its final flag (the owner pushed the sum into this GPU's
        partials, or with ``C_DIRECT`` into its shared output), then copy it to ``out``
        (local); when ``out`` is that shared output (``C_OUT_SHARED``) only wait, so that the
        call ends with its output complete."""
        epoch, call, deadline, err, rank, trace = ctx
        tr = cfg[C_TRACE] != 0
        m, wn = cfg[C_M], cfg[C_N] // 4
        part_base = (call & 1) * cfg[C_WORDS]
        seq = 0
        move_init(smem)
        split = cfg[C_SPLIT]
        sub = bm // split
        while True:
            i, it, band = take_band(queue, Q_PULL, call, cfg[C_NPULL], split, workers)
            if it >= cfg[C_NPULL]:
                break
            t = pull_tiles[it]
            if not wait(final_flags, t * split + band, epoch, deadline, err, rank, ROLE_INTRA):
                return False
            if cfg[C_OUT_SHARED] == 0:
                r0, c0 = origin(t, cfg[C_TILES_N], band, sub)
                src, src_off = part, part_base + r0 * wn + c0
                if cfg[C_DIRECT] != 0:        # the owner wrote it into my shared output
                    src, src_off = prim.peer_view(out_ptrs, cfg[C_ME], out), r0 * wn + c0
                seq = move_copy(smem, seq, src, src_off, wn, out, r0 * wn + c0, wn,
                                min(sub, m - r0), min(bw, wn - c0))
            stamp(tr, trace, T_PULL_DONE, i)
        move_drain(smem)
        return True

    @cuda.jit(**bounds)
    def gemm_reduce_kernel(a, bt, tmaps, part_c, part, part_ptrs, tile_flags, tile_flag_ptrs,
                           final_flags, final_flag_ptrs, out, out_ptrs, out_c, cfg, order,
                           owner_of_row,
                           red_tiles, red_slots,
                           red_chunks, chunk_tiles, cmds, final_tiles, final_slots, pull_tiles,
                           stage, recv, arrive, red_flags, chunk_count, chunk_ready,
                           ring, head, tail, epoch, call, timeout_ns, err, rank, trace, queue):
        """a [m, k], bt [n, k], part_c [2, P, m, n]: bf16 bits (per slot, plane 0 this GPU's
        partials, planes 1..G-1 its inbox when delivering); part: the same memory as uint64
        words [2 * P * m * n/4] (symmetric); out: uint64 words of the bf16 output (out_ptrs:
        its address table when it is the op's shared output, cfg[C_DIRECT]; out_c: the same
        memory as bf16 bits [out rows, n], where a folding compute role writes); stage/recv:
        tile-major uint64 [2 * slots * bm * bn/4]; flags uint32; tables int32 (sched.reduce);
        trace int64 [TRACE_EVENTS, items] (written only when cfg[C_TRACE]); queue uint32 [2]:
        the reduce and pull work queues' ticket counters."""
        smem = cuda.shared.array(0, dtype=_BYTE)
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
            ok = reduce_role(smem, cfg, (order, red_tiles, red_slots, red_chunks, chunk_tiles),
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
            ok = pull_role(smem, cfg, pull_tiles, part, final_flags, out, out_ptrs, queue,
                           pull_workers, ctx)
        if ok:
            stamp(tr, trace, T_BLOCK_END, blk)

    return gemm_reduce_kernel


SIMT_THREADS = 32 if SIMULATOR else compute.SIMT_THREADS   # the simulator runs threads in Python
_KERNELS = {}             # (tile build name, moves) -> (threads per block, persistent kernel)
_SIM_SMS = 6              # the simulator's "device": compute, reduce, send, receive, pull
_COMPILED = {}            # (kind, moves, argtypes) -> (compiled kernel, blocks per SM)
_COMPILE_LOCK = threading.Lock()


def _build(kind, moves):
    """(roles.compute.TileBuild, threads per block, kernel) of a tile build name and a way to
    move tiles (roles.bulk.MOVES)."""
    b = compute.tile_build(kind)
    if (kind, moves) not in _KERNELS:
        threads = SIMT_THREADS if kind == "simt" else b.threads
        _KERNELS[kind, moves] = (threads, _make_kernel(b.init, b.tile, *b.shape, threads, moves))
    return (b, *_KERNELS[kind, moves])


def _compiled(kind, moves, args):
    import numba
    key = (kind, moves, tuple(numba.typeof(x) for x in args))
    with _COMPILE_LOCK:
        if key not in _COMPILED:
            build, _, disp = _build(kind, moves)
            # off the simulator every build runs with its own thread count
            _COMPILED[key] = (disp, 1) if SIMULATOR else _gemm._load(disp, key[2], build)
        return _COMPILED[key]


class _Solo:
    """One rank's call, in place of a prepared launch: the plain GEMM into ``out`` (``run``
    takes the fused launch's epoch and call number, which it does not need)."""

    def __init__(self, gemm, a, b, out, stream):
        self.gemm, self.a, self.b, self.out, self.stream = gemm, a, b, out, stream

    def run(self, epoch, call):
        return self.gemm(self.a, self.b, b_layout="kn", out=self.out, stream=self.stream)


class GemmReduce:
    """Plan once, call many times (base of :class:`GemmReduceScatter` and :class:`GemmAllReduce`).

    comm: the Comm; m, n, k: the full output [m, n] and this rank's inner dimension k (= k_local);
    dtype: "bfloat16" (inputs, output; fp32 accumulation everywhere).
    comm_sms: SMs held back from the GEMM for the communication roles (default: the recorded
    sweep in ``sched.split``); chunk_bytes: network chunk size (rounded to whole tiles);
    tile: "auto" (on sm_90a ``roles.compute.SM90_FUSED_TILE``, else "simt") | "sm90" | "simt"
    (or another build, ``roles.compute.tile_build``);
    split: row bands per tile in the 1-node reduce and pull roles (default 1, see
    :meth:`_split`); join: idle compute blocks help the reduce and pull roles (default: on
    one node on the GPU, see :meth:`_join`); deliver: compute blocks write tiles other local
    GPUs own straight into those GPUs' memory (one node; default per shape from the recorded
    sweep, see :meth:`_deliver`); fold (ReduceScatter, with deliver): each GPU computes its
    own tiles last and adds the delivered partials in their epilogue (:meth:`_fold`);
    moves: how the reduce and pull roles move tiles over NVLink: "threads" (plain loads and
    stores, ``roles.reduce``; the default), or on sm_90a "bulk" / "bulk:w1" (TMA bulk copies,
    ``roles.bulk``: correct, but slower per block on an H200, benchmarks/NOTES.md);
    shared_out (AllReduce): the op owns a symmetric [m, n] output (:meth:`output`) that each
    tile's owner writes on every local GPU, with no copy at the end (with delivery or
    between nodes; other outputs still work, through the copy); a call with ``out=None``
    returns it, valid until the next call, like an in-place all-reduce;
    trace: stamp every role's steps with the GPU clock (read them with :meth:`trace_events`
    after :meth:`synchronize`). Calls are asynchronous on the stream of the inputs (the
    current PyTorch stream for tensors, else ``stream``); :meth:`synchronize` waits and raises
    any device-side timeout. On one rank there is nothing to reduce: calls run the plain
    persistent GEMM (``mknumba.Gemm``) into ``out``, unless ``trace`` asks for the fused roles.
    """

    allreduce = False
    name = "GemmReduce"

    def __init__(self, comm, m, n, k, dtype="bfloat16", *, comm_sms=None, chunk_bytes=None,
                 tile="auto", group_m=None, trace=False, moves=None, split=None, join=None,
                 deliver=None, shared_out=False, fold=None):
        if str(dtype).split(".")[-1] not in ("bfloat16", "bf16"):
            raise MkValueError(f"{self.name}: dtype must be bfloat16, got {dtype}")
        m, n, k = int(m), int(n), int(k)
        _gemm._check_shapes(m, n, k)
        self.comm, self.m, self.n, self.k = comm, m, n, k
        self.kind = _gemm.Gemm(tile=tile)._kind()
        if tile == "auto" and self.kind == "sm90":
            self.kind = compute.SM90_FUSED_TILE
        self.build = compute.tile_build(self.kind)
        if self.build.timing_only:
            raise MkValueError(f"{self.name}: tile build {tile!r} leaves the output unwritten "
                               "(timing only)")
        self.bm, self.bn = self.build.shape
        self.moves = moves or "threads"
        is_bulk = self.moves.startswith("bulk")
        if self.moves not in bulk.MOVES or (is_bulk and not self.build.tma):
            raise MkValueError(f"{self.name}: moves={moves!r}: 'threads', or 'bulk' / "
                               "'bulk:w1' with an sm_90a tile build")
        if is_bulk and self.build.smem_bytes < bulk.SMEM_BYTES:
            raise MkValueError(f"{self.name}: tile build {self.kind!r} launches with "
                               f"{self.build.smem_bytes} bytes of shared memory; bulk moves "
                               f"need {bulk.SMEM_BYTES}")
        if n % 4:
            raise MkValueError(f"{self.name}: n={n} must be a multiple of 4")
        G, nodes = comm.local_size, comm.nodes
        self.world = comm.size
        tiles_m, tiles_n = cdiv(m, self.bm), cdiv(n, self.bn)
        sms = _SIM_SMS if SIMULATOR else cuda.get_current_device().MULTIPROCESSOR_COUNT
        self.topology = f"{nodes}x{G}"
        recorded = sm_split.choose(self.kernel_name, self.topology, m, n, k, sms)
        self.comm_sms = int(recorded.comm_sms if comm_sms is None else comm_sms)
        tile_bytes = self.bm * self.bn * 2
        if chunk_bytes is None:
            chunk_bytes = sm_split.default_chunk_bytes(self.topology)
        self.chunk_tiles = max(1, int(chunk_bytes) // tile_bytes)
        self.group_m = int(group_m or default_group_m(tiles_m, tiles_n, 128 if not SIMULATOR
                                                      else 2))
        self.split = self._split(split, nodes)
        self.join = self._join(join, nodes)
        self.deliver = self._deliver(deliver, nodes, G, recorded.deliver)
        self.fold = self._fold(fold, recorded.fold)
        # nothing to reduce: the one block the reduce role needs. Not in the simulator, whose
        # blocks run one at a time: there a compute block waiting on a peer's delivery can
        # hang if that comes from a later block of the peer (with its two compute blocks and
        # the tests' shapes it comes from the same block or an earlier one; else the bounded
        # wait reports it)
        if self.fold and comm_sms is None and not recorded.fold and not SIMULATOR:
            self.comm_sms = 1
        self.plan = ReducePlan(self.allreduce, m, n, self.bm, self.bn, nodes, G, comm.node,
                               comm.local_rank, self.chunk_tiles, self.group_m, self.fold)
        self.out_rows = m if self.allreduce else m // self.world
        self.tracing = bool(trace)
        # One rank: nothing to reduce, so the op is the plain persistent GEMM into ``out`` (no
        # partials to write and copy back: ~0.5 ms of a 1.3 ms call at m = n = 16384, k = 1024).
        # trace=True keeps the fused kernel, whose roles it stamps.
        self.solo = self.world == 1 and not self.tracing
        if shared_out and not self.allreduce:
            raise MkValueError(f"{self.name}: shared_out is for AllReduce (each rank's "
                               "ReduceScatter output is written by its own GPU only)")
        self.shared_out = bool(shared_out)
        # the owners write the shared output of every local GPU (sum_local's push target)
        self.direct = self.shared_out and not self.solo and G > 1 and (self.deliver or nodes > 1)
        self._roles(sms, G, nodes)
        if not self.solo:
            self._check_agreement(comm)
        self._solo_gemm = _gemm.Gemm(tile=tile, group_m=group_m) if self.solo else None
        self._views = {}      # the shared output as the caller's array type
        if self.solo:
            self._buffers = []
            self.shared = (cuda.device_array(self.m * self.n // 4, np.uint64)
                           if self.shared_out else None)
        else:
            self._allocate(G, nodes)
        self.err = comm.new_error_record()
        self.epoch = 0
        self.calls = 0
        self._tmaps = {}
        self._prepared = {}
        self._lock = threading.Lock()

    kernel_name = "gemm_reduce"

    # -- planning ---------------------------------------------------------------------------------
    def _roles(self, sms, G, nodes):
        """Split the held-back SMs between the communication roles (block index order)."""
        s = self.comm_sms
        need = 1 + (2 if nodes > 1 else 0) + (1 if self.allreduce and G > 1 else 0)
        if not need <= s < sms:
            raise MkValueError(f"{self.name}: comm_sms={s} must be in [{need}, {sms - 1}] "
                               f"for topology {self.topology}")
        send = 1 if nodes > 1 else 0
        p = self.plan
        pull = 0
        if self.direct:                   # nothing to copy: the pull role only waits
            pull = 1
        elif self.allreduce and G > 1 and nodes > 1:
            pull = max(1, (s - send) // 4)
        elif self.allreduce and G > 1:    # by words moved: the reduce reads G tiles and writes
            red = len(p.red_tiles) * 2 * G      # G (one here, G - 1 pushed); a pull copies one
            pulled = len(p.pull_tiles) * 2
            pull = min(s - 1, max(1, round(s * pulled / max(red + pulled, 1))))
        recv = 0
        if nodes > 1:   # reduce and receive split by words moved: G reads + 1 write per reduced
                        # tile, one read per node + 1-2 writes per finished tile
            red = len(p.red_tiles) * (G + 1)
            fin = p.n_final * (nodes + 1 + (1 if self.allreduce and G > 1 else 0))
            share = fin / (red + fin) if red + fin else 0.0    # a GPU may own no tiles
            recv = min(s - send - pull - 1, max(1, round((s - send - pull) * share)))
        reduce = s - send - recv - pull
        self.role_blocks = dict(compute=sms - s, reduce=reduce, send=send, recv=recv, pull=pull)
        self.grid = sms
        self.sms = sms

    def _split(self, split, nodes):
        """Row bands per tile for the 1-node reduce and pull roles (default 1). Meant for the
        tail of small shapes, where a few last tiles keep a few reduce blocks busy while the
        rest idle; measured on 2xH200 (benchmarks/NOTES.md, seventh session) 4 bands made the
        2048-point calls slower (more flags, each behind a system fence), so it is opt-in."""
        if split in (None, 1):
            return 1
        if nodes > 1:     # stage slots and network chunks count whole tiles
            raise MkValueError(f"{self.name}: split={split} needs one node")
        split = int(split)
        if split < 1 or self.bm % split:
            raise MkValueError(f"{self.name}: split={split} must divide the tile height "
                               f"{self.bm}")
        return split

    def _join(self, join, nodes):
        """Whether compute blocks, once their tiles are done, join the reduce queue, and (for
        AllReduce) compute and reduce blocks then join the pull queue: on one node, where the
        tail of a call is NVLink work that every idle SM can share. Default on, on the GPU.

        A joined block waits on tiles of higher-numbered blocks, which needs the whole grid
        resident (one block per SM, as launched); the simulator runs blocks one at a time, so
        there it is off. Bulk moves keep their own barriers in shared memory: off with them."""
        return self._option(join, nodes == 1 and not SIMULATOR and self.moves == "threads",
                            True, "join=True needs one node, a GPU (not the simulator) and "
                                  "moves='threads'")

    def _deliver(self, deliver, nodes, G, recorded):
        """Whether compute blocks write each tile another local GPU owns straight into that
        GPU's inbox (NVLink stores from the GEMM's epilogue), so the owner's reduce reads only
        local memory, instead of leaving it in their own memory for the owner to load over
        NVLink (a block loads over NVLink at about half the rate it stores). One node, plain
        tile moves; costs (G - 1) more planes of m x n partials per slot. Default: what the
        recorded sweep chose for the nearest shape (``sched.split``: on 2xH200 it was faster
        at every 1x2 point but RS at m = 2048)."""
        return self._option(deliver, nodes == 1 and G > 1 and self.moves == "threads",
                            recorded, "deliver=True needs one node of several GPUs and "
                                      "moves='threads'")

    def _check_agreement(self, comm):
        """Collective: every rank must plan the same exchange (the flags and buffers it writes
        into on other GPUs follow from these); SM splits and joining are each rank's own."""
        mine = dict(op=self.name, m=self.m, n=self.n, tile=(self.bm, self.bn),
                    chunk_tiles=self.chunk_tiles, split=self.split, deliver=self.deliver,
                    fold=self.fold, shared_out=self.shared_out)
        plans = comm.mpi.allgather(mine)
        for r, p in enumerate(plans):
            if p != mine:
                diff = {key: (mine[key], p[key]) for key in mine if p[key] != mine[key]}
                raise MkValueError(f"{self.name}: rank {comm.rank} and rank {r} planned "
                                   f"different exchanges (this rank's vs theirs): {diff}")

    def _fold(self, fold, recorded):
        """Whether the owner of a ReduceScatter tile adds the other local GPUs' delivered
        partials in its own GEMM epilogue and writes the sum to ``out`` (it computes its own
        row block last, ``sched.reduce``), instead of a reduce pass over three planes. Needs
        ``deliver`` (one node of several GPUs) and row bands of whole tiles (``split`` 1).
        Default: the recorded sweep's choice for the nearest shape."""
        return self._option(fold, not self.allreduce and self.deliver and self.split == 1,
                            recorded, "fold=True needs ReduceScatter with deliver=True (one "
                                      "node of several GPUs) and split=1")

    def _option(self, value, possible, default, needs):
        """An on/off option: None takes ``default`` where ``possible`` (else off); True where
        it is not possible is an error that says what it ``needs``."""
        if value is None:
            return bool(possible and default)
        if value and not possible:
            raise MkValueError(f"{self.name}: {needs}")
        return bool(value)

    def _allocate(self, G, nodes):
        comm, plan = self.comm, self.plan
        self.words = self.m * self.n // 4
        self.planes = G if self.deliver else 1     # own partials, then an inbox per local peer
        self.part = comm.alloc_symmetric((2 * self.planes * self.words,), np.uint64)
        self.tile_flags = comm.alloc_flags(self.planes * plan.tiles_m * plan.tiles_n)
        self.final_flags = comm.alloc_flags(plan.tiles_m * plan.tiles_n * self.split
                                            if self.allreduce else 1)
        self._buffers = [self.part, self.tile_flags, self.final_flags]
        self.shared = None
        if self.shared_out:
            self.shared = comm.alloc_symmetric((self.m * self.n // 4,), np.uint64)
            self._buffers.append(self.shared)
        tile_words = self.bm * self.bn // 4
        # Symmetric buffers must have one size on every rank: take the world's largest.
        from mpi4py import MPI
        stage_slots = comm.mpi.allreduce(plan.stage_slots, op=MPI.MAX)
        recv_slots = comm.mpi.allreduce(plan.recv_slots, op=MPI.MAX)
        n_arrive = comm.mpi.allreduce((nodes - 1) * plan.recv_chunks, op=MPI.MAX)
        n_chunks = comm.mpi.allreduce(plan.n_chunks, op=MPI.MAX)
        self.stage_slots, self.recv_slots = stage_slots, recv_slots
        wins = (0, 0, 0)
        if nodes > 1:
            if comm.proxy is None:
                raise MkError(f"{self.name}: {nodes} nodes need the proxy (mknumba.proxy), "
                              "which this Comm did not start")
            self.stage = comm.alloc_symmetric((max(1, 2 * stage_slots * tile_words),), np.uint64)
            self.recv = comm.alloc_symmetric((max(1, 2 * recv_slots * tile_words),), np.uint64)
            self.arrive = comm.alloc_flags(max(1, n_arrive))
            self.red_flags = comm.alloc_flags(max(1, stage_slots))
            self.chunk_count = comm.alloc_flags(max(1, n_chunks))
            self.chunk_ready = comm.alloc_flags(max(1, n_chunks))
            self._buffers += [self.stage, self.recv, self.arrive, self.red_flags,
                              self.chunk_count, self.chunk_ready]
            wins = (comm.proxy.register(self.stage), comm.proxy.register(self.recv),
                    comm.proxy.register(self.arrive))
            ring, head, tail = comm.proxy.device_args()
            dev = [x.local for x in (self.stage, self.recv, self.arrive, self.red_flags,
                                     self.chunk_count, self.chunk_ready)]
        else:
            z64, z32 = np.zeros(1, np.uint64), np.zeros(1, np.uint32)
            dev = [_to_device(z64), _to_device(z64)] + [_to_device(z32) for _ in range(4)]
            ring, head, tail = (cuda.mapped_array(12, np.uint32), _to_device(z32),
                                cuda.mapped_array(1, np.uint32))
        rb = self.role_blocks
        reduce_end = rb["compute"] + rb["reduce"]
        send_end = reduce_end + rb["send"]
        recv_end = send_end + rb["recv"]
        cfg = np.zeros(C_OUT_SHARED + 1, np.int64)
        cfg[[C_M, C_N, C_TILES_N, C_ME, C_G, C_NODES]] = (self.m, self.n, plan.tiles_n,
                                                          comm.local_rank, G, nodes)
        cfg[C_OUT_ROW0] = 0 if self.allreduce else comm.rank * self.out_rows
        cfg[[C_COMPUTE, C_REDUCE_END, C_SEND_END, C_RECV_END]] = (rb["compute"], reduce_end,
                                                                  send_end, recv_end)
        cfg[C_ALLREDUCE] = int(self.allreduce)
        cfg[[C_STAGE_SLOTS, C_RECV_SLOTS, C_NFINAL, C_RECV_CHUNKS, C_CHUNK, C_NCMDS]] = (
            stage_slots, recv_slots, plan.n_final, plan.recv_chunks, plan.chunk_tiles_max,
            plan.n_cmds)
        cfg[[C_WIN_STAGE, C_WIN_RECV, C_WIN_ARRIVE]] = wins
        cfg[[C_NRED, C_NPULL, C_WORDS]] = (len(plan.red_tiles), len(plan.pull_tiles),
                                           self.planes * self.words)     # words per slot
        cfg[C_DELIVER] = int(self.deliver)
        cfg[C_FOLD] = int(self.fold)
        cfg[C_TRACE] = int(self.tracing)
        cfg[C_SPLIT] = self.split
        cfg[C_JOIN] = int(self.join)
        cfg[C_DIRECT] = int(self.direct)
        into_shared = cfg.copy()      # for calls into the shared output: no copy at the end
        into_shared[C_OUT_SHARED] = int(self.direct)
        self._cfg = {False: _to_device(cfg), True: _to_device(into_shared)}
        self.queue = _to_device(np.zeros(2, np.uint32))
        items = max(self.grid, len(plan.red_tiles) * self.split, plan.n_cmds, plan.n_final,
                    len(plan.pull_tiles) * self.split) if self.tracing else 1
        self._trace = _to_device(np.zeros((len(TRACE_EVENTS), items), np.int64))
        tables = [plan.order, plan.owner_of_row, plan.red_tiles, plan.red_slots, plan.red_chunks,
                  plan.chunk_tiles, plan.cmds, plan.final_tiles, plan.final_slots,
                  plan.pull_tiles]
        self._tables = [_to_device(nonempty(np.ascontiguousarray(t))) for t in tables]
        self._net = dev + [ring, head, tail]

    # -- calls ------------------------------------------------------------------------------------
    def out_shape(self):
        return (self.out_rows, self.n)

    def output(self, torch=False):
        """The shared output (``shared_out=True``): [m, n] bf16 on this GPU, as a PyTorch
        tensor (``torch=True``) or a numba array of bf16 bits (uint16), no copy. Each call
        into it overwrites it: read it before the next call (in stream order, as that call's
        kernel only starts after earlier work on the stream), and not after :meth:`free`. The
        owners write it directly only with delivery or between nodes (``op.direct``); else it
        is an ordinary output, filled by the copy at the end."""
        if not self.shared_out:
            raise MkValueError(f"{self.name}: planned without shared_out=True")
        if self.shared is None:
            raise MkValueError(f"{self.name}: freed")
        kind = "torch" if torch else "numba"
        if kind not in self._views:
            mem = self.shared if self.solo else self.shared.local
            view = mem.view(np.uint16).reshape(self.out_shape())
            if torch:
                import torch as _torch
                view = _torch.as_tensor(mem.view(np.int16).reshape(self.out_shape()),
                                        device=f"cuda:{self.comm.device_id}")
                view = view.view(_torch.bfloat16)
            self._views[kind] = view
        return self._views[kind]

    def __call__(self, a, b, out=None, stream=None):
        """a: [m, k] bf16, b: [k, n] bf16 (row-major, or a column-major view such as ``w.T``
        of a row-major [n, k] ``w``: no copy) -> out [m / world, n] (ReduceScatter) or [m, n]
        (AllReduce), bf16. PyTorch tensors in -> tensor out; numba/CuPy arrays of bf16 bits
        (uint16/int16) in -> numba array out. ``out=None``: a new array, or with
        ``shared_out`` the shared output (:meth:`output`)."""
        self.comm.check(self.err, f"{self.name} (an earlier call)")
        if out is None and self.shared_out:
            out = self.output(torch=type(a).__module__.split(".")[0] == "torch")
        key = _key(a, b, out, stream)
        prep = self._prepared.get(key) if key is not None else None
        if prep is None:
            prep = self._prepare(a, b, out, stream)
            if key is not None:
                if len(self._prepared) > 16:
                    self._prepared.clear()
                self._prepared[key] = prep
        with self._lock:
            self.epoch = self.epoch % _MASK32 + 1       # never 0: fresh flags hold 0
            self.calls = (self.calls + 1) & _MASK32     # counters and slot parity follow it
            res = prep.run(self.epoch, self.calls)
        return out if out is not None else res

    def _prepare(self, a, b, out, stream):
        A, B = _gemm._Operand(a, "a"), _gemm._Operand(b, "b")
        s = self._check_inputs(A, B, stream)
        if self.solo:
            if out is not None:
                self._output(A, out)  # the same checks of ``out`` as the fused launch
            return _Solo(self._solo_gemm, a, b, out, stream)
        bt = _gemm.Gemm._b_as_nk(B, "kn", self.n, self.k, s)
        res, out_words, out_c = self._output(A, out)
        if self.build.tma:
            tk = (_gemm._ptr(A.arr), _gemm._ptr(bt))
            if tk not in self._tmaps:
                host = np.concatenate([
                    _gemm._tensor_map(tk[0], self.m, self.k, compute.SM90_TILE[0]),
                    _gemm._tensor_map(tk[1], self.n, self.k, compute.SM90_TILE[1])])
                self._tmaps = {tk: cuda.to_device(host)}
            tmaps = self._tmaps[tk]
        else:
            tmaps = _to_device(np.zeros(32, np.uint64))
        part_c = self.part.local.view(np.uint16).reshape(2, self.planes, self.m, self.n)
        # the owners write every GPU's shared output (C_DIRECT, planned); a call into another
        # array copies it out of this GPU's shared output at the end
        into_shared = self.direct and _address(out_words) == _address(self.shared.local)
        out_ptrs = (self.shared or self.part).ptrs     # read only when direct
        args = [A.arr, bt, tmaps, part_c, self.part.local, self.part.ptrs,
                self.tile_flags.local, self.tile_flags.ptrs, self.final_flags.local,
                self.final_flags.ptrs, out_words, out_ptrs, out_c, self._cfg[into_shared]] + \
            self._tables + self._net + [
                np.uint32(0), np.uint32(0), np.uint64(self.comm.timeout_ns), self.err,
                np.int64(self.comm.rank), self._trace, self.queue]
        kern, bps = _compiled(self.kind, self.moves, args)
        if bps < 1:
            raise MkError(f"{self.name}: the kernel does not fit on an SM")
        grid = self.sms  # one block per SM: the persistent grid is co-resident
        keep = (a, b, bt, out)
        _, threads, _ = _build(self.kind, self.moves)
        return Prepared(kern, args, grid, threads, self.build.smem_bytes, s,
                        (_EPOCH_ARG, _CALL_ARG), res, keep)

    def _check_inputs(self, A, B, stream):
        """Shapes, layout and device of a and b against the plan; the stream of the call."""
        if (A.torch is None) != (B.torch is None):
            raise MkValueError(f"{self.name}: a and b must both be PyTorch tensors or both be "
                               "device arrays")
        if A.shape != (self.m, self.k):
            raise MkValueError(f"{self.name}: a has shape {A.shape}, planned [{self.m}, {self.k}]"
                               " (A: [m, k_local])")
        if B.shape != (self.k, self.n):
            raise MkValueError(f"{self.name}: b has shape {B.shape}, planned [{self.k}, {self.n}]"
                               " (B: [k_local, n])")
        if not A.row_major:
            raise MkValueError(f"{self.name}: a must be row-major and contiguous")
        if A.torch is not None:
            import torch
            if A.device != self.comm.device_id or B.device != self.comm.device_id:
                raise MkValueError(f"{self.name}: inputs must live on this rank's GPU "
                                   f"cuda:{self.comm.device_id}")
            return cuda.external_stream(torch.cuda.current_stream(A.device).cuda_stream)
        return stream if stream is not None else (0 if SIMULATOR else cuda.default_stream())

    def _output(self, A, out):
        shape = self.out_shape()
        if out is None:
            if A.torch is not None:
                import torch
                out = torch.empty(shape, dtype=torch.bfloat16, device=A.torch.device)
            else:
                out = cuda.device_array(shape, dtype=np.uint16)
        O = _gemm._Operand(out, "out")
        if O.shape != shape or not O.row_major:
            raise MkValueError(f"{self.name}: out must be a contiguous row-major "
                               f"[{shape[0]}, {shape[1]}] bf16 array, got {O.shape}")
        if A.torch is not None and O.torch is None:
            raise MkValueError(f"{self.name}: out must be a PyTorch tensor like the inputs")
        _gemm.check_aligned(O.arr, "out", self.name)
        return (out, O.arr.reshape(shape[0] * shape[1]).view(np.uint64),
                O.arr.reshape(shape).view(np.uint16))

    def synchronize(self, stream=None):
        """Wait for this rank's calls; raise MkTimeoutError if a device wait expired."""
        self.comm.synchronize(stream or 0)   # polls: the proxy thread needs the GIL meanwhile
        self.comm.check(self.err, self.name)

    def clear_trace(self):
        """Zero the stamps (so a later read shows only what the next call reached)."""
        if self.tracing:
            self._trace.copy_to_device(np.zeros(self._trace.shape, np.int64))

    def trace_events(self):
        """The last traced call's stamps: {event: int64 ns array by item (0: not reached)} plus
        ``role_blocks``. Block events index blocks (in role order: compute, reduce, send,
        receive, pull); the others index each role's items (reduced tiles, send commands,
        finished tiles, pulled tiles). Call after :meth:`synchronize`."""
        if not self.tracing:
            raise MkValueError(f"{self.name}: built without trace=True")
        rows = self._trace.copy_to_host()
        return dict(zip(TRACE_EVENTS, rows), role_blocks=dict(self.role_blocks))

    def free(self):
        """Collective: release the op's symmetric buffers."""
        for buf in self._buffers:
            self.comm.free(buf)
        self._buffers = []
        self._prepared.clear()
        self._views.clear()
        self.shared = None


def _arg_positions():
    """Positions of ``epoch`` and ``call`` among the kernel's arguments (a launch rewrites only
    those two; every build's kernel has the same parameters)."""
    import inspect
    names = list(inspect.signature(_make_kernel(None, None, 1, 4, 1).py_func).parameters)
    return names.index("epoch"), names.index("call")


_EPOCH_ARG, _CALL_ARG = _arg_positions()


def _to_device(x):
    return cuda.to_device(x)


def _address(arr):
    """Device address of a numba (or simulator) array's first element."""
    return arr._ary.__array_interface__["data"][0] if SIMULATOR else _gemm._ptr(arr)


def _key(a, b, out, stream):
    """Reuse a prepared launch for the same tensors/arrays (pointers, shapes, strides, stream)."""
    if out is None:
        return None
    def desc(x):
        if type(x).__module__.split(".")[0] == "torch":
            return (x.data_ptr(), tuple(x.shape), tuple(x.stride()), str(x.dtype), x.device.index)
        cai = getattr(x, "__cuda_array_interface__", None)
        if cai is None:
            return None
        return (cai["data"][0], tuple(cai["shape"]), cai.get("strides"), cai["typestr"])
    ds = [desc(x) for x in (a, b, out)]
    if any(d is None for d in ds) or SIMULATOR:
        return None
    torch_stream = None
    if type(a).__module__.split(".")[0] == "torch":
        import torch
        torch_stream = torch.cuda.current_stream(a.device).cuda_stream
    return (tuple(ds), torch_stream, id(stream))
