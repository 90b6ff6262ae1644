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
epoch parity (slot = e & 1): a rank can only get one call ahead of a peer (it cannot finish
call e+1 before the peer has sent e+1, which follows the peer's call e in stream order), so the
slot it writes in call e+2 is one the peer has finished reading.
"""
import numpy as np
from numba import cuda

from .. import primitives as prim
from .._compat import SIMULATOR
from ..arrays import as_device_array, empty
from ..errors import ROLE_RECV, MkError, MkValueError
from ..roles.blocks import copy_tile, publish, wait


@cuda.jit
def allgather_kernel(shard, out, stage, stage_ptrs, flags, flag_ptrs, epoch, me, members,
                     tile, n_send, timeout_ns, err, rank):
    """shard: [n] raw words (any unsigned width); out: [members*n]; stage: symmetric
    [2*members*n]; tile: words per tile; flags: symmetric uint32
    [members*tiles]; *_ptrs: peers' addresses of stage/flags; err: int64[8] error record."""
    deadline = prim.globaltimer() + timeout_ns
    n = shard.size
    tiles = (n + tile - 1) // tile
    slot = epoch & 1
    b = cuda.blockIdx.x
    if b < n_send:                                   # ---- send role
        for t in range(b, tiles, n_send):
            off = t * tile
            cnt = min(tile, n - off)
            copy_tile(shard, off, out, me * n + off, cnt)
            for j in range(1, members):
                p = (me + j) % members               # stagger peers so links share the load
                peer_stage = prim.peer_view(stage_ptrs, p, stage)
                copy_tile(shard, off, peer_stage, (slot * members + me) * n + off, cnt)
                publish(prim.peer_view(flag_ptrs, p, flags), me * tiles + t, epoch)
    else:                                            # ---- receive role
        n_recv = cuda.gridDim.x - n_send
        for job in range(b - n_send, (members - 1) * tiles, n_recv):
            k = job // tiles
            t = job - k * tiles
            src = (me + 1 + k) % members
            if not wait(flags, src * tiles + t, epoch, deadline, err, rank, ROLE_RECV):
                return
            off = t * tile
            copy_tile(stage, (slot * members + src) * n + off, out, src * n + off,
                      min(tile, n - off))


class AllGather:
    """Plan once, call many times: ``out = op(x)`` gathers ``x`` from every member.

    comm: a :class:`mknumba.Comm`. shape/dtype: of each rank's ``x`` (every member must pass
    the same). scope: ``"node"`` (the GPUs of this node) or ``"world"`` (every rank; needs a
    single node for now: the inter-node stage goes through the proxy).
    Output: a new device array of shape ``(members,) + shape`` unless ``out`` is given.
    Calls are asynchronous on ``stream``; :meth:`synchronize` waits and raises any timeout.
    """

    def __init__(self, comm, shape, dtype, *, scope="node", send_blocks=None, recv_blocks=None,
                 tile=None, threads=None):
        self.shape = tuple(int(s) for s in np.atleast_1d(shape))
        if not self.shape or any(s <= 0 for s in self.shape):
            raise MkValueError(f"AllGather: shape must have positive extents, got {shape}")
        self.dtype = np.dtype(dtype)
        if self.dtype.kind not in "iuf":
            raise MkValueError(f"AllGather: dtype must be an integer or float type, got {dtype}")
        if scope == "world" and comm.nodes > 1:
            raise MkValueError("AllGather(scope='world') spans nodes: not supported yet; use "
                               "scope='node' (the inter-node stage goes through the proxy)")
        self.comm = comm
        group, ranks = comm._group(scope)
        self.members, self.me = group.Get_size(), group.Get_rank()
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
        self.epoch = 0

    def __call__(self, x, out=None, stream=0):
        """x: [*shape] on this rank's GPU -> out: [members, *shape]."""
        self.comm.check(self.err, "AllGather (an earlier call)")
        x = as_device_array(x, "x", dtype=self.dtype, shape=self.shape,
                            device_id=self.comm.device_id)
        full = (self.members,) + self.shape
        if out is None:
            out = empty(full, self.dtype)
        else:
            out = as_device_array(out, "out", dtype=self.dtype, shape=full,
                                  device_id=self.comm.device_id)
        self.epoch = (self.epoch + 1) & 0xFFFFFFFF
        grid = self.send_blocks + self.recv_blocks
        allgather_kernel[grid, self.threads, stream](
            x.reshape(self.count).view(self.word), out.reshape(-1).view(self.word),
            self.stage.local, self.stage.ptrs, self.flags.local, self.flags.ptrs,
            np.uint32(self.epoch), self.me, self.members, self.tile, self.send_blocks,
            np.uint64(self.comm.timeout_ns), self.err, self.comm.rank)
        return out

    def synchronize(self, stream=0):
        """Wait for this rank's calls; raise MkTimeoutError if a wait expired."""
        self.comm.synchronize(stream)
        self.comm.check(self.err, "AllGather")

    def free(self):
        """Collective: release the op's symmetric buffers."""
        if self.stage is None:
            raise MkError("AllGather already freed")
        self.comm.free(self.stage)
        self.comm.free(self.flags)
        self.stage = self.flags = None
