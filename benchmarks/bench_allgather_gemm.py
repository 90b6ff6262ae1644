"""AllGather + GEMM (fused, one persistent kernel) against cuBLAS + NCCL and PyTorch's async-TP.

    mpirun --bind-to none -n 2 python benchmarks/bench_allgather_gemm.py \\
        --out benchmarks/results/allgather_gemm.json [--topology 1x2|2x1]

Two ranks, one per GPU; ``--topology`` 1x2 (one node, NVLink), 2x1 (two emulated nodes: the
dma transport through the host proxy, paced to ``--pace-gbps`` per GPU) or both (the default,
one after the other). Shapes (issue 19): the paper's M = K in {4K, 8K, 16K} (32K with
``--paper 4096,8192,16384,32768``), N = M / 16 per GPU; Llama-3-70B's k = 8192, n per GPU =
28672 / world and 10240 / world, m in {4096, 8192, 16384}. Capped so one topology takes about
two minutes (M = K = 32K alone needs ~6 ms a call and 10 GB per GPU). Each rank holds A's
[m / world, k] rows and the row-major [n, k] weight, handed over as its [k, n] view ``w.T``.

Baselines in the same process, one record each (docs/design.md §8):
- ``"cublas+nccl"``: ``dist.all_gather_into_tensor`` then ``torch.matmul``. In 2x1 NCCL still
  runs over NVLink (it cannot be paced), so the baseline there is the model
  ``T_cuBLAS + max(T_NCCL, network bytes / pace)``; the measured time is kept beside it.
- ``"torch_symm_mem"``: ``torch.ops.symm_mem.fused_all_gather_matmul`` (copy engines gather,
  every SM computes), NVLink multicast kept off (``TORCH_SYMM_MEM_DISABLE_MULTICAST=1``). One
  node only: between emulated nodes it would use NVLink, not the paced network. Where it is
  unavailable the record says why (``"unavailable"``) and has no time.

Ours: the fastest of a small sweep of send/forward SMs (``comm_sms``; every point kept under
"sweep"), after a correctness check against the cuBLAS + NCCL result. Floor:
``max(T_cuBLAS, bytes on the slowest link / its rate)``: NVLink at 380 GB/s (measured copy
rate, docs/design.md §6) for the shards each GPU receives from its node, the network at the pace
for the shards it receives from its rail peers.
"""
import os
import sys

os.environ.setdefault("TORCH_SYMM_MEM_DISABLE_MULTICAST", "1")   # never NVLink multicast
os.environ.setdefault("NCCL_NVLS_ENABLE", "0")

import common  # noqa: E402

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

from mknumba.kernels.allgather_gemm import AllGatherGemm  # noqa: E402

NVLINK_GBPS = 380.0
SWEEP = {"1x2": (8, 16, 32), "2x1": (4, 8, 16)}


def iters_for(ms_est):
    return int(min(50, max(5, 150.0 / max(ms_est, 1e-3))))


