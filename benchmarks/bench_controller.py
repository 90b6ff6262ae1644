"""The adaptive SM split against static splits: for each fused kernel, shape and topology, a
sweep of static splits, the best of them, the recorded table's choice and the controller.

    mpirun --bind-to none -n 2 python benchmarks/bench_controller.py \
        --out benchmarks/results/controller.json [--save-trace /tmp/ctl]

Two ranks, one per GPU; ``1x2`` (NVLink) and ``2x1`` (two emulated nodes through the host
proxy, paced to ``--pace-gbps``) in one run. Kernels (``--kernels``, comma-separated): ``rs``
GEMM + ReduceScatter, ``ar`` GEMM + AllReduce, ``ag`` AllGather + GEMM, ``ring`` Ring
Attention, ``moe`` MoE Dispatch + GEMM. Shapes of rs and ar (m = n, k_local): every row of the
recorded table (``sched/split.py``, ``held_out: false``) and shapes that are not in it
(``--held-out``, ``held_out: true``); ag, ring and moe have no recorded table (their "table"
is the op's default split), so each of their shapes is ``held_out: true``: ag (m, n, k) from
``AG_SHAPES``, ring (seq total, heads, kv_heads, head_dim 128, causal on zigzag) from
``RING_SHAPES``, moe (hidden, ffn, experts, top_k, tokens over the ranks, routing uniform or
Zipf-hot as in bench_moe_dispatch_gemm.py; w as [E / W, ffn, hidden]) from ``MOE_SHAPES``.
Per point, each configuration is checked once against a reference (into a poisoned output;
rs, ar, ag: fp32 products; ring: the output of the op's default static split, itself checked
against fp32 SDPA of the gathered sequence with the layout's positions as the mask; moe: 2048
sampled rows against fp32 x[token] @ w[expert]^T), then timed over back-to-back calls (mean,
slowest rank):

- ``static``: ``comm_sms`` = each of ``--sweep`` (default 1, 2, 4, ..., 64; splits the op
  refuses for the topology are skipped), with the table's deliver/fold for the shape (ring:
  ``send_blocks`` = each of the sweep, its send blocks being its communication SMs; moe: its
  pack, forward and pull blocks);
- ``table``: the op's default (``comm_sms=None``: the recorded table's split);
- ``adaptive``: ``comm_sms="adaptive"`` (``roles.controller``; it starts from the table's
  split, never folds).

``--quick``: a smoke run that also works with two ranks sharing one GPU
(``MKNUMBA_ALLOW_SHARED_GPU=1``: its timings mean nothing): tiny shapes of every kernel
given, a short sweep, 1x2 only, no NCCL (references through MPI on the host):

    MKNUMBA_ALLOW_SHARED_GPU=1 mpirun -n 2 python benchmarks/bench_controller.py --quick \
        --kernels rs,ar,ag,ring,moe --out /tmp/controller_quick.json

Records (docs/design.md §8) carry ``sm_split`` ("compute+comm", or "adaptive"), ``controller``
(true for the adaptive runs), ``held_out``, ``config`` (static | table | adaptive), and
compare with the best static split of the point: ``baseline`` "best_static_split",
``baseline_ms`` its time, ``speedup`` best / ours (1.0 for the best itself, < 1 slower). The
floor is as in bench_fused.py. At the end rank 0 prints per kernel and topology the
controller's geometric mean and worst ratio to the best static split, and against the table
on the held-out shapes (the goals: <= 1.05x, no point worse than 1.15x, better than
the table where held out). ``--save-trace PREFIX``: one traced controller call per point as a
Chrome / Perfetto trace (``PREFIX-<kernel>-<topology>-<m>-<k>.json``, see
benchmarks/plot_timeline.py; MoE Dispatch + GEMM has no trace yet).
"""
import math
import os
import sys

import common

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

from mknumba.errors import MkValueError  # noqa: E402
from mknumba.kernels.allgather_gemm import AllGatherGemm  # noqa: E402
from mknumba.kernels.gemm_ar import GemmAllReduce  # noqa: E402
from mknumba.kernels.gemm_rs import GemmReduceScatter  # noqa: E402
from mknumba.kernels.moe_dispatch import MoeDispatchGemm, MoeLayout  # noqa: E402
from mknumba.kernels.ring_attention import RingAttention  # noqa: E402
from mknumba.sched import split as sm_split  # noqa: E402

