"""A stand-in for libcuda over host memory, so the dma transport's compiled path runs on CPUs.

Device addresses are host addresses (like UVA): copies are memmove, stream memory operations
write the value at once, so stream order is program order. Used by proxy_stress.py's
``dma-host:*`` transports and tests/test_proxy.py.
"""
import ctypes

import numpy as np

from mknumba.proxy.transports import _cudrv

INT = ctypes.c_int


def _fn(name, impl):
    return ctypes.CFUNCTYPE(INT, *_cudrv._SIGS[name][1])(impl)


def _put(addr, value):
    ctypes.c_uint64.from_address(addr).value = value
    return 0


def _memops(stream, n, params, flags):
    if not 0 < n < 256:
        return 1          # CUDA_ERROR_INVALID_VALUE, as the driver answers
    p = np.ctypeslib.as_array((ctypes.c_uint64 * (n * _cudrv.MEMOP_WORDS)).from_address(params))
    for i in range(n):
        op, addr, val = (int(x) for x in p[i * 6:i * 6 + 3])
        if op == _cudrv.CU_STREAM_MEM_OP_WRITE_VALUE_32:
            ctypes.c_uint32.from_address(addr).value = val & 0xFFFFFFFF
        elif op == _cudrv.CU_STREAM_MEM_OP_WRITE_VALUE_64:
            ctypes.c_uint64.from_address(addr).value = val
        else:
            return 1
    return 0


def _copy_batch(dsts, srcs, sizes, count, attrs, idx, nattrs, stream):
    if nattrs != 1 or ctypes.c_int32.from_address(attrs).value != 1:
        return 1      # the transport must ask for stream-ordered source access
    arr = [np.ctypeslib.as_array((ctypes.c_uint64 * count).from_address(a))
           for a in (dsts, srcs, sizes)]
    for d, s, n in zip(*arr):
        ctypes.memmove(int(d), int(s), int(n))
    return 0


class HostLib:
    """Attributes named like libcuda's symbols; counts calls in ``calls``."""

    def __init__(self, batch=True):
        self.calls = {}
        impl = {
            "copy": lambda d, s, n, st: (ctypes.memmove(d, s, n), 0)[1],
            "memops": _memops,
            "ctx_get": lambda p: _put(p, 1),
            "ctx_set": lambda c: 0,
            "stream_create": lambda p, f: _put(p, 7),
            "stream_destroy": lambda s: 0,
            "stream_sync": lambda s: 0,
            "stream_query": lambda s: 0,
            "host_register": lambda p, n, f: 0,
            "host_unregister": lambda p: 0,
            "host_devptr": lambda pd, p, f: _put(pd, p),
            "error_string": lambda rc, ps: 0,
            "event_create": lambda p, f: _put(p, 9),
            "event_destroy": lambda e: 0,
            "event_record": lambda e, st: 0,        # stream order is program order here
            "stream_wait_event": lambda st, e, f: 0,
        }
        if batch:
            impl["copy_batch"] = _copy_batch
        for name, f in impl.items():
            setattr(self, _cudrv._SIGS[name][0], _fn(name, self._count(name, f)))

    def _count(self, name, f):
        def wrapped(*a):
            self.calls[name] = self.calls.get(name, 0) + 1
            return f(*a)
        return wrapped


def host_driver(batch=True):
    return _cudrv.Driver(HostLib(batch))
