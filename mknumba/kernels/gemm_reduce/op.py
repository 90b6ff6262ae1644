"""The fused GEMM + reduction op on the host: plan once (``plan``), allocate the symmetric
buffers and flags, prepare the launch; each call checks its arrays, binds them and launches."""
import numpy as np
from numba import cuda

from ..._compat import SIMULATOR
from ...arrays import (is_torch, new_output, operand, refuse_overlap, shared_bytes, torch_ptr,
                       unshared)
from ...errors import (ERR_SET, ROLE_COMPUTE, ROLE_INTRA, ROLE_RECV, ROLE_SEND, MkError,
                       MkValueError)
from ...sched.reduce import nonempty
from ..gemm import Gemm
from ...roles.controller import CTL_WORDS
from ...timeline import (Timeline, Traced, decision_log, role_of, segments_from_log,
                         spans)
from ..gemm_inputs import LayoutLaunches, NoTensorMaps, TensorMaps, b_kn, b_mode, b_shape
from ..launch import Slot, pack, param
from ..lifetime import Frame, OpLifetime
from ..streams import outputs_in_capture, stream_handle
from .kernel import (CFG_FIELDS, CTL_LOG, Q_COMPUTE, Q_PULL, Q_REDUCE, QUEUES, TRACE_EVENTS,
                     TRACE_ROWS, build)
from .plan import GemmReducePlan


