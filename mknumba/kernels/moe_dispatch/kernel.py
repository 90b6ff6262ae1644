"""The MoE Dispatch + GEMM kernel: its roles, each a device function, and the kernel that hands
blocks to them in block order (the role table is in :mod:`mknumba.kernels.moe_dispatch`).

Every role takes ``ctx = (epoch, call, deadline, err, rank)`` and returns False when one of its
waits timed out (the error record says which), so the block can end. Token rows move as
``uint64`` words (4 bf16); a row is ``hidden / 4`` words. ``slot = call & 1`` picks the half of
each symmetric buffer this call writes (see the package docstring).

What a source rank publishes for a call sits in a *region* of its own memory (``slot``, its
node) and, between nodes, in the same region of each rail peer's memory (the proxy's copy), so
that every GPU finds source ``src``'s region on the GPU of its own node with ``src``'s local
index (:func:`holder`), at region (slot, node of ``src``): a meta region (``mw`` int32 words:
the call's token count T, the counts and starts of its send list per expert, then the send
list as (flat (token, slot) index, weight bits) pairs) and a token region (max_tokens rows).
"""
import numpy as np
from numba import cuda, types

from ... import _compat  # noqa: F401  (numpy alias before numba compiles)
from ... import primitives as prim
from ..._compat import SIMULATOR
from ...errors import KIND_CAPACITY, KIND_EXPERT, ROLE_BITS, ROLE_COMPUTE, ROLE_INTRA, ROLE_RECV
from ...roles import compute
from ...roles import controller as ctl_
from ...roles.blocks import launch_context, copy_tile, publish, publish_peers, wait
from ...roles.send import enqueue_rail
from ..launch import array_type

Bits2D, Bits3D = array_type(np.uint16, 2), array_type(np.uint16, 3)
Words, Words2D = array_type(np.uint64, 1), array_type(np.uint64, 2)
Flags, Ints, Ints2D = array_type(np.uint32, 1), array_type(np.int32, 1), array_type(np.int32, 2)
F32 = array_type(np.float32, 1)
Cfg, Record = array_type(np.int64, 1), array_type(np.int64, 1)

#: cfg: the small integers of a launch, one int64 array, by name (``launch.pack``). tokens: this
#: call's T; k: top_k; el: experts per rank; me: world rank; units: flags per rank's token
#: buffer (``unit`` tokens each); cap: rows this rank may receive; tiles_m: tile rows of the
#: receive buffer; *_end: the roles' block ranges; weighted: the call has topk_weights; g:
#: GPUs per node, local: this GPU's index in its node; mw: int32 words of a meta region;
#: win_*: the proxy's windows of the token buffer, the meta regions and the flags. The
#: adaptive build (``comm_sms="adaptive"``) reads chunks: pull items per tile row
#: (``CHUNK_ROWS`` rows each), init_comm: its flexible blocks that start pulling.
CFG_FIELDS = ("tokens", "k", "hidden", "ffn", "el", "experts", "world", "me", "max_tokens",
              "unit", "units", "cap", "tiles_m", "tiles_n", "bm", "pack_end", "forward_end",
              "pull_end", "weighted", "nodes", "node", "g", "local", "mw", "win_xbuf",
              "win_meta", "win_flags", "chunks", "init_comm")
(C_T, C_K, C_HIDDEN, C_FFN, C_EL, C_EXPERTS, C_WORLD, C_ME, C_MAXT, C_UNIT, C_UNITS, C_CAP,
 C_TILES_M, C_TILES_N, C_BM, C_PACK_END, C_FORWARD_END, C_PULL_END, C_WEIGHTED, C_NODES,
 C_NODE, C_G, C_LOCAL, C_MW, C_WIN_XBUF, C_WIN_META, C_WIN_FLAGS, C_CHUNKS,
 C_INIT_COMM) = range(len(CFG_FIELDS))
#: the adaptive build's pull items: this many rows of the receive buffer (a tile row holds
#: ``bm / CHUNK_ROWS``), each with its flag after the tile rows' (``lflags[1 + tiles_m + i]``)
CHUNK_ROWS = 16
# the adaptive build's work queues (roles.blocks.take)
Q_COMPUTE, Q_COMM = ctl_.Q_COMPUTE, ctl_.Q_COMM
POOL_STATE = ctl_.STATE              # (a global: numba sizes local arrays by constants)

