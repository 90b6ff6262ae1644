"""Diagnostic: how fast the reduction roles' tile moves run per block, by direction.

    mpirun --bind-to none -n 2 python benchmarks/probe_tile_moves.py

One node, two GPUs. Blocks of the fused kernel's width (288 threads) move 64 MiB of 64 KiB tiles
(128 rows x 64 words) with the moves of ``roles.reduce``: ``copy_tile_2d`` local -> local,
pulled from the peer (NVLink loads) and pushed to the peer (NVLink stores); ``reduce_peers``
summing the peer's tile and the local one (what the 1x2 reduce role does); ``sum_local``
summing two local tiles (the 2x1 receive role). Rank 0 moves; rank 1 only hosts its buffers.
On sm_90a also the TMA bulk moves of ``bulk_moves.py`` beside this probe (``w0``: each move
waits for its stores to be written; ``w1``: only read out of shared memory): pull, push, pull-sum, and pull-sum
pushing the sum back to the peer (the 1x2 AllReduce reduce role).
Prints GB/s of tile bytes written for 1 to 64 blocks.
"""
import numba
import numpy as np
from numba import cuda

import mknumba
from mknumba import primitives as prim
from mknumba.roles.reduce import sum_local, copy_tile_2d, reduce_peers

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
            sum_local(src, off, src, o2, 0, 1, dst, off, WCOLS, ptrs, src, 2, me, 0, 0,
                      False, ROWS, WCOLS, WCOLS)


BULK_KINDS = ("pull", "push", "pull-sum", "pull-sum-push")


def bulk_kernel(wait):
    import bulk_moves as bulk     # beside this probe (benchmarks/)
    b_init, b_reduce, b_copy, b_drain = bulk.bulk_functions(wait)

    @cuda.jit
    def move_bulk(kind, src, dst, ptrs, dptrs, peer, me):
        smem = cuda.shared.array(0, dtype=np.uint8)
        b_init(smem)
        seq = 0
        for t in range(cuda.blockIdx.x, TILES, cuda.gridDim.x):
            off = t * TILE
            if kind == 0:
                seq = b_copy(smem, seq, prim.peer_view(ptrs, peer, src), off, WCOLS, dst, off,
                             WCOLS, ROWS, WCOLS)
            elif kind == 1:
                seq = b_copy(smem, seq, src, off, WCOLS, prim.peer_view(dptrs, peer, dst), off,
                             WCOLS, ROWS, WCOLS)
            else:
                seq = b_reduce(smem, seq, ptrs, src, 2, me, off, WCOLS, dst, off, WCOLS,
                               kind == 3, ROWS, WCOLS)
                if kind == 3:
                    b_drain(smem)      # as the AllReduce reduce role before its flag
        b_drain(smem)
    return move_bulk, bulk.SMEM_BYTES


def time_kind(comm, kern, kind, name, blocks, smem, args):
    s = cuda.stream()
    if comm.rank == 0:
        kern[blocks, THREADS, s, smem](kind, *args)      # warm-up (and compile)
    s.synchronize()
    comm.barrier()
    e0, e1 = cuda.event(), cuda.event()
    e0.record(s)
    if comm.rank == 0:
        for _ in range(3):
            kern[blocks, THREADS, s, smem](kind, *args)
    e1.record(s)
    s.synchronize()
    comm.barrier()
    if comm.rank == 0:
        ms = cuda.event_elapsed_time(e0, e1) / 3
        gbps = TILES * TILE * 8 / ms / 1e6
        print(f"{name:18s} {blocks:3d} blocks: {gbps:7.1f} GB/s ({gbps / blocks:5.1f} per "
              "block)", flush=True)


def main():
    comm = mknumba.init(gpus_per_node=2)
    a = comm.alloc_symmetric((TILES * TILE,), np.uint64)
    b = comm.alloc_symmetric((TILES * TILE,), np.uint64)
    a.local.copy_to_device(np.arange(TILES * TILE, dtype=np.uint64))
    peer = 1 - comm.rank
    args = (a.local, b.local, a.ptrs, b.ptrs, peer, comm.rank)
    for kind, name in enumerate(KINDS):
        for blocks in (1, 16, 32, 64):
            time_kind(comm, move, kind, name, blocks, 0, args)
    if cuda.get_current_device().compute_capability == (9, 0):
        from mknumba.kernels.launch import _set_max_dynamic_smem
        for wait in (0, 1):
            kern, smem = bulk_kernel(wait)
            for kind, name in enumerate(BULK_KINDS):
                for blocks in (1, 8, 16, 32, 64):
                    if blocks == 1 and kind == 0:    # compile, then lift the smem limit
                        ty = tuple(numba.typeof(x) for x in (kind, *args))
                        _set_max_dynamic_smem(kern.compile(ty)._codelibrary.get_cufunc(), smem,
                                              comm.device_id)
                    time_kind(comm, kern, kind, f"bulk-w{wait} {name}", blocks, smem, args)
    comm.barrier()
    comm.finalize()


if __name__ == "__main__":
    main()
