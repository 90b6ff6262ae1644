"""The host proxy: one thread per GPU that turns ring commands into transport submissions.

The thread runs the compiled loop of :mod:`.engine` (poll, batch per connection, pace, issue,
progress) in slices without the GIL. Transports with a compiled path (``dma``) are driven from
inside that loop; for the others (``sim``, ``verbs``) the loop defers batches to an outbox that
this thread submits in Python, calling the transport's ``progress`` between slices. Any failure
ends the thread and is kept: :meth:`Proxy.check` (and :meth:`Proxy.stop`) re-raise it in the
calling program, while kernels waiting on the dead proxy leave their bounded waits with an error
record instead of hanging.
"""
import threading
import time

import numpy as np
from numba import cuda

from ..errors import MkError, MkTimeoutError, MkValueError
from . import engine as eng
from .clock import new_clock
from .ring import CMD_WORDS, COMMAND_DTYPE


class Proxy:
    """This rank's proxy (create with :func:`mknumba.proxy.start`).

    comm: the Comm; transport: a started :class:`~.transports.base.Transport`.
    slots: ring capacity (power of two); max_batch/window_us: batching (paper: 8, a few µs);
    pace_gbps: submit at most this many GB/s (None: as fast as the transport goes);
    spin_us: how long an idle proxy spins before it naps (latency vs. CPU for others).
    """

    def __init__(self, comm, transport, slots=1024, max_batch=8, window_us=5.0, pace_gbps=None,
                 spin_us=None, poll_limit=64, slice_ms=1000.0):
        if slots & (slots - 1) or slots <= 0:
            raise MkValueError(f"ring slots must be a power of two, got {slots}")
        if not 1 <= max_batch <= 256:
            raise MkValueError(f"max_batch must be in 1..256, got {max_batch}")
        self.comm = comm
        self.transport = transport
        self.rank = comm.rank
        self.slots, self.max_batch = slots, max_batch
        # The ring and credits live in mapped host memory: the GPU writes commands over PCIe, the
        # proxy reads them without a copy; the ticket counter stays on the GPU (atomics there).
        self.ring = cuda.mapped_array(slots * CMD_WORDS, dtype=np.uint32)
        self.tail = cuda.mapped_array(1, dtype=np.uint32)
        np.asarray(self.ring)[:] = 0
        np.asarray(self.tail)[:] = 0
        self.head = cuda.to_device(np.zeros(1, np.uint32))
        self._words = np.asarray(self.ring)
        self._recs = self._words.view(COMMAND_DTYPE)
        self._tail = np.asarray(self.tail)
        self.queues = eng.Queues(comm.size, max_batch, poll_limit)
        self._st = np.zeros(eng.NSTATE, np.int64)
        self._st[eng.S_IDLE_SINCE] = time.monotonic_ns()
        self._cfg = np.zeros(eng.NCFG, np.int64)
        cfg = self._cfg
        cfg[eng.K_MAX_BATCH], cfg[eng.K_WINDOW_NS] = max_batch, int(window_us * 1000)
        cfg[eng.K_SPIN_NS] = int((spin_us if spin_us is not None
                                  else (200 if comm.simulator else 2000)) * 1000)
        cfg[eng.K_POLL_LIMIT], cfg[eng.K_ME] = poll_limit, comm.rank
        cfg[eng.K_PACE_FS_PER_BYTE] = int(round(1e6 / pace_gbps)) if pace_gbps else 0
        compiled = transport.compiled() is not None
        cfg[eng.K_OUTBOX] = not compiled
        # outbox mode returns often so Python can progress; compiled transports run long slices:
        # stop and yield requests reach the loop through st, and each return to Python costs
        # ~0.1 ms with the GIL (measured as the loop's max_gap_ns)
        cfg[eng.K_SLICE_NS] = int((slice_ms if compiled else 0.2) * 1e6)
        self._error = None
        self._drained = threading.Event()    # own ring drained, own submissions delivered
        self._final = threading.Event()      # all ranks drained: publish the last arrivals
        self._reg_lock = threading.Lock()
        self._compile()
        self._thread = threading.Thread(target=self._main, name=f"mknumba-proxy-{self.rank}",
                                        daemon=True)
        self._thread.start()

    def _compile(self):
        """Compile the loop for this transport here, on an empty ring with stop set, so the
        proxy thread starts at full speed and compile time never eats a kernel's timeout."""
        st = np.zeros(eng.NSTATE, np.int64)
        st[eng.S_STOP], st[eng.S_TAIL] = 1, self._st[eng.S_TAIL]
        q = eng.Queues(self.comm.size, self.max_batch, int(self._cfg[eng.K_POLL_LIMIT]))
        rc = self._run(st, np.zeros(1, np.uint32), q, self._loop_parts(q), new_clock())
        assert rc == eng.RC_DRAINED, rc

    def _loop_parts(self, q):
        """(issue, progress, ctx): the transport's compiled path, or the outbox of ``q``."""
        return self.transport.compiled() or (eng.defer, eng.no_progress, q.outbox_ctx())

    def _run(self, st, tail, q, parts, clock):
        issue, progress, ctx = parts
        return eng.run(st, self._cfg, self._words, self._recs, tail, q.pending, q.count,
                       q.oldest, self.transport.win_bytes, issue, progress, ctx, clock)

    # -- main-thread API ---------------------------------------------------------------------------
    def register(self, buf):
        """Collective: make a SymmetricBuffer a window commands can name; returns its id."""
        self.check()
        with self._reg_lock:
            win = self.transport.register(buf)
            self._retable(f"window {win}")
        ids = self.comm.mpi.allgather(win)
        if len(set(ids)) != 1:
            raise MkError(f"rank {self.rank}: ranks registered proxy windows in different "
                          f"orders (ids {ids}): register and free buffers in the same order "
                          "everywhere")
        return win

    def unregister(self, buf):
        """Collective over the world: forget the window of ``buf`` (no-op if it has none). Call
        it after every kernel that names it has finished: the commands they left in the ring
        are delivered first (every rank drains its own), then the tables change."""
        self.check()
        with self._reg_lock:
            win = self.transport.window_of(buf)
            if win is None:
                return
            self._drain(f"window {win}")
            self.comm.mpi.Barrier()          # every rank's sends into this window delivered
            self.transport.unregister(win)
            self._retable(f"the removal of window {win}")

    def _drain(self, what):
        """Wait until every command committed to the ring so far is issued and delivered."""
        deadline = self._host_deadline()
        mask = self.slots - 1
        while True:
            self._retable(f"a drain before removing {what}")   # a round boundary: outbox sent
            t = int(self._st[eng.S_TAIL])
            committed = int(self._words[(t & mask) * CMD_WORDS]) == ((t + 1) & 0xFFFFFFFF)
            if not committed and not self.queues.count.any():
                break
            if time.monotonic() > deadline:
                raise MkTimeoutError(f"rank {self.rank}: the proxy did not drain its ring "
                                     f"before removing {what}")
            time.sleep(1e-5)
        self.transport.quiesce(time.monotonic_ns() + self.comm.timeout_ns)

    def _host_deadline(self):
        """Deadline of a host-side wait on the loop (a drain, a table change): the loop answers
        at its next round, microseconds away; the 60 s floor only covers a badly loaded host
        (its compile happens in ``__init__``, before any of these waits)."""
        return time.monotonic() + max(self.comm.timeout_ns * 1e-9, 60.0)

    def _retable(self, what):
        """Have the loop pick up the transport's new tables; wait (bounded) until it has."""
        self._cfg[eng.K_NWIN] = len(self.transport.windows)
        self._st[eng.S_YIELD] = 1
        deadline = self._host_deadline()
        while self._st[eng.S_YIELD] and self._thread is not None and self._thread.is_alive():
            if time.monotonic() > deadline:
                raise MkTimeoutError(f"rank {self.rank}: the proxy did not take {what}")
            time.sleep(1e-5)
        self.check()

    @property
    def stats(self):
        """Counters of this proxy: commands, batches, bytes submitted; busy_ns, polls; and
        since :meth:`reset_max`, the longest issue call and the longest the ring went unwatched
        while busy (max_issue_ns, max_gap_ns: a descheduled thread, a slice boundary)."""
        st = self._st
        return {"commands": int(st[eng.S_COMMANDS]), "batches": int(st[eng.S_BATCHES]),
                "bytes": int(st[eng.S_BYTES]), "busy_ns": int(st[eng.S_BUSY_NS]),
                "polls": int(st[eng.S_POLLS]), "max_issue_ns": int(st[eng.S_MAX_ISSUE_NS]),
                "max_gap_ns": int(st[eng.S_MAX_GAP_NS])}

    def reset_max(self):
        self._st[eng.S_MAX_ISSUE_NS] = self._st[eng.S_MAX_GAP_NS] = 0

    def device_args(self):
        """(ring, head, tail): pass to kernels for ``roles.send.enqueue``."""
        return self.ring, self.head, self.tail

    def check(self):
        """Raise MkError (chained to the cause) if the proxy thread failed."""
        if self._error is not None:
            raise MkError(f"rank {self.rank}: the proxy ({self.transport.name}, "
                          f"{self.transport.completion}) failed: {self._error!r}") from self._error

    def wait_submitted(self, n, timeout_s=None):
        """Sleep (GIL released) until this proxy has submitted ``n`` commands in total."""
        deadline = time.monotonic() + (timeout_s or self.comm.timeout_ns * 1e-9)
        while self.stats["commands"] < n:
            self.check()
            if time.monotonic() > deadline:
                raise MkTimeoutError(f"rank {self.rank}: proxy submitted "
                                     f"{self.stats['commands']} of {n} commands in time")
            time.sleep(1e-4)

    @property
    def alive(self):
        return self._thread.is_alive()

    def stop(self):
        """Collective: deliver what was enqueued, wait for every rank, stop, release.

        Never raises, so the caller's own collective teardown stays matched across ranks; a
        failure is kept: call :meth:`check` once teardown is done. Returns the error or None.
        """
        if self._thread is None:
            return self._error
        self._st[eng.S_STOP] = 1              # drain own ring and flush own submissions
        deadline = self._host_deadline()      # a short device timeout must not cut teardown
        while not self._drained.is_set() and self._thread.is_alive():
            if time.monotonic() > deadline:
                self._error = self._error or MkTimeoutError(
                    f"rank {self.rank}: proxy did not drain within the timeout")
                break
            time.sleep(1e-4)
        self.comm.mpi.Barrier()               # every rank's sends delivered ...
        self._final.set()                     # ... so a last progress() publishes all arrivals
        self._thread.join(max(self._host_deadline() - time.monotonic(), 0.0))
        self._thread = None
        try:
            self.transport.close()
        except Exception as e:                # noqa: BLE001 - kept, like a thread failure
            self._error = self._error or e
        return self._error

    # -- the proxy thread --------------------------------------------------------------------------
    def _main(self):
        try:
            self.transport.thread_init()
            self._loop()
            self.transport.flush(time.monotonic_ns() + self.comm.timeout_ns)
            self._drained.set()
            while not self._final.wait(1e-4):
                self.transport.progress()     # peers may still be delivering to us
            self.transport.progress()
        except BaseException as e:            # noqa: BLE001 - kept and re-raised by check()
            self._error = e
        finally:
            self._drained.set()

    def _loop(self):
        q, st, transport, clock = self.queues, self._st, self.transport, new_clock()
        outbox = bool(self._cfg[eng.K_OUTBOX])
        while True:
            st[eng.S_YIELD] = 0               # a table built after this sees every register()
            parts = self._loop_parts(q)
            while True:
                rc = self._run(st, self._tail, q, parts, clock)
                if outbox:
                    for peer, batch in q.take_outbox():
                        transport.submit(peer, batch)
                    transport.progress()
                if rc == eng.RC_ERROR:
                    self._raise_engine_error()
                if rc == eng.RC_DRAINED:
                    return
                if rc == eng.RC_IDLE:
                    time.sleep(20e-6)         # nap: let other Python threads (and cores) run
                if rc == eng.RC_YIELD or st[eng.S_YIELD]:
                    break

    def _raise_engine_error(self):
        st, t = self._st, self.transport
        kind, peer, code = (int(st[k]) for k in (eng.S_ERR, eng.S_ERR_PEER, eng.S_ERR_CODE))
        if kind == eng.E_PEER:
            raise MkValueError(f"rank {self.rank}: a command names peer {peer}, but the world "
                               f"has {self.comm.size} ranks")
        if kind == eng.E_COMMAND:
            t.check_command(peer, self.queues.pending[peer, :code].copy())   # raises its message
            raise MkValueError(f"rank {self.rank}: a bad command for peer {peer}")
        if kind == eng.E_ISSUE:
            raise MkError(f"{t.name} transport: submitting to rank {peer} failed: "
                          f"{t.describe_error(code)}")
        raise MkError(f"{t.name} transport: progress failed: {t.describe_error(code)}")
