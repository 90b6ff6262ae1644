"""05 - Your own fused op: GEMM, then an all-gather of its output, in one persistent launch.

What you will learn
  * How lessons 01-03 make an op: plan once in ``__init__`` (buffers, flags, the compiled
    kernel's ``Launch``); each call checks its operands, binds them and launches.
  * Fusion: each tile of C goes to the other GPUs as soon as it is announced, while the
    compute role works on the next one. No separate collective.

What the code does
  ``GemmAllGather(comm, m, n, k)``: each of the node's W GPUs holds A's rows [m/W, k] and all
  of B [n, k]; a call computes its rows of C = A @ B^T and returns the whole [m, n] C on every
  GPU. Compute blocks (lesson 03) write tiles into a scratch and announce them; push blocks
  store each announced tile into this GPU's and every peer's output (slot ``call & 1``, as in
  ``kernels/allgather.py``) and ``publish_peers`` its flag; one block awaits the peers' tiles.

Run it:  mpiexec -n 2 python examples/tutorial/05_your_own_fused_op.py
"""
import numpy as np

import mknumba as mk
from mknumba import primitives as prim
from mknumba._compat import SIMULATOR
from mknumba.errors import ROLE_INTRA, ROLE_RECV, MkValueError
from mknumba.kernels.gemm.plan import kind_for
from mknumba.kernels.gemm_inputs import NoTensorMaps, TensorMaps
from mknumba.kernels.launch import Launch, Slot, array_type, compile_kernel, param
from mknumba.kernels.lifetime import Frame
from mknumba.roles import compute
from mknumba.roles.blocks import begin, copy_tile, publish_peers, wait
from numba import cuda, types

Bits, Bits2D, Bits3D = (array_type(np.uint16, d) for d in (1, 2, 3))
Words64, Flags = array_type(np.uint64, 1), array_type(np.uint32, 1)
Ints, Record, i64 = array_type(np.int32, 1), array_type(np.int64, 1), types.int64
BYTE = np.dtype(np.uint8) if SIMULATOR else np.uint8
COMPUTE, PUSH = 2, 2                              # + 1 block that waits for the peers


def make_kernel(build):
    compute_role = compute.make_compute_role(build, compute.OWN_TILE)
    bm, bn = build.shape

    @cuda.jit(**({} if SIMULATOR else {"launch_bounds": (build.threads, 1)}))
    def gemm_allgather(a: Bits2D, bt: Bits2D, c: Bits2D, c_flat: Bits, c_planes: Bits3D,
                       tmaps: Words64, done: Flags, order: Ints, out: Bits, out_ptrs: Words64,
                       flags: Flags, flag_ptrs: Words64, frame: Words64, me: i64, members: i64,
                       timeout_ns: types.uint64, err: Record, rank: i64):
        smem = cuda.shared.array(0, dtype=BYTE)
        epoch, call = begin(frame)
        deadline = prim.globaltimer() + timeout_ns
        mw, n = c.shape
        tiles, tiles_n = done.size, (n + bn - 1) // bn
        row0 = ((call & 1) * members + me) * mw   # my rows of C in this call's slot
        blk = cuda.blockIdx.x
        if blk < COMPUTE:                         # ---- compute: tiles of my rows into c
            compute_role(smem, tmaps, a, bt, order, tiles_n, blk, COMPUTE, epoch,
                         (c, done, False, c_planes))
        elif blk < COMPUTE + PUSH:                # ---- push: each tile, once it is done
            for t in range(blk - COMPUTE, tiles, PUSH):
                if not wait(done, t, epoch, deadline, err, rank, ROLE_INTRA, False):
                    return
                tm = prim.udiv32(t, tiles_n)
                c0 = (t - tm * tiles_n) * bn
                cols = min(bn, n - c0)
                for j in range(members):          # j = 0: my own output first
                    dst = out if j == 0 else prim.peer_view(
                        out_ptrs, prim.peer_after(me, j, members), out)
                    for r in range(tm * bm, min(tm * bm + bm, mw)):
                        copy_tile(c_flat, r * n + c0, dst, (row0 + r) * n + c0, cols)
                publish_peers(flag_ptrs, flags, members, me, me * tiles + t, epoch)
        else:                                     # ---- wait: every peer's tiles are here
            for j in range(1, members):
                src = prim.peer_after(me, j, members)
                for t in range(tiles):
                    if not wait(flags, src * tiles + t, epoch, deadline, err, rank, ROLE_RECV):
                        return
    return gemm_allgather