#: the layout the pull role's first block derives from the counts (``lay``, int32, local):
#: tile rows this call, rows this call, then per local expert its first row in the receive
#: buffer (a tile row), its row count, its first row in out; per (source rank, expert) the
#: first receive-buffer row of that source's rows; per tile row its expert
LAY_TILES, LAY_ROWS, LAY_BASE = 0, 1, 2
LAYOUT_FLAG = 0          # lflags[0]: the layout is there; lflags[1 + tm]: tile row tm arrived
# the intra-node role's waits on lflags, as their role code says (errors.ROLE_BITS: array 1;
# array 0 is ``flags``), so that a timeout names the layout (``op._flag_name``)
INTRA_LAYOUT = ROLE_INTRA | 1 << ROLE_BITS

_BYTE = np.dtype(np.uint8) if SIMULATOR else np.uint8


def lay_words(el, world, tiles_m):
    return LAY_BASE + 3 * el + world * el + tiles_m


def meta_words(experts, max_tokens, top_k):
    """int32 words of a meta region: T, counts and starts per expert, the send list's pairs."""
    return 1 + 2 * experts + 2 * max_tokens * top_k


def flag_words(world, units):
    """Epoch flags per GPU: counts (one per source rank), token units (``units`` per source),
    meta regions that came through the proxy (one per source rank)."""
    return world + world * units + world


@cuda.jit(device=True, inline=True)
def unit_flag(cfg, src, u):
    """Flag index of unit ``u`` of source ``src``'s tokens (``flags[src]``: its counts)."""
    return cfg[C_WORLD] + src * cfg[C_UNITS] + u


@cuda.jit(device=True, inline=True)
def arrived_flag(cfg, src):
    """Flag index, on a rail peer of ``src``, of ``src``'s meta region (the proxy sets it)."""
    return cfg[C_WORLD] * (1 + cfg[C_UNITS]) + src


@cuda.jit(device=True, inline=True)
def holder(cfg, slot, src):
    """(local index of the GPU of this node that holds source ``src``'s regions, their region
    index): ``src`` itself in this node, its rail peer here in another."""
    n = prim.udiv32(src, cfg[C_G])
    return src - n * cfg[C_G], slot * cfg[C_NODES] + n


@cuda.jit(device=True, inline=True)
def tab(cfg, slot, src, field, e):
    """Index in a count table of (slot, source rank, field: 0 rows / 1 first index in the
    source's send list, local expert)."""
    return ((slot * cfg[C_WORLD] + src) * 2 + field) * cfg[C_EL] + e


@cuda.jit(device=True, inline=True)
def seg_at(cfg, src, e):
    el = cfg[C_EL]
    return LAY_BASE + 3 * el + src * el + e


@cuda.jit(device=True, inline=True)
def expert_at(cfg, tm):
    el = cfg[C_EL]
    return LAY_BASE + 3 * el + cfg[C_WORLD] * el + tm


@cuda.jit(device=True, inline=True)
def chunk_flag(cfg, i):
    """lflags index of pull item ``i`` of the adaptive build (after the tile rows' flags)."""
    return 1 + cfg[C_TILES_M] + i


@cuda.jit(device=True)
def chunks_here(args, i):
    """One thread, no wait: whether every chunk of the tile row of the tile at ticket ``i``
    of the compute queue (``skip`` tickets left empty this call) has arrived (their flags).
    args: (lflags, cfg, order, epoch, skip)."""
    lflags, cfg, order, epoch, skip = args
    C = cfg[C_CHUNKS]
    first = chunk_flag(cfg, prim.udiv32(order[i - skip], cfg[C_TILES_N]) * C)
    for c in range(C):
        if not prim.epoch_reached(prim.acquire(lflags, first + c, False), epoch):
            return False
    return True


pool_start, _, next_block, pool_stop = ctl_.make_dispatch(chunks_here)


@cuda.jit(device=True)
def publish_node(flag_ptrs, flags, cfg, idx, epoch):
    """:func:`roles.blocks.publish` into every GPU of the node's ``flags[idx]`` (this one's
    too), the next GPU first: for data the node's GPUs read from this GPU's memory (the
    system fence also orders it before the proxy's reads)."""
    cuda.syncthreads()
    if cuda.threadIdx.x == 0:
        prim.fence_sys()
        g, local = cfg[C_G], cfg[C_LOCAL]
        for j in range(g):
            prim.st_release_sys(prim.peer_view(flag_ptrs, prim.peer_after(local, j, g),
                                               flags), idx, epoch)


