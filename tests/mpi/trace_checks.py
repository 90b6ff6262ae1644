"""The check of a saved role trace (``op.save_trace``), shared by the fused ops' checks
(``fused_checks.py``, ``allgather_gemm_checks.py``)."""
import json
import os
import tempfile


def check_saved_trace(op, counts):
    """op.save_trace (collective): rank 0 reads the file back and checks it: it parses; one
    process per rank, each with X events; per rank r, ``counts(r, meta)`` -> {role: events}
    (meta: the rank's ``otherData``; None: any number) events of each role,
    each on a track named after the role, its first track named the role; the ``SMs per
    role`` counter never above the rank's blocks and at 0 for every role at the end (every
    block ended); per track the events in time order, none overlapping the next. Returns the
    trace on rank 0, None on the others."""
    path = os.path.join(tempfile.gettempdir(), f"mk-trace-{os.getpid()}-{op.kernel_name}.json")
    path = op.comm.mpi.bcast(path, root=0)
    wrote = op.save_trace(path)
    if op.comm.rank != 0:
        assert wrote is None
        return None
    with open(path) as f:
        doc = json.load(f)
    os.unlink(path)
    ev = doc["traceEvents"]
    world = op.comm.size
    names = {(e["pid"], e["tid"]): e["args"]["name"] for e in ev
             if e["ph"] == "M" and e["name"] == "thread_name"}
    assert {e["pid"] for e in ev if e["ph"] == "X"} == set(range(world))
    for r in range(world):
        meta = doc["otherData"]["ranks"][str(r)]
        rb = meta["role_blocks"]
        for role, n in counts(r, meta).items():
            got = [e for e in ev if e["ph"] == "X" and e["pid"] == r and e["cat"] == role]
            assert n is None or len(got) == n, (r, role, len(got), n)
            for e in got:
                assert names[r, e["tid"]].split()[0] == role, (r, role, names[r, e["tid"]])
            assert not got or role in {names[r, e["tid"]] for e in got}, (r, role)
        counters = [e for e in ev if e["ph"] == "C" and e["pid"] == r]
        sms = [e for e in counters if e["name"] == "SMs per role"]
        assert sms and max(sum(e["args"].values()) for e in sms) <= sum(rb.values())
        assert sms[-1]["args"] == {k: 0 for k in sms[-1]["args"]}   # every block ended
    tracks = {}
    for e in ev:
        if e["ph"] == "X":
            tracks.setdefault((e["pid"], e["tid"]), []).append((e["ts"], e["ts"] + e["dur"]))
    for key, spans in tracks.items():          # in time order, none overlapping the next
        for (s0, e0), (s1, e1) in zip(spans, spans[1:]):
            assert s0 <= s1 and e0 <= s1 + 1e-6, (key, (s0, e0), (s1, e1))
    return doc