class GemmAllGather:
    """``op(a, bt)``: a [m / W, k] (this GPU's rows), bt [n, k], bf16 bits -> C [m, n] on
    every GPU of the node (a view of the op's buffer, valid until the call after next)."""

    def __init__(self, comm, m, n, k):
        self.comm, self.W, self.me = comm, comm.local_size, comm.local_rank
        comm.agree("GemmAllGather", dict(m=m, n=n, k=k), "node")   # same plan everywhere
        build = compute.tile_build(kind_for("auto"))
        bm, bn = build.shape
        if m % (self.W * bm) or n % 8 or k % 8:
            raise MkValueError(f"GemmAllGather: m must be a multiple of {self.W * bm} (whole "
                               "tiles per GPU), n and k of 8")
        self.m, self.n, self.k, self.mw, self.calls = m, n, k, m // self.W, 0
        tiles = self.mw // bm * -(-n // bn)
        self.out = comm.alloc_symmetric((2 * m * n,), np.uint16)   # two slots of C
        self.flags = comm.alloc_flags(self.W * tiles)
        self.err = comm.new_error_record()
        c = cuda.device_array((self.mw, n), np.uint16)
        self.maps = TensorMaps(self.mw, n, k, build.shape) if build.tma else NoTensorMaps()
        kernel = make_kernel(build)
        compiled, _ = compile_kernel(kernel, build.threads, build.smem_bytes)
        self.launch = Launch(kernel, compiled, dict(
            a=Slot((self.mw, k)), bt=Slot((n, k)), c=c, c_flat=c.reshape(self.mw * n),
            c_planes=c.reshape((1, self.mw, n)), tmaps=Slot((TensorMaps.ROW,)),
            done=cuda.to_device(np.zeros(tiles, np.uint32)),
            order=cuda.to_device(np.arange(tiles, dtype=np.int32)), out=self.out.local,
            out_ptrs=self.out.ptrs, flags=self.flags.local, flag_ptrs=self.flags.ptrs,
            frame=Frame(COMPUTE + PUSH + 1).words, me=self.me, members=self.W,
            timeout_ns=comm.timeout_ns, err=self.err, rank=comm.rank),
            COMPUTE + PUSH + 1, build.threads, build.smem_bytes)

    def __call__(self, a, bt):
        for name, x, shape in (("a", a, (self.mw, self.k)), ("bt", bt, (self.n, self.k))):
            if tuple(x.shape) != shape or x.dtype != np.uint16:      # check
                raise MkValueError(f"GemmAllGather: {name} must be uint16 {shape}")
        self.comm.check(self.err, "GemmAllGather (an earlier call)")
        self.launch.bind("a", param(a))                              # bind
        self.launch.bind("bt", param(bt))
        self.launch.bind("tmaps", self.maps(param(a), param(bt), 0))
        self.launch()                                                # launch
        self.calls += 1
        return self.out.local.reshape((2, self.m, self.n))[self.calls & 1]

    def synchronize(self):
        self.comm.synchronize()
        self.comm.check(self.err, "GemmAllGather")


def main():
    with mk.init() as comm:
        bm = compute.tile_build(kind_for("auto")).shape[0]
        W, (n, k) = comm.local_size, ((64, 32) if SIMULATOR else (512, 256))
        op = GemmAllGather(comm, W * bm, n, k)
        for call in range(2):
            a_all = [np.random.default_rng(9 * call + r).standard_normal((bm, k)) for r in range(W)]
            b = np.random.default_rng(7 + call).standard_normal((n, k))
            a_bits, b_bits = mk.to_bf16_bits(a_all[comm.local_rank]), mk.to_bf16_bits(b)
            out = op(cuda.to_device(a_bits), cuda.to_device(b_bits))
            op.synchronize()
            got = mk.from_bf16_bits(out.copy_to_host()).astype(np.float64)
            want = (mk.from_bf16_bits(mk.to_bf16_bits(np.concatenate(a_all))).astype(np.float64)
                    @ mk.from_bf16_bits(b_bits).astype(np.float64).T)
            ok = np.allclose(got, want, rtol=1e-2, atol=5e-2 * np.sqrt(k))
            if comm.mpi.allreduce(int(not ok)):
                raise SystemExit(f"rank {comm.rank}: call {call}: {'wrong C' if not ok else ''}")
        if comm.rank == 0:
            print(f"05 your own fused op: GEMM + all-gather of C [{W * bm}, {n}] on {W} GPUs, "
                  "2 calls match NumPy float64: OK")


if __name__ == "__main__":
    main()