NVLINK_GBPS = 380.0                  # measured copy rate (docs/design.md §6), as bench_fused.py
OPS = {"rs": GemmReduceScatter, "ar": GemmAllReduce, "ag": AllGatherGemm, "ring": RingAttention,
       "moe": MoeDispatchGemm}
SWEEP = (1, 2, 4, 8, 16, 32, 64)
#: (m, k_local) pairs in none of the recorded table's rows
HELD_OUT = ((3072, 1536), (6144, 384), (12288, 3072), (8192, 128))
#: AllGather + GEMM (m, n, k): no recorded table
AG_SHAPES = ((4096, 8192, 4096), (8192, 8192, 8192), (16384, 4096, 2048), (8192, 28672, 4096))
#: Ring Attention (seq total, heads, kv_heads, causal); batch 1, head_dim 128
RING_SHAPES = ((8192, 32, 8, False), (8192, 32, 8, True), (32768, 32, 8, True),
               (32768, 32, 32, False))
#: MoE Dispatch + GEMM (hidden, ffn, experts, top_k, tokens over the ranks, routing): the
#: DeepSeek-V3-like and Mixtral-like layers of bench_moe_dispatch_gemm.py
MOE_SHAPES = ((7168, 2048, 256, 8, 8192, "uniform"), (7168, 2048, 256, 8, 8192, "zipf"),
              (4096, 14336, 8, 2, 16384, "uniform"), (4096, 14336, 8, 2, 16384, "zipf"))
#: --quick: tiny shapes, a short sweep
QUICK = dict(sweep=(1, 4), held_out=((512, 256),), ag=((512, 256, 256),),
             ring=((512, 4, 2, False), (512, 4, 2, True)),
             moe=((256, 256, 4, 2, 256, "uniform"), (256, 256, 4, 2, 256, "zipf")))


def iters_for(ms_est):
    return int(min(50, max(5, 150.0 / max(ms_est, 1e-3))))


def shapes(kernel, topology, held_out):
    """[(m, k, held_out)]: the table's rows for (kernel, topology), then ``held_out``."""
    rows = sorted({(m, k) for m, k, *_ in sm_split.RECORDED.get((kernel, topology), [])})
    return [(m, k, False) for m, k in rows] + [(m, k, True) for m, k in held_out
                                               if (m, k) not in rows]


def measure(comm, make, configs, out, run, check, ms_est, log, what):
    """Each ``(config, arg)`` of ``configs``: ``make(arg)`` (skipped where the op refuses
    it), checked once (``run(op)`` into ``out`` poisoned with NaN, then ``check()`` ->
    relative error, the slowest rank's), then timed over back-to-back calls. Returns
    [{config, op facts, ms, err}] (ops freed)."""
    measured = []
    for config, arg in configs:
        try:
            op = make(arg)
        except MkValueError as e:             # a split this topology cannot run
            log(f"  skip {config} {arg}: {e}")
            continue
        out.fill_(float("nan"))
        run(op)
        op.synchronize()
        err = check()
        ok = err == err and err <= 1e-2       # (NaN: an unwritten output)
        err = comm.mpi.allreduce(err if ok else 1.0, op=_max())
        ms = common.time_ms(lambda: run(op), iters_for(ms_est), mpi=comm.mpi)
        op.synchronize()
        measured.append(dict(op_facts(op), config=config, ms=ms, err=err))
        if err > 1e-2:
            log(f"  WRONG {what} {config} {measured[-1]['split']}: rel err {err}")
        op.free()
    return measured


def op_facts(op):
    """The split an op ran ("compute+comm" or "adaptive") and its static knobs."""
    if hasattr(op, "comm_sms"):                # the fused reductions: a planned split
        comm_sms, compute = op.comm_sms, op.sms - op.comm_sms
    else:              # AllGatherGemm, RingAttention, MoeDispatchGemm: role blocks
        rb = op.role_blocks
        comm_sms = sum(rb.get(r, 0) for r in ("send", "forward", "pack", "pull"))
        compute = rb["compute"]
    return dict(split="adaptive" if op.adaptive else f"{compute}+{comm_sms}",
                comm_sms=comm_sms, deliver=getattr(op, "deliver", None),
                fold=getattr(op, "fold", None))


