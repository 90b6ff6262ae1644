"""The streams an op's calls come on: the caller's stream as a raw handle that keeps its stream
object alive (:func:`stream_handle`), whether a stream is being captured into a CUDA graph
(:func:`is_capturing`, :func:`outputs_in_capture`), and one order for an op's calls across
streams (:class:`StreamOrder`)."""
import threading

from .._compat import SIMULATOR
from ..errors import MkError, MkValueError

__all__ = ["StreamHandle", "stream_handle", "is_capturing", "outputs_in_capture", "StreamOrder"]


class StreamHandle(int):
    """A raw stream handle that keeps the stream object it came from alive (``stream``). An op
    keeps the stream of its last call (:class:`StreamOrder`) and uses it after the call: to
    order a call on another stream behind it, in ``synchronize()``, to close its call counter.
    By then the caller may have dropped the object, and a numba or CuPy stream is destroyed
    with it: its handle would name freed driver state."""


def stream_handle(stream, torch_device=None):
    """The raw handle (int) of ``stream``: None (with torch tensors, PyTorch's current stream on
    ``torch_device``; else the legacy default stream, 0), an int, a numba stream, a CuPy stream
    (``.ptr``) or a PyTorch stream (``.cuda_stream``). A stream object's handle holds the
    object (:class:`StreamHandle`). A raw handle (an int, or a PyTorch external stream made
    current) must stay valid until the op's next call on another stream, its
    ``synchronize()`` and ``free()``; PyTorch's own streams are never destroyed."""
    if SIMULATOR:
        return 0
    if stream is None:
        if torch_device is None:
            return 0
        return _torch_current_stream(torch_device)
    if isinstance(stream, int):
        return stream
    handle = None
    for attr in ("cuda_stream", "ptr"):
        if hasattr(stream, attr):
            handle = int(getattr(stream, attr))
            break
    else:
        handle = getattr(stream, "handle", None)
        if handle is not None:
            handle = int(getattr(handle, "value", handle) or 0)
    if handle is not None:
        if not handle:
            return 0                 # the legacy default stream: nothing to keep alive
        held = StreamHandle(handle)
        held.stream = stream
        return held
    raise MkValueError(f"stream: expected a CUDA stream (numba, CuPy, PyTorch) or a raw handle, "
                       f"got {type(stream).__name__}")


_raw_stream = None


def _torch_current_stream(device):
    global _raw_stream
    if _raw_stream is None:
        import torch
        _raw_stream = getattr(torch._C, "_cuda_getCurrentRawStream", None) or (
            lambda d: torch.cuda.current_stream(d).cuda_stream)
    return _raw_stream(device)


def is_capturing(stream):
    """True while ``stream`` (a raw handle) is being captured into a CUDA graph."""
    if SIMULATOR:
        return False
    from cuda.bindings import driver as drv
    err, status = drv.cuStreamIsCapturing(drv.CUstream(stream))
    if err != drv.CUresult.CUDA_SUCCESS:
        raise MkError(f"cuStreamIsCapturing failed: {err}")
    return status != drv.CUstreamCaptureStatus.CU_STREAM_CAPTURE_STATUS_NONE


def outputs_in_capture(op, stream, **outputs):
    """Refuse (MkError) a call on a capturing ``stream`` that leaves out one of ``outputs``
    (name -> the array given, or None): the call would allocate it there, and every replay
    would write into it after the caller dropped it (numba then frees it for reuse)."""
    if all(x is not None for x in outputs.values()) or not is_capturing(stream):
        return
    names = " and ".join(f"{name}=" for name in outputs)
    missing = ", ".join(f"{name}=" for name, x in outputs.items() if x is None)
    raise MkError(f"{op}: a call inside a CUDA graph capture must pass {names} (the arrays the "
                  f"graph's replays write); without {missing} it would allocate here")


class StreamOrder:
    """Keeps an op's calls in one order when they come on different streams.

    The call counter (:class:`~mknumba.kernels.lifetime.Frame`) numbers launches in the order
    they start, so two calls of one op must not run at once. A call on another stream than the
    last one first makes its stream wait for the last call's (an event). A capturing stream
    takes no such dependency: a graph's replays run wherever they are replayed, ordered by the
    caller like any other work on that stream (``torch.cuda.graph`` synchronises the device
    before it captures). A call on another stream while a capture is in progress is refused: it
    could run during the capture's own calls. ``refused(why)``, if given, is told first
    (``OpLifetime._end_calls``).
    """

    def __init__(self, name, refused=None):
        self.name, self.last, self._refused = name, None, refused
        self._event = None
        self._lock = threading.Lock()

    def enter(self, stream):
        if SIMULATOR or stream == self.last:
            return
        with self._lock:
            last, self.last = self.last, stream
            if last is None or is_capturing(stream):
                return
            if is_capturing(last):
                self.last = last
                e = MkValueError(
                    f"{self.name}: called on stream {stream:#x} while a CUDA graph capture of "
                    f"its calls is in progress on stream {last:#x}; call it on the capturing "
                    "stream, or after the capture ends")
                if self._refused is not None:    # the hot paths refuse here, not in a check
                    self._refused(f"a call it refused here ({e})")
                raise e
            from cuda.bindings import driver as drv
            if self._event is None:
                err, self._event = drv.cuEventCreate(
                    drv.CUevent_flags.CU_EVENT_DISABLE_TIMING)
            (err,) = drv.cuEventRecord(self._event, drv.CUstream(last))
            if err == drv.CUresult.CUDA_SUCCESS:
                (err,) = drv.cuStreamWaitEvent(drv.CUstream(stream), self._event, 0)
            if err != drv.CUresult.CUDA_SUCCESS:
                raise MkError(f"{self.name}: could not order stream {stream:#x} after "
                              f"{last:#x}: {err}")
