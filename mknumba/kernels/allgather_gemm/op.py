"""AllGather + GEMM on the host: plan once (``plan``), allocate the symmetric gathered A and its
flags, prepare the launch; each call checks its arrays, binds them and launches."""
import numpy as np
from numba import cuda

from ..._compat import SIMULATOR
from ...arrays import (dtype_name, is_torch, new_output, operand, refuse_overlap, torch_ptr,
                       unshared)
from ...errors import ERR_SET, ROLE_COMPUTE, ROLE_INTRA, ROLE_RECV, MkError, MkValueError
from ..gemm_inputs import (LayoutLaunches, NoTensorMaps, SlotMaps, TensorMaps, b_kn, b_mode,
                           b_shape)
from ...roles.controller import CTL_LOG, CTL_WORDS
from ...timeline import Timeline, Traced, decision_log, role_of, segments_from_log, spans
from ..launch import Slot, pack, param
from ..lifetime import Frame, OpLifetime
from ..streams import outputs_in_capture, stream_handle
from .kernel import CFG_FIELDS, Q_COMM, Q_COMPUTE, QUEUES, TRACE_EVENTS, TRACE_ROWS, build
from .plan import AllGatherGemmPlan

#: the roles in block order (``plan._roles``), static and adaptive
ROLE_ORDER = {False: ("send", "forward", "collect", "compute"),
              True: ("send", "forward", "compute", "collect")}


