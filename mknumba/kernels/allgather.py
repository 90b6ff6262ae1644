"""AllGather: every member's shard, in member order, on every member; within a node (NVLink)
or across the world (NVLink inside each node, the host proxy between nodes).

One persistent launch; blocks take roles by index, senders first (a block may only wait on
lower-numbered blocks, on the proxy or on other ranks, which keeps the simulator's
one-block-at-a-time order deadlock-free). Members are numbered as in the output (world ranks
for ``scope="world"``, node ranks for ``"node"``); a node's G GPUs are members
``base .. base + G - 1`` and ``q`` below is a GPU of this node (local index):

    send     blocks [0, S)      between nodes first, for each tile t of my shard:
                                  stage[slot, me, t] <- shard[t]; publish flags[me, t] (fence)
                                  for each rail peer r: a proxy command: my stage tile into
                                    r's stage[slot, me, t], then r.flags[me, t] = epoch
                                then, for each tile t of my shard:
                                  out[me, t] <- shard[t]                       (local copy)
                                  for each other GPU q of the node: q.stage[slot, me, t] <-
                                    shard[t]; publish q.flags[me, t] = epoch   (NVLink)
    forward  blocks [S, S+F)    between nodes, G > 1: for each rail peer r, each tile t:
                                  wait flags[r, t] (the proxy sets it); for each other GPU q
                                  of the node: q.stage[slot, r, t] <- stage[slot, r, t];
                                  publish q.flags[r, t]
    receive  blocks [S+F, ..)   for each (src, t), src != me:
                                  wait flags[src, t] >= epoch
                                  out[src, t] <- stage[slot, src, t]

Each shard crosses the network once per other node (to the rail peer, from the launch on) and
each NVLink once. Forward waits only on the proxy, whose commands the send roles enqueue
without waiting on anything but ring credits; receive waits on send and forward.

Epochs, not resets: call e publishes e; no flag is ever cleared. Staging is double-buffered by
call parity (slot = call & 1): a rank can only get one call ahead of any other member (it
cannot finish call e+1 before every member has sent e+1, which follows that member's call e
in stream order), so the slot it writes, or has the proxy or a forwarder write, in call e+2
is one every reader has finished with, and one the proxy finished sending from.
"""
import sys

import numpy as np
from numba import cuda, types

from .. import primitives as prim
from .._compat import SIMULATOR
from ..arrays import BF16, is_torch, operand, refuse_overlap, torch_ptr, unshared
from ..errors import ERR_SET, ROLE_RECV, MkError, MkValueError, positive_ints
from ..roles.blocks import begin, copy_tile, publish, wait
from ..roles.send import enqueue_rail
from .launch import Launch, Slot, array_type, compile_kernel
from .lifetime import Frame, OpLifetime
from .streams import outputs_in_capture, stream_handle

Flags, Ptrs, Record = array_type(np.uint32, 1), array_type(np.uint64, 1), array_type(np.int64, 1)
Ints = array_type(np.int32, 1)
_KERNELS = {}    # word dtype -> kernel


