"""Host clock and nap for compiled proxy code (``@njit(nogil=True)`` can call these).

``now_ns(clock)`` reads CLOCK_MONOTONIC (the clock of ``time.monotonic_ns``) through libc's vDSO
``clock_gettime`` (~20 ns). Being an opaque call, it also keeps the compiler from moving loads
of shared memory (ring headers, completion entries) across it, which the polling loops rely on.
``clock`` is a scratch int64[2] (a timespec) owned by the calling thread: :func:`new_clock`.
"""
import ctypes

import numpy as np
from numba import njit

_libc = ctypes.CDLL(None)
_clock_gettime = _libc.clock_gettime
_clock_gettime.restype, _clock_gettime.argtypes = ctypes.c_int, [ctypes.c_int, ctypes.c_uint64]
_usleep = _libc.usleep
_usleep.restype, _usleep.argtypes = ctypes.c_int, [ctypes.c_uint32]
_CLOCK_MONOTONIC = 1


def new_clock():
    return np.zeros(2, np.int64)


@njit(nogil=True)
def now_ns(clock):
    _clock_gettime(_CLOCK_MONOTONIC, clock.ctypes.data)
    return clock[0] * 1_000_000_000 + clock[1]


@njit(nogil=True)
def nap_us(us):
    """Sleep ``us`` microseconds without the GIL (the idle proxy leaves its core to others)."""
    _usleep(us)
