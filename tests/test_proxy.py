"""Command ring, the compiled proxy loop (batching, credits, pacing), immediates, transport choice, verbs planning; MPI stress tests."""
import time

import numpy as np
import pytest

import mknumba  # noqa: F401
from mknumba.proxy import engine as eng
from mknumba.proxy.clock import new_clock
from mknumba.proxy.imm import (MAX_FLAG_SLOTS, MAX_FLAG_WINDOWS, SLOT_BITS, WIN_BITS,
                               FlagShadow, encode_imm, restore_epoch)
from mknumba.proxy.ring import (CMD_WORDS, COMMAND_DTYPE, MAX_WINDOWS, W_SEQ, host_enqueue,
                                write_body)
from mknumba.proxy.transports import parse_spec
from mknumba.proxy.transports.verbs import rdma_available
from mknumba.proxy.transports.verbs_plan import (IBV_WR_RDMA_WRITE, FlagSource, pack_conn_info,
                                                 unpack_conn_info, work_requests)
from mpi_util import SharedLaunch

FIELDS = dict(peer=3, src_win=1, src_off=(5 << 32) + 7, dst_win=2, dst_off=(1 << 40) + 9,
              nbytes=4096, chunk=77, flag_win=4, flag_slot=1234, epoch=0xFFFFFFFE)


def decode_imm(imm):
    """uint32 immediates -> (flag_win, flag_slot, epoch_lo8): the field layout written out
    independently of the library's compiled decoder."""
    imm = np.asarray(imm, np.int64)
    return ((imm >> SLOT_BITS) & (MAX_FLAG_WINDOWS - 1), imm & (MAX_FLAG_SLOTS - 1),
            imm >> (SLOT_BITS + WIN_BITS))


def ring(slots=8):
    return np.zeros(slots * CMD_WORDS, np.uint32), np.zeros(1, np.uint32), np.zeros(1, np.uint32)


def test_encoder_round_trip():
    r = np.zeros(CMD_WORDS, np.uint32)
    write_body(r, 0, **FIELDS)
    c = r.view(COMMAND_DTYPE)[0]
    for k, v in FIELDS.items():
        assert int(c[k]) == v, k
    assert r[W_SEQ] == 0   # the encoder never commits


class LoopHarness:
    """The proxy's compiled loop in outbox mode over a host ring, driven without a thread."""

    def __init__(self, slots=8, size=4, max_batch=8, window_ns=10**9, pace_gbps=None):
        self.words, self.head, self.tail = ring(slots)
        self.recs = self.words.view(COMMAND_DTYPE)
        self.q = eng.Queues(size, max_batch, 64)
        self.st = np.zeros(eng.NSTATE, np.int64)
        self.cfg = np.zeros(eng.NCFG, np.int64)
        self.cfg[[eng.K_MAX_BATCH, eng.K_WINDOW_NS, eng.K_SPIN_NS, eng.K_SLICE_NS,
                  eng.K_POLL_LIMIT, eng.K_ME, eng.K_NWIN, eng.K_OUTBOX,
                  eng.K_PACE_FS_PER_BYTE]] = [max_batch, window_ns, 0, 10**9, 64, 0, 8, 1,
                                              1e6 / pace_gbps if pace_gbps else 0]
        self.win_bytes = np.full(MAX_WINDOWS, 1 << 50, np.uint64)
        self.clock = new_clock()

    def set_tail(self, t):
        self.head[0] = self.tail[0] = t
        self.st[eng.S_TAIL] = t

    def enqueue(self, **kw):
        return host_enqueue(self.words, self.head, self.tail, **dict(FIELDS, **kw))

    def run(self, stop=False):
        """One engine call -> (rc, [(peer, batch)] it deferred)."""
        self.st[eng.S_STOP] = stop
        self.st[eng.S_IDLE_SINCE] = 0          # idle at once: return instead of spinning
        q = self.q
        rc = eng.run(self.st, self.cfg, self.words, self.recs, self.tail, q.pending, q.count,
                     q.oldest, self.win_bytes, eng.defer, eng.no_progress, q.outbox_ctx(),
                     self.clock)
        return rc, q.take_outbox()

    def drain(self):
        """Run with stop set until drained -> every deferred batch."""
        out = []
        while True:
            rc, got = self.run(stop=True)
            out += got
            if rc == eng.RC_DRAINED:
                return out
            assert rc in (eng.RC_DEFERRED, eng.RC_IDLE), rc


def chunks(batches):
    return [int(c) for _, b in batches for c in b["chunk"]]


