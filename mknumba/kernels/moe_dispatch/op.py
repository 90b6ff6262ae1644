"""MoE Dispatch + GEMM on the host: plan once (``plan``), allocate the symmetric token buffer,
send list, count table and flags, prepare the launch; each call checks its arrays, binds them
and launches."""
import sys
from collections import namedtuple

import numpy as np
from numba import cuda

from ...arrays import is_torch, new_output, operand, refuse_overlap, torch_ptr, unshared
from ...errors import ERR_SET, MkError, MkValueError
from ...roles.controller import CTL_WORDS, QUEUES
from ...roles.compute import kn_kind
from ..gemm_inputs import b_map
from ..launch import (Frame, Launch, OpLifetime, Slot, compile_kernel,
                      is_capturing, outputs_in_capture, pack, param,
                      stream_handle)
from ..tensor_maps import MapTable, tensor_map
from .kernel import CFG_FIELDS, Q_COMM, Q_COMPUTE, build, flag_words, lay_words, meta_words
from .plan import MoeDispatchGemmPlan

#: What a combine step needs to send the rows back, beside ``out`` (device arrays, int32 unless
#: said): counts [experts / world] rows per local expert; offsets [experts / world + 1]: expert
#: e's rows are out[offsets[e]:offsets[e + 1]], offsets[-1] the rows this call received;
#: rows [capacity, 3]: per out row its source rank, token index (in that rank's x) and top-k
#: slot; weights [capacity] fp32: its routing weight, 1 for a row from a rank whose call passed
#: no topk_weights (whatever this rank's call passed). Rows past offsets[-1] are not written.
MoeLayout = namedtuple("MoeLayout", "counts offsets rows weights")


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
        self._plan(comm, hidden, ffn, experts, top_k, max_tokens, dtype, capacity, w_layout,
                   comm_sms, tile, unit_tokens)
        self._buffers = []
        self._unshared = {}           # T -> (address sets seen apart, sizes): arrays.unshared
        self._cfgs = {}               # tokens T -> (device cfg, its parameter)
        self.err = comm.new_error_record()
        self.frame = Frame(self.grid)
        self.w_kn = self.w_layout == "ehf"      # w[e] is [hidden, ffn]: B as [k, n]
        self.build, self.threads, self._kernel = build(kn_kind(self.kind, self.name)
                                                       if self.w_kn else self.kind,
                                                       self.adaptive)
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
                wt=Slot((El, H, F) if self.w_kn else (El, F, H)), tmtable=Slot((El, 32)),
                recv=self.recv,
                recv_words=self.recv.reshape(self.recv_rows * H).view(np.uint64),
                xbuf=self.xbuf.local, xbuf_ptrs=self.xbuf.ptrs, meta=meta,
                meta_f=meta.view(np.float32), meta_ptrs=self.meta.ptrs, table=self.table.local,
                table_ptrs=self.table.ptrs, flags=self.flags.local, flag_ptrs=self.flags.ptrs,
                hist=cuda.to_device(np.zeros(3 * self.experts + 1, np.int32)),
                lay=cuda.to_device(np.zeros(lay_words(El, W, self.tiles_m), np.int32)),
                lflags=self.lflags, tile_flags=self.tile_flags, out=Slot((cap, F)),
                counts=Slot((El,)), offsets=Slot((El + 1,)), rows_out=Slot((cap, 3)),
                weights_out=Slot((cap,)), cfg=Slot((len(CFG_FIELDS),)),
                order=cuda.to_device(self.order), rail=cuda.to_device(rail), ring=ring, head=head,
                tail=tail, frame=self.frame.words,
                timeout_ns=comm.timeout_ns, err=self.err, rank=comm.rank, queue=self.queue,
                ctl=self.ctl),
                self.grid, self.threads, self.build.smem_bytes)   # one block per SM: co-resident

    # -- calls ------------------------------------------------------------------------------------
    def out_shape(self):
        return (self.capacity, self.ffn)

    def __call__(self, x, topk_idx, w, topk_weights=None, out=None, layout=None, stream=None):
        """x: this rank's tokens [T, hidden] bf16 (T <= max_tokens, 0 allowed); topk_idx
        [T, top_k] int32: each token's experts (global ids); w: this rank's experts
        [experts / world, hidden, ffn] bf16 (w_layout "ehf") or [experts / world, ffn, hidden]
        ("efh"); topk_weights: [T, top_k] float32, carried into the layout.

        Returns ``(out, layout)``: out [capacity, ffn] bf16, every row routed to this rank's
        experts times that expert's weight, expert by expert (expert e's rows are
        ``out[layout.offsets[e]:layout.offsets[e + 1]]``), and the :data:`MoeLayout`. Rows
        past ``layout.offsets[-1]`` are left as they were. ``out=`` / ``layout=`` reuse arrays
        of an earlier call (a CUDA graph capture must pass both). Expert ids are checked on
        the device (see the class docstring): nothing here waits for the GPU."""
        if (out is not None and isinstance(layout, MoeLayout) and stream is None
                and not self.freed and self.comm.proxy is None
                and is_torch(x)):                               # the hot path: tensors
            ptrs = self._hot_ptrs(x, topk_idx, w, topk_weights, out, layout)
            if ptrs is not None and not self.err[ERR_SET]:
                T, px, pi, pg, pw, po, lay = ptrs
                self._run(T, px, pi, pg, pw, po, lay, stream_handle(None, self.comm.device_id))
                return out, layout
        return self._checked_call(self._call, x, topk_idx, w, topk_weights, out, layout, stream)

    def _call(self, x, topk_idx, w, topk_weights, out, layout, stream):
        """A call with every check."""
        dev = self.comm.device_id
        H, F, K, El = self.hidden, self.ffn, self.top_k, self.local_experts
        X = operand(x, self.name, "x", shape=(None, H), device_id=dev)
        T = X.shape[0]
        if T > self.max_tokens:
            raise MkValueError(f"{self.name}: x has {T} tokens, more than max_tokens="
                               f"{self.max_tokens} it was planned for")
        I = operand(topk_idx, self.name, "topk_idx", dtypes=("int32",), shape=(T, K),
                    device_id=dev, align=4)
        wshape = (El, H, F) if self.w_layout == "ehf" else (El, F, H)
        Wt = operand(w, self.name, "w", shape=wshape, device_id=dev)
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
            out = new_output(x, X.torch, (self.capacity, F))
        O = operand(out, self.name, "out", shape=(self.capacity, F), device_id=dev)
        if layout is None:
            layout = self._new_layout(x, X.torch)
        L = self._layout_operands(layout, X.torch, dev)
        refuse_overlap(self.name, (O, *L), (X, I, Wg, Wt))
        self._run(T, X.as_param(np.uint64, (T * H // 4,)), I.as_param(np.int32, (T * K,)),
                  Wg.as_param(np.float32, (T * K,)) if Wg is not None else None,
                  Wt.as_param(np.uint16, wshape), O.as_param(np.uint16, (self.capacity, F)),
                  [o.as_param(np.dtype(o.dtype), tuple(o.shape)) for o in L], stream)
        return out, layout

    def _hot_ptrs(self, x, topk_idx, w, topk_weights, out, layout):
        """``(T, x, topk_idx, topk_weights or None, w, out, layout's four)`` as addresses when
        every tensor is exactly what the plan expects and a call with T tokens, weighted or
        not as this one, ran before (its cfg exists); else None, and the call takes the
        checked path."""
        if x.dim() != 2:
            return None
        T = x.shape[0]
        if (T, topk_weights is not None) not in self._cfgs:
            return None
        torch = sys.modules["torch"]
        dev, cap, El, K = self.comm.device_id, self.capacity, self.local_experts, self.top_k
        wshape = (El, self.hidden, self.ffn) if self.w_layout == "ehf" else \
            (El, self.ffn, self.hidden)
        px = torch_ptr(x, (T, self.hidden), dev)
        pi = px and torch_ptr(topk_idx, (T, K), dev, dtype=torch.int32, align=4)
        pg = None
        if pi and topk_weights is not None:
            pg = torch_ptr(topk_weights, (T, K), dev, dtype=torch.float32, align=4)
            pi = pg and pi
        pw = pi and torch_ptr(w, wshape, dev)
        po = pw and torch_ptr(out, (cap, self.ffn), dev)
        pc = po and torch_ptr(layout.counts, (El,), dev, dtype=torch.int32, align=4)
        pf = pc and torch_ptr(layout.offsets, (El + 1,), dev, dtype=torch.int32, align=4)
        pr = pf and torch_ptr(layout.rows, (cap, 3), dev, dtype=torch.int32, align=4)
        pl = pr and torch_ptr(layout.weights, (cap,), dev, dtype=torch.float32, align=4)
        if not pl:
            return None
        seen, sizes = self._unshared.get(T) or self._unshared.setdefault(T, (set(), (
            2 * cap * self.ffn, 4 * El, 4 * El + 4, 12 * cap, 4 * cap, 2 * T * self.hidden,
            4 * T * K, 4 * T * K, 2 * El * self.hidden * self.ffn)))
        if not unshared(seen, (po, pc, pf, pr, pl, px, pi, pg, pw), sizes, 5):
            return None                   # the checked path names the overlap
        return T, px, pi, pg, pw, po, (pc, pf, pr, pl)

    def _new_layout(self, like, torch):
        cap, El = self.capacity, self.local_experts
        if torch:
            import torch as t
            kw = dict(device=like.device)
            return MoeLayout(t.empty(El, dtype=t.int32, **kw),
                             t.empty(El + 1, dtype=t.int32, **kw),
                             t.empty((cap, 3), dtype=t.int32, **kw),
                             t.empty(cap, dtype=t.float32, **kw))
        return MoeLayout(cuda.device_array(El, np.int32), cuda.device_array(El + 1, np.int32),
                         cuda.device_array((cap, 3), np.int32),
                         cuda.device_array(cap, np.float32))

    def _layout_operands(self, layout, torch, dev):
        """The layout's four arrays, checked (Operands)."""
        if not isinstance(layout, MoeLayout):
            raise MkValueError(f"{self.name}: layout must be the MoeLayout of an earlier call")
        cap, El = self.capacity, self.local_experts
        ops = []
        for field, shape, dt in (("counts", (El,), "int32"), ("offsets", (El + 1,), "int32"),
                                 ("rows", (cap, 3), "int32"), ("weights", (cap,), "float32")):
            o = operand(getattr(layout, field), self.name, f"layout.{field}", dtypes=(dt,),
                        shape=shape, device_id=dev, align=4)
            if o.torch != torch:
                raise MkValueError(f"{self.name}: layout.{field} must be a PyTorch tensor "
                                   "exactly when x is")
            ops.append(o)
        return ops

    def _run(self, T, x, topk, weights, w, out, lay, stream):
        """Bind the parameters and launch: w as it is, the experts' tensor maps with it, this
        T's cfg."""
        L = self.launch
        with L.lock:                      # one call at a time binds and launches
            self.streams.enter(stream)
            L.binder("x", "topk", "weights", "wt", "tmtable", "out", "counts", "offsets",
                     "rows_out", "weights_out", "cfg")(
                stream, x, topk, weights if weights is not None else self._no_weights_ptr, w,
                self.tmaps(w, stream) if self.build.tma else self._no_maps_ptr, out, *lay,
                self._cfg_param(T, weights is not None, stream))

    def _cfg_param(self, T, weighted, stream):
        key = (T, weighted)
        if key not in self._cfgs:         # one small array per token count met so far
            if is_capturing(stream):
                raise MkError(f"{self.name}: a first call with {T} tokens inside a CUDA graph "
                              "capture; call once with this many tokens before capturing")
            dev = cuda.to_device(pack(CFG_FIELDS, **self._cfg, tokens=T, weighted=weighted))
            self._cfgs[key] = (dev, param(dev))
        return self._cfgs[key][1]

    def _counters(self):
        """With the adaptive split, the work queues' tickets (each call draws
        its queue's most items plus one ticket per flexible block: ``kernel``)."""
        if not self.adaptive:
            return []
        per_call = np.zeros(QUEUES, np.uint64)
        per_call[Q_COMPUTE], per_call[Q_COMM] = (n + self.role_blocks["compute"]
                                                 for n in self.queue_items())
        return [(self.queue, per_call)]

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
