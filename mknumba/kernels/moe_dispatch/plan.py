"""Planning MoE Dispatch + GEMM: options, capacities, the SM split between roles, rank
agreement.

Everything here is decided once, when the op is built; a call only binds its arrays (and picks
the cfg of its token count). Routing is data: how many rows each expert gets is only known on
the GPU, inside the launch, so buffers are planned for the worst case (or a smaller capacity
the caller names; the device refuses a call that exceeds it) and the compute role learns its
tile count from the counts exchanged in the launch.
"""
import numpy as np
from numba import cuda

from ..._compat import SIMULATOR
from ...arrays import check_bf16
from ...errors import MkValueError, positive_ints
from ...sched.tiles import cdiv
from ..gemm.plan import fused_tile
from .kernel import CHUNK_ROWS

#: Tokens of a rank's x behind one flag (the paper's 16-token units): receivers pull a row as
#: soon as the unit holding its token is in the sender's token buffer.
UNIT_TOKENS = 16
#: Between nodes a unit is also one proxy command to each rail peer, so the default unit grows
#: to whole 16-token units of about this many bytes (the paper's 512 KiB network chunks; the
#: host proxy spends microseconds per command). A unit never splits a token: no row waits
#: for two chunks.
NETWORK_CHUNK_BYTES = 512 << 10
#: pack and pull blocks on the GPU when ``comm_sms`` is not given; not swept yet
#: (``benchmarks/bench_moe_dispatch_gemm.py``): a block stores about 21 GB/s over NVLink
#: (benchmarks/NOTES.md).
DEFAULT_COMM_SMS = 16
#: expert weight layouts a call takes: "ehf" = [experts / world, hidden, ffn] (B as [k, n], a
#: ":kn" tile build), "efh" = [experts / world, ffn, hidden] (B as [n, k]); both read as they are
W_LAYOUTS = ("ehf", "efh")


class MoeDispatchGemmPlan:
    """The planning half of :class:`~mknumba.kernels.moe_dispatch.MoeDispatchGemm`."""

    name = "MoeDispatchGemm"
    kernel_name = "moe_dispatch_gemm"

    def _plan(self, comm, hidden, ffn, experts, top_k, max_tokens, dtype, capacity, w_layout,
              comm_sms, tile, unit_tokens=None):
        """Resolve every option and the role split (sets the attributes the op reads)."""
        check_bf16(self.name, dtype)
        hidden, ffn, experts, top_k, max_tokens = positive_ints(
            self.name, hidden=hidden, ffn=ffn, experts=experts, top_k=top_k,
            max_tokens=max_tokens).values()
        W = comm.size
        if experts % W:
            raise MkValueError(f"{self.name}: experts={experts} must be divisible by the world "
                               f"size {W} (each rank holds experts / world of them)")
        if top_k > experts:
            raise MkValueError(f"{self.name}: top_k={top_k} is more than experts={experts}")
        if hidden % 8 or ffn % 8:
            raise MkValueError(f"{self.name}: hidden={hidden} and ffn={ffn} must be multiples "
                               "of 8 (16-byte rows for the tensor copies); pad them")
        if w_layout not in W_LAYOUTS:
            raise MkValueError(f"{self.name}: w_layout must be one of {W_LAYOUTS}, got "
                               f"{w_layout!r}")
        worst = W * max_tokens * top_k
        if capacity is None:
            capacity = worst
        capacity = positive_ints(self.name, capacity=capacity)["capacity"]
        self.comm, self.hidden, self.ffn, self.experts = comm, hidden, ffn, experts
        self.top_k, self.max_tokens, self.world = top_k, max_tokens, W
        self.local_experts = experts // W
        self.w_layout = w_layout
        #: rows this rank can receive in one call (out's rows); every token of every rank to
        #: this rank's experts by default
        self.capacity = min(capacity, worst)
        self.kind, self.build = fused_tile(tile, self.name)
        self.bm, self.bn = self.build.shape
        self.topology = f"{comm.nodes}x{comm.local_size}"
        # The receive buffer: each local expert's rows start on a tile row (so a tile row
        # holds one expert's rows), so it has room for the capacity plus a partial tile row
        # per expert.
        self.tiles_m = cdiv(self.capacity, self.bm) + self.local_experts
        self.recv_rows = self.tiles_m * self.bm
        self.tiles_n = cdiv(ffn, self.bn)
        self.nodes = comm.nodes
        unit = UNIT_TOKENS
        if self.nodes > 1:
            unit = max(unit, NETWORK_CHUNK_BYTES // (2 * hidden) // unit * unit)
        unit_tokens = positive_ints(self.name, unit_tokens=unit_tokens)["unit_tokens"]
        self.unit = min(unit, max_tokens) if unit_tokens is None else unit_tokens
        self.units = cdiv(max_tokens, self.unit)
        # tiles in the order they are taken: tile rows in receive-buffer order (expert by
        # expert), every column of a row before the next row
        self.order = np.arange(self.tiles_m * self.tiles_n, dtype=np.int32)
        self._roles(comm_sms)

    def _roles(self, comm_sms):
        """The grid (one block per SM) and its roles in block order: route (one block), pack,
        forward (between nodes), pull, compute; with ``comm_sms="adaptive"`` route, pack,
        forward, then the flexible blocks (:meth:`_adaptive`)."""
        sms = None if SIMULATOR else cuda.get_current_device().MULTIPROCESSOR_COUNT
        need = 3 if self.nodes > 1 else 2
        if isinstance(comm_sms, str) and comm_sms != "adaptive":
            raise MkValueError(f"{self.name}: comm_sms={comm_sms!r}: a number of SMs, None "
                               "(the default) or 'adaptive'")
        self.adaptive = comm_sms == "adaptive"
        if comm_sms is None or self.adaptive:
            comm_sms = need if SIMULATOR else DEFAULT_COMM_SMS
        comm_sms = positive_ints(self.name, comm_sms=comm_sms)["comm_sms"]
        if comm_sms < need:
            raise MkValueError(f"{self.name}: comm_sms={comm_sms} must be at least {need} "
                               f"(pack{', forward' if need == 3 else ''} and pull)")
        forward = max(1, comm_sms // 4) if self.nodes > 1 else 0
        pack = max(1, (comm_sms - forward) // 3)
        pull = comm_sms - forward - pack
        held = 1 + comm_sms
        if self.adaptive:
            pull = self._adaptive(pull)
            held = 1 + pack + forward
        grid = held + 2 if SIMULATOR else sms   # the simulator runs blocks one at a time
        if held >= grid:
            raise MkValueError(f"{self.name}: {held} blocks for route, pack, forward and pull "
                               f"leave none of the {grid} SMs to compute")
        self.role_blocks = dict(route=1, pack=pack, forward=forward, pull=pull,
                                compute=grid - held)
        self.init_comm = min(self.init_comm, grid - held - 1) if self.adaptive else 0
        self.grid = grid

    def _adaptive(self, pull):
        """comm_sms="adaptive" (``roles.controller``): the compute blocks are flexible, and
        their communication items are the pulls, ``CHUNK_ROWS`` rows of the receive buffer
        each (route, pack and forward stay fixed: they face the proxy). The flexible blocks
        that start pulling: the static split's ``pull`` blocks. Returns the fixed pull blocks
        (none)."""
        if self.bm % CHUNK_ROWS:
            raise MkValueError(f"{self.name}: comm_sms='adaptive' pulls {CHUNK_ROWS} rows at a "
                               f"time, and tile build {self.kind!r} has tile rows of {self.bm}")
        self.chunks = self.bm // CHUNK_ROWS
        self.init_comm = pull
        return 0
