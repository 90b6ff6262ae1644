"""The host proxy: one thread per GPU that turns ring commands into transport submissions.

Loop: poll the ring (copy committed commands out, return their slots as credits at once), batch
them per connection (:class:`~.batching.Batcher`), optionally pace submissions to a NIC rate,
submit, then let the transport advance completions. Any exception ends the loop and is kept;
:meth:`Proxy.check` (and :meth:`Proxy.stop`) re-raise it in the calling program, while kernels
waiting on the dead proxy leave their bounded waits with an error record instead of hanging.
"""
import threading
import time

import numpy as np
from numba import cuda

from ..errors import MkError, MkTimeoutError
from .batching import Batcher
from .ring import CMD_WORDS, RingReader


class Proxy:
    """This rank's proxy (create with :func:`mknumba.proxy.start`).

    comm: the Comm; transport: a started :class:`~.transports.base.Transport`.
    slots: ring capacity (power of two); max_batch/window_us: batching (paper: 8, a few µs);
    pace_gbps: submit at most this many GB/s (None: as fast as the transport goes);
    spin_us: how long an idle proxy spins before it naps (latency vs. CPU for others).
    """

    def __init__(self, comm, transport, slots=1024, max_batch=8, window_us=5.0, pace_gbps=None,
                 spin_us=None, poll_limit=64):
        self.comm = comm
        self.transport = transport
        self.rank = comm.rank
        # The ring and credits live in mapped host memory: the GPU writes commands over PCIe, the
        # proxy reads them without a copy; the ticket counter stays on the GPU (atomics there).
        self.ring = cuda.mapped_array(slots * CMD_WORDS, dtype=np.uint32)
        self.tail = cuda.mapped_array(1, dtype=np.uint32)
        np.asarray(self.ring)[:] = 0
        np.asarray(self.tail)[:] = 0
        self.head = cuda.to_device(np.zeros(1, np.uint32))
        self.reader = RingReader(np.asarray(self.ring), np.asarray(self.tail))
        self.batcher = Batcher(max_batch, int(window_us * 1000))
        self.poll_limit = int(poll_limit)
        self.pace_bps = None if not pace_gbps else float(pace_gbps) * 1e9
        self.spin_ns = int((spin_us if spin_us is not None
                            else (200 if comm.simulator else 2000)) * 1000)
        self.stats = {"commands": 0, "batches": 0, "bytes": 0, "busy_ns": 0, "polls": 0}
        self._error = None
        # The proxy thread needs the GIL: Comm.__init__ has already made mpi4py's first
        # pickle-based reduction on each communicator (it holds the GIL while it spins).
        self._stop = threading.Event()
        self._drained = threading.Event()    # own ring drained, own submissions delivered
        self._final = threading.Event()      # all ranks drained: publish the last arrivals
        self._thread = threading.Thread(target=self._main, name=f"mknumba-proxy-{self.rank}",
                                        daemon=True)
        self._thread.start()

    # -- main-thread API ---------------------------------------------------------------------------
    def register(self, buf):
        """Collective: make a SymmetricBuffer a window commands can name; returns its id."""
        self.check()
        return self.transport.register(buf)

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
        self._stop.set()                      # drain own ring and flush own submissions
        deadline = time.monotonic() + self.comm.timeout_ns * 1e-9
        while not self._drained.is_set() and self._thread.is_alive():
            if time.monotonic() > deadline:
                self._error = self._error or MkTimeoutError(
                    f"rank {self.rank}: proxy did not drain within the timeout")
                break
            time.sleep(1e-4)
        self.comm.mpi.Barrier()               # every rank's sends delivered ...
        self._final.set()                     # ... so a last progress() publishes all arrivals
        self._thread.join(self.comm.timeout_ns * 1e-9)
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
        reader, batcher, stats, transport = self.reader, self.batcher, self.stats, self.transport
        idle_since = time.monotonic_ns()
        next_ns = 0
        while True:
            stopping = self._stop.is_set()
            t0 = time.monotonic_ns()
            cmds = reader.poll(self.poll_limit)
            if len(cmds):
                reader.release()               # copied out: the slots are credits again
                batcher.add(cmds, t0)
            batches = batcher.take(t0, flush=stopping and not len(cmds))
            for peer, batch in batches:
                if self.pace_bps:
                    next_ns = self._pace(next_ns, int(batch["nbytes"].sum()))
                transport.submit(peer, batch)
                stats["batches"] += 1
                stats["commands"] += len(batch)
                stats["bytes"] += int(batch["nbytes"].sum())
            worked = transport.progress() + len(cmds)
            if worked or batches:
                t1 = time.monotonic_ns()
                stats["busy_ns"] += t1 - t0
                idle_since = t1
            elif stopping and not len(batcher):
                return
            elif t0 - idle_since > self.spin_ns:
                time.sleep(20e-6)              # nap: let other Python threads (and cores) run
            stats["polls"] += 1

    def _pace(self, next_ns, nbytes):
        """Token bucket at pace_bps: returns when ``nbytes`` may go; allows a 50 µs burst."""
        now = time.monotonic_ns()
        next_ns = max(next_ns, now - 50_000)
        while now < next_ns:
            self.transport.progress()
            now = time.monotonic_ns()
        return next_ns + int(nbytes * 1e9 / self.pace_bps)
