"""The verbs transport's pure logic: commands -> work requests, connection info encoding.

Kept free of pyverbs so it is tested everywhere; :mod:`.verbs` feeds its output to the NIC.
"""
from collections import namedtuple

import numpy as np

# ibv_wr_opcode value (verbs.h)
IBV_WR_RDMA_WRITE = 0

#: One RDMA write: local source (addr, length, lkey) -> remote (addr, rkey); ``signaled`` asks
#: for a send completion (the last request of a batch).
WorkRequest = namedtuple("WorkRequest", "wr_id opcode local_addr length lkey remote_addr rkey "
                                        "signaled")


def work_requests(batch, local, remote, flag_source):
    """Translate one batch (COMMAND_DTYPE[n], one peer) into a chain of work requests.

    local: uint64[windows, 2] (address, lkey) of this rank's windows; remote: uint64[windows, 2]
    (address, rkey) of the peer's windows. Per command a data write, then a 4-byte flag write on
    the same queue pair, which RC delivers in order; flag_source(epoch) -> (addr, lkey)
    of registered host memory holding the epoch value (RC's flag payload).
    wr_id = the command's ring sequence number, so completions name their command.
    """
    out = []
    last = len(batch) - 1
    for i, c in enumerate(batch):
        sw, dw, fw = int(c["src_win"]), int(c["dst_win"]), int(c["flag_win"])
        src = int(local[sw, 0]) + int(c["src_off"])
        dst = int(remote[dw, 0]) + int(c["dst_off"])
        out.append(WorkRequest(int(c["seq"]), IBV_WR_RDMA_WRITE, src, int(c["nbytes"]),
                               int(local[sw, 1]), dst, int(remote[dw, 1]), False))
        faddr, fkey = flag_source(int(c["epoch"]))
        out.append(WorkRequest(int(c["seq"]), IBV_WR_RDMA_WRITE, faddr, 4, fkey,
                               int(remote[fw, 0]) + 4 * int(c["flag_slot"]),
                               int(remote[fw, 1]), i == last))
    return out


#: What a rank tells each peer to connect (RC: one QP per peer). Windows follow as (address, rkey) pairs.
CONN_DTYPE = np.dtype([("lid", "<u2"), ("port", "u1"), ("_pad", "u1"), ("qpn", "<u4"),
                       ("psn", "<u4"), ("qkey", "<u4"), ("gid", "u1", 16), ("nwin", "<u4")])
WIN_DTYPE = np.dtype([("addr", "<u8"), ("rkey", "<u4"), ("_pad", "<u4")])


def pack_conn_info(lid, port, qpn, psn, qkey, gid, windows):
    """-> bytes. gid: 16 bytes (or a 'fe80:...' string); windows: list of (addr, rkey)."""
    head = np.zeros(1, CONN_DTYPE)
    head["lid"], head["port"], head["qpn"], head["psn"], head["qkey"] = lid, port, qpn, psn, qkey
    head["gid"][0] = np.frombuffer(_gid_bytes(gid), np.uint8)
    head["nwin"] = len(windows)
    wins = np.zeros(len(windows), WIN_DTYPE)
    for i, (a, k) in enumerate(windows):
        wins[i]["addr"], wins[i]["rkey"] = a, k
    return head.tobytes() + wins.tobytes()


def unpack_conn_info(blob):
    """bytes -> (dict of lid, port, qpn, psn, qkey, gid (bytes)), uint64[nwin, 2] (addr, rkey))."""
    head = np.frombuffer(blob[:CONN_DTYPE.itemsize], CONN_DTYPE)[0]
    wins = np.frombuffer(blob[CONN_DTYPE.itemsize:], WIN_DTYPE, count=int(head["nwin"]))
    info = {k: int(head[k]) for k in ("lid", "port", "qpn", "psn", "qkey")}
    info["gid"] = bytes(head["gid"])
    table = np.stack([wins["addr"], wins["rkey"].astype(np.uint64)], axis=1) if len(wins) \
        else np.zeros((0, 2), np.uint64)
    return info, table


def _gid_bytes(gid):
    if isinstance(gid, (bytes, bytearray)):
        if len(gid) != 16:
            raise ValueError("a GID is 16 bytes")
        return bytes(gid)
    import ipaddress
    return ipaddress.IPv6Address(str(gid)).packed


class FlagSource:
    """Registered host slab of epoch values that RC flag writes read from.

    The NIC reads the 4 bytes after the post returns, so a slot must not be rewritten before its
    write completed: ``slots`` bounds the flag writes in flight (the transport keeps fewer).
    """

    def __init__(self, slots=4096):
        self.values = np.zeros(slots, np.uint32)
        self.next = 0
        self.base, self.lkey = self.values.ctypes.data, 0   # lkey set once registered

    def __call__(self, epoch):
        i = self.next % len(self.values)
        self.next += 1
        self.values[i] = epoch
        return self.base + 4 * i, self.lkey
