"""The 32-bit immediate that names a chunk's arrival flag (completion-based transports).

EFA SRD does not order writes, so the payload goes as an RDMA write with immediate and the
receiving proxy sets the flag from the receive completion. 32 bits must name the flag and its
epoch: flag slot (20 bits), flag window (4 bits), and the epoch's low 8 bits. The receiving proxy
is the only writer of those flags, so it knows each flag's last value and restores the full
epoch as the next value with those low bits (epochs advance by < 256 between uses of a flag).

The scalar functions are compiled, so the compiled proxy paths and the Python ones share them.
"""
import numpy as np
from numba import njit

SLOT_BITS, WIN_BITS, EPOCH_BITS = 20, 4, 8
MAX_FLAG_SLOTS, MAX_FLAG_WINDOWS = 1 << SLOT_BITS, 1 << WIN_BITS


@njit(nogil=True, inline="always")
def imm_of(flag_win, flag_slot, epoch):
    """One immediate (fields must fit: see :func:`check_flag_window`)."""
    return np.uint32(np.int64(flag_slot) | (np.int64(flag_win) << SLOT_BITS)
                     | ((np.int64(epoch) & 0xFF) << (SLOT_BITS + WIN_BITS)))


@njit(nogil=True, inline="always")
def imm_fields(imm):
    """-> (flag_win, flag_slot, epoch_lo8)."""
    v = np.int64(imm)
    return (v >> SLOT_BITS) & (MAX_FLAG_WINDOWS - 1), v & (MAX_FLAG_SLOTS - 1), v >> (SLOT_BITS + WIN_BITS)


@njit(nogil=True, inline="always")
def restore_epoch(last, lo8):
    """Full epoch from the flag's last value and the epoch's low 8 bits (wraps mod 2**32)."""
    return (np.int64(last) + ((np.int64(lo8) - np.int64(last)) & 0xFF)) & 0xFFFFFFFF


def check_flag_window(win, nslots):
    """Raise ValueError unless flags of window ``win`` (``nslots`` slots) fit an immediate."""
    if win >= MAX_FLAG_WINDOWS or nslots > MAX_FLAG_SLOTS:
        raise ValueError(f"completion-based transports name flags with {SLOT_BITS}-bit slots in "
                         f"{MAX_FLAG_WINDOWS} windows; flag window {win} has {nslots} slots")


@njit(nogil=True)
def _encode(wins, slots, epochs, out):
    for i in range(out.shape[0]):
        out[i] = imm_of(wins[i], slots[i], epochs[i])


def encode_imm(flag_win, flag_slot, epoch):
    """Arrays or scalars -> uint32 immediates. Raises ValueError if a field does not fit."""
    w, s, e = np.broadcast_arrays(*(np.atleast_1d(np.asarray(x, np.int64))
                                    for x in (flag_win, flag_slot, epoch)))
    if len(w) and ((s >= MAX_FLAG_SLOTS).any() or (w >= MAX_FLAG_WINDOWS).any()):
        raise ValueError(f"completion-based transports name flags with {SLOT_BITS}-bit slots in "
                         f"{MAX_FLAG_WINDOWS} windows; got slot {s.max()}, window {w.max()}")
    out = np.empty(len(w), np.uint32)
    _encode(np.ascontiguousarray(w), np.ascontiguousarray(s), np.ascontiguousarray(e), out)
    return out


@njit(nogil=True, inline="always")
def shadow_publish(values, offsets, imm):
    """Receiving side of one immediate -> (flag_win, flag_slot, full epoch); updates the shadow.

    values: int64, every flag window's last published values back to back; offsets: int64 per
    window id, the window's first index in ``values`` (-1: not a flag window).
    """
    win, slot, lo = imm_fields(imm)
    i = offsets[win] + slot
    e = restore_epoch(values[i], lo)
    values[i] = e
    return win, slot, e


@njit(nogil=True)
def _publish_all(values, offsets, imms, wins, slots, epochs):
    for i in range(imms.shape[0]):   # in order: one flag may appear twice in a batch
        wins[i], slots[i], epochs[i] = shadow_publish(values, offsets, imms[i])


class FlagShadow:
    """The receiving proxy's copy of the flags it publishes (flags start zeroed: alloc_flags)."""

    def __init__(self):
        self.values = np.zeros(0, np.int64)
        self.offsets = np.full(MAX_FLAG_WINDOWS, -1, np.int64)
        self.sizes = np.zeros(MAX_FLAG_WINDOWS, np.int64)

    # New arrays rather than in-place changes: a running compiled loop keeps the pair it was
    # given until the proxy hands it the new one (Proxy._retable).
    def add_window(self, win, n):
        check_flag_window(win, n)
        offsets = self.offsets.copy()
        offsets[win] = len(self.values)
        self.values = np.concatenate([self.values, np.zeros(n, np.int64)])
        self.offsets = offsets
        self.sizes[win] = n

    def remove_window(self, win):
        offsets = self.offsets.copy()
        offsets[win] = -1        # its values stay behind (a few bytes per flag; ids are reused)
        self.offsets = offsets

    def set_window(self, win, epoch):
        """Every flag of window ``win`` now holds ``epoch`` (set in place: the running proxy
        loop reads this array)."""
        i = self.offsets[win]
        self.values[i:i + self.sizes[win]] = epoch

    def publish(self, imms):
        """Decode immediates in arrival order -> (flag_win, flag_slot, epoch) int64 arrays."""
        imms = np.ascontiguousarray(imms, np.uint32)
        wins, slots, epochs = (np.empty(len(imms), np.int64) for _ in range(3))
        _publish_all(self.values, self.offsets, imms, wins, slots, epochs)
        return wins, slots, epochs
