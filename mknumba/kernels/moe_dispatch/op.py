"""MoE Dispatch + GEMM on the host: plan once (``plan``), allocate the symmetric token buffer,
send list, count table and flags, prepare the launch; each call checks its arrays, binds them
and launches."""
import sys
from collections import namedtuple

import numpy as np
from numba import cuda

from ...arrays import (dtype_name, is_torch, new_output, operand, refuse_overlap, torch_ptr,
                       unshared)
from ...errors import ERR_SET, ROLE_COMPUTE, ROLE_INTRA, ROLE_RECV, MkError, MkValueError
from ...roles.controller import CTL_WORDS, QUEUES
from ...roles.compute import kn_kind
from ..gemm_inputs import b_map
from ..launch import Launch, Slot, compile_kernel, pack, param
from ..lifetime import Frame, OpLifetime
from ..streams import is_capturing, outputs_in_capture, stream_handle
from ..tensor_maps import MapTable, tensor_map
from .kernel import CFG_FIELDS, Q_COMM, Q_COMPUTE, build, flag_words, lay_words, meta_words
from .plan import MoeDispatchGemmPlan


#: The kernel's parameters for the layout's four parts (``MoeLayout.parts``), in their order.
LAYOUT_PARAMS = ("counts", "offsets", "rows_out", "weights_out")


class MoeLayout:
    """What a combine step needs to send the rows back, beside ``out``: one int32 device array
    ``buffer`` of :meth:`words` ``(experts, capacity)`` items (``experts``: the op's experts per
    rank; ``capacity``: its rows), seen as four arrays (:meth:`parts`), each a view of
    ``buffer`` made when read:

    - counts [experts] int32: rows per local expert;
    - offsets [experts + 1] int32: expert e's rows are out[offsets[e]:offsets[e + 1]],
      offsets[-1] the rows this call received;
    - rows [capacity, 3] int32: per out row its source rank, token index (in that rank's x) and
      top-k slot;
    - weights [capacity] float32: its routing weight, 1 for a row from a rank whose call passed
      no topk_weights (whatever this rank's call passed).

    Rows past offsets[-1] are not written. An op writes ``buffer`` (one array to check per
    call); ``MoeLayout(buffer, experts, capacity)`` wraps a device array of the caller's, and
    ``counts, offsets, rows, weights = layout`` unpacks one (``layout[i]`` reads one)."""

    __slots__ = ("buffer", "experts", "capacity")

    def __init__(self, buffer, experts, capacity):
        if not (hasattr(buffer, "dtype") and hasattr(buffer, "shape")):
            raise MkValueError(f"MoeLayout: buffer must be a device array (int32, "
                               f"MoeLayout.words(experts, capacity) items), not "
                               f"{type(buffer).__name__}")
        self.buffer, self.experts, self.capacity = buffer, int(experts), int(capacity)

    @staticmethod
    def parts(experts, capacity):
        """``(name, start, dtype, shape)`` of counts, offsets, rows and weights, in the
        buffer's order (start in items; weights as float32 bits)."""
        E, C = experts, capacity
        return (("counts", 0, np.int32, (E,)), ("offsets", E, np.int32, (E + 1,)),
                ("rows", 2 * E + 1, np.int32, (C, 3)),
                ("weights", 2 * E + 1 + 3 * C, np.float32, (C,)))

    @classmethod
    def words(cls, experts, capacity):
        """Items of the buffer of a layout for ``experts`` local experts and ``capacity``
        rows."""
        _, start, _, (n,) = cls.parts(experts, capacity)[-1]      # weights come last
        return start + n

    def __getitem__(self, i):
        _, start, dtype, shape = self.parts(self.experts, self.capacity)[i]
        part = self.buffer[start:start + int(np.prod(shape))]
        if dtype is np.float32:
            part = part.view(sys.modules["torch"].float32 if is_torch(part) else np.float32)
        return part.reshape(shape) if len(shape) > 1 else part

    def __len__(self):
        return 4

    counts = property(lambda self: self[0])
    offsets = property(lambda self: self[1])
    rows = property(lambda self: self[2])
    weights = property(lambda self: self[3])

    def __repr__(self):
        words = self.words(self.experts, self.capacity)
        return (f"MoeLayout({type(self.buffer).__name__} of {words} int32, "
                f"experts={self.experts}, capacity={self.capacity})")


