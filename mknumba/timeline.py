"""Per-role timelines of a traced fused call as a Chrome / Perfetto trace (``op.save_trace``).

An op built with ``trace=True`` stamps each role's items with the GPU clock. Its
``timeline()`` turns the stamps of the last call into a :class:`Timeline` (plain lists, one
rank); :func:`save` gathers every rank's to rank 0 over MPI and writes one JSON file in the
Trace Event Format that ``chrome://tracing`` and https://ui.perfetto.dev open:

- one process per rank (``pid`` = world rank);
- per role one group of threads named after the role (``compute``, ``reduce``, ``send``,
  ``recv``, ``pull``, ``forward``, ``collect``), an ``X`` event per item (a tile computed, a
  tile reduced, a chunk sent, a chunk received and finished, a tile pulled; AllGather + GEMM:
  a part of A stored here, pushed to the node's GPUs, forwarded, collected). Items of one role overlap in time
  (many blocks), and a trace viewer wants the events of one thread nested, so a role's items
  are laid out on lanes: ``reduce``, ``reduce 2``, ... (as few as the overlap needs);
- a counter ``SMs per role``: how many blocks each role held over time (from the blocks'
  start and end stamps, or with the adaptive split from the controller's decision log);
- a counter ``controller target``: the communication blocks the controller wanted at each of
  its decisions (adaptive split only).

Times are microseconds from the earliest stamp of any rank (the GPUs of one host share the
clock closely enough for a picture; across hosts, read each rank on its own).
``benchmarks/plot_timeline.py`` draws the ``SMs per role`` counter like the paper's Figure 7.
"""
import json
from typing import NamedTuple

import numpy as np

from .errors import MkValueError

#: roles in the order their tracks appear
ROLES = ("compute", "reduce", "send", "recv", "pull", "forward", "collect")
SMS_COUNTER = "SMs per role"
TARGET_COUNTER = "controller target"


class Timeline(NamedTuple):
    """One rank's traced call, times in ns of the GPU clock.

    items: role -> [(start, end, item, block)] (block -1 where not recorded), or
    [(start, end, item, block, name)] to name the event ``name item`` rather than after the
    role (two kinds of item on one role's tracks);
    segments: [(block, role, start, end)]: which role each block held when;
    decisions: [(time, block, role, target)]: the controller's (adaptive split);
    meta: anything JSON-able (op name, shape, split, ...)."""
    rank: int
    items: dict
    segments: list
    decisions: list
    meta: dict


def decision_log(rows, events, blocks, entries):
    """Every block's controller decisions from the trace rows ``rows`` of a kernel with
    ``events`` stamp rows, the last of them the count of entries (``roles.controller.log``,
    at most ``entries`` kept): per block [(time, role, target)]."""
    n = len(events)
    count = rows[n - 1]
    return [[(int(rows[n + 2 * j, b]), int(rows[n + 2 * j + 1, b]) & 15,
              int(rows[n + 2 * j + 1, b]) >> 4) for j in range(min(int(count[b]), entries))]
            for b in range(blocks)]


def segments_from_log(start, end, log, names):
    """A block's role segments from its decision log ``[(time, role, target)]``: each role
    from its entry to the next, the last to ``end`` (``names``: role number -> name)."""
    out = []
    for j, (t, role, _) in enumerate(log):
        t0 = max(int(t), int(start))
        t1 = int(log[j + 1][0]) if j + 1 < len(log) else int(end)
        if t1 > t0:
            out.append((names[role], t0, t1))
    return out


def sms_over_time(segments):
    """[(time, {role: blocks})] at every change, from ``segments``."""
    edges = []
    for _, role, t0, t1 in segments:
        edges.append((t0, 1, role))
        edges.append((t1, -1, role))
    edges.sort(key=lambda e: (e[0], e[1]))    # at one instant: ends before starts
    count = {r: 0 for r in ROLES}
    out = []
    for t, d, role in edges:
        count[role] = count.get(role, 0) + d
        if out and out[-1][0] == t:
            out[-1] = (t, dict(count))
        else:
            out.append((t, dict(count)))
    return out


def lanes(events):
    """Lay out ``[(start, end, ...)]`` on as few lanes as they need so that no two events of
    one lane overlap: [lane per event], in the order given."""
    order = sorted(range(len(events)), key=lambda i: (events[i][0], events[i][1]))
    free = []                   # per lane: when its last event ends
    lane = [0] * len(events)
    for i in order:
        s, e = events[i][0], events[i][1]
        for j, f in enumerate(free):
            if f <= s:
                lane[i], free[j] = j, e
                break
        else:
            lane[i] = len(free)
            free.append(e)
    return lane