def test_loop_waits_for_header_and_keeps_order():
    h = LoopHarness(8)
    for j in range(5):
        assert h.enqueue(chunk=j)
    h.words[2 * CMD_WORDS + W_SEQ] = 0          # ticket 2 not committed yet: stop before it
    assert chunks(h.drain()) == [0, 1] and h.tail[0] == 2
    h.words[2 * CMD_WORDS + W_SEQ] = 3
    got = h.drain()
    assert chunks(got) == [2, 3, 4] and {p for p, _ in got} == {3}
    assert h.drain() == [] and h.st[eng.S_COMMANDS] == 5


def test_full_ring_refuses_then_wraps_with_credits():
    h = LoopHarness(4)
    seen = []
    for j in range(4 * 1000 + 3):           # many laps; tickets keep their order
        while not h.enqueue(chunk=j):
            assert h.head[0] - h.tail[0] == 4      # full: refused, nothing overwritten
            seen += chunks(h.drain())
    seen += chunks(h.drain())
    assert seen == list(range(4 * 1000 + 3))


def test_ticket_wraps_at_2_32():
    h = LoopHarness(4)
    h.set_tail(0xFFFFFFFE)
    for j in range(6):
        assert h.enqueue(chunk=j) or j >= 4
    assert chunks(h.drain()) == [0, 1, 2, 3] and h.tail[0] == 2


def test_full_batches_at_once_partial_after_window():
    h = LoopHarness(64, max_batch=8, window_ns=10**10)   # 10 s: no pause on a busy host ends it
    for j in range(22):
        assert h.enqueue(peer=1 if j < 19 else 2, chunk=j)
    rc, out = h.run()
    assert rc == eng.RC_DEFERRED and [(p, len(b)) for p, b in out] == [(1, 8), (1, 8)]
    assert h.run()[1] == []                   # the window has not passed
    h.cfg[eng.K_WINDOW_NS] = 1_000_000        # now a 1 ms window, and let it pass
    time.sleep(0.01)
    rc, out = h.run()
    assert sorted((p, len(b)) for p, b in out) == [(1, 3), (2, 3)]
    assert h.drain() == [] and h.st[eng.S_BATCHES] == 4


def test_keeps_per_connection_order_and_flushes_when_stopping():
    h = LoopHarness(64, max_batch=4)
    peers = np.random.default_rng(0).integers(1, 4, 50)
    for j, p in enumerate(peers):
        assert h.enqueue(peer=int(p), chunk=j)
    out = h.drain()
    for p in (1, 2, 3):
        got = [int(c) for q, b in out if q == p for c in b["chunk"]]
        assert got == list(np.flatnonzero(peers == p))
    assert all(len(b) <= 4 for _, b in out)


def test_bad_commands_stop_the_loop_with_a_reason():
    h = LoopHarness(8)
    h.win_bytes[:] = 4096
    assert h.enqueue(peer=1, src_off=0, dst_off=4000, nbytes=200)    # leaves its window
    rc, out = h.run(stop=True)
    assert rc == eng.RC_ERROR and out == []
    assert (h.st[eng.S_ERR], h.st[eng.S_ERR_PEER], h.st[eng.S_ERR_CODE]) == (eng.E_COMMAND, 1, 1)
    h = LoopHarness(8)
    assert h.enqueue(peer=9)                                          # no such rank
    assert h.run()[0] == eng.RC_ERROR and h.st[eng.S_ERR] == eng.E_PEER


def test_pacing_holds_submissions_to_the_rate():
    h = LoopHarness(64, max_batch=1, pace_gbps=1.0)
    for j in range(20):
        assert h.enqueue(peer=1, nbytes=1_000_000, chunk=j)
    t0 = time.monotonic()
    assert chunks(h.drain()) == list(range(20))
    assert time.monotonic() - t0 > 0.018       # 20 MB at 1 GB/s, less the 50 us burst


def test_imm_round_trip_and_epoch_restore():
    imm = encode_imm([3, 15], [5, (1 << 20) - 1], [0x1234, 0xFFFFFFFF])
    w, s, lo = decode_imm(imm)
    assert list(w) == [3, 15] and list(s) == [5, (1 << 20) - 1] and list(lo) == [0x34, 0xFF]
    assert restore_epoch(0x1200, 0x34) == 0x1234
    assert restore_epoch(0xFFFFFFFF, 0x01) == 1          # wraps
    sh = FlagShadow()
    sh.add_window(0, 4)
    for e in range(1, 600):
        assert sh.publish(encode_imm([0], [2], [e]))[2][0] == e
    with pytest.raises(ValueError):
        encode_imm([16], [0], [1])