def emit(records, log, kernel, shape, measured, topo, transport, floor, held, W, **extra):
    """One record per measured configuration, against the point's best static split."""
    static = [x for x in measured if x["config"] == "static" and x["err"] <= 1e-2]
    best = min(static, key=lambda x: x["ms"]) if static else None
    for x in measured:
        records.append(common.record(
            kernel, shape, dtype="bfloat16", world=W, topology=topo, transport=transport,
            ours_ms=x["ms"], baseline="best_static_split",
            baseline_ms=best["ms"] if best else None, floor_ms=floor, sm_split=x["split"],
            controller=x["config"] == "adaptive", held_out=held, config=x["config"],
            best_static=x is best, best_static_split=best["split"] if best else None,
            sms_reserved=None if x["config"] == "adaptive" else x["comm_sms"],
            comm_sms_start=x["comm_sms"], deliver=x["deliver"], fold=x["fold"],
            rel_err=x["err"], of_floor=floor / x["ms"] if floor else None, **extra))
        dims = " ".join(f"{k}={v}" for k, v in shape.items())
        log(f"{kernel:19s} {topo} {dims} {'held' if held else 'table'} "
            f"{x['config']:8s} {x['split']:>9s} {x['ms']:8.3f} ms"
            + (f"  x{x['ms'] / best['ms']:5.2f} of best ({best['split']})" if best else ""))


def allreduce_(t, comm, dist):
    """Sum ``t`` (a CUDA tensor) over the ranks: NCCL, or (``dist`` None: --quick, ranks that
    may share a GPU) MPI through the host."""
    if dist is not None:
        dist.all_reduce(t)
        return t
    import torch
    from mpi4py import MPI
    x = t.cpu().numpy()
    comm.mpi.Allreduce(MPI.IN_PLACE, x, op=MPI.SUM)
    return torch.from_numpy(x).to(t.device)


def allgather_(t, comm):
    """The ranks' ``t`` (CUDA tensors of one shape) concatenated along dim 0, through MPI on
    the host (a one-time reference; NCCL cannot serve ranks sharing a GPU)."""
    import torch
    x = t.contiguous().view(torch.int16).cpu().numpy() if t.dtype == torch.bfloat16 \
        else t.contiguous().cpu().numpy()
    out = comm.mpi.allgather(x)
    y = torch.from_numpy(__import__("numpy").concatenate(out)).to(t.device)
    return y.view(torch.bfloat16) if t.dtype == torch.bfloat16 else y


def configs(args):
    """The static splits of the sweep, the op's default ("table"), the controller."""
    return [("static", s) for s in args.sweep] + [("table", None), ("adaptive", "adaptive")]


def bench_point(comm, dist, args, Op, m, k, held, records, log):
    import torch
    topo = f"{comm.nodes}x{comm.local_size}"
    _, paced, transport = common.transport_of(comm, args)
    W, n = comm.size, m
    rows = m // W if Op is GemmReduceScatter else m
    torch.manual_seed(31 + comm.rank)
    a = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
    w = torch.randn(n, k, device="cuda", dtype=torch.bfloat16)
    b = w.T
    c = torch.empty(m, n, device="cuda", dtype=torch.bfloat16)
    t_gemm = common.time_ms(lambda: torch.matmul(a, b, out=c), 20, mpi=comm.mpi)
    G = comm.local_size
    link_bytes = (1 if Op is GemmReduceScatter else 2) * (G - 1) / G * m * n * 2
    net_bytes = (m * n * 2 / W if Op is GemmReduceScatter else m * n * 2 / G) * (comm.nodes - 1)
    t_net = net_bytes / ((args.pace_gbps if paced else NVLINK_GBPS) * 1e9) * 1e3
    floor = max(t_gemm, link_bytes / (NVLINK_GBPS * 1e9) * 1e3,
                t_net if comm.nodes > 1 else 0.0)
    ref = allreduce_(a.float() @ w.float().T, comm, dist)
    want = ref[comm.rank * rows:(comm.rank + 1) * rows] if rows < m else ref
    out = torch.empty((rows, n), device="cuda", dtype=torch.bfloat16)

    def run(op):
        op(a, b, out=out)

    def check():
        return ((out.float() - want).norm() / want.norm()).item()
    measured = measure(comm, lambda sms: Op(comm, m, n, k, comm_sms=sms), configs(args), out,
                       run, check, floor * 2, log,
                       f"{Op.kernel_name} {topo} m={m} k={k}")
    if args.save_trace:
        save_trace(Op(comm, m, n, k, comm_sms="adaptive", trace=True), run,
                   f"{args.save_trace}-{Op.kernel_name}-{topo}-{m}-{k}.json")
    emit(records, log, Op.kernel_name, {"m": m, "n": n, "k": k}, measured, topo, transport,
         floor, held, W, cublas_ms=t_gemm)
    torch.cuda.empty_cache()


