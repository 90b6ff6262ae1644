"""Attention compute role: FlashAttention's forward, one KV slice at a time (the SIMT twin).

A block takes one tile of query rows of one (batch, head); each thread owns one query row and
keeps its running state in fp32 registers: the row maximum ``m``, the softmax denominator ``l``
and the unnormalised output ``acc[d]``. Each key updates them online:

    s = q . k * scale;   m' = max(m, s);   l = l * e^(m - m') + e^(s - m');
    acc = acc * e^(m - m') + e^(s - m') * v

The state carries over from one KV slice to the next, so slices arriving from other ranks
merge exactly as partial outputs merged by their log-sum-exp would, in fp32, and the output is
rounded to bf16 once, at the end: ``out = acc / l``, ``lse = m + log(l)``.

Arrays: q [batch, seq, heads, d], k and v [batch, seq, kv_heads, d], bf16 bits (uint16). With
grouped-query attention (kv_heads < heads) head h reads kv head h // (heads / kv_heads).
"""
import math

import numpy as np
from numba import cuda

from ..sched.sequence import position
from .compute import bf16_to_f32, f32_to_bf16

HEAD_DIM_MAX = 128     # the per-thread accumulator's size (registers on the GPU)


@cuda.jit(device=True)
def load_row(q, b, row, h, d, qrow, scale):
    """``qrow[:d] = q[b, row, h, :] * scale`` in fp32."""
    for e in range(d):
        qrow[e] = bf16_to_f32(q[b, row, h, e]) * scale


@cuda.jit(device=True)
def attend_slice(qrow, acc, m, l, k, v, b, kvh, d, n_keys, qpos, kv_rank, seq_local, world,
                 zigzag, causal):
    """Fold the keys of one KV slice (``k``, ``v``: rank ``kv_rank``'s [batch, seq, kv_heads,
    d]) into one query row's state; returns the new ``(m, l)`` (``acc`` is updated in place).
    Causal: keys after the query's global position ``qpos`` are skipped."""
    for j in range(n_keys):
        if causal and position(j, kv_rank, seq_local, world, zigzag) > qpos:
            continue
        s = np.float32(0.0)
        for e in range(d):
            s += qrow[e] * bf16_to_f32(k[b, j, kvh, e])
        if s > m:
            corr = np.float32(math.exp(m - s))
            l *= corr
            for e in range(d):
                acc[e] *= corr
            m = s
        p = np.float32(math.exp(s - m))
        l += p
        for e in range(d):
            acc[e] += p * bf16_to_f32(v[b, j, kvh, e])
    return m, l


@cuda.jit(device=True)
def store_row(out, lse, acc, m, l, b, row, h, d):
    """``out[b, row, h, :] = acc / l`` (bf16, rounded once) and ``lse[b, h, row] = m + log l``."""
    inv = np.float32(1.0) / l
    for e in range(d):
        out[b, row, h, e] = f32_to_bf16(acc[e] * inv)
    lse[b, h, row] = m + np.float32(math.log(l))
