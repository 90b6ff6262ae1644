"""Exceptions, role codes, and the device error record that turns a hang into a message.

A kernel block whose bounded wait expires writes one record (first writer wins) into a small
int64 array in mapped host memory; the host decodes it into :class:`MkTimeoutError`.
"""
import numpy as np


class MkError(RuntimeError):
    """Base class for mknumba errors."""


class MkValueError(MkError, ValueError):
    """An argument was rejected before anything was launched."""


class MkTimeoutError(MkError, TimeoutError):
    """A bounded device-side wait expired: names the rank, role and flag it was waiting on."""


class MkCapacityError(MkError):
    """More rows came to a rank than its op was planned for (the device found it and stopped
    instead of writing past its buffers)."""


class MkPerformanceWarning(RuntimeWarning):
    """The run will work, but a setting will cost time (e.g. the proxy has no core of its own)."""


def positive_ints(op, **values):
    """``values`` (dimensions, block counts, band heights) as ints, each a positive integer; a
    None passes as it is (an option left to its default). Else MkValueError naming ``op`` and
    the field: a zero or negative count would otherwise plan a launch that skips its work."""
    got = {}
    for key, value in values.items():
        if value is not None:
            try:
                ok = not isinstance(value, str) and int(value) == value and value >= 1
            except (TypeError, ValueError, OverflowError):
                ok = False
            if not ok:
                raise MkValueError(f"{op}: {key} must be a positive integer, got {value!r}")
            value = int(value)
        got[key] = value
    return got


# Role codes carried in error records; names appear in messages.
ROLE_COMPUTE, ROLE_INTRA, ROLE_SEND, ROLE_RECV, ROLE_CONTROLLER, ROLE_PROXY, ROLE_TEST = range(1, 8)
ROLE_NAMES = {ROLE_COMPUTE: "compute", ROLE_INTRA: "intra-node comm", ROLE_SEND: "inter-node send",
              ROLE_RECV: "receive", ROLE_CONTROLLER: "controller", ROLE_PROXY: "proxy",
              ROLE_TEST: "test"}

#: A wait's role code may say, above its low byte, which of the role's flag arrays it watched
#: (``role | array << ROLE_BITS``; array 0: the role's first or only one), so that an op whose
#: role waits on several arrays still says what a timed-out flag stands for (its
#: ``_flag_name``). ARRAY_RING_CREDIT: the proxy's command ring's free slots, which the send
#: role of every op waits on (``roles.send.enqueue``; named here, not by the op).
ROLE_BITS = 8
ARRAY_RING_CREDIT = 255
ROLE_SEND_CREDIT = ROLE_SEND | ARRAY_RING_CREDIT << ROLE_BITS

# Layout of the error record: one int64 per field.
ERR_SET, ERR_RANK, ERR_ROLE, ERR_FLAG, ERR_EXPECTED, ERR_SEEN, ERR_BLOCK, ERR_KIND = range(8)
ERR_WORDS = 8
#: ERR_KIND: what the record says. KIND_TIMEOUT: a wait expired (the fields say which).
#: KIND_CAPACITY: more rows arrived than planned (ERR_EXPECTED: the planned capacity, ERR_SEEN:
#: the rows that came). KIND_EXPERT: an input routed a token to an expert id out of range, and
#: the kernel left that pair out (ERR_FLAG: the token, ERR_BLOCK: its top-k slot, ERR_EXPECTED:
#: the number of experts, ERR_SEEN: the id).
KIND_TIMEOUT, KIND_CAPACITY, KIND_EXPERT = 0, 1, 2
#: the exception each kind raises
KIND_ERRORS = {KIND_TIMEOUT: MkTimeoutError, KIND_CAPACITY: MkCapacityError,
               KIND_EXPERT: MkValueError}
#: kinds whose launch still ended consistently on every rank (a bad input was left out and
#: reported): the record is cleared once raised, so after synchronize() raised it the op
#: takes the next call (raised by a call instead, that call is not launched on this rank:
#: ``kernels.lifetime.OpLifetime._end_calls``)
CLEARED_ONCE_RAISED = (KIND_EXPERT,)


def raise_if_timed_out(rec, what="", flag_name=None):
    """Raise the error the record ``rec`` holds, if any (:data:`KIND_ERRORS`): MkTimeoutError
    describing a wait that expired, ... A kind in :data:`CLEARED_ONCE_RAISED` is cleared first
    (every other word, then the set word: a kernel may write a new record once it is clear).
    ``flag_name``: as :func:`describe_error_record` takes it."""
    msg = describe_error_record(rec, what, flag_name)
    if msg:
        kind = int(rec[ERR_KIND])
        if kind in CLEARED_ONCE_RAISED:
            rec[ERR_SET + 1:] = 0
            rec[ERR_SET] = 0
        raise KIND_ERRORS.get(kind, MkTimeoutError)(msg)


def describe_error_record(rec, what="", flag_name=None):
    """Format an error record (a length-8 int64 array) as a sentence; '' when it is clear.
    ``flag_name(role, index, array)``: what flag ``index`` of the role's flag array
    ``array`` (:data:`ROLE_BITS`), which a timed-out wait watched, stands for in the caller's
    terms (e.g. "rank 3's tile 2 of its shard"), or None where the op cannot tell (an op's
    ``_flag_name``)."""
    rec = np.asarray(rec)
    if rec[ERR_SET] == 0:
        return ""
    where = what + ": " if what else ""
    code = int(rec[ERR_ROLE])
    role_id, array = code & ((1 << ROLE_BITS) - 1), code >> ROLE_BITS
    role = ROLE_NAMES.get(role_id, f"role {role_id}")
    if rec[ERR_KIND] == KIND_EXPERT:
        return (f"{where}rank {int(rec[ERR_RANK])}: topk_idx[{int(rec[ERR_FLAG])}, "
                f"{int(rec[ERR_BLOCK])}] = {int(rec[ERR_SEEN])} is not an expert id (0 .. "
                f"{int(rec[ERR_EXPECTED]) - 1}); that call left it out (the first such pair; "
                "any others too).")
    if rec[ERR_KIND] == KIND_CAPACITY:
        return (f"{where}rank {int(rec[ERR_RANK])}, {role} role (block "
                f"{int(rec[ERR_BLOCK])}): {int(rec[ERR_SEEN])} rows were routed to this rank, "
                f"more than the {int(rec[ERR_EXPECTED])} it was planned for; nothing was "
                "written past them. Plan with a larger capacity (or max_tokens).")
    if code == ROLE_SEND_CREDIT:
        name = "a free slot in the proxy's command ring"
    else:
        name = flag_name(role_id, int(rec[ERR_FLAG]), array) if flag_name else None
    return (f"{where}rank {int(rec[ERR_RANK])}, {role} role (block "
            f"{int(rec[ERR_BLOCK])}) timed out waiting on flag {int(rec[ERR_FLAG])}"
            f"{f' ({name})' if name else ''} to reach epoch {int(rec[ERR_EXPECTED])}; it last "
            f"held {int(rec[ERR_SEEN])}. A peer rank probably failed, was not launched, or "
            "called with other arguments.")
