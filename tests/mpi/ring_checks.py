"""Multi-rank checks of RingAttention, run under mpiexec.

    mpiexec -n N python tests/mpi/ring_checks.py BATCH SEQ_LOCAL HEADS KV_HEADS HEAD_DIM CALLS
        [ARRAYS]

For each layout (contiguous, zigzag) and mask (full, causal): CALLS calls back to back with
fresh random inputs (the same global sequence on every rank, from one seed, sharded by the
layout) and poisoned outputs (NaN), then each rank's out and lse are compared with a float64
NumPy reference of the whole sequence, restricted to this rank's rows (relative Frobenius error
of out <= 1e-2, lse within 1e-3). ARRAYS: numba (bf16 bits) or torch (GPU only). Prints
``PASS ring <layout> causal=<0|1> rank <r> ...``.
"""
import sys

import numpy as np

import mknumba as mk
from mknumba._compat import SIMULATOR
from mknumba.arrays import from_bf16_bits, to_bf16_bits
from mknumba.sched.sequence import positions, shard
from numba import cuda


def reference(q, k, v, causal):
    """float64 attention over the whole sequence: (out [b, S, h, d], lse [b, h, S])."""
    b, S, h, d = q.shape
    g = h // k.shape[2]
    out, lse = np.zeros(q.shape), np.zeros((b, h, S))
    for bi in range(b):
        for hi in range(h):
            s = q[bi, :, hi] @ k[bi, :, hi // g].T / np.sqrt(d)
            if causal:
                s = np.where(np.arange(S)[None, :] <= np.arange(S)[:, None], s, -np.inf)
            mx = s.max(1, keepdims=True)
            p = np.exp(s - mx)
            den = p.sum(1, keepdims=True)
            out[bi, :, hi] = p / den @ v[bi, :, hi // g]
            lse[bi, hi] = (mx + np.log(den))[:, 0]
    return out, lse


def to_device(bits, arrays):
    if arrays == "torch":
        import torch
        return torch.from_numpy(bits.view(np.int16)).cuda().view(torch.bfloat16)
    return cuda.to_device(bits) if not SIMULATOR else bits.copy()


def to_host(x, arrays):
    if arrays == "torch":
        import torch
        return x.view(torch.int16).cpu().numpy().view(np.uint16) if x.dtype == torch.bfloat16 \
            else x.cpu().numpy()
    return x.copy_to_host() if hasattr(x, "copy_to_host") else np.asarray(x)


def run(comm, dims, calls, arrays, layout, causal):
    b, s, h, hk, d = dims
    W, r = comm.size, comm.rank
    op = mk.RingAttention(comm, b, s, h, hk, d, causal=causal, layout=layout)
    rng = np.random.default_rng(77)                  # one global sequence on every rank
    sent, got = [], []
    for _ in range(calls):
        full = [to_bf16_bits(rng.standard_normal((b, W * s, n, d))) for n in (h, hk, hk)]
        sent.append(full)
        mine = [to_device(shard(x, r, W, layout), arrays) for x in full]
        if arrays == "torch":
            import torch
            out = torch.full((b, s, h, d), float("nan"), device="cuda", dtype=torch.bfloat16)
            lse = torch.full((b, h, s), float("nan"), device="cuda")
        else:
            out = to_device(np.full((b, s, h, d), 0x7FC0, np.uint16), arrays)
            lse = to_device(np.full((b, h, s), np.nan, np.float32), arrays)
            if not SIMULATOR:
                lse = cuda.to_device(np.full((b, h, s), np.nan, np.float32))
        got.append(op(*mine, out=out, lse=lse))
    op.synchronize()
    worst = 0.0
    rows = positions(r, s, W, layout)
    for it, (full, (out, lse)) in enumerate(zip(sent, got)):
        ro, rl = reference(*(from_bf16_bits(x).astype(np.float64) for x in full), causal)
        o = from_bf16_bits(to_host(out, arrays)).astype(np.float64)
        L = to_host(lse, arrays).astype(np.float64)
        assert np.isfinite(o).all() and np.isfinite(L).all(), f"call {it}: unwritten outputs"
        err = np.linalg.norm(o - ro[:, rows]) / np.linalg.norm(ro[:, rows])
        lerr = np.abs(L - rl[:, :, rows]).max()
        assert err <= 1e-2 and lerr <= 1e-3, f"call {it}: out rel err {err:.3g}, lse {lerr:.3g}"
        worst = max(worst, err)
    op.free()
    return worst


def main():
    dims = tuple(int(x) for x in sys.argv[1:6])
    calls = int(sys.argv[6])
    arrays = sys.argv[7] if len(sys.argv) > 7 else "numba"
    with mk.init() as comm:
        if arrays == "torch":
            import torch
            torch.cuda.set_device(comm.device_id)
        for layout in ("contiguous", "zigzag"):
            for causal in (False, True):
                worst = run(comm, dims, calls, arrays, layout, causal)
                print(f"PASS ring {layout} causal={int(causal)} rank {comm.rank} topology "
                      f"{comm.nodes}x{comm.local_size} dims={dims} calls={calls} "
                      f"max_rel_err={worst:.2e}", flush=True)
        comm.barrier()


if __name__ == "__main__":
    main()
