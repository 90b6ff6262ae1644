"""Multi-rank checks of the runtime and the AllGather kernel, run under mpiexec.

    mpiexec -n N python tests/mpi/runtime_checks.py CHECK[,CHECK...] [ITERATIONS]

The same program runs under the simulator (NUMBA_ENABLE_CUDASIM=1, CI) and on GPUs. Each rank
prints ``PASS <check> rank <r>`` when every assertion of a check held; any failure exits
non-zero. Several checks share one launch (one MPI start-up); ``timeout`` shortens the job's
wait bound to 3 s (1 s in the simulator), so it runs alone.
"""
import os
import sys
import time

import numpy as np

import mknumba as mk
from mknumba import primitives as prim
from mknumba._compat import SIMULATOR
from mknumba.errors import ROLE_TEST
from mknumba.roles.blocks import wait
from numba import cuda


def host(a):
    return np.asarray(a) if SIMULATOR else a.copy_to_host()


def device(a):
    if SIMULATOR:
        return a.copy()
    from numba import cuda
    return cuda.to_device(a)


def check_topology(comm):
    gpn = int(os.environ.get("MKNUMBA_GPUS_PER_NODE", comm.size))
    assert comm.local_size == gpn and comm.nodes == comm.size // gpn, comm
    assert comm.node == comm.rank // gpn and comm.local_rank == comm.rank % gpn, comm
    assert comm.rail_peers == tuple(n * gpn + comm.local_rank
                                    for n in range(comm.nodes) if n != comm.node)
    everyone = comm.mpi.allgather((comm.node, comm.local_rank))
    assert len(set(everyone)) == comm.size  # each (node, local rank) exactly once
    assert comm.node_comm.Get_size() == gpn and comm.rail_comm.Get_size() == comm.nodes
    # Symmetric memory: each member writes its rank into its own buffer, then reads the peers'.
    buf = comm.alloc_symmetric((4, 3), np.int32)
    assert buf.scope_ranks == comm.topology.node_ranks
    if SIMULATOR:
        buf.peers[buf.index][...] = comm.rank
    else:
        buf.local.copy_to_device(np.full((4, 3), comm.rank, np.int32))
    comm.barrier()
    for i, world_rank in enumerate(buf.scope_ranks):
        assert (host(buf.peers[i]) == world_rank).all(), (i, host(buf.peers[i]))
    comm.barrier()
    comm.free(buf)


def check_allgather(comm, iterations):
    """Back-to-back calls with no host synchronisation, fresh random inputs each time,
    poisoned outputs, several dtypes and shapes; every result checked against the shards
    gathered with MPI. Scope "world" across nodes: the proxy to each rail peer, forwarded
    inside the node."""
    rng = np.random.default_rng(1234 + comm.rank)
    scopes = ["node", "world"]
    small = SIMULATOR
    cases = [((37,), np.float32), ((5, 77), np.float64), ((300,), np.int32)] if small else \
        [((1 << 20,), np.float32), ((3, 100003), np.float64), ((4097,), np.int32)]
    for scope in scopes:
        group = comm.node_comm if scope == "node" else comm.mpi
        for shape, dtype in cases:
            op = mk.AllGather(comm, shape, dtype, scope=scope)
            sent, outs = [], []
            for it in range(iterations):
                x = (rng.standard_normal(shape) * 1000).astype(dtype)
                sent.append(x)
                out = None
                if it % 2 and dtype != np.int32:       # every other call: a poisoned out=
                    out = device(np.full((group.Get_size(),) + shape, np.nan, dtype))
                outs.append(op(device(x), out=out))
            op.synchronize()
            for it, (x, out) in enumerate(zip(sent, outs)):
                want = np.stack(group.allgather(x))
                got = host(out)
                assert got.shape == want.shape and np.array_equal(got, want), \
                    f"{scope} {shape} {dtype} call {it}: {np.sum(got != want)} elements differ"
            op.free()


@cuda.jit
def wait_forever(flags, timeout_ns, err, rank):
    """One block waits for a flag that nobody will ever set."""
    wait(flags, 0, 1, prim.globaltimer() + timeout_ns, err, rank, ROLE_TEST)