def chrome_trace(timelines, meta=None):
    """The Trace Event Format dict of several ranks' :class:`Timeline` s."""
    stamps = [t for tl in timelines for ev in tl.items.values() for x in ev for t in x[:2]]
    stamps += [s[2] for tl in timelines for s in tl.segments]
    t0 = min(stamps) if stamps else 0
    us = lambda t: (int(t) - t0) / 1e3        # noqa: E731
    out = []
    for tl in timelines:
        pid = int(tl.rank)
        out.append(dict(ph="M", name="process_name", pid=pid, tid=0,
                        args=dict(name=f"rank {pid}")))
        out.append(dict(ph="M", name="process_sort_index", pid=pid, tid=0,
                        args=dict(sort_index=pid)))
        for r, role in enumerate(ROLES):
            ev = tl.items.get(role, [])
            lane = lanes(ev)
            for j in range(max(lane, default=-1) + 1):
                tid = 1 + r * 1000 + j
                out.append(dict(ph="M", name="thread_name", pid=pid, tid=tid,
                                args=dict(name=role if j == 0 else f"{role} {j + 1}")))
                out.append(dict(ph="M", name="thread_sort_index", pid=pid, tid=tid,
                                args=dict(sort_index=tid)))
            for x, j in sorted(zip(ev, lane), key=lambda x: x[0][0]):
                s, e, item, block = x[:4]
                out.append(dict(ph="X", name=f"{x[4] if len(x) > 4 else role} {item}",
                                cat=role, pid=pid,
                                tid=1 + r * 1000 + j, ts=us(s), dur=max(0.0, (e - s) / 1e3),
                                args=dict(item=int(item), block=int(block))))
        for t, count in sms_over_time(tl.segments):
            out.append(dict(ph="C", name=SMS_COUNTER, pid=pid, tid=0, ts=us(t),
                            args={r: count.get(r, 0) for r in ROLES}))
        for t, block, role, want in sorted(tl.decisions):
            out.append(dict(ph="C", name=TARGET_COUNTER, pid=pid, tid=0, ts=us(t),
                            args=dict(target=int(want))))
    ranks = {str(tl.rank): tl.meta for tl in timelines}
    return dict(traceEvents=out, displayTimeUnit="ns",
                otherData=dict(meta or {}, ranks=ranks, t0_ns=int(t0)))


def spans(ev, first, last, n, item, block=lambda i: -1, name=None):
    """Items ``[(start, end, item, block)]`` (``name``: with it, see :class:`Timeline`) of the
    stamp rows ``ev[first]`` and ``ev[last]`` over i < n, leaving out those not stamped (0)."""
    tail = () if name is None else (name,)
    return [(int(ev[first][i]), int(ev[last][i]), int(item(i)), int(block(i))) + tail
            for i in range(n) if ev[first][i] > 0 and ev[last][i] > 0]


def role_of(b, layout):
    """The role of block ``b`` in a static layout ``[(role, blocks), ...]`` in block order
    (None past its end)."""
    for role, count in layout:
        if b < count:
            return role
        b -= count
    return None


class Traced:
    """The host side of an op built with ``trace=True`` (mixin): ``self.tracing``,
    ``self._trace`` (the int64 [rows, items] array the kernel stamps), ``self.comm``,
    ``self.name`` and ``timeline()`` come from the op."""

    def clear_trace(self):
        """Zero the stamps (so a later read shows only what the next call reached)."""
        if self.tracing:
            self._trace.copy_to_device(np.zeros(self._trace.shape, np.int64))

    def _stamps(self, events):
        """The stamp rows of the last traced call: ({event: row}, every row)."""
        if not self.tracing:
            raise MkValueError(f"{self.name}: built without trace=True")
        rows = self._trace.copy_to_host()
        return dict(zip(events, rows)), rows

    def save_trace(self, path):
        """Collective (every rank calls it, after :meth:`synchronize`): rank 0 writes the last
        traced call of every rank to ``path`` as a Chrome / Perfetto trace
        (:mod:`mknumba.timeline`: one process per rank, tracks per role, an event per item,
        SMs per role, with the adaptive split the controller's target, as counters). Returns
        ``path`` on rank 0, None on the others."""
        return save(self.comm, self.timeline(), path)


def save(comm, timeline, path, meta=None):
    """Collective over ``comm`` (every rank calls it): rank 0 gathers every rank's
    ``timeline`` and writes the trace to ``path``; returns ``path`` there, None elsewhere."""
    everyone = comm.mpi.gather(timeline, root=0)
    if comm.mpi.Get_rank() != 0:
        return None
    with open(path, "w") as f:
        json.dump(chrome_trace(everyone, meta), f)
    return path
