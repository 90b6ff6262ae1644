"""The static SM split of the fused GEMM + reduction kernels, chosen per shape from a recorded sweep.

``RECORDED`` maps (kernel, topology) to rows ``(m, k_local, comm_sms)``: the number of SMs held
back from the GEMM for the communication roles that was fastest in ``benchmarks/bench_fused.py``
(see ``benchmarks/results/fused.json``, field ``sweep``). A shape between recorded rows takes the
row with the nearest ``m * k_local`` (log scale; on a tie, the nearest m); a shape the table does
not cover gets a rule of thumb. Callers override with ``comm_sms=``.
"""
import math

# From the sweep in benchmarks/results/fused.json (2x H200, 2026-12-01; regenerate with
# benchmarks/split_table.py): (kernel, topology) -> [(m, k_local, comm_sms)].
RECORDED = {
    ('gemm_allreduce', '1x2'): [(2048, 128, 96), (2048, 512, 64), (4096, 256, 24), (4096, 1024, 64),
                                (8192, 512, 64), (8192, 2048, 48), (16384, 1024, 64),
                                (16384, 4096, 32)],
    ('gemm_allreduce', '2x1'): [(2048, 128, 64), (2048, 512, 48), (4096, 256, 64), (4096, 1024, 64),
                                (8192, 512, 32), (8192, 2048, 48), (16384, 1024, 64),
                                (16384, 4096, 64)],
    ('gemm_reducescatter', '1x2'): [(2048, 128, 64), (2048, 512, 64), (4096, 256, 64),
                                    (4096, 1024, 48), (8192, 512, 64), (8192, 2048, 32),
                                    (16384, 1024, 48), (16384, 4096, 16)],
    ('gemm_reducescatter', '2x1'): [(2048, 128, 64), (2048, 512, 48), (4096, 256, 48),
                                    (4096, 1024, 48), (8192, 512, 32), (8192, 2048, 64),
                                    (16384, 1024, 64), (16384, 4096, 64)],
}

#: Network chunk size per topology kind (paper: 256 KiB for GEMM+AllReduce; the emulated
#: network's host proxy spends a few microseconds per command, so larger chunks there).
CHUNK_BYTES = {"network": 1 << 20}


def rule_of_thumb(kernel, topology, m, n, k, sms):
    """Communication SMs when no sweep covers the shape: more when communication is a larger
    share (small k: little compute per output byte), fewer for compute-heavy shapes."""
    nodes, gpus = (int(x) for x in topology.split("x"))
    per_byte_flops = k  # GEMM flops per output element ~ 2k; bytes moved per element ~ const
    base = 16 if per_byte_flops <= 1024 else 8
    if kernel == "gemm_allreduce" and gpus > 1:
        base += 8                      # reduce and broadcast both need NVLink bandwidth
    if nodes > 1:
        base += 4                      # send and receive roles
    return max(2, min(base, sms // 4))


def choose(kernel, topology, m, n, k, sms):
    """comm_sms for this shape: the recorded sweep's nearest row, else the rule of thumb."""
    from .._compat import SIMULATOR
    if SIMULATOR:
        return sms - 2                 # the simulator's small grid: two compute blocks
    rows = RECORDED.get((kernel, topology))
    if rows:
        target = math.log2(m * k)     # ties (2048 x 512 and 4096 x 256): the nearer m
        best = min(rows, key=lambda r: (abs(math.log2(r[0] * r[1]) - target),
                                        abs(math.log2(r[0] / m))))
        return min(best[2], sms - 1)
    return rule_of_thumb(kernel, topology, m, n, k, sms)


def from_sweep(records):
    """The RECORDED table from benchmark records (each with ``sweep``: comm_sms -> ms): per
    (kernel, topology), rows ``(m, k_local, fastest comm_sms)`` sorted by shape."""
    out = {}
    for r in records:
        if r.get("sweep"):
            best = min(r["sweep"], key=r["sweep"].get)
            out.setdefault((r["kernel"], r["topology"]), []).append(
                (r["shape"]["m"], r["shape"]["k"], int(best)))
    return {key: sorted(rows) for key, rows in sorted(out.items())}


def default_chunk_bytes(topology):
    nodes = int(topology.split("x")[0])
    return CHUNK_BYTES["network"] if nodes > 1 else 1 << 18
