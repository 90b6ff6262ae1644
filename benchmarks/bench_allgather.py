"""AllGather: mknumba's persistent kernel against NCCL all_gather, one node and across nodes.

    mpirun --bind-to none -n 2 python benchmarks/bench_allgather.py \\
        --out benchmarks/results/allgather.json [--topology 1x2|2x1|1x2,2x1]

Two ranks, one per GPU; ``--topology`` 1x2 (one node: ``scope="node"``, NVLink), 2x1 (two
emulated nodes: ``scope="world"``, each shard sent once to the other node's rail peer through
the host proxy's dma transport, paced to ``--pace-gbps`` per GPU) or both (the default, one
after the other). Shards of 1, 16, 64 and 256 MiB per rank (float32), PyTorch tensors handed to
mknumba through __cuda_array_interface__ (no copies); each result is checked against NCCL's.

Baseline ``"nccl_all_gather"`` (``dist.all_gather_into_tensor``) in the same process. In 2x1
NCCL still runs over NVLink (it cannot be paced), so the baseline there is the model
``max(T_NCCL, network bytes / pace)``, the measured time kept beside it (``nccl_ms``). Floor:
the bytes each GPU receives over its slowest link at that link's rate (NVLink: the measured
copy rate, docs/design.md §6; the network: the pace). Issue 19's goals: >= 0.9x NCCL at >= 64
MiB per rank on 1x2, >= 90% of the floor on 2x1.
"""
import common
import numpy as np

import mknumba as mk

P2P_GBPS = 380.0   # measured GPU-to-GPU copy rate on 2xH200 (docs/design.md §6)
SIZES_MIB = (1, 16, 64, 256)


def bench_topology(comm, dist, args, records, log):
    import torch
    topo, paced, transport = common.transport_of(comm, args)
    scope = "node" if comm.nodes == 1 else "world"
    for mib in SIZES_MIB:
        n = mib * (1 << 20) // 4
        torch.manual_seed(7 + comm.rank)
        x = torch.randn(n, device="cuda", dtype=torch.float32)
        out_nccl = torch.empty(comm.size * n, device="cuda", dtype=torch.float32)
        op = mk.AllGather(comm, (n,), np.float32, scope=scope)
        out = torch.empty((op.members, n), device="cuda", dtype=torch.float32)
        out.fill_(float("nan"))
        op(x, out=out)
        op.synchronize()
        dist.all_gather_into_tensor(out_nccl, x)
        wrong = comm.mpi.allreduce(int(not torch.equal(out.reshape(-1), out_nccl)),
                                   op=common._max())
        if wrong:
            log(f"WRONG allgather {topo} {mib} MiB: differs from NCCL's")
        iters = 20
        ours = common.time_ms(lambda: op(x, out=out), iters, mpi=comm.mpi)
        op.synchronize()
        nccl = common.time_ms(lambda: dist.all_gather_into_tensor(out_nccl, x), iters,
                              mpi=comm.mpi)
        shard = n * 4
        t_link = (comm.local_size - 1) * shard / (P2P_GBPS * 1e9) * 1e3
        net_rate = (args.pace_gbps if paced else P2P_GBPS) * 1e9
        t_net = (comm.nodes - 1) * comm.local_size * shard / net_rate * 1e3
        floor = max(t_link, t_net)
        base = max(nccl, t_net) if paced else nccl
        recv_bytes = (comm.size - 1) * shard
        records.append(common.record(
            "allgather", {"bytes_per_rank": shard}, dtype="float32", world=comm.size,
            topology=topo, transport=transport, ours_ms=ours, baseline="nccl_all_gather",
            baseline_ms=base, floor_ms=floor, nccl_ms=nccl, scope=scope, correct=not wrong,
            of_floor=floor / ours,
            gbps=recv_bytes / ours / 1e6,
            baseline_note=(f"network modelled at {args.pace_gbps:g} GB/s" if paced else None)))
        r = records[-1]
        log(f"allgather {topo} {mib:4d} MiB/rank: ours {ours:.3f} ms, nccl {base:.3f} ms "
            f"(x{r['speedup']:.2f}), floor {floor:.3f} ms ({r['of_floor']:.2f} of it), "
            f"{r['gbps']:.0f} GB/s")
        op.free()


def main():
    args = common.parse_args(ranks=2, extra=common.NETWORK_ARGS + [
        (("--topology",), dict(default="1x2,2x1", help="1x2, 2x1, or both (comma list)"))])
    common.run_topologies(args, bench_topology, args.topology.split(","), 29533)


if __name__ == "__main__":
    main()