def test_parse_spec():
    assert parse_spec("dma") == ("dma", None)
    assert parse_spec("dma:completion") == ("dma", "completion")
    assert parse_spec("verbs:rc") == ("verbs", "ordered")
    assert parse_spec("sim:srd") == ("sim", "completion")
    with pytest.raises(ValueError):
        parse_spec("tcp")


def test_verbs_work_requests_rc():
    batch = np.zeros(3, COMMAND_DTYPE)
    batch["seq"] = [10, 11, 12]
    batch["src_off"], batch["dst_off"], batch["nbytes"] = [0, 64, 128], [1000, 0, 8], [64, 64, 8]
    batch["dst_win"], batch["flag_win"], batch["flag_slot"], batch["epoch"] = 1, 2, [0, 1, 2], 7
    local = np.array([[0x1000, 11], [0, 0], [0, 0]], np.uint64)
    remote = np.array([[0, 0], [0x9000, 21], [0xA000, 22]], np.uint64)
    src = FlagSource(8)
    src.lkey = 33
    rc = work_requests(batch, local, remote, src)
    assert len(rc) == 6 and all(w.opcode == IBV_WR_RDMA_WRITE for w in rc)
    assert rc[0][2:7] == (0x1000, 64, 11, 0x9000 + 1000, 21)
    assert rc[1][2:7] == (src.base, 4, 33, 0xA000, 22) and src.values[0] == 7
    assert rc[5].remote_addr == 0xA000 + 8 and [w.signaled for w in rc] == [False] * 5 + [True]


def test_conn_info_round_trip():
    blob = pack_conn_info(7, 1, 0x1234, 99, 0x11111111, "fe80::1", [(0xDEAD0000, 5), (1, 2)])
    info, wins = unpack_conn_info(blob)
    assert (info["lid"], info["qpn"], info["psn"], info["qkey"]) == (7, 0x1234, 99, 0x11111111)
    assert info["gid"][:2] == b"\xfe\x80" and info["gid"][-1] == 1
    assert wins.tolist() == [[0xDEAD0000, 5], [1, 2]]


def test_verbs_hardware_or_skip():
    ok, why = rdma_available()
    if not ok:
        pytest.skip(f"no RDMA device: {why}")
    pytest.skip("RDMA device present: run tests/mpi/proxy_stress.py verbs on two nodes")


def test_device_enqueue_compiles_for_sm90(fake_sm90):
    from numba import cuda
    from mknumba.primitives import globaltimer
    from mknumba.errors import ROLE_RECV
    from mknumba.primitives import wait_flag
    from mknumba.roles.send import enqueue

    def k(ring, head, tail, flags, err):
        d = globaltimer() + 1000
        if enqueue(ring, head, tail, 1, 0, 64, 1, 128, 4096, 3, 2, 5, 9, d, err, 0):
            wait_flag(flags, 5, 9, d, err, 0, ROLE_RECV)
    u32 = "uint32[::1]"
    ptx, _ = cuda.compile_ptx(k, f"({u32}, {u32}, {u32}, {u32}, int64[::1])", cc=fake_sm90)
    assert "st.release.sys.b32" in ptx and "ld.acquire.sys" in ptx


ENV = {"MKNUMBA_GPUS_PER_NODE": "1", "MKNUMBA_PROXY_SLOTS": "16"}
# The programs' runs of 2 ranks share one mpiexec start, those of 4 another (each its own
# mk.init; the failing proxy runs last).
LAUNCH = {2: SharedLaunch(2), 4: SharedLaunch(4)}
STRESS = [(2, "sim:ordered"), (2, "sim:completion"), (4, "sim:ordered"), (4, "sim:completion")]
for _n, _spec in STRESS:
    LAUNCH[_n].add(f"test_sim_stress_10k_commands[{_n}-{_spec}]", "proxy_stress.py", _spec,
                   10000, env=ENV)


@pytest.mark.parametrize("n,spec", STRESS)
@pytest.mark.slow
def test_sim_stress_10k_commands(n, spec, request):
    out = LAUNCH[n].output(request)
    assert "every byte and flag checked" in out


def _coalesced(cmds, order=None):
    """(dst, src, bytes) of the copies ``coalesce`` makes of commands (src_win, src_off,
    dst_win, dst_off, nbytes) sent to peer 1, taken in ``order``; and whether any overlap."""
    from collections import namedtuple
    from mknumba.proxy.transports._cudrv import coalesce
    Ctx = namedtuple("Ctx", "src_base dst_base dsts srcs sizes keys order")
    src_base = np.array([0, 1000, 50_000, 1200], np.uint64)
    dst_base = np.array([[0, 0], [0, 7000], [0, 90_000], [0, 7200]], np.uint64)  # [window, peer]
    ctx = Ctx(src_base, dst_base, *(np.zeros(8, np.uint64) for _ in range(4)),
              np.zeros(8, np.int64))
    cmds = [cmds[i] for i in (order if order is not None else range(len(cmds)))]
    batch = np.zeros(len(cmds), COMMAND_DTYPE)
    for i, (sw, so, dw, do, nb) in enumerate(cmds):
        batch[i]["src_win"], batch[i]["src_off"], batch[i]["dst_win"] = sw, so, dw
        batch[i]["dst_off"], batch[i]["nbytes"] = do, nb
    k, overlap = coalesce(ctx, 1, batch)
    return list(zip(ctx.dsts[:k].tolist(), ctx.srcs[:k].tolist(), ctx.sizes[:k].tolist())), overlap