def save_trace(op, run, path):
    """Three calls of a traced adaptive op; the last one's trace to ``path`` (rank 0)."""
    for _ in range(3):
        run(op)
    op.synchronize()
    op.save_trace(path)
    op.free()


def bench_ag(comm, dist, args, m, n, k, records, log):
    """AllGather + GEMM: this rank's [m / W, k] rows gathered, times b [k, n] (a w.T view)."""
    import torch
    topo = f"{comm.nodes}x{comm.local_size}"
    _, paced, transport = common.transport_of(comm, args)
    W, G = comm.size, comm.local_size
    torch.manual_seed(41 + comm.rank)
    a = torch.randn(m // W, k, device="cuda", dtype=torch.bfloat16)
    torch.manual_seed(43)                    # one b on every rank
    w = torch.randn(n, k, device="cuda", dtype=torch.bfloat16)
    b = w.T
    full = allgather_(a, comm)
    c = torch.empty(m, n, device="cuda", dtype=torch.bfloat16)
    t_gemm = common.time_ms(lambda: torch.matmul(full, b, out=c), 20, mpi=comm.mpi)
    shard_bytes = m // W * k * 2
    t_link = shard_bytes * (G - 1) / (NVLINK_GBPS * 1e9) * 1e3
    t_net = shard_bytes * G * (comm.nodes - 1) / ((args.pace_gbps if paced else NVLINK_GBPS)
                                                  * 1e9) * 1e3
    floor = max(t_gemm, t_link, t_net if comm.nodes > 1 else 0.0)
    want = full.float() @ w.float().T
    out = torch.empty((m, n), device="cuda", dtype=torch.bfloat16)

    def run(op):
        op(a, b, out=out)

    def check():
        return ((out.float() - want).norm() / want.norm()).item()
    measured = measure(comm, lambda sms: AllGatherGemm(comm, m, n, k, comm_sms=sms),
                       configs(args), out, run, check, floor * 2, log,
                       f"allgather_gemm {topo} m={m} n={n} k={k}")
    if args.save_trace:
        save_trace(AllGatherGemm(comm, m, n, k, comm_sms="adaptive", trace=True), run,
                   f"{args.save_trace}-allgather_gemm-{topo}-{m}-{n}-{k}.json")
    emit(records, log, "allgather_gemm", {"m": m, "n": n, "k": k}, measured, topo,
         transport, floor, True, W, cublas_ms=t_gemm)
    torch.cuda.empty_cache()


def bench_moe(comm, dist, args, shape, records, log):
    """MoE Dispatch + GEMM: this rank's tokens, routed ``routing`` (one draw per point, the
    same for every configuration), w [E / W, ffn, hidden] (w_layout "efh")."""
    import numpy as np
    import torch
    from bench_moe_dispatch_gemm import check as check_rows, routing
    H, F, E, K, total, kind = shape
    topo = f"{comm.nodes}x{comm.local_size}"
    _, paced, transport = common.transport_of(comm, args)
    W, me, El, T = comm.size, comm.rank, E // comm.size, total // comm.size
    gen = torch.Generator(device="cuda")
    gen.manual_seed(53 + me)
    x = torch.randn(T, H, device="cuda", dtype=torch.bfloat16, generator=gen)
    w = torch.randn(El, F, H, device="cuda", dtype=torch.bfloat16, generator=gen) / H ** 0.5
    idx, _ = routing(torch, T, E, K, kind, gen)
    x_all = allgather_(x, comm)
    every = np.concatenate(comm.mpi.allgather(idx.cpu().numpy()))
    R = int(((every >= me * El) & (every < (me + 1) * El)).sum())     # rows this rank gets
    # floor: one GEMM of the rows received, or the rows from the other GPUs over the link
    rows = torch.randn(max(R, 1), H, device="cuda", dtype=torch.bfloat16)
    t_mm = common.time_ms(lambda: rows @ w[0].T, 10, mpi=comm.mpi)
    rate = (args.pace_gbps if paced else NVLINK_GBPS) * 1e9
    floor = max(t_mm, R * H * 2 * (W - 1) / W / rate * 1e3)
    cap = W * T * K
    out = torch.empty((cap, F), device="cuda", dtype=torch.bfloat16)
    lay = MoeLayout(torch.empty(MoeLayout.words(El, cap), device="cuda", dtype=torch.int32),
                    El, cap)

    def run(op):
        op(x, idx, w, out=out, layout=lay)

    def check():
        return check_rows(torch, None, x_all, T, w, out, lay, me, El)
    measured = measure(comm, lambda sms: MoeDispatchGemm(comm, H, F, E, K, T, w_layout="efh",
                                                         comm_sms=sms),
                       configs(args), out, run, check, max(floor, 0.05) * 2, log,
                       f"moe_dispatch_gemm {topo} H={H} F={F} E={E} K={K} tokens={total} "
                       f"{kind}")
    emit(records, log, "moe_dispatch_gemm", {"hidden": H, "ffn": F, "experts": E,
                                             "top_k": K, "tokens": total}, measured, topo,
         transport, floor, True, W, routing=kind, rows_received=R, gemm_ms=t_mm)
    torch.cuda.empty_cache()


def ring_reference(comm, q, k, v, layout, causal):
    """fp32 attention of this rank's q over every rank's k and v (gathered through MPI), the
    causal mask from the layout's global positions: (out [b, s, h, d], lse [b, h, s])."""
    import torch
    from mknumba.sched.sequence import positions
    W, s = comm.size, q.shape[1]
    ks, vs = (allgather_(x.transpose(0, 1), comm).transpose(0, 1) for x in (k, v))
    group = q.shape[2] // k.shape[2]
    qf = q.float().transpose(1, 2)                                   # [b, h, s, d]
    kf, vf = (x.float().transpose(1, 2).repeat_interleave(group, 1) for x in (ks, vs))
    sc = torch.matmul(qf, kf.transpose(-1, -2)) / q.shape[-1] ** 0.5
    if causal:
        pq = torch.as_tensor(positions(comm.rank, s, W, layout), device=q.device)
        pk = torch.as_tensor(__import__("numpy").concatenate(
            [positions(r, s, W, layout) for r in range(W)]), device=q.device)
        sc.masked_fill_(pk[None, :] > pq[:, None], float("-inf"))
    lse = torch.logsumexp(sc, -1)
    return torch.matmul(torch.exp(sc - lse.unsqueeze(-1)), vf).transpose(1, 2), lse


def bench_ring(comm, dist, args, seq, heads, kv_heads, causal, records, log):
    """Ring Attention: this rank's seq / W rows (zigzag when causal), batch 1, head_dim 128;
    the static splits are send_blocks (the blocks that push this rank's slice)."""
    import torch
    topo = f"{comm.nodes}x{comm.local_size}"
    _, paced, transport = common.transport_of(comm, args)
    W, d, s = comm.size, 128, seq // comm.size
    layout = "zigzag" if causal else "contiguous"
    torch.manual_seed(47 + comm.rank)
    q = torch.randn(1, s, heads, d, device="cuda", dtype=torch.bfloat16)
    k, v = (torch.randn(1, s, kv_heads, d, device="cuda", dtype=torch.bfloat16)
            for _ in range(2))
    out = torch.empty_like(q)
    lse = torch.empty(1, heads, s, device="cuda")
    slice_bytes = 2 * s * kv_heads * d * 2
    rate = (args.pace_gbps if paced else NVLINK_GBPS) * 1e9
    floor = slice_bytes * (W - 1) / rate * 1e3

    def make(send):
        kw = dict(comm_sms="adaptive") if send == "adaptive" else dict(send_blocks=send)
        return RingAttention(comm, 1, s, heads, kv_heads, d, causal=causal, layout=layout, **kw)

    def run(op):
        op(q, k, v, out=out, lse=lse)
    base = make(None)                        # the default static split, checked once
    out.fill_(float("nan"))
    run(base)
    base.synchronize()
    want = out.float().clone()
    if s * seq * heads * 4 <= 2 ** 32:       # the fp32 reference's scores fit (4 GiB)
        ro, rl = ring_reference(comm, q, k, v, layout, causal)
        err = ((want - ro).norm() / ro.norm()).item()
        assert err <= 1e-2 and (lse - rl).abs().max().item() <= 1e-2, (err, "default split")
        del ro, rl
    base.free()

    def check():
        return ((out.float() - want).norm() / want.norm()).item()
    measured = measure(comm, make, configs(args), out, run, check, max(floor, 0.05) * 4, log,
                       f"ring_attention {topo} seq={seq} h={heads}/{kv_heads} causal={causal}")
    if args.save_trace:
        op = RingAttention(comm, 1, s, heads, kv_heads, d, causal=causal, layout=layout,
                           comm_sms="adaptive", trace=True)
        save_trace(op, run, f"{args.save_trace}-ring_attention-{topo}-{seq}-{heads}-"
                            f"{kv_heads}-{int(causal)}.json")
    emit(records, log, "ring_attention", {"batch": 1, "seq": seq, "heads": heads,
                                          "kv_heads": kv_heads, "head_dim": d}, measured, topo,
         transport, floor, True, W, causal=causal, layout=layout)
    torch.cuda.empty_cache()


def summary(records, log):
    """Per kernel and topology: the controller against the best static split and the table."""
    groups = {}
    for r in records:
        groups.setdefault((r["kernel"], r["topology"]), []).append(r)
    for (kern, topo), recs in sorted(groups.items()):
        ctl = [r for r in recs if r["controller"] and r["baseline_ms"]]
        if not ctl:
            continue
        ratios = [r["ours_ms"] / r["baseline_ms"] for r in ctl]
        gm = math.exp(sum(map(math.log, ratios)) / len(ratios))
        def point(r):                          # the shape and its knobs, any kernel's
            return tuple(sorted(r["shape"].items())) + (r.get("causal"), r.get("layout"),
                                                        r.get("routing"))
        held = {point(r): r["ours_ms"] for r in ctl if r["held_out"]}
        table = {point(r): r["ours_ms"] for r in recs if r["config"] == "table" and r["held_out"]}
        better = sum(held[s] < table[s] for s in held if s in table)
        log(f"{kern} {topo}: controller / best static: geomean {gm:.3f}, worst "
            f"{max(ratios):.3f} over {len(ratios)} points; held out: faster than the table at "
            f"{better} of {len(held)}")


def _max():
    from mpi4py import MPI
    return MPI.MAX


def main():
    args = common.parse_args(ranks=2, extra=[
        (("--topologies",), dict(default="1x2,2x1")),
        (("--kernels",), dict(default="rs,ar,ag,ring,moe",
                              help="rs, ar, ag, ring, moe (comma-separated)")),
        *common.NETWORK_ARGS,
        (("--sweep",), dict(default=",".join(map(str, SWEEP)),
                            help="static comm SMs to time at every point")),
        (("--held-out",), dict(default=",".join(f"{m}:{k}" for m, k in HELD_OUT),
                               help="m:k_local shapes not in the table ('' for none)")),
        (("--table-shapes",), dict(default="1", choices=("0", "1"),
                                   help="also the table's own shapes")),
        (("--save-trace",), dict(default=None, metavar="PREFIX",
                                 help="write one traced controller call per point")),
        (("--quick",), dict(action="store_true",
                            help="a smoke run: tiny shapes, 1x2, no NCCL (ranks may share "
                                 "a GPU)"))])
    args.sweep = [int(s) for s in args.sweep.split(",") if s]
    held_out = [tuple(int(x) for x in s.split(":")) for s in args.held_out.split(",") if s]
    ag_shapes, ring_shapes, moe_shapes = AG_SHAPES, RING_SHAPES, MOE_SHAPES
    if args.quick:
        args.sweep, held_out = list(QUICK["sweep"]), list(QUICK["held_out"])
        args.table_shapes, args.topologies = "0", "1x2"
        ag_shapes, ring_shapes, moe_shapes = QUICK["ag"], QUICK["ring"], QUICK["moe"]
    kernels = args.kernels.split(",")
    unknown = [x for x in kernels if x not in OPS]
    if unknown:
        raise SystemExit(f"--kernels: unknown {unknown} (rs, ar, ag, ring, moe)")

    kept = []                  # the list run_topologies fills and writes after each topology

    def bench_topology(comm, dist, args, records, log):
        kept[:] = [records]
        topo = f"{comm.nodes}x{comm.local_size}"
        for name in kernels:
            if name == "ag":
                for m, n, k in ag_shapes:
                    bench_ag(comm, dist, args, m, n, k, records, log)
                continue
            if name == "ring":
                for seq, heads, kv_heads, causal in ring_shapes:
                    bench_ring(comm, dist, args, seq, heads, kv_heads, causal, records, log)
                continue
            if name == "moe":
                for shape in moe_shapes:
                    bench_moe(comm, dist, args, shape, records, log)
                continue
            Op = OPS[name]
            for m, k, held in shapes(Op.kernel_name, topo, held_out):
                if held or args.table_shapes == "1":
                    bench_point(comm, dist, args, Op, m, k, held, records, log)
    common.run_topologies(args, bench_topology, args.topologies.split(","), 29547,
                          nccl=not args.quick)
    from mpi4py import MPI
    if MPI.COMM_WORLD.Get_rank() == 0 and kept:
        summary(kept[0], print)


if __name__ == "__main__":
    main()
