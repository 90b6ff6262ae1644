"""AllGather over NVLink: every member's shard, in rank order, on every member.

One persistent launch; blocks take roles by index, senders first (a block may only wait on
lower-numbered blocks or on other ranks, which keeps the simulator's one-block-at-a-time order
deadlock-free):

    send     blocks [0, S)      for each tile t of my shard:
                                  out[me, t] <- shard[t]                       (local copy)
                                  for each peer p:  p.stage[slot, me, t] <- shard[t]
                                                    publish p.flags[me, t] = epoch
    receive  blocks [S, S+R)    for each (src, t), src != me:
                                  wait flags[src, t] >= epoch
                                  out[src, t] <- stage[slot, src, t]

Epochs, not resets: call e publishes e; no flag is ever cleared. Staging is double-buffered by
call parity (slot = call & 1): a rank can only get one call ahead of a peer (it cannot finish
call e+1 before the peer has sent e+1, which follows the peer's call e in stream order), so the
slot it writes in call e+2 is one the peer has finished reading.
"""
import sys

import numpy as np
from numba import cuda, types

from .. import primitives as prim
from .._compat import SIMULATOR
from ..arrays import is_torch, operand, torch_ptr
from ..errors import ERR_SET, ROLE_RECV, MkError, MkValueError
from ..roles.blocks import begin, copy_tile, publish, wait
from .launch import Frame, Launch, Slot, StreamOrder, array_type, compile_kernel, stream_handle

Flags, Ptrs, Record = array_type(np.uint32, 1), array_type(np.uint64, 1), array_type(np.int64, 1)
_KERNELS = {}    # word dtype -> kernel


def make_kernel(word):
    """The AllGather kernel over raw words of ``word`` (any unsigned width)."""
    Words = array_type(word, 1)
    i64 = types.int64

    @cuda.jit
    def allgather_kernel(shard: Words, out: Words, stage: Words, stage_ptrs: Ptrs, flags: Flags,
                         flag_ptrs: Ptrs, frame: Ptrs, me: i64, members: i64, tile: i64,
                         n_send: i64, timeout_ns: types.uint64, err: Record, rank: i64):
        """shard: [n] raw words; out: [members*n]; stage: symmetric [2*members*n]; tile:
        words per tile; flags: symmetric uint32 [members*tiles]; *_ptrs: peers' addresses of
        stage/flags; frame: the op's call counter; err: int64[8] error record."""
        epoch, call = begin(frame)
        deadline = prim.globaltimer() + timeout_ns
        n = shard.size
        tiles = (n + tile - 1) // tile
        slot = call & 1
        b = cuda.blockIdx.x
        if b < n_send:                                   # ---- send role
            for t in range(b, tiles, n_send):
                off = t * tile
                cnt = min(tile, n - off)
                copy_tile(shard, off, out, me * n + off, cnt)
                for j in range(1, members):
                    p = prim.peer_after(me, j, members)  # stagger peers: links share the load
                    peer_stage = prim.peer_view(stage_ptrs, p, stage)
                    copy_tile(shard, off, peer_stage, (slot * members + me) * n + off, cnt)
                    publish(prim.peer_view(flag_ptrs, p, flags), me * tiles + t, epoch)
        else:                                            # ---- receive role
            n_recv = cuda.gridDim.x - n_send
            for job in range(b - n_send, (members - 1) * tiles, n_recv):
                k = job // tiles
                t = job - k * tiles
                src = prim.peer_after(me, 1 + k, members)
                if not wait(flags, src * tiles + t, epoch, deadline, err, rank, ROLE_RECV):
                    return
                off = t * tile
                copy_tile(stage, (slot * members + src) * n + off, out, src * n + off,
                          min(tile, n - off))

    return allgather_kernel


