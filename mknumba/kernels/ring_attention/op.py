"""Ring Attention on the host: plan once (validate, agree across ranks, allocate the slots and
flags, the tensor maps, prepare the launch); each call checks its arrays, binds and launches."""
import math
import sys

import numpy as np
from numba import cuda

from ..._compat import SIMULATOR
from ...arrays import is_torch, new_output, operand, refuse_overlap, torch_ptr, unshared
from ...errors import (ERR_SET, ERR_WORDS, ROLE_COMPUTE, ROLE_RECV, MkError, MkValueError,
                       positive_ints)
from ...roles.attention import (HEAD_DIM_MAX, SM90_BUILDS, SM90_HEAD_DIMS, SM90_ROWS,
                                SM90_SMEM_BYTES, SM90_THREADS)
from ...sched.sequence import check_layout, runs
from ...sched.tiles import arrival_order
from ..launch import Launch, Slot, compile_kernel, pack, param
from ..lifetime import Frame, OpLifetime
from ..streams import is_capturing, outputs_in_capture, stream_handle
from ...roles.controller import CTL_LOG, CTL_WORDS, Q_COMM, Q_COMPUTE, QUEUES
from ...timeline import Timeline, Traced, decision_log, role_of, segments_from_log, spans
from ..tensor_maps import MAP_WORDS, MapTable, tensor_map
from .kernel import CFG_FIELDS, TRACE_EVENTS, TRACE_ROWS, make_kernel

