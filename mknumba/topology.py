"""Where each rank sits: node, local rank, rail peers, GPU. Pure functions, no MPI, no CUDA.

A *node* is a set of GPUs joined by NVLink; nodes talk through the network. One host may pose
as several nodes (``gpus_per_node`` smaller than the ranks it runs), so emulated multi-node
schedules run on one machine. Ranks of one node are consecutive ranks of one host.
A *rail peer* is the rank with the same local index on another node (paper §2.3, C1).
"""
from dataclasses import dataclass

from .errors import MkValueError


@dataclass(frozen=True)
class Topology:
    rank: int              # world rank
    size: int              # world size
    node: int              # node index, 0 .. nodes-1
    nodes: int
    local_rank: int        # index within the node, 0 .. gpus_per_node-1
    gpus_per_node: int
    host_rank: int         # index among the ranks of this host (all emulated nodes together)
    rail_peers: tuple      # world ranks with this local_rank on the other nodes, by node
    node_ranks: tuple      # world ranks of this node, by local rank

    @property
    def local_size(self):
        return self.gpus_per_node


def make_topology(rank, host_of_rank, gpus_per_node=None):
    """Compute ``rank``'s place from the host each world rank runs on.

    host_of_rank: sequence, one hashable host id per world rank (e.g. hostnames).
    gpus_per_node: ranks per node; default all ranks of a host. Must divide every host's count.
    """
    size = len(host_of_rank)
    if not 0 <= rank < size:
        raise MkValueError(f"rank {rank} outside a world of {size}")
    hosts = list(dict.fromkeys(host_of_rank))            # hosts in order of first rank
    ranks_of = {h: [r for r in range(size) if host_of_rank[r] == h] for h in hosts}
    for h, rs in ranks_of.items():
        if rs != list(range(rs[0], rs[0] + len(rs))):
            raise MkValueError(f"ranks of host {h!r} are not consecutive ({rs}); launch with "
                               "ranks placed by node (e.g. mpirun --map-by node is wrong here)")
    per_host = {len(rs) for rs in ranks_of.values()}
    if len(per_host) != 1:
        raise MkValueError(f"hosts run different numbers of ranks: "
                           f"{ {h: len(r) for h, r in ranks_of.items()} }")
    per_host = per_host.pop()
    gpn = per_host if gpus_per_node is None else int(gpus_per_node)
    if gpn < 1 or per_host % gpn:
        raise MkValueError(f"gpus_per_node={gpn} must divide the {per_host} ranks of each host")
    if size % gpn:
        raise MkValueError(f"world size {size} is not a multiple of gpus_per_node={gpn}")
    host_rank = ranks_of[host_of_rank[rank]].index(rank)
    node, local = divmod(rank, gpn)   # hosts hold consecutive ranks, so nodes are blocks of gpn
    nodes = size // gpn
    return Topology(rank=rank, size=size, node=node, nodes=nodes, local_rank=local,
                    gpus_per_node=gpn, host_rank=host_rank,
                    rail_peers=tuple(n * gpn + local for n in range(nodes) if n != node),
                    node_ranks=tuple(node * gpn + i for i in range(gpn)))
