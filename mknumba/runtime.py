"""The runtime: MPI bootstrap, topology, GPU binding, symmetric memory, error records, teardown.

    import mknumba as mk
    with mk.init() as comm:          # one process per GPU, launched with mpiexec
        buf = comm.alloc_symmetric((1024,), "float32")
        ...

Environment: ``MKNUMBA_GPUS_PER_NODE`` (pose one host as several nodes), ``MKNUMBA_TIMEOUT_S``
(bound of every device-side wait), ``MKNUMBA_HOST_TIMEOUT_S`` (bound of the host-side
collective steps: planning an op, ``free``, ``barrier``, ``finalize``; see ``Comm.meet``),
``MKNUMBA_ALLOW_SHARED_GPU`` (more ranks than GPUs on a host share them, with a note; 1:
without the note, e.g. under MPS; 0: refuse),
``MKNUMBA_TRANSPORT`` (inter-node transport, see ``mknumba.proxy``).
"""
import atexit
import os
import socket
import sys
import time
import traceback
import weakref

import numpy as np
from numba import cuda

from ._compat import SIMULATOR
from .errors import (ERR_WORDS, MkError, MkTimeoutError, MkValueError, positive_ints,
                     raise_if_timed_out)
from .symmem import SymmetricBuffer
from .topology import make_topology

_DEFAULT_TIMEOUT_S = 120.0 if SIMULATOR else 30.0  # simulated peers are Python: slow
#: how long a rank waits on the host for the others to reach a collective step (planning an
#: op, free, barrier, finalize): long enough for a peer's kernel compile on a loaded host,
#: as long as PyTorch's default for a NCCL collective
_DEFAULT_HOST_TIMEOUT_S = 600.0
_current = None


#: the longest bound a wait takes (about 115 days): a device deadline is the GPU's clock (ns
#: since 1970) plus the bound, which must stay inside an int64
_MAX_TIMEOUT_S = 1e7


def default_timeout_ns(timeout_s=None):
    """The bound of every device-side wait, in ns: ``timeout_s``, else ``MKNUMBA_TIMEOUT_S``,
    else the default; a finite number of seconds, more than 0 and at most about 115 days."""
    return int(_seconds(timeout_s, "MKNUMBA_TIMEOUT_S", _DEFAULT_TIMEOUT_S,
                        "timeout_s (MKNUMBA_TIMEOUT_S)") * 1e9)


def _seconds(value, env, default, what):
    """A bound in seconds: ``value``, else the environment's ``env``, else ``default``; more
    than 0 and at most :data:`_MAX_TIMEOUT_S`, else MkValueError naming ``what``."""
    if value is None:
        value = os.environ.get(env, default)
    try:
        seconds = float(value)
    except (TypeError, ValueError):
        seconds = float("nan")
    if not 0 < seconds <= _MAX_TIMEOUT_S:
        raise MkValueError(f"{what} must be a number of seconds in (0, {_MAX_TIMEOUT_S:g}], "
                           f"got {value!r}")
    return seconds


def _mpi():
    try:
        from mpi4py import MPI
    except ImportError as e:  # pragma: no cover - depends on the machine
        raise MkError("mknumba needs mpi4py and an MPI library; on a machine without MPI "
                      "install them with: pip install 'mknumba[mpi]'") from e
    return MPI


