"""Symmetric memory: the same buffer on every rank of a group, each rank able to reach the others'.

On the GPU a buffer is a device allocation shared through CUDA IPC; under the simulator it is a
``multiprocessing.shared_memory`` segment. Either way a buffer gives:

- ``local``: this rank's array (what kernels read and write),
- ``peers``: host-side handles to every member's array, indexed by rank within the group,
- ``ptrs``: a device uint64 array of the members' addresses, for ``primitives.peer_view``.

Allocation is collective over the group, and every member must ask for the same shape and dtype.
"""
import collections
import itertools
import math
import os
import secrets
import socket

import numpy as np
from numba import cuda

from ._compat import SIMULATOR
from .errors import MkError, MkValueError

_sim_tokens = itertools.count(1 << 40)  # simulated addresses: unique, never a real pointer


def _capacity():
    """``(bytes, where)``: what symmetric buffers could ever take here, and the memory's
    identity (members with the same share it): the GPU's memory in all (memory that numba
    has yet to free counts as room) and its UUID, or in the simulator the size of /dev/shm
    and the host."""
    host = socket.gethostname()
    if SIMULATOR:
        try:
            st = os.statvfs("/dev/shm")
        except OSError:       # no /dev/shm to measure: no bound from here
            return float("inf"), host
        return st.f_blocks * st.f_frsize, host
    ctx = cuda.current_context()
    return ctx.get_memory_info()[1], (host, ctx.device.uuid)


class SymmetricBuffer:
    """One symmetric allocation over an MPI communicator ``group`` (see module docstring)."""

    def __init__(self, group, shape, dtype, *, job_tag="mk", zero=True):
        self.group = group
        self.shape = tuple(int(s) for s in np.atleast_1d(shape))
        self.dtype = np.dtype(dtype)
        self.index = group.Get_rank()
        self.scope_ranks = None  # world ranks of the members; set by the owner (Comm)
        asks = group.allgather((self.shape, self.dtype.str, _capacity()))
        if any(a[:2] != asks[0][:2] for a in asks):
            raise MkValueError("symmetric allocation: ranks asked for different buffers: "
                               + ", ".join(f"rank {i}: shape {s} dtype {d}"
                                           for i, (s, d, _) in enumerate(asks)))
        # refused on every member alike, before any member allocates (a member whose
        # allocation failed would leave the others waiting in the next step); members that
        # share a GPU (or, simulated, a host's /dev/shm) need a buffer each there
        each = math.prod(self.shape) * self.dtype.itemsize
        sharing = collections.Counter(where for _, _, (_, where) in asks)
        for i, (_, _, (room, where)) in enumerate(asks):
            if each * sharing[where] > room:
                raise MkValueError(
                    f"symmetric allocation of shape {self.shape} {self.dtype} cannot fit: "
                    f"{sharing[where]} x {each / 2**30:.3g} GiB where rank {i} of its group "
                    f"has {room / 2**30:.3g} GiB of " + (
                        "shared memory (/dev/shm, where the simulator keeps every member's "
                        "buffer)" if SIMULATOR else "GPU memory") + " in all")
        self._closed = False
        if SIMULATOR:
            self._open_shared_memory(job_tag, zero)
        else:
            self._open_ipc(zero)

    # -- GPU: CUDA IPC ---------------------------------------------------------------------------
    def _open_ipc(self, zero):
        from numba.cuda.cudadrv.devicearray import DeviceNDArray

        self.local = cuda.device_array(self.shape, self.dtype)
        if zero:
            self.local.copy_to_device(np.zeros(self.shape, self.dtype))
        handles = self.group.allgather(self.local.get_ipc_handle())
        ctx = cuda.current_context()
        self._opened = []
        self.peers = []
        for i, h in enumerate(handles):
            if i == self.index:
                self.peers.append(self.local)
                continue
            ipc = h._ipc_handle
            # numba would silently stage through host memory when peers cannot reach each
            # other; a fused kernel cannot work that way, so refuse instead.
            if not ipc.can_access_peer(ctx):
                raise MkError(f"GPU of rank {i} in this group is not peer-accessible from "
                              f"device {ctx.device.id}: symmetric memory needs NVLink/PCIe P2P")
            dptr = ipc.open_direct(ctx)
            self._opened.append(ipc)
            self.peers.append(DeviceNDArray(gpu_data=dptr, **h._array_desc))
        addrs = [p.__cuda_array_interface__["data"][0] for p in self.peers]
        self.ptrs = cuda.to_device(np.array(addrs, dtype=np.uint64))

    # -- simulator: POSIX shared memory -----------------------------------------------------------
    def _open_shared_memory(self, job_tag, zero):
        from multiprocessing import resource_tracker, shared_memory

        from numba.cuda.simulator.cudadrv.devicearray import FakeCUDAArray

        from . import primitives

        nbytes = max(1, int(np.prod(self.shape)) * self.dtype.itemsize)
        # random part: a segment left by an aborted run with a reused pid must not collide
        name = (f"{job_tag}_{self.index}_{next(_sim_tokens) & 0xFFFFFF:x}_{os.getpid()}_"
                f"{secrets.token_hex(4)}")
        mine = shared_memory.SharedMemory(name=name, create=True, size=nbytes)
        names = self.group.allgather(name)
        self._segments = []
        self.shm_name = name  # this rank's segment, for transports that map it outside the group
        self.peers = []
        for i, n in enumerate(names):
            seg = mine if i == self.index else shared_memory.SharedMemory(name=n)
            if i != self.index:
                # Attached, not created: keep Python's tracker from unlinking it at our exit.
                resource_tracker.unregister(seg._name, "shared_memory")
            self._segments.append(seg)
            self.peers.append(np.ndarray(self.shape, self.dtype, buffer=seg.buf))
        if zero:
            self.peers[self.index][...] = 0
        self.group.Barrier()  # nobody writes into a peer before the peer has zeroed its buffer
        self.local = FakeCUDAArray(self.peers[self.index])
        self._tokens = [next(_sim_tokens) for _ in names]
        for tok, arr in zip(self._tokens, self.peers):
            primitives.sim_register(tok, arr)
        self.ptrs = FakeCUDAArray(np.array(self._tokens, np.uint64))

    def free(self):
        """Collective: release the mappings (and, for the owner, the memory)."""
        if self._closed:
            return
        self._closed = True
        self.group.Barrier()  # no peer may still be writing into our buffer
        if SIMULATOR:
            from . import primitives
            for tok in self._tokens:
                primitives.sim_unregister(tok)
            self.peers = self.local = None
            for i, seg in enumerate(self._segments):
                seg.close()
                if i == self.index:
                    seg.unlink()
        else:
            self.peers = None
            for ipc in self._opened:
                ipc.close()
            self.local = self.ptrs = None
        self.group.Barrier()
