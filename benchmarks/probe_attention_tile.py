"""Diagnostic: builds of the sm90 attention tile timed against each other and cuDNN (one GPU).

    python benchmarks/probe_attention_tile.py [--out PATH] [--variants sm90,...]

A variant is ``roles/cuda/attention_tile.cu`` built with defines (code the library's build
leaves out, guarded by ``#if``), listed in ``VARIANTS`` below, registered with
``roles.attention.register_sm90_build`` and run through ``mknumba.attention(tile=...)``. The
library's tile is ``sm90``; the variants measured so far (the Q slot released early, the
producer / consumer register split 40 / 232, ping-pong alone and with the early release) and
what they gave are in benchmarks/NOTES.md; ping-pong won and is the library's tile now.

First every variant is checked on small ragged shapes (seq 1000: a partial last tile; 640 query
tiles, several a block) against an fp32 reference (output and LSE), both masks, d 64 and 128;
this compiles it too ("checking X" is printed before each call: a variant that hangs is the
last one named; rerun without it).
Then at each point (d 128: seq 4K and 16K, both masks; d 64: seq 4K, both masks; batch * seq =
16K tokens, heads * d = 2048, as bench_attention.py) cuDNN SDPA and every variant are timed,
twice, in opposite orders, each the faster of its two; each variant's output is checked
against SDPA's (relative error <= 1e-2) and its LSE, for two heads, against fp32 (<= 1e-3).
"""
import argparse
import os
import sys

import common
from bench_attention import BACKENDS, attention_flops, measure, rel_err, sdpa_baseline

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

from mknumba.roles import attention as A  # noqa: E402

#: variant -> defines (None: the library's build)
VARIANTS = {"sm90": None}
DEFAULT = "sm90"
#: (d, causal, seq) timed
POINTS = [(128, False, 4096), (128, True, 4096), (128, False, 16384), (128, True, 16384),
          (64, False, 4096), (64, True, 4096)]
TOKENS, HEAD_WIDTH = 16384, 2048
ERR_MAX, LSE_MAX = 1e-2, 1e-3


def tile_name(variant):
    """The build name ``mknumba.attention`` takes for ``variant`` (registered once)."""
    if VARIANTS[variant] is None:
        return "sm90"
    name = f"sm90:{variant}"
    A.register_sm90_build(name, VARIANTS[variant])
    return name


def reference_lse(q, k, b, h, causal, scale, chunk=4096):
    """LSE of head h of batch b in fp32 (natural log), query rows in chunks."""
    import torch
    qs, ks = q[b, :, h].float(), k[b, :, h].float()
    seq, out = qs.shape[0], []
    for r0 in range(0, seq, chunk):
        s = (qs[r0:r0 + chunk] @ ks.T) * scale
        if causal:
            rows = torch.arange(r0, min(r0 + chunk, seq), device=q.device)[:, None]
            s.masked_fill_(torch.arange(seq, device=q.device)[None, :] > rows, float("-inf"))
        out.append(torch.logsumexp(s, dim=-1))
    return torch.cat(out)


def reference(q, k, v, causal, scale):
    """Attention in fp32 (small shapes): out [b, s, h, d] and lse [b, h, s]."""
    import torch
    qf, kf, vf = (x.float().transpose(1, 2) for x in (q, k, v))     # [b, h, s, d]
    s = (qf @ kf.transpose(-1, -2)) * scale
    if causal:
        n = s.shape[-1]
        s.masked_fill_(torch.ones(n, n, dtype=torch.bool, device=q.device).triu(1),
                       float("-inf"))
    return (torch.softmax(s, -1) @ vf).transpose(1, 2), torch.logsumexp(s, -1)


