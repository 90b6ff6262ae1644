"""Transports behind one interface (:class:`.base.Transport`), and the choice among them.

``spec`` is ``name[:mode]``: name ``sim`` | ``dma`` | ``verbs``; mode ``ordered`` (alias ``rc``)
or ``completion`` (alias ``srd``; ``sim`` and ``dma`` only). Default mode: ordered.
"""
import os
import socket

from ...errors import MkError, MkValueError
from .base import COMPLETION, ORDERED, Transport

NAMES = ("sim", "dma", "verbs")
_MODES = {"ordered": ORDERED, "rc": ORDERED, "completion": COMPLETION, "srd": COMPLETION}


def parse_spec(spec):
    """'dma:completion' -> ('dma', 'completion'); 'verbs' -> ('verbs', None)."""
    name, _, mode = (spec or "").strip().lower().partition(":")
    if name not in NAMES:
        raise MkValueError(f"unknown transport {spec!r}; choose one of {NAMES} "
                           "(optionally ':ordered' or ':completion')")
    if mode and mode not in _MODES:
        raise MkValueError(f"unknown completion mode {mode!r} in {spec!r}; choose ordered (rc) "
                           "or completion (srd)")
    return name, (_MODES[mode] if mode else None)


def choose(comm, spec=None):
    """The transport spec to use: the argument, else MKNUMBA_TRANSPORT, else by the machine:
    ``sim`` under the simulator, ``dma`` when every rank is on this host (emulated nodes),
    ``verbs`` when an RDMA device connects real nodes."""
    spec = spec or os.environ.get("MKNUMBA_TRANSPORT")
    if spec:
        name, mode = parse_spec(spec)
    elif comm.simulator:
        name, mode = "sim", None
    elif len(set(comm.mpi.allgather(socket.gethostname()))) == 1:
        name, mode = "dma", None
    else:
        from .verbs import rdma_available
        ok, why = rdma_available()
        if not ok:
            raise MkError(f"ranks run on several hosts but no RDMA device is usable ({why}); "
                          "mknumba's inter-node transport needs InfiniBand or EFA with pyverbs")
        name, mode = "verbs", None
    if comm.simulator and name != "sim":
        raise MkValueError(f"transport {name!r} cannot run under the simulator; use 'sim'")
    return name, mode


def make(comm, name, mode=None, **options):
    """Construct transport ``name`` (collective: transports exchange connection info)."""
    if name == "sim":
        from .sim import SimTransport
        return SimTransport(comm, mode or ORDERED, **options)
    if name == "dma":
        from .dma import DmaTransport
        return DmaTransport(comm, mode or ORDERED, **options)
    if name == "verbs":
        from .verbs import VerbsTransport
        return VerbsTransport(comm, mode, **options)
    raise MkValueError(f"unknown transport {name!r}")


__all__ = ["Transport", "ORDERED", "COMPLETION", "NAMES", "parse_spec", "choose", "make"]