class GemmReduce(GemmReducePlan, Traced, OpLifetime):
    """Plan once, call many times (base of :class:`GemmReduceScatter` and :class:`GemmAllReduce`).

    comm: the Comm; m, n, k: the full output [m, n] and this rank's inner dimension k (= k_local);
    dtype: "bfloat16" (inputs, output; fp32 accumulation everywhere).
    comm_sms: SMs held back from the GEMM for the communication roles (default: the recorded
    sweep in ``sched.split``), or "adaptive": the compute and reduce (one node, AllReduce:
    and pull) blocks change role between items as ``roles.controller`` decides, starting
    from the recorded split (no join, no fold); chunk_bytes: network chunk size (rounded to
    whole tiles);
    tile: "auto" (on sm_90a ``roles.compute.SM90_FUSED_TILE``, else "simt") | "sm90" | "simt"
    (or another build, ``roles.compute.tile_build``);
    join: idle compute blocks help the reduce and pull roles (default: on
    one node on the GPU, see :meth:`_join`); deliver: compute blocks write tiles other local
    GPUs own straight into those GPUs' memory (one node; default per shape from the recorded
    sweep, see :meth:`_deliver`); fold (ReduceScatter, with deliver): each GPU computes its
    own tiles last and adds the delivered partials in their epilogue (:meth:`_fold`);
    shared_out (AllReduce): the op owns a symmetric [m, n] output (:meth:`output`) that each
    tile's owner writes on every local GPU, with no copy at the end (with delivery or
    between nodes; other outputs still work, through the copy); a call with ``out=None``
    returns it, valid until the next call, like an in-place all-reduce;
    trace: stamp every role's steps with the GPU clock (read them with :meth:`trace_events`
    after :meth:`synchronize`). Calls are asynchronous on the stream of the inputs (the
    current PyTorch stream for tensors, else ``stream``); :meth:`synchronize` waits and raises
    any device-side timeout. On one rank there is nothing to reduce: calls run the plain
    persistent GEMM (``mknumba.Gemm``) into ``out``, unless ``trace`` asks for the fused roles.
    """

    def __init__(self, comm, m, n, k, dtype="bfloat16", *, comm_sms=None, chunk_bytes=None,
                 tile="auto", group_m=None, trace=False, join=None, deliver=None,
                 shared_out=False, fold=None):
        self._plan_on(comm)
        with self._planning_starts() as agreed:
            self._plan(comm, m, n, k, dtype, comm_sms, chunk_bytes, tile, group_m, trace, join,
                       deliver, shared_out, fold)
            agreed.update(self._agreement())
        self._views = {}      # the shared output as the caller's array type
        # the hot path's spans: out, the shared output (where every call writes it), a, b
        self._hot_sizes = (2 * self.out_rows * self.n, 2 * self.m * self.n, 2 * self.m * self.k,
                           2 * self.k * self.n)
        self._unshared = set()        # the hot path's address sets seen apart (arrays.unshared)
        self._buffers = []
        self.err = comm.new_error_record()
        if self.solo:         # one rank: the plain GEMM into ``out`` (plan.py), no call counter
            self._solo_gemm = Gemm(tile=tile, group_m=group_m)
            self._solo_gemm.streams = self.streams    # its calls are this op's: _wait
            self.shared = (cuda.device_array(self.m * self.n // 4, np.uint64)
                           if self.shared_out else None)
            return
        self.frame = Frame(self.grid)
        self.tmaps = (TensorMaps(self.m, self.n, self.k, self.build.shape) if self.build.tma
                      else NoTensorMaps())
        self._allocate(comm.local_size, comm.nodes)

    def _allocate(self, G, nodes):
        comm, plan = self.comm, self.plan
        self.words = self.m * self.n // 4
        self.planes = G if self.deliver else 1     # own partials, then an inbox per local peer
        self.part = comm.alloc_symmetric((2 * self.planes * self.words,), np.uint64)
        self.tile_flags = comm.alloc_flags(self.planes * plan.tiles_m * plan.tiles_n)
        self.final_flags = comm.alloc_flags(plan.tiles_m * plan.tiles_n
                                            if self.allreduce else 1)
        self._buffers = [self.part, self.tile_flags, self.final_flags]
        self._epoch_flags = [self.tile_flags.local, self.final_flags.local]
        self.shared = None
        self._shared_ptr = None
        if self.shared_out:
            self.shared = comm.alloc_symmetric((self.m * self.n // 4,), np.uint64)
            self._buffers.append(self.shared)
            self._shared_ptr = _address(self.shared.local)
        tile_words = self.bm * self.bn // 4
        # Symmetric buffers must have one size on every rank: take the world's largest.
        from mpi4py import MPI
        stage_slots = comm.mpi.allreduce(plan.stage_slots, op=MPI.MAX)
        recv_slots = comm.mpi.allreduce(plan.recv_slots, op=MPI.MAX)
        n_arrive = comm.mpi.allreduce((nodes - 1) * plan.recv_chunks, op=MPI.MAX)
        n_chunks = comm.mpi.allreduce(plan.n_chunks, op=MPI.MAX)
        self.stage_slots, self.recv_slots = stage_slots, recv_slots
        wins = (0, 0, 0)
        if nodes > 1:
            if comm.proxy is None:
                raise MkError(f"{self.name}: {nodes} nodes need the proxy (mknumba.proxy), "
                              "which this Comm did not start")
            self.stage = comm.alloc_symmetric((max(1, 2 * stage_slots * tile_words),), np.uint64)
            self.recv = comm.alloc_symmetric((max(1, 2 * recv_slots * tile_words),), np.uint64)
            self.arrive = comm.alloc_flags(max(1, n_arrive))
            self.red_flags = comm.alloc_flags(max(1, stage_slots))
            self.chunk_count = comm.alloc_flags(max(1, n_chunks))
            self.chunk_ready = comm.alloc_flags(max(1, n_chunks))
            self._buffers += [self.stage, self.recv, self.arrive, self.red_flags,
                              self.chunk_count, self.chunk_ready]
            self._epoch_flags += [self.arrive.local, self.red_flags.local,
                                  self.chunk_ready.local]
            wins = (comm.proxy.register(self.stage), comm.proxy.register(self.recv),
                    comm.proxy.register(self.arrive))
            ring, head, tail = comm.proxy.device_args()
            dev = [x.local for x in (self.stage, self.recv, self.arrive, self.red_flags,
                                     self.chunk_count, self.chunk_ready)]
        else:
            z64, z32 = np.zeros(1, np.uint64), np.zeros(1, np.uint32)
            dev = ([cuda.to_device(z64), cuda.to_device(z64)]
                   + [cuda.to_device(z32) for _ in range(4)])
            ring, head, tail = (cuda.mapped_array(12, np.uint32), cuda.to_device(z32),
                                cuda.mapped_array(1, np.uint32))
        with self._planning_ends():
            rb = self.role_blocks
            reduce_end = rb["compute"] + rb["reduce"]
            send_end = reduce_end + rb["send"]
            recv_end = send_end + rb["recv"]
            cfg = dict(m=self.m, n=self.n, tiles_n=plan.tiles_n, me=comm.local_rank, g=G,
                       nodes=nodes, out_row0=0 if self.allreduce else comm.rank * self.out_rows,
                       compute=rb["compute"], reduce_end=reduce_end, send_end=send_end,
                       recv_end=recv_end, allreduce=self.allreduce, stage_slots=stage_slots,
                       recv_slots=recv_slots, nfinal=plan.n_final, recv_chunks=plan.recv_chunks,
                       chunk=plan.chunk_tiles_max, ncmds=plan.n_cmds, win_stage=wins[0],
                       win_recv=wins[1], win_arrive=wins[2], nred=len(plan.red_tiles),
                       npull=len(plan.pull_tiles), words=self.planes * self.words,  # per slot
                       trace=self.tracing, join=self.join, deliver=self.deliver,
                       direct=self.direct, fold=self.fold, adaptive=self.adaptive,
                       flex_pull=self.flex_pull, init_comm=rb["reduce"])
            # calls into the shared output need no copy at the end (out_shared)
            self._cfg = {into: cuda.to_device(pack(CFG_FIELDS, **cfg,
                                                       out_shared=into and self.direct))
                         for into in (False, True)}
            self._cfg_ptr = {into: param(c) for into, c in self._cfg.items()}
            self.queue = cuda.to_device(np.zeros(QUEUES, np.uint32))
            # the controller's measurements: they grow across calls (roles.controller)
            self.ctl = cuda.to_device(np.zeros(CTL_WORDS, np.uint64))
            items = max(self.grid, len(plan.red_tiles), plan.n_cmds, plan.n_final,
                        len(plan.pull_tiles), len(plan.order)) if self.tracing else 1
            self._trace = cuda.to_device(np.zeros((TRACE_ROWS, items), np.int64))
            tables = {name: cuda.to_device(nonempty(np.ascontiguousarray(getattr(plan, name))))
                      for name in ("order", "owner_of_row", "red_tiles", "red_slots", "red_chunks",
                                   "chunk_tiles", "cmds", "final_tiles", "final_slots",
                                   "pull_tiles")}
            net = dict(zip(("stage", "recv", "arrive", "red_flags", "chunk_count", "chunk_ready"),
                           dev), ring=ring, head=head, tail=tail)
            m, n, rows = self.m, self.n, self.out_rows
            values = dict(
                a=Slot((m, self.k)), tmaps=Slot((TensorMaps.ROW,)),
                part_c=self.part.local.view(np.uint16).reshape(2, self.planes, m, n),
                part=self.part.local, part_ptrs=self.part.ptrs,
                tile_flags=self.tile_flags.local, tile_flag_ptrs=self.tile_flags.ptrs,
                final_flags=self.final_flags.local, final_flag_ptrs=self.final_flags.ptrs,
                out=Slot((rows * n // 4,)), out_c=Slot((rows, n)),
                out_ptrs=(self.shared or self.part).ptrs,      # read only when direct
                cfg=Slot((len(CFG_FIELDS),)), **tables, **net,
                frame=self.frame.words, timeout_ns=comm.timeout_ns, err=self.err, rank=comm.rank,
                trace=self._trace, queue=self.queue, ctl=self.ctl)
            self.launches = LayoutLaunches(      # planned for b [k, n], as in a @ b
                lambda kind: build(kind, self.adaptive), self.kind, values, "b",
                {False: (n, self.k), True: (self.k, n)}, self.grid, True, self.name)

    # -- calls ------------------------------------------------------------------------------------
    def out_shape(self):
        return (self.out_rows, self.n)

    def output(self, torch=False):
        """The shared output (``shared_out=True``): [m, n] bf16 on this GPU, as a PyTorch
        tensor (``torch=True``) or a numba array of bf16 bits (uint16), no copy. Read it
        before the next call (in stream order, as that call's kernel only starts after earlier
        work on the stream), and not after :meth:`free`. With delivery or between nodes
        (``op.direct``) the owners write it directly, on every call whatever its ``out``: so
        no array of a call may lie in it (a copy may; such a call is refused). Else it is an
        ordinary output, filled by the copy at the end of a call into it."""
        if not self.shared_out:
            raise MkValueError(f"{self.name}: planned without shared_out=True")
        self._check_live()      # not after free() or the Comm's finalize: its memory is gone
        kind = "torch" if torch else "numba"
        if kind not in self._views:
            mem = self.shared if self.solo else self.shared.local
            view = mem.view(np.uint16).reshape(self.out_shape())
            if torch:
                import torch as _torch
                view = _torch.as_tensor(mem.view(np.int16).reshape(self.out_shape()),
                                        device=f"cuda:{self.comm.device_id}")
                view = view.view(_torch.bfloat16)
            self._views[kind] = view
        return self._views[kind]

    def __call__(self, a, b, out=None, stream=None):
        """a: [m, k] bf16, b: [k, n] bf16 (row-major, or a column-major view such as ``w.T``
        of a row-major [n, k] ``w``: no copy) -> out [m / world, n] (ReduceScatter) or [m, n]
        (AllReduce), bf16. PyTorch tensors in -> tensor out (on the current PyTorch stream);
        numba/CuPy arrays in (bf16 as ml_dtypes.bfloat16 or bits as uint16/int16) -> numba
        array of bf16 bits out (on ``stream``). ``out=None``: a new array, or with
        ``shared_out`` the shared output (:meth:`output`). b is read as it is at the call, in
        either layout (no copy; the first call with a w.T view compiles its kernel)."""
        if (stream is None and self.solo and not self.freed
                and self._solo_gemm._hot_call(a, b, "kn", out)):
            return out    # one rank: the GEMM's hot path (its plans are this op's shape)
        if (out is not None and stream is None and not self.solo and not self.freed
                and self.comm.proxy is None and is_torch(a)):     # the hot path: tensors
            dev, (m, n, k) = self.comm.device_id, (self.m, self.n, self.k)
            pa = torch_ptr(a, (m, k), dev)
            pb = pa and torch_ptr(b, (k, n), dev, (1, k))          # w.T: no copy
            mode = "view"
            if pa and not pb:
                pb, mode = torch_ptr(b, (k, n), dev), "kn"
            pc = pb and torch_ptr(out, (self.out_rows, n), dev)
            ps = self._shared_ptr if self.direct and pc != self._shared_ptr else None
            if (pc and unshared(self._unshared, (pc, ps, pa, pb), self._hot_sizes, 2)
                    and not self.err[ERR_SET]):
                self._run(pa, pb, mode, pc, pc, pc == self._shared_ptr,
                          stream_handle(None, dev))
                return out
        return self._checked_call(self._call, a, b, out, stream)

    def _check_error(self, what):
        """:meth:`OpLifetime._check_error`, and on one rank the plain GEMM's records too (a
        split-K fold that timed out)."""
        super()._check_error(what)
        if self.solo:
            self._solo_gemm._raise_if_timed_out(what)

    def _call(self, a, b, out, stream):
        """A call with every check."""
        dev = self.comm.device_id
        A = operand(a, self.name, "a", shape=(self.m, self.k), device_id=dev)
        B = operand(b, self.name, "b", shape=(self.k, self.n), layouts=("row", "col"),
                    device_id=dev)
        if A.torch != B.torch:
            raise MkValueError(f"{self.name}: a and b must both be PyTorch tensors or both be "
                               "device arrays")
        st = stream_handle(stream, dev if A.torch else None)
        if not self.shared_out:       # the shared output is the op's own: nothing to allocate
            outputs_in_capture(self.name, st, out=out)
        if out is None:
            out = self.output(torch=A.torch) if self.shared_out else \
                new_output(a, A.torch, self.out_shape())
        O = operand(out, self.name, "out", shape=self.out_shape(), device_id=dev)
        if O.torch != A.torch:
            raise MkValueError(f"{self.name}: out must be a PyTorch tensor exactly when the "
                               "inputs are")
        refuse_overlap(self.name, (O,), (A, B))
        self._refuse_shared(O, A, B)
        if self.solo:
            return self._solo_gemm(a, b, out=out, stream=stream)
        m, n, k, rows = self.m, self.n, self.k, self.out_rows
        mode = b_mode(B, "kn", n, k, self.name)
        self._run(A.as_param(np.uint16, (m, k)), B.as_param(np.uint16, b_shape(mode, n, k)),
                  mode,
                  O.as_param(np.uint64, (rows * n // 4,)), O.as_param(np.uint16, (rows, n)),
                  O.ptr == self._shared_ptr, st)
        return out

    def _refuse_shared(self, out, *inputs):
        """MkValueError if an array of the call shares memory with the shared output while
        the call writes it elsewhere: with ``direct`` the owners write every local GPU's shared
        output on every call, whatever its ``out``, so an input there (the last call's result,
        fed to the next layer) would be overwritten while the call reads it."""
        if not self.direct or out.ptr == self._shared_ptr:
            return      # written only where out says (refuse_overlap covers it)
        shared = (self._shared_ptr, 2 * self.m * self.n)
        hit = shared_bytes([shared], [(x.ptr, x.nbytes) for x in (*inputs, out)])
        if hit is not None:
            name = (*inputs, out)[hit[1]].name
            raise MkValueError(
                f"{self.name}: {name} shares memory with the shared output (op.output()), which "
                f"every call writes on every GPU of the node (shared_out with "
                f"{'delivery' if self.deliver else 'several nodes'}), also when out is another "
                f"array; give {name} memory of its own (e.g. a copy of the last result)")

    def _run(self, a, b, mode, out_words, out_c, into_shared, stream):
        """Bind the parameters (``Operand.as_param``: addresses on the GPU) and launch the
        kernel for B's layout (``gemm_inputs.b_mode``): B as it is, its tensor maps, and the
        cfg for calls into the shared output or not."""
        kn = b_kn(mode)
        with self.launches.lock:          # one call at a time binds and launches
            L = self.launches(kn, stream)
            self.streams.enter(stream)
            # cfg: the owners write every GPU's shared output (direct, planned); a call into
            # another array copies it out of this GPU's shared output at the end
            L.binder("a", "b", "tmaps", "out", "out_c", "cfg")(
                stream, a, b, self.tmaps(a, b, stream, kn), out_words, out_c,
                self._cfg_ptr[self.direct and into_shared])

    def trace_events(self):
        """The last traced call's stamps: {event: int64 ns array by item (0: not reached)} plus
        ``role_blocks``. Block events index blocks (in role order: compute, reduce, send,
        receive, pull); the others index each role's items (reduced tiles, send commands,
        finished tiles, pulled tiles). Call after :meth:`synchronize`."""
        stamps, rows = self._stamps(TRACE_EVENTS)
        log = decision_log(rows, TRACE_EVENTS, self.grid, CTL_LOG) if self.adaptive else []
        return dict(stamps, role_blocks=dict(self.role_blocks), controller=log)

    def timeline(self):
        """The last traced call as a :class:`mknumba.timeline.Timeline` (this rank): an item
        per tile computed, tile reduced, chunk sent, tile finished from the
        network, tile pulled; each block's role over time (the static layout by block index,
        joined compute blocks counted as reduce from their last tile on; adaptive: the
        controller's log, its communication role named ``reduce``). After
        :meth:`synchronize`."""
        ev = self.trace_events()
        p, rb = self.plan, self.role_blocks
        net = self.comm.nodes > 1
        span = lambda *a: spans(ev, *a)    # noqa: E731
        order = p.order
        n_compute = rb["compute"]
        items = dict(
            compute=span("tile_start", "tile_done", len(order), lambda i: order[i],
                         (lambda i: ev["tile_block"][i]) if self.adaptive
                         else (lambda i: i % n_compute)),
            reduce=span("reduce_ready", "reduce_done", len(p.red_tiles),
                        lambda i: p.red_tiles[i]),
            send=span("send_ready", "send_enqueued", p.n_cmds if net else 0,
                      lambda i: p.cmds[i, 0]),
            recv=span("recv_arrived", "recv_done", p.n_final if net else 0,
                      lambda i: p.final_tiles[i]),
            pull=span("pull_ready", "pull_done", len(p.pull_tiles),
                      lambda i: p.pull_tiles[i]))
        start, end = ev["block_start"], ev["block_end"]
        layout = [(role, rb[role]) for role in ("compute", "reduce", "send", "recv", "pull")]
        segments, decisions = [], []
        for b in range(self.grid):
            if start[b] <= 0 or end[b] <= 0:
                continue
            if self.adaptive and b < n_compute + rb["reduce"]:
                log = ev["controller"][b]
                segs = segments_from_log(start[b], end[b], log, ("compute", "reduce"))
                decisions += [(t, b, role, want) for t, role, want in log]
            elif b < n_compute:
                mid = ev["compute_end"][b] if self.join else end[b]
                segs = [("compute", int(start[b]), int(mid))] + (
                    [("reduce", int(mid), int(end[b]))] if self.join else [])
            else:
                segs = [(role_of(b, layout), int(start[b]), int(end[b]))]
            segments += [(b, role, t0, t1) for role, t0, t1 in segs]
        meta = dict(op=self.name, m=self.m, n=self.n, k=self.k, topology=self.topology,
                    comm_sms=self.comm_sms, adaptive=self.adaptive, role_blocks=dict(rb),
                    tiles=len(order), controller_log_dropped=sum(
                        max(0, int(ev["ctl_n"][b]) - CTL_LOG) for b in range(self.grid))
                    if self.adaptive else 0)
        return Timeline(self.comm.rank, items, segments, decisions, meta)

    def _flag_name(self, role, index, array=0):
        """What each wait watches (``kernel``'s role codes): the intra-node role, local GPU
        j's partial of a tile (array 1 + j; delivered partials: index plane * tiles + tile)
        or a tile's final sum from its owner (array 0, pull); the compute role (fold), the
        partial a local GPU delivered into plane j (index j * tiles + tile); the receive role,
        a rail peer's chunk (array 0, index source * chunks + chunk) or this GPU's own sum of
        the node's partials (array 1, a stage slot); the send role, a chunk this GPU's reduce
        role stages."""
        p, t = self.plan, self.comm.topology
        tiles = p.tiles_m * p.tiles_n
        if role == ROLE_INTRA and 1 <= array <= len(t.node_ranks):
            return (f"rank {t.node_ranks[array - 1]}'s partial of "
                    + self._tile_name(index % tiles))
        if role == ROLE_INTRA and array == 0 and index < tiles:
            owner = t.node_ranks[p.owner_of_row[index // p.tiles_n]]
            return f"rank {owner}'s final sum of {self._tile_name(index)}, a tile it owns"
        if role == ROLE_COMPUTE and index < len(t.node_ranks) * tiles:
            j, tile = divmod(index, tiles)
            src = t.node_ranks[(t.local_rank + j) % len(t.node_ranks)]
            return f"rank {src}'s partial of {self._tile_name(tile)}, delivered here"
        if role == ROLE_RECV and array == 0 and p.recv_chunks:
            s, c = divmod(index, p.recv_chunks)
            if s < len(t.rail_peers):
                return (f"rank {t.rail_peers[s]}'s sum of chunk {c} of the tiles this rank "
                        "finishes, through the proxy")
        if role == ROLE_RECV and array == 1:
            at = np.flatnonzero(p.final_slots == index)
            if len(at):
                return ("this GPU's sum of its node's partials of "
                        + self._tile_name(int(p.final_tiles[at[0]])))
        if role == ROLE_SEND and array == 0 and index < p.n_chunks:
            return f"chunk {index} of the tiles this GPU sends, staged by its reduce role"
        return None

    def _tile_name(self, tile):
        """Output tile ``tile`` in the caller's terms: its rows and columns of the product."""
        r0, c0 = divmod(tile, self.plan.tiles_n)
        r0, c0 = r0 * self.bm, c0 * self.bn
        return (f"tile {tile} at rows {r0}..{min(r0 + self.bm, self.m) - 1}, columns "
                f"{c0}..{min(c0 + self.bn, self.n) - 1}")

    def free(self):
        """Collective: release the op's symmetric buffers (waits for this rank's calls)."""
        OpLifetime.free(self)
        self._views.clear()
        self.shared = None

    def _counters(self):
        """The work queues' (each call draws its items plus one ticket per
        worker: ``roles.blocks.take``) and between nodes the chunk counters' tickets."""
        rb, p = self.role_blocks, self.plan
        reduce_end = rb["compute"] + rb["reduce"]
        recv_end = reduce_end + rb["send"] + rb["recv"]
        red_workers = reduce_end - (0 if self.join or self.adaptive else rb["compute"])
        pull_workers = (reduce_end if self.flex_pull else
                        self.grid - recv_end + (reduce_end if self.join else 0))
        per_call = np.zeros(QUEUES, np.uint64)
        per_call[Q_REDUCE] = len(p.red_tiles) + red_workers
        per_call[Q_PULL] = len(p.pull_tiles) + pull_workers
        per_call[Q_COMPUTE] = len(p.order) + reduce_end          # adaptive: flexible blocks
        return [(self.queue, per_call)] + (
            [(self.chunk_count.local, p.chunk_tiles)] if self.comm.nodes > 1 else [])


def _address(arr):
    """Device address of a numba (or simulator) array's first element."""
    if SIMULATOR:
        return arr._ary.__array_interface__["data"][0]
    return arr.__cuda_array_interface__["data"][0]