class RingAttention(Traced, OpLifetime):
    """Plan once, call many times: attention over a sequence split across the ranks of a node.

    comm: the :class:`mknumba.Comm` (None: one GPU, see :func:`attention`); the ring is
    its world, node by node (rank order is sequence order, ``layout``); batch, seq_local
    (this rank's rows), heads, kv_heads (grouped-query attention: heads % kv_heads == 0),
    head_dim (a multiple of 8, at most 128); causal; layout: how the global sequence is split
    ("contiguous" or "zigzag", ``sched.sequence``; shard and unshard with
    ``mknumba.sched.sequence.shard``/``unshard``); scale (default 1/sqrt(head_dim)); tile:
    "auto" (the sm_90a tile where it applies: a Hopper GPU, head_dim 64 or 128), "sm90" or
    "simt"; threads (the SIMT twin's rows per block), send_blocks and compute_blocks (blocks
    per role) are tuning knobs. comm_sms: None (the static split: send_blocks blocks push
    this rank's slice, the rest compute) or "adaptive": the compute blocks also push the
    parts of this rank's slice to the node's other GPUs, each next item (a query tile or a
    part) picked by ``roles.controller`` between query tiles, a block whose next tile's
    slices have not all arrived pushing a part meanwhile (between nodes the send blocks stay
    fixed: they hand the slice to the proxy; forward stays fixed). trace (with "adaptive"):
    stamp each block, part and query tile and log the controller's decisions:
    :meth:`trace_events`, :meth:`timeline` and :meth:`save_trace` read the last call after
    :meth:`synchronize`.
    Every rank must pass the same values (checked). Calls are asynchronous on the stream of
    the inputs; :meth:`synchronize` waits and raises any device-side timeout. A call inside a
    CUDA graph capture works as any other (the epoch lives on the GPU; a tensor map row first
    written there is written again by the next ordinary call) when it passes ``out=`` and
    ``lse=`` (a call that would allocate is refused there).
    """

    name = "RingAttention"

    def __init__(self, comm, batch, seq_local, heads, kv_heads, head_dim, *, causal=False,
                 layout="contiguous", scale=None, tile="auto", send_blocks=None, threads=None,
                 compute_blocks=None, comm_sms=None, trace=False):
        if comm is None:
            self.name = "mknumba.attention"     # what one-GPU callers called
        self._plan_on(comm, one_gpu=True)
        with self._planning_starts() as agreed:     # what every rank must plan alike
            dims = positive_ints(self.name, batch=batch, seq_local=seq_local, heads=heads,
                                 kv_heads=kv_heads, head_dim=head_dim)
            self.batch, self.seq, self.heads, self.kv_heads, self.d = dims.values()
            send_blocks, threads, compute_blocks = positive_ints(
                self.name, send_blocks=send_blocks, threads=threads,
                compute_blocks=compute_blocks).values()
            if self.heads % self.kv_heads:
                raise MkValueError(f"{self.name}: heads={heads} must be a multiple of "
                                   f"kv_heads={kv_heads}")
            if self.d % 8 or self.d > HEAD_DIM_MAX:
                raise MkValueError(f"{self.name}: head_dim={head_dim} is not supported: a multiple "
                                   f"of 8, at most {HEAD_DIM_MAX}")
            check_layout(layout, self.seq, self.name)
            if comm_sms not in (None, "adaptive"):
                raise MkValueError(f"{self.name}: comm_sms={comm_sms!r}: None (the static split, "
                                   "send_blocks blocks) or 'adaptive'")
            self.adaptive = comm_sms == "adaptive"
            self.tracing = bool(trace)
            if self.tracing and not self.adaptive:
                raise MkValueError(f"{self.name}: trace=True stamps the adaptive build "
                                   "(comm_sms='adaptive'); the static build has no stamps")
            if causal not in (True, False):      # not bool(): "no" would mean causal
                raise MkValueError(f"{self.name}: causal must be True or False, got {causal!r}")
            self.causal, self.layout = bool(causal), layout
            self.scale = float(scale) if scale is not None else 1.0 / math.sqrt(self.d)
            if not math.isfinite(self.scale):
                raise MkValueError(f"{self.name}: scale must be a finite number, got {scale!r}")
            b, s, h, hk, d = self.batch, self.seq, self.heads, self.kv_heads, self.d
            # out, lse, q, k, v: bf16 but lse (fp32), for the hot path's arrays.unshared
            self._hot_sizes = (2 * b * s * h * d, 4 * b * h * s, 2 * b * s * h * d,
                               2 * b * s * hk * d, 2 * b * s * hk * d)
            self._unshared = set()
            self.world = comm.size if comm is not None else 1
            self.me = comm.rank if comm is not None else 0
            self.nodes = comm.nodes if comm is not None else 1
            self.local = comm.local_rank if comm is not None else 0
            self.g = comm.local_size if comm is not None else 1
            agreed.update(dims, causal=self.causal, layout=layout, scale=self.scale,
                          send_blocks=send_blocks)
            self.device = comm.device_id if comm is not None else (
                None if SIMULATOR else cuda.get_current_device().id)
            self.tile = self._tile_for(tile)
            sm90 = self.tile in SM90_BUILDS
            # q, k, v: the sm90 tile reads them by TMA (16-byte aligned tensor maps), the SIMT twin
            # 8 bytes at a time; out asks 8 bytes in both builds (no TMA map on it)
            self.align = 16 if sm90 else 8
            if sm90:
                if threads is not None:
                    raise MkValueError(f"{self.name}: threads= sets the SIMT twin's rows per "
                                       f"block; the sm90 tile runs {SM90_THREADS} threads")
                self.threads, smem, rows = SM90_THREADS, SM90_SMEM_BYTES, SM90_ROWS
            else:
                self.threads, smem = int(threads or (8 if SIMULATOR else 128)), 0
                rows = self.threads
            self.words = self.batch * self.seq * self.kv_heads * self.d // 4   # of K, and of V
            self.parts = 0
            if self.world > 1:    # parts of a slice, each a flag; none of them empty
                chunk = -(-self.words // int(send_blocks or (1 if SIMULATOR else 8)))
                self.parts = -(-self.words // chunk)
            tiles = self.batch * self.heads * -(-self.seq // rows)
            sms = 2 if SIMULATOR else cuda.get_current_device().MULTIPROCESSOR_COUNT
            comm_blocks = self.parts * (2 if self.nodes > 1 else 1)
            # adaptive: the pushes inside the node are the compute blocks' (ncomm items), only the
            # send (to the proxy) and forward blocks between nodes stay fixed
            self.ncomm = self.parts if self.adaptive and self.g > 1 else 0
            if self.adaptive:
                comm_blocks = 2 * self.parts if self.nodes > 1 else 0
            self.tiles = tiles
            # the sm90 tile takes a whole SM (shared memory): one block per SM beside the movers
            fit = max(1, sms - comm_blocks) if sm90 else 4 * sms
            self.compute_blocks = int(compute_blocks or min(tiles + self.ncomm, fit))
            # flexible blocks that start pushing: as many as the static split's send blocks
            self.init_comm = min(self.parts, self.ncomm, self.compute_blocks - 1) \
                if self.adaptive else 0
            self.role_blocks = dict(send=self.parts if comm_blocks else 0,
                                    forward=self.parts if comm_blocks and self.nodes > 1 else 0,
                                    compute=self.compute_blocks)
        self._allocate()
        with self._planning_ends():
            kernel = make_kernel(self.tile, self.adaptive)
            compiled, bps = compile_kernel(kernel, self.threads, smem)
            grid = comm_blocks + self.compute_blocks
            self.frame = Frame(grid)
            if not SIMULATOR and (self.parts or sm90) and grid > bps * sms:
                raise MkValueError(f"{self.name}: {grid} blocks are more than fit on the GPU at "
                                   f"once ({bps} per SM)")
            cfg = pack(CFG_FIELDS, batch=self.batch, seq=self.seq, heads=self.heads,
                       kv_heads=self.kv_heads, d=self.d, me=self.me, world=self.world,
                       parts=self.parts, causal=self.causal, zigzag=layout == "zigzag",
                       local=self.local, g=self.g, nodes=self.nodes, words=self.words,
                       win_kv=self._wins[0], win_arrive=self._wins[1], pool=comm_blocks,
                       ncomm=self.ncomm, init_comm=self.init_comm, trace=self.tracing)
            self.grid = grid
            # the adaptive split's work queues, the controller's measurements (they grow across
            # calls: roles.controller) and the trace rows (the static build never reads them)
            items = max(grid, tiles, self.parts) if self.tracing else 1
            self._trace = cuda.to_device(np.zeros((TRACE_ROWS, items), np.int64))
            self.queue = cuda.to_device(np.zeros(QUEUES, np.uint32))
            self.ctl = cuda.to_device(np.zeros(CTL_WORDS, np.uint64))
            b, s, h, hk, d = self.batch, self.seq, self.heads, self.kv_heads, self.d
            self.launch = Launch(kernel, compiled, dict(
                q=Slot((b, s, h, d)), k=Slot((b, s, hk, d)), v=Slot((b, s, hk, d)),
                out=Slot((b, s, h, d)), lse=Slot((b, h, s)), k_words=Slot((self.words,)),
                v_words=Slot((self.words,)), **self._device_args,
                order=cuda.to_device(self.order()), **self._tile_args(),
                frame=self.frame.words, cfg=cuda.to_device(cfg), scale=np.float32(self.scale),
                timeout_ns=self.timeout_ns, err=self.err, rank=self.me, queue=self.queue,
                ctl=self.ctl, trace=self._trace), grid,
                self.threads, smem)

    def _tile_for(self, tile):
        """The tile to run for ``tile``: "auto", "simt", or an sm90 build ("sm90", or one a
        probe registered: ``roles.attention.register_sm90_build``)."""
        if tile not in ("auto", "simt") and tile not in SM90_BUILDS:
            raise MkValueError(f"{self.name}: tile must be 'auto', 'sm90' or 'simt', got {tile!r}")
        cc = None if SIMULATOR else tuple(cuda.get_current_device().compute_capability)
        fits = cc == (9, 0) and self.d in SM90_HEAD_DIMS
        if tile in SM90_BUILDS and not fits:
            raise MkValueError(f"{self.name}: the {tile} tile needs a Hopper GPU (here: "
                               f"{'the simulator' if cc is None else cc}) and head_dim 64 or "
                               f"128 (here: {self.d})")
        if tile in SM90_BUILDS:
            return tile
        return "sm90" if tile == "auto" and fits else "simt"

    def _tile_args(self):
        """The sm90 tile's launch arguments: the caller's q, k, v tensor maps (one row per
        address triple, bound per call), each slot's K and V maps, the positions of this rank's
        rows and of every slice in compute order (``sched.sequence.runs``)."""
        W, layout = self.world, self.layout
        table = [runs(self.me, self.seq, W, layout)]
        table += [runs(int(src), self.seq, W, layout) for src in self.order()]
        args = dict(runs=cuda.to_device(np.array(table, np.int32).ravel()))
        if self.tile not in SM90_BUILDS:
            self.user_maps = None
            dummy = cuda.to_device(np.zeros(MAP_WORDS, np.uint64))
            return dict(args, user_maps=dummy, slot_maps=dummy)
        b, s, h, hk, d = self.batch, self.seq, self.heads, self.kv_heads, self.d
        box = (64, SM90_ROWS, 1)

        def encode(key):
            q, k, v = key
            return np.concatenate([tensor_map(q, (h * d, s, b), box),
                                   tensor_map(k, (hk * d, s, b), box),
                                   tensor_map(v, (hk * d, s, b), box)])
        self.user_maps = MapTable(encode, 3 * MAP_WORDS)
        slots = np.zeros((max(W, 2) * 4, MAP_WORDS), np.uint64)
        if W > 1:             # [slot, src, k|v] -> the map of that [b, s, kv_heads * d] slice
            base, elems = param(self._device_args["kv"]), b * s * hk * d
            for i in range(4 * W):
                slots[i] = tensor_map(base + i * elems * 2, (hk * d, s, b), box)
        return dict(args, user_maps=Slot((3 * MAP_WORDS,)),
                    slot_maps=cuda.to_device(slots.ravel()))

    def order(self):
        """The world ranks whose slices this rank attends to, in order: its own, this node's
        other GPUs in ring order (the previous GPU's first), then each other node's, its
        rail peer's first (that slice arrives directly, the others forwarded)."""
        return arrival_order(self.me, self.local, self.g, self.nodes)

    def _allocate(self):
        """The symmetric slots for other ranks' K and V (one per world rank), their flags, the
        network's arrival flags and proxy windows, the error record."""
        b, s, hk, d, W = self.batch, self.seq, self.kv_heads, self.d, self.world
        comm = self.comm
        self._buffers, self._wins = [], (0, 0)
        z64, z32 = np.zeros(1, np.uint64), np.zeros(1, np.uint32)
        if W > 1:
            kv = comm.alloc_symmetric((2 * W * 2 * self.words,), np.uint64)
            fl = comm.alloc_flags(W * self.parts)
            self._buffers = [kv, fl]
            args = dict(kv=kv.local.view(np.uint16).reshape(2, W, 2, b, s, hk, d),
                        kv_words=kv.local, kv_ptrs=kv.ptrs, flags=fl.local, flag_ptrs=fl.ptrs)
            self._epoch_flags = [fl.local]
        else:                     # one GPU: no slots to fill, the kernel reads k and v
            args = dict(kv=cuda.to_device(np.zeros((1, 1, 1, 1, 1, 1, 4), np.uint16)),
                        kv_words=cuda.to_device(z64), kv_ptrs=cuda.to_device(z64),
                        flags=cuda.to_device(z32), flag_ptrs=cuda.to_device(z64))
            self._epoch_flags = []
        if self.nodes > 1:
            if comm.proxy is None:
                raise MkError(f"{self.name}: {self.nodes} nodes need the proxy, which this "
                              "Comm did not start")
            arrive = comm.alloc_flags(W * 2 * self.parts)
            self._buffers.append(arrive)
            self._epoch_flags.append(arrive.local)
            self._wins = (comm.proxy.register(kv), comm.proxy.register(arrive))
            ring, head, tail = comm.proxy.device_args()
            args.update(arrive=arrive.local, ring=ring, head=head, tail=tail,
                        rail=cuda.to_device(np.array(comm.rail_peers, np.int32)))
        else:
            args.update(arrive=cuda.to_device(z32), ring=cuda.mapped_array(12, np.uint32),
                        head=cuda.to_device(z32), tail=cuda.mapped_array(1, np.uint32),
                        rail=cuda.to_device(np.zeros(1, np.int32)))
        self._device_args = args
        if comm is not None:
            self.err, self.timeout_ns = comm.new_error_record(), comm.timeout_ns
        else:
            from ...runtime import default_timeout_ns
            self.err = cuda.mapped_array(ERR_WORDS, dtype=np.int64)
            self.err[:] = 0
            self.timeout_ns = default_timeout_ns()

    def __call__(self, q, k, v, out=None, lse=None, stream=None):
        """q [batch, seq_local, heads, d], k and v [batch, seq_local, kv_heads, d] (bf16) ->
        ``(out, lse)``: out like q (bf16), lse [batch, heads, seq_local] fp32 (natural log).
        PyTorch tensors in -> tensors out; other arrays (bf16 as ml_dtypes.bfloat16 or bits as
        uint16/int16) -> numba arrays (out as bf16 bits, uint16)."""
        if (out is not None and lse is not None and stream is None and not self.freed
                and (self.comm is None or self.comm.proxy is None)   # (a proxy: comm.check)
                and is_torch(q)):                               # the hot path: tensors
            b, s, h, hk, d, dev = (self.batch, self.seq, self.heads, self.kv_heads, self.d,
                                   self.device)
            pq = torch_ptr(q, (b, s, h, d), dev, align=self.align)
            pk = pq and torch_ptr(k, (b, s, hk, d), dev, align=self.align)
            pv = pk and torch_ptr(v, (b, s, hk, d), dev, align=self.align)
            po = pv and torch_ptr(out, (b, s, h, d), dev, align=8)
            pl = po and torch_ptr(lse, (b, h, s), dev, dtype=sys.modules["torch"].float32, align=4)
            if (pl and unshared(self._unshared, (po, pl, pq, pk, pv), self._hot_sizes, 2)
                    and not self.err[ERR_SET]):
                self._run(pq, pk, pv, pk, pv, po, pl, (pq, pk, pv), stream_handle(None, dev))
                return out, lse
        return self._checked_call(self._call, q, k, v, out, lse, stream)

    def _call(self, q, k, v, out, lse, stream):
        """A call with every check."""
        b, s, h, hk, d, dev = self.batch, self.seq, self.heads, self.kv_heads, self.d, self.device
        Q = operand(q, self.name, "q", shape=(b, s, h, d), device_id=dev, align=self.align)
        K = operand(k, self.name, "k", shape=(b, s, hk, d), device_id=dev, align=self.align)
        V = operand(v, self.name, "v", shape=(b, s, hk, d), device_id=dev, align=self.align)
        if not Q.torch == K.torch == V.torch:
            raise MkValueError(f"{self.name}: q, k and v must all be PyTorch tensors or all "
                               "device arrays")
        st = stream_handle(stream, dev if Q.torch else None)
        outputs_in_capture(self.name, st, out=out, lse=lse)
        if out is None:
            out = new_output(q, Q.torch, (b, s, h, d))
        if lse is None:
            lse = new_output(q, Q.torch, (b, h, s), "float32")
        O = operand(out, self.name, "out", shape=(b, s, h, d), device_id=dev, align=8)
        L_ = operand(lse, self.name, "lse", dtypes=("float32",), shape=(b, h, s),
                     device_id=dev, align=4)
        refuse_overlap(self.name, (O, L_), (Q, K, V))
        u16 = np.uint16
        self._run(Q.as_param(u16, (b, s, h, d)), K.as_param(u16, (b, s, hk, d)),
                  V.as_param(u16, (b, s, hk, d)), K.as_param(np.uint64, (self.words,)),
                  V.as_param(np.uint64, (self.words,)), O.as_param(u16, (b, s, h, d)),
                  L_.as_param(np.float32, (b, h, s)), (Q.ptr, K.ptr, V.ptr), st)
        return out, lse

    def _run(self, q, k, v, k_words, v_words, out, lse, qkv_ptrs, stream):
        """Bind the parameters (``Operand.as_param``: addresses on the GPU), the tensor maps
        of q, k and v at ``qkv_ptrs`` where the tile reads them by TMA, and launch."""
        L = self.launch
        with L.lock:                      # one call at a time binds and launches
            self.streams.enter(stream)
            if self.user_maps is None:
                L.binder("q", "k", "v", "k_words", "v_words", "out", "lse")(
                    stream, q, k, v, k_words, v_words, out, lse)
            else:
                L.binder("q", "k", "v", "k_words", "v_words", "out", "lse", "user_maps")(
                    stream, q, k, v, k_words, v_words, out, lse,
                    self.user_maps.row(qkv_ptrs, stream))

    def _counters(self):
        """With the adaptive split, the work queues' tickets."""
        if not self.adaptive:
            return []
        per_call = np.zeros(QUEUES, np.uint64)
        per_call[Q_COMPUTE] = self.tiles + self.compute_blocks
        per_call[Q_COMM] = self.ncomm + self.compute_blocks
        return [(self.queue, per_call)]

    def _flag_name(self, role, index, array=0):
        """Between nodes the forward role's waits (receive), and the compute role's array 0,
        watch arrive[src, k|v, part]: a rail peer's K or V part, landed through the proxy. The
        compute role's array 1 (``kernel.COMPUTE_PUSHED``) is flags[src, part], a slice's
        part pushed by a GPU of this node; its array 2 the mailbox between a block's producer
        warp and its consumers (index 0: the producer's next item, 1: the consumers' taking
        the last one)."""
        if (role, array) == (ROLE_COMPUTE, 2) and index in (0, 1):
            return ("this block's mailbox: " + ("its producer's next item" if index == 0 else
                                                "its consumers taking the last item"))
        if not self.parts:
            return None
        if (role, array) == (ROLE_COMPUTE, 1):
            src, p = divmod(index, self.parts)
            return (f"rank {src}'s K and V part {p}, pushed by a GPU of this node"
                    if src < self.world else None)
        if (role, array) in ((ROLE_RECV, 0), (ROLE_COMPUTE, 0)):
            src, rest = divmod(index, 2 * self.parts)
            hv, p = divmod(rest, self.parts)
            if src < self.world:
                return f"rank {src}'s {'KV'[hv]} part {p}, through the proxy"
        return None

    # -- traces (comm_sms="adaptive", trace=True) ---------------------------------------------
    def trace_events(self):
        """The last traced call's stamps (after :meth:`synchronize`): {event: int64 ns array by
        item (0: not reached)} plus ``role_blocks`` and ``controller``. ``block_*`` index
        blocks (send, forward, compute in block order); ``send_*`` and ``push_*`` the parts of
        this rank's slice (between nodes stored here and handed to the proxy; pushed to the
        node's other GPUs, ``push_block`` by which block); ``tile_*`` query tiles in the
        queue's order (``kernel.query_tile`` with one worker), ``tile_block`` by which block;
        ``controller``: per block its decisions [(ns, role, target)] (role 0 compute, 1 the
        pushes: ``roles.controller``)."""
        stamps, rows = self._stamps(TRACE_EVENTS)
        log = decision_log(rows, TRACE_EVENTS, self.grid, CTL_LOG)
        return dict(stamps, role_blocks=dict(self.role_blocks), controller=log)

    def timeline(self):
        """The last traced call as a :class:`mknumba.timeline.Timeline` (this rank): a
        ``compute`` item per query tile, a ``push`` item on the send tracks per part of this
        rank's slice pushed inside the node and, between nodes, a ``send`` item per part
        handed to the proxy (items name the part by its flag, ``rank * parts + part``); each
        fixed block's role from its start to its end stamp, each flexible block's from the
        controller's log (its communication role named ``send``). After :meth:`synchronize`."""
        ev = self.trace_events()
        rb, P, me = self.role_blocks, self.parts, self.me
        layout = [(role, rb[role]) for role in ("send", "forward", "compute")]
        pool = rb["send"] + rb["forward"]
        items = dict(
            send=spans(ev, "send_start", "send_staged", rb["send"], lambda p: me * P + p,
                       lambda p: p) +
            spans(ev, "push_start", "push_done", self.ncomm, lambda p: me * P + p,
                  lambda p: ev["push_block"][p], "push"),
            compute=spans(ev, "tile_start", "tile_done", self.tiles, lambda i: i,
                          lambda i: ev["tile_block"][i]))
        start, end = ev["block_start"], ev["block_end"]
        segments, decisions = [], []
        for b in range(self.grid):
            if start[b] <= 0 or end[b] <= 0:
                continue
            if b >= pool:
                log = ev["controller"][b]
                segments += [(b, r, t0, t1) for r, t0, t1 in
                             segments_from_log(start[b], end[b], log, ("compute", "send"))]
                decisions += [(t, b, r, want) for t, r, want in log]
            else:
                segments.append((b, role_of(b, layout), int(start[b]), int(end[b])))
        meta = dict(op=self.name, batch=self.batch, seq=self.seq, heads=self.heads,
                    kv_heads=self.kv_heads, head_dim=self.d, causal=self.causal,
                    layout=self.layout, topology=f"{self.nodes}x{self.g}", parts=P,
                    role_blocks=dict(rb), tiles=self.tiles, adaptive=True, tile=self.tile,
                    controller_log_dropped=sum(max(0, int(ev["ctl_n"][b]) - CTL_LOG)
                                               for b in range(self.grid)))
        return Timeline(me, items, segments, decisions, meta)


_SINGLE = {}    # one op per shape and GPU, kept (a captured graph may refer to it)


def attention(q, k, v, causal=False, scale=None, out=None, lse=None, stream=None,
              tile="auto"):
    """Attention on one GPU: q [batch, seq, heads, d], k and v [batch, seq, kv_heads, d] (bf16)
    -> ``(out, lse)``, out like q (bf16) and lse [batch, heads, seq] (fp32, natural log);
    causal masks keys after each query; tile: as for :class:`RingAttention`. The compute role
    of :class:`RingAttention` on a world of one (planned once per shape; ``attention.op(...)``
    returns that plan, e.g. to see which tile it runs). Inside a CUDA graph capture: a shape
    called before, ``out=`` and ``lse=`` given."""
    if not hasattr(q, "shape") or len(q.shape) != 4 or not hasattr(k, "shape") or \
            len(k.shape) != 4:
        raise MkValueError("mknumba.attention: q, k and v must be 4-d [batch, seq, heads, d]")
    st = stream_handle(stream, q.device.index if is_torch(q) else None)
    op = _single(tuple(int(x) for x in q.shape), int(k.shape[2]), causal, scale, tile, st)
    return op(q, k, v, out=out, lse=lse, stream=st)


def _single(q_shape, kv_heads, causal=False, scale=None, tile="auto", stream=None):
    b, s, h, d = q_shape
    key = (b, s, h, kv_heads, d, causal if causal in (True, False) else repr(causal), scale, tile,
           None if SIMULATOR else cuda.get_current_device().id)
    if key not in _SINGLE:
        if stream is not None and is_capturing(stream):   # planning allocates and compiles
            raise MkError("mknumba.attention: the first call with these shapes and options is "
                          "inside a CUDA graph capture; call once with them before capturing "
                          "(it plans the op)")
        _SINGLE[key] = RingAttention(None, b, s, h, kv_heads, d, causal=causal, scale=scale,
                                     tile=tile)
    return _SINGLE[key]


attention.op = _single