class Comm:
    """This rank's view of the job. Create it with :func:`init`; see the module docstring.

    Attributes: ``rank``/``size`` (world), ``node``/``nodes``, ``local_rank``/``local_size``
    (within the node; ``local_size`` is GPUs per node), ``rail_peers`` (world ranks with this
    local rank on the other nodes), ``device_id``, ``mpi`` (world communicator), ``node_comm``,
    ``rail_comm``, ``timeout_ns``, ``host_timeout_s`` (:meth:`meet`), ``simulator``, ``proxy``
    (None on a single node),
    ``closed`` (finalized: every op planned on it is then freed, and planning or calling one
    raises MkError).
    """

    def __init__(self, mpi_comm=None, gpus_per_node=None, timeout_s=None, transport=None):
        MPI = _mpi()
        failed = None            # this rank's bad argument: every rank refuses the init
        try:
            self.timeout_ns = default_timeout_ns(timeout_s)
            self.host_timeout_s = _seconds(None, "MKNUMBA_HOST_TIMEOUT_S",
                                           _DEFAULT_HOST_TIMEOUT_S, "MKNUMBA_HOST_TIMEOUT_S")
            env = os.environ.get("MKNUMBA_GPUS_PER_NODE")
            if gpus_per_node is None and env:
                gpus_per_node = positive_ints("mk.init", MKNUMBA_GPUS_PER_NODE=(
                    int(env) if env.strip().isdigit() else env))["MKNUMBA_GPUS_PER_NODE"]
            gpus_per_node = positive_ints("mk.init", gpus_per_node=gpus_per_node)[
                "gpus_per_node"]
        except Exception as e:     # noqa: BLE001 (raised below, after every rank knows)
            failed = e
        self.mpi = (mpi_comm or MPI.COMM_WORLD).Dup()
        self.simulator = SIMULATOR
        host = socket.gethostname()
        # Every rank must agree on the job's shape before anything is allocated.
        asks = self.mpi.allgather((host, gpus_per_node, failed and str(failed)))
        refused = [(r, why) for r, (_, _, why) in enumerate(asks) if why]
        if refused:
            self.mpi.Free()
            if failed is not None:
                raise failed
            raise MkValueError(f"mk.init: rank {refused[0][0]} refused its arguments "
                               f"({refused[0][1]}); so does this rank")
        if len({g for _, g, _ in asks}) != 1:
            raise MkValueError(f"ranks disagree on gpus_per_node: {[g for _, g, _ in asks]}")
        self.topology = make_topology(self.mpi.Get_rank(), [h for h, _, _ in asks],
                                      gpus_per_node)
        t = self.topology
        self.rank, self.size = t.rank, t.size
        self.node, self.nodes = t.node, t.nodes
        self.local_rank, self.local_size = t.local_rank, t.local_size
        self.rail_peers = t.rail_peers
        self.node_comm = self.mpi.Split(color=t.node, key=t.local_rank)
        self.rail_comm = self.mpi.Split(color=t.local_rank, key=t.node)
        # mpi4py's first pickle-based reduction on a communicator duplicates it while holding
        # the GIL; done later, with a kernel waiting on the proxy thread, that can deadlock.
        for c in (self.mpi, self.node_comm, self.rail_comm):
            c.allreduce(0)
        self.device_id = 0 if SIMULATOR else self._bind_gpu()
        self._buffers = []
        self._ops = weakref.WeakSet()      # the ops planned on this Comm (adopt)
        self._closed = False
        self._lost = None          # a collective step that timed out (meet): no more steps
        self.proxy = None
        self._held_frees = None
        if self.nodes > 1:
            from . import proxy
            self.proxy = proxy.start(self, transport)
            self._hold_frees()

    def _bind_gpu(self):
        if not cuda.is_available():
            raise MkError("no CUDA GPU is visible to this process; to run without a GPU leave "
                          "NUMBA_ENABLE_CUDASIM unset or set it to 1 (numba's simulator, small "
                          "sizes)")
        ngpu = len(cuda.gpus)
        per_host = self.mpi.allreduce(self.topology.host_rank, op=_mpi().MAX) + 1
        if per_host > ngpu:
            if os.environ.get("MKNUMBA_ALLOW_SHARED_GPU") == "0":
                raise MkError(f"{per_host} ranks on this host but only {ngpu} GPUs; launch at "
                              f"most {ngpu} ranks per host (MKNUMBA_ALLOW_SHARED_GPU=0 refuses "
                              "to share them)")
            if self.rank == 0 and os.environ.get("MKNUMBA_ALLOW_SHARED_GPU") != "1":
                print(f"mknumba: {per_host} ranks share {ngpu} GPU(s) on this host: results are "
                      "right, timings are not (MKNUMBA_ALLOW_SHARED_GPU=0 refuses)",
                      file=sys.stderr, flush=True)
        dev = self.topology.host_rank % ngpu
        cuda.select_device(dev)
        ctx = cuda.current_context()
        for peer in self.node_comm.allgather(dev):
            if peer != dev and not ctx.can_access_peer(peer):
                raise MkError(f"rank {self.rank}: GPU {dev} cannot access GPU {peer} of the "
                              "same node (no P2P); fused kernels need peer access")
        return dev

    # -- memory ------------------------------------------------------------------------------------
    def _group(self, scope):
        if scope == "node":
            return self.node_comm, self.topology.node_ranks
        if scope == "world":
            return self.mpi, tuple(range(self.size))
        raise MkValueError(f"scope must be 'node' or 'world', got {scope!r}")

    def alloc_symmetric(self, shape, dtype, scope="node"):
        """Collective over ``scope``: a zeroed :class:`SymmetricBuffer` of ``shape``/``dtype``.

        ``scope="world"`` maps every rank's buffer into every other rank: only possible when
        all ranks share one host (emulated nodes).
        """
        self._check_open()
        group, ranks = self._group(scope)
        buf = SymmetricBuffer(group, shape, dtype, job_tag=f"mk{os.getpid() % 100000}")
        buf.scope_ranks = ranks
        self._buffers.append(buf)
        return buf

    def alloc_flags(self, n, scope="node"):
        """Collective: ``n`` zeroed uint32 epoch flags per rank, symmetric over ``scope``."""
        return self.alloc_symmetric((int(n),), np.uint32, scope)

    def free(self, buf):
        """Collective over the buffer's group: release a symmetric buffer early (and its proxy
        window, if it has one: then collective over the world)."""
        windowed = self.proxy is not None and self.proxy.transport.window_of(buf) is not None
        self.meet(self.mpi if windowed else buf.group, "free()")
        if self.proxy is not None:
            self.proxy.unregister(buf)
        buf.free()
        self._buffers.remove(buf)

    def flags_set(self, arrays, epoch):
        """Flag arrays of this rank (symmetric buffers' ``local`` arrays) were set to ``epoch``
        outside the kernels (tests: an op's ``_start_at``); a proxy that publishes flags from
        the low bits of each epoch takes that as their last value."""
        if self.proxy is not None:
            self.proxy.transport.flags_set(arrays, epoch)

    def agree(self, what, fields, scope="world", failed=None):
        """Collective over ``scope``: every rank must pass the same ``fields`` (a dict of what
        the op was planned with, in the caller's terms); else MkValueError names the ranks and
        the fields that differ, on every rank. ``failed``: the exception this rank's own
        checks raised (its ``fields`` may be empty, then not compared): raised here, unless
        the fields differ, and the others raise MkValueError naming this rank and its error.
        The ranks of this node, members at every scope, first compare ``scope`` itself: ranks
        that named different groups (or one that is none) raise instead of waiting in
        different ones."""
        self.meet(self.node_comm, f"{what}: planning")
        scopes = self.node_comm.allgather(repr(scope))
        if len(set(scopes)) > 1:
            raise MkValueError(f"{what}: ranks of this node planned it over different scopes ("
                               + ", ".join(f"rank {self.topology.node_ranks[r]}: {s}"
                                           for r, s in enumerate(scopes))
                               + "); every member must pass the same")
        group, _ = self._group(scope)
        self.meet(group, f"{what}: planning")
        why = None if failed is None else f"{type(failed).__name__}: {failed}"
        said = group.allgather((why, dict(fields)))
        me = group.Get_rank()
        for r, (_, theirs) in enumerate(said):
            if fields and theirs and theirs != fields:
                diff = ", ".join(f"{key}: {fields.get(key)!r} here, {theirs.get(key)!r} there"
                                 for key in sorted(set(fields) | set(theirs))
                                 if fields.get(key) != theirs.get(key))
                raise MkValueError(f"{what}: ranks planned it differently (this is rank {me} "
                                   f"of the {scope}, against rank {r}): {diff}")
        if failed is not None:
            raise failed
        for r, (theirs, _) in enumerate(said):
            if theirs is not None:
                raise MkValueError(f"{what}: rank {r} of the {scope} refused to plan it "
                                   f"({theirs}); so does this rank ({me})")

    def meet(self, group, what):
        """Collective over ``group`` (one of this Comm's communicators), bounded: every member
        says which step it is at (``what``, e.g. ``"free()"``), and this returns once all have
        said the same. Every host-side collective step starts with it (planning an op, free,
        barrier, finalize), so ranks out of step get an error instead of a hang:

        - members at different steps: MkError on each, naming every member's step (the
          exchange completed: nothing is left pending);
        - a member that never comes: MkTimeoutError after ``host_timeout_s``
          (``MKNUMBA_HOST_TIMEOUT_S``) naming this rank and ``what``. A timed-out exchange
          cannot be withdrawn (MPI has no way to cancel a collective), and a late rank's next
          step would complete against it and then wait forever; so the job is aborted when
          this process exits (an exit handler: ``MPI_Finalize`` would wait on it too).

        Either way the Comm then takes no more collective steps (its ranks are out of step)."""
        self._check_open()
        if group.Get_size() == 1:
            return
        said = np.zeros((group.Get_size(), 4 + _STEP_BYTES), np.uint8)   # world rank, step
        mine = np.frombuffer(self.rank.to_bytes(4, "little") +
                             what.encode()[:_STEP_BYTES].ljust(_STEP_BYTES, b" "), np.uint8)
        arrived = group.Iallgather(mine, said)
        start = time.monotonic()
        while not arrived.Test():
            waited = time.monotonic() - start
            if waited > self.host_timeout_s:
                self._lose(f"rank {self.rank}: {what}: not every rank of its group "
                           f"({group.Get_size()} ranks) came within {self.host_timeout_s:g} s "
                           "(MKNUMBA_HOST_TIMEOUT_S); a rank skipped this step, raised before "
                           "it, or waits in another group (each rank must plan, free and "
                           "finalize the same ops in the same order, over the same scope)",
                           abort=True)
            # yield at first (ranks leave a barrier together), then poll every 100 us; a
            # sleep releases the GIL, so the proxy thread runs meanwhile
            time.sleep(0 if waited < 2e-3 else 1e-4)
        steps = {int.from_bytes(bytes(row[:4]), "little"):
                 bytes(row[4:]).decode(errors="replace").rstrip() for row in said}
        if len(set(steps.values())) > 1:
            self._lose(f"rank {self.rank}: {what}: the ranks of its group are at different "
                       "steps (" + ", ".join(f"rank {r}: {s!r}" for r, s in steps.items())
                       + "); each rank must plan, free and finalize the same ops in the same "
                       "order", abort=False)

    def _lose(self, why, abort):
        """A collective step failed (:meth:`meet`): raise, and from now on refuse every step;
        ``abort``: a step is left pending, so abort the job when this process exits
        (MkTimeoutError), else MkError."""
        self._lost = why
        if abort:
            _LOST.append(self)
            if len(_LOST) == 1:
                atexit.register(_abort_lost)
            raise MkTimeoutError(why)
        raise MkError(why)

    def new_error_record(self):
        """A zeroed int64[8] record in mapped host memory that kernels fill on a timeout."""
        rec = cuda.mapped_array(ERR_WORDS, dtype=np.int64)
        rec[:] = 0
        return rec

    def check(self, record, what="", flag_name=None):
        """Raise if the proxy failed, or :class:`MkTimeoutError` if a kernel wrote ``record``
        (a dead proxy is the likelier cause of a timeout, so it is reported first).
        ``flag_name``: see ``errors.describe_error_record``."""
        if self.proxy is not None:
            self.proxy.check()
        raise_if_timed_out(record, what, flag_name)

    # -- collective helpers and teardown ----------------------------------------------------------
    def synchronize(self, stream=0):
        """Wait until the work queued on ``stream`` (a numba stream or a raw handle) is done,
        without holding the GIL.

        A blocking CUDA call from this thread keeps the GIL while it waits; if the kernel it
        waits for needs the proxy thread (which needs the GIL) to make progress, that is a
        deadlock. So: record an event and poll it, sleeping between polls. With a proxy
        running, the device arrays numba was told to free since the last call are freed here
        (see :meth:`_hold_frees`).
        """
        if SIMULATOR:
            return
        if isinstance(stream, int) and stream:      # a raw handle (an op's last stream)
            stream = cuda.external_stream(stream)
        self._poll(stream)
        if self._held_frees and any(len(q) for q in self._held_frees):
            self._poll(0)        # the legacy stream: after every blocking stream's work
            self._release_frees()
            self._hold_frees()

    def _poll(self, stream):
        done = cuda.event(timing=False)
        done.record(stream)
        while not done.query():
            if self.proxy is not None:
                self.proxy.check()
            time.sleep(20e-6)

    def _hold_frees(self):
        """numba frees device arrays in batches (cuMemFree, every 10 dropped arrays), and
        cuMemFree waits for the whole GPU while it blocks this process's other driver calls,
        the proxy thread's copies included: a kernel waiting on the proxy would then never
        finish (a deadlock until the timeout). So while the proxy runs, numba's frees (arrays,
        and events and streams) wait for :meth:`synchronize`, which releases them once the
        legacy stream, and with it every blocking stream, is idle (work on non-blocking
        streams is not waited for). Between synchronizations the arrays dropped stay
        allocated."""
        if SIMULATOR:
            return
        ctx = cuda.current_context()
        queues = [ctx.deallocations, getattr(ctx.memory_manager, "deallocations", None)]
        self._held_frees = {q: q.disable() for q in queues if q is not None}
        for hold in self._held_frees.values():
            hold.__enter__()

    def _release_frees(self):
        for queue, hold in self._held_frees.items():
            hold.__exit__(None, None, None)
            queue.clear()
        self._held_frees = None

    def barrier(self):
        """Synchronise this rank's GPU (default stream), then all ranks."""
        self._check_open()
        self.synchronize()
        self.meet(self.mpi, "barrier()")

    @property
    def closed(self):
        """True once :meth:`finalize` ran."""
        return self._closed

    def _check_open(self):
        if self._closed:
            raise MkError("this Comm was finalized (comm.finalize(), or the end of its "
                          "`with mk.init()` block): init a new one")
        if self._lost:
            raise MkError(f"this Comm's ranks are out of step ({self._lost}); it takes no "
                          "more collective steps" + (", and the job is aborted when this "
                                                     "process exits" if self in _LOST else ""))

    def adopt(self, op):
        """An op planned on this Comm (``kernels.lifetime.OpLifetime``): :meth:`finalize`, which
        frees every symmetric buffer, frees the op too, so that a later call raises MkError
        rather than launching on freed memory."""
        self._check_open()
        self._ops.add(op)

    def disown(self, op):
        """An op whose planning failed (``OpLifetime._planning_ends``): nothing of it is left
        for :meth:`finalize` to tend (its buffers are the Comm's until then)."""
        self._ops.discard(op)

    def finalize(self):
        """Collective: stop the proxy, free every symmetric buffer, release the communicators."""
        global _current
        if self._closed:
            return
        self.synchronize()
        for op in list(self._ops):   # each waits for its calls (the proxy still runs), then a
            op._close_frame()        # graph's replays launch nothing on the freed buffers
        self.meet(self.mpi, "finalize()")
        proxy, self.proxy = self.proxy, None
        if proxy is not None:
            proxy.stop()     # never raises, so every rank reaches the collective frees below
        if self._held_frees:
            self._release_frees()
        for op in list(self._ops):
            op.freed, op.finalized = True, True
        self._ops.clear()
        for buf in reversed(self._buffers):
            buf.free()
        self._buffers.clear()
        self.mpi.Barrier()
        for c in (self.node_comm, self.rail_comm, self.mpi):
            c.Free()
        self._closed = True
        if _current is self:
            _current = None
        if proxy is not None:
            proxy.check()    # now that teardown is matched across ranks, report its failure

    def __enter__(self):
        return self

    def __exit__(self, exc_type, exc, tb):
        if exc_type is not None and self.size > 1:
            # The other ranks may be inside a collective this rank will never join, so a
            # collective teardown would hang: report the error and take the job down instead.
            traceback.print_exception(exc_type, exc, tb)
            sys.stderr.flush()
            self.mpi.Abort(1)
        self.finalize()

    def __repr__(self):
        return (f"Comm(rank={self.rank}/{self.size}, node={self.node}/{self.nodes}, "
                f"local_rank={self.local_rank}/{self.local_size}, device={self.device_id}, "
                f"simulator={self.simulator})")