def make_kernel(word):
    """The AllGather kernel over raw words of ``word`` (any unsigned width)."""
    Words = array_type(word, 1)
    i64 = types.int64

    @cuda.jit(device=True, inline=True)
    def send_remote(shard, stage, flags, rail, n_rail, proxy, wins, me, members, n, tile,
                    wbytes, tiles, first, step, slot, ctx):
        """Between nodes: this block's tiles of my shard into this GPU's stage (the proxy
        sends from there), each announced there (the system fence orders the copy before the
        proxy's read), then one proxy command per rail peer; False if a ring credit never
        came (recorded; the peers' waits expire too)."""
        epoch, deadline, err, rank = ctx
        for jt in range(prim.steps(first, tiles, step)):
            t = first + jt * step
            off = t * tile
            cnt = min(tile, n - off)
            at = (slot * members + me) * n + off
            copy_tile(shard, off, stage, at, cnt)
            publish(flags, me * tiles + t, epoch)
            if not enqueue_rail(proxy, rail[:n_rail], wins[0], at * wbytes, cnt * wbytes, t,
                                wins[1], me * tiles + t, epoch, deadline, err, rank):
                return False                  # the whole block, together
        return True

    @cuda.jit
    def allgather_kernel(shard: Words, out: Words, stage: Words, stage_ptrs: Ptrs, flags: Flags,
                         flag_ptrs: Ptrs, rail: Ints, ring: Flags, head: Flags, tail: Flags,
                         frame: Ptrs, me: i64, members: i64, local: i64, g: i64, n_rail: i64,
                         tile: i64, wbytes: i64, n_send: i64, n_fwd: i64, win_stage: i64,
                         win_flags: i64, timeout_ns: types.uint64, err: Record, rank: i64):
        """shard: [n] raw words; out: [members*n]; stage: symmetric over the node [2*members*n];
        tile: words per tile; flags: symmetric uint32 [members*tiles]; *_ptrs: the node's
        addresses of stage/flags, by local index; me: my member index, local: my index among
        the node's g GPUs; rail: the first n_rail entries are my rail peers' member indices
        (between nodes; n_rail = 0 inside one); ring/head/tail: the proxy's command ring;
        win_*: the proxy windows of stage and flags; wbytes: bytes per word; frame: the op's
        call counter; err: int64[8] error record."""
        epoch, call = begin(frame)
        if call == 0:
            return       # the op has ended on this rank: a graph replayed after it
        deadline = prim.globaltimer() + timeout_ns
        n = shard.size
        tiles = prim.udiv32(n + tile - 1, tile)
        slot = call & 1
        b = cuda.blockIdx.x
        if b < n_send:                                   # ---- send role
            if n_rail > 0 and not send_remote(
                    shard, stage, flags, rail, n_rail, (ring, head, tail),
                    (win_stage, win_flags), me, members, n, tile, wbytes, tiles, b, n_send,
                    slot, (epoch, deadline, err, rank)):
                return
            for jt in range(prim.steps(b, tiles, n_send)):
                t = b + jt * n_send
                off = t * tile
                cnt = min(tile, n - off)
                copy_tile(shard, off, out, me * n + off, cnt)
                for j in range(1, g):
                    q = prim.peer_after(local, j, g)     # stagger peers: links share the load
                    peer_stage = prim.peer_view(stage_ptrs, q, stage)
                    copy_tile(shard, off, peer_stage, (slot * members + me) * n + off, cnt)
                    publish(prim.peer_view(flag_ptrs, q, flags), me * tiles + t, epoch)
        elif b < n_send + n_fwd:                         # ---- forward role
            f = b - n_send
            for i in range(n_rail):
                src = rail[i]
                for jt in range(prim.steps(f, tiles, n_fwd)):
                    t = f + jt * n_fwd
                    if not wait(flags, src * tiles + t, epoch, deadline, err, rank, ROLE_RECV):
                        return
                    off = t * tile
                    at = (slot * members + src) * n + off
                    cnt = min(tile, n - off)
                    for j in range(1, g):
                        q = prim.peer_after(local, j, g)
                        copy_tile(stage, at, prim.peer_view(stage_ptrs, q, stage), at, cnt)
                        publish(prim.peer_view(flag_ptrs, q, flags), src * tiles + t, epoch)
        else:                                            # ---- receive role
            first = b - n_send - n_fwd
            n_recv = cuda.gridDim.x - n_send - n_fwd
            for jj in range(prim.steps(first, (members - 1) * tiles, n_recv)):
                job = first + jj * n_recv
                k = prim.udiv32(job, tiles)
                t = job - k * tiles
                src = prim.peer_after(me, 1 + k, members)
                if not wait(flags, src * tiles + t, epoch, deadline, err, rank, ROLE_RECV):
                    return
                off = t * tile
                copy_tile(stage, (slot * members + src) * n + off, out, src * n + off,
                          min(tile, n - off))

    return allgather_kernel