def check_timeout(comm):
    """A wait that can never finish ends in MkTimeoutError naming rank, role and flag."""
    flags, err = comm.alloc_flags(4), comm.new_error_record()
    wait_forever[1, 4 if SIMULATOR else 64](flags.local, np.uint64(comm.timeout_ns), err,
                                            comm.rank)
    if not SIMULATOR:
        cuda.synchronize()
    try:
        comm.check(err, "wait_forever")
    except mk.MkTimeoutError as e:
        msg = str(e)
        assert f"rank {comm.rank}, test role" in msg and "flag 0 to reach epoch 1" in msg, msg
    else:
        raise AssertionError("a wait nobody can satisfy did not time out")
    if comm.local_size == 1:
        return
    op = mk.AllGather(comm, (64,), np.float32, scope="node")
    if comm.local_rank == 0:                 # only rank 0 of each node calls: nobody sends
        op(device(np.ones(64, np.float32)))
        try:
            op.synchronize()
        except mk.MkTimeoutError as e:
            msg = str(e)
            assert f"rank {comm.rank}" in msg and "receive role" in msg and "flag" in msg, msg
            assert "epoch 1" in msg, msg
            peers = [r for r in comm.topology.node_ranks if r != comm.rank]   # never called
            assert any(f"(rank {r}'s tile " in msg for r in peers), msg
            assert "of its shard) to reach" in msg, msg
        else:
            raise AssertionError("a wait with no sender did not time out")
        try:                                 # the op stays poisoned: later calls refuse
            op(device(np.ones(64, np.float32)))
        except mk.MkTimeoutError:
            pass
        else:
            raise AssertionError("a timed-out op accepted another call")
    if comm.size == 2:          # one layout is enough (each simulated timeout costs seconds)
        check_fused_timeout(comm)
    comm.barrier()


def check_fused_timeout(comm):
    """A fused op whose peers never call raises within the documented bound: every wait of a
    launch ends ``timeout_s`` after the launch began (the kernel compiles when the op is
    planned, not at the first call)."""
    import time
    m, n, k = (128, 64, 16) if SIMULATOR else (1024, 512, 128)
    op = mk.GemmAllReduce(comm, m, n, k)
    if comm.local_rank == 0:
        a = device(np.full((m, k), 0x3F80, np.uint16))     # 1.0 in bf16
        b = device(np.full((k, n), 0x3F80, np.uint16))
        t0 = time.monotonic()
        op(a, b)
        try:
            op.synchronize()
        except mk.MkTimeoutError as e:
            took = time.monotonic() - t0
            bound = comm.timeout_ns / 1e9
            slack = 60.0 if SIMULATOR else 2.0    # the simulator runs blocks one by one
            assert took <= bound + slack, f"raised after {took:.1f} s, bound {bound:.1f} s"
            assert "GemmAllReduce" in str(e) and f"rank {comm.rank}" in str(e), str(e)
            # the flag named as the peer's partial or final sum of a tile (op._flag_name)
            peer = comm.topology.node_ranks[1]
            assert any(f"(rank {peer}'s {what} of tile " in str(e)
                       for what in ("partial", "final sum")), str(e)
            print(f"fused timeout raised after {took:.2f} s (bound {bound:.1f} s): {e}",
                  flush=True)
        else:
            raise AssertionError("a fused op whose peer never called did not time out")
    comm.barrier()


def expect_value_error(fn, *words):
    try:
        fn()
    except mk.MkValueError as e:
        assert all(w in str(e) for w in words), (str(e), words)
        return
    raise AssertionError(f"no MkValueError (wanted {words})")