class AllGatherGemm(AllGatherGemmPlan, Traced, OpLifetime):
    """``out = AllGather(a) @ b`` in one persistent launch (a column-parallel linear layer).

    comm: the :class:`mknumba.Comm`; m: rows of the gathered A (every rank holds ``m / world``
    of them, world rank r rows ``[r * m / world, (r + 1) * m / world)``); n: columns of this
    rank's b and of out; k: the inner dimension. n and k multiples of 8. Every rank must pass
    the same m, n, k (checked).

    gathered: plan the collect role, so that calls can also write the gathered A into an
    array of the caller's (``op(a, b, gathered=buf)``; backward passes need it); costs
    ``collect_sms`` SMs (default 4; 1 in the simulator). comm_sms: SMs of the send and
    forward roles (default 16, not measured yet), or "adaptive": the compute blocks also
    move this rank's shard inside the node (store each part here on one node, push it to
    the node's other GPUs), each next item's kind decided by ``roles.controller``, a block
    whose next tile's rows have not arrived moving a part meanwhile (between nodes the send
    blocks stay fixed: they hand the parts to the proxy; forward and collect stay fixed);
    part_rows: rows of a shard behind one flag
    (default: one tile row, 128 on Hopper; between nodes whole tile rows of about 1 MiB, one
    proxy command each); tile: "auto" (on sm_90a ``roles.compute.SM90_FUSED_TILE``, else
    "simt") | "sm90" | "simt" | another build (``roles.compute.tile_build``); group_m: tile
    rows per band of the tile order; trace: stamp every role's steps with the GPU clock (a
    part of this rank's shard stored here and pushed to the node's GPUs, a part forwarded, a
    part collected, a tile computed): :meth:`trace_events`, :meth:`timeline` and
    :meth:`save_trace` read the last call after :meth:`synchronize` (off: one branch per
    stamp).

    Calls are asynchronous on the stream of the inputs (the current PyTorch stream for
    tensors, else ``stream``); :meth:`synchronize` waits and raises any device-side timeout.
    A call inside a CUDA graph capture works as any other (the epoch lives on the GPU) when it
    passes ``out=`` and b is row-major [k, n] or a layout met in an ordinary call before (else
    it is refused: it would allocate, or compile that layout's kernel).
    """

    def __init__(self, comm, m, n, k, dtype="bfloat16", *, gathered=False, comm_sms=None,
                 collect_sms=None, part_rows=None, tile="auto", group_m=None, trace=False):
        self._plan_on(comm)
        with self._planning_starts() as agreed:
            # every rank must ask for the same exchange (the buffers, flags and offsets it
            # writes into on other GPUs follow from these), in the caller's terms; the SM
            # split and ``gathered`` are each rank's own
            agreed.update(op=self.name, m=m, n=n, k=k, dtype=dtype_name(dtype),
                          tile=tile, part_rows=part_rows)
            self._plan(comm, m, n, k, dtype, gathered, comm_sms, collect_sms, part_rows, tile,
                       group_m, trace)
        self._hot_sizes = (2 * self.m * self.n, 2 * self.shard * self.k, 2 * self.k * self.n)
        self._unshared = set()        # the hot path's address sets seen apart (arrays.unshared)
        self._collected = False
        self._buffers = []
        self.err = comm.new_error_record()
        self.frame = Frame(self.grid)
        self._allocate(comm)

    def _allocate(self, comm):
        m, n, k, W, P = self.m, self.n, self.k, self.world, self.parts
        # the gathered A, one [m, k] slot per call parity (see the package docstring)
        self.gathered_buf = comm.alloc_symmetric((2 * m * k // 4,), np.uint64)
        self.flags = comm.alloc_flags(W * P)
        self._buffers = [self.gathered_buf, self.flags]
        self.tile_flags = cuda.to_device(np.zeros(self.tiles_m * self.tiles_n, np.uint32))
        self._epoch_flags = [self.flags.local, self.tile_flags]
        base = _address(self.gathered_buf.local)         # the slots' tensor maps
        self.tmaps = (SlotMaps((base, base + m * k * 2), m, n, k, self.build.shape)
                      if self.build.tma else NoTensorMaps())
        z32 = np.zeros(1, np.uint32)
        wins = (0, 0)
        if comm.nodes > 1:
            if comm.proxy is None:
                raise MkError(f"{self.name}: {comm.nodes} nodes need the proxy "
                              "(mknumba.proxy), which this Comm did not start")
            wins = (comm.proxy.register(self.gathered_buf), comm.proxy.register(self.flags))
            ring, head, tail = comm.proxy.device_args()
            rail = cuda.to_device(np.array(comm.rail_peers, np.int32))
        else:
            ring, head, tail = (cuda.mapped_array(12, np.uint32), cuda.to_device(z32),
                                cuda.mapped_array(1, np.uint32))
            rail = cuda.to_device(np.zeros(1, np.int32))
        with self._planning_ends():
            rb, ad = self.role_blocks, self.adaptive
            start = self.role_starts()
            cfg = dict(m=m, n=n, k=k, shard=self.shard, rows=self.part_rows, parts=P,
                       me=comm.rank, local=comm.local_rank, g=comm.local_size, nodes=comm.nodes,
                       world=W, tiles_n=self.tiles_n, send_end=start["forward"],
                       forward_end=start["forward"] + rb["forward"],
                       compute_start=start["compute"],
                       compute_end=start["compute"] + rb["compute"],
                       collect_start=start["collect"],
                       collect_end=start["collect"] + rb["collect"], win_gathered=wins[0],
                       win_flags=wins[1], trace=self.tracing,
                       nstage=self.nstage if ad else 0, ncomm=self.ncomm if ad else 0,
                       init_comm=self.init_comm)
            # a call that fills the caller's gathered A (collect) or not
            self._cfg = {c: cuda.to_device(pack(CFG_FIELDS, **cfg, collect=c)) for c in (0, 1)}
            self._cfg_ptr = {c: param(x) for c, x in self._cfg.items()}
            self._no_gathered = cuda.to_device(np.zeros(1, np.uint64))    # never read
            self._no_gathered_ptr = param(self._no_gathered)   # bound by every call that has none
            items = max(self.grid, P * max(1, len(comm.rail_peers) if comm.nodes > 1 else 1),
                        W * P, len(self.order)) if self.tracing else 1
            self._trace = cuda.to_device(np.zeros((TRACE_ROWS, items), np.int64))
            # the adaptive split's work queues and the controller's measurements (they grow across
            # calls: roles.controller; the static build never reads them)
            self.queue = cuda.to_device(np.zeros(QUEUES, np.uint32))
            self.ctl = cuda.to_device(np.zeros(CTL_WORDS, np.uint64))
            local = self.gathered_buf.local
            values = dict(
                a=Slot((self.shard * k // 4,)), tmaps=Slot((TensorMaps.ROW,)),
                tmaps_odd=Slot((TensorMaps.ROW,)),
                gathered=local.view(np.uint16).reshape(2, m, k), gathered_words=local,
                gathered_ptrs=self.gathered_buf.ptrs, flags=self.flags.local,
                flag_ptrs=self.flags.ptrs, out=Slot((m, n)), gathered_out=Slot((m * k // 4,)),
                tile_flags=self.tile_flags, cfg=Slot((len(CFG_FIELDS),)),
                order=cuda.to_device(self.order), shards=cuda.to_device(self.arrival), rail=rail,
                ring=ring, head=head, tail=tail, frame=self.frame.words,
                timeout_ns=comm.timeout_ns, err=self.err, rank=comm.rank, trace=self._trace,
                queue=self.queue, ctl=self.ctl)
            self.launches = LayoutLaunches(    # planned for b [k, n]
                lambda kind: build(kind, ad), self.kind, values, "b",
                {False: (n, k), True: (k, n)}, self.grid, True, self.name)

    # -- calls ------------------------------------------------------------------------------------
    def out_shape(self):
        return (self.m, self.n)

    def __call__(self, a, b, out=None, gathered=None, stream=None):
        """a: this rank's rows of A, [m / world, k] bf16; b: [k, n] bf16 (row-major, or a
        column-major view such as ``w.T`` of a row-major [n, k] ``w``: no copy) -> out
        [m, n] bf16 = AllGather(a) @ b, A's rows in world rank order. gathered: an [m, k]
        bf16 array (row-major) that also receives the gathered A (needs ``gathered=True`` at
        planning). PyTorch tensors in -> tensor out (on the current PyTorch stream);
        numba/CuPy arrays in (bf16 as ml_dtypes.bfloat16 or bits as uint16/int16) -> numba
        array of bf16 bits out (on ``stream``). b is read as it is at the call, in either
        layout (no copy; the first call with a w.T view compiles its kernel)."""
        if (out is not None and gathered is None and stream is None and not self.freed
                and self.comm.proxy is None and is_torch(a)):     # the hot path: tensors
            dev, (m, n, k) = self.comm.device_id, (self.m, self.n, self.k)
            pa = torch_ptr(a, (self.shard, k), dev)
            pb = pa and torch_ptr(b, (k, n), dev, (1, k))          # w.T: no copy
            mode = "view"
            if pa and not pb:
                pb, mode = torch_ptr(b, (k, n), dev), "kn"
            pc = pb and torch_ptr(out, (m, n), dev)
            if (pc and unshared(self._unshared, (pc, pa, pb), self._hot_sizes, 1)
                    and not self.err[ERR_SET]):
                self._run(pa, pb, mode, pc, None, stream_handle(None, dev))
                return out
        return self._checked_call(self._call, a, b, out, gathered, stream)

    def _call(self, a, b, out, gathered, stream):
        """A call with every check."""
        dev = self.comm.device_id
        m, n, k = self.m, self.n, self.k
        A = operand(a, self.name, "a", shape=(self.shard, k), device_id=dev)
        B = operand(b, self.name, "b", shape=(k, n), layouts=("row", "col"), device_id=dev)
        if A.torch != B.torch:
            raise MkValueError(f"{self.name}: a and b must both be PyTorch tensors or both be "
                               "device arrays")
        st = stream_handle(stream, dev if A.torch else None)
        outputs_in_capture(self.name, st, out=out)
        if out is None:
            out = new_output(a, A.torch, (m, n))
        O = operand(out, self.name, "out", shape=(m, n), device_id=dev)
        if O.torch != A.torch:
            raise MkValueError(f"{self.name}: out must be a PyTorch tensor exactly when the "
                               "inputs are")
        g = Gd = None
        if gathered is not None:
            if not self.gathered:
                raise MkValueError(f"{self.name}: gathered= needs the op planned with "
                                   "gathered=True (it holds SMs back to copy A out)")
            Gd = operand(gathered, self.name, "gathered", shape=(m, k), device_id=dev)
            if Gd.torch != A.torch:
                raise MkValueError(f"{self.name}: gathered must be a PyTorch tensor exactly "
                                   "when the inputs are")
            g = Gd.as_param(np.uint64, (m * k // 4,))
        refuse_overlap(self.name, (O, Gd), (A, B))
        mode = b_mode(B, "kn", n, k, self.name)
        self._run(A.as_param(np.uint64, (self.shard * k // 4,)),
                  B.as_param(np.uint16, b_shape(mode, n, k)), mode,
                  O.as_param(np.uint16, (m, n)), g, st)
        return out

    def _run(self, a, b, mode, out, gathered, stream):
        """Bind the parameters (``Operand.as_param``: addresses on the GPU) and launch the
        kernel for B's layout (``gemm_inputs.b_mode``): B as it is, the tensor maps of each
        slot of the gathered A with it, and the cfg that collects the gathered A or not."""
        kn = b_kn(mode)
        with self.launches.lock:          # one call at a time binds and launches
            L = self.launches(kn, stream)
            self.streams.enter(stream)
            collect = gathered is not None
            self._collected = collect     # the trace's collect stamps are this call's
            L.binder("a", "b", "tmaps", "tmaps_odd", "out", "gathered_out", "cfg")(
                stream, a, b, *self.tmaps.pair(b, stream, kn), out,
                gathered if collect else self._no_gathered_ptr, self._cfg_ptr[int(collect)])

    # -- traces -----------------------------------------------------------------------------------
    def trace_events(self):
        """The last traced call's stamps (after :meth:`synchronize`): {event: int64 ns array by
        item (0: not reached)} plus ``role_blocks``. ``block_*`` index blocks (in role order:
        send, forward, collect, compute); ``send_*`` and ``push_*`` the parts of this rank's
        shard (stored here and handed to the proxy; stored into the node's other GPUs);
        ``forward_*`` rail peer i's part p at i * parts + p; ``collect_*`` the collect items
        (shard in arrival order, then part); ``tile_*`` positions in the tile order.
        Adaptive (send, forward, compute, collect in block order): ``tile_block``,
        ``send_block`` (one node) and ``push_block``: the block that did the item, and
        ``controller``: per block its decisions [(ns, role, target)] (role 0 compute, 1 the
        parts: ``roles.controller``)."""
        stamps, rows = self._stamps(TRACE_EVENTS)
        log = decision_log(rows, TRACE_EVENTS, self.grid, CTL_LOG) if self.adaptive else []
        return dict(stamps, role_blocks=dict(self.role_blocks), controller=log)

    def timeline(self):
        """The last traced call as a :class:`mknumba.timeline.Timeline` (this rank): per part
        of this rank's shard a ``send`` item (stored here, between nodes handed to the proxy)
        and, with other GPUs in the node, a ``push`` item on the send tracks (stored into
        them); a ``forward`` item per rail peer's part, a ``collect`` item per part of the
        gathered A when the call filled one (items name the part by its flag, ``shard *
        parts + part``); a ``compute`` item per tile; each block's role from its start to its
        end stamp (adaptive: a flexible block's from the controller's log, its communication
        role named ``send``). After :meth:`synchronize`."""
        ev = self.trace_events()
        rb, P, comm, ad = self.role_blocks, self.parts, self.comm, self.adaptive
        me, order, n_send = comm.rank, self.order, rb["send"]
        rail = list(comm.rail_peers) if comm.nodes > 1 else []
        layout = [(role, rb[role]) for role in ROLE_ORDER[ad]]
        first = self.role_starts()

        def block(row, role, step):   # the block of item i: recorded (adaptive) or striding
            if ad and role == "compute":
                return lambda i: ev[row][i]
            return lambda i: first[role] + i % max(1, rb[role] if step is None else step)
        send_role = "send" if n_send else "compute"       # adaptive, one node: the pool
        items = dict(
            send=spans(ev, "send_start", "send_staged", P, lambda p: me * P + p,
                       block("send_block", send_role, None)) + (
                spans(ev, "push_start", "push_done", P, lambda p: me * P + p,
                      block("push_block", "compute" if ad else "send", None), "push")
                if comm.local_size > 1 else []),
            forward=spans(ev, "forward_ready", "forward_done",
                          len(rail) * P if rb["forward"] else 0,
                          lambda i: rail[i // P] * P + i % P,
                          lambda i: first["forward"] + i % P % max(1, rb["forward"])),
            collect=spans(ev, "collect_ready", "collect_done",
                          self.world * P if self._collected else 0,
                          lambda i: self.arrival[i // P] * P + i % P,
                          block(None, "collect", None)),
            compute=spans(ev, "tile_start", "tile_done", len(order), lambda i: order[i],
                          block("tile_block", "compute", None)))
        start, end = ev["block_start"], ev["block_end"]
        segments, decisions = [], []
        for b in range(self.grid):
            if start[b] <= 0 or end[b] <= 0:
                continue
            role = role_of(b, layout)
            if ad and role == "compute":
                log = ev["controller"][b]
                segments += [(b, r, t0, t1) for r, t0, t1 in
                             segments_from_log(start[b], end[b], log, ("compute", "send"))]
                decisions += [(t, b, r, want) for t, r, want in log]
            else:
                segments.append((b, role, int(start[b]), int(end[b])))
        meta = dict(op=self.name, m=self.m, n=self.n, k=self.k, topology=self.topology,
                    parts=P, part_rows=self.part_rows, role_blocks=dict(rb),
                    tiles=len(order), adaptive=ad,
                    controller_log_dropped=sum(max(0, int(ev["ctl_n"][b]) - CTL_LOG)
                                               for b in range(self.grid)) if ad else 0)
        return Timeline(comm.rank, items, segments, decisions, meta)

    def role_starts(self):
        """{role: its first block}, the roles in this build's block order (``ROLE_ORDER``)."""
        starts, at = {}, 0
        for role in ROLE_ORDER[self.adaptive]:
            starts[role], at = at, at + self.role_blocks[role]
        return starts

    def _counters(self):
        """With the adaptive split, the work queues' tickets (each call draws
        every item plus one ticket per flexible block: ``kernel``)."""
        if not self.adaptive:
            return []
        flex = self.role_blocks["compute"]
        per_call = np.zeros(QUEUES, np.uint64)
        per_call[Q_COMPUTE], per_call[Q_COMM] = len(self.order) + flex, self.ncomm + flex
        return [(self.queue, per_call)]

    def _flag_name(self, role, index, array=0):
        """Every wait but the proxy's ring credit (send) watches flags[src * parts + p]: part
        p of world rank src's rows of A has arrived (here, or at the forwarder)."""
        src, p = divmod(index, self.parts)
        if role in (ROLE_COMPUTE, ROLE_RECV, ROLE_INTRA) and src < self.world:
            return f"rank {src}'s part {p} of its rows of a"
        return None


def _address(arr):
    """Device address of a numba array's first element (None in the simulator: no tensor
    maps there)."""
    return None if SIMULATOR else arr.__cuda_array_interface__["data"][0]
