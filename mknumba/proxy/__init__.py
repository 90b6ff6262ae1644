"""Host proxy, command ring and transports (paper §3.3, docs/design.md §7).

Send blocks publish 48-byte commands into a ring in mapped host memory
(:func:`mknumba.roles.send.enqueue`); one proxy thread per GPU polls it, batches commands per
connection and hands them to a transport, which moves the payload and then makes the chunk's
arrival flag true on the peer (a bounded :func:`mknumba.primitives.wait_flag` waits for it).

    proxy = mknumba.proxy.start(comm)            # init() does this when comm.nodes > 1
    win = proxy.register(buf)                    # collective, same order on every rank
    ring, head, tail = proxy.device_args()       # kernel arguments for enqueue
    proxy.stop()                                 # finalize() does this

Environment: ``MKNUMBA_TRANSPORT`` = ``sim`` | ``dma`` | ``verbs``, optionally ``:ordered`` or
``:completion``; ``MKNUMBA_PACE_GBPS`` paces submissions to a NIC rate (e.g. 50);
``MKNUMBA_PROXY_SLOTS`` ring capacity (power of two, default 1024); ``MKNUMBA_PROXY_BATCH``
commands per submission and connection (default 8, the paper's; at most 256).
"""
import os

from . import transports
from .proxy import Proxy
from .ring import CMD_BYTES, CMD_WORDS, COMMAND_DTYPE, host_enqueue, write_body


def start(comm, transport=None, *, slots=None, max_batch=None, window_us=5.0, pace_gbps=None,
          **transport_options):
    """Collective: choose and connect the transport, start this rank's proxy thread.

    transport: a spec such as ``"dma:completion"`` (see :mod:`.transports`), a constructed
    Transport, or None to choose by MKNUMBA_TRANSPORT and the machine. Returns the Proxy.
    """
    if isinstance(transport, transports.Transport):
        t = transport
    else:
        name, mode = transports.choose(comm, transport)
        t = transports.make(comm, name, mode, **transport_options)
    if pace_gbps is None and os.environ.get("MKNUMBA_PACE_GBPS"):
        pace_gbps = float(os.environ["MKNUMBA_PACE_GBPS"])
    _warn_if_one_cpu(comm)
    # Defaults of the proxy benchmark runs (benchmarks/NOTES.md, proxy: batches of 8 reached
    # 87-100% of the copy engine at 1-4 MiB chunks); other values were not swept.
    slots = int(slots or os.environ.get("MKNUMBA_PROXY_SLOTS", 1024))
    max_batch = int(max_batch or os.environ.get("MKNUMBA_PROXY_BATCH", 8))
    return Proxy(comm, t, slots=slots, max_batch=max_batch, window_us=window_us,
                 pace_gbps=pace_gbps)


def _warn_if_one_cpu(comm):
    """The proxy thread polls without pause while kernels run; sharing one CPU with the calling
    thread, the OS time-slices them and calls stall by milliseconds (measured: a fused op at
    2-3x its steady time under OpenMPI's default one-core binding, at the network floor with
    ``--bind-to none``)."""
    cpus = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    if cpus is not None and cpus < 2 and not comm.simulator:
        import warnings
        from ..errors import MkPerformanceWarning
        warnings.warn(f"rank {comm.rank} may run on 1 CPU, which its proxy thread would share "
                      "with the calling thread: launch with `mpirun --bind-to none` (or map "
                      "each rank to 2+ cores, e.g. `--map-by slot:PE=2`)", MkPerformanceWarning,
                      stacklevel=3)


__all__ = ["start", "Proxy", "transports", "CMD_BYTES", "CMD_WORDS", "COMMAND_DTYPE",
           "host_enqueue", "write_body"]
