"""mknumba: persistent, fused multi-GPU / multi-node kernels written with numba-cuda.

    import mknumba as mk
    comm = mk.init()                        # MPI bootstrap, topology, GPU binding, proxies
    op = mk.AllGather(comm, (1024,), "float32")
    out = op(x)                             # x: [1024] on this rank's GPU -> out: [ranks, 1024]
"""
from . import _compat  # noqa: F401  (must run before numba.cuda compiles anything)
from .arrays import bf16_array, from_bf16_bits, to_bf16_bits, to_float32
from .errors import (MkCapacityError, MkError, MkPerformanceWarning, MkTimeoutError,
                     MkValueError)
from .kernels.allgather import AllGather
from .kernels.allgather_gemm import AllGatherGemm
from .kernels.gemm import Gemm, gemm
from .kernels.gemm_ar import GemmAllReduce
from .kernels.gemm_rs import GemmReduceScatter
from .kernels.moe_dispatch import MoeDispatchGemm, MoeLayout
from .kernels.ring_attention import RingAttention, attention
from .runtime import Comm, finalize, init
from .topology import Topology, make_topology

__version__ = "0.1.0"
__all__ = ["init", "finalize", "Comm", "AllGather", "AllGatherGemm", "Gemm", "gemm",
           "GemmReduceScatter", "GemmAllReduce", "Topology", "make_topology",
           "MkError", "MkValueError", "MkTimeoutError", "MkCapacityError", "MkPerformanceWarning",
           "bf16_array", "to_float32", "to_bf16_bits", "from_bf16_bits", "RingAttention", "attention", "MoeDispatchGemm",
           "MoeLayout"]
