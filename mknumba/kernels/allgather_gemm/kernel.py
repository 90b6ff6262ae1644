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
from ...roles.blocks import launch_context, publish, stamp, wait
from ...roles.reduce import copy_tile_2d
from ...roles.send import enqueue_rail
from ..launch import array_type

Bits2D, Bits3D = array_type(np.uint16, 2), array_type(np.uint16, 3)
Words, Flags, Ints = array_type(np.uint64, 1), array_type(np.uint32, 1), array_type(np.int32, 1)
Cfg, Record, Trace = array_type(np.int64, 1), array_type(np.int64, 1), array_type(np.int64, 2)

#: cfg: the small integers of a launch, one int64 array, by name (``launch.pack``). me: world
#: rank, local: rank in the node of g GPUs; shard: rows per rank (m / world); rows: rows per
#: part of a shard (its last part may be shorter), parts: parts per shard; *_end: the roles'
#: block ranges; win_*: the proxy's windows; collect: this call fills the caller's gathered A;
#: trace: stamp the roles' items.
CFG_FIELDS = ("m", "n", "k", "shard", "rows", "parts", "me", "local", "g", "nodes", "world",
              "tiles_n", "send_end", "forward_end", "collect_end", "win_gathered",
              "win_flags", "collect", "trace")
(C_M, C_N, C_K, C_SHARD, C_ROWS, C_PARTS, C_ME, C_LOCAL, C_G, C_NODES, C_WORLD, C_TILES_N,
 C_SEND_END, C_FORWARD_END, C_COLLECT_END, C_WIN_GATHERED, C_WIN_FLAGS,
 C_COLLECT, C_TRACE) = range(len(CFG_FIELDS))

# trace rows (``trace=True``): globaltimer stamps, one row per event, indexed by block
# (block_*), by part of this rank's shard (send_*: stored in this GPU's gathered A, flag
# published, between nodes handed to the proxy; push_*: stored into every other GPU of the
# node), by rail peer and part (forward_*: i * parts + p), by collect item and by position
# in the tile order (tile_*)
(T_BLOCK_START, T_BLOCK_END, T_SEND_START, T_SEND_STAGED, T_PUSH_START, T_PUSH_DONE,
 T_FORWARD_READY, T_FORWARD_DONE, T_COLLECT_READY, T_COLLECT_DONE, T_TILE_START,
 T_TILE_DONE) = range(12)
TRACE_EVENTS = ("block_start", "block_end", "send_start", "send_staged", "push_start",
                "push_done", "forward_ready", "forward_done", "collect_ready", "collect_done",
                "tile_start", "tile_done")

_BYTE = np.dtype(np.uint8) if SIMULATOR else np.uint8


@cuda.jit(device=True, inline=True)
def part_rows(cfg, p):
    """(first row within the shard, rows) of part ``p`` of a shard."""
    r0 = p * cfg[C_ROWS]
    return r0, min(cfg[C_ROWS], cfg[C_SHARD] - r0)


def make_kernel(build, threads):
    """The persistent kernel around one tile build (``roles.compute.TileBuild``). Each role is
    a device function below; the kernel at the end hands blocks to them in block order."""
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

    @cuda.jit(**bounds)
    def allgather_gemm_kernel(
            a: Words, b: Bits2D, tmaps: Words, tmaps_odd: Words, gathered: Bits3D,
            gathered_words: Words, gathered_ptrs: Words, flags: Flags, flag_ptrs: Words,
            out: Bits2D, gathered_out: Words, tile_flags: Flags, cfg: Cfg, order: Ints,
            shards: Ints, rail: Ints, ring: Flags, head: Flags, tail: Flags, frame: Words,
            timeout_ns: types.uint64, err: Record, rank: types.int64, trace: Trace):
        """a: this rank's shard [m / world, k] bf16 as uint64 words; b [n, k] bf16 bits ([k, n]
        with a ":kn" tile build); tmaps / tmaps_odd: the tensor maps of A (this GPU's gathered
        A, slot 0 / 1) and b (sm_90a; one zero row for the SIMT tile); gathered [2, m, k]
        bf16 bits: the symmetric gathered A, one slot per call parity (gathered_words: the
        same memory as uint64 words, gathered_ptrs its address table); flags uint32 [world * parts] (symmetric,
        flag_ptrs its address table): part p of world rank r's shard is here at flags[r *
        parts + p]; out [m, n] bf16 bits; gathered_out: the caller's [m, k] as words (read
        only when cfg[C_COLLECT]); tile_flags uint32 [tiles]; order int32 [tiles]
        (``sched.tiles.gather_order``); shards int32 [world]: world ranks in arrival order;
        rail int32: the rail peers' world ranks; ring/head/tail: the proxy's command ring;
        frame: the op's call counter (``kernels.launch.Frame``); err: the error record;
        trace int64 [TRACE_EVENTS, items] (written only when cfg[C_TRACE])."""
        smem = cuda.shared.array(0, dtype=_BYTE)
        ctx = launch_context(frame, timeout_ns, err, rank)
        epoch, call, deadline = ctx[0], ctx[1], ctx[2]
        blk = cuda.blockIdx.x
        tr = cfg[C_TRACE] != 0
        stamp(tr, trace, T_BLOCK_START, blk)
        send_end, forward_end = cfg[C_SEND_END], cfg[C_FORWARD_END]
        collect_end = cfg[C_COLLECT_END]
        ok = True
        if blk < send_end:
            ok = send_role(cfg, a, gathered_words, gathered_ptrs, flags, flag_ptrs, rail,
                           (ring, head, tail), blk, send_end, ctx, trace)
        elif blk < forward_end:
            ok = forward_role(cfg, gathered_words, gathered_ptrs, flags, flag_ptrs, rail,
                              blk - send_end, forward_end - send_end, ctx, trace)
        elif blk < collect_end:
            if cfg[C_COLLECT] != 0:
                ok = collect_role(cfg, gathered_words, flags, shards, gathered_out,
                                  blk - forward_end, collect_end - forward_end, ctx, trace)
        else:
            slot = call & 1
            tiles_n = cfg[C_TILES_N]
            compute_role(smem, tmaps_odd if slot else tmaps, gathered[slot], b, order,
                         tiles_n, blk - collect_end, cuda.gridDim.x - collect_end, epoch,
                         (out, tile_flags, gathered, flags, tiles_n, cfg[C_M], cfg[C_SHARD],
                          cfg[C_ROWS], cfg[C_PARTS], (deadline, err, rank)), tr, trace)
        if ok:                        # a timed-out role's block has no end stamp
            stamp(tr, trace, T_BLOCK_END, blk)

    return allgather_gemm_kernel


#: (roles.compute.TileBuild, threads per block, kernel) of a tile build name
build = compute.KernelBuilds(make_kernel)