@cuda.jit(device=True, inline=True)
def route_role(cfg, topk, weights, hist, meta, meta_f, table, table_ptrs, flags, flag_ptrs,
               rail, proxy, ctx):
    """One block: count this call's (token, slot) pairs per expert and list them expert by
    expert in this GPU's meta region (a counting sort; the order within an expert is the
    atomics'), with their weights (1 without topk_weights), T and the counts; write the
    counts of each destination of this node and where its lists start into that GPU's count
    table; publish the counts flag ``flags[me]`` on every GPU of the node; between nodes, one
    command per rail peer: the meta region into the same region there, then its arrival
    flag. A pair with an expert id out of range is left out and the first one (lowest token,
    then slot) recorded (``KIND_EXPERT``: the host raises it, then clears it). Waits on
    nothing but ring credits."""
    epoch, call, deadline, err, rank = ctx
    E, K, el, me = cfg[C_EXPERTS], cfg[C_K], cfg[C_EL], cfg[C_ME]
    n = cfg[C_T] * K
    slot = call & 1
    base = (slot * cfg[C_NODES] + cfg[C_NODE]) * cfg[C_MW]
    pairs = base + 1 + 2 * E
    tid, nt = cuda.threadIdx.x, cuda.blockDim.x
    g = tid
    while g < E:
        hist[g] = 0
        g += nt
    if tid == 0:
        hist[3 * E] = n               # the first pair out of range (n: none)
    cuda.syncthreads()
    p = tid
    while p < n:
        g = topk[p]
        if g >= 0 and g < E:
            cuda.atomic.add(hist, g, 1)
        else:
            cuda.atomic.min(hist, 3 * E, p)
        p += nt
    cuda.syncthreads()
    if tid == 0:                      # exclusive scan: where each expert's list starts
        meta[base] = cfg[C_T]
        run = 0
        for g in range(E):
            hist[E + g] = run
            hist[2 * E + g] = run     # the cursor the scatter advances
            meta[base + 1 + g] = hist[g]
            meta[base + 1 + E + g] = run
            run += hist[g]
        bad = hist[3 * E]
        if bad < n:
            t = prim.udiv32(bad, K)
            prim.record_error(err, rank, ROLE_INTRA, t, E, topk[bad], bad - t * K,
                              KIND_EXPERT)
    cuda.syncthreads()
    p = tid
    while p < n:
        g = topk[p]
        if g >= 0 and g < E:
            pos = cuda.atomic.add(hist, 2 * E + g, 1)
            meta[pairs + 2 * pos] = p
            meta_f[pairs + 2 * pos + 1] = weights[p] if cfg[C_WEIGHTED] else np.float32(1)
        p += nt
    G, node = cfg[C_G], cfg[C_NODE]
    g = tid
    while g < E:                      # counts into this node's tables (NVLink stores)
        dst = prim.udiv32(g, el)
        q = dst - node * G
        if q >= 0 and q < G:
            e = g - dst * el
            there = prim.peer_view(table_ptrs, q, table)
            there[tab(cfg, slot, me, 0, e)] = hist[g]
            there[tab(cfg, slot, me, 1, e)] = hist[E + g]
        g += nt
    # the meta region (read by the node's GPUs from here) and the counts (stored there)
    publish_node(flag_ptrs, flags, cfg, me, epoch)
    if cfg[C_NODES] > 1:
        return enqueue_rail(proxy, rail, cfg[C_WIN_META], base * 4, (pairs - base + 2 * n) * 4,
                            0, cfg[C_WIN_FLAGS], arrived_flag(cfg, me), epoch, deadline, err,
                            rank)
    return True


@cuda.jit(device=True, inline=True)
def pack_role(cfg, x, xbuf, flags, flag_ptrs, rail, proxy, first, step, ctx):
    """This call's tokens into this GPU's token region, ``unit`` tokens at a time (units
    ``first, first + step, ...``), each unit's flag published on every GPU of the node (they
    pull the rows they need from here); between nodes, then one command per rail peer: the
    unit into the same region there, then its flag there. Waits on nothing but ring
    credits."""
    epoch, call, deadline, err, rank = ctx
    kw = cfg[C_HIDDEN] // 4
    T, unit, me = cfg[C_T], cfg[C_UNIT], cfg[C_ME]
    base = ((call & 1) * cfg[C_NODES] + cfg[C_NODE]) * cfg[C_MAXT] * kw
    units = prim.udiv32(T + unit - 1, unit)
    for j in range(prim.steps(first, units, step)):
        u = first + j * step
        r0 = u * unit
        rows = min(unit, T - r0)
        at = base + r0 * kw
        copy_tile(x, r0 * kw, xbuf, at, rows * kw)
        publish_node(flag_ptrs, flags, cfg, unit_flag(cfg, me, u), epoch)
        if cfg[C_NODES] > 1 and not enqueue_rail(
                proxy, rail, cfg[C_WIN_XBUF], at * 8, rows * kw * 8, u, cfg[C_WIN_FLAGS],
                unit_flag(cfg, me, u), epoch, deadline, err, rank):
            return False
    return True


