"""The interface every transport implements, and the window table they share.

A *window* is a symmetric buffer registered with the proxy (collectively, in the same order on
every rank, so ids agree); commands name their source, destination and flag windows by id.
Unregistering (when the buffer is freed, after :class:`~..proxy.Proxy` has drained every rank)
releases the transport's mappings of it and frees its id for the next registration.
"""
import numpy as np
from numba import njit

from ...errors import MkValueError
from ..imm import FlagShadow
from ..ring import MAX_WINDOWS

ORDERED, COMPLETION = "ordered", "completion"


class Window:
    """A registered buffer: id, bytes per rank, element size, the SymmetricBuffer itself."""

    def __init__(self, win, buf):
        self.id = win
        self.buf = buf
        self.itemsize = buf.dtype.itemsize
        self.nbytes = int(np.prod(buf.shape)) * self.itemsize
        self.is_flags = buf.dtype == np.uint32


class Transport:
    """Moves the payload of each command to its peer, then makes its arrival flag true.

    completion: ORDERED (the flag is written after the data on the same ordered path, like
    InfiniBand RC) or COMPLETION (the receiving side publishes the flag once the payload has
    landed, like EFA SRD write-with-immediate).
    The proxy thread calls ``thread_init`` once, then ``submit`` and ``progress`` in its loop,
    ``flush`` when stopping; ``register`` and ``close`` run on the main thread.
    """

    name = "base"
    completions = (ORDERED, COMPLETION)

    def __init__(self, comm, completion=ORDERED):
        if completion not in self.completions:
            raise MkValueError(f"transport {self.name!r} has completion modes "
                               f"{self.completions}, not {completion!r}")
        self.comm = comm
        self.completion = completion
        self.windows = []
        self.win_bytes = np.zeros(MAX_WINDOWS, np.uint64)   # bytes per rank of each window
        self.shadow = FlagShadow()   # completion mode: the flags this rank's proxy publishes

    def register(self, buf):
        """Collective: register a SymmetricBuffer; returns its window id (the lowest free one)."""
        win = next((i for i, w in enumerate(self.windows) if w is None), len(self.windows))
        if win >= MAX_WINDOWS:
            raise MkValueError(f"at most {MAX_WINDOWS} windows can be registered")
        w = Window(win, buf)
        if w.is_flags and self.completion == COMPLETION:
            try:
                self.shadow.add_window(win, w.nbytes // 4)
            except ValueError as e:
                raise MkValueError(str(e)) from None
        self._register(w)
        self.win_bytes[win] = w.nbytes
        if win == len(self.windows):
            self.windows.append(w)
        else:
            self.windows[win] = w
        return win

    def unregister(self, win):
        """Forget window ``win`` (local: ``Proxy.unregister`` drains and synchronises the ranks
        first, so no command naming it is in flight). Commands that still name it fail the
        bounds check; its id goes to the next registration."""
        w = self.windows[win]
        self.win_bytes[win] = 0
        if w.is_flags and self.completion == COMPLETION:
            self.shadow.remove_window(win)
        self._unregister(w)
        self.windows[win] = None
        while self.windows and self.windows[-1] is None:
            self.windows.pop()

    def flags_set(self, arrays, epoch):
        """Flag arrays of this rank (SymmetricBuffer ``local`` arrays) were set to ``epoch`` on
        the device, outside the proxy (an op's ``_start_at``): in completion mode the proxy
        restores each flag's epoch from its last value (``proxy.imm``), so that value follows."""
        if self.completion != COMPLETION:
            return
        for w in self.windows:
            if w is not None and w.is_flags and any(a is w.buf.local for a in arrays):
                self.shadow.set_window(w.id, epoch)

    def window_of(self, buf):
        """The id of the window registered for ``buf``, or None."""
        return next((w.id for w in self.windows if w is not None and w.buf is buf), None)

    def _register(self, window):
        raise NotImplementedError

    def _unregister(self, window):
        """Release what :meth:`_register` mapped for ``window``."""

    def compiled(self):
        """(issue, progress, ctx) for the proxy's compiled loop (:mod:`..engine`), or None to
        have batches handed to :meth:`submit` in Python. Called in the proxy thread, again
        after every :meth:`register`."""
        return None

    def describe_error(self, code):
        """Text for an error code returned by the compiled issue/progress."""
        return f"error code {code}"

    def thread_init(self):
        """Called in the proxy thread before its loop (e.g. make the CUDA context current)."""

    def submit(self, peer, batch):
        """Start the transfers of ``batch`` (COMMAND_DTYPE array, 1..8 commands to ``peer``)."""
        raise NotImplementedError

    def progress(self):
        """Advance completions (receive side publishes flags); returns the work it did."""
        return 0

    def flush(self, deadline_ns):
        """Wait until everything submitted so far has been delivered (proxy thread)."""

    def quiesce(self, deadline_ns):
        """Main thread, proxy running: wait until everything submitted so far has been
        delivered (before a window goes). Default: submission delivers (sim)."""

    def close(self):
        """Release resources (main thread, after the proxy thread stopped)."""

    def check_command(self, peer, batch):
        """Validate a batch against the window table (bounds, peer); raise MkValueError."""
        if _first_bad(batch, peer, self.comm.rank, self.comm.size, self.win_bytes,
                      len(self.windows)) < 0:
            return
        if not 0 <= peer < self.comm.size or peer == self.comm.rank:
            raise MkValueError(f"command for peer {peer} from rank {self.comm.rank}")
        nw = len(self.windows)
        for f in ("src_win", "dst_win", "flag_win"):
            if (batch[f] >= nw).any():
                raise MkValueError(f"command names {f} {int(batch[f].max())}, but only {nw} "
                                   "windows are registered")
        nb = np.array([w.nbytes if w is not None else 0 for w in self.windows], np.int64)
        end_src = batch["src_off"].astype(np.int64) + batch["nbytes"]
        end_dst = batch["dst_off"].astype(np.int64) + batch["nbytes"]
        bad = ((end_src > nb[batch["src_win"]]) | (end_dst > nb[batch["dst_win"]])
               | (batch["flag_slot"].astype(np.int64) * 4 >= nb[batch["flag_win"]]))
        if bad.any():
            c = batch[np.argmax(bad)]
            raise MkValueError(f"command out of bounds: chunk {int(c['chunk'])} {int(c['nbytes'])}"
                               f" bytes src {int(c['src_off'])} (window {int(c['src_win'])}) dst "
                               f"{int(c['dst_off'])} (window {int(c['dst_win'])}), flag slot "
                               f"{int(c['flag_slot'])} (window {int(c['flag_win'])})")


def first_bad_command(batch, peer, me, size, win_bytes, nwin):
    """Index of the first command that leaves its windows (or names a bad peer/window), or -1.

    Compiled (see :func:`bounds_check`), so the check costs little per batch.
    """
    if peer < 0 or peer >= size or peer == me:
        return 0
    for i in range(batch.shape[0]):
        c = batch[i]
        if c.src_win >= nwin or c.dst_win >= nwin or c.flag_win >= nwin:
            return i
        if (c.src_off + c.nbytes > win_bytes[c.src_win] or c.dst_off + c.nbytes > win_bytes[c.dst_win]
                or np.uint64(4) * np.uint64(c.flag_slot) + np.uint64(4) > win_bytes[c.flag_win]):
            return i
    return -1


_first_bad = njit(nogil=True)(first_bad_command)
