"""Planning the fused GEMM + reduction: options, the SM split between roles, rank agreement.

Everything here is decided once, when the op is built; a call only binds its arrays.
"""
from numba import cuda

from ..._compat import SIMULATOR
from ...arrays import check_bf16
from ...errors import MkValueError, positive_ints
from ...sched import split as sm_split
from ...sched.reduce import ReducePlan
from ...sched.tiles import cdiv, default_group_m
from ..gemm.plan import check_shapes, fused_tile

_SIM_SMS = 6              # the simulator's "device": compute, reduce, send, receive, pull


class GemmReducePlan:
    """The planning half of :class:`~mknumba.kernels.gemm_reduce.GemmReduce` (see there)."""

    allreduce = False
    name = "GemmReduce"
    kernel_name = "gemm_reduce"

    def _plan(self, comm, m, n, k, dtype, comm_sms, chunk_bytes, tile, group_m, trace, join,
              deliver, shared_out, fold):
        """Resolve every option and the role split (sets the attributes the op reads)."""
        check_bf16(self.name, dtype)
        m, n, k, group_m, chunk_bytes = positive_ints(
            self.name, m=m, n=n, k=k, group_m=group_m, chunk_bytes=chunk_bytes).values()
        check_shapes(m, n, k, self.name)
        self.comm, self.m, self.n, self.k = comm, m, n, k
        self.kind, self.build = fused_tile(tile, self.name)
        self.bm, self.bn = self.build.shape
        if n % 4:
            raise MkValueError(f"{self.name}: n={n} must be a multiple of 4")
        G, nodes = comm.local_size, comm.nodes
        self.world = comm.size
        tiles_m, tiles_n = cdiv(m, self.bm), cdiv(n, self.bn)
        sms = _SIM_SMS if SIMULATOR else cuda.get_current_device().MULTIPROCESSOR_COUNT
        self.topology = f"{nodes}x{G}"
        recorded = sm_split.choose(self.kernel_name, self.topology, m, n, k, sms)
        if isinstance(comm_sms, str) and comm_sms != "adaptive":
            raise MkValueError(f"{self.name}: comm_sms={comm_sms!r}: a number of SMs, None "
                               "(the recorded table) or 'adaptive'")
        self.adaptive = comm_sms == "adaptive"
        # adaptive: the table's split is where the controller starts (roles.controller)
        self.comm_sms = int(recorded.comm_sms if comm_sms in (None, "adaptive") else comm_sms)
        tile_bytes = self.bm * self.bn * 2
        if chunk_bytes is None:
            chunk_bytes = sm_split.default_chunk_bytes(self.topology)
        self.chunk_tiles = max(1, int(chunk_bytes) // tile_bytes)
        self.group_m = int(group_m or default_group_m(tiles_m, tiles_n, 128 if not SIMULATOR
                                                      else 2))
        self._check_adaptive(join, fold)
        self.join = self._join(join, nodes)
        self.deliver = self._deliver(deliver, nodes, G, recorded.deliver)
        self.fold = self._fold(fold, recorded.fold)
        # nothing to reduce: the one block the reduce role needs. Not in the simulator, whose
        # blocks run one at a time: there a compute block waiting on a peer's delivery can
        # hang if that comes from a later block of the peer (with its two compute blocks and
        # the tests' shapes it comes from the same block or an earlier one; else the bounded
        # wait reports it)
        if self.fold and comm_sms is None and not recorded.fold and not SIMULATOR:
            self.comm_sms = 1
        self.plan = ReducePlan(self.allreduce, m, n, self.bm, self.bn, nodes, G, comm.node,
                               comm.local_rank, self.chunk_tiles, self.group_m, self.fold)
        self.out_rows = m if self.allreduce else m // self.world
        self.tracing = bool(trace)
        # One rank: nothing to reduce, so the op is the plain persistent GEMM into ``out`` (no
        # partials to write and copy back: ~0.5 ms of a 1.3 ms call at m = n = 16384, k = 1024).
        # trace=True keeps the fused kernel, whose roles it stamps.
        self.solo = self.world == 1 and not self.tracing
        if shared_out and not self.allreduce:
            raise MkValueError(f"{self.name}: shared_out is for AllReduce (each rank's "
                               "ReduceScatter output is written by its own GPU only)")
        self.shared_out = bool(shared_out)
        # the owners write the shared output of every local GPU (sum_local's push target)
        self.direct = self.shared_out and not self.solo and G > 1 and (self.deliver or nodes > 1)
        self._roles(sms, G, nodes)

    def _roles(self, sms, G, nodes):
        """Split the held-back SMs between the communication roles (block index order)."""
        s = self.comm_sms
        need = 1 + (2 if nodes > 1 else 0) + (1 if self.allreduce and G > 1 else 0)
        if not need <= s < sms:
            raise MkValueError(f"{self.name}: comm_sms={s} must be in [{need}, {sms - 1}] "
                               f"for topology {self.topology}")
        send = 1 if nodes > 1 else 0
        p = self.plan
        pull = 0
        if self.direct:                   # nothing to copy: the pull role only waits
            pull = 1
        elif self.allreduce and G > 1 and nodes > 1:
            pull = max(1, (s - send) // 4)
        elif self.allreduce and G > 1:    # by words moved: the reduce reads G tiles and writes
            red = len(p.red_tiles) * 2 * G      # G (one here, G - 1 pushed); a pull copies one
            pulled = len(p.pull_tiles) * 2
            pull = min(s - 1, max(1, round(s * pulled / max(red + pulled, 1))))
        recv = 0
        if nodes > 1:   # reduce and receive split by words moved: G reads + 1 write per reduced
                        # tile, one read per node + 1-2 writes per finished tile
            red = len(p.red_tiles) * (G + 1)
            fin = p.n_final * (nodes + 1 + (1 if self.allreduce and G > 1 else 0))
            share = fin / (red + fin) if red + fin else 0.0    # a GPU may own no tiles
            recv = min(s - send - pull - 1, max(1, round((s - send - pull) * share)))
        reduce = s - send - recv - pull
        self.role_blocks = dict(compute=sms - s, reduce=reduce, send=send, recv=recv, pull=pull)
        # adaptive: compute and reduce blocks (and on one node the pull blocks) are flexible,
        # those counted as reduce (and pull) start in the communication role
        self.flex_pull = self.adaptive and nodes == 1 and pull > 0
        if self.flex_pull:
            self.role_blocks.update(reduce=reduce + pull, pull=0)
        self.grid = sms
        self.sms = sms

    def _check_adaptive(self, join, fold):
        """comm_sms='adaptive' moves blocks between compute and reduce between items
        (``kernels.gemm_reduce.kernel.flexible_role``): joining is what it does already, and
        folding waits inside a compute tile, which a block that may be the only one left to
        reduce must not."""
        if not self.adaptive:
            return
        for name, value in (("join", join), ("fold", fold)):
            if value:
                raise MkValueError(f"{self.name}: {name}=True does not go with "
                                   "comm_sms='adaptive'")

    def _join(self, join, nodes):
        """Whether compute blocks, once their tiles are done, join the reduce queue, and (for
        AllReduce) compute and reduce blocks then join the pull queue: on one node, where the
        tail of a call is NVLink work that every idle SM can share. Default on, on the GPU.

        A joined block waits on tiles of higher-numbered blocks, which needs the whole grid
        resident (one block per SM, as launched); the simulator runs blocks one at a time, so
        there it is off. On by default: measured faster on 1x2 (benchmarks/NOTES.md, join).
        Not with comm_sms='adaptive', whose pool does what joining does."""
        return self._option(join, nodes == 1 and not SIMULATOR and not self.adaptive, True,
                            "join=True needs one node and a GPU (not the simulator)")

    def _deliver(self, deliver, nodes, G, recorded):
        """Whether compute blocks write each tile another local GPU owns straight into that
        GPU's inbox (NVLink stores from the GEMM's epilogue), so the owner's reduce reads only
        local memory, instead of leaving it in their own memory for the owner to load over
        NVLink (a block loads over NVLink at about half the rate it stores). One node; costs (G - 1) more planes of m x n partials per slot. Default: what the
        recorded sweep chose for the nearest shape (``sched.split``: on 2xH200 it was faster
        at every 1x2 point but RS at m = 2048)."""
        return self._option(deliver, nodes == 1 and G > 1, recorded,
                            "deliver=True needs one node of several GPUs")

    def _agreement(self):
        """What every rank must plan alike (``OpLifetime._planning_starts``): the exchange
        (the flags and buffers it writes into on other GPUs follow from these), in the
        caller's terms first, and ``group_m`` (the order of the tiles, which the network's
        final lists take to be the same on every node); SM splits and joining are each
        rank's own."""
        return dict(op=self.name, m=self.m, n=self.n, dtype="bfloat16", tile=(self.bm, self.bn),
                    chunk_tiles=self.chunk_tiles, group_m=self.group_m, deliver=self.deliver,
                    fold=self.fold, shared_out=self.shared_out)

    def _fold(self, fold, recorded):
        """Whether the owner of a ReduceScatter tile adds the other local GPUs' delivered
        partials in its own GEMM epilogue and writes the sum to ``out`` (it computes its own
        row block last, ``sched.reduce``), instead of a reduce pass over three planes. Needs
        ``deliver`` (one node of several GPUs), and not comm_sms='adaptive'. Default: the
        recorded sweep's choice for the nearest shape."""
        return self._option(fold, not self.allreduce and self.deliver and not self.adaptive,
                            recorded, "fold=True needs ReduceScatter with deliver=True (one "
                                      "node of several GPUs)")

    def _option(self, value, possible, default, needs):
        """An on/off option: None takes ``default`` where ``possible`` (else off); True where
        it is not possible is an error that says what it ``needs``."""
        if value is None:
            return bool(possible and default)
        if value and not possible:
            raise MkValueError(f"{self.name}: {needs}")
        return bool(value)
