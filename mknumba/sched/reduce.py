"""Who owns which output tile, in which order tiles are computed, and how locally reduced tiles
are grouped into network chunks: the schedule of GEMM + ReduceScatter and GEMM + AllReduce.

Everything here is host-side NumPy, computed once per op from global facts (shape, tile size,
topology), so every rank derives the same tables without talking to the others.

Words: ``G`` GPUs per node, ``nodes`` nodes, ``W = nodes * G`` ranks; rank ``(node, local)``.
A *tile* is one ``bm x bn`` output tile, numbered ``t = tile_m * tiles_n + tile_n``.

Ownership (the GPU of each node that reduces a tile over NVLink, its *local owner*):
- ReduceScatter: rows split into ``W`` row blocks; world rank ``j`` receives block ``j``; block
  ``j``'s local owner is ``j % G`` on every node, and its *destination node* is ``j // G``;
- AllReduce: tile row ``tm`` is owned by local GPU ``tm % G``; every node needs every tile.

Compute order (the same on every rank of a node, but with ``fold``): tiles some other node needs
come first (the network is the slow link, so its chunks must leave early), then the tiles that
stay here. ``fold`` (ReduceScatter on one node, partials delivered to their owners): each GPU
computes the other GPUs' row blocks first and its own last, so that when it computes one of
its own tiles the others' partials of it are already in its inbox, and it adds them in the
tile's epilogue: no reduce pass (``red_tiles`` is empty). Inside
each class, each row block is walked in bands of ``group_m`` tile rows, each band in grouped
raster order (row fastest) for L2 reuse of B, and the row blocks' walks are interleaved tile by
tile: every local owner gets tiles to reduce at the same rate from the start to the end, so both
directions of every NVLink carry traffic at once (the blocks' bands also walk the columns in
step, sharing B's tiles in L2).

Network stage (``nodes > 1``): a local owner puts each tile it reduced for another node into a
tile-major *stage* slot; ``chunk_tiles`` consecutive slots form one network chunk (sized
independently of tiles). A per-chunk counter lets the last reduced tile of a chunk publish it;
the send role then enqueues one command per (chunk, destination rail peer). The receiver lays
incoming tiles out as ``recv[src, i]`` where ``i`` is the tile's position in its *final list*
(the tiles it finishes) and ``src`` the sender's index among its rail peers.
"""
from dataclasses import dataclass

import numpy as np

from ..errors import MkValueError
from .tiles import cdiv


def compute_order(tiles_m, tiles_n, blocks, network_block, group_m, late_block=None):
    """Linear tile ids in compute order.

    blocks: int array [tiles_m], the row block of each tile row; network_block: bool per row
    block id (True: another node needs it, so it goes first); group_m: band height in tile rows;
    late_block: bool per row block id (True: after the other blocks of its class).
    """
    order = []
    late_block = np.zeros(len(network_block), bool) if late_block is None else late_block
    for network, late in ((True, False), (True, True), (False, False), (False, True)):
        ids = [b for b in dict.fromkeys(blocks.tolist())
               if bool(network_block[b]) == network and bool(late_block[b]) == late]
        walks = []
        for b in ids:
            rows = np.flatnonzero(blocks == b)
            walk = []
            for i in range(0, len(rows), group_m):
                band = rows[i:i + group_m]
                for tn in range(tiles_n):                     # grouped raster: row fastest
                    walk.extend(int(tm) * tiles_n + tn for tm in band)
            walks.append(walk)
        for j in range(max((len(w) for w in walks), default=0)):
            order.extend(w[j] for w in walks if j < len(w))   # one tile of each block in turn
    return np.array(order, dtype=np.int32)


