"""An op's life on its GPU and its Comm: the call counter on the device (:class:`Frame`, from
which every launch derives its call number and epoch, so a captured CUDA graph replays as new
calls), the ticket counters that tests set near the wrap (:func:`counter_at`), and what every
op does around its calls (:class:`OpLifetime`: planning together, checked calls, ending a
rank's calls, ``synchronize``, ``free``)."""
import contextlib
import warnings
import weakref

import numpy as np
from numba import cuda

from .._compat import SIMULATOR
from ..errors import MkError, MkValueError, raise_if_timed_out
from ..primitives import FRAME_CLOSED, FRAME_WORDS, epoch_of_host
from .streams import StreamOrder, is_capturing

__all__ = ["Frame", "counter_at", "OpLifetime"]


class Frame:
    """An op's call counter on its GPU: one uint64 of tickets (``primitives.FRAME_WORDS``),
    one per block of every launch so far, for launches of ``grid`` blocks.

    Each block of a launch takes a ticket when it starts (``roles.blocks.begin``), so launches
    on one stream, graph replays among them, number themselves: call c holds tickets
    [(c - 1) * grid, c * grid). Epochs follow ``primitives.epoch_of_host``: 1, 2, ...,
    2**32 - 1, 1, ... (never 0, which fresh flags hold).
    """

    def __init__(self, grid):
        self.grid = int(grid)
        self.words = cuda.to_device(np.zeros(FRAME_WORDS, np.uint64))
        self.shut = False         # close() took effect (then a second close does nothing)

    def read(self):
        """``(calls mod 2**32, epoch)`` of the last call that started (waits for the device)."""
        calls = (int(self.words.copy_to_host()[0]) & ~int(FRAME_CLOSED)) // self.grid
        return calls & 0xFFFFFFFF, epoch_of_host(calls)

    def closed(self):
        """Whether :meth:`close` has taken effect (waits for the device)."""
        return bool(int(self.words.copy_to_host()[0]) & int(FRAME_CLOSED))

    def close(self, stream=None):
        """The op has ended on this rank (``OpLifetime._end_calls``, ``free``): from now on a
        launch of it does nothing (``roles.blocks.begin``), e.g. a CUDA graph captured before
        and replayed after, which would otherwise pair with the other ranks' calls or touch
        freed buffers. It sets the counter's top byte, so :meth:`read` still counts the calls.
        ``stream``: the stream of the op's last call, behind which the close is queued, and
        waited for (the earlier calls end or time out within the bound); None, or a stream
        that is capturing a graph (which must not take it): a stream of its own. The wait is
        allowed during another stream's capture (this thread's capture mode relaxed). Once
        closed, a second close returns at once: it would only wait on ``stream`` again, which
        may be gone by then (a Comm's finalize closes the frames of ops already freed)."""
        if self.shut:
            return
        if SIMULATOR:
            self.words.copy_to_device(self.words.copy_to_host() | FRAME_CLOSED)
            self.shut = True
            return
        from cuda.bindings import driver as drv
        ok = drv.CUresult.CUDA_SUCCESS
        err, mode = drv.cuThreadExchangeStreamCaptureMode(
            drv.CUstreamCaptureMode.CU_STREAM_CAPTURE_MODE_RELAXED)
        if err != ok:
            raise MkError(f"could not close an op's call counter: {err}")
        own = None
        try:
            if stream is None or is_capturing(stream):
                err, own = drv.cuStreamCreate(drv.CUstream_flags.CU_STREAM_NON_BLOCKING)
                own = own if err == ok else None
            h = own if own is not None else drv.CUstream(stream)
            top = self.words.__cuda_array_interface__["data"][0] + 7     # the top byte, LE
            if err == ok:
                (err,) = drv.cuMemsetD8Async(top, int(FRAME_CLOSED) >> 56, 1, h)
            if err == ok:
                (err,) = drv.cuStreamSynchronize(h)
        finally:
            if own is not None:
                drv.cuStreamDestroy(own)
            drv.cuThreadExchangeStreamCaptureMode(mode)
        if err != ok:
            raise MkError(f"could not close an op's call counter: {err}")
        self.shut = True

    def set(self, calls, epoch=None):
        """Pretend ``calls`` calls have run (tests start near the wrap); ``epoch``, if given,
        must be theirs. Only between calls; the op's flags must agree (``_start_at``)."""
        if epoch is not None and epoch != epoch_of_host(calls):
            raise MkValueError(f"call {calls} has epoch {epoch_of_host(calls)}, not {epoch}")
        counter_at(self.words, [self.grid], calls)
        self.shut = False         # the counter as those calls left it: open

    def start_at(self, calls, flags=(), comm=None):
        """Set the op's state as if ``calls`` calls had run: the counter (:meth:`set`) and
        every epoch flag array in ``flags`` at the last call's epoch (tests start near the
        wrap; only between calls, after a synchronisation). ``comm``: the flags' Comm, whose
        proxy (if any) is told (``Comm.flags_set``)."""
        epoch = epoch_of_host(calls)
        self.set(calls)
        for f in flags:
            f.copy_to_device(np.full(f.shape, epoch, np.uint32))
        if comm is not None:
            comm.flags_set(flags, epoch)