class AllGather:
    """Plan once, call many times: ``out = op(x)`` gathers ``x`` from every member.

    comm: a :class:`mknumba.Comm`. shape/dtype: of each rank's ``x`` (every member must pass
    the same; checked at construction). scope: ``"node"`` (the GPUs of this node) or
    ``"world"`` (every rank; needs a single node for now: the inter-node stage goes through
    the proxy). Output: a new device array of shape ``(members,) + shape`` unless ``out`` is
    given. Calls are asynchronous on ``stream`` (PyTorch tensors: the current PyTorch stream);
    :meth:`synchronize` waits and raises any timeout.
    """

    name = "AllGather"

    def __init__(self, comm, shape, dtype, *, scope="node", send_blocks=None, recv_blocks=None,
                 tile=None, threads=None):
        self.shape = tuple(int(s) for s in np.atleast_1d(shape))
        if not self.shape or any(s <= 0 for s in self.shape):
            raise MkValueError(f"AllGather: shape must have positive extents, got {shape}")
        self.dtype = np.dtype(dtype)
        if self.dtype.kind not in "iuf" and self.dtype.name != "bfloat16":
            raise MkValueError(f"AllGather: dtype must be an integer or float type, got {dtype}")
        if scope == "world" and comm.nodes > 1:
            raise MkValueError("AllGather(scope='world') spans nodes: not supported yet; use "
                               "scope='node' (the inter-node stage goes through the proxy)")
        self.comm = comm
        group, ranks = comm._group(scope)
        self.members, self.me = group.Get_size(), group.Get_rank()
        comm.agree(self.name, dict(shape=self.shape, dtype=self.dtype.name), scope)
        self.count = int(np.prod(self.shape))
        # Defaults: (simulator, GPU). The simulator runs every thread as a Python thread.
        given = dict(tile=tile, threads=threads, send_blocks=send_blocks, recv_blocks=recv_blocks)
        defaults = dict(tile=(64, 8192), threads=(16, 512), send_blocks=(2, 32),
                        recv_blocks=(2, 32))
        for name, value in given.items():
            value = int(defaults[name][0 if SIMULATOR else 1] if value is None else value)
            if value < 1:
                raise MkValueError(f"AllGather: {name} must be >= 1, got {value}")
            setattr(self, name, value)
        # The kernel moves raw words: 8-byte ones when the shard allows (wider stores over
        # NVLink), whatever the element type.
        nbytes = self.count * self.dtype.itemsize
        self.word = next(np.dtype(w) for w in (np.uint64, np.uint32, np.uint16, np.uint8)
                         if nbytes % np.dtype(w).itemsize == 0)
        self.words = nbytes // self.word.itemsize
        tiles = -(-self.words // self.tile)
        self.stage = comm.alloc_symmetric((2 * self.members * self.words,), self.word, scope)
        self.flags = comm.alloc_flags(self.members * tiles, scope)
        self.err = comm.new_error_record()
        self.frame = Frame(self.send_blocks + self.recv_blocks)
        self.streams = StreamOrder(self.name)
        self._torch_dtype = None
        if self.word not in _KERNELS:
            _KERNELS[self.word] = make_kernel(self.word)
        kernel = _KERNELS[self.word]
        compiled, _ = compile_kernel(kernel, self.threads, 0)
        self.launch = Launch(kernel, compiled, dict(
            shard=Slot((self.words,)), out=Slot((self.members * self.words,)),
            stage=self.stage.local, stage_ptrs=self.stage.ptrs, flags=self.flags.local,
            flag_ptrs=self.flags.ptrs, frame=self.frame.words, me=self.me,
            members=self.members, tile=self.tile, n_send=self.send_blocks,
            timeout_ns=comm.timeout_ns, err=self.err, rank=comm.rank),
            self.send_blocks + self.recv_blocks, self.threads, 0)

    def __call__(self, x, out=None, stream=None):
        """x: [*shape] on this rank's GPU -> out: [members, *shape] (same kind and dtype)."""
        if (out is not None and stream is None and self.stage is not None and is_torch(x)
                and not self.err[ERR_SET]):                 # the hot path: tensors
            dev = self.comm.device_id
            if self._torch_dtype is None:     # False: no such torch dtype, no hot path
                self._torch_dtype = getattr(sys.modules["torch"], self.dtype.name, False)
            w = self.word.itemsize
            px = self._torch_dtype and torch_ptr(x, self.shape, dev, dtype=self._torch_dtype,
                                                 align=w)
            po = px and torch_ptr(out, (self.members,) + self.shape, dev,
                                  dtype=self._torch_dtype, align=w)
            if po:
                s = stream_handle(None, dev)
                with self.launch.lock:
                    self.streams.enter(s)
                    self.launch.bind("shard", px)
                    self.launch.bind("out", po)
                    self.launch(s)
                return out
        if self.stage is None:
            raise MkError("AllGather: called after free()")
        self.comm.check(self.err, "AllGather (an earlier call)")
        dt = (self.dtype.name,)
        X = operand(x, self.name, "x", dtypes=dt, shape=self.shape,
                    device_id=self.comm.device_id, align=self.word.itemsize)
        full = (self.members,) + self.shape
        if out is None:
            if X.torch:
                import torch
                out = torch.empty(full, dtype=x.dtype, device=x.device)
            else:
                out = cuda.device_array(full, self.dtype)
        O = operand(out, self.name, "out", dtypes=dt, shape=full,
                    device_id=self.comm.device_id, align=self.word.itemsize)
        s = stream_handle(stream, X.device if X.torch else None)
        with self.launch.lock:
            self.streams.enter(s)
            self.launch.bind("shard", X.as_param(self.word, (self.words,)))
            self.launch.bind("out", O.as_param(self.word, (self.members * self.words,)))
            self.launch(s)
        return out

    def synchronize(self, stream=None):
        """Wait for this rank's calls (on ``stream``, default the stream of the last call);
        raise MkTimeoutError if a wait expired."""
        self.comm.synchronize(stream if stream is not None else (self.streams.last or 0))
        self.comm.check(self.err, "AllGather")

    def _start_at(self, calls):
        """Tests: set this rank's state as if ``calls`` calls had run (the call counter and
        every flag), e.g. just short of 2**32. Every rank, between calls, after a sync."""
        self.comm.synchronize(self.streams.last or 0)
        self.frame.start_at(calls, [self.flags.local])

    def free(self):
        """Collective: release the op's symmetric buffers."""
        if self.stage is None:
            raise MkError("AllGather already freed")
        self.comm.synchronize(self.streams.last or 0)
        self.comm.free(self.stage)
        self.comm.free(self.flags)
        self.stage = self.flags = None
