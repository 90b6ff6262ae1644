"""The static SM split of the fused GEMM + reduction kernels, chosen per shape from a recorded sweep.

``RECORDED`` maps (kernel, topology) to rows ``(m, k_local, comm_sms, deliver, fold)``: the
number of SMs held back from the GEMM for the communication roles, whether compute blocks
delivered partial tiles to their owners (one node of several GPUs only), and whether the owner
added them in its own GEMM epilogue (``fold``, ReduceScatter), that together were fastest in
``benchmarks/bench_fused.py`` (see ``benchmarks/results/fused.json``, field ``sweep``). A shape
between recorded rows takes the row with the nearest ``m * k_local`` (log scale; on a tie, the
nearest m); a shape the table does not cover gets a rule of thumb. Callers override with
``comm_sms=``, ``deliver=`` and ``fold=``. The AllReduce rows were swept with the op's shared
output (``bench_fused.py --shared-out 1``): into an array of the caller's, the owners' pushes
are copied out at the end, so a little more may go to communication there.
"""
import math
from typing import NamedTuple

# From the sweep recorded in benchmarks/results/fused.json (its records carry the GPU, the
# date and the command; regenerate with benchmarks/split_table.py):
# (kernel, topology) -> [(m, k_local, comm_sms, deliver, fold)].
RECORDED = {
    ('gemm_allreduce', '1x2'): [(2048, 128, 16, 1, 0), (2048, 512, 8, 0, 0), (4096, 256, 8, 1, 0),
                                (4096, 1024, 8, 1, 0), (8192, 512, 32, 1, 0),
                                (8192, 2048, 24, 1, 0), (16384, 1024, 24, 1, 0),
                                (16384, 4096, 16, 1, 0)],
    ('gemm_allreduce', '2x1'): [(2048, 128, 48, 0, 0), (2048, 512, 32, 0, 0),
                                (4096, 256, 48, 0, 0), (4096, 1024, 48, 0, 0),
                                (8192, 512, 64, 0, 0), (8192, 2048, 32, 0, 0),
                                (16384, 1024, 64, 0, 0), (16384, 4096, 64, 0, 0)],
    ('gemm_reducescatter', '1x2'): [(2048, 128, 24, 1, 0), (2048, 512, 8, 1, 0),
                                    (4096, 256, 8, 1, 0), (4096, 1024, 24, 1, 0),
                                    (8192, 512, 32, 1, 0), (8192, 2048, 16, 1, 0),
                                    (16384, 1024, 24, 1, 0), (16384, 4096, 8, 1, 0)],
    ('gemm_reducescatter', '2x1'): [(2048, 128, 48, 0, 0), (2048, 512, 64, 0, 0),
                                    (4096, 256, 64, 0, 0), (4096, 1024, 64, 0, 0),
                                    (8192, 512, 64, 0, 0), (8192, 2048, 64, 0, 0),
                                    (16384, 1024, 48, 0, 0), (16384, 4096, 48, 0, 0)],
}

#: Network chunk size per topology kind (paper: 256 KiB for GEMM+AllReduce; the emulated
#: network's host proxy spends a few microseconds per command, so larger chunks there). The
#: 2x1 sweep with 1 MiB reached 97-100% of the network floor (benchmarks/NOTES.md, fused);
#: other sizes were not swept.
CHUNK_BYTES = {"network": 1 << 20}


class Split(NamedTuple):
    """A shape's plan: SMs held back for the communication roles, delivered partials or not,
    folded into the owner's epilogue or not."""
    comm_sms: int
    deliver: bool
    fold: bool = False


def sweep_key(comm_sms, deliver, fold=False):
    """A benchmark sweep entry's name: ``"24"``, ``"24:deliver"`` with delivered partials,
    ``"24:fold"`` with delivered partials folded into the owner's epilogue."""
    return f"{comm_sms}:fold" if fold else f"{comm_sms}:deliver" if deliver else str(comm_sms)


def parse_sweep_key(key):
    sms, _, mode = str(key).partition(":")
    return Split(int(sms), mode in ("deliver", "fold"), mode == "fold")


def rule_of_thumb(kernel, topology, m, n, k, sms):
    """The split when no sweep covers the shape: more communication SMs when communication is
    a larger share (small k: little compute per output byte), fewer for compute-heavy shapes;
    delivered partials on one node of several GPUs (faster at 14 of the 16 recorded 1x2
    points, benchmarks/results/fused.json)."""
    nodes, gpus = (int(x) for x in topology.split("x"))
    per_byte_flops = k  # GEMM flops per output element ~ 2k; bytes moved per element ~ const
    base = 16 if per_byte_flops <= 1024 else 8
    if kernel == "gemm_allreduce" and gpus > 1:
        base += 8                      # reduce and broadcast both need NVLink bandwidth
    if nodes > 1:
        base += 4                      # send and receive roles
    return Split(max(2, min(base, sms // 4)), nodes == 1 and gpus > 1)


def choose(kernel, topology, m, n, k, sms):
    """The Split for this shape: the recorded sweep's nearest row, else the rule of thumb."""
    from .._compat import SIMULATOR
    if SIMULATOR:                      # the simulator's small grid: two compute blocks
        return rule_of_thumb(kernel, topology, m, n, k, sms)._replace(comm_sms=sms - 2)
    rows = RECORDED.get((kernel, topology))
    if rows:
        target = math.log2(m * k)     # ties (2048 x 512 and 4096 x 256): the nearer m
        best = min(rows, key=lambda r: (abs(math.log2(r[0] * r[1]) - target),
                                        abs(math.log2(r[0] / m))))
        return Split(min(best[2], sms - 1), bool(best[3]), bool(best[4]))
    return rule_of_thumb(kernel, topology, m, n, k, sms)


def from_sweep(records):
    """The RECORDED table from benchmark records (each with ``sweep``: :func:`sweep_key` ->
    ms): per (kernel, topology), rows ``(m, k_local, comm_sms, deliver, fold)`` of the fastest
    entry, sorted by shape."""
    out = {}
    for r in records:
        if r.get("sweep"):
            best = parse_sweep_key(min(r["sweep"], key=r["sweep"].get))
            out.setdefault((r["kernel"], r["topology"]), []).append(
                (r["shape"]["m"], r["shape"]["k"], best.comm_sms, int(best.deliver),
                 int(best.fold)))
    return {key: sorted(rows) for key, rows in sorted(out.items())}


def default_chunk_bytes(topology):
    nodes = int(topology.split("x")[0])
    return CHUNK_BYTES["network"] if nodes > 1 else 1 << 18