#: What the calls with one token count share (``MoeDispatchGemm._token_count``).
_TokenCount = namedtuple("_TokenCount", "dev cfg x_shape k_shape seen sizes")


class MoeDispatchGemm(MoeDispatchGemmPlan, OpLifetime):
    """Expert-parallel dispatch and the experts' first GEMM in one persistent launch.

    comm: the :class:`mknumba.Comm` (several nodes: through its proxy); hidden, ffn: the experts' GEMM
    [hidden] -> [ffn] (multiples of 8); experts: in all, ``experts / world`` per rank (rank r
    holds experts [r * E / W, (r + 1) * E / W)); top_k: experts per token; max_tokens: the most
    tokens a rank passes in one call. capacity: the rows a rank can receive in one call
    (default: every token of every rank routed to it, ``world * max_tokens * top_k``; a call
    that routes more rows to a rank raises MkCapacityError at the next synchronize() or call,
    with nothing written past the buffers). w_layout: "ehf" (w is [experts / world, hidden,
    ffn]) or "efh" ([experts / world, ffn, hidden]), either read as it is (the tile build
    ``kn_kind(kind)`` reads "ehf"). comm_sms: SMs of the pack, forward (between nodes) and pull
    roles (default 16, not measured yet: between nodes a quarter forward; of the rest a third
    pack, the others pull), or "adaptive": the pull blocks join the compute blocks, which
    pull 16-row chunks of the receive buffer or compute tiles as the controller decides
    (``roles.controller``; route, pack and forward as in the default split); unit_tokens: tokens behind one flag of the token buffer (default
    16; between nodes, where a unit is also one proxy command, whole 16-token units of about
    512 KiB). Every rank must plan the same sizes (checked).

    Calls are asynchronous on the stream of the inputs (the current PyTorch stream for
    tensors, else ``stream``), with no host round trip: :meth:`synchronize` (or the next
    call, which is then not launched, and after which this rank takes no more calls: the
    others launched it) raises any device-side error: MkTimeoutError; MkCapacityError when a
    call routed more rows to this rank than planned; MkValueError naming the first (token,
    slot) of a call whose topk_idx held an expert id out of range (the call left those pairs
    out, alike on every rank; raised by synchronize(), the op takes the next call). After a
    timeout or a capacity error the op refuses every later call on that rank (its ranks no
    longer agree on what was sent): plan a new one. A CUDA graph capture
    replays correctly when every token count was met in an ordinary call first and the
    capture passes ``out=`` and ``layout=`` (a call that would allocate is refused there).
    """

    def __init__(self, comm, hidden, ffn, experts, top_k, max_tokens, dtype="bfloat16", *,
                 capacity=None, w_layout="ehf", comm_sms=None, tile="auto", unit_tokens=None):
        self._plan_on(comm)
        with self._planning_starts() as agreed:
            # every rank must plan the same exchange, in the caller's terms
            agreed.update(op=self.name, hidden=hidden, ffn=ffn, experts=experts, top_k=top_k,
                          max_tokens=max_tokens, dtype=dtype_name(dtype), tile=tile,
                          unit_tokens=unit_tokens)
            self._plan(comm, hidden, ffn, experts, top_k, max_tokens, dtype, capacity, w_layout,
                       comm_sms, tile, unit_tokens)
            self.w_kn = self.w_layout == "ehf"      # w[e] is [hidden, ffn]: B as [k, n]
            kind = kn_kind(self.kind, self.name) if self.w_kn else self.kind   # may refuse
        self._buffers = []
        self._cfgs = {}               # (T, weighted) -> _TokenCount
        self.err = comm.new_error_record()
        self.frame = Frame(self.grid)
        self.w_shape = (self.local_experts, hidden, ffn) if self.w_kn else \
            (self.local_experts, ffn, hidden)
        # the layout: one buffer of this many int32, its four parts from these byte offsets
        self._lay_words = MoeLayout.words(self.local_experts, self.capacity)
        self._lay_parts = MoeLayout.parts(self.local_experts, self.capacity)
        self._lay_bytes = tuple(4 * start for _, start, _, _ in self._lay_parts)
        self._lay_shape, self._out_shape = (self._lay_words,), (self.capacity, ffn)
        self.build, self.threads, self._kernel = build(kind, self.adaptive)
        self._allocate(comm)

    def _allocate(self, comm):
        W, El, K, H, F = self.world, self.local_experts, self.top_k, self.hidden, self.ffn
        maxt, nodes = self.max_tokens, self.nodes
        mw = meta_words(self.experts, maxt, K)
        # per call parity and node: this GPU's regions and its rail peers' (package docstring)
        self.xbuf = comm.alloc_symmetric((2 * nodes * maxt * H // 4,), np.uint64)
        self.meta = comm.alloc_symmetric((2 * nodes * mw,), np.int32)
        self.table = comm.alloc_symmetric((2 * W * 2 * El,), np.int32)
        self.flags = comm.alloc_flags(flag_words(W, self.units))
        self._buffers = [self.xbuf, self.meta, self.table, self.flags]
        self.recv = cuda.device_array((self.recv_rows, H), np.uint16)
        # the layout, each tile row, and (adaptive) each pull item of the tile rows
        chunks = self.tiles_m * self.chunks if self.adaptive else 0
        self.lflags = cuda.to_device(np.zeros(1 + self.tiles_m + chunks, np.uint32))
        self.tile_flags = cuda.to_device(np.zeros(self.tiles_m * self.tiles_n, np.uint32))
        self._epoch_flags = [self.flags.local, self.lflags, self.tile_flags]
        if self.build.tma:
            self.tmaps = ExpertMaps(self.recv, El, H, F, self.w_kn, self.build.shape)
        else:
            self._no_maps = cuda.to_device(np.zeros((El, 32), np.uint64))
            self._no_maps_ptr = param(self._no_maps)
        wins = (0, 0, 0)
        if nodes > 1:
            if comm.proxy is None:
                raise MkError(f"{self.name}: {nodes} nodes need the proxy (mknumba.proxy), "
                              "which this Comm did not start")
            wins = tuple(comm.proxy.register(b) for b in (self.xbuf, self.meta, self.flags))
            ring, head, tail = comm.proxy.device_args()
            rail = np.array(comm.rail_peers, np.int32)
        else:                     # never enqueued to
            ring, head, tail = (cuda.mapped_array(12, np.uint32),
                                cuda.to_device(np.zeros(1, np.uint32)),
                                cuda.mapped_array(1, np.uint32))
            rail = np.zeros(1, np.int32)
        with self._planning_ends():
            rb = self.role_blocks
            self._cfg = dict(k=K, hidden=H, ffn=F, el=El, experts=self.experts, world=W,
                             me=comm.rank, max_tokens=maxt, unit=self.unit, units=self.units,
                             cap=self.capacity, tiles_m=self.tiles_m, tiles_n=self.tiles_n,
                             bm=self.bm, pack_end=1 + rb["pack"],
                             forward_end=1 + rb["pack"] + rb["forward"],
                             pull_end=1 + rb["pack"] + rb["forward"] + rb["pull"], nodes=nodes,
                             node=comm.node, g=comm.local_size, local=comm.local_rank, mw=mw,
                             win_xbuf=wins[0], win_meta=wins[1], win_flags=wins[2],
                             chunks=self.chunks if self.adaptive else 0, init_comm=self.init_comm)
            # the adaptive split's work queues and the controller's measurements (they grow across
            # calls: roles.controller; the static build never reads them)
            self.queue = cuda.to_device(np.zeros(QUEUES, np.uint32))
            self.ctl = cuda.to_device(np.zeros(CTL_WORDS, np.uint64))
            self._no_weights = cuda.to_device(np.zeros(1, np.float32))      # never read
            self._no_weights_ptr = param(self._no_weights)   # bound by every call that has none
            compiled, bps = compile_kernel(self._kernel, self.threads, self.build.smem_bytes)
            if bps < 1:
                raise MkError(f"{self.name}: the kernel does not fit on an SM")
            meta = self.meta.local
            cap = self.capacity
            self.launch = Launch(self._kernel, compiled, dict(
                x=Slot((maxt * H // 4,)), topk=Slot((maxt * K,)), weights=Slot((maxt * K,)),
                wt=Slot(self.w_shape), tmtable=Slot((El, 32)),
                recv=self.recv,
                recv_words=self.recv.reshape(self.recv_rows * H).view(np.uint64),
                xbuf=self.xbuf.local, xbuf_ptrs=self.xbuf.ptrs, meta=meta,
                meta_f=meta.view(np.float32), meta_ptrs=self.meta.ptrs, table=self.table.local,
                table_ptrs=self.table.ptrs, flags=self.flags.local, flag_ptrs=self.flags.ptrs,
                hist=cuda.to_device(np.zeros(3 * self.experts + 1, np.int32)),
                lay=cuda.to_device(np.zeros(lay_words(El, W, self.tiles_m), np.int32)),
                lflags=self.lflags, tile_flags=self.tile_flags, out=Slot((cap, F)),
                cfg=Slot((len(CFG_FIELDS),)),
                order=cuda.to_device(self.order), rail=cuda.to_device(rail), ring=ring, head=head,
                tail=tail, frame=self.frame.words,
                timeout_ns=comm.timeout_ns, err=self.err, rank=comm.rank, queue=self.queue,
                ctl=self.ctl, **{name: Slot(shape) for name, (_, _, _, shape)
                                 in zip(LAYOUT_PARAMS, self._lay_parts)}),
                self.grid, self.threads, self.build.smem_bytes)   # one block per SM: co-resident
            self._go = self.launch.binder("x", "topk", "weights", "wt", "tmtable", "out",
                                          *LAYOUT_PARAMS, "cfg")

    # -- calls ------------------------------------------------------------------------------------
    def out_shape(self):
        return self._out_shape

    def __call__(self, x, topk_idx, w, topk_weights=None, out=None, layout=None, stream=None):
        """x: this rank's tokens [T, hidden] bf16 (T <= max_tokens, 0 allowed); topk_idx
        [T, top_k] int32: each token's experts (global ids); w: this rank's experts
        [experts / world, hidden, ffn] bf16 (w_layout "ehf") or [experts / world, ffn, hidden]
        ("efh"); topk_weights: [T, top_k] float32, carried into the layout.

        Returns ``(out, layout)``: out [capacity, ffn] bf16, every row routed to this rank's
        experts times that expert's weight, expert by expert (expert e's rows are
        ``out[layout.offsets[e]:layout.offsets[e + 1]]``), and the :class:`MoeLayout`. Rows
        past ``layout.offsets[-1]`` are left as they were. ``out=`` / ``layout=`` take an
        earlier call's (or arrays of the caller's; a CUDA graph capture must pass both).
        Expert ids are checked on the device (see the class docstring): nothing here waits
        for the GPU."""
        if (out is not None and isinstance(layout, MoeLayout) and stream is None
                and not self.freed and self.comm.proxy is None
                and is_torch(x)):                               # the hot path: tensors
            if self._hot_call(x, topk_idx, w, topk_weights, out, layout):
                return out, layout
        return self._checked_call(self._call, x, topk_idx, w, topk_weights, out, layout, stream)

    def _call(self, x, topk_idx, w, topk_weights, out, layout, stream):
        """A call with every check."""
        dev = self.comm.device_id
        H, K = self.hidden, self.top_k
        X = operand(x, self.name, "x", shape=(None, H), device_id=dev)
        T = X.shape[0]
        if T > self.max_tokens:
            raise MkValueError(f"{self.name}: x has {T} tokens, more than max_tokens="
                               f"{self.max_tokens} it was planned for")
        I = operand(topk_idx, self.name, "topk_idx", dtypes=("int32",), shape=(T, K),
                    device_id=dev, align=4)
        Wt = operand(w, self.name, "w", shape=self.w_shape, device_id=dev)
        if not (X.torch == I.torch == Wt.torch):
            raise MkValueError(f"{self.name}: x, topk_idx and w must all be PyTorch tensors or "
                               "all be device arrays")
        Wg = None
        if topk_weights is not None:
            Wg = operand(topk_weights, self.name, "topk_weights", dtypes=("float32",),
                         shape=(T, K), device_id=dev, align=4)
            if Wg.torch != X.torch:
                raise MkValueError(f"{self.name}: topk_weights must be a PyTorch tensor "
                                   "exactly when x is")
        stream = stream_handle(stream, dev if X.torch else None)
        outputs_in_capture(self.name, stream, out=out, layout=layout)
        if out is None:
            out = new_output(x, X.torch, self._out_shape)
        O = operand(out, self.name, "out", shape=self._out_shape, device_id=dev)
        if layout is None:
            layout = self._new_layout(x, X.torch)
        Lb = self._layout_operand(layout, X.torch, dev)
        refuse_overlap(self.name, (O, Lb), (X, I, Wg, Wt))
        cfg = self._token_count(T, Wg is not None, stream).cfg
        self._run(X.as_param(np.uint64, (T * H // 4,)), I.as_param(np.int32, (T * K,)),
                  Wg.as_param(np.float32, (T * K,)) if Wg is not None else None,
                  Wt.as_param(np.uint16, self.w_shape), O.as_param(np.uint16, self._out_shape),
                  [Lb.part(start, dtype, shape) for _, start, dtype, shape in self._lay_parts],
                  cfg, stream)
        return out, layout

    def _hot_call(self, x, topk_idx, w, topk_weights, out, layout):
        """The call on the hot path: launched (True) when every tensor is exactly what the
        plan expects, a call with T tokens, weighted or not as this one, ran before
        (:meth:`_token_count`) and no error is pending; else False, and the call takes the
        checked path, which names what is wrong."""
        if x.dim() != 2:
            return False
        known = self._cfgs.get((x.shape[0], topk_weights is not None))
        if known is None:
            return False
        torch = sys.modules["torch"]
        i32, dev = torch.int32, self.comm.device_id
        px = torch_ptr(x, known.x_shape, dev)
        pi = px and torch_ptr(topk_idx, known.k_shape, dev, dtype=i32, align=4)
        pg = None
        if pi and topk_weights is not None:
            pg = torch_ptr(topk_weights, known.k_shape, dev, dtype=torch.float32, align=4)
            pi = pg and pi
        pw = pi and torch_ptr(w, self.w_shape, dev)
        po = pw and torch_ptr(out, self._out_shape, dev)
        pl = (po and layout.experts == self.local_experts and layout.capacity == self.capacity
              and torch_ptr(layout.buffer, self._lay_shape, dev, dtype=i32, align=4))
        if (not pl or not unshared(known.seen, (po, pl, px, pi, pg, pw), known.sizes, 2)
                or self.err[ERR_SET]):
            return False
        _, b1, b2, b3 = self._lay_bytes
        self._run(px, pi, pg, pw, po, (pl, pl + b1, pl + b2, pl + b3), known.cfg,
                  stream_handle(None, dev))
        return True

    def _new_layout(self, like, torch):
        words = self._lay_words
        if torch:
            t = sys.modules["torch"]
            buf = t.empty(words, dtype=t.int32, device=like.device)
        else:
            buf = cuda.device_array(words, np.int32)
        return MoeLayout(buf, self.local_experts, self.capacity)

    def _layout_operand(self, layout, torch, dev):
        """The layout's buffer, checked (an Operand)."""
        if not isinstance(layout, MoeLayout):
            raise MkValueError(f"{self.name}: layout must be a MoeLayout (the one an earlier "
                               f"call returned), not {type(layout).__name__}")
        El, cap = self.local_experts, self.capacity
        if (layout.experts, layout.capacity) != (El, cap):
            raise MkValueError(f"{self.name}: layout is for {layout.experts} experts and "
                               f"capacity {layout.capacity}; this op has {El} experts per "
                               f"rank and capacity {cap}")
        b = operand(layout.buffer, self.name, "layout.buffer", dtypes=("int32",),
                    shape=self._lay_shape, device_id=dev, align=4)
        if b.torch != torch:
            raise MkValueError(f"{self.name}: layout.buffer must be a PyTorch tensor exactly "
                               "when x is")
        return b

    def _run(self, x, topk, weights, w, out, lay, cfg, stream):
        """Bind the parameters and launch: w as it is, the experts' tensor maps with it, the
        cfg of this call's token count."""
        with self.launch.lock:            # one call at a time binds and launches
            self.streams.enter(stream)
            self._go(stream, x, topk, weights if weights is not None else self._no_weights_ptr,
                     w, self.tmaps(w, stream) if self.build.tma else self._no_maps_ptr, out,
                     *lay, cfg)

    def _token_count(self, T, weighted, stream):
        """What calls with ``T`` tokens, weighted or not, share: their cfg (a small device
        array each, made by the first such call) and the hot path's shapes and overlap memory
        (:func:`arrays.unshared`)."""
        key = (T, weighted)
        if key not in self._cfgs:
            if is_capturing(stream):
                raise MkError(f"{self.name}: a first call with {T} tokens inside a CUDA graph "
                              "capture; call once with this many tokens before capturing")
            dev = cuda.to_device(pack(CFG_FIELDS, **self._cfg, tokens=T, weighted=weighted))
            H, K, El = self.hidden, self.top_k, self.local_experts
            sizes = (2 * self.capacity * self.ffn, 4 * self._lay_words, 2 * T * H, 4 * T * K,
                     4 * T * K, 2 * El * H * self.ffn)
            # setdefault: a call made at once on another thread keeps the record it binds
            return self._cfgs.setdefault(key, _TokenCount(dev, param(dev), (T, H), (T, K),
                                                          set(), sizes))
        return self._cfgs[key]

    def _counters(self):
        """With the adaptive split, the work queues' tickets (each call draws
        its queue's most items plus one ticket per flexible block: ``kernel``)."""
        if not self.adaptive:
            return []
        per_call = np.zeros(QUEUES, np.uint64)
        per_call[Q_COMPUTE], per_call[Q_COMM] = (n + self.role_blocks["compute"]
                                                 for n in self.queue_items())
        return [(self.queue, per_call)]

    def _flag_name(self, role, index, array=0):
        """The receive and intra-node roles' waits watch ``flags`` (array 0,
        ``kernel.flag_words``): a source's counts, its 16-token units, and (through the
        proxy) its routing. The compute role's, and the intra-node role's array 1
        (``kernel.INTRA_LAYOUT``), watch ``lflags``: this GPU's routing layout (index 0), then
        the receive buffer's tile rows and (adaptive) their pulled chunks."""
        W, units = self.world, self.units
        if role == ROLE_COMPUTE or (role == ROLE_INTRA and array == 1):
            return self._layout_flag_name(index)
        if role not in (ROLE_RECV, ROLE_INTRA) or array or index >= W * (2 + units):
            return None
        if index < W:
            return f"rank {index}'s token counts"
        if index < W * (1 + units):
            src, u = divmod(index - W, units)
            return f"rank {src}'s tokens {u * self.unit} .. {(u + 1) * self.unit - 1}"
        return f"rank {index - W * (1 + units)}'s routing, through the proxy"

    def _layout_flag_name(self, index):
        """``lflags[index]`` in words: 0 the layout, 1 + tm tile row tm of the receive buffer,
        then (adaptive) chunk c of tile row tm at 1 + tiles_m + tm * chunks + c."""
        if index == 0:
            return "this GPU's routing layout (the rows routed to its experts)"
        tm, chunk = index - 1, None
        if tm >= self.tiles_m:
            tm, chunk = divmod(tm - self.tiles_m, self.chunks)
        if tm >= self.tiles_m:
            return None
        rows = f"rows {tm * self.bm}..{(tm + 1) * self.bm - 1} of the receive buffer"
        return ((f"chunk {chunk} of " if chunk is not None else "") + rows
                + ", which this GPU's intra-node role gathers")

    def queue_items(self):
        """The adaptive split's items per call that its queues are planned for: (tiles,
        pulls) of every tile row of the receive buffer."""
        return self.tiles_m * self.tiles_n, self.tiles_m * self.chunks

    def rows(self, layout):
        """Rows the call that filled ``layout`` received (waits for it)."""
        self.synchronize()
        off = layout.offsets
        return int(off[-1].item() if is_torch(off) else
                   (off.copy_to_host() if hasattr(off, "copy_to_host") else off)[-1])


class ExpertMaps(MapTable):
    """Per local expert the tile's two tensor maps (A: the receive buffer, B: the expert's
    weight, [ffn, hidden] or with ``kn`` [hidden, ffn]), one [E_local, 32] table per weight
    address met so far; boxes for a tile build of ``shape`` (``gemm_inputs.TensorMaps``)."""

    def __init__(self, recv, experts, hidden, ffn, kn, shape, capacity=16):
        self.recv_ptr = recv.__cuda_array_interface__["data"][0]
        self.rows_, self.experts, self.hidden, self.ffn = recv.shape[0], experts, hidden, ffn
        self.kn, self.shape = kn, tuple(shape)
        super().__init__(self._encode, 32 * experts, capacity)

    def _encode(self, key):
        from ...roles import compute
        (w,), bk, (bm, bn) = key, compute.SM90_BK, self.shape
        a = tensor_map(self.recv_ptr, (self.hidden, self.rows_), (bk, bm))
        step = self.ffn * self.hidden * 2
        return np.concatenate([np.concatenate([a, b_map(w + e * step, self.ffn, self.hidden,
                                                        self.kn, bn)])
                               for e in range(self.experts)])

    def __call__(self, w_ptr, stream):
        return self.row((w_ptr,), stream)