class AllGather(OpLifetime):
    """Plan once, call many times: ``out = op(x)`` gathers ``x`` from every member.

    comm: a :class:`mknumba.Comm`. shape/dtype: of each rank's ``x`` (every member must pass
    the same, and the same ``tile``; checked at construction, over the scope). scope:
    ``"node"`` (the GPUs of this node) or ``"world"`` (every rank, in world rank order). Across
    nodes the schedule is hierarchical: each shard goes once to each other node's rail peer
    (same local rank) through the host proxy, its commands enqueued at launch, and that GPU
    forwards it to the rest of its node over NVLink (``forward_blocks``, default 1 in the
    simulator, 16 on a GPU; none with one GPU per node); a tile is then one proxy command
    (default 1 MiB on a GPU). Output: a new device array of shape ``(members,) + shape``
    unless ``out`` is given. Calls are asynchronous on ``stream`` (PyTorch tensors: the
    current PyTorch stream); :meth:`synchronize` waits and raises any timeout.
    """

    name = "AllGather"

    def __init__(self, comm, shape, dtype, *, scope="node", send_blocks=None, recv_blocks=None,
                 forward_blocks=None, tile=None, threads=None):
        self._plan_on(comm)
        with self._planning_starts(scope) as agreed:
            group, self._member_ranks = comm._group(scope)
            self._plan(comm, shape, dtype, scope, group, agreed, tile, threads, send_blocks,
                       recv_blocks, forward_blocks)
        # the symmetric buffers span one node (NVLink); the proxy carries the rest
        buf_scope = "node" if comm.nodes > 1 else scope
        self.stage = comm.alloc_symmetric((2 * self.members * self.words,), self.word,
                                          buf_scope)
        self.flags = comm.alloc_flags(self.members * self.tiles, buf_scope)
        self._buffers, self._epoch_flags = [self.stage, self.flags], [self.flags.local]
        nbytes = self.words * self.word.itemsize
        self._hot_sizes = (self.members * nbytes, nbytes)     # out, x: arrays.unshared
        self._unshared = set()
        z32 = np.zeros(1, np.uint32)
        if self.remote:
            wins = (comm.proxy.register(self.stage), comm.proxy.register(self.flags))
            ring, head, tail = comm.proxy.device_args()
            rail = np.array(comm.rail_peers, np.int32)
        else:
            wins = (0, 0)
            ring, head, tail = (cuda.mapped_array(12, np.uint32), cuda.to_device(z32),
                                cuda.mapped_array(1, np.uint32))
            rail = np.zeros(1, np.int32)
        with self._planning_ends(group):
            self.err = comm.new_error_record()
            grid = self.send_blocks + self.forward_blocks + self.recv_blocks
            self.frame = Frame(grid)
            self._torch_dtype = None
            if self.word not in _KERNELS:
                _KERNELS[self.word] = make_kernel(self.word)
            kernel = _KERNELS[self.word]
            compiled, _ = compile_kernel(kernel, self.threads, 0)
            self.launch = Launch(kernel, compiled, dict(
                shard=Slot((self.words,)), out=Slot((self.members * self.words,)),
                stage=self.stage.local, stage_ptrs=self.stage.ptrs, flags=self.flags.local,
                flag_ptrs=self.flags.ptrs, rail=cuda.to_device(rail), ring=ring, head=head,
                tail=tail, frame=self.frame.words, me=self.me, members=self.members,
                local=comm.local_rank, g=comm.local_size,
                n_rail=len(comm.rail_peers) if self.remote else 0, tile=self.tile,
                wbytes=self.word.itemsize, n_send=self.send_blocks, n_fwd=self.forward_blocks,
                win_stage=wins[0], win_flags=wins[1], timeout_ns=comm.timeout_ns, err=self.err,
                rank=comm.rank), grid, self.threads, 0)

    def _plan(self, comm, shape, dtype, scope, group, agreed, tile, threads, send_blocks,
              recv_blocks, forward_blocks):
        """Check every argument and resolve the options (sets the attributes the op reads);
        ``agreed``: what every member must ask for alike (``OpLifetime._planning_starts``)."""
        given = tuple(np.atleast_1d(shape).tolist())
        try:
            dtype_name = str(np.dtype(dtype))
        except TypeError:
            dtype_name = None
        # every member must ask for the same exchange, in the caller's terms
        agreed.update(shape=given, dtype=dtype_name or repr(dtype), tile=tile)
        if dtype_name is None:
            raise MkValueError(f"AllGather: dtype {dtype!r} is not a NumPy dtype")
        if not given or any(not isinstance(s, int) or s <= 0 for s in given):
            raise MkValueError(f"AllGather: shape must have positive integer extents, got "
                               f"{shape}")
        self.shape = given
        self.dtype = np.dtype(dtype)
        if self.dtype.kind not in "iuf" and self.dtype.name != "bfloat16":
            raise MkValueError(f"AllGather: dtype must be an integer or float type, got {dtype}")
        self.members, self.me = group.Get_size(), group.Get_rank()
        # between nodes: the proxy to the rail peers, a forward role inside each node
        self.remote = scope == "world" and comm.nodes > 1
        if self.remote and comm.proxy is None:
            raise MkError(f"AllGather: {comm.nodes} nodes need the proxy (mknumba.proxy), "
                          "which this Comm did not start")
        self.count = int(np.prod(self.shape))
        # The kernel moves raw words: 8-byte ones when the shard allows (wider stores over
        # NVLink), whatever the element type.
        nbytes = self.count * self.dtype.itemsize
        self.word = next(np.dtype(w) for w in (np.uint64, np.uint32, np.uint16, np.uint8)
                         if nbytes % np.dtype(w).itemsize == 0)
        self.words = nbytes // self.word.itemsize
        # Defaults: (simulator, GPU). The simulator runs every thread as a Python thread.
        # Between nodes a tile is one proxy command: about 1 MiB on a GPU (the host proxy
        # spends microseconds per command). The GPU block counts are those of the AllGather
        # benchmark (0.67x NCCL at 256 MiB, benchmarks/NOTES.md); they were not swept.
        fwd = comm.local_size > 1 if self.remote else False
        given = dict(tile=tile, threads=threads, send_blocks=send_blocks,
                     recv_blocks=recv_blocks, forward_blocks=forward_blocks)
        defaults = dict(tile=(64, (1 << 20) // self.word.itemsize if self.remote else 8192),
                        threads=(16, 512), send_blocks=(2, 32), recv_blocks=(2, 32),
                        forward_blocks=(1, 16))
        for name, value in positive_ints("AllGather", **given).items():
            setattr(self, name, defaults[name][0 if SIMULATOR else 1] if value is None
                    else value)
        self.tiles = -(-self.words // self.tile)
        if not fwd:
            self.forward_blocks = 0

    def _flag_name(self, role, index, array=0):
        """The receive role's waits (forward's too) watch flags[src * tiles + t]: member
        src's tile t has arrived."""
        src, t = divmod(index, self.tiles)
        if role == ROLE_RECV and src < self.members:
            return f"rank {self._member_ranks[src]}'s tile {t} of its shard"
        return None

    def __call__(self, x, out=None, stream=None):
        """x: [*shape] on this rank's GPU -> out: [members, *shape] (same kind and dtype).
        ``x`` may be ``out[me]`` (in place); no other part of ``out``."""
        if (out is not None and stream is None and not self.freed and is_torch(x)
                and not self.remote and not self.err[ERR_SET]):    # the hot path: tensors
            dev = self.comm.device_id
            if self._torch_dtype is None:     # False: no such torch dtype, no hot path
                self._torch_dtype = getattr(sys.modules["torch"], self.dtype.name, False)
            w = self.word.itemsize
            px = self._torch_dtype and torch_ptr(x, self.shape, dev, dtype=self._torch_dtype,
                                                 align=w)
            po = px and torch_ptr(out, (self.members,) + self.shape, dev,
                                  dtype=self._torch_dtype, align=w)
            if po and (px == po + self.me * self.words * w or
                       unshared(self._unshared, (po, px), self._hot_sizes, 1)):
                s = stream_handle(None, dev)
                with self.launch.lock:
                    self.streams.enter(s)
                    self.launch.binder("shard", "out")(s, px, po)
                return out
        return self._checked_call(self._call, x, out, stream)

    def _call(self, x, out, stream):
        """A call with every check."""
        dt = BF16 if self.dtype.name == "bfloat16" else (self.dtype.name,)   # bf16: or its bits
        X = operand(x, self.name, "x", dtypes=dt, shape=self.shape,
                    device_id=self.comm.device_id, align=self.word.itemsize)
        full = (self.members,) + self.shape
        s = stream_handle(stream, X.device if X.torch else None)
        outputs_in_capture(self.name, s, out=out)
        if out is None:
            if X.torch:
                import torch
                out = torch.empty(full, dtype=x.dtype, device=x.device)
            else:
                out = cuda.device_array(full, self.dtype)
        O = operand(out, self.name, "out", dtypes=dt, shape=full,
                    device_id=self.comm.device_id, align=self.word.itemsize)
        if X.ptr != O.ptr + self.me * X.nbytes:        # x = out[me] gathers in place
            refuse_overlap(self.name, (O,), (X,))
        with self.launch.lock:
            self.streams.enter(s)
            self.launch.binder("shard", "out")(s, X.as_param(self.word, (self.words,)),
                                               O.as_param(self.word, (self.members * self.words,)))
        return out
