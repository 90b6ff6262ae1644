"""One-GPU attention: ``mknumba.attention`` beside PyTorch SDPA (cuDNN and flash backends).

    python benchmarks/bench_attention.py --out benchmarks/results/attention.json [--quick]

What is timed: one forward call, bf16 in and out. Ours takes q [batch, seq, heads, d] and
k/v [batch, seq, kv_heads, d] and also writes the fp32 LSE [batch, heads, seq]. SDPA takes
[batch, heads, seq, d]: it gets the views ``q.transpose(1, 2)`` (no copy) and, beside them,
contiguous [b, h, s, d] copies made before timing; the faster layout of those the backend
accepts and computes right counts ("baseline_layout", both times in "layout_ms").

Points: head_dim in {64, 128}, causal and not, seq in {1K, ..., 32K}; batch * seq = 16K tokens
(batch 1 from seq 16K on) and heads * head_dim = 2048, kv_heads = heads: the FlashAttention
benchmark shapes, where every point is large enough to fill the GPU. ``--quick``: seq 4K and
16K, d = 128, both masks. FLOPs: 4 * batch * heads * seq^2 * d, halved for causal.

Each measurement: one untimed call (compile, plan), one timed trial call that sizes the run
to about ``--budget-s`` of back-to-back calls (``common.time_ms``). Ours is left out at a
point where the previous point of the same (d, mask) scaled by FLOPs predicts a call longer
than ``--max-call-s`` (the SIMT compute role is slow); its records keep ``ours_ms: null``.
Correctness: ours against each backend's output once per point, the relative Frobenius error
of out ("rel_err"; above 2e-2 is reported, not fatal). Floor: the FLOPs at 989 TFLOP/s.
One record per backend and point (docs/design.md §8, kernel "attention"); "tile" names the compute
tile ours ran (sm90 or simt), where the op says.
"""
import os
import sys

import common
import report

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

#: H200 (as H100 SXM) dense bf16 tensor-core peak: the floor's rate. Measured GEMMs reach ~800.
PEAK_TFLOPS = 989.0
TOKENS = 16384          # batch * seq while seq <= TOKENS
HEAD_WIDTH = 2048       # heads * head_dim
ERR_MAX = 2e-2
BACKENDS = (("sdpa_cudnn", "CUDNN_ATTENTION"), ("sdpa_flash", "FLASH_ATTENTION"))


def attention_flops(batch, heads, seq_q, seq_k, d, causal):
    """Two GEMMs of 2 * seq_q * seq_k * d per head; a causal mask halves the work."""
    flops = 4 * batch * heads * seq_q * seq_k * d
    return flops / 2 if causal else flops


def rel_err(got, want):
    """Relative Frobenius error of ``got`` against ``want`` (any float dtypes, same shape)."""
    got, want = got.float(), want.float()
    return ((got - want).norm() / want.norm()).item()


def reason(e, width=160):
    """An exception in one short line (PyTorch's dispatcher messages run to kilobytes)."""
    text = (str(e).splitlines() or [""])[0]
    text = text if len(text) <= width else text[:width - 3] + "..."
    return f"{type(e).__name__}: {text}" if text else type(e).__name__


def ours_tile(q, kv_heads, causal):
    """The compute tile (e.g. "sm90", "simt") ``mknumba.attention`` runs for these inputs."""
    import mknumba
    return mknumba.attention.op(tuple(q.shape), kv_heads, causal).tile


def measure(fn, budget_s, mpi=None, called=False, max_iters=200):
    """ms per call of ``fn`` (the slowest rank with ``mpi``). Unless ``called``, one untimed
    call first (compile, plan, lazy init); then one timed trial call sizes the run to about
    ``budget_s`` of back-to-back calls. A call as long as the budget is timed once: the
    trial is the measurement."""
    import torch
    if not called:
        fn()
    torch.cuda.synchronize()
    if mpi is not None:
        mpi.Barrier()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    fn()
    end.record()
    torch.cuda.synchronize()
    trial = start.elapsed_time(end)
    if mpi is not None:           # every rank sizes the run alike (collective calls)
        trial = mpi.allreduce(trial, op=common._max())
    iters = int(min(max_iters, budget_s * 1e3 / max(trial, 1e-3)))
    if iters < 2:
        return trial
    return common.time_ms(fn, iters, warmup=1 if trial > 20 else 3, mpi=mpi)


def sdpa_baseline(backend, q, k, v, causal, budget_s, log):
    """Time SDPA on one backend: the transposed views and contiguous copies (made here, before
    timing). Returns (ms, out, layout, layout_ms) for the faster layout that runs and agrees
    with the other, or (None, None, reason, {}) when the backend takes neither."""
    import torch
    import torch.nn.functional as F
    from torch.nn.attention import SDPBackend, sdpa_kernel
    views = tuple(x.transpose(1, 2) for x in (q, k, v))            # [b, h, s, d], no copy
    layouts = {"bshd_view": views, "bhsd_contiguous": tuple(x.contiguous() for x in views)}
    outs, why = {}, {}                                             # why: message -> layouts
    with sdpa_kernel(getattr(SDPBackend, backend)):
        for name, qkv in layouts.items():
            try:
                outs[name] = F.scaled_dot_product_attention(*qkv, is_causal=causal)
                torch.cuda.synchronize()
            except RuntimeError as e:                 # "No available kernel", cuDNN refusals
                why.setdefault(reason(e), []).append(name)
        if not outs:
            return None, None, "; ".join(f"{', '.join(n)}: {m}" for m, n in why.items()), {}
        if len(outs) == 2:    # a layout the backend reads wrongly must not be timed
            e = rel_err(outs["bshd_view"], outs["bhsd_contiguous"])
            if e > ERR_MAX:
                log(f"  {backend}: the transposed views give another result (rel err {e:.2e}): "
                    "timing the contiguous copies only")
                del outs["bshd_view"]
        layout_ms = {}
        for name in outs:
            qkv = layouts[name]
            layout_ms[name] = measure(                  # called above: plans are made
                lambda: F.scaled_dot_product_attention(*qkv, is_causal=causal), budget_s,
                called=True)
    best = min(layout_ms, key=layout_ms.get)
    return layout_ms[best], outs[best], best, layout_ms