def test_dma_coalesces_adjacent_commands_only():
    """Commands that continue each other in both source and destination become one copy, in
    whatever order the ring holds them; a gap on either side, or another window (even one whose
    memory happens to follow), starts a new one. Overlapping destinations keep the ring order."""
    cmds = [(1, 0, 1, 0, 100), (1, 100, 1, 100, 50),      # adjacent: merged
            (1, 150, 1, 160, 10),                          # destination gap
            (1, 170, 1, 170, 10),                          # source gap (160 expected)
            (1, 180, 1, 180, 20),                          # adjacent to the previous: merged
            (3, 0, 3, 0, 8),                               # window 3 starts where 1 ended
            (2, 200, 2, 200, 8)]                           # another window
    want = [(7000, 1000, 150), (7160, 1150, 10), (7170, 1170, 30), (7200, 1200, 8),
            (90_200, 50_200, 8)]
    assert _coalesced(cmds) == (want, False)
    for seed in range(5):      # enqueued out of order by parallel senders: the same copies
        assert _coalesced(cmds, np.random.default_rng(seed).permutation(len(cmds))) == (want,
                                                                                        False)
    # two commands writing the same bytes: not reordered (the later one must land last), and
    # reported, so that dma_issue copies them one by one even in batch mode
    overlap = [(1, 300, 1, 40, 20), (1, 0, 1, 0, 50), (1, 50, 1, 50, 10)]
    assert _coalesced(overlap) == ([(7040, 1300, 20), (7000, 1000, 60)], True)


DMA_HOST = [("dma-host:ordered", None), ("dma-host:completion:batch", None),
            ("dma-host:ordered:batch", "0")]
for _spec, _event_bytes in DMA_HOST:
    LAUNCH[2].add(f"test_dma_compiled_path_over_host_memory[{_spec}-{_event_bytes}]",
                  "proxy_stress.py", _spec, 1000,
                  env=dict(ENV, MKNUMBA_DMA_EVENT_BYTES=_event_bytes))


@pytest.mark.parametrize("spec,event_bytes", DMA_HOST)
def test_dma_compiled_path_over_host_memory(spec, event_bytes, request):
    """The dma transport's compiled issue and progress over a host stand-in for libcuda; with
    MKNUMBA_DMA_EVENT_BYTES=0 every batch writes its flags on the second stream behind an event
    (the script checks that every batch did)."""
    out = LAUNCH[2].output(request)
    assert "every byte and flag checked" in out


WINDOWS = ["sim:completion", "dma-host:ordered"]
for _spec in WINDOWS:
    LAUNCH[2].add(f"test_windows_are_released_and_reused[{_spec}]", "proxy_windows.py", _spec,
                  20, env=ENV)


@pytest.mark.parametrize("spec", WINDOWS)
def test_windows_are_released_and_reused(spec, request):
    out = LAUNCH[2].output(request)
    assert "reused; stale command refused" in out


LAUNCH[2].add("test_proxy_failure_surfaces", "proxy_errors.py",
              env=dict(ENV, MKNUMBA_TIMEOUT_S="2"))


def test_proxy_failure_surfaces(request):
    out = LAUNCH[2].output(request)
    assert "proxy error surfaced" in out and "credit wait timed out" in out


def test_warns_when_the_proxy_would_share_one_cpu(monkeypatch):
    from types import SimpleNamespace
    import mknumba.proxy as proxy_mod
    comm = SimpleNamespace(rank=3, simulator=False)
    monkeypatch.setattr(proxy_mod.os, "sched_getaffinity", lambda pid: {0}, raising=False)
    with pytest.warns(mknumba.MkPerformanceWarning, match="rank 3 may run on 1 CPU.*bind-to none"):
        proxy_mod._warn_if_one_cpu(comm)
    monkeypatch.setattr(proxy_mod.os, "sched_getaffinity", lambda pid: {0, 1}, raising=False)
    import warnings
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        proxy_mod._warn_if_one_cpu(comm)      # two CPUs: silent
