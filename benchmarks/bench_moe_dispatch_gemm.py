"""MoE Dispatch + GEMM (fused, one persistent kernel) against NCCL all-to-all + grouped GEMM.

    mpirun --bind-to none -n 2 python benchmarks/bench_moe_dispatch_gemm.py \\
        --out benchmarks/results/moe_dispatch_gemm.json [--topology 1x2|2x1]

Two ranks, one per GPU (issue 20, item 4); ``--topology`` 1x2 (one node, NVLink), 2x1 (two
emulated nodes: the dma transport, paced to ``--pace-gbps`` per GPU) or both (the default).
Where the op cannot be planned, the records keep the baselines with ``ours_ms: null`` and the
reason (``"unavailable"``).

Shapes: DeepSeek-V3-like (hidden 7168, ffn 2048, 256 experts, top-8) and Mixtral-like (hidden
4096, ffn 14336, 8 experts, top-2), ``--tokens`` in all (over the ranks; default 4K, 16K,
64K); routing ``uniform`` (top_k distinct experts, uniformly) and ``zipf`` (expert i drawn with
weight 1 / (i + 1), top_k distinct: hot experts, and the rank that holds them receives most
rows). Each rank draws its own tokens and routing; weights are [E / W, ffn, hidden] (as
nn.Linear stores them: ours plans w_layout="efh"; the grouped GEMM reads the [E / W, hidden,
ffn] view of the same memory).

Baselines in the same process, one record each (docs/design.md §8):
- ``"nccl_a2a+grouped_mm"``: per-destination counts exchanged with ``all_to_all_single`` (the
  split sizes then go to the host: one sync, as every NCCL dispatch needs), the rows sorted by
  destination expert and sent with ``all_to_all_single``, regrouped expert by expert, then
  ``torch._grouped_mm`` (a loop of ``torch.matmul`` where it is missing: ``"grouped_mm"``
  says which ran).
- ``"uniform_a2a+gemm"``: the paper's baseline: an all-to-all of equal splits (the average
  rows per destination) and one ungrouped GEMM of the rows received against one expert's
  weight: what a dispatch would cost if routing were uniform and known in advance.
In 2x1 NCCL still runs over NVLink (it cannot be paced), so the baselines' network part is
modelled there: ``T_compute + max(T_nccl, network bytes / pace)``; the measured time is kept.

Floor: ``max(T_grouped_mm, bytes on the slowest link / its rate)``: the rows this rank
receives from the other GPU, over NVLink at 380 GB/s (docs/design.md §6) or the paced network.
Correctness: before timing, 2048 sampled rows of ours against x[token] @ w[expert] (float32)
from an all-gather of every rank's tokens; a WRONG line and ``rel_err`` in the record.
"""
import os
import sys

os.environ.setdefault("NCCL_NVLS_ENABLE", "0")        # never NVLink multicast

import common  # noqa: E402

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

import mknumba as mk  # noqa: E402

NVLINK_GBPS = 380.0
MODELS = {"deepseek-v3": dict(hidden=7168, ffn=2048, experts=256, top_k=8),
          "mixtral": dict(hidden=4096, ffn=14336, experts=8, top_k=2)}


def iters_for(ms_est):
    return int(min(30, max(3, 100.0 / max(ms_est, 1e-3))))


def routing(torch, T, experts, top_k, kind, gen):
    """topk_idx int32 [T, top_k] (distinct experts per token) and weights fp32."""
    if kind == "uniform":
        probs = torch.ones(experts, device="cuda")
    else:
        probs = 1.0 / torch.arange(1, experts + 1, device="cuda", dtype=torch.float32)
    idx = torch.multinomial(probs.expand(T, experts), top_k, replacement=False,
                            generator=gen) if T else torch.empty(0, top_k, device="cuda",
                                                                  dtype=torch.int64)
    return idx.to(torch.int32).contiguous(), torch.rand(T, top_k, device="cuda", generator=gen)