def shapes(args, world):
    """(m, n per GPU, k, family) of every point."""
    out = [(M, M // 16, M, "paper") for M in args.paper]
    out += [(m, n_full // world, 8192, "llama3-70b") for n_full in (28672, 10240)
            for m in args.llama_m]
    return out


class SymmMem:
    """PyTorch's fused_all_gather_matmul, or why it cannot run here (``reason``)."""

    def __init__(self, dist):
        self.reason = None
        try:
            import torch
            self.op = torch.ops.symm_mem.fused_all_gather_matmul
            self.group = dist.group.WORLD.group_name
            try:   # needed before PyTorch 2.9; newer versions enable groups on first use
                from torch.distributed._symmetric_memory import enable_symm_mem_for_group
                enable_symm_mem_for_group(self.group)
            except (ImportError, AttributeError):
                pass
        except Exception as e:  # noqa: BLE001 - recorded, not fatal
            self.reason = f"{type(e).__name__}: {e}"

    def __call__(self, a, b):
        _, outs = self.op(a, [b], gather_dim=0, group_name=self.group)
        return outs[0]


def bench_topology(comm, dist, args, records, log):
    import torch
    topo, paced, transport = common.transport_of(comm, args)
    W, G = comm.size, comm.local_size
    symm = SymmMem(dist) if comm.nodes == 1 else None
    for m, n, k, family in shapes(args, W):
        shard = m // W
        torch.manual_seed(31 + comm.rank)
        a = torch.randn(shard, k, device="cuda", dtype=torch.bfloat16)
        w = torch.randn(n, k, device="cuda", dtype=torch.bfloat16)
        b = w.T                                               # [k, n] view, no copy
        full = torch.empty(m, k, device="cuda", dtype=torch.bfloat16)
        c = torch.empty(m, n, device="cuda", dtype=torch.bfloat16)
        t_gemm = common.time_ms(lambda: torch.matmul(full, b, out=c), 20, mpi=comm.mpi)
        t_nccl = common.time_ms(lambda: dist.all_gather_into_tensor(full, a), 20, mpi=comm.mpi)

        def unfused():
            dist.all_gather_into_tensor(full, a)
            torch.matmul(full, b, out=c)
        t_unfused = common.time_ms(unfused, 20, mpi=comm.mpi)
        ref = c.float()                                       # the last unfused call's result
        shard_bytes = shard * k * 2
        t_link = (G - 1) * comm.nodes * shard_bytes / (NVLINK_GBPS * 1e9) * 1e3
        net_rate = (args.pace_gbps if paced else NVLINK_GBPS) * 1e9
        t_net = (comm.nodes - 1) * shard_bytes / net_rate * 1e3      # from the rail peers
        floor = max(t_gemm, t_link, t_net)
        if paced:
            base_ms = t_gemm + max(t_nccl, t_net)
            base_note = f"network modelled at {args.pace_gbps:g} GB/s"
        else:
            base_ms, base_note = t_unfused, None
        comm_share = (base_ms - t_gemm) / base_ms
        out = torch.empty(m, n, device="cuda", dtype=torch.bfloat16)
        sweep, splits, err = {}, {}, None
        for sms in (args.sweep or SWEEP.get(topo, (8, 16, 32))):
            op = AllGatherGemm(comm, m, n, k, comm_sms=sms)
            if err is None:                                   # correctness once per point
                out.fill_(float("nan"))
                op(a, b, out=out)
                op.synchronize()
                e = ((out.float() - ref).norm() / ref.norm()).item()
                ok = bool(torch.isfinite(out).all().item()) and e <= 1e-2
                err = comm.mpi.allreduce(e if ok else 1.0, op=common._max())
                if err > 1e-2:
                    log(f"WRONG allgather_gemm {topo} m={m} n={n} k={k}: rel err {err}")
            est = min(sweep.values()) if sweep else base_ms
            sweep[str(sms)] = common.time_ms(lambda: op(a, b, out=out), iters_for(est),
                                             mpi=comm.mpi)
            op.synchronize()
            splits[str(sms)] = op.role_blocks
            op.free()
        best = min(sweep, key=sweep.get)
        ours, split = sweep[best], splits[best]
        flops = 2.0 * m * n * k
        common_fields = dict(dtype="bfloat16", world=W, topology=topo, transport=transport,
                             ours_ms=ours, floor_ms=floor)
        extra = dict(family=family, sweep=sweep, sms_reserved=int(best),
                     sm_split=f"{split['compute'] + split['collect']}+{best}",
                     cublas_ms=t_gemm, nccl_ms=t_nccl, unfused_measured_ms=t_unfused,
                     network_ms=t_net if comm.nodes > 1 else None, nvlink_ms=t_link,
                     comm_share=comm_share, rel_err=err, of_floor=floor / ours,
                     tflops=flops / ours / 1e9)
        shape = {"m": m, "n": n, "k": k}
        records.append(common.record("allgather_gemm", shape, baseline="cublas+nccl",
                                     baseline_ms=base_ms, **common_fields, **extra,
                                     **({"baseline_note": base_note} if base_note else {})))
        line = (f"allgather_gemm {topo} m={m:5d} n={n:5d} k={k:5d} ours {ours:8.3f} ms "
                f"(comm_sms {best:>3s})  cublas+nccl {base_ms:8.3f} x{base_ms / ours:5.2f}")
        sym_ms, reason = None, "one node only (emulated nodes share NVLink)"
        if symm is not None:
            reason = symm.reason
            if reason is None:
                try:
                    got = symm(a, b)
                    torch.cuda.synchronize()
                    e = ((got.float() - ref).norm() / ref.norm()).item()
                    if not e <= 1e-2:
                        log(f"WRONG torch_symm_mem m={m} n={n} k={k}: rel err {e}")
                    sym_ms = common.time_ms(lambda: symm(a, b), iters_for(ours), mpi=comm.mpi)
                except Exception as e:  # noqa: BLE001 - recorded, not fatal
                    reason = f"{type(e).__name__}: {e}"
            line += (f"  torch_symm_mem {sym_ms:8.3f} x{sym_ms / ours:5.2f}" if sym_ms else
                     "  torch_symm_mem n/a")
        records.append(common.record("allgather_gemm", shape, baseline="torch_symm_mem",
                                     baseline_ms=sym_ms, **common_fields, **extra,
                                     **({} if sym_ms else {"unavailable": reason})))
        if comm.rank == 0:
            common.write(records, args.out)           # keep every point, even if cut short
        log(line + f"  floor {floor:8.3f} ({floor / ours:4.0%})  comm {comm_share:4.0%}  "
                   f"err {err:.1e}")
        a = w = b = full = c = out = ref = None       # freed before the next point's
        torch.cuda.empty_cache()


def main():
    args = common.parse_args(ranks=2, extra=[
        (("--topology",), dict(default="1x2,2x1", help="1x2, 2x1, or both (comma list)")),
        (("--paper",), dict(default="4096,8192,16384",
                            help="the paper's M = K values (N = M / 16 per GPU)")),
        (("--llama-m",), dict(default="4096,8192,16384",
                              help="token counts m of the Llama-3-70B shapes")),
        *common.NETWORK_ARGS,
        (("--sweep",), dict(default="", help="comm SMs to try at every point (default: "
                                              "a built-in list per topology)"))])
    args.paper = [int(s) for s in args.paper.split(",") if s]
    args.llama_m = [int(s) for s in args.llama_m.split(",") if s]
    args.sweep = [int(s) for s in args.sweep.split(",") if s]
    common.run_topologies(args, bench_topology, args.topology.split(","), 29561)


if __name__ == "__main__":
    main()
