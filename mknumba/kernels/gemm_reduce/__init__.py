"""GEMM + ReduceScatter and GEMM + AllReduce: one persistent kernel, hierarchical reduction.

Three modules, each read alone: ``plan`` (options, the SM split between roles, rank
agreement), ``kernel`` (the roles and the kernel that hands blocks to them, as below) and
``op`` (the host op: buffers, the prepared launch, calls).

Every rank computes a partial product ``A_r @ B_r`` (A_r: [m, k_local], B_r: [k_local, n]); the
result is the sum over all ranks, scattered by row blocks (ReduceScatter) or everywhere
(AllReduce). Blocks take roles by index; a role waits only on lower-numbered blocks of its own
GPU or on other ranks (docs/design.md §3), so the stages below are in block order (the joiners, last
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

With ``comm_sms="adaptive"`` the compute and reduce blocks (one node, AllReduce: and the pull
blocks) are one pool, [0, R): each block takes its next item from the compute queue or the
reduce (then pull) queue as the controller (``roles.controller``) decides between items, and a
block holding a reduce or pull item that is not ready computes a tile meanwhile (a poll, no
wait) while tiles are left; only then does it wait, bounded. A compute item never waits (no
fold), and every tile is taken by a block that computes it at once, so the waits end: on the
GPU every block is resident; in the simulator block 0 does all the pool's work itself.
Send, receive and (between nodes) pull keep their blocks after the pool.

Stores rather than loads cross NVLink wherever the roles allow: a block stores over NVLink
about twice as fast as it loads (loads wait a round trip; benchmarks/NOTES.md). So the owner
pushes finished AllReduce tiles to the other local GPUs rather than letting them pull, and on
one node the GEMM's epilogue can deliver each partial tile to its owner (``deliver``). A user's
``out`` is not mapped into the other GPUs, so the owner pushes into their partials and each
copies the tile out; an AllReduce planned with ``shared_out`` owns a symmetric output that
every owner writes into directly (``C_DIRECT``; with delivery or between nodes).

Per GPU only 1/G of the output crosses the network, to its rail peers. Epochs, not resets: flags
take the call's epoch (``roles.blocks.begin``: the kernel numbers its own calls); ``slot =
call & 1`` double-buffers ``part``, ``stage`` and ``recv``: a rank cannot start call e+2 before every peer it exchanges with has finished call e (call e+1
waits on that peer's call e+1 tiles or finished tiles, which follow its call e in stream
order), so a slot is never rewritten, nor delivered into, while a peer still reads it.
"""
from .op import GemmReduce

__all__ = ["GemmReduce"]
