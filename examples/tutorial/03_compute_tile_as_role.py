"""03 - A GEMM tile as a role: the compute blocks announce tiles, another role consumes them.

What you will learn
  * ``roles.compute.make_compute_role(build, destination)``: the library's compute role,
    the one its GEMM and fused ops run. Compute block ``blk`` of ``blocks`` computes the tiles
    ``order[blk], order[blk + blocks], ...`` of C = A @ B^T (bf16 in, fp32 accumulate, bf16
    out) and releases ``flags[t] = epoch`` after each tile ``t = tile_m * tiles_n + tile_n``.
  * ``destination`` says where a tile goes and what it waits for; ``OWN_TILE`` is the simplest:
    every tile into one array ``c``, announced by ``flags[t]``.
  * Tile builds: ``tile_build("simt")`` runs anywhere (the simulator too); ``"sm90"`` is the
    Hopper tile (TMA + wgmma, 128 x 256) and reads A and B through tensor maps (``TensorMaps``).
    ``kernels.gemm.plan.kind_for("auto")`` picks the right one for this GPU; the kernel is the same.
  * Another role in the same launch waits on those flags: here it sums each finished tile, as
    a communication role would send it. It starts on a tile as soon as that tile is done.

Run it:  mpiexec -n 2 python examples/tutorial/03_compute_tile_as_role.py   (each rank on its own)
"""
import numpy as np

import mknumba as mk
from mknumba import primitives as prim
from mknumba._compat import SIMULATOR
from mknumba.errors import ROLE_COMPUTE
from mknumba.kernels.gemm.plan import kind_for
from mknumba.kernels.gemm_inputs import NoTensorMaps, TensorMaps
from mknumba.kernels.launch import Launch, Slot, array_type, compile_kernel, param
from mknumba.kernels.lifetime import Frame
from mknumba.roles import compute
from mknumba.roles.blocks import begin, wait
from numba import cuda, types

M, N, K = (64, 64, 32) if SIMULATOR else (512, 512, 256)
COMPUTE, READERS = 2, 2
Bits2D, Bits3D = array_type(np.uint16, 2), array_type(np.uint16, 3)
Words64, Flags = array_type(np.uint64, 1), array_type(np.uint32, 1)
Ints, Sums, Record = array_type(np.int32, 1), array_type(np.float32, 1), array_type(np.int64, 1)
BYTE = np.dtype(np.uint8) if SIMULATOR else np.uint8   # the simulator wants a dtype instance


def make_kernel(build):
    compute_role = compute.make_compute_role(build, compute.OWN_TILE)
    bn = build.shape[1]

    @cuda.jit(**({} if SIMULATOR else {"launch_bounds": (build.threads, 1)}))
    def gemm_and_sums(a: Bits2D, bt: Bits2D, c: Bits2D, c_planes: Bits3D, tmaps: Words64,
                      flags: Flags, order: Ints, sums: Sums, frame: Words64,
                      timeout_ns: types.uint64, err: Record, rank: types.int64):
        smem = cuda.shared.array(0, dtype=BYTE)   # the tile's staging (sm90); unused by simt
        epoch, call = begin(frame)
        blk = cuda.blockIdx.x
        tiles_n = (bt.shape[0] + bn - 1) // bn
        if blk < COMPUTE:                         # ---- compute role: the library's
            compute_role(smem, tmaps, a, bt, order, tiles_n, blk, COMPUTE, epoch,
                         (c, flags, False, c_planes))   # False: flags read on this GPU only
            return
        deadline = prim.globaltimer() + timeout_ns      # ---- reader role: ours
        bm = build.shape[0]
        for t in range(blk - COMPUTE, flags.size, READERS):
            if not wait(flags, t, epoch, deadline, err, rank, ROLE_COMPUTE, False):
                return
            tm = prim.udiv32(t, tiles_n)          # 32-bit divides keep the sm90 tile fast
            rows = min(bm, c.shape[0] - tm * bm)
            cols = min(bn, c.shape[1] - (t - tm * tiles_n) * bn)
            acc = np.float32(0)
            # range() with a run-time step divides in 64 bits to count its trips: prim.steps
            for j in range(prim.steps(cuda.threadIdx.x, rows * cols, cuda.blockDim.x)):
                e = cuda.threadIdx.x + j * cuda.blockDim.x
                r = prim.udiv32(e, cols)
                acc += compute.bf16_to_f32(c[tm * bm + r, (t - tm * tiles_n) * bn + e - r * cols])
            cuda.atomic.add(sums, t, acc)
    return gemm_and_sums


def main():
    with mk.init() as comm:
        build = compute.tile_build(kind_for("auto"))   # "sm90" on Hopper, else "simt"
        (bm, bn), kernel = build.shape, make_kernel(build)
        tiles = -(-M // bm) * -(-N // bn)
        rng = np.random.default_rng(comm.rank)
        a_f, b_f = rng.standard_normal((M, K)), rng.standard_normal((N, K))
        a, bt = (cuda.to_device(mk.to_bf16_bits(x)) for x in (a_f, b_f))
        c, sums, frame = cuda.device_array((M, N), np.uint16), cuda.to_device(
            np.zeros(tiles, np.float32)), Frame(COMPUTE + READERS)
        err = comm.new_error_record()
        maps = TensorMaps(M, N, K, build.shape) if build.tma else NoTensorMaps()
        compiled, _ = compile_kernel(kernel, build.threads, build.smem_bytes)
        launch = Launch(kernel, compiled, dict(
            a=a, bt=bt, c=c, c_planes=c.reshape((1, M, N)), tmaps=Slot((TensorMaps.ROW,)),
            flags=cuda.to_device(np.zeros(tiles, np.uint32)),
            order=cuda.to_device(np.arange(tiles, dtype=np.int32)), sums=sums,
            frame=frame.words, timeout_ns=comm.timeout_ns, err=err, rank=comm.rank),
            COMPUTE + READERS, build.threads, build.smem_bytes)
        launch.bind("tmaps", maps(param(a), param(bt), 0))
        launch()
        comm.synchronize()
        comm.check(err, "gemm_and_sums")
        got = mk.from_bf16_bits(c.copy_to_host()).astype(np.float64)
        want = mk.from_bf16_bits(mk.to_bf16_bits(a_f)).astype(np.float64) @ \
            mk.from_bf16_bits(mk.to_bf16_bits(b_f)).astype(np.float64).T
        tile_sums = got.reshape(M // bm, bm, N // bn, bn).sum(axis=(1, 3)).ravel()
        ok = (np.allclose(got, want, rtol=1e-2, atol=5e-2 * np.sqrt(K))
              and np.allclose(sums.copy_to_host(), tile_sums, rtol=1e-3, atol=1e-2))
        if comm.mpi.allreduce(int(not ok)):
            raise SystemExit(f"rank {comm.rank}: {'wrong C or tile sums' if not ok else ''}")
        if comm.rank == 0:
            print(f"03 compute tile as a role: C = A @ B^T ({M}x{N}x{K}, {kind_for('auto')} "
                  f"tile) matches NumPy float64, {tiles} tiles summed as announced: OK")


if __name__ == "__main__":
    main()
