"""Attention compute role: FlashAttention's forward, one KV slice at a time.

Two builds of the same role. On sm_90a the linked tile ``cuda/attention_tile.cu`` (TMA +
wgmma, 128 query rows per tile, 384 threads: see its header); its numba wrappers are
:func:`sm90_functions`. Elsewhere (the simulator, other GPUs, head dims other than 64 and 128)
the SIMT twin below: a block takes one tile of query rows of one (batch, head); each thread owns one query row and
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
import os

import numpy as np
from numba import cuda, types

from ..errors import MkValueError
from ..primitives import data_ptr
from ..sched.sequence import position
from .compute import bf16_to_f32, f32_to_bf16, linked_source

HEAD_DIM_MAX = 128     # the per-thread accumulator's size (registers on the GPU)

# Must match the constants at the top of cuda/attention_tile.cu.
SM90_HELPER = os.path.join(os.path.dirname(os.path.abspath(__file__)), "cuda",
                           "attention_tile.cu")
SM90_ROWS = 128                 # query rows per tile, and keys per KV tile
SM90_THREADS = 384              # two consumer warpgroups + the producer warpgroup
SM90_CONSUMERS = 256
SM90_HEAD_DIMS = (64, 128)
SM90_SMEM_BYTES = 7 * 128 * 256 + 128 + 1024  # Q, K x 3, V x 3, barriers, 1 KB alignment
RUN_BYTES = 12                  # one run of positions: base0, split, base1 (int32)
LOG2E = 1.4426950408889634


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


# ---- sm_90a: thin numba wrappers around the linked tile -----------------------------------------
#: the sm_90a builds of the tile: name -> defines prepended to ``cuda/attention_tile.cu``. The
#: library runs "sm90"; a probe adds variants (:func:`register_sm90_build`), which the ops then
#: take as ``tile=``
SM90_BUILDS = {"sm90": ""}
_SM90 = {}      # build name -> its device functions


def register_sm90_build(name, defines):
    """Add a build of the tile under ``name`` (``"sm90:..."``) with ``defines`` (lines such
    as ``"#define MK_ATTN_X 1\n"`` put before attention_tile.cu, for code it guards with
    ``#if``), for probes that time variants against each other
    (``benchmarks/probe_attention_tile.py``)."""
    if not name.startswith("sm90:"):
        raise MkValueError(f"an sm90 attention build's name starts with 'sm90:', got {name!r}")
    if SM90_BUILDS.get(name, defines) != defines:
        raise MkValueError(f"sm90 attention build {name!r} exists with other defines")
    SM90_BUILDS[name] = defines


def sm90_functions(build="sm90"):
    """``(init, producer_regs, consumer_regs, load_q, load_kv, tile)`` device functions around
    ``cuda/attention_tile.cu`` as ``build`` (a name in ``SM90_BUILDS``) compiles it, declared
    on first use. Launch with ``SM90_THREADS`` threads and ``SM90_SMEM_BYTES`` of dynamic
    shared memory; ``smem`` is that memory, map arguments are tensor-map addresses."""
    if build in _SM90:
        return _SM90[build]
    helper = linked_source(SM90_HELPER, SM90_BUILDS[build])
    u64, i32, f32 = types.uint64, types.int32, types.float32
    init_fn = cuda.declare_device("mk_attn_sm90_init", i32(u64), link=[helper], abi="c")
    load_q_fn = cuda.declare_device("mk_attn_sm90_load_q", i32(u64, u64, i32, i32, i32, i32, i32),
                                    link=[helper], abi="c")
    load_kv_fn = cuda.declare_device(
        "mk_attn_sm90_load_kv",
        i32(u64, u64, u64, i32, i32, i32, i32, i32, u64, u64, i32, i32, i32), link=[helper],
        abi="c")
    tile_fn = cuda.declare_device(
        "mk_attn_sm90_tile",
        i32(u64, u64, u64, i32, i32, i32, i32, i32, i32, u64, u64, i32, i32, f32, i32, i32),
        link=[helper], abi="c")
    # setmaxnreg: the first thing on the producer warpgroup's path (all of its threads) and on
    # the consumers'; the two paths must never rejoin (ptxas then drops both, C7507)
    producer_regs, consumer_regs = (
        cuda.declare_device(f"mk_attn_sm90_{role}_regs", i32(), link=[helper], abi="c")
        for role in ("producer", "consumer"))
    i = np.int32

    @cuda.jit(device=True)
    def attn_init(smem):
        """Once per block before its first tile (the caller then syncs the block)."""
        init_fn(data_ptr(smem))

    @cuda.jit(device=True)
    def attn_load_q(smem, q_map, b, col, row0, d, q_seq):
        """Producer lane: query rows [row0, row0 + 128) at column ``col`` (head * d)."""
        load_q_fn(data_ptr(smem), q_map, i(b), i(col), i(row0), i(d), i(q_seq))

    @cuda.jit(device=True)
    def attn_load_kv(smem, k_map, v_map, b, col, d, seq, row0, q_run, kv_run, causal, kv_seq,
                     live):
        """Producer lane: the KV tiles of one slice that query tile ``row0`` sees; returns the
        KV tiles passed through the ring so far."""
        return load_kv_fn(data_ptr(smem), k_map, v_map, i(b), i(col), i(d), i(seq), i(row0),
                          q_run, kv_run, i(causal), i(kv_seq), i(live))

    @cuda.jit(device=True)
    def attn_tile(smem, out, lse, b, h, heads, seq, d, row0, q_run, kv_runs, slices, causal,
                  scale_log2, kv_seq, q_seq):
        """Consumers: one query tile against ``slices`` slices; returns KV tiles consumed."""
        return tile_fn(data_ptr(smem), data_ptr(out), data_ptr(lse), i(b), i(h), i(heads),
                       i(seq), i(d), i(row0), q_run, kv_runs, i(slices), i(causal),
                       np.float32(scale_log2), i(kv_seq), i(q_seq))

    _SM90[build] = (attn_init, producer_regs, consumer_regs, attn_load_q, attn_load_kv,
                    attn_tile)
    return _SM90[build]
