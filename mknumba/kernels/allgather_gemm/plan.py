"""Planning AllGather + GEMM: options, the shard's parts, the SM split between roles, the tile
order, rank agreement.

Everything here is decided once, when the op is built; a call only binds its arrays.
"""
from numba import cuda

from ..._compat import SIMULATOR
from ...arrays import check_bf16
from ...errors import MkValueError, positive_ints
from ...sched.tiles import arrival_order, cdiv, default_group_m, gather_order
from ..gemm.plan import check_shapes, fused_tile

#: Bytes of a shard's part that crosses the network in one proxy command (the host proxy
#: spends microseconds per command: ``sched.split.CHUNK_BYTES``).
NETWORK_PART_BYTES = 1 << 20
#: Send and forward blocks on the GPU when ``comm_sms`` is not given. Not measured yet (issue
#: 19, item 2): a block stores about 21 GB/s over NVLink (benchmarks/NOTES.md), so 16 blocks
#: keep a good part of one NVLink busy.
DEFAULT_COMM_SMS = 16
DEFAULT_COLLECT_SMS = 4


class AllGatherGemmPlan:
    """The planning half of :class:`~mknumba.kernels.allgather_gemm.AllGatherGemm`."""

    name = "AllGatherGemm"
    kernel_name = "allgather_gemm"

    def _plan(self, comm, m, n, k, dtype, gathered, comm_sms, collect_sms, part_rows, tile,
              group_m, trace=False):
        """Resolve every option and the role split (sets the attributes the op reads)."""
        check_bf16(self.name, dtype)
        m, n, k, group_m = positive_ints(self.name, m=m, n=n, k=k, group_m=group_m).values()
        W = comm.size
        if m % W:
            raise MkValueError(f"{self.name}: m={m} must be divisible by the world size {W} "
                               "(each rank holds m / world rows of A)")
        check_shapes(m, n, k, self.name)
        self.comm, self.m, self.n, self.k, self.world = comm, m, n, k, W
        self.shard = m // W
        self.kind, self.build = fused_tile(tile, self.name)
        self.bm, self.bn = self.build.shape
        G, nodes = comm.local_size, comm.nodes
        self.topology = f"{nodes}x{G}"
        # Parts of a shard, each with its flag: the paper's 128 rows (one tile row) inside a
        # node; between nodes, whole tile rows of about NETWORK_PART_BYTES per proxy command.
        if part_rows is None:
            part_rows = self.bm
            if nodes > 1:
                part_rows = max(self.bm, NETWORK_PART_BYTES // (2 * k) // self.bm * self.bm)
        part_rows = positive_ints(self.name, part_rows=part_rows)["part_rows"]
        self.part_rows = min(part_rows, self.shard)
        self.parts = cdiv(self.shard, self.part_rows)
        self.gathered = bool(gathered)
        self.tracing = bool(trace)
        self.tiles_m, self.tiles_n = cdiv(m, self.bm), cdiv(n, self.bn)
        self._roles(comm_sms, collect_sms, G, nodes)
        self.group_m = int(group_m or default_group_m(self.tiles_m, self.tiles_n,
                                                      self.role_blocks["compute"]))
        self.arrival = arrival_order(comm.rank, comm.local_rank, G, nodes)
        self.order = gather_order(m, self.shard, self.bm, self.tiles_n, self.arrival,
                                  self.group_m)

    def _roles(self, comm_sms, collect_sms, G, nodes):
        """The grid (one block per SM) and its roles in block order: send, forward (between
        nodes, G > 1), collect (planned with ``gathered``), compute; with ``comm_sms=
        "adaptive"`` send, forward, compute (flexible), collect (:meth:`_adaptive`)."""
        sms = None if SIMULATOR else cuda.get_current_device().MULTIPROCESSOR_COUNT
        forward = nodes > 1 and G > 1
        if isinstance(comm_sms, str) and comm_sms != "adaptive":
            raise MkValueError(f"{self.name}: comm_sms={comm_sms!r}: a number of SMs, None "
                               "(the default) or 'adaptive'")
        self.adaptive = comm_sms == "adaptive"
        if comm_sms is None or self.adaptive:
            comm_sms = (2 if forward else 1) if SIMULATOR else DEFAULT_COMM_SMS
        comm_sms = positive_ints(self.name, comm_sms=comm_sms)["comm_sms"]
        need = 2 if forward else 1
        if comm_sms < need:
            raise MkValueError(f"{self.name}: comm_sms={comm_sms} must be at least {need} for "
                               f"topology {self.topology} (send{' and forward' * forward})")
        # a block with no part of its own would idle: at most one per part
        fwd = min(self.parts, comm_sms // 2) if forward else 0
        send = min(self.parts, comm_sms - fwd)
        if self.adaptive:
            send = self._adaptive(comm_sms - fwd, send, G, nodes)
        collect = 0
        if self.gathered:
            collect = positive_ints(self.name, collect_sms=collect_sms)["collect_sms"]
            if collect is None:
                collect = 1 if SIMULATOR else DEFAULT_COLLECT_SMS
            collect = min(collect, self.world * self.parts)
        elif collect_sms is not None:
            raise MkValueError(f"{self.name}: collect_sms is for an op planned with "
                               "gathered=True")
        held = send + fwd + collect
        # the simulator runs blocks one at a time: two compute blocks are plenty
        grid = held + 2 if SIMULATOR else sms
        if held >= grid:
            raise MkValueError(f"{self.name}: {held} blocks for send, forward and collect "
                               f"leave none of the {grid} SMs to compute")
        self.role_blocks = dict(send=send, forward=fwd, collect=collect, compute=grid - held)
        self.init_comm = min(self.init_comm, grid - held - 1) if self.adaptive else 0
        self.grid = grid

    def _adaptive(self, comm, send, G, nodes):
        """comm_sms="adaptive" (``roles.controller``): the compute blocks are flexible, and
        their communication items are the parts of this rank's shard: on one node each part
        stored here, then each pushed into the node's other GPUs; between nodes only the
        pushes, the fixed send blocks storing the parts and handing them to the proxy (forward
        and collect stay fixed). Sets the items and the flexible blocks that start in the
        communication role (the static split's ``comm`` blocks); returns the fixed send
        blocks."""
        self.nstage = self.parts if nodes == 1 else 0
        self.ncomm = self.nstage + (self.parts if G > 1 else 0)
        fixed = send if nodes > 1 else 0
        self.init_comm = min(max(1, comm - fixed), self.ncomm)
        return fixed
