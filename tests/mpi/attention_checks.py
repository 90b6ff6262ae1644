"""One-GPU attention (``mk.attention`` / ``RingAttention`` on a world of one) against a float64
PyTorch reference: head dims 64 and 128, causal and not, grouped-query heads, sequence lengths
that are not multiples of the 128-row tile; the tile picked as on a user's machine (sm90 on an
H200) and the SIMT twin beside it; 100 back-to-back calls with fresh inputs and poisoned outputs.

    python attention_checks.py            (GPU only; prints one PASS line per case)
"""
import math

import torch

import mknumba as mk


def reference(q, k, v, causal, scale):
    """float64 attention of [b, s, h, d] tensors: (out [b, s, h, d], lse [b, h, s])."""
    s, h, hk = q.shape[1], q.shape[2], k.shape[2]
    k, v = k.repeat_interleave(h // hk, dim=2), v.repeat_interleave(h // hk, dim=2)
    scores = torch.einsum("bqhd,bkhd->bhqk", q, k) * scale
    if causal:
        later = torch.ones(s, s, dtype=torch.bool, device=q.device).triu(1)
        scores = scores.masked_fill(later, -math.inf)
    return torch.einsum("bhqk,bkhd->bqhd", torch.softmax(scores, -1), v), \
        torch.logsumexp(scores, -1)


def check(b, s, h, hk, d, causal, tile="auto", calls=1):
    op = mk.RingAttention(None, b, s, h, hk, d, causal=causal, tile=tile)
    if tile == "auto" and torch.cuda.get_device_capability() == (9, 0):
        assert op.tile == "sm90", op.tile
    worst = (0.0, 0.0)
    for _ in range(calls):
        q = torch.randn(b, s, h, d, device="cuda").bfloat16()
        k = torch.randn(b, s, hk, d, device="cuda").bfloat16()
        v = torch.randn(b, s, hk, d, device="cuda").bfloat16()
        out = torch.full_like(q, math.nan)
        lse = torch.full((b, h, s), math.nan, device="cuda")
        op(q, k, v, out=out, lse=lse)
        op.synchronize()
        ro, rl = reference(q.double(), k.double(), v.double(), causal, 1 / math.sqrt(d))
        err = ((out.double() - ro).norm() / ro.norm()).item()
        lerr = (lse.double() - rl).abs().max().item()
        assert err < 1e-2 and lerr < 1e-3, (b, s, h, hk, d, causal, op.tile, err, lerr)
        worst = max(worst[0], err), max(worst[1], lerr)
    print(f"PASS attention tile={op.tile} b={b} s={s} h={h} hk={hk} d={d} causal={causal} "
          f"calls={calls} err={worst[0]:.1e} lse_err={worst[1]:.1e}", flush=True)


if __name__ == "__main__":
    torch.manual_seed(0)
    for d in (64, 128):
        for causal in (False, True):
            check(2, 300, 4, 2, d, causal)        # ragged (300 = 2 x 128 + 44), GQA 2:1
            check(1, 1024, 4, 4, d, causal)       # whole tiles, several per slice
    check(1, 2048, 8, 1, 128, True)               # GQA 8:1, 16 KV tiles
    check(2, 200, 4, 2, 128, True, tile="simt")   # the twin on the same GPU
    check(1, 512, 8, 2, 128, True, calls=100)
