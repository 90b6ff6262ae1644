"""AllGather + GEMM (paper §4, Table 3): ``out = AllGather(a) @ b`` in one persistent kernel.

    op = mk.AllGatherGemm(comm, m, n, k)       # plans the gathered A, flags, roles, tile order
    out = op(a, b)          # a: [m / world, k], b: [k, n] (bf16) -> out: [m, n]

Communication feeds computation: every GPU needs every rank's rows of A before the tiles that
read them. Three modules, each read alone: ``plan`` (options, parts, the SM split, the tile
order, rank agreement), ``kernel`` (the roles and the kernel that hands blocks to them, as
below) and ``op`` (the host op: buffers, the prepared launch, calls).

Each GPU holds a symmetric gathered A, [m, k] per call parity (``slot = call & 1``), and one
epoch flag per part of every rank's shard (``flags[r * parts + p]``, a part is ``part_rows``
rows). Blocks take roles by index; a role waits only on other ranks, the proxy or
lower-numbered blocks of its own GPU (docs/design.md §3):

  send     [0, S)       for each part p of this rank's shard (blocks share the parts):
                          gathered[slot][my rows of p] <- a            (local stores)
                          publish flags[me, p] = epoch here              (sys: the proxy reads p)
                          nodes > 1: one command per rail peer to the proxy: p -> the same
                            rows of its gathered A, then its flags[me, p] (at launch: the
                            slowest link starts first)
                        then for each part p: into every other GPU of the node (NVLink stores,
                          the next GPU first); publish flags[me, p] there
  forward  [S, F)       nodes > 1, G > 1: for each rail peer r, each part p: wait flags[r, p]
                          (the proxy sets it here); push the part to every other GPU of the
                          node; publish flags[r, p] there
  collect  [F, C)       planned with gathered=True, and a call with gathered=: for each part of
                          each shard in arrival order: wait its flag; copy it to the caller's
                          gathered A (local)
  compute  [C, grid)    for each tile t in ``order`` (``sched.tiles.gather_order``: this
                          rank's rows first, then the node's other shards, then the other
                          nodes', the rail peer's first), blocks striding: every thread waits
                          for the flags of the parts its rows touch (a ragged tile row may
                          span two shards) and fences the async proxy (the sm_90a tile reads A
                          by TMA through a tensor map over this GPU's gathered A);
                          out[t] <- gathered[slot][rows of t] @ B[:, cols of t]; publish
                          tile_flags[t] (GPU scope)

Each shard crosses the network once per node (to the rail peer, which forwards it over
NVLink), and NVLink once per GPU. No wait forms a cycle: send waits on ring credits only,
forward on the proxy (fed by send), collect and compute on send and forward.

Epochs, not resets: flags take the call's epoch (``roles.blocks.begin``: the kernel numbers
its own calls). Slots alternate with the call's parity: a rank cannot start call e+2 before
every other rank has finished call e (its call e+1 needs their call e+1 shards, which they
send after their call e), so nobody writes a slot another GPU still reads; a flag already at
e+1 while a GPU is still in call e means the call-e rows are there (and e+1's went to the
other slot).
"""
from .op import AllGatherGemm

__all__ = ["AllGatherGemm"]
