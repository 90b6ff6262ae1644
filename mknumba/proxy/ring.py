"""The command ring: fixed 48-byte commands in pinned, device-mapped host memory (paper §3.3).

Layout: ``ring`` is uint32[slots * CMD_WORDS] (``slots`` a power of two). Command ``t`` (the
t-th ticket, counting from 0 over the ring's whole life) lives in slot ``t % slots`` and is
complete when its header word ``W_SEQ`` holds ``t + 1`` (mod 2**32). The producer writes the
body words first and commits the header last with a system-scope release store; the proxy polls
the header of the next expected slot, copies the command out, and only then returns the slot.

Who writes what (one writer per word, so the simulator's non-atomic cross-process memory works):
- ``ring`` words: the GPU (or a host-side producer in tests), through :func:`write_body` + commit;
- ``head`` uint32[1] in device memory: the GPU's ticket counter (atomic add on the GPU only);
- ``tail`` uint32[1] in mapped host memory: the proxy's count of commands copied out. It is the
  credit counter: ticket ``t`` may use its slot once ``tail`` reaches ``t + 1 - slots``.

Command words (uint32, little-endian; 64-bit offsets split lo/hi):

====  =========  =============================================================================
word  field      meaning
====  =========  =============================================================================
0     seq        header: ticket + 1; written last (release, sys scope)
1     peer       destination world rank
2-3   src_off    byte offset into this rank's source window
4-5   dst_off    byte offset into the peer's destination window
6     nbytes     payload bytes (< 4 GiB)
7     chunk      chunk id (for traces and the verbs work-request id)
8     flag_slot  index of the arrival flag in the peer's flag window
9     epoch      value the arrival flag takes (the call's epoch)
10    windows    src window | dst window << 8 | flag window << 16 (ids from Proxy.register)
11    reserved   0
====  =========  =============================================================================
"""
import numpy as np

CMD_WORDS = 12
CMD_BYTES = 4 * CMD_WORDS  # 48, the paper's command size
(W_SEQ, W_PEER, W_SRC_LO, W_SRC_HI, W_DST_LO, W_DST_HI, W_BYTES, W_CHUNK, W_FLAG, W_EPOCH,
 W_WINDOWS, W_RESERVED) = range(CMD_WORDS)
MAX_WINDOWS = 256

#: One command as the host sees it (the same 48 bytes, decoded).
COMMAND_DTYPE = np.dtype([
    ("seq", "<u4"), ("peer", "<u4"), ("src_off", "<u8"), ("dst_off", "<u8"), ("nbytes", "<u4"),
    ("chunk", "<u4"), ("flag_slot", "<u4"), ("epoch", "<u4"), ("src_win", "u1"),
    ("dst_win", "u1"), ("flag_win", "u1"), ("_pad", "u1"), ("reserved", "<u4")])
assert COMMAND_DTYPE.itemsize == CMD_BYTES


def write_body(ring, base, peer, src_win, src_off, dst_win, dst_off, nbytes, chunk, flag_win,
               flag_slot, epoch):
    """Write a command's body (every word but the header) at ``ring[base:base + CMD_WORDS]``.

    The one command encoder: ``roles.send.enqueue`` compiles it as a device function, host-side
    producers (tests, the simulator's feeders) call it on a numpy array. Integer arguments;
    offsets up to 2**64, the rest 32-bit (windows 8-bit).
    """
    ring[base + W_PEER] = np.uint32(peer)
    ring[base + W_SRC_LO] = np.uint32(np.uint64(src_off) & np.uint64(0xFFFFFFFF))
    ring[base + W_SRC_HI] = np.uint32(np.uint64(src_off) >> np.uint64(32))
    ring[base + W_DST_LO] = np.uint32(np.uint64(dst_off) & np.uint64(0xFFFFFFFF))
    ring[base + W_DST_HI] = np.uint32(np.uint64(dst_off) >> np.uint64(32))
    ring[base + W_BYTES] = np.uint32(nbytes)
    ring[base + W_CHUNK] = np.uint32(chunk)
    ring[base + W_FLAG] = np.uint32(flag_slot)
    ring[base + W_EPOCH] = np.uint32(epoch)
    ring[base + W_WINDOWS] = np.uint32((src_win & 0xFF) | ((dst_win & 0xFF) << 8)
                                       | ((flag_win & 0xFF) << 16))
    ring[base + W_RESERVED] = np.uint32(0)


def slot_base(ticket, slots):
    """First word of ticket's slot (slots: a power of two, so tickets may wrap at 2**32)."""
    return (np.int64(ticket) & np.int64(slots - 1)) * CMD_WORDS


def host_enqueue(ring, head, tail, **fields):
    """Host-side producer (tests, simulator feeders): enqueue one command, or return False when
    the ring has no credit. Same encoder and commit order as the device path.

    ring: uint32[slots * CMD_WORDS]; head: uint32[1] owned by this producer; tail: uint32[1].
    """
    slots = ring.shape[0] // CMD_WORDS
    t = int(head[0])
    if (t - int(tail[0])) & 0xFFFFFFFF >= slots:
        return False
    base = slot_base(t, slots)
    write_body(ring, base, **fields)
    ring[base + W_SEQ] = np.uint32((t + 1) & 0xFFFFFFFF)  # commit last (x86: stores in order)
    head[0] = np.uint32((t + 1) & 0xFFFFFFFF)
    return True
