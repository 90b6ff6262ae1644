"""The static SM split of the fused GEMM + reduction kernels, chosen per shape from a recorded sweep.

``RECORDED`` maps (kernel, topology) to rows ``(m, k_local, comm_sms)``: the number of SMs held
back from the GEMM for the communication roles that was fastest in ``benchmarks/bench_fused.py``
(see ``benchmarks/results/fused.json``, field ``sweep``). A shape between recorded rows takes the
row with the nearest ``m * k_local`` (log scale); a shape the table does not cover gets a rule
of thumb. Callers override with ``comm_sms=``.
"""
import math

# Filled from the sweep in benchmarks/results/fused.json (kernel, topology) -> [(m, k, sms)].
RECORDED = {}

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
        target = math.log2(m * k)
        best = min(rows, key=lambda r: abs(math.log2(r[0] * r[1]) - target))
        return min(best[2], sms - 1)
    return rule_of_thumb(kernel, topology, m, n, k, sms)


def default_chunk_bytes(topology):
    nodes = int(topology.split("x")[0])
    return CHUNK_BYTES["network"] if nodes > 1 else 1 << 18