def bench_point(mk, batch, seq, heads, d, causal, args, last, records, log):
    """Ours and every SDPA backend at one point; appends one record per backend."""
    import torch
    torch.manual_seed(0)
    q, k, v = (torch.randn(batch, seq, heads, d, device="cuda", dtype=torch.bfloat16)
               for _ in range(3))
    flops = attention_flops(batch, heads, seq, seq, d, causal)
    floor = flops / (PEAK_TFLOPS * 1e12) * 1e3
    shape = dict(batch=batch, seq=seq, heads=heads, kv_heads=heads, head_dim=d, causal=causal)
    tag = f"d={d:3d} causal={int(causal)} seq={seq:5d} batch={batch:2d} heads={heads}"

    ours_ms, ours_out, note, tile = None, None, None, None
    prev = last.get((d, causal))
    predicted = prev[1] * flops / prev[0] if prev else 0.0
    if predicted > args.max_call_s * 1e3:
        note = f"ours left out: about {predicted / 1e3:.1f} s a call predicted"
    else:
        def ours():
            return mk.attention(q, k, v, causal=causal)
        try:
            ours_out = ours()[0]              # the first call compiles and plans
            torch.cuda.synchronize()
            tile = ours_tile(q, heads, causal)
            ours_ms = measure(ours, args.budget_s, called=True)
            last[(d, causal)] = (flops, ours_ms)
        except Exception as e:               # noqa: BLE001 (recorded; the baselines still run)
            note = f"ours failed: {reason(e)}"
            ours_out = None
    if note:
        log(f"{tag}  {note}")

    done = 0
    for name, backend in BACKENDS:
        base_ms, base_out, layout, layout_ms = sdpa_baseline(backend, q, k, v, causal,
                                                             args.budget_s, log)
        if base_ms is None:
            log(f"{tag}  {name} left out: {layout}")
            continue
        err = rel_err(ours_out.transpose(1, 2), base_out) if ours_out is not None else None
        if err is not None and err > ERR_MAX:
            log(f"{tag}  WRONG? ours against {name}: rel err {err:.2e} > {ERR_MAX}")
        records.append(common.record(
            "attention", shape, dtype="bf16", world=1, topology="1x1", transport=None,
            ours_ms=ours_ms, baseline=name, baseline_ms=base_ms, floor_ms=floor,
            tflops=flops / ours_ms / 1e9 if ours_ms else None,
            baseline_tflops=flops / base_ms / 1e9, rel_err=err, baseline_layout=layout,
            layout_ms=layout_ms, flops=flops, peak_tflops=PEAK_TFLOPS, tile=tile,
            **({"note": note} if note else {})))
        done += 1
        ours_txt = f"ours {ours_ms:9.3f} ms ({flops / ours_ms / 1e9:6.1f} TF/s)" if ours_ms \
            else "ours         -"
        log(f"{tag}  {ours_txt}  {name} {base_ms:8.3f} ms ({flops / base_ms / 1e9:6.1f} TF/s,"
            f" {layout})  err {'-' if err is None else f'{err:.1e}'}")
    if not done and ours_ms is not None:      # no backend ran: keep our time all the same
        records.append(common.record(
            "attention", shape, dtype="bf16", world=1, topology="1x1", transport=None,
            ours_ms=ours_ms, baseline=None, baseline_ms=None, floor_ms=floor,
            tflops=flops / ours_ms / 1e9, flops=flops, peak_tflops=PEAK_TFLOPS, tile=tile))
    common.write(records, args.out)           # keep every point, even if the run is cut short


def main():
    args = common.parse_args(ranks=1, extra=[
        (("--quick",), dict(action="store_true",
                            help="seq 4096 and 16384, head_dim 128 only (both masks)")),
        (("--seqs",), dict(default=None, help="sequence lengths, e.g. 1024,4096")),
        (("--dims",), dict(default=None, help="head dims, e.g. 64,128")),
        (("--causal",), dict(default="both", choices=("0", "1", "both"))),
        (("--budget-s",), dict(type=float, default=0.3,
                               help="about this much timed work per measurement")),
        (("--max-call-s",), dict(type=float, default=3.0,
                                 help="leave ours out where a call is predicted longer"))])
    seqs = [4096, 16384] if args.quick else [1024, 2048, 4096, 8192, 16384, 32768]
    dims = [128] if args.quick else [64, 128]
    if args.seqs:
        seqs = sorted(int(s) for s in args.seqs.split(","))
    if args.dims:
        dims = [int(s) for s in args.dims.split(",")]
    causals = {"0": [False], "1": [True], "both": [False, True]}[args.causal]

    import torch

    import mknumba as mk
    records, last = [], {}        # last[(d, causal)]: (flops, ours ms) of the latest point

    def log(msg):
        print(msg, flush=True)
    for d in dims:
        for causal in causals:
            for seq in seqs:          # ascending: each point predicts the next one's time
                bench_point(mk, max(1, TOKENS // seq), seq, HEAD_WIDTH // d, d, causal, args,
                            last, records, log)
                torch.cuda.empty_cache()             # the point's tensors are gone
    common.write(records, args.out)
    report.render(records)


if __name__ == "__main__":
    main()
