"""Ring Attention (sequence parallel, paper §4): every rank's queries attend to every rank's keys.

    op = mk.RingAttention(comm, batch, seq_local, heads, kv_heads, head_dim, causal=True,
                          layout="zigzag")
    out, lse = op(q, k, v)   # q [batch, seq_local, heads, d], k/v [batch, seq_local, kv_heads, d]

Within a step the attention of each KV slice is independent of the others, so one persistent
launch overlaps moving the slices with computing on those already here. Roles, by block index:

  send     [0, P)       part p of this rank's K and V -> every other GPU of the node, into its
                          slot for this rank (NVLink stores, peers in ring order: the next GPU
                          first); publish that GPU's flags[me, p] = epoch
  compute  [P, grid)    for each tile of query rows (batch, head, rows), one query row per
                          thread: attend to the local slice, then to the slice of rank me - 1,
                          me - 2, ... as each arrives (wait flags[src, :]); the running max,
                          denominator and output stay in fp32 across slices (the LSE merge,
                          ``roles.attention``); out (bf16) and lse (fp32) written once

Slots are double-buffered by call parity (``slot = call & 1``): a rank cannot start call e+2
before every peer has finished call e (its call e+1 waited on their call e+1 slices), so a
slot is never rewritten while a peer still reads it. Causal attention masks each key by the
global positions of the layout (``sched.sequence``: contiguous, or zigzag for equal work).

The compute role here is the SIMT twin (one query row per thread, plain loads): correct on
any GPU and in the simulator, not fast; the Hopper tile (TMA + wgmma) is still to come. One
node for now: between nodes each slice is to go once to each node's rail peer through the
proxy; a Comm of several nodes is refused.
"""
import math
import sys

import numpy as np
from numba import cuda, types

from .. import primitives as prim
from .._compat import SIMULATOR
from ..arrays import operand
from ..errors import ERR_WORDS, ROLE_COMPUTE, MkError, MkValueError
from ..roles.attention import HEAD_DIM_MAX, attend_slice, load_row, store_row
from ..roles.blocks import begin, copy_tile, publish, wait
from ..sched.sequence import check_layout, position
from .launch import (Frame, Launch, Slot, StreamOrder, array_type, compile_kernel, pack,
                     stream_handle)

Bits4D, Bits7D = array_type(np.uint16, 4), array_type(np.uint16, 7)
F32x3, Words, Flags = array_type(np.float32, 3), array_type(np.uint64, 1), array_type(np.uint32, 1)
Cfg, Record = array_type(np.int64, 1), array_type(np.int64, 1)

#: the launch's small integers (``launch.pack``)
CFG_FIELDS = ("batch", "seq", "heads", "kv_heads", "d", "me", "world", "parts", "causal",
              "zigzag")
(C_BATCH, C_SEQ, C_HEADS, C_KV_HEADS, C_D, C_ME, C_WORLD, C_PARTS, C_CAUSAL,
 C_ZIGZAG) = range(len(CFG_FIELDS))


