"""Ring Attention on two GPUs: ``mknumba.RingAttention`` beside the unfused ring users write
today and an all-gather of K and V, in one run.

    mpirun --bind-to none -n 2 python benchmarks/bench_ring_attention.py \\
        --out benchmarks/results/ring_attention.json [--topologies 1x2,2x1]

Two ranks, one GPU each (never a shared GPU: timings there mean nothing). Topologies as in
bench_fused.py: ``1x2`` (one node, NVLink) and ``2x1`` (two emulated nodes: the dma transport
through the host proxy, paced to ``--pace-gbps`` per GPU). Each rank holds seq_local = seq / W
rows: q [batch, seq_local, heads, d], k/v [batch, seq_local, kv_heads, d], bf16, random per rank
(the global sequence is the ranks' rows in layout order). Causal points use the zigzag layout,
the others contiguous. Shapes: batch 1, heads 32, kv_heads 8 (GQA) and 32, head_dim 128,
seq (total) in {8K, 32K, 128K}, causal and not.

Ours: one ``RingAttention`` call (one persistent launch). Baselines, same process and inputs:

- ``sdpa_nccl_ring``: the unfused ring (ring-flash-attention's schedule). Per step one fused
  SDPA that returns the LSE; partial outputs merged by LSE in fp32, rounded to bf16 once at
  the end; the KV slice passed on with ``torch.distributed.batch_isend_irecv``, which NCCL runs
  on its own stream while the step's attention runs on the current one. Causal (zigzag) steps:
  step 0 causal on the diagonal; a slice from a lower rank: all of Q against the first half of
  its KV; from a higher rank: the second half of Q against all of its KV (docs/design.md §9).
- ``allgather_kv_sdpa``: NCCL all_gather of K and of V, then SDPA over the whole KV. Causal:
  the gathered KV put in sequence order (a copy), each of our two chunks attends causally to
  its own chunk and fully to the chunks before it, the two parts merged by LSE.

The SDPA entry point (``sdpa_impl``) is the first that returns the LSE and matches an fp32
reference on this build: ``aten._scaled_dot_product_cudnn_attention`` (compute_log_sumexp),
then ``aten._scaled_dot_product_flash_attention``; on the transposed views or contiguous copies,
grouped KV native or repeated per call; a plain matmul-softmax ("math", small shapes only) if
none does.

In 2x1 NCCL still runs over NVLink (it cannot be paced). With a pace the baselines are modelled
(``modelled: true``; the measured time kept in ``baseline_measured_ms``): the ring adds, per
step, the time one slice takes at the pace beyond what the measured step hid it under (max of
the step's attention and the measured NCCL exchange); the all-gather adds the network time of
(nodes - 1) slices beyond the measured all_gather. With more GPUs per node the model is
optimistic for the baselines.

Floor: max(T_attention, T_bytes). T_attention: one SDPA over this rank's share of the whole
attention (seq_local queries against seq keys; causal: against seq / 2 keys, unmasked, the same
FLOPs), measured in the run. T_bytes: the KV this rank must receive over its slowest link:
(W - 1) slices at the rate of a measured NCCL send/recv of one slice (1x2, or 2x1 unpaced), the
network's (nodes - 1) slices at the pace (2x1). The slowest rank counts everywhere.
Correctness: each baseline's out against ours once per point ("rel_err", relative Frobenius;
against the other baseline where ours was left out). Ours is left out where the previous seq
of the same (topology, kv_heads, mask) scaled by FLOPs predicts a call over ``--max-call-s``.
Records: kernel "ring_attention", one per baseline and point; "tflops" and "baseline_tflops"
per GPU (this rank's share of the FLOPs), "tile" the compute tile ours ran (sm90 or simt).
"""
import math
import os
import sys

import common
import report
from bench_attention import ERR_MAX, attention_flops, measure, reason, rel_err

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

BASELINES = ("sdpa_nccl_ring", "allgather_kv_sdpa")


# ---- attention with its LSE, as PyTorch offers it

