"""Topology arithmetic, without MPI."""
import pytest

from mknumba import MkValueError, make_topology


def test_single_node():
    t = make_topology(3, ["a"] * 8)
    assert (t.node, t.nodes, t.local_rank, t.local_size) == (0, 1, 3, 8)
    assert t.rail_peers == () and t.node_ranks == tuple(range(8))


def test_two_hosts_rail_peers():
    hosts = ["a"] * 8 + ["b"] * 8
    t = make_topology(10, hosts)
    assert (t.node, t.nodes, t.local_rank, t.host_rank) == (1, 2, 2, 2)
    assert t.rail_peers == (2,) and t.node_ranks == tuple(range(8, 16))


def test_emulated_nodes_on_one_host():
    t = make_topology(3, ["a"] * 4, gpus_per_node=2)
    assert (t.node, t.nodes, t.local_rank, t.host_rank) == (1, 2, 1, 3)
    assert t.rail_peers == (1,)
    t = make_topology(5, ["a"] * 8 + ["b"] * 8, gpus_per_node=4)
    assert (t.node, t.nodes, t.local_rank) == (1, 4, 1)
    assert t.rail_peers == (1, 9, 13)


@pytest.mark.parametrize("rank,hosts,gpn,words", [
    (0, ["a", "b", "a", "b"], None, "consecutive"),
    (0, ["a", "a", "b"], None, "different numbers"),
    (0, ["a"] * 4, 3, "divide"),
    (0, ["a"] * 4, 0, "divide"),
    (5, ["a"] * 4, None, "outside"),
])
def test_bad_layouts(rank, hosts, gpn, words):
    with pytest.raises(MkValueError, match=words):
        make_topology(rank, hosts, gpn)
