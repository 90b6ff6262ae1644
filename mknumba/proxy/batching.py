"""Submission batching: up to ``max_batch`` ready commands per connection, partial after a window.

Each command keeps its own transfer and arrival flag; a batch only shares one submission (one
driver call or one chain of work requests). Filling every batch would stall sparse arrivals and
the last chunks of a call, so a partial batch leaves once its oldest command has waited
``window_ns`` (paper §3.3).
"""
import numpy as np

from .ring import COMMAND_DTYPE


class Batcher:
    """Per-connection FIFO of commands (a connection is a destination peer).

    add(cmds, now_ns): cmds is a COMMAND_DTYPE array in ticket order.
    take(now_ns, flush=False) -> list of (peer, COMMAND_DTYPE array of 1..max_batch commands).
    """

    def __init__(self, max_batch=8, window_ns=5_000):
        if not 1 <= max_batch <= 256:
            raise ValueError(f"max_batch must be in 1..256, got {max_batch}")
        self.max_batch = int(max_batch)
        self.window_ns = int(window_ns)
        self._pending = {}   # peer -> (commands, arrival time of each)

    def __len__(self):
        return sum(len(c) for c, _ in self._pending.values())

    def add(self, cmds, now_ns):
        if len(cmds) == 0:
            return
        peers = cmds["peer"]
        first = int(peers[0])
        groups = ([(first, cmds)] if (peers == first).all()
                  else [(int(p), cmds[peers == p]) for p in np.unique(peers)])
        for peer, c in groups:
            t = np.full(len(c), now_ns, dtype=np.int64)
            old = self._pending.get(peer)
            self._pending[peer] = (c, t) if old is None else (np.concatenate([old[0], c]),
                                                              np.concatenate([old[1], t]))

    def take(self, now_ns, flush=False):
        out = []
        for peer in list(self._pending):
            c, t = self._pending[peer]
            full = len(c) - len(c) % self.max_batch
            for i in range(0, full, self.max_batch):
                out.append((peer, c[i:i + self.max_batch]))
            rest, rest_t = c[full:], t[full:]
            if len(rest) and (flush or now_ns - rest_t[0] >= self.window_ns):
                out.append((peer, rest))
                rest = rest[:0]
            if len(rest):
                self._pending[peer] = (rest, rest_t)
            else:
                del self._pending[peer]
        return out


def empty_commands():
    return np.zeros(0, dtype=COMMAND_DTYPE)
