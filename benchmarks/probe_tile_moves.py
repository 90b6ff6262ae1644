"""Diagnostic: how fast the reduction roles' tile moves run per block, by direction.

    mpirun --bind-to none -n 2 python benchmarks/probe_tile_moves.py

One node, two GPUs. Blocks of the fused kernel's width (288 threads) move 64 MiB of 64 KiB tiles
(128 rows x 64 words) with the moves of ``roles.reduce``: ``copy_tile_2d`` local -> local,
pulled from the peer (NVLink loads) and pushed to the peer (NVLink stores); ``reduce_peers``
summing the peer's tile and the local one (what the 1x2 reduce role does); ``combine_remote``
summing two local tiles (the 2x1 receive role). Rank 0 moves; rank 1 only hosts its buffers.
Prints GB/s of tile bytes written for 1 to 64 blocks.
"""
import numpy as np
from numba import cuda

import mknumba
from mknumba import primitives as prim
from mknumba.roles.reduce import combine_remote, copy_tile_2d, reduce_peers

ROWS, WCOLS = 128, 64
TILE = ROWS * WCOLS
TILES = 1024                     # 64 MiB
THREADS = 288
KINDS = ("local", "pull", "push", "pull-sum", "local-sum")


@cuda.jit
def move(kind, src, dst, ptrs, dptrs, peer, me):
    for t in range(cuda.blockIdx.x, TILES, cuda.gridDim.x):
        off = t * TILE
        if kind == 0:
            copy_tile_2d(src, off, WCOLS, dst, off, WCOLS, ROWS, WCOLS)
        elif kind == 1:
            copy_tile_2d(prim.peer_view(ptrs, peer, src), off, WCOLS, dst, off, WCOLS, ROWS,
                         WCOLS)
        elif kind == 2:
            copy_tile_2d(src, off, WCOLS, prim.peer_view(dptrs, peer, dst), off, WCOLS, ROWS,
                         WCOLS)
        elif kind == 3:
            reduce_peers(ptrs, src, 2, me, off, WCOLS, dst, off, WCOLS, False, ROWS, WCOLS)
        else:
            o2 = ((t + 1) % TILES) * TILE
            combine_remote(src, off, src, o2, 0, 1, dst, off, WCOLS, ptrs, src, 2, me, 0, 0,
                           False, ROWS, WCOLS, WCOLS)


def main():
    comm = mknumba.init(gpus_per_node=2)
    a = comm.alloc_symmetric((TILES * TILE,), np.uint64)
    b = comm.alloc_symmetric((TILES * TILE,), np.uint64)
    a.local.copy_to_device(np.arange(TILES * TILE, dtype=np.uint64))
    peer = 1 - comm.rank
    for kind, name in enumerate(KINDS):
        for blocks in (1, 16, 32, 64):
            s = cuda.stream()
            args = (kind, a.local, b.local, a.ptrs, b.ptrs, peer, comm.rank)
            if comm.rank == 0:
                move[blocks, THREADS, s](*args)      # warm-up (and compile)
            s.synchronize()
            comm.barrier()
            e0, e1 = cuda.event(), cuda.event()
            e0.record(s)
            if comm.rank == 0:
                for _ in range(3):
                    move[blocks, THREADS, s](*args)
            e1.record(s)
            s.synchronize()
            comm.barrier()
            if comm.rank == 0:
                ms = cuda.event_elapsed_time(e0, e1) / 3
                gbps = TILES * TILE * 8 / ms / 1e6
                print(f"{name:9s} {blocks:3d} blocks: {gbps:7.1f} GB/s "
                      f"({gbps / blocks:5.1f} per block)", flush=True)
    comm.barrier()
    comm.finalize()


if __name__ == "__main__":
    main()
