"""Command ring, batching, immediates, transport choice, verbs planning; MPI stress tests."""
import numpy as np
import pytest

import mknumba  # noqa: F401
from mknumba.proxy.batching import Batcher
from mknumba.proxy.imm import FlagShadow, decode_imm, encode_imm, restore_epoch
from mknumba.proxy.ring import (CMD_WORDS, COMMAND_DTYPE, RingReader, W_SEQ, host_enqueue,
                                write_body)
from mknumba.proxy.transports import parse_spec
from mknumba.proxy.transports.verbs import rdma_available
from mknumba.proxy.transports.verbs_plan import (IBV_WR_RDMA_WRITE, IBV_WR_RDMA_WRITE_WITH_IMM,
                                                 FlagSource, pack_conn_info, unpack_conn_info,
                                                 work_requests)
from mpi_util import run_mpi

FIELDS = dict(peer=3, src_win=1, src_off=(5 << 32) + 7, dst_win=2, dst_off=(1 << 40) + 9,
              nbytes=4096, chunk=77, flag_win=4, flag_slot=1234, epoch=0xFFFFFFFE)


def ring(slots=8):
    return np.zeros(slots * CMD_WORDS, np.uint32), np.zeros(1, np.uint32), np.zeros(1, np.uint32)


def test_encoder_round_trip():
    r = np.zeros(CMD_WORDS, np.uint32)
    write_body(r, 0, **FIELDS)
    c = r.view(COMMAND_DTYPE)[0]
    for k, v in FIELDS.items():
        assert int(c[k]) == v, k
    assert r[W_SEQ] == 0   # the encoder never commits


def test_reader_waits_for_header_and_keeps_order():
    words, head, tail = ring(8)
    rd = RingReader(words, tail)
    for j in range(5):
        assert host_enqueue(words, head, tail, **dict(FIELDS, chunk=j))
    words[2 * CMD_WORDS + W_SEQ] = 0          # ticket 2 not committed yet: stop before it
    got = rd.poll()
    assert list(got["chunk"]) == [0, 1]
    words[2 * CMD_WORDS + W_SEQ] = 3
    assert list(rd.poll()["chunk"]) == [2, 3, 4]
    assert len(rd.poll()) == 0


def test_full_ring_refuses_then_wraps_with_credits():
    words, head, tail = ring(4)
    rd = RingReader(words, tail)
    seen = []
    for j in range(4 * 1000 + 3):           # many laps; tickets keep their order
        while not host_enqueue(words, head, tail, **dict(FIELDS, chunk=j)):
            assert head[0] - tail[0] == 4      # full: refused, nothing overwritten
            seen += list(rd.poll()["chunk"])
            rd.release()
    seen += list(rd.poll()["chunk"])
    assert seen == list(range(4 * 1000 + 3))


def test_ticket_wraps_at_2_32():
    words, head, tail = ring(4)
    head[0] = tail[0] = 0xFFFFFFFE
    rd = RingReader(words, tail)
    for j in range(6):
        assert host_enqueue(words, head, tail, **dict(FIELDS, chunk=j)) or j >= 4
    assert list(rd.poll()["chunk"]) == [0, 1, 2, 3]


def cmds(peers, t0=0):
    a = np.zeros(len(peers), COMMAND_DTYPE)
    a["peer"] = peers
    a["chunk"] = np.arange(t0, t0 + len(peers))
    return a


def test_batcher_full_batches_at_once_partial_after_window():
    b = Batcher(max_batch=8, window_ns=1000)
    b.add(cmds([1] * 19 + [2] * 3), now_ns=0)
    out = b.take(now_ns=10)
    assert [(p, len(x)) for p, x in out] == [(1, 8), (1, 8)]
    assert b.take(now_ns=999) == []
    out = b.take(now_ns=1000)
    assert sorted((p, len(x)) for p, x in out) == [(1, 3), (2, 3)]
    assert len(b) == 0


def test_batcher_keeps_per_connection_order_and_flush():
    b = Batcher(max_batch=4, window_ns=10**9)
    peers = np.random.default_rng(0).integers(1, 4, 50)
    b.add(cmds(peers), 0)
    out = b.take(0) + b.take(0, flush=True)
    for p in (1, 2, 3):
        got = np.concatenate([x["chunk"] for q, x in out if q == p])
        assert list(got) == list(np.flatnonzero(peers == p))
        assert all(len(x) <= 4 for q, x in out)


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


def test_verbs_work_requests_rc_and_srd():
    batch = np.zeros(3, COMMAND_DTYPE)
    batch["seq"] = [10, 11, 12]
    batch["src_off"], batch["dst_off"], batch["nbytes"] = [0, 64, 128], [1000, 0, 8], [64, 64, 8]
    batch["dst_win"], batch["flag_win"], batch["flag_slot"], batch["epoch"] = 1, 2, [0, 1, 2], 7
    local = np.array([[0x1000, 11], [0, 0], [0, 0]], np.uint64)
    remote = np.array([[0, 0], [0x9000, 21], [0xA000, 22]], np.uint64)
    src = FlagSource(8)
    src.lkey = 33
    rc = work_requests(batch, local, remote, "ordered", src)
    assert len(rc) == 6 and all(w.opcode == IBV_WR_RDMA_WRITE for w in rc)
    assert rc[0][2:7] == (0x1000, 64, 11, 0x9000 + 1000, 21)
    assert rc[1][2:7] == (src.base, 4, 33, 0xA000, 22) and src.values[0] == 7
    assert rc[5].remote_addr == 0xA000 + 8 and [w.signaled for w in rc] == [False] * 5 + [True]
    srd = work_requests(batch, local, remote, "completion", src)
    assert len(srd) == 3 and all(w.opcode == IBV_WR_RDMA_WRITE_WITH_IMM for w in srd)
    assert list(decode_imm([w.imm for w in srd])[1]) == [0, 1, 2]


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
    from mknumba.roles.recv import wait_chunk
    from mknumba.roles.send import enqueue

    def k(ring, head, tail, flags, err):
        d = globaltimer() + 1000
        if enqueue(ring, head, tail, 1, 0, 64, 1, 128, 4096, 3, 2, 5, 9, d, err, 0):
            wait_chunk(flags, 5, 9, d, err, 0)
    u32 = "uint32[::1]"
    ptx, _ = cuda.compile_ptx(k, f"({u32}, {u32}, {u32}, {u32}, int64[::1])", cc=fake_sm90)
    assert "st.release.sys.b32" in ptx and "ld.acquire.sys" in ptx


ENV = {"MKNUMBA_GPUS_PER_NODE": "1", "MKNUMBA_PROXY_SLOTS": "16"}


@pytest.mark.parametrize("n,spec", [(2, "sim:ordered"), (2, "sim:completion"),
                                    (4, "sim:ordered"), (4, "sim:completion")])
def test_sim_stress_10k_commands(n, spec):
    out = run_mpi("proxy_stress.py", n, spec, 10000, env=ENV, timeout=300)
    assert "every byte and flag checked" in out


@pytest.mark.parametrize("spec", ["dma-host:ordered", "dma-host:completion:batch"])
def test_dma_compiled_path_over_host_memory(spec):
    out = run_mpi("proxy_stress.py", 2, spec, 1000, env=ENV, timeout=300)
    assert "every byte and flag checked" in out


def test_proxy_failure_surfaces():
    out = run_mpi("proxy_errors.py", 2, env=dict(ENV, MKNUMBA_TIMEOUT_S="2"), timeout=120)
    assert "proxy error surfaced" in out and "credit wait timed out" in out