@cuda.jit(device=True, inline=True)
def forward_role(cfg, meta, table, table_ptrs, flags, flag_ptrs, rail, first, step, ctx):
    """Between nodes: for each rail peer ``src`` (its meta region and token units come here
    through the proxy), once its meta region is here (the proxy's flag): the first block
    writes ``src``'s counts into the count table of every GPU of the node (NVLink stores) and
    publishes ``flags[src]`` on each; every block (units ``first, first + step, ...``) waits
    for each of ``src``'s token units and publishes its flag on the node's other GPUs, which
    pull those rows from here. It waits for every unit, needed or not: a call ends only
    once the rail peers' data of the call is all here, which keeps the slots' reuse safe (see
    the package docstring). Waits only on the proxy."""
    epoch, call, deadline, err, rank = ctx
    slot = call & 1
    E, el, G, node = cfg[C_EXPERTS], cfg[C_EL], cfg[C_G], cfg[C_NODE]
    for i in range(rail.shape[0]):
        src = rail[i]
        if not wait(flags, arrived_flag(cfg, src), epoch, deadline, err, rank, ROLE_RECV):
            return False
        _, region = holder(cfg, slot, src)
        base = region * cfg[C_MW]
        if first == 0:
            j = cuda.threadIdx.x
            while j < G * el:
                q = prim.udiv32(j, el)
                e = j - q * el
                gq = (node * G + q) * el + e
                there = prim.peer_view(table_ptrs, q, table)
                there[tab(cfg, slot, src, 0, e)] = meta[base + 1 + gq]
                there[tab(cfg, slot, src, 1, e)] = meta[base + 1 + E + gq]
                j += cuda.blockDim.x
            publish_node(flag_ptrs, flags, cfg, src, epoch)
        units = prim.udiv32(meta[base] + cfg[C_UNIT] - 1, cfg[C_UNIT])
        for j in range(prim.steps(first, units, step)):
            idx = unit_flag(cfg, src, first + j * step)
            if not wait(flags, idx, epoch, deadline, err, rank, ROLE_RECV):
                return False
            publish_peers(flag_ptrs, flags, G, cfg[C_LOCAL], idx, epoch)
    return True


@cuda.jit(device=True, inline=True)
def layout_lead(cfg, table, flags, lay, lflags, counts, offsets, ctx):
    """The pull role's first block: :func:`lay_out`, then the layout flag (GPU scope: the
    pull and compute blocks of this GPU read it)."""
    if not lay_out(cfg, table, flags, lay, counts, offsets, ctx):
        return False
    publish(lflags, LAYOUT_FLAG, ctx[0], False)
    return True


@cuda.jit(device=True, inline=True)
def lay_out(cfg, table, flags, lay, counts, offsets, ctx):
    """Wait for every rank's counts flag, then (thread 0) lay this call's rows out: each local
    expert's rows from one tile row on in the receive buffer, source rank by source rank, and
    packed in out (``counts``, ``offsets``: the caller's layout); more rows than planned -> a
    capacity error and no rows. False: a wait timed out."""
    epoch, call, deadline, err, rank = ctx
    W, el, bm = cfg[C_WORLD], cfg[C_EL], cfg[C_BM]
    slot = call & 1
    for j in range(W):
        if not wait(flags, prim.peer_after(cfg[C_ME], j, W), epoch, deadline, err, rank,
                    ROLE_INTRA):
            return False
    if cuda.threadIdx.x == 0:
        rows = 0
        tm = 0
        for e in range(el):
            lay[LAY_BASE + e] = tm * bm
            lay[LAY_BASE + 2 * el + e] = rows
            offsets[e] = rows
            cnt = 0
            for src in range(W):
                lay[seg_at(cfg, src, e)] = tm * bm + cnt
                cnt += table[tab(cfg, slot, src, 0, e)]
            lay[LAY_BASE + el + e] = cnt
            counts[e] = cnt
            rows += cnt
            tiles = prim.udiv32(cnt + bm - 1, bm)
            if rows <= cfg[C_CAP]:
                for i in range(tiles):
                    lay[expert_at(cfg, tm + i)] = e
            tm += tiles
        offsets[el] = rows
        if rows > cfg[C_CAP]:
            prim.record_error(err, rank, ROLE_RECV, 0, cfg[C_CAP], rows, cuda.blockIdx.x,
                              KIND_CAPACITY)
            tm = 0
        lay[LAY_TILES] = tm
        lay[LAY_ROWS] = rows
    return True