def check_validation(comm):
    """Every bad input fails before launch with a message that names what is wrong; each bad
    call on an op of its own (an op of 2+ members that refused a call refuses the next)."""
    cases = [(lambda op: op(device(np.ones(16, np.float64))), ("dtype", "float64")),
             (lambda op: op(device(np.ones(17, np.float32))), ("shape", "(17,)")),
             (lambda op: op(device(np.ones((16, 2), np.float32))[:, 0]), ("contiguous",)),
             (lambda op: op(device(np.ones(16, np.float32)),
                            out=device(np.ones((3, 16), np.float32))), ("out", "shape")),
             (lambda op: op("not an array"), ("x",))]
    if not SIMULATOR:
        cases.append((lambda op: op(np.ones(16, np.float32)), ("host",)))
    for call, words in cases:
        op = mk.AllGather(comm, (16,), np.float32)
        expect_value_error(lambda: call(op), *words)
        if op.members > 1:           # (one GPU a node: nobody to pair with, the op goes on)
            try:
                op(device(np.ones(16, np.float32)))
            except mk.MkError as e:
                assert "refused here" in str(e), str(e)
            else:
                raise AssertionError("a call after a refused one was taken")
        op.free()
    expect_value_error(lambda: mk.AllGather(comm, (0,), np.float32), "positive")
    expect_value_error(lambda: mk.AllGather(comm, (4,), np.complex64), "dtype")
    expect_value_error(lambda: mk.AllGather(comm, (4,), np.float32, scope="galaxy"), "scope")
    expect_value_error(lambda: mk.AllGather(comm, (4,), np.float32, threads=0), "threads")
    # more than the GPU (the simulator: /dev/shm) could ever hold: refused on every rank
    expect_value_error(lambda: mk.AllGather(comm, (10**12,), np.float32), "cannot fit")
    if comm.size > 1:
        expect_value_error(lambda: comm.alloc_symmetric((4 + comm.rank,), np.float32, "world"),
                           "different", "rank 1")
    expect_value_error(lambda: mk.init(timeout_s=-1), "timeout")
    if comm.size > 1:             # one rank's bad bound: every rank refuses (none waits)
        last = comm.rank == comm.size - 1
        expect_value_error(lambda: mk.init(timeout_s=-1 if last else None),
                           "timeout" if last else f"rank {comm.size - 1} refused")
        if last:                  # the host steps' bound, from the environment
            os.environ["MKNUMBA_HOST_TIMEOUT_S"] = "soon"
        try:
            expect_value_error(mk.init, "MKNUMBA_HOST_TIMEOUT_S" if last else
                               f"rank {comm.size - 1} refused")
        finally:
            os.environ.pop("MKNUMBA_HOST_TIMEOUT_S", None)
    if comm.size > 1:
        expect_value_error(lambda: mk.AllGather(comm, (4,), np.float32, scope="world",
                                                tile=4 + comm.rank % 2), "differently", "tile")
    if comm.nodes > 1:        # a node's buffer (no proxy window): freed by that node alone
        if comm.node == 0:
            comm.free(comm.alloc_symmetric((8,), np.float32, "node"))
        comm.barrier()
    if comm.size > 1 and comm.nodes == 1:   # ranks at different steps of one group: each
        apart = mk.init()                    # raises, naming every rank's step (a Comm of its
        first = comm.rank == 0               # own: it takes no more steps after)
        try:
            apart.barrier() if first else apart.finalize()
        except mk.MkError as e:
            assert "at different steps" in str(e) and "'barrier()'" in str(e), str(e)
            assert "'finalize()'" in str(e) and not isinstance(e, mk.MkTimeoutError), str(e)
        else:
            raise AssertionError("ranks at different steps went on")
        try:
            apart.barrier()
        except mk.MkError as e:
            assert "out of step" in str(e) and "aborted" not in str(e), str(e)
        else:
            raise AssertionError("a step after a failed one was taken")
    if comm.local_size > 1:   # ranks of a node that name different scopes, or one names none
        odd = comm.local_rank % 2 == 1
        for other in ("world", "galaxy"):
            expect_value_error(lambda: mk.AllGather(comm, (4,), np.float32,
                                                    scope=other if odd else "node"),
                               "different scopes", repr(other))
    comm.barrier()


def check_host_timeout(comm):
    """A rank that skips a collective step (here the last rank waits in a barrier while the
    others plan an op): every rank raises MkTimeoutError after MKNUMBA_HOST_TIMEOUT_S (2 s),
    naming its rank and its own step, instead of hanging; that Comm then refuses every
    collective step, and the job is aborted when the processes exit (the steps left pending
    cannot be withdrawn). On a Comm of its own; the job's Comm still finalizes."""
    assert comm.nodes == 1 and comm.size > 1, "one node of 2+: the others wait in its step"
    os.environ["MKNUMBA_HOST_TIMEOUT_S"] = "2"
    try:
        lost = mk.init()
    finally:
        del os.environ["MKNUMBA_HOST_TIMEOUT_S"]
    last = comm.rank == comm.size - 1
    start = time.monotonic()
    try:
        if last:
            lost.barrier()
        else:
            mk.AllGather(lost, (4,), np.float32)
    except mk.MkTimeoutError as e:
        waited = time.monotonic() - start
        step = "barrier()" if last else "AllGather: planning"
        assert f"rank {comm.rank}: {step}: not every rank" in str(e), str(e)
        assert "MKNUMBA_HOST_TIMEOUT_S" in str(e), str(e)
        assert 2 <= waited < 60, waited
    else:
        raise AssertionError("no MkTimeoutError")
    try:
        lost.barrier()
    except mk.MkError as e:
        assert "out of step" in str(e) and "aborted when this process exits" in str(e), str(e)
    else:
        raise AssertionError("a step after a timed-out one was taken")
    comm.barrier()


def main():
    checks = sys.argv[1].split(",")
    iterations = int(sys.argv[2]) if len(sys.argv) > 2 else 3
    if "timeout" in checks and len(checks) > 1:
        raise SystemExit("the timeout check runs alone (it shortens every wait's bound)")
    # the simulator runs a launch's blocks one by one, each waiting out its own bound
    timeout = (1.0 if SIMULATOR else 3.0) if checks == ["timeout"] else None
    with mk.init(timeout_s=timeout) as comm:
        for check in checks:
            if check == "topology":
                check_topology(comm)
            elif check == "allgather":
                check_allgather(comm, iterations)
            elif check == "timeout":
                check_timeout(comm)
            elif check == "validation":
                check_validation(comm)
            elif check == "host_timeout":
                check_host_timeout(comm)
            elif check == "raise":           # rank 0 fails while the others wait in a collective
                if comm.rank == 0:
                    raise RuntimeError("rank 0 failed on purpose")
                comm.barrier()
            else:
                raise SystemExit(f"unknown check {check}")
            print(f"PASS {check} rank {comm.rank}", flush=True)


if __name__ == "__main__":
    main()
