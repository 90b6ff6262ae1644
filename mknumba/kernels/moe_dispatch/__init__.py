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

Symmetric over the node, each with one half per call parity (``slot = call & 1``): token
regions (a call's x) and meta regions (its T, per expert the count and start of its send
list, and the send list: its (token, top-k slot) pairs sorted by expert, with their weights),
one of each per node: this GPU's own and, between nodes, a copy of each rail peer's (so a
source rank's regions are on the GPU of each node with its local index: ``kernel.holder``);
and the count table (per source rank and local expert: rows, and where they start in the
source's send list). Epoch flags, symmetric: ``flags[src]`` (src's counts are in this GPU's
table), ``flags[W + src * units + u]`` (unit u, ``unit`` tokens, of src's tokens is on its
holder) and, between nodes, ``flags[W * (1 + units) + src]`` (src's meta region came through
the proxy). Local: the receive buffer (each local expert's rows from one tile row on, source
rank by source rank) and ``lflags`` (the layout; each tile row arrived). Inside a node tokens
are pulled (paper Table 3): a receiver reads the rows it needs over NVLink from the token
region that holds them; between nodes each GPU's regions are copied once to its rail peer in
every other node through the proxy, from the launch on, and that node pulls them from there
like its own. Blocks take roles by index; a role waits only on other ranks, the proxy or
lower-numbered blocks of its own GPU (docs/design.md §3):

  route    [0, 1)       count this call's pairs per expert (an expert id out of range: left
                          out and recorded, ``errors.KIND_EXPERT``); list them expert by
                          expert in the meta region (with weights); write each node GPU's
                          counts into its count table (NVLink stores); publish flags[me] on
                          every GPU of the node; nodes > 1: one proxy command per rail peer:
                          the meta region, then its arrival flag there   (waits: ring credits)
  pack     [1, P)       copy x into the token region ``unit`` tokens at a time; publish each
                          unit's flag on every GPU of the node; nodes > 1: one proxy command
                          per rail peer and unit                          (waits: ring credits)
  forward  [P, F)       nodes > 1: for each rail peer src: wait its meta region's arrival
                          flag; the first block writes src's counts into every node GPU's count
                          table and publishes flags[src] there; every block waits for each of
                          src's units (needed or not) and publishes its flag on the node's
                          other GPUs                                      (waits: the proxy)
  pull     [F, Q)       the first block: wait flags[src] of every rank; lay the call out
                          (expert bases, out offsets, each tile row's expert; more rows than
                          planned: a capacity error, no rows); publish the layout (local).
                        every block: wait the layout; for each tile row of the receive buffer
                          (blocks striding): each row from the token region holding its
                          source's tokens (NVLink loads, after its unit's flag), its source,
                          token, slot and weight into the caller's layout; publish the tile
                          row's flag (local)
  compute  [Q, grid)    wait the layout: tiles = tile rows x column tiles; for each tile
                          (blocks striding, tile rows in receive-buffer order): wait its tile
                          row's flag, fence the async proxy; out[rows of the tile] <- rows @
                          w[expert]^T (``roles.compute``: the sm90 TMA + wgmma tile with the
                          expert's tensor maps, or its SIMT twin); tile flag (local)

With ``comm_sms="adaptive"`` the pull blocks join the compute blocks as the controller's
flexible pool (``roles.controller``): the first lays the call out, then each block takes
pulls (16 rows of the receive buffer, each with its own flag) or tiles as the controller
decides, and a block whose next tile row's rows have not all arrived pulls instead of waiting
(route, pack and forward as above; ``kernel.make_kernel``).

No wait forms a cycle: route and pack wait on nothing but ring credits; forward waits on the
proxy (fed by other ranks' route and pack); pull on route, pack and forward (its own GPU's
and the peers'), compute on pull. Slots alternate with the call's parity: a rank cannot start
call e+2 before every other rank has finished call e (its call e+1 waits for every rank's
call e+1 counts, published after that rank's call e ended; a call ends only once its rail
peers' regions of the call are all here, as the forward role waits for every unit), so
nobody overwrites a half another GPU still reads or the proxy still copies.

Expert ids are checked on the device, so a call never waits for the GPU: the error reaches
the host at the next synchronize() or call (``errors.CLEARED_ONCE_RAISED``: after
synchronize() raised it the op takes calls again; a call that raises it is not launched, and
this rank then takes no more calls, as the others launched it). Under a CUDA graph capture a call
works as any other (the epoch lives on the GPU) once its token count, weight addresses and
(w_layout "ehf") scratch were met in an ordinary call, and it passes ``out=`` and
``layout=``; else it is refused with the reason.
"""
from .op import MoeDispatchGemm, MoeLayout

__all__ = ["MoeDispatchGemm", "MoeLayout"]
