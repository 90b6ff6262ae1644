"""The 32-bit immediate that names a chunk's arrival flag (completion-based transports).

EFA SRD does not order writes, so the payload goes as an RDMA write with immediate and the
receiving proxy sets the flag from the receive completion. 32 bits must name the flag and its
epoch: flag slot (20 bits), flag window (4 bits), and the epoch's low 8 bits. The receiving proxy
is the only writer of those flags, so it knows each flag's last value and restores the full
epoch as the next value with those low bits (epochs advance by < 256 between uses of a flag).
"""
import numpy as np

SLOT_BITS, WIN_BITS, EPOCH_BITS = 20, 4, 8
MAX_FLAG_SLOTS, MAX_FLAG_WINDOWS = 1 << SLOT_BITS, 1 << WIN_BITS


def encode_imm(flag_win, flag_slot, epoch):
    """Arrays or scalars -> uint32 immediates. Raises ValueError if a field does not fit."""
    flag_win = np.asarray(flag_win, np.int64)
    flag_slot = np.asarray(flag_slot, np.int64)
    if (flag_slot >= MAX_FLAG_SLOTS).any() or (flag_win >= MAX_FLAG_WINDOWS).any():
        raise ValueError(f"completion-based transports name flags with {SLOT_BITS}-bit slots in "
                         f"{MAX_FLAG_WINDOWS} windows; got slot {flag_slot.max()}, "
                         f"window {flag_win.max()}")
    lo = np.asarray(epoch, np.int64) & 0xFF
    return (flag_slot | (flag_win << SLOT_BITS) | (lo << (SLOT_BITS + WIN_BITS))).astype(np.uint32)


def decode_imm(imm):
    """uint32 immediates -> (flag_win, flag_slot, epoch_lo8) as int64 arrays."""
    imm = np.asarray(imm, np.int64)
    return ((imm >> SLOT_BITS) & (MAX_FLAG_WINDOWS - 1), imm & (MAX_FLAG_SLOTS - 1),
            imm >> (SLOT_BITS + WIN_BITS))


def restore_epoch(last, lo8):
    """Full epoch from the flag's last value and the epoch's low 8 bits (wraps mod 2**32)."""
    last = np.asarray(last, np.int64)
    return (last + ((np.asarray(lo8, np.int64) - last) & 0xFF)) & 0xFFFFFFFF


class FlagShadow:
    """The receiving proxy's copy of the flags it publishes: window -> int64 array of values."""

    def __init__(self):
        self._values = {}

    def add_window(self, win, n):
        self._values[win] = np.zeros(n, np.int64)   # flags start zeroed (alloc_flags)

    def publish(self, imms):
        """Decode immediates in arrival order -> (flag_win, flag_slot, epoch) int64 arrays."""
        wins, slots, lo = decode_imm(imms)
        epochs = np.empty(len(wins), np.int64)
        for i in range(len(wins)):   # sequential: one flag may appear twice in a batch
            vals = self._values[int(wins[i])]
            epochs[i] = vals[slots[i]] = restore_epoch(vals[slots[i]], lo[i])
        return wins, slots, epochs