def check_small(mk, variant, tile, log):
    """The variant on ragged shapes against fp32; False if wrong."""
    import torch
    ok = True
    for d in (128, 64):
        for causal in (False, True):
            torch.manual_seed(d + causal)
            # 640 query tiles: several a block (the Q slot and the turns reused)
            q, k, v = (torch.randn(2, 1000, 40, d, device="cuda", dtype=torch.bfloat16)
                       for _ in range(3))
            log(f"checking {variant} d={d} causal={int(causal)} seq=1000 ...")
            out = torch.full_like(q, float("nan"))
            lse = torch.full((2, 40, 1000), float("nan"), device="cuda")
            mk.attention(q, k, v, causal=causal, out=out, lse=lse, tile=tile)
            torch.cuda.synchronize()
            want, want_lse = reference(q, k, v, causal, d ** -0.5)
            err = rel_err(out, want)
            lse_err = (lse - want_lse).abs().max().item()
            good = err <= ERR_MAX and lse_err <= LSE_MAX
            ok &= good
            log(f"  {'ok' if good else 'WRONG'}: rel err {err:.1e}, lse max err {lse_err:.1e}")
    return ok


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--out", default=None)
    p.add_argument("--variants", default=DEFAULT, help=f"of {', '.join(VARIANTS)}")
    p.add_argument("--budget-s", type=float, default=0.15)
    p.add_argument("--ranks", action="store_true")
    args = p.parse_args()
    if args.ranks:
        print(1)
        return
    import torch

    import mknumba as mk

    def log(msg):
        print(msg, flush=True)
    variants = list(dict.fromkeys(args.variants.split(",")))
    unknown = [v for v in variants if v not in VARIANTS]
    if unknown:
        raise SystemExit(f"unknown variants {unknown}; known: {list(VARIANTS)}")
    tiles = {v: tile_name(v) for v in variants}
    variants = [v for v in variants if check_small(mk, v, tiles[v], log)]

    records, table = [], {}
    cudnn = BACKENDS[0][1]
    for d, causal, seq in POINTS:
        batch, heads = max(1, TOKENS // seq), HEAD_WIDTH // d
        torch.manual_seed(seq + d + causal)
        q, k, v = (torch.randn(batch, seq, heads, d, device="cuda", dtype=torch.bfloat16)
                   for _ in range(3))
        flops = attention_flops(batch, heads, seq, seq, d, causal)
        point = (d, causal, seq)
        base_ms, base_out, layout, _ = sdpa_baseline(cudnn, q, k, v, causal, args.budget_s, log)
        want_lse = {h: reference_lse(q, k, 0, h, causal, d ** -0.5) for h in (0, heads - 1)}
        outs = {}
        for name in variants:                   # plan, check
            out, lse = torch.empty_like(q), torch.empty(batch, heads, seq, device="cuda")
            mk.attention(q, k, v, causal=causal, out=out, lse=lse, tile=tiles[name])
            torch.cuda.synchronize()
            err = rel_err(out.transpose(1, 2), base_out) if base_out is not None else None
            lse_err = max((lse[0, h] - ref).abs().max().item() for h, ref in want_lse.items())
            if (err is not None and err > ERR_MAX) or lse_err > LSE_MAX:
                log(f"WRONG {name} at d={d} causal={int(causal)} seq={seq}: rel err {err}, "
                    f"lse max err {lse_err}")
            outs[name] = (out, lse, err, lse_err)
        times = {name: [] for name in variants}
        times["cudnn"] = [base_ms] if base_ms is not None else []
        for order in (variants, variants[::-1]):   # two rounds, opposite orders
            for name in order:
                out, lse = outs[name][:2]
                times[name].append(measure(
                    lambda: mk.attention(q, k, v, causal=causal, out=out, lse=lse,
                                         tile=tiles[name]), args.budget_s, called=True))
        if base_ms is not None:                 # cuDNN again, after the variants
            again, _, _, _ = sdpa_baseline(cudnn, q, k, v, causal, args.budget_s, log)
            times["cudnn"].append(again)
        best = {name: min(t) for name, t in times.items() if t}
        table[point] = (best, flops)
        for name in variants:
            records.append(common.record(
                "attention_tile_probe", dict(batch=batch, seq=seq, heads=heads,
                                             kv_heads=heads, head_dim=d, causal=causal),
                dtype="bf16", world=1, topology="1x1", transport=None, ours_ms=best[name],
                baseline="sdpa_cudnn", baseline_ms=best.get("cudnn"), floor_ms=None,
                variant=name, tile=tiles[name], rel_err=outs[name][2],
                lse_err=outs[name][3], baseline_layout=layout, tflops=flops / best[name] / 1e9,
                times_ms=times[name]))
        common.write(records, args.out)
        log(f"d={d} causal={int(causal)} seq={seq}: " + ", ".join(
            f"{name} {ms:.3f} ms" for name, ms in best.items()))

    log("\nTF/s (ratio to cuDNN SDPA); each the faster of two timings")
    log(f"{'point':24s}{'cudnn':>10s}" + "".join(f"{name:>16s}" for name in variants))
    for (d, causal, seq), (best, flops) in table.items():
        cells = "".join(
            f" {flops / best[n] / 1e9:8.1f} ({best['cudnn'] / best[n] if 'cudnn' in best else 0:4.2f})"
            for n in variants)
        base = f"{flops / best['cudnn'] / 1e9:10.1f}" if "cudnn" in best else f"{'-':>10s}"
        log(f"d={d:3d} {'causal' if causal else 'full':6s} {seq:6d}    {base}{cells}")


if __name__ == "__main__":
    main()
