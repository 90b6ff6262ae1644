"""AllGather over NVLink (one node): mknumba's persistent kernel against NCCL all_gather.

    mpirun -n 2 python benchmarks/bench_allgather.py --out benchmarks/results/allgather.json
Inputs are PyTorch tensors handed to mknumba through __cuda_array_interface__ (no copies).
The floor is the bytes each GPU must receive over its NVLink at the measured copy rate.
"""
import common
import numpy as np

import mknumba as mk

P2P_GBPS = 380.0   # measured GPU-to-GPU copy rate on 2xH200 (docs/design.md §6)


def main():
    args = common.parse_args(ranks=2)
    import torch
    comm = mk.init()
    dist = common.init_nccl(29533, device=comm.device_id)
    records = []
    for mib in (1, 16, 64, 256):
        n = mib * (1 << 20) // 4
        x = torch.randn(n, device="cuda", dtype=torch.float32)
        out_nccl = torch.empty(comm.size * n, device="cuda", dtype=torch.float32)
        op = mk.AllGather(comm, (n,), np.float32)
        out = torch.empty((comm.size, n), device="cuda", dtype=torch.float32)
        op(x, out=out)
        op.synchronize()
        dist.all_gather_into_tensor(out_nccl, x)
        assert torch.equal(out.reshape(-1), out_nccl), "AllGather differs from NCCL"
        iters = 20
        ours = common.time_ms(lambda: op(x, out=out), iters, mpi=comm.mpi)
        op.synchronize()
        base = common.time_ms(lambda: dist.all_gather_into_tensor(out_nccl, x), iters,
                              mpi=comm.mpi)
        recv_bytes = (comm.size - 1) * n * 4
        floor = recv_bytes / (P2P_GBPS * 1e9) * 1e3
        records.append(common.record(
            "allgather", {"bytes_per_rank": n * 4}, dtype="float32", world=comm.size,
            topology=f"{comm.nodes}x{comm.local_size}", transport="nvlink", ours_ms=ours,
            baseline="nccl_all_gather", baseline_ms=base, floor_ms=floor,
            gbps=recv_bytes / ours / 1e6))
        op.free()
    if comm.rank == 0:
        common.write(records, args.out)
        for r in records:
            print(r["shape"], f"ours {r['ours_ms']:.3f} ms  nccl {r['baseline_ms']:.3f} ms  "
                  f"x{r['speedup']:.2f}  {r['gbps']:.0f} GB/s")
    dist.destroy_process_group()
    comm.finalize()


if __name__ == "__main__":
    main()
