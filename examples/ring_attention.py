"""Ring Attention: one long sequence split over the GPUs, every query attending to every key.

    mpirun -n 16 python examples/ring_attention.py            # 2 nodes x 8 GPUs
    mpiexec -n 4 python examples/ring_attention.py            # 4 GPUs, or the simulator
    mpiexec -n 4 python examples/ring_attention.py --causal   # causal, zigzag layout

How the sequence is split (``mknumba.sched.sequence``): with W ranks, rank r holds seq_local
rows of Q, K and V. ``contiguous`` gives rank r rows [r * seq_local, (r + 1) * seq_local);
``zigzag`` cuts the sequence into 2W chunks and gives rank r chunks r and 2W - 1 - r, so that
under a causal mask every rank has the same work (``shard`` and ``unshard`` convert).

What one call does, in one persistent kernel per GPU (``mknumba/kernels/ring_attention/``):
- send blocks store this rank's K and V into every other GPU of the node (NVLink; the next GPU
  first), then set a flag there;
- compute blocks attend to the local K and V at once, then to each other rank's slice as its
  flags arrive, keeping the softmax state in fp32 across slices: the result is the attention
  over the whole sequence, rounded to bf16 once. They never wait on the host;
- between nodes, each slice goes once to each other node's GPU of the same local rank (its
  rail peer) through the host proxy, at launch; that GPU forwards it inside its node.

Knobs: ``causal``, ``layout``, ``kv_heads`` (grouped-query attention), ``scale``; ``tile``
(on Hopper with head_dim 64 or 128 the compute blocks run the TMA + wgmma attention tile, 128
query rows each; elsewhere its SIMT twin); ``send_blocks`` / ``compute_blocks`` (and the SIMT
twin's ``threads``) for the schedule. Without a GPU this runs
in numba's CUDA simulator at a small size (one process per rank; 16 ranks as 2 emulated nodes
of 8). ``MKNUMBA_GPUS_PER_NODE`` poses one host as several nodes.

The script checks its result against a float64 NumPy reference of the whole sequence and
prints what it checked.
"""
import argparse
import os

import numpy as np
from mpi4py import MPI

import mknumba as mk
from mknumba._compat import SIMULATOR
from mknumba.sched.sequence import positions, shard
from numba import cuda


def reference(q, k, v, causal, rows, heads):
    """float64 attention over the whole sequence (q, k, v: [batch, seq, heads, d]) of the
    queries at global positions ``rows``, for the query heads ``heads``: [batch, rows, heads,
    d]."""
    b, S, h, d = q.shape
    g = h // k.shape[2]
    out = np.zeros((b, len(rows), len(heads), d))
    for bi in range(b):
        for j, hi in enumerate(heads):
            s = q[bi, rows, hi] @ k[bi, :, hi // g].T / np.sqrt(d)
            if causal:
                s = np.where(np.arange(S)[None, :] <= rows[:, None], s, -np.inf)
            p = np.exp(s - s.max(1, keepdims=True))
            out[bi, :, j] = p / p.sum(1, keepdims=True) @ v[bi, :, hi // g]
    return out


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--causal", action="store_true", help="causal mask, zigzag layout")
    args = ap.parse_args()
    # A small problem in the simulator, where every thread is a Python thread.
    batch, seq_local, heads, kv_heads, d = (1, 6, 2, 1, 16) if SIMULATOR else (2, 2048, 16, 4,
                                                                               128)
    layout = "zigzag" if args.causal else "contiguous"
    # Without a GPU, 16 ranks become 2 emulated nodes of 8, as on two 8-GPU machines (the
    # slices between nodes go through the proxy's simulated network).
    size, gpn = MPI.COMM_WORLD.Get_size(), None
    if SIMULATOR and "MKNUMBA_GPUS_PER_NODE" not in os.environ and size > 8 and size % 8 == 0:
        gpn = 8
    with mk.init(gpus_per_node=gpn) as comm:
        W, r = comm.size, comm.rank
        op = mk.RingAttention(comm, batch, seq_local, heads, kv_heads, d, causal=args.causal,
                              layout=layout)
        # The same global sequence on every rank (one seed); each keeps its own rows.
        rng = np.random.default_rng(0)
        full = [mk.to_bf16_bits(rng.standard_normal((batch, W * seq_local, n, d)))
                for n in (heads, kv_heads, kv_heads)]
        q, k, v = (cuda.to_device(shard(x, r, W, layout)) for x in full)
        out, lse = op(q, k, v)               # out: [batch, seq_local, heads, d], lse fp32
        op.synchronize()
        # this rank's rows, against float64 NumPy (every head in the simulator; the first and
        # last on GPUs, where the whole reference would take NumPy minutes)
        hs = list(range(heads)) if SIMULATOR else [0, heads - 1]
        mine = reference(*(mk.from_bf16_bits(x).astype(np.float64) for x in full), args.causal,
                         positions(r, seq_local, W, layout), hs)
        got = mk.from_bf16_bits(out.copy_to_host())[:, :, hs]
        err = np.linalg.norm(got - mine) / np.linalg.norm(mine)
        assert err <= 1e-2, f"rank {r}: relative error {err:.3g}"
        errs = comm.mpi.gather(err, root=0)
        if comm.rank == 0:
            print(f"Ring attention over {W} ranks, {comm.nodes} node(s) of {comm.local_size} "
                  f"({'simulator' if SIMULATOR else 'GPUs'}, {op.tile} tile): "
                  f"batch {batch}, sequence {W * seq_local} ({layout}, {seq_local} rows per "
                  f"rank), {heads} heads over {kv_heads} KV heads, head_dim {d}, "
                  f"causal={args.causal}: largest relative error against float64 NumPy "
                  f"{max(errs):.2e} (bf16 output). OK")
        op.free()


if __name__ == "__main__":
    main()