@dataclass
class ReducePlan:
    """The per-rank tables of a GEMM + ReduceScatter / AllReduce launch (see module docstring).

    Device tables (int32 unless noted):
      order [tiles]            compute order of every tile (same on every rank of the node)
      owner_of_row [tiles_m]   local owner (GPU of the node) of each tile row
      red_tiles [R]            tiles this GPU reduces over NVLink, in processing order
      red_slots [R]            their stage slot (nodes > 1), else -1
      red_chunks [R]           their network chunk (-1: not sent), for the per-chunk counter
      chunk_tiles [C]          tiles in each chunk (the counter's target per call)
      cmds [Q, 6]              send commands: chunk, dest world rank, first stage slot, tiles,
                               first recv slot at the dest, arrival flag slot at the dest
      final_tiles [F]          tiles this GPU finishes with its rail peers' partial sums
      final_slots [F]          the stage slot holding its own node's partial of each
      pull_tiles [P], pull_owner [P]   (AllReduce, G > 1) tiles other local GPUs finish, and who
    """
    allreduce: bool
    m: int
    n: int
    bm: int
    bn: int
    nodes: int
    G: int
    node: int
    local: int
    chunk_tiles_max: int
    group_m: int
    fold: bool = False
    tiles_m: int = 0
    tiles_n: int = 0

    def __post_init__(self):
        m, n, bm, bn, G, nodes = self.m, self.n, self.bm, self.bn, self.G, self.nodes
        W = nodes * G
        self.world = W
        self.tiles_m, self.tiles_n = cdiv(m, bm), cdiv(n, bn)
        tm = np.arange(self.tiles_m)
        if self.allreduce:
            blocks = np.zeros(self.tiles_m, np.int64)          # one block: plain grouped raster
            owner_of_row = tm % G
            network_block = np.array([nodes > 1])
            dest_of_row = np.full(self.tiles_m, -1)              # every node
        else:
            if m % W or (m // W) % bm:
                raise MkValueError(
                    f"GemmReduceScatter: m={m} must split into {W} row blocks of a multiple of "
                    f"{bm} rows (the tile height), i.e. m % {W * bm} == 0")
                # (a ragged split would give one tile two owners)
            blocks = tm // ((m // W) // bm)
            owner_of_row = blocks % G
            dest_of_row = blocks // G
            network_block = np.arange(W) // G != self.node
        late_block = None
        if self.fold:
            if self.allreduce or nodes > 1 or G < 2:
                raise MkValueError("fold: ReduceScatter on one node of several GPUs only")
            late_block = np.arange(W) % G == self.local          # my own row block last
        self.order = compute_order(self.tiles_m, self.tiles_n, blocks, network_block,
                                   self.group_m, late_block)
        self.owner_of_row = owner_of_row.astype(np.int32)
        tn_ = self.tiles_n
        owner = owner_of_row[self.order // tn_]
        dest = dest_of_row[self.order // tn_]
        mine = self.order[owner == self.local]
        mine_dest = dest[owner == self.local]
        k = self.chunk_tiles_max

        # Final list of a GPU: the tiles it finishes with its rail peers' sums, in compute order
        # (the same relative order on every node, so sender and receiver agree on positions).
        if self.allreduce:
            final = mine
        else:
            final = mine[mine_dest == self.node]
        self.final_tiles = final.astype(np.int32)
        self.n_final = len(final)
        self.recv_chunks = cdiv(self.n_final, k) if nodes > 1 else 0

        if self.fold:                 # finished in the compute role's epilogue
            mine = mine[:0]
        R = len(mine)
        self.red_tiles = mine.astype(np.int32)
        self.red_slots = np.full(R, -1, np.int32)
        self.red_chunks = np.full(R, -1, np.int32)
        chunk_len, cmds = [], []
        self.final_slots = np.full(self.n_final, -1, np.int32)
        if nodes > 1:
            pos = {int(t): i for i, t in enumerate(mine)}
            slot = 0
            # Network-bound tiles, grouped per destination so a chunk has one destination set.
            dests = [None] if self.allreduce else [d for d in range(nodes) if d != self.node]
            for d in dests:
                seq = mine if d is None else mine[mine_dest == d]
                targets = [x for x in range(nodes) if x != self.node] if d is None else [d]
                for c in range(cdiv(len(seq), k)):
                    q = len(chunk_len)
                    part = seq[c * k:(c + 1) * k]
                    for j, t in enumerate(part):
                        self.red_slots[pos[int(t)]] = slot + j
                        self.red_chunks[pos[int(t)]] = q
                    chunk_len.append(len(part))
                    for dn in targets:
                        src_idx = self.node if self.node < dn else self.node - 1
                        dest_rank = dn * G + self.local
                        cmds.append((q, dest_rank, slot, len(part),
                                     src_idx * self.n_final + c * k,
                                     src_idx * self.recv_chunks + c))
                    slot += len(part)
            if not self.allreduce:   # own block: reduced here, finished with the remote sums
                for t in final:
                    self.red_slots[pos[int(t)]] = slot
                    slot += 1
            self.stage_slots = slot
            self.final_slots = self.red_slots[[pos[int(t)] for t in final]].astype(np.int32)
        else:
            self.stage_slots = 0
        self.chunk_tiles = np.array(chunk_len or [0], np.int32)
        self.n_chunks = len(chunk_len)
        self.cmds = np.array(cmds or [(0,) * 6], np.int32).reshape(-1, 6)
        self.n_cmds = len(cmds)
        if self.allreduce and G > 1:
            others = owner != self.local
            self.pull_tiles = self.order[others].astype(np.int32)
            self.pull_owner = owner[others].astype(np.int32)
        else:
            self.pull_tiles = np.zeros(0, np.int32)
            self.pull_owner = np.zeros(0, np.int32)
        self.recv_slots = (nodes - 1) * self.n_final

    def network_bytes(self, elem_bytes=2):
        """Bytes this GPU sends over the network per call (whole tiles, edges included)."""
        return int(self.cmds[:self.n_cmds, 3].sum()) * self.bm * self.bn * elem_bytes


def nonempty(a):
    """Device tables may not be empty: pad with one unused entry."""
    return a if len(a) else np.zeros(1, a.dtype)