@cuda.jit
def ring_attention_kernel(q: Bits4D, k: Bits4D, v: Bits4D, out: Bits4D, lse: F32x3,
                          k_words: Words, v_words: Words, kv: Bits7D, kv_words: Words,
                          kv_ptrs: Words, flags: Flags, flag_ptrs: Words, frame: Flags,
                          cfg: Cfg, scale: types.float32, timeout_ns: types.uint64,
                          err: Record, rank: types.int64):
    """q/out [batch, seq, heads, d], k/v [batch, seq, kv_heads, d]: bf16 bits; lse [batch,
    heads, seq] fp32; k_words/v_words: k and v as uint64 words; kv: the symmetric slots [2,
    world, 2 (k, v), batch, seq, kv_heads, d] (kv_words the same memory as words, kv_ptrs its
    address table); flags [world * parts] (flag_ptrs likewise); frame: the op's call counter."""
    epoch, call = begin(frame)
    deadline = prim.globaltimer() + timeout_ns
    me, world, parts = cfg[C_ME], cfg[C_WORLD], cfg[C_PARTS]
    slot = call & 1
    blk = cuda.blockIdx.x
    if blk < parts:                                           # ---- send role
        n = k_words.shape[0]
        chunk = (n + parts - 1) // parts
        off = blk * chunk
        cnt = max(0, min(chunk, n - off))
        base = (slot * world + me) * 2 * n
        for j in range(1, world):
            p = prim.peer_after(me, j, world)
            dst = prim.peer_view(kv_ptrs, p, kv_words)
            copy_tile(k_words, off, dst, base + off, cnt)
            copy_tile(v_words, off, dst, base + n + off, cnt)
            publish(prim.peer_view(flag_ptrs, p, flags), me * parts + blk, epoch)
        return
    # ---- compute role
    batch, seq, heads, kv_heads, d = cfg[C_BATCH], cfg[C_SEQ], cfg[C_HEADS], cfg[C_KV_HEADS], \
        cfg[C_D]
    causal, zigzag = cfg[C_CAUSAL] != 0, cfg[C_ZIGZAG] != 0
    qrow = cuda.local.array(HEAD_DIM_MAX, np.float32)
    acc = cuda.local.array(HEAD_DIM_MAX, np.float32)
    rows = cuda.blockDim.x
    tiles = (seq + rows - 1) // rows
    group = heads // kv_heads
    for it in range(blk - parts, batch * heads * tiles, cuda.gridDim.x - parts):
        b = it // (heads * tiles)
        h = (it // tiles) % heads
        row = (it % tiles) * rows + cuda.threadIdx.x
        active = row < seq
        m = np.float32(-math.inf)
        lsum = np.float32(0.0)
        qpos = 0
        if active:
            load_row(q, b, row, h, d, qrow, scale)
            qpos = position(row, me, seq, world, zigzag)
            for e in range(d):
                acc[e] = np.float32(0.0)
        for j in range(world):
            src = me if j == 0 else prim.peer_after(me, world - j, world)   # me - j
            ks, vs = k, v
            if src != me:
                for p in range(parts):           # every thread: the wait is block-wide
                    if not wait(flags, src * parts + p, epoch, deadline, err, rank,
                                ROLE_COMPUTE):
                        return
                ks, vs = kv[slot, src, 0], kv[slot, src, 1]
            if active:
                m, lsum = attend_slice(qrow, acc, m, lsum, ks, vs, b, h // group, d, seq, qpos,
                                       src, seq, world, zigzag, causal)
        if active:
            store_row(out, lse, acc, m, lsum, b, row, h, d)


class RingAttention:
    """Plan once, call many times: attention over a sequence split across the ranks of a node.

    comm: the :class:`mknumba.Comm` (None: one GPU, see :func:`attention`); batch, seq_local
    (this rank's rows), heads, kv_heads (grouped-query attention: heads % kv_heads == 0),
    head_dim (a multiple of 8, at most 128); causal; layout: how the global sequence is split
    ("contiguous" or "zigzag", ``sched.sequence``; shard and unshard with
    ``mknumba.sched.sequence.shard``/``unshard``); scale (default 1/sqrt(head_dim)).
    Every rank must pass the same values (checked). Calls are asynchronous on the stream of
    the inputs; :meth:`synchronize` waits and raises any device-side timeout.
    """

    name = "RingAttention"

    def __init__(self, comm, batch, seq_local, heads, kv_heads, head_dim, *, causal=False,
                 layout="contiguous", scale=None, send_blocks=None, threads=None,
                 compute_blocks=None):
        dims = dict(batch=batch, seq_local=seq_local, heads=heads, kv_heads=kv_heads,
                    head_dim=head_dim)
        for key, value in dims.items():
            if int(value) != value or value < 1:
                raise MkValueError(f"{self.name}: {key} must be a positive integer, got {value}")
        self.batch, self.seq, self.heads, self.kv_heads, self.d = (int(x) for x in dims.values())
        if self.heads % self.kv_heads:
            raise MkValueError(f"{self.name}: heads={heads} must be a multiple of "
                               f"kv_heads={kv_heads}")
        if self.d % 8 or self.d > HEAD_DIM_MAX:
            raise MkValueError(f"{self.name}: head_dim={head_dim} is not supported: a multiple "
                               f"of 8, at most {HEAD_DIM_MAX}")
        check_layout(layout, self.seq, self.name)
        self.causal, self.layout = bool(causal), layout
        self.scale = float(scale) if scale is not None else 1.0 / math.sqrt(self.d)
        self.comm = comm
        if comm is not None and comm.nodes > 1:
            raise MkValueError(f"{self.name}: {comm.nodes} nodes: not supported yet (one node: "
                               "the slices between nodes are to go through the proxy)")
        self.world = comm.local_size if comm is not None else 1
        self.me = comm.local_rank if comm is not None else 0
        if comm is not None:
            comm.agree(self.name, dict(dims, causal=self.causal, layout=layout,
                                       scale=self.scale), scope="node")
        self.device = comm.device_id if comm is not None else (
            None if SIMULATOR else cuda.get_current_device().id)
        self.threads = int(threads or (8 if SIMULATOR else 128))
        self.parts = 0 if self.world == 1 else int(send_blocks or (1 if SIMULATOR else 8))
        tiles = self.batch * self.heads * -(-self.seq // self.threads)
        sms = 2 if SIMULATOR else cuda.get_current_device().MULTIPROCESSOR_COUNT
        self.compute_blocks = int(compute_blocks or min(tiles, 4 * sms))
        self._allocate()
        self.frame = Frame()
        self.streams = StreamOrder(self.name)
        compiled, bps = compile_kernel(ring_attention_kernel, self.threads, 0)
        grid = self.parts + self.compute_blocks
        if not SIMULATOR and self.parts and grid > bps * sms:
            raise MkValueError(f"{self.name}: {grid} blocks are more than fit on the GPU at "
                               f"once ({bps} per SM)")
        cfg = pack(CFG_FIELDS, batch=self.batch, seq=self.seq, heads=self.heads,
                   kv_heads=self.kv_heads, d=self.d, me=self.me, world=self.world,
                   parts=self.parts, causal=self.causal, zigzag=layout == "zigzag")
        b, s, h, hk, d = self.batch, self.seq, self.heads, self.kv_heads, self.d
        self.launch = Launch(ring_attention_kernel, compiled, dict(
            q=Slot((b, s, h, d)), k=Slot((b, s, hk, d)), v=Slot((b, s, hk, d)),
            out=Slot((b, s, h, d)), lse=Slot((b, h, s)), k_words=Slot((self.kv_words,)),
            v_words=Slot((self.kv_words,)), kv=self._kv_view, kv_words=self._kv_local,
            kv_ptrs=self._kv_ptrs, flags=self._flags_local, flag_ptrs=self._flag_ptrs,
            frame=self.frame.words, cfg=cuda.to_device(cfg), scale=np.float32(self.scale),
            timeout_ns=self.timeout_ns, err=self.err, rank=comm.rank if comm else 0),
            grid, self.threads, 0)
        self.freed = False

    def _allocate(self):
        """The symmetric slots for other ranks' K and V, their flags, the error record."""
        b, s, hk, d, W = self.batch, self.seq, self.kv_heads, self.d, self.world
        self.kv_words = b * s * hk * d // 4
        comm = self.comm
        if comm is not None and W > 1:
            self._kv = comm.alloc_symmetric((2 * W * 2 * self.kv_words,), np.uint64)
            self._fl = comm.alloc_flags(W * self.parts)
            self._buffers = [self._kv, self._fl]
            self._kv_local, self._kv_ptrs = self._kv.local, self._kv.ptrs
            self._flags_local, self._flag_ptrs = self._fl.local, self._fl.ptrs
            shape = (2, W, 2, b, s, hk, d)
        else:                     # one GPU: no slots to fill, the kernel reads k and v
            self._buffers = []
            self._kv_local = cuda.to_device(np.zeros(1, np.uint64))
            self._kv_ptrs = cuda.to_device(np.zeros(1, np.uint64))
            self._flags_local = cuda.to_device(np.zeros(1, np.uint32))
            self._flag_ptrs = cuda.to_device(np.zeros(1, np.uint64))
            shape = (1, 1, 1, 1, 1, 1, 4)
        self._kv_view = self._kv_local.view(np.uint16).reshape(shape)
        if comm is not None:
            self.err, self.timeout_ns = comm.new_error_record(), comm.timeout_ns
        else:
            from ..runtime import default_timeout_ns
            self.err = cuda.mapped_array(ERR_WORDS, dtype=np.int64)
            self.err[:] = 0
            self.timeout_ns = default_timeout_ns()

    def __call__(self, q, k, v, out=None, lse=None, stream=None):
        """q [batch, seq_local, heads, d], k and v [batch, seq_local, kv_heads, d] (bf16) ->
        ``(out, lse)``: out like q (bf16), lse [batch, heads, seq_local] fp32 (natural log).
        PyTorch tensors in -> tensors out; other arrays (bf16 as ml_dtypes.bfloat16 or bits as
        uint16/int16) -> numba arrays (out as bf16 bits, uint16)."""
        if self.freed:
            raise MkError(f"{self.name}: called after free()")
        self._check_error(f"{self.name} (an earlier call)")
        b, s, h, hk, d, dev = self.batch, self.seq, self.heads, self.kv_heads, self.d, self.device
        Q = operand(q, self.name, "q", shape=(b, s, h, d), device_id=dev, align=8)
        K = operand(k, self.name, "k", shape=(b, s, hk, d), device_id=dev, align=8)
        V = operand(v, self.name, "v", shape=(b, s, hk, d), device_id=dev, align=8)
        if not Q.torch == K.torch == V.torch:
            raise MkValueError(f"{self.name}: q, k and v must all be PyTorch tensors or all "
                               "device arrays")
        if out is None:
            out = _empty(q, Q.torch, (b, s, h, d), "bfloat16")
        if lse is None:
            lse = _empty(q, Q.torch, (b, h, s), "float32")
        O = operand(out, self.name, "out", shape=(b, s, h, d), device_id=dev, align=8)
        L_ = operand(lse, self.name, "lse", dtypes=("float32",), shape=(b, h, s),
                     device_id=dev, align=4)
        st = stream_handle(stream, dev if Q.torch else None)
        self.streams.enter(st)
        L = self.launch
        u16 = np.uint16
        L.bind("q", Q.as_param(u16, (b, s, h, d)))
        L.bind("k", K.as_param(u16, (b, s, hk, d)))
        L.bind("v", V.as_param(u16, (b, s, hk, d)))
        L.bind("k_words", K.as_param(np.uint64, (self.kv_words,)))
        L.bind("v_words", V.as_param(np.uint64, (self.kv_words,)))
        L.bind("out", O.as_param(u16, (b, s, h, d)))
        L.bind("lse", L_.as_param(np.float32, (b, h, s)))
        L(st)
        return out, lse

    def _check_error(self, what):
        if self.comm is not None:
            self.comm.check(self.err, what)
        else:
            from ..errors import MkTimeoutError, describe_error_record
            msg = describe_error_record(self.err, what)
            if msg:
                raise MkTimeoutError(msg)

    def synchronize(self, stream=0):
        """Wait for this rank's calls; raise MkTimeoutError if a device wait expired."""
        if self.comm is not None:
            self.comm.synchronize(stream)
        elif not SIMULATOR:
            cuda.synchronize()
        self._check_error(self.name)

    def _start_at(self, calls):
        """Tests: set this rank's state as if ``calls`` calls had run (see GemmReduce)."""
        epoch = (calls - 1) % 0xFFFFFFFF + 1 if calls else 0
        self.synchronize()
        self.frame.set(calls, epoch)
        self._flags_local.copy_to_device(np.full(self._flags_local.shape, epoch, np.uint32))

    def free(self):
        """Collective: release the op's symmetric buffers (waits for this rank's calls)."""
        if self.freed:
            return
        self.synchronize()
        for buf in self._buffers:
            self.comm.free(buf)
        self.freed = True


def _empty(like, torch, shape, dtype):
    if torch:
        t = sys.modules["torch"]
        return t.empty(shape, dtype=getattr(t, dtype), device=like.device)
    return cuda.device_array(shape, np.uint16 if dtype == "bfloat16" else np.float32)


_SINGLE = {}


def attention(q, k, v, causal=False, scale=None, out=None, lse=None, stream=None):
    """Attention on one GPU: q [batch, seq, heads, d], k and v [batch, seq, kv_heads, d] (bf16)
    -> ``(out, lse)``, out like q (bf16) and lse [batch, heads, seq] (fp32, natural log);
    causal masks keys after each query. The compute role of :class:`RingAttention` on a world
    of one (planned once per shape)."""
    if not hasattr(q, "shape") or len(q.shape) != 4 or not hasattr(k, "shape") or \
            len(k.shape) != 4:
        raise MkValueError("mknumba.attention: q, k and v must be 4-d [batch, seq, heads, d]")
    b, s, h, d = (int(x) for x in q.shape)
    key = (b, s, h, int(k.shape[2]), d, bool(causal), scale,
           None if SIMULATOR else cuda.get_current_device().id)
    if key not in _SINGLE:
        _SINGLE[key] = RingAttention(None, b, s, h, int(k.shape[2]), d, causal=causal,
                                     scale=scale)
    return _SINGLE[key](q, k, v, out=out, lse=lse, stream=stream)


__all__ = ["RingAttention", "attention"]