@cuda.jit(device=True, inline=True)
def pull_role(cfg, table, flags, xbuf, xbuf_ptrs, meta, meta_ptrs, meta_f, recv, lay, lflags,
              rows_out, weights_out, first, step, ctx):
    """Tile rows ``first, first + step, ...`` of the receive buffer: every row of it
    (:func:`pull_rows`), then the tile row's flag (GPU scope: compute blocks of this GPU wait
    on it). Waits on the layout (a lower block) and on the pack and forward roles."""
    epoch, call, deadline, err, rank = ctx
    dims = pull_dims(cfg, call)
    el = dims[1]
    if not wait(lflags, LAYOUT_FLAG, epoch, deadline, err, rank, INTRA_LAYOUT, False):
        return False
    tiles = lay[LAY_TILES]
    for it in range(prim.steps(first, tiles, step)):
        tm = first + it * step
        e = lay[expert_at(cfg, tm)]
        r0 = tm * cfg[C_BM]
        r1 = min(r0 + cfg[C_BM], lay[LAY_BASE + e] + lay[LAY_BASE + el + e])
        if not pull_rows(cfg, table, flags, xbuf, xbuf_ptrs, meta, meta_ptrs, meta_f, recv,
                         lay, lflags, rows_out, weights_out, e, r0, r1, 1 + tm, dims, ctx):
            return False
    return True


@cuda.jit(device=True, inline=True)
def pull_dims(cfg, call):
    """What :func:`pull_rows` reads of cfg once per block: (world, experts per rank, top_k,
    rank, words of a row, slot)."""
    return cfg[C_WORLD], cfg[C_EL], cfg[C_K], cfg[C_ME], cfg[C_HIDDEN] // 4, call & 1


@cuda.jit(device=True, inline=True)
def pull_rows(cfg, table, flags, xbuf, xbuf_ptrs, meta, meta_ptrs, meta_f, recv, lay, lflags,
              rows_out, weights_out, e, r0, r1, done, dims, ctx):
    """Rows ``r0 .. r1`` of the receive buffer (of local expert ``e``; dims:
    :func:`pull_dims`): each from the GPU of this node that holds its source's tokens
    (:func:`holder`; NVLink loads, once the unit holding the token is there: its flag), with
    its source rank, token and top-k slot (and weight) into the caller's layout; then
    ``lflags[done]`` (GPU scope). Block-wide; False: a wait timed out (recorded)."""
    epoch, call, deadline, err, rank = ctx
    W, el, K, me, kw, slot = dims
    out0 = lay[LAY_BASE + 2 * el + e] - lay[LAY_BASE + e]     # out row = row + out0
    for j in range(W):
        src = prim.peer_after(me, j, W)
        s0 = lay[seg_at(cfg, src, e)]
        lo = max(r0, s0)
        hi = min(r1, s0 + table[tab(cfg, slot, src, 0, e)])
        if lo < hi:
            q, region = holder(cfg, slot, src)
            pairs = region * cfg[C_MW] + 1 + 2 * cfg[C_EXPERTS]
            xrow = region * cfg[C_MAXT]
            first_q = table[tab(cfg, slot, src, 1, e)] - s0
            their_meta = prim.peer_view(meta_ptrs, q, meta)
            their_w = prim.peer_view(meta_ptrs, q, meta_f)
            their_x = prim.peer_view(xbuf_ptrs, q, xbuf)
            for row in range(lo, hi):
                at = pairs + 2 * (first_q + row)
                p = their_meta[at]
                t = prim.udiv32(p, K)
                u = prim.udiv32(t, cfg[C_UNIT])
                if not wait(flags, unit_flag(cfg, src, u), epoch, deadline, err, rank,
                            ROLE_INTRA):
                    return False
                copy_tile(their_x, (xrow + t) * kw, recv, row * kw, kw)
                if cuda.threadIdx.x == 0:
                    o = row + out0
                    rows_out[o, 0] = src
                    rows_out[o, 1] = t
                    rows_out[o, 2] = p - t * K
                    weights_out[o] = their_w[at + 1]    # the sender's: 1 if it passed none
    publish(lflags, done, epoch, False)
    return True


