"""MoE Dispatch + GEMM (paper §4, Table 3): expert-parallel token dispatch and the experts'
first GEMM in one persistent kernel.

    op = mk.MoeDispatchGemm(comm, hidden, ffn, experts, top_k, max_tokens)
    out, layout = op(x, topk_idx, w)   # x [T, hidden], topk_idx [T, top_k], w [E / W, hidden,
                                       # ffn] -> out [capacity, ffn], rows grouped by expert

Communication feeds computation, and routing is data: how many rows each expert gets is known
only on the GPU, so counts are exchanged inside the launch first, then tokens move, and each
grouped-GEMM tile starts once its rows are here. Three modules, each read alone: ``plan``
(options, capacities, the SM split, rank agreement), ``kernel`` (the roles and the kernel that
hands blocks to them, as below) and ``op`` (the host op: buffers, the prepared launch, calls).

Symmetric on every GPU, each with one half per call parity (``slot = call & 1``): the token
buffer xbuf (this call's x), the send list (this call's (token, top-k slot) pairs sorted by
expert, with their weights) and the count table (per source rank and local expert: rows, and
where they start in the source's send list). Epoch flags, symmetric: ``flags[src]`` (src's
counts and send list are ready) and ``flags[W + src * units + u]`` (unit u, 16 tokens, of
src's token buffer is there). Local: the receive buffer (each local expert's rows from one
tile row on, source rank by source rank) and ``lflags`` (the layout; each tile row arrived).
Inside a node tokens are pulled (paper Table 3): a receiver reads the rows it needs from the
sender's token buffer over NVLink. Blocks take roles by index; a role waits only on other
ranks or on lower-numbered blocks of its own GPU (docs/design.md §3):

  route    [0, 1)       count this call's pairs per expert; list them expert by expert in the
                          send list (with weights); write each GPU's counts into its count
                          table (NVLink stores); publish flags[me] on every GPU   (waits: none)
  pack     [1, P)       copy x into the token buffer 16 tokens at a time; publish each unit's
                          flag on every GPU                                        (waits: none)
  pull     [P, Q)       the first block: wait flags[src] of every rank; lay the call out
                          (expert bases, out offsets, each tile row's expert; more rows than
                          planned: a capacity error, no rows); publish the layout (local).
                        every block: wait the layout; for each tile row of the receive buffer
                          (blocks striding): each row from its source's token buffer (NVLink
                          loads, after its unit's flag), its source, token, slot and weight into
                          the caller's layout; publish the tile row's flag (local)
  compute  [Q, grid)    wait the layout: tiles = tile rows x column tiles; for each tile
                          (blocks striding, tile rows in receive-buffer order): wait its tile
                          row's flag, fence the async proxy; out[rows of the tile] <- rows @
                          w[expert]^T (``roles.compute``: the sm90 TMA + wgmma tile with the
                          expert's tensor maps, or its SIMT twin); tile flag (local)

No wait forms a cycle: route and pack wait on nothing; pull waits on route and pack (its own
GPU's and the peers'), compute on pull. Slots alternate with the call's parity: a rank cannot
start call e+2 before every other rank has finished call e (its call e+1 waits for every
rank's call e+1 counts, published after that rank's call e ended), so nobody overwrites a
half another GPU still reads.

One node for now: between nodes the token buffer would go to the rail peer through the proxy
and be forwarded inside its node (paper Table 3); planning with several nodes is refused.
"""
from .op import MoeDispatchGemm, MoeLayout

__all__ = ["MoeDispatchGemm", "MoeLayout"]