def math_attention(q, k, v, causal):
    """Plain matmul-softmax with fp32 scores: the reference, and the last fallback. q [b, h,
    sq, d], k/v [b, kv_heads, sk, d]; causal only for sq == sk. Memory grows as sq * sk."""
    import torch
    group = q.shape[1] // k.shape[1]
    k, v = (x.repeat_interleave(group, 1) for x in (k, v))
    s = torch.matmul(q.float(), k.float().transpose(-1, -2)) / math.sqrt(q.shape[-1])
    if causal:
        s.masked_fill_(torch.ones(s.shape[-2:], dtype=torch.bool, device=s.device).triu(1),
                       -math.inf)
    lse = torch.logsumexp(s, -1)
    out = torch.matmul(torch.exp(s - lse.unsqueeze(-1)), v.float())
    return out.to(q.dtype), lse


def lse_candidates(group):
    """``(name, fn)`` pairs, best first; fn(q, k, v, causal) -> (out bf16 [b, h, sq, d], lse
    fp32 [b, h, sq]) with q [b, h, sq, d] and k/v [b, kv_heads, sk, d] (views allowed)."""
    import torch
    aten = torch.ops.aten

    def cudnn(q, k, v, causal):
        r = aten._scaled_dot_product_cudnn_attention(q, k, v, None, True, 0.0, causal, False)
        return r[0], r[1].reshape(q.shape[:3])            # some builds give [b, h, sq, 1]

    def flash(q, k, v, causal):
        r = aten._scaled_dot_product_flash_attention(q, k, v, 0.0, causal)
        return r[0], r[1]

    def contiguous(fn):
        return lambda q, k, v, c: fn(q.contiguous(), k.contiguous(), v.contiguous(), c)

    def expand(fn):       # grouped KV repeated to every head, inside the timed call
        return lambda q, k, v, c: fn(q, k.repeat_interleave(group, 1),
                                     v.repeat_interleave(group, 1), c)
    out = []
    for name, fn in (("cudnn", cudnn), ("flash", flash)):
        for prep in ("", "+contiguous"):
            f = contiguous(fn) if prep else fn
            out.append((name + prep, f))
            if group > 1:
                out.append((name + prep + "+expand_kv", expand(f)))
    out.append(("math", math_attention))
    return out