def counter_at(counter, per_call, calls):
    """Set a ticket counter (a device array: the frame's words, a work queue, chunk counts) to
    what ``calls`` calls leave in it, each call drawing ``per_call`` tickets from its entries
    (an entry per index; missing ones draw none), modulo the counter's width."""
    t = np.zeros(counter.shape, np.uint64)
    t[:len(per_call)] = np.asarray(per_call, np.uint64) * np.uint64(calls)
    counter.copy_to_device(t.astype(counter.dtype))


class OpLifetime:
    """What an op on a Comm does around its calls (a mixin): :meth:`_plan_on` first at plan
    time; each call through :meth:`_checked_call`; :meth:`synchronize`, :meth:`free`,
    :meth:`_start_at`. The op sets ``name`` (before :meth:`_plan_on`), ``err`` (its error
    record), ``frame`` (its :class:`Frame`), ``_buffers`` (its symmetric buffers) and
    ``_epoch_flags`` (its epoch flag arrays on this GPU)."""

    def _plan_on(self, comm, one_gpu=False):
        """Plan time, first: the op lives on ``comm`` (None: a one-GPU op, where ``one_gpu``
        allows it) until :meth:`free` or ``comm.finalize()``, which frees it too
        (``Comm.adopt``). ``freed``: the op takes no more calls (also after a call this rank
        could not launch: ``_ended``). Its calls keep one order across streams
        (``streams``)."""
        # a Comm, or an object that serves as one (tests' stand-ins): it adopts its ops
        if not (callable(getattr(comm, "adopt", None)) or comm is None and one_gpu):
            raise MkValueError(f"{self.name}: comm must be the Comm that mk.init() returned, "
                               f"got {type(comm).__name__}")
        self.comm, self.freed, self.finalized, self._ended = comm, False, False, None
        self.frame = None        # set once planned (a plan that raises before leaves none)
        me = weakref.ref(self)           # (no cycle: a dropped op is freed at once)
        self.streams = StreamOrder(self.name, refused=lambda why: me()._end_calls(why))
        if comm is not None:
            comm.adopt(self)

    @contextlib.contextmanager
    def _planning_starts(self, scope="world"):
        """Plan time, after :meth:`_plan_on`: ``with`` around every check of the op's
        arguments, up to its first collective step. The body puts what every member must plan
        alike (in the caller's terms) into the dict it is given, and the members compare those
        on leaving it (``Comm.agree`` over ``scope``). A member whose checks raised takes part
        all the same, so every member raises, naming it, instead of leaving the others waiting
        in the agreement (or in the next collective) for it."""
        agreed, failed = {}, None
        try:
            yield agreed
        except BaseException as e:    # noqa: BLE001 (raised again below, on this rank too)
            failed = e
        try:
            if self.comm is not None:
                self.comm.agree(self.name, agreed, scope, failed=failed)
            elif failed is not None:
                raise failed
        except BaseException as e:
            self._planning_failed(f"{type(e).__name__}: {e}")
            raise

    def _planning_failed(self, why):
        """An op whose planning failed takes no calls and leaves its Comm."""
        self.freed, self._ended = True, f"its planning failed ({why})"
        if self.comm is not None:
            self.comm.disown(self)

    @contextlib.contextmanager
    def _planning_ends(self, group=None):
        """Plan time, last: ``with`` around everything after the plan's last collective step
        (the kernel's compile and link among it). Every member leaves it together, so no
        member's first call starts its bounded waits while another is still compiling (on a
        loaded host a link takes minutes, and those waits would time out); and a member that
        raises in it makes every member raise, instead of leaving them to wait for it. An op
        whose planning failed takes no calls and leaves its Comm (whose finalize would
        otherwise tend it). ``group``: the op's members (an mpi4py communicator; default the
        Comm's world)."""
        failed = None
        try:
            yield
        except BaseException as e:    # noqa: BLE001 (raised again below, on this rank too)
            failed = e
        group = group if group is not None else getattr(self.comm, "mpi", None)
        why = None if failed is None else f"{type(failed).__name__}: {failed}"
        if group is not None and group.Get_size() > 1:
            try:
                self.comm.meet(group, f"{self.name}: the end of planning")
            except BaseException as e:
                self._planning_failed(f"{type(e).__name__}: {e}")
                raise
            said = group.allgather(why)
            others = [(r, w) for r, w in enumerate(said) if w is not None]
            if failed is None and others:
                r, w = others[0]
                failed = MkError(f"{self.name}: rank {r} of its members failed to plan it ({w}); "
                                 "it takes no calls here either")
                why = f"rank {r}'s planning failed"
        if failed is not None:
            self._planning_failed(why)
            raise failed

    def _check_live(self):
        """MkError if the op takes no more calls: after :meth:`free`, its Comm's finalize, or
        a call this rank did not launch (:meth:`_end_calls`)."""
        if self.freed:
            raise MkError(f"{self.name}: called after " + (
                self._ended if self._ended else
                "its Comm was finalized" if self.finalized else "free()"))

    def _checked_call(self, call, *args):
        """``call(*args)``: a call with every check, after :meth:`_check_live` and
        :meth:`_check_error`. That may raise an earlier call's error, and ``call`` may
        refuse its arguments (MkValueError), before anything is launched; in an op of several
        ranks the others may have launched that call, so this rank then takes no later one
        (:meth:`_end_calls`). (``call``'s other refusals, MkError inside a CUDA graph capture,
        leave the op as it was: every rank captures alike.)"""
        self._check_live()
        try:
            self._check_error(f"{self.name} (an earlier call)")
        except MkError as e:          # an earlier call's error, raised instead of this launch
            self._end_calls(f"an error here ({e})")
            raise
        try:
            return call(*args)
        except MkValueError as e:
            self._end_calls(f"a call it refused here ({e})")
            raise

    def _check_error(self, what):
        """Raise what the op's calls left in its error record (a timeout, a capacity overflow,
        an expert id out of range: MoE), or a failed proxy first (``Comm.check``)."""
        if self.comm is not None:
            self.comm.check(self.err, what, self._flag_name)
        else:
            raise_if_timed_out(self.err, what, self._flag_name)

    def _flag_name(self, role, index, array=0):
        """What flag ``index`` of the flag array ``array`` (``errors.ROLE_BITS``: 0 where the
        role waits on one), which a wait of ``role`` (``errors.ROLE_*``) timed out on, stands
        for in the caller's terms (e.g. "rank 3's tile 2 of its shard"), for the timeout's
        message; None where the op cannot tell. Ops override it."""
        return None

    def _end_calls(self, why):
        """This rank raised instead of launching a call that the other ranks may have
        launched, so none of its later calls may pair with theirs (ops of 2+ members): it
        takes no more calls (``freed``; :meth:`free` still releases the buffers), while the
        others' launch times out. (Counting the call as made instead would not do: a quick
        retry would publish the next epoch, which meets the others' waits for the refused
        call, and they would read stale data.) The end is host state, not the error record,
        which a kernel may write first; and the frame is closed (:meth:`Frame.close`), so a CUDA
        graph of the op's calls captured before replays as nothing here."""
        if self._pairs() and not self.freed:
            self.freed, self._ended = True, why
            self._close_frame()

    def _pairs(self):
        """Whether the op's calls pair with other ranks' (2+ members, a call counter)."""
        return (self.comm is not None and getattr(self, "members", self.comm.size) > 1
                and self.frame is not None)

    def _close_frame(self):
        """:meth:`Frame.close` behind the op's last call: its graphs' replays launch nothing
        from now on. On the way to raising an error, so a failure to close warns rather than
        replacing that error."""
        if self.frame is None:
            return
        try:
            self.frame.close(self.streams.last)
        except Exception as e:      # noqa: BLE001 (the error being raised matters more)
            warnings.warn(f"{self.name}: could not close its call counter ({e}); a CUDA graph "
                          "of its calls captured earlier may still launch", RuntimeWarning)

    def _wait(self, stream=None):
        """Wait for this rank's calls on ``stream`` (default the stream of the last call)."""
        stream = stream if stream is not None else (self.streams.last or 0)
        if self.comm is not None:
            self.comm.synchronize(stream)
        elif not SIMULATOR:
            cuda.synchronize()

    def _counters(self):
        """``[(device array, tickets one call draws from each entry)]``: the ticket counters
        besides the frame's that every call advances alike (:func:`counter_at`; work queues,
        chunk counts), which :meth:`_start_at` sets to ``calls`` calls' worth. None here."""
        return []

    def synchronize(self, stream=None):
        """Wait for this rank's calls (on ``stream``, default the stream of the last call);
        raise the error a device wait or check recorded (MkTimeoutError, ...). Such an error
        stays (the next call raises it, then the op takes no more), and from now on a CUDA
        graph of the op's calls replays as nothing here (:meth:`Frame.close`); an expert id
        out of range (MoE, MkValueError) is cleared once raised, and the op goes on. After the
        op ended on this rank (:meth:`_end_calls`), MkError: a replay since wrote nothing."""
        self._wait(stream)
        try:
            self._check_error(self.name)
        except MkValueError:
            raise
        except MkError:
            if self._pairs() and not self.freed:
                self._close_frame()
            raise
        if self._ended:
            raise MkError(f"{self.name}: ended on this rank by {self._ended}; a CUDA graph of "
                          "its calls replayed since then launched nothing")

    def free(self):
        """Collective: release the op's symmetric buffers (waits for this rank's calls); a CUDA
        graph of its calls replays as nothing after it (while the op object lives: the counter
        that says so is the op's)."""
        if self.freed and (self.finalized or not self._buffers):
            return
        self._wait()
        self._close_frame()      # a graph's replays must not touch the freed buffers
        for buf in self._buffers:
            self.comm.free(buf)
        self._buffers = []
        self.freed, self._ended = True, None

    def _start_at(self, calls):
        """Tests: set this rank's state as if ``calls`` calls had run (the frame, every epoch
        flag, and the ticket counters of :meth:`_counters`), e.g. just short of 2**32, to run
        the next calls across the wrap. Collective in effect: every rank must do it with the
        same ``calls`` between calls, after synchronising."""
        self.synchronize()
        self.frame.start_at(calls, self._epoch_flags, self.comm)
        for counter, per_call in self._counters():
            counter_at(counter, per_call, calls)
