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
  compute  [.., grid)   for each tile of query rows (batch, head, rows; blocks take tiles
                          snaking, the heaviest causal ones first): attend to the local slice,
                          then to the others in ``order`` (this node's GPUs in ring order, then
                          the other nodes') as each arrives (flags[src, :], or arrive[src, ...]
                          for a rail peer's); the running max, denominator and output stay in
                          fp32 across slices (the LSE merge, ``roles.attention``); out (bf16)
                          and lse (fp32) written once

With ``comm_sms="adaptive"`` (``kernel.make_kernel(tile, adaptive=True)``) the compute
blocks are the controller's flexible pool (``roles.controller``): they also push the parts of
this rank's slice inside the node, each next item (a query tile or a part) picked between query tiles, a
block whose next tile's slices have not all arrived pushing a part meanwhile; between nodes
send (to the proxy) and forward stay fixed. On the sm_90a tile the producer lane picks the
items and hands each to the consumer warpgroups through a mailbox in shared memory (the two
never meet at a block-wide barrier once they set their registers).

Slots are double-buffered by call parity (``slot = call & 1``): a rank cannot start call e+2
before every peer has finished call e (its call e+1 waited on their call e+1 slices), so a
slot is never rewritten while a peer still reads it. Causal attention masks each key by the
global positions of the layout (``sched.sequence``: contiguous, or zigzag for equal work).

Two modules, each read alone: ``kernel`` (the roles above and the kernel that hands blocks to
them) and ``op`` (the host op: the symmetric slots, tensor maps, the prepared launch, calls).

The compute role runs on the Hopper tile (``roles/cuda/attention_tile.cu``: TMA + wgmma, 128
query rows per block, the producer lane waiting for each slice's flags before it queues the
slice's KV tiles) where the GPU is sm_90a and head_dim is 64 or 128, and on its SIMT twin (one
query row per thread, plain loads) elsewhere, the simulator included.
"""
from .kernel import make_kernel
from .op import RingAttention, attention

__all__ = ["RingAttention", "attention", "make_kernel"]
