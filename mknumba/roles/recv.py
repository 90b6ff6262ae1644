"""Inter-node receive role: wait until a chunk sent through the proxy has arrived.

The transport writes the chunk's arrival flag only after the payload is in place (ordered RC-like
paths write it after the data on the same queue; completion-based paths publish it from the
receive completion), so a flag at the call's epoch means the chunk may be read.
"""
from numba import cuda

from .. import _compat  # noqa: F401
from ..errors import ROLE_RECV
from ..primitives import wait_flag


@cuda.jit(device=True)
def wait_chunk(flags, flag_slot, epoch, deadline, err, rank):
    """Bounded wait for ``flags[flag_slot]`` (uint32, this rank's flag window) to reach ``epoch``.

    Returns False (with the error record written) past ``deadline`` (a ``globaltimer()`` value).
    The acquire load inside orders this thread's later reads of the chunk after the flag.
    """
    return wait_flag(flags, flag_slot, epoch, deadline, err, rank, ROLE_RECV)