_LOST = []      # Comms with a timed-out step left pending (Comm._lose): the job ends at exit
#: bytes of a step's name that ranks compare (Comm.meet): longer names are cut
_STEP_BYTES = 96


def _abort_lost():
    """At exit, after a collective step timed out: abort the job, saying why, instead of
    waiting in ``MPI_Finalize`` on the step (and leaving late ranks waiting on this one)."""
    comm = _LOST[0]
    print(f"mknumba: {comm._lost}; aborting the job", file=sys.stderr, flush=True)
    comm.mpi.Abort(1)


def init(mpi_comm=None, *, gpus_per_node=None, timeout_s=None, transport=None):
    """Collective: bootstrap mknumba over MPI and return this rank's :class:`Comm`.

    mpi_comm: an mpi4py communicator (default ``MPI.COMM_WORLD``).
    gpus_per_node: ranks per (emulated) node; default ``MKNUMBA_GPUS_PER_NODE`` or all ranks of
        a host. ``timeout_s``: bound of device-side waits. ``transport``: inter-node transport.
    """
    global _current
    _current = Comm(mpi_comm, gpus_per_node, timeout_s, transport)
    return _current


def finalize():
    """Finalize the Comm made by the last :func:`init`, if it is still open."""
    if _current is not None:
        _current.finalize()