def pick_lse_attention(batch, heads, kv_heads, d, mpi, log):
    """The first candidate that runs and matches the fp32 reference on every rank, tried on
    the calls the ring makes (causal square; half of Q; half of KV) at a small length, on
    [b, h, s, d] views of [b, s, h, d] tensors as the benchmark passes them."""
    import torch
    from mpi4py import MPI
    torch.manual_seed(5)
    n = 256

    def views(h):
        return torch.randn(batch, n, h, d, device="cuda", dtype=torch.bfloat16).transpose(1, 2)
    q, k, v = views(heads), views(kv_heads), views(kv_heads)
    cases = [(q, k, v, True), (q[:, :, n // 2:], k, v, False),
             (q, k[:, :, :n // 2], v[:, :, :n // 2], False)]
    refs = [math_attention(*c) for c in cases]
    for name, fn in lse_candidates(heads // kv_heads):      # "math" always passes
        try:
            ok = True
            for case, (ref_out, ref_lse) in zip(cases, refs):
                out, lse = fn(*case)
                ok = ok and rel_err(out, ref_out) <= ERR_MAX and \
                    (lse.float() - ref_lse).abs().max().item() <= 1e-2
            why = "" if ok else "does not match the fp32 reference"
        except Exception as e:       # noqa: BLE001 (not on this build: the next candidate)
            why = reason(e)
        if mpi.allreduce(0 if why else 1, op=MPI.MIN):     # the ranks go in step
            break
        log(f"  sdpa candidate {name} ({heads}/{kv_heads} heads, d={d}): "
            f"{why or 'fails on another rank'}")
    if name == "math":
        log("  WARNING: no fused SDPA returns the LSE here; the baselines use matmul-softmax")
    else:
        log(f"  sdpa entry point for {heads}/{kv_heads} heads, d={d}: {name}")
    return name, fn


def merge(out, lse, blk_out, blk_lse):
    """Fold one partial result (blk_out, blk_lse) into the fp32 running ``out`` [b, h, s, d]
    and ``lse`` [b, h, s], in place (views of rows allowed)."""
    import torch
    new = torch.logaddexp(lse, blk_lse)
    out.mul_((lse - new).exp_().unsqueeze(-1))
    out.add_(blk_out.float().mul_((blk_lse - new).exp_().unsqueeze(-1)))
    lse.copy_(new)


# ---- the two baselines

class NcclRing:
    """The unfused ring: ``self()`` -> out [b, s, h, d] bf16. ``talk=False``: the same calls on
    this rank's own slice at every step and no NCCL (a dry run: does every SDPA call run?)."""

    def __init__(self, dist, attn, q, kv, me, world, causal):
        import torch
        self.dist, self.attn, self.q, self.kv = dist, attn, q, kv     # kv [2, b, s, kvh, d]
        self.me, self.world, self.causal = me, world, causal
        # two receive buffers, taken in turn: a slice is never overwritten while it is sent on
        self.bufs = [torch.empty_like(kv) for _ in range(min(2, world - 1))]

    def __call__(self, talk=True):
        import torch
        dist, W, me = self.dist, self.world, self.me
        b, s, h, d = self.q.shape
        half = s // 2
        q = self.q.transpose(1, 2)                                    # [b, h, s, d] views
        out = torch.empty(b, s, h, d, device=q.device, dtype=torch.float32).transpose(1, 2)
        lse = torch.empty(b, h, s, device=q.device, dtype=torch.float32)
        cur = self.kv
        for i in range(W):
            src = (me - i) % W
            talking = talk and i < W - 1
            if talking:       # pass the slice on (NCCL's stream) while attending to it
                nxt = self.bufs[i % 2]
                reqs = dist.batch_isend_irecv([dist.P2POp(dist.isend, cur, (me + 1) % W),
                                               dist.P2POp(dist.irecv, nxt, (me - 1) % W)])
            k, v = cur[0].transpose(1, 2), cur[1].transpose(1, 2)
            if i == 0:        # our own slice: causal on the diagonal
                blk_out, blk_lse = self.attn(q, k, v, self.causal)
                out.copy_(blk_out)
                lse.copy_(blk_lse)
            elif not self.causal:
                merge(out, lse, *self.attn(q, k, v, False))
            elif src < me:    # its first chunk precedes both of ours, its second follows them
                merge(out, lse, *self.attn(q, k[:, :, :half], v[:, :, :half], False))
            else:             # both of its chunks lie between our two: our second half sees them
                merge(out[:, :, half:], lse[:, :, half:],
                      *self.attn(q[:, :, half:], k, v, False))
            if talking:
                for r in reqs:
                    r.wait()  # the current stream waits for the slice; the host does not
                cur = nxt
        return out.to(torch.bfloat16).transpose(1, 2)


class AllGatherKV:
    """All-gather K and V, then attend to the whole sequence: ``self()`` -> out [b, s, h, d].
    ``talk=False``: no NCCL (the gathered buffers as they are; a dry run)."""

    def __init__(self, dist, attn, q, k, v, me, world, causal):
        import torch
        self.dist, self.attn, self.q, self.k, self.v = dist, attn, q, k, v
        self.me, self.world, self.causal = me, world, causal
        self.k_all, self.v_all = (torch.empty((world,) + tuple(x.shape), device=x.device,
                                              dtype=x.dtype) for x in (k, v))

    def __call__(self, talk=True):
        import torch
        W, me = self.world, self.me
        if talk:
            self.dist.all_gather_into_tensor(self.k_all, self.k)
            self.dist.all_gather_into_tensor(self.v_all, self.v)
        b, s, h, d = self.q.shape
        half = s // 2
        q = self.q.transpose(1, 2)
        if not self.causal:   # contiguous layout: rank order is sequence order (b = 1: views)
            k, v = (x.transpose(0, 1).reshape(b, W * s, *x.shape[-2:]).transpose(1, 2)
                    for x in (self.k_all, self.v_all))
            return self.attn(q, k, v, False)[0].transpose(1, 2)

        def in_order(x):      # zigzag: chunk j of the sequence is rank j's first half (j < W)
            return torch.cat([x[j, :, :half] if j < W else x[2 * W - 1 - j, :, half:]
                              for j in range(2 * W)], dim=1).transpose(1, 2)
        k, v = in_order(self.k_all), in_order(self.v_all)              # [b, kvh, seq, d]
        out = torch.empty(b, s, h, d, device=q.device, dtype=torch.float32).transpose(1, 2)
        lse = torch.empty(b, h, s, device=q.device, dtype=torch.float32)
        for part, c in enumerate((me, 2 * W - 1 - me)):   # our chunks' places in the sequence
            rows, keys = slice(part * half, (part + 1) * half), slice(c * half, (c + 1) * half)
            blk_out, blk_lse = self.attn(q[:, :, rows], k[:, :, keys], v[:, :, keys], True)
            out[:, :, rows].copy_(blk_out)
            lse[:, :, rows].copy_(blk_lse)
            if c:             # every key before our chunk, unmasked
                merge(out[:, :, rows], lse[:, :, rows],
                      *self.attn(q[:, :, rows], k[:, :, :c * half], v[:, :, :c * half], False))
        return out.to(torch.bfloat16).transpose(1, 2)


def runs_here(fn, mpi):
    """Does ``fn()`` run on every rank? (agreed before any collective call of it, so that no
    rank is left waiting in NCCL). Returns (ok, this rank's reason or "")."""
    import torch
    from mpi4py import MPI
    try:
        fn()
        torch.cuda.synchronize()
        why = ""
    except Exception as e:           # noqa: BLE001 (reported; the baseline is left out)
        why = reason(e)
    return mpi.allreduce(0 if why else 1, op=MPI.MIN) == 1, why


def agreed_err(got, want, mpi):
    """rel_err, worst over the ranks (inf for a non-finite result)."""
    e = rel_err(got, want)
    return mpi.allreduce(e if math.isfinite(e) else math.inf, op=common._max())


# ---- one point

def bench_point(mk, comm, dist, args, S, kv_heads, causal, impls, last, records, log):
    import torch
    from mpi4py import MPI
    W, me, mpi = comm.size, comm.rank, comm.mpi
    b, h, d = args.batch, args.heads, args.head_dim
    s = S // W
    layout = "zigzag" if causal else "contiguous"
    topo = f"{comm.nodes}x{comm.local_size}"
    paced = comm.nodes > 1 and args.pace_gbps > 0
    transport = "nvlink" if comm.nodes == 1 else (
        f"dma:{args.mode}@{args.pace_gbps:g}GB/s" if paced else f"dma:{args.mode}")
    tag = f"{topo} seq={S:6d} kv_heads={kv_heads:2d} causal={int(causal)}"
    if (h, kv_heads) not in impls:
        impls[(h, kv_heads)] = pick_lse_attention(b, h, kv_heads, d, mpi, log)
    impl, attn = impls[(h, kv_heads)]

    torch.manual_seed(1234 + me)
    q = torch.randn(b, s, h, d, device="cuda", dtype=torch.bfloat16)
    k, v = (torch.randn(b, s, kv_heads, d, device="cuda", dtype=torch.bfloat16)
            for _ in range(2))
    kv = torch.stack([k, v])                 # the ring's slice: K and V in one message
    flops = attention_flops(b, h, s, S, d, causal)        # this rank's share
    budget = args.budget_s

    # ours (every decision below rests on values agreed across the ranks)
    ours_ms, ours_out, note, tile = None, None, None, None
    prev = last.get((topo, kv_heads, causal))
    predicted = prev[1] * flops / prev[0] if prev else 0.0
    if predicted > args.max_call_s * 1e3:
        note = f"ours left out: about {predicted / 1e3:.1f} s a call predicted"
    else:
        op = None
        try:
            op = mk.RingAttention(comm, b, s, h, kv_heads, d, causal=causal, layout=layout)
            tile = getattr(op, "tile", None)     # the compute tile it chose (sm90, simt)
            ours_out = op(q, k, v)[0]        # the first call compiles
            op.synchronize()
            ours_ms = measure(lambda: op(q, k, v), budget, mpi=mpi, called=True)
            op.synchronize()
        except Exception as e:               # noqa: BLE001 (recorded; the baselines still run)
            note = f"ours failed: {reason(e)}"
        if mpi.allreduce(0 if note else 1, op=MPI.MIN):
            op.free()                        # collective: only where every rank got here
            last[(topo, kv_heads, causal)] = (flops, ours_ms)
        else:                                # every rank leaves ours out alike
            ours_ms, ours_out, note = None, None, note or "ours failed on another rank"
    if note:
        log(f"{tag}  {note}")

    # the baselines: a dry run on every rank first, then correctness and time
    ring = NcclRing(dist, attn, q, kv, me, W, causal)
    gather = AllGatherKV(dist, attn, q, k, v, me, W, causal)
    measured, outs = {}, {}
    for name, fn in zip(BASELINES, (ring, gather)):
        ok, why = runs_here(lambda: fn(talk=False), mpi)
        if not ok:
            log(f"{tag}  {name} left out: {why or 'fails on another rank'}")
            continue
        outs[name] = fn()
        measured[name] = measure(fn, budget, mpi=mpi, called=True)

    # what the floor and the 2x1 model need, measured in the same run
    half = s // 2
    qt, kt, vt = (x.transpose(1, 2) for x in (q, k, v))
    step_ms = {}
    if causal:
        step_ms["diag"] = measure(lambda: attn(qt, kt, vt, True), budget, mpi=mpi)
        step_ms["half"] = measure(lambda: attn(qt, kt[:, :, :half], vt[:, :, :half], False),
                                  budget, mpi=mpi)
    else:
        step_ms["full"] = measure(lambda: attn(qt, kt, vt, False), budget, mpi=mpi)
    keys = S // 2 if causal else S           # this rank's share as one unmasked SDPA
    k_share, v_share = (torch.randn(b, kv_heads, keys, d, device="cuda", dtype=torch.bfloat16)
                        for _ in range(2))
    t_attn = measure(lambda: attn(qt, k_share, v_share, False), budget, mpi=mpi)
    buf = torch.empty_like(kv)

    def exchange():           # one slice each way, as a ring step moves it
        for r in dist.batch_isend_irecv([dist.P2POp(dist.isend, kv, (me + 1) % W),
                                         dist.P2POp(dist.irecv, buf, (me - 1) % W)]):
            r.wait()
    t_exch = measure(exchange, budget, mpi=mpi)
    t_gather = measure(lambda: (dist.all_gather_into_tensor(gather.k_all, k),
                                dist.all_gather_into_tensor(gather.v_all, v)), budget, mpi=mpi)
    kv_bytes = kv.numel() * kv.element_size()
    t_slice_net = kv_bytes / (args.pace_gbps * 1e9) * 1e3 if paced else 0.0
    if paced:
        t_bytes = max((comm.local_size - 1) * t_exch, (comm.nodes - 1) * t_slice_net)
    else:
        t_bytes = (W - 1) * t_exch
    floor = max(t_attn, t_bytes)

    def modelled(name):
        """The baseline's time with the network at the pace (2x1), else as measured."""
        t = measured[name]
        if not paced:
            return t
        if name == "sdpa_nccl_ring":
            first = step_ms["diag" if causal else "full"]
            rest = step_ms["half" if causal else "full"]
            return t + sum(max(0.0, t_slice_net - max(first if i == 0 else rest, t_exch))
                           for i in range(W - 1))
        return t + max(0.0, (comm.nodes - 1) * t_slice_net - t_gather)

    for name in measured:
        if ours_out is not None:
            err, against = agreed_err(outs[name], ours_out, mpi), "ours"
        else:                 # both baselines ran the same attention: check one by the other
            other = [n for n in outs if n != name]
            against = other[0] if other else None
            err = agreed_err(outs[name], outs[against], mpi) if against else None
        if err is not None and err > ERR_MAX:
            log(f"{tag}  WRONG? {name} against {against}: rel err {err:.2e} > {ERR_MAX}")
        base_ms = modelled(name)
        records.append(common.record(
            "ring_attention", dict(batch=b, seq=S, heads=h, kv_heads=kv_heads, head_dim=d,
                                   causal=causal, layout=layout),
            dtype="bf16", world=W, topology=topo, transport=transport, ours_ms=ours_ms,
            baseline=name, baseline_ms=base_ms, floor_ms=floor,
            tflops=flops / ours_ms / 1e9 if ours_ms else None,    # per GPU
            baseline_tflops=flops / base_ms / 1e9, of_floor=floor / ours_ms if ours_ms else None,
            rel_err=err, rel_err_against=against, seq_local=s, sdpa_impl=impl,
            modelled=paced, baseline_measured_ms=measured[name], attention_ms=t_attn,
            bytes_ms=t_bytes, exchange_ms=t_exch, exchange_gbps=kv_bytes / t_exch / 1e6,
            allgather_ms=t_gather, network_ms=t_slice_net * (comm.nodes - 1) if paced else None,
            step_ms=step_ms, kv_slice_bytes=kv_bytes, flops=flops, tile=tile,
            **({"note": note} if note else {})))
        ours_txt = f"ours {ours_ms:9.3f} ms" if ours_ms else "ours         -"
        log(f"{tag}  {ours_txt}  {name:17s} {base_ms:9.3f} ms"
            f"{' (modelled)' if paced else ''}  floor {floor:8.3f} (attn {t_attn:.3f}, bytes "
            f"{t_bytes:.3f})  err {'-' if err is None else f'{err:.1e}'} vs {against}")
    if comm.rank == 0:
        common.write(records, args.out)       # keep every point, even if the run is cut short


def main():
    args = common.parse_args(ranks=2, extra=[
        (("--topologies", "--topology"), dict(default="1x2,2x1")),
        *common.NETWORK_ARGS,
        (("--seqs",), dict(default="8192,32768,131072", help="total sequence lengths")),
        (("--kv-heads",), dict(default="8,32")),
        (("--heads",), dict(type=int, default=32)),
        (("--head-dim",), dict(type=int, default=128)),
        (("--batch",), dict(type=int, default=1)),
        (("--causal",), dict(default="both", choices=("0", "1", "both"))),
        (("--budget-s",), dict(type=float, default=0.3,
                               help="about this much timed work per measurement")),
        (("--max-call-s",), dict(type=float, default=3.0,
                                 help="leave ours out where a call is predicted longer"))])
    seqs = sorted(int(x) for x in args.seqs.split(","))
    kv_heads = [int(x) for x in args.kv_heads.split(",")]
    causals = {"0": [False], "1": [True], "both": [False, True]}[args.causal]
    from mpi4py import MPI
    if MPI.COMM_WORLD.Get_size() < 2:
        raise SystemExit("bench_ring_attention: run it on 2 ranks (mpirun -n 2)")
    rank = MPI.COMM_WORLD.Get_rank()
    dist = common.init_nccl(29543)
    import torch

    import mknumba as mk
    records = []
    impls = {}                # the SDPA entry point per (heads, kv_heads)

    def log(msg):
        if rank == 0:
            print(msg, flush=True)
    for topo in args.topologies.split(","):
        comm, _ = common.init_topology(topo, args)
        last = {}             # ours' latest (flops, ms) per (topology, kv_heads, mask)
        try:
            for kvh in kv_heads:
                for causal in causals:
                    for S in seqs:   # ascending: each point predicts the next one's time
                        bench_point(mk, comm, dist, args, S, kvh, causal, impls, last,
                                    records, log)
                        torch.cuda.empty_cache()     # the point's tensors are gone
        finally:
            comm.finalize()
        if rank == 0:
            common.write(records, args.out)
    dist.destroy_process_group()
    if rank == 0:
        report.render(records)


if __name__ == "__main__":
    main()