class NcclDispatch:
    """The unfused dispatch + grouped GEMM of one call's routing (PyTorch + NCCL)."""

    def __init__(self, torch, dist, W, El, x, idx, wt_view):
        self.torch, self.dist, self.W, self.El = torch, dist, W, El
        self.x, self.idx, self.w = x, idx, wt_view        # w: [El, hidden, ffn] view
        self.grouped = hasattr(torch, "_grouped_mm")

    def __call__(self):
        torch, dist, W, El = self.torch, self.dist, self.W, self.El
        K = self.idx.shape[1]
        flat = self.idx.reshape(-1).long()
        order = torch.argsort(flat, stable=True)           # rows sorted by global expert
        counts = torch.bincount(flat, minlength=W * El).to(torch.int32)
        recv_counts = torch.empty_like(counts)             # [W (source), El] after exchange
        dist.all_to_all_single(recv_counts, counts)
        send_split = counts.view(W, El).sum(1)
        recv_matrix = recv_counts.view(W, El)
        splits = torch.stack([send_split, recv_matrix.sum(1)]).cpu()   # the host needs them
        send = self.x[order // K]
        recv = torch.empty(int(splits[1].sum()), self.x.shape[1], device="cuda",
                           dtype=self.x.dtype)
        dist.all_to_all_single(recv, send, splits[1].tolist(), splits[0].tolist())
        # received source by source, each source's rows expert by expert: regroup by expert
        src_of = torch.repeat_interleave(torch.arange(W * El, device="cuda"),
                                         recv_matrix.reshape(-1).long())
        expert_of = src_of % El
        regroup = torch.argsort(expert_of, stable=True)
        rows = recv[regroup]
        ends = torch.cumsum(recv_matrix.sum(0), 0).to(torch.int32)
        if self.grouped:
            return torch._grouped_mm(rows, self.w, offs=ends)
        out, start = [], 0
        for e, end in enumerate(ends.tolist()):
            out.append(rows[start:end] @ self.w[e])
            start = end
        return torch.cat(out)


def bench_topology(comm, dist, args, records, log):
    import torch
    topo, paced, transport = common.transport_of(comm, args)
    W, me = comm.size, comm.rank
    for model in args.models:
        cfg = MODELS[model]
        H, F, E, K = cfg["hidden"], cfg["ffn"], cfg["experts"], cfg["top_k"]
        El = E // W
        for total in args.tokens:
            T = total // W
            gen = torch.Generator(device="cuda")
            gen.manual_seed(1000 + me)
            x = torch.randn(T, H, device="cuda", dtype=torch.bfloat16, generator=gen)
            w = torch.randn(El, F, H, device="cuda", dtype=torch.bfloat16,
                            generator=gen) / H ** 0.5
            wt_view = w.transpose(1, 2)                        # [El, hidden, ffn], no copy
            x_all = torch.empty(W * T, H, device="cuda", dtype=torch.bfloat16)
            dist.all_gather_into_tensor(x_all, x)
            op, why = None, None
            try:
                op = mk.MoeDispatchGemm(comm, H, F, E, K, T, w_layout="efh")
            except mk.MkValueError as e:
                why = str(e)
            for kind in args.routing:
                idx, wts = routing(torch, T, E, K, kind, gen)
                base = NcclDispatch(torch, dist, W, El, x, idx, wt_view)
                ref_out = base()
                R = ref_out.shape[0]
                rows_in = torch.tensor([R], device="cuda")
                rows_max = rows_in.clone()
                dist.all_reduce(rows_max, op=dist.ReduceOp.MAX)
                # the parts of the baseline, for the floor and the 2x1 model
                t_a2a = common.time_ms(base, iters_for(5.0), mpi=comm.mpi)
                rows = torch.randn(R, H, device="cuda", dtype=torch.bfloat16, generator=gen)
                ends = torch.cumsum(torch.full((El,), R // El, device="cuda"), 0).to(
                    torch.int32)
                ends[-1] = R
                t_mm = common.time_ms(
                    (lambda: torch._grouped_mm(rows, wt_view, offs=ends)) if base.grouped
                    else (lambda: [rows[:R // El] @ wt_view[0] for _ in range(El)]),
                    iters_for(1.0), mpi=comm.mpi)
                # rows from the other GPU (W = 2): what crosses the slowest link
                remote_bytes = R * H * 2 * (W - 1) / W
                rate = (args.pace_gbps if paced else NVLINK_GBPS) * 1e9
                t_link = remote_bytes / rate * 1e3
                floor = max(t_mm, t_link)
                base_a = t_a2a if not paced else t_mm + max(t_a2a - t_mm, t_link)
                # (b) uniform all-to-all of the average rows per destination + one GEMM
                per = max(1, T * K // W)
                send_u = torch.randn(W * per, H, device="cuda", dtype=torch.bfloat16,
                                     generator=gen)
                recv_u = torch.empty_like(send_u)
                out_u = torch.empty(W * per, F, device="cuda", dtype=torch.bfloat16)

                def uniform():
                    dist.all_to_all_single(recv_u, send_u)
                    torch.matmul(recv_u, wt_view[0], out=out_u)
                t_uni = common.time_ms(uniform, iters_for(2.0), mpi=comm.mpi)
                base_b = t_uni if not paced else t_uni + max(0.0, t_link - t_uni)
                ours, err, extra = None, None, {}
                if op is not None:
                    out, lay = op(x, idx, w, topk_weights=wts)
                    op.synchronize()
                    err = check(torch, op, x_all, T, w, out, lay, me, El)
                    err = comm.mpi.allreduce(err, op=common._max())
                    if not err <= 1e-2:
                        log(f"WRONG moe_dispatch_gemm {topo} {model} tokens={total} {kind}: "
                            f"rel err {err}")
                    ours = common.time_ms(lambda: op(x, idx, w, topk_weights=wts, out=out,
                                                     layout=lay), iters_for(t_a2a),
                                          mpi=comm.mpi)
                    op.synchronize()
                    extra = dict(sm_split=f"{op.role_blocks['compute']}+"
                                          f"{op.grid - op.role_blocks['compute']}",
                                 sms_reserved=op.grid - op.role_blocks["compute"],
                                 of_floor=floor / ours,
                                 tflops=2.0 * R * H * F / ours / 1e9)
                else:
                    extra = dict(unavailable=why)
                shape = dict(tokens=total, hidden=H, ffn=F, experts=E, top_k=K,
                             routing=kind)
                common_fields = dict(dtype="bfloat16", world=W, topology=topo,
                                     transport=transport, ours_ms=ours, floor_ms=floor,
                                     model=model, rows_received=R,
                                     rows_received_max=int(rows_max.item()),
                                     grouped_mm_ms=t_mm, link_ms=t_link, rel_err=err,
                                     grouped_mm="torch._grouped_mm" if base.grouped
                                     else "matmul loop", **extra)
                records.append(common.record("moe_dispatch_gemm", shape,
                                             baseline="nccl_a2a+grouped_mm",
                                             baseline_ms=base_a, measured_ms=t_a2a,
                                             comm_share=max(0.0, (t_a2a - t_mm) / t_a2a),
                                             **common_fields))
                records.append(common.record("moe_dispatch_gemm", shape,
                                             baseline="uniform_a2a+gemm", baseline_ms=base_b,
                                             measured_ms=t_uni, **common_fields))
                if comm.rank == 0:
                    common.write(records, args.out)       # keep every point, even if cut short
                line = f"moe_dispatch_gemm {topo} {model:11s} tokens={total:6d} {kind:7s} "
                line += (f"ours {ours:8.3f} ms  a2a+grouped {base_a:8.3f} "
                         f"x{base_a / ours:5.2f}  uniform {base_b:8.3f} x{base_b / ours:5.2f}"
                         f"  floor {floor:8.3f} ({floor / ours:4.0%})  err {err:.1e}"
                         if ours else f"ours n/a  a2a+grouped {base_a:8.3f}  uniform "
                                      f"{base_b:8.3f}  floor {floor:8.3f}")
                log(line)
                base = ref_out = rows = send_u = recv_u = out_u = None   # before the next
            if op is not None:
                op.free()
            x = w = wt_view = x_all = None
            torch.cuda.empty_cache()


def check(torch, op, x_all, T, w, out, lay, me, El, sample=2048):
    """Relative error of ``sample`` random rows of ours against float32 x[token] @ w[e]^T."""
    R = int(lay.offsets[-1].item())
    if R == 0:
        return 0.0
    pick = torch.randint(0, R, (min(sample, R),), device="cuda")
    info = lay.rows[pick].long()                       # source rank, token, slot
    expert = torch.searchsorted(lay.offsets[1:].long(), pick, right=True)
    xs = x_all[info[:, 0] * T + info[:, 1]].float()
    ref = torch.empty(pick.shape[0], w.shape[1], device="cuda")
    for e in torch.unique(expert).tolist():          # one expert's weight at a time
        mask = expert == e
        ref[mask] = xs[mask] @ w[e].float().T
    got = out[pick].float()
    if not torch.isfinite(got).all():
        return float("inf")
    return ((got - ref).norm() / ref.norm()).item()


def main():
    args = common.parse_args(ranks=2, extra=[
        (("--topology",), dict(default="1x2,2x1", help="1x2, 2x1, or both (comma list)")),
        (("--models",), dict(default="deepseek-v3,mixtral", help="comma list of "
                                                                + ", ".join(MODELS))),
        (("--tokens",), dict(default="4096,16384,65536", help="tokens in all (over ranks)")),
        (("--routing",), dict(default="uniform,zipf", help="uniform, zipf (comma list)")),
        *common.NETWORK_ARGS])
    args.models = [m for m in args.models.split(",") if m]
    args.tokens = [int(s) for s in args.tokens.split(",") if s]
    args.routing = [r for r in args.routing.split(",") if r]
    common.run_topologies(args, bench_topology, args.topology.split(","), 29571)


if __name__ == "__main__":
    main()