def make_kernel(build, threads, adaptive=False):
    """The persistent kernel around one tile build (``roles.compute.TileBuild``), with the
    static split or (``adaptive``) the controller's. Each role is a device function above or
    below; the kernel at the end hands blocks to them in block order."""
    bounds = {} if SIMULATOR else {"launch_bounds": (threads, 1)}

    @cuda.jit(device=True, inline=True)
    def tile_rows(where, epoch, tiles):
        """This call's tiles: wait (this thread) for the layout, then every column of each
        tile row the routing filled (0 after a capacity error)."""
        lay, lflags, tiles_n = where[2], where[3], where[7]
        deadline, err, rank = where[8]
        if not prim.wait_flag(lflags, LAYOUT_FLAG, epoch, deadline, err, rank, ROLE_COMPUTE,
                              1000, False):
            return 0
        return lay[LAY_TILES] * tiles_n

    @cuda.jit(device=True, inline=True)
    def expert_operands(where, tm, a, b, tmaps):
        """Tile row ``tm`` belongs to one local expert e: A is the receive buffer up to e's
        last row (the tile stores no row past it), B is e's weight (``wt[e]``), the tensor
        maps e's (sm_90a: A = the receive buffer, B = e's weight)."""
        lay, cfg, wt, tmtable = where[2], where[4], where[5], where[6]
        el = cfg[C_EL]
        e = lay[expert_at(cfg, tm)]
        return a[:lay[LAY_BASE + e] + lay[LAY_BASE + el + e]], wt[e], tmtable[e]

    @cuda.jit(device=True, inline=True)
    def into_out(where, t, tm):
        """Expert e's rows go to out from ``offsets[e]`` on: receive-buffer row r to out row
        r - (e's first receive row - offsets[e]); ``tile_flags[t]`` (GPU scope) announces it;
        nothing to fold in (``wt``: the tile's unread addend)."""
        out, tile_flags, lay, cfg, wt = where[0], where[1], where[2], where[4], where[5]
        el = cfg[C_EL]
        e = lay[expert_at(cfg, tm)]
        return out, lay[LAY_BASE + e] - lay[LAY_BASE + 2 * el + e], wt, 0, tile_flags, t, False

    @cuda.jit(device=True, inline=True)
    def rows_arrived(where, t, adds, epoch):
        """Wait (this thread) until tile row t's rows are in the receive buffer (the pull
        role's flag), then fence the async proxy: the sm_90a tile reads them by TMA."""
        lflags, tiles_n = where[3], where[7]
        deadline, err, rank = where[8]
        if not prim.wait_flag(lflags, 1 + prim.udiv32(t, tiles_n), epoch, deadline, err, rank,
                              ROLE_COMPUTE, 1000, False):
            return False
        prim.fence_proxy_async()
        return True

    compute_role = compute.make_compute_role(build, (into_out, rows_arrived),
                                             (tile_rows, expert_operands))

    # ---- the adaptive split (roles.controller) ---------------------------------------------
    # The compute blocks are the controller's flexible pool: compute items are the grouped
    # GEMM's tiles, communication items the pulls, CHUNK_ROWS rows of the receive buffer each
    # (tile row tm's chunk c: item tm * chunks + c; a chunk past its expert's last row pulls
    # nothing and only publishes its flag). Route, pack and (between nodes) forward stay
    # fixed: they face the proxy, and a pull waits only on them (the unit flags) and on the
    # layout, which the first flexible block lays out before any block draws an item. So a
    # pull never waits on a flexible block, and a block whose next tile's rows have not all
    # arrived pulls a chunk instead of waiting, while any are left; then the tile, whose waits
    # are bounded.
    # Routing is data, so the items of a call are only known from its layout, while the
    # queues' epoch rule (roles.blocks.take) needs a fixed count per call: each queue is
    # planned for the most items (every tile row of the receive buffer), and the layout's
    # block draws the tickets this call leaves empty in one add before it publishes the
    # layout; items are then the tickets past them.
    @cuda.jit(device=True, inline=True)
    def chunks_arrived(where, t, adds, epoch):
        """Wait (this thread) until every chunk of tile t's tile row is in the receive buffer
        (the pull items' flags), then fence the async proxy (the sm_90a tile's TMA loads)."""
        lflags, cfg, tiles_n = where[3], where[4], where[7]
        deadline, err, rank = where[8]
        first = chunk_flag(cfg, prim.udiv32(t, tiles_n) * cfg[C_CHUNKS])
        for c in range(cfg[C_CHUNKS]):
            if not prim.wait_flag(lflags, first + c, epoch, deadline, err, rank, ROLE_COMPUTE,
                                  1000, False):
                return False
        prim.fence_proxy_async()
        return True

    compute_tile = compute.make_compute_tile(build, (into_out, chunks_arrived),
                                             (tile_rows, expert_operands))
    tile_init = build.init

    @cuda.jit(device=True, inline=True)
    def flexible_pool(smem, tmtable, recv, wt, order, cfg, io, where, queue, ctl, blk, ctx):
        """Blocks [forward_end, grid): the first lays the call out and opens the queues; each
        then waits for the layout and takes its next item from the controller's dispatch
        (``roles.controller.make_dispatch``) until none is left. io: what a pull reads and
        writes, and the caller's counts and offsets; where: the compute tile's."""
        epoch, call, deadline, err, rank = ctx
        table, flags, xbuf, xbuf_ptrs, meta, meta_ptrs, meta_f, recv_words = io[:8]
        lay, lflags, rows_out, weights_out, counts, offsets = io[8:]
        first = cfg[C_FORWARD_END]
        flex = cuda.gridDim.x - first
        tiles_m, tiles_n, C = cfg[C_TILES_M], cfg[C_TILES_N], cfg[C_CHUNKS]
        most_tiles, most_pulls = order.shape[0], tiles_m * C
        if blk == first:
            if not lay_out(cfg, table, flags, lay, counts, offsets, ctx):
                return
            if cuda.threadIdx.x == 0:      # the tickets this call leaves empty, before any draw
                rows = lay[LAY_TILES]
                prim.atomic_add_relaxed(queue, Q_COMPUTE,
                                        np.uint32(most_tiles - rows * tiles_n))
                prim.atomic_add_relaxed(queue, Q_COMM, np.uint32((tiles_m - rows) * C))
            publish(lflags, LAYOUT_FLAG, epoch, False)
        if not wait(lflags, LAYOUT_FLAG, epoch, deadline, err, rank, INTRA_LAYOUT, False):
            return
        rows = lay[LAY_TILES]
        skip_tiles, skip_pulls = most_tiles - rows * tiles_n, (tiles_m - rows) * C
        dims = pull_dims(cfg, call)
        el, bm = dims[1], cfg[C_BM]
        tmaps = tmtable[0]
        tile_init(smem, tmaps)
        cuda.syncthreads()
        st = cuda.local.array(POOL_STATE, np.int64)
        if cuda.threadIdx.x == 0:     # (every block draws each queue to its end: its epoch)
            pool_start(st, ctl, ctl_.COMM if blk - first < cfg[C_INIT_COMM] else ctl_.COMPUTE,
                       most_pulls)
        seq = 0
        while True:
            kind, it = next_block(st, ctl, queue, call, (most_tiles, most_pulls), flex,
                                  cfg[C_INIT_COMM], (False, rows_out, 0, 0, blk),
                                  (lflags, cfg, order, epoch, skip_tiles))
            if kind == ctl_.END:
                break
            start = prim.globaltimer()
            if kind == ctl_.COMM:
                i = it - skip_pulls
                tm = prim.udiv32(i, C)
                e = lay[expert_at(cfg, tm)]
                r0 = tm * bm + (i - tm * C) * CHUNK_ROWS
                r1 = min(r0 + CHUNK_ROWS, lay[LAY_BASE + e] + lay[LAY_BASE + el + e])
                if not pull_rows(cfg, table, flags, xbuf, xbuf_ptrs, meta, meta_ptrs, meta_f,
                                 recv_words, lay, lflags, rows_out, weights_out, e, r0, r1,
                                 chunk_flag(cfg, i), dims, ctx):
                    break                # timed out (recorded): the call is lost anyway
            else:
                compute_tile(smem, tmaps, recv, wt[0], order[it - skip_tiles], tiles_n, seq,
                             epoch, where)
                seq += 1
            cuda.syncthreads()            # every thread's part of the item, then its cost
            ctl_.account(ctl, kind, start)
        if cuda.threadIdx.x == 0:
            pool_stop(st, ctl)

    @cuda.jit(**bounds)
    def moe_dispatch_gemm_kernel(
            x: Words, topk: Ints, weights: F32, wt: Bits3D, tmtable: Words2D, recv: Bits2D,
            recv_words: Words, xbuf: Words, xbuf_ptrs: Words, meta: Ints, meta_f: F32,
            meta_ptrs: Words, table: Ints, table_ptrs: Words, flags: Flags, flag_ptrs: Words,
            hist: Ints, lay: Ints, lflags: Flags, tile_flags: Flags, out: Bits2D, counts: Ints,
            offsets: Ints, rows_out: Ints2D, weights_out: F32, cfg: Cfg, order: Ints,
            rail: Ints, ring: Flags, head: Flags, tail: Flags, frame: Words,
            timeout_ns: types.uint64, err: Record, rank: types.int64, queue: Flags, ctl: Words):
        """x: this call's tokens [T, hidden] bf16 as uint64 words; topk int32 [T * top_k];
        weights fp32 [T * top_k] (read when cfg[C_WEIGHTED]); wt [experts / world, ffn,
        hidden] bf16 bits ([experts / world, hidden, ffn] with a ":kn" tile build): this
        rank's experts as the tile's B; tmtable [experts / world, 32]:
        each expert's tensor maps (sm_90a; zeros for the SIMT tile); recv [tiles_m * bm,
        hidden] bf16 bits: the receive buffer (recv_words: the same memory as words);
        symmetric over the node, each with its address table (by local index): xbuf [2,
        nodes, max_tokens, hidden] words (token regions: per call parity, this GPU's tokens
        and its rail peers'), meta int32 [2, nodes, mw] (meta regions, likewise; meta_f: the
        same memory as fp32, for the weights), table int32 [2, world, 2, experts / world]
        (counts from every rank), flags uint32 (``flag_words``); local: hist int32 [3 *
        experts + 1] (the route's counting sort), lay int32 (``lay_words``), lflags uint32
        [1 + tiles_m] (adaptive: also the chunks' flags, [1 + tiles_m * (1 + chunks)]),
        tile_flags uint32 [tiles_m * tiles_n]; out [capacity, ffn] bf16 bits;
        counts int32 [experts / world], offsets int32 [experts / world + 1], rows_out int32
        [capacity, 3] (source rank, token, top-k slot), weights_out fp32 [capacity]; order
        int32 [tiles_m * tiles_n]; rail int32: the rail peers' world ranks; ring/head/tail:
        the proxy's command ring (between nodes); frame: the op's call counter
        (``kernels.lifetime.Frame``); err: the error record; the adaptive build's queue uint32
        [QUEUES] (the compute and pull queues' ticket counters) and ctl uint64
        [roles.controller.CTL_WORDS] (its measurements).

        Blocks in order: route, pack, forward (between nodes), then pull and compute, or
        (adaptive) the flexible blocks [forward_end, grid), the first of which lays the call
        out. ``adaptive`` is a constant of the kernel: numba compiles only its build's
        branch (the static build never reads queue or ctl)."""
        smem = cuda.shared.array(0, dtype=_BYTE)
        ctx = launch_context(frame, timeout_ns, err, rank)
        epoch, deadline = ctx[0], ctx[2]
        if ctx[1] == 0:
            return       # the op has ended on this rank: a graph replayed after it
        blk = cuda.blockIdx.x
        pack_end, forward_end = cfg[C_PACK_END], cfg[C_FORWARD_END]
        pull_end = cfg[C_PULL_END]
        proxy = (ring, head, tail)
        # what the compute tile reads and writes
        where = (out, tile_flags, lay, lflags, cfg, wt, tmtable, cfg[C_TILES_N],
                 (deadline, err, rank))
        if blk == 0:
            route_role(cfg, topk, weights, hist, meta, meta_f, table, table_ptrs, flags,
                       flag_ptrs, rail, proxy, ctx)
        elif blk < pack_end:
            pack_role(cfg, x, xbuf, flags, flag_ptrs, rail, proxy, blk - 1, pack_end - 1, ctx)
        elif blk < forward_end:
            forward_role(cfg, meta, table, table_ptrs, flags, flag_ptrs, rail, blk - pack_end,
                         forward_end - pack_end, ctx)
        elif adaptive:
            flexible_pool(smem, tmtable, recv, wt, order, cfg,
                          (table, flags, xbuf, xbuf_ptrs, meta, meta_ptrs, meta_f, recv_words,
                           lay, lflags, rows_out, weights_out, counts, offsets), where, queue,
                          ctl, blk, ctx)
        elif blk < pull_end:
            if blk == forward_end:
                if not layout_lead(cfg, table, flags, lay, lflags, counts, offsets, ctx):
                    return
            pull_role(cfg, table, flags, xbuf, xbuf_ptrs, meta, meta_ptrs, meta_f, recv_words,
                      lay, lflags, rows_out, weights_out, blk - forward_end,
                      pull_end - forward_end, ctx)
        else:
            compute_role(smem, tmtable[0], recv, wt[0], order, cfg[C_TILES_N], blk - pull_end,
                         cuda.gridDim.x - pull_end, epoch, where)

    return moe_dispatch_gemm_kernel


#: (roles.compute.TileBuild, threads per block, kernel) of a tile build name, either split
_BUILDS = {False: compute.KernelBuilds(make_kernel),
           True: compute.KernelBuilds(lambda b, threads: make_kernel(b, threads, True))}


def build(kind, adaptive=False):
    """(roles.compute.TileBuild, threads per block, kernel) of a tile build name with the
    static or (``comm_sms="adaptive"``) the controller's split."""
    return _BUILDS[bool(adaptive)](kind)
