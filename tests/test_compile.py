"""GPU-only code must compile for sm_90a here, without a GPU, so a typing or PTX error fails CI
instead of costing device time."""
import re

import numpy as np
import pytest
from numba import cuda, types

u32, u64, i64 = types.uint32[::1], types.uint64[::1], types.int64[::1]


def _ptx(fn, sig, cc):
    ptx, _ = cuda.compile_ptx(fn, sig, cc=cc)
    assert ".target sm_90a" in ptx
    return ptx


def test_primitives_emit_ordered_ptx(fake_sm90):
    from mknumba import primitives as P

    def k(flags, ptrs, tmpl, err, epoch, out):
        deadline = P.globaltimer() + 1000
        if P.wait_flag(flags, 3, epoch, deadline, err, 0, 4):
            P.peer_view(ptrs, 1, tmpl)[cuda.threadIdx.x, 0] = 5.0
            P.fence_sys()
            P.fence_gpu()
            P.fence_proxy_async()
            P.st_release_sys(flags, 2, epoch)
            P.st_release(flags, 2, epoch)
            P.atomic_add_release_sys(flags, 1, 1)
            P.atomic_add_release(flags, 1, 1)
            P.atomic_add_relaxed(out, 1, 1)
            out[0] = P.data_ptr(tmpl) + P.ld_acquire(out, 1)
            P.nanosleep(32)

    ptx = _ptx(k, (u32, u64, types.float32[:, ::1], i64, types.uint32, u64), fake_sm90)
    for instr in ["ld.acquire.sys.b32", "ld.acquire.gpu.b64", "st.release.sys.b32",
                  "st.release.gpu.b32", "atom.add.release.sys.u32", "atom.add.release.gpu.u32",
                  "atom.add.relaxed.gpu.u64", "fence.acq_rel.sys", "fence.acq_rel.gpu",
                  "nanosleep.u32", "%globaltimer", "atom.global.cas.b64",
                  "fence.proxy.async.global"]:
        assert instr in ptx, instr
    # The poll stays inside the loop: a load that LLVM hoisted would appear once, before it.
    loop = ptx[ptx.index("nanosleep"):]
    assert "ld.acquire.sys.b32" in loop


@pytest.mark.slow
def test_allgather_kernel_compiles(fake_sm90):
    """Every word width the AllGather moves, compiled for the kernel's own declaration; each
    block starts by numbering the call (a ticket from the frame); the send role's proxy
    commands commit with a system release; no 64-bit divide by a run-time value (the rule of
    the Hopper kernels, kept here too); and it links for sm_90a."""
    from mknumba.kernels.allgather import make_kernel
    from mknumba.kernels.launch import signature
    for word in (np.uint64, np.uint32, np.uint16, np.uint8):
        kernel = make_kernel(np.dtype(word))
        ptx = _ptx(kernel.py_func, signature(kernel), fake_sm90)
        assert len(re.findall(r"st\.release\.sys", ptx)) >= 1
        assert "atom.add.relaxed.gpu.u64" in ptx
        assert not re.search(r"\b(div|rem)\.[su]64\b", ptx), f"a 64-bit divide ({word})"
    ptx, log = _link_sm90a(make_kernel(np.dtype(np.uint64)), 512, fake_sm90)
    assert "ld.acquire.sys" in ptx and "error" not in log.lower(), log


@pytest.mark.parametrize("cc", [(8, 0), (9, 0, "a")])
def test_tile_moves_use_packed_bf16_and_assemble(monkeypatch, cc):
    """The reduction roles' sums use packed bf16 instructions (measured 7 -> 19 GB/s per block),
    keep their per-thread word arrays out of local memory (ptxas spills are not checked), and
    assemble for sm_80 too: the SIMT kernel that carries them serves GPUs before Hopper."""
    import mknumba  # noqa: F401  (numpy compatibility first)
    import numba.cuda.dispatcher as disp
    from conftest import HAVE_GPU
    from mknumba.roles.reduce import sum_local, reduce_peers
    if not HAVE_GPU:
        monkeypatch.setattr(disp, "get_current_device",
                            lambda: type("Fake", (), {"compute_capability": cc[:2]})())

    def k(ptrs, tmpl, own, recv, dst, members, nsrc):
        reduce_peers(ptrs, tmpl, members, 0, 0, 64, dst, 0, 64, nsrc > 1, 128, 64)
        sum_local(own, 0, recv, 0, 8192, nsrc, dst, 0, 64, ptrs, tmpl, members, 0, 0, 64,
                  nsrc > 2, 128, 64, 64)

    ptx, _ = cuda.compile_ptx(k, (u64, u64, u64, u64, u64, types.int64, types.int64), cc=cc)
    assert "fma.rn.bf16x2" in ptx and "cvt.rn.bf16x2.f32" in ptx
    assert not re.search(r"(ld|st)\.local", ptx), "the tile moves' word arrays left registers"
    core = pytest.importorskip("cuda.core")
    arch = "sm_" + "".join(str(x) for x in cc)
    cubin = core.Linker(core.ObjectCode.from_ptx(ptx.encode()),
                        options=core.LinkerOptions(arch=arch)).link("cubin")
    assert len(bytes(cubin.code)) > 0


@pytest.mark.parametrize("value,epoch,ready", [
    (0, 1, False), (1, 1, True), (2, 1, True), (0xFFFFFFFF, 0, False), (0, 0xFFFFFFFF, True),
    (5, 0xFFFFFFF0, True), (0xFFFFFFF0, 5, False), (0x7FFFFFFF, 0, True)])
def test_epoch_reached_wraps(value, epoch, ready):
    from mknumba.primitives import epoch_reached
    assert bool(epoch_reached.py_func(np.uint32(value), np.uint32(epoch))) is ready



@pytest.mark.parametrize("helper", ["gemm_tile.cu", "attention_tile.cu"])
def test_linked_tiles_assemble_for_sm90a(helper):
    """Each linked helper, as NVRTC gets it (its ``#include "sm90.cuh"`` pasted in), compiles and
    assembles for sm_90a; ptxas does not serialize its wgmma (any call in a function that
    issues wgmma makes it do so: an IEEE division's slow path is such a call)."""
    import os
    import mknumba
    from mknumba.roles.compute import linked_source
    nvrtc = pytest.importorskip("cuda.bindings.nvrtc")
    core = pytest.importorskip("cuda.core")
    from numba.cuda.cuda_paths import get_cuda_paths
    path = linked_source(os.path.join(os.path.dirname(mknumba.__file__), "roles", "cuda", helper))
    with open(path, "rb") as f:
        src = f.read()
    err, prog = nvrtc.nvrtcCreateProgram(src, helper.encode(), 0, [], [])
    include = get_cuda_paths()["include_dir"].info
    opts = [b"--gpu-architecture=sm_90a", b"-rdc=true", f"-I{include}".encode()]
    (err,) = nvrtc.nvrtcCompileProgram(prog, len(opts), opts)
    _, n = nvrtc.nvrtcGetProgramLogSize(prog)
    log = b" " * n
    nvrtc.nvrtcGetProgramLog(prog, log)
    assert err == nvrtc.nvrtcResult.NVRTC_SUCCESS, log.decode()
    _, n = nvrtc.nvrtcGetPTXSize(prog)
    ptx = b" " * n
    nvrtc.nvrtcGetPTX(prog, ptx)
    linker = core.Linker(core.ObjectCode.from_ptx(ptx.rstrip(b"\0 ")),
                         options=core.LinkerOptions(arch="sm_90a", verbose=True))
    assert len(bytes(linker.link("cubin").code)) > 0
    assert "serialized" not in linker.get_info_log(), linker.get_info_log()


def _link_sm90a(kernel, threads, cc, as_launched=False, cubin=False):
    """``kernel`` compiled for its own declaration and linked with its helpers as on a Hopper
    GPU (LTO): (PTX of the whole kernel, ptxas's log of assembling it for sm_90a).
    The log comes from that PTX handed to nvJitLink, which assembles it as a separate
    compilation unit: there ptxas drops setmaxnreg (C7504) and may allocate registers
    differently. ``as_launched``: from numba's own link instead (LTO-IR in, the whole kernel
    assembled at once, a cubin out), ~1.5-2.5 s more a kernel: where registers, spills or
    setmaxnreg are checked. ``cubin``: the cubin too, third."""
    pytest.importorskip("cuda.bindings.nvjitlink")
    core = pytest.importorskip("cuda.core")
    from numba.cuda import compiler
    from numba.cuda.cudadrv import driver
    from mknumba.kernels.launch import signature
    lib, _ = compiler._compile_pyfunc_with_fixup(
        kernel.py_func, signature(kernel), device=False, cc=cc,
        launch_bounds=(threads, 1), lto=True, abi="numba")
    lib._lto = True
    ptx = lib.get_lto_ptx(cc=cc).replace("\x00", "")
    if as_launched:
        objects = driver._Linker(cc=cc, lto=True)     # the inputs of numba's cubin link
        lib._link_all(objects, cc, ignore_nonlto=False)
        linker = core.Linker(*objects._object_codes, options=core.LinkerOptions(
            arch="sm_90a", link_time_optimization=True, verbose=True))
    else:
        linker = core.Linker(core.ObjectCode.from_ptx(ptx.encode()),
                             options=core.LinkerOptions(arch="sm_90a", verbose=True))
    code = bytes(linker.link("cubin").code)
    assert len(code) > 0
    log = linker.get_info_log().replace("\x00", "")
    return (ptx, log, code) if cubin else (ptx, log)


def _hopper_kernel(name):
    from mknumba.roles.compute import SM90_FUSED_TILE
    if name in GEMM_BUILDS:
        from mknumba.kernels.gemm import kernel as gemm
        build, kernel = gemm._build(*GEMM_BUILDS[name])
        return kernel, build.threads
    if name.startswith("gemm_reduce"):      # gemm_reduce_adaptive: the controller's build
        from mknumba.kernels.gemm_reduce import kernel as K
        _, threads, kernel = K.build(SM90_FUSED_TILE, name.endswith("adaptive"))
        return kernel, threads
    if name.startswith("allgather_gemm"):   # allgather_gemm_adaptive: the controller's
        from mknumba.kernels.allgather_gemm import kernel as K
        _, threads, kernel = K.build(SM90_FUSED_TILE, name.endswith("adaptive"))
        return kernel, threads
    if name.startswith("moe_dispatch_gemm"):   # moe_dispatch_gemm_adaptive: the controller's
        from mknumba.kernels.moe_dispatch import kernel as K
        _, threads, kernel = K.build(SM90_FUSED_TILE, name.endswith("adaptive"))
        return kernel, threads
    from mknumba.kernels.ring_attention import make_kernel   # ring_attention_adaptive: the
    from mknumba.roles.attention import SM90_THREADS           # controller's build
    return make_kernel("sm90", name.endswith("adaptive")), SM90_THREADS


#: the plain GEMM's kernels here -> (tile build (roles.compute.tile_build), split-K kernel:
#: False, True, or "tail": the tail split's)
GEMM_BUILDS = {"gemm": ("sm90", False), "gemm_kn": ("sm90:kn", False),
               "gemm_pp": ("sm90:pp", False), "gemm_pp_kn": ("sm90:pp:kn", False),
               "gemm_tms": ("sm90:tms", False), "gemm_tms_kn": ("sm90:tms:kn", False),
               "gemm_split": ("sm90", True), "gemm_split_kn": ("sm90:kn", True),
               "gemm_tail": ("sm90", "tail"), "gemm_tail_kn": ("sm90:kn", "tail")}
#: the ping-pong tile's other shapes ("sm90:pp:<BM>x<BN>", roles.compute.pp_name), B [n, k] and
#: [k, n]: gemm_pp_<BM>x<BN>(_kn)
GEMM_BUILDS.update({f"gemm_pp_{bm}x{bn}{kn}": (f"sm90:pp:{bm}x{bn}{kn.replace('_', ':')}", False)
                    for bm, bn in ((128, 64), (64, 128), (64, 64)) for kn in ("", "_kn")})
#: the ping-pong tile's variants (roles.compute.SM90_PP_VARIANTS: letters of d, r):
#: gemm_pp<letters>_<BM>x<BN>(_kn)
GEMM_BUILDS.update({f"gemm_pp{v}_{bm}x{bn}{kn}": (f"sm90:pp{v}:{bm}x{bn}{kn.replace('_', ':')}",
                                                 False)
                    for bm, bn in ((128, 128), (128, 64), (64, 128), (64, 64))
                    for kn in ("", "_kn") for v in ("d", "r", "dr")})
#: registers per thread of the plain GEMM's kernels, either layout of B: ptxas's count for the
#: [n, k] build, rounded up to its allocation unit of 8 (the [k, n] build must not need more);
#: the ping-pong tile's [k, n] build needs a few more (its two MMAs per k16 step share B), and
#: so do the split-K kernels (split and tail), whose epilogue can fold partials
GEMM_REGISTERS = {"sm90": 160, "sm90:pp": 168, "sm90:tms": 160, "split": 168}


@pytest.mark.parametrize("name", ["gemm", "gemm_kn", "gemm_pp", "gemm_pp_kn", "gemm_pp_128x64",
                                  "gemm_pp_128x64_kn", "gemm_pp_64x128", "gemm_pp_64x128_kn",
                                  "gemm_pp_64x64", "gemm_pp_64x64_kn", "gemm_ppd_64x64",
                                  "gemm_ppd_128x128_kn", "gemm_ppdr_128x64", "gemm_ppr_64x64_kn",
                                  "gemm_tms",
                                  "gemm_tms_kn", "gemm_split", "gemm_split_kn", "gemm_tail",
                                  "gemm_tail_kn", "gemm_reduce",
                                  "gemm_reduce_adaptive", "ring_attention",
                                  "ring_attention_adaptive"])
@pytest.mark.slow
def test_hopper_kernels_keep_wgmma_asynchronous(fake_sm90, name):
    """No wgmma of a Hopper kernel is serialized. ptxas serializes all of a kernel's wgmma when
    the kernel makes a call, and a 64-bit divide by a run-time value is one (so is range() with
    a run-time step): kernels divide with primitives.udiv32 / steps (what serialized wgmma
    cost the GEMM: benchmarks/NOTES.md).
    (allgather_gemm and moe_dispatch_gemm: checked in their own tests below, which link them
    anyway.) The plain GEMM's tiles (gemm_tile.cu, and gemm_pingpong.cu in its four shapes) with B
    [n, k] and [k, n] (MK_B_KN: a transposed wgmma B, tnspB = 1, from TMA boxes of 64
    N-columns), the tensor-store tile (gemm_tile.cu with MK_TMA_STORE), the split-K kernel and
    the tail split's: no spills, registers within GEMM_REGISTERS; the split kernels' folds
    load 16 bytes at a time; the tail split's whole tiles store to global memory, then the
    block meets and the ring is invalidated and initialised again before the tail's tiles
    (tail_split_order); the tensor-store tile stores only by TMA, each chunk after waiting for
    its buffer's last store to read it and after a proxy fence, records its flags after
    waiting for every store to read its buffer (tms_epilogue_order); whole tiles record their
    flags with plain stores, only a split's slices release theirs (the folds read them). Those
    and the ring kernel (the attention tile: setmaxnreg, S and P V overlapped, the consumer
    warpgroups' turns) are checked on ptxas's log of the link numba does on a GPU
    (``_link_sm90a(as_launched=True)``)."""
    ptx, log = _link_sm90a(*_hopper_kernel(name), fake_sm90,
                           as_launched=name in GEMM_BUILDS or name.startswith("ring_attention"))
    assert "wgmma.mma_async" in ptx
    assert "serialized" not in log, log
    assert not re.search(r"\b(div|rem)\.[su]64\b", ptx), "a 64-bit divide"
    if name.startswith("gemm_reduce"):      # the flags' memory order; never NVLink multicast
        for instr in ("st.release.sys", "ld.acquire.sys", "atom.add.release.gpu",
                      "fence.acq_rel.sys"):
            assert instr in ptx, instr
        assert "multimem" not in ptx
    if name.startswith("ring_attention"):
        # the attention tile's producer warpgroup gives registers to its consumers, whose
        # pipelined loop (S of the next KV tile in flight during this one's softmax) needs them:
        # ptxas keeps both setmaxnreg (it drops them where the two roles' paths rejoin, C7507,
        # or the kernel is assembled in parts, C7504) and spills nothing
        assert "setmaxnreg.inc" in ptx and "setmaxnreg.dec" in ptx
        assert "setmaxnreg" not in log, log
        assert "0 bytes spill stores, 0 bytes spill loads" in log, log
        # the block's registers, which the consumers' setmaxnreg.inc counts on (attention_tile.cu)
        assert "Used 168 registers" in log, log
        assert ptx.count("wgmma.wait_group.sync.aligned 1;") >= 2, "S and P V not overlapped"
        # the consumer warpgroups' ping-pong turns (named barriers)
        assert "bar.arrive" in ptx and "bar.sync" in ptx
    if name == "ring_attention":                # one declaration, the pool pruned away
        assert "atom.global.add.u64" not in ptx, "the controller's sums in the static build"
    if name == "ring_attention_adaptive":
        # the producer lane's queue tickets and the controller's sums; the consumers' own
        # barrier (a part they push) and the mailbox's GPU-scope acquire and release
        for instr in ("atom.add.relaxed.gpu.u32", "atom.global.add.u64", "ld.acquire.gpu.b32",
                      "st.release.gpu.b32", "st.release.sys"):
            assert instr in ptx, instr
        assert re.search(r"bar\.sync %r\d+, %r\d+;", ptx), "the consumers' named barrier"
    if name in GEMM_BUILDS:
        pingpong = name.startswith("gemm_pp")
        # wgmma's scale-d (1, or the ping-pong tile's predicate p) and imm-trans-b
        tnsp = set(re.findall(r"%rd\d+, %rd\d+, (?:1|p), 1, 1, 0, ([01]);", ptx))
        assert tnsp == {"1" if name.endswith("kn") else "0"}, tnsp
        split, tail = "_split" in name, "_tail" in name
        # unrolled k16 steps (the tail split: a tile for each phase; the ping-pong tile: one
        # m64nBNk16 per 64 rows of the tile, of BN columns)
        letters, rows, cols = (re.match(r"gemm_pp([dr]*)_(\d+)x(\d+)", name).groups()
                               if re.match(r"gemm_pp[dr]*_\d", name) else ("", "128", "128"))
        rows, cols = int(rows), int(cols)
        assert ptx.count("wgmma.mma_async") == (rows // 16 if pingpong else 8 if tail else 4)
        if pingpong:
            assert set(re.findall(r"wgmma\.mma_async\.sync\.aligned\.m64n(\d+)k16",
                                  ptx)) == {str(cols)}
        assert "0 bytes spill stores, 0 bytes spill loads" in log, log
        if not (split or tail):
            assert "0 bytes stack frame" in log, log
        # a split's fold sums the planes with 16-byte loads, many in flight (fold_planes); the
        # unsplit kernel adds nothing and keeps none of that code
        assert ("ld.global.cg.v4.u32" in ptx) == (split or tail)
        regs = int(re.search(r"Used (\d+) registers", log).group(1))
        tms = name.startswith("gemm_tms")
        limit = ("split" if split or tail else "sm90:pp" if pingpong else "sm90:tms" if tms
                 else "sm90")
        assert regs <= GEMM_REGISTERS[limit], log
        assert ("cp.async.bulk.tensor.2d.global" in ptx) == tms
        if tms:
            tms_epilogue_order(ptx)
        if pingpong:
            # the descriptors' shared-address masks (sm90.cuh smem_desc, & 0x3FFFF): each
            # MMA's A and each k16 step's B, or (MK_PP_DESC_ITER) the slot's A and B once
            masks = len(re.findall(r"and\.b32\s+%r\d+, %r\d+, 26\d{4};", ptx))
            assert masks == (2 if "d" in letters else (rows // 64 + 1) * 4), masks
        # the early ramp: the block's first order entry prefetched before begin's ticket
        assert ("prefetch.global.L1" in ptx) == ("r" in letters)
        if "r" in letters:
            assert ptx.index("prefetch.global.L1") < ptx.index("atom.add.relaxed.gpu")
        assert ("mbarrier.inval" in ptx) == tail     # only the tail split starts a ring again
        # nothing in the kernel reads a whole tile's flag: recorded, no fence waits for the
        # tile's stores; a split's slices release theirs for the folds
        assert ("st.release.gpu" in ptx) == ("fence.acq_rel.gpu" in ptx) == (split or tail)
        if tail:
            tail_split_order(ptx)


def _nvdisasm():
    """nvdisasm (SASS of a cubin): $NVDISASM, on PATH, or in $CUDA_HOME/bin; None if none."""
    import os
    import shutil
    for path in (os.environ.get("NVDISASM"), shutil.which("nvdisasm"),
                 os.path.join(os.environ.get("CUDA_HOME", "/usr/local/cuda"), "bin", "nvdisasm")):
        if path and os.access(path, os.X_OK):
            return path
    return None


def main_loop_sass(sass):
    """The instructions (text, predicates dropped) of the innermost loop of nvdisasm -c output
    that issues wgmma (HGMMA): the smallest span from a label to a backward branch to it."""
    ins, at = [], {}
    for line in sass.splitlines():
        label = re.match(r"\s*(\.L_x_\d+):", line)
        if label:
            at[label.group(1)] = len(ins)
            continue
        m = re.match(r"\s*/\*[0-9a-f]{4,}\*/\s+(.*?)\s*;", line)
        if m:
            ins.append(re.sub(r"^@!?U?P\w+\s+", "", m.group(1)))
    loops = [ins[at[m.group(1)]:i + 1] for i, text in enumerate(ins)
             for m in [re.search(r"BRA `\((\.L_x_\d+)\)", text)]
             if m and m.group(1) in at and at[m.group(1)] < i]
    return min((x for x in loops if any(t.startswith("HGMMA") for t in x)), key=len)


@pytest.mark.parametrize("plain, desc_iter", [("gemm_pp_64x64", "gemm_ppd_64x64"),
                                              ("gemm_pp_kn", "gemm_ppd_128x128_kn")])
@pytest.mark.slow
def test_pingpong_desc_iter_shortens_the_k_step(fake_sm90, plain, desc_iter):
    """MK_PP_DESC_ITER ("sm90:ppd:..."): the ping-pong tile's k-step in SASS, as linked on a
    GPU, has fewer instructions than the plain build's (the descriptors no longer rebuilt from
    the slot's address for every MMA) and the same MMAs, issued closer together (first to last:
    at 64 x 64 about 30 instructions instead of 44). Needs nvdisasm ($NVDISASM, PATH or
    $CUDA_HOME/bin)."""
    import subprocess
    import tempfile
    nvdisasm = _nvdisasm()
    if nvdisasm is None:
        pytest.skip("no nvdisasm")
    loops = {}
    for v, name in (("", plain), ("d", desc_iter)):
        _, _, code = _link_sm90a(*_hopper_kernel(name), fake_sm90, as_launched=True, cubin=True)
        with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
            f.write(code)
            f.flush()
            sass = subprocess.run([nvdisasm, "-c", f.name], capture_output=True, text=True,
                                  check=True).stdout
        loops[v] = main_loop_sass(sass)
    hgmma = {v: [i for i, t in enumerate(x) if t.startswith("HGMMA")] for v, x in loops.items()}
    assert len(hgmma[""]) == len(hgmma["d"]) == (4 if "64x64" in plain else 8)
    assert len(loops["d"]) <= len(loops[""]) - 15, (len(loops["d"]), len(loops[""]))
    span = {v: x[-1] - x[0] for v, x in hgmma.items()}
    assert span["d"] <= span[""] - 12, span


def tail_split_order(ptx):
    """The tail split's kernel in the linked PTX (kernels.gemm.kernel.tail_split_role): phase 1's
    tile (its four k16 MMAs, global 16-byte stores of C), a block barrier, thread 0
    invalidating the ring's 8 barriers (4 slots, full and empty) and initialising them again
    (gemm_tile.cu mk_gemm_sm90_reinit), the init fence, a block barrier, then phase 2's tile
    (its MMAs, generic stores: slices into planes, folds into C)."""
    mma = [m.start() for m in re.finditer("wgmma.mma_async", ptx)]
    inval = [m.start() for m in re.finditer(r"mbarrier\.inval\.shared::cta\.b64", ptx)]
    assert len(mma) == 8 and len(inval) == 8, (len(mma), len(inval))
    meet = ptx.rindex("bar.sync \t0;", 0, inval[0])
    inits = [m.start() for m in re.finditer("mbarrier.init", ptx[inval[-1]:])]
    fence = ptx.index("fence.mbarrier_init", inval[-1])
    again = ptx.index("bar.sync \t0;", fence)
    assert mma[3] < meet < inval[0] and len(inits) >= 8 and inval[-1] + inits[7] < fence
    assert again < mma[4], "phase 2's MMAs before the ring is initialised again"
    phase1 = ptx[:meet]
    assert "st.global.v4.u32" in phase1 and "st.v4.u32" not in phase1
    assert "st.global.v4.u32" not in ptx[again:] and "st.v4.u32" in ptx[again:]


def tms_epilogue_order(ptx):
    """The tensor-store tile's epilogue and end in the linked PTX (gemm_tile.cu MK_TMA_STORE):
    no generic global store of C; per 64-column chunk (4, unrolled) a wait until at most one
    store still reads staging, the stmatrix, the proxy fence, then the tensor store and its
    commit; after the tiles, a wait until every store has read its buffer, then the flags,
    recorded with plain stores (no release: nothing in the kernel reads them)."""
    assert "st.global.v4" not in ptx
    body = ptx[ptx.index("wgmma.wait_group.sync.aligned 0"):]
    read1, fence = "cp.async.bulk.wait_group.read 1;", "fence.proxy.async.shared::cta;"
    store = "cp.async.bulk.tensor.2d.global.shared::cta.bulk_group"
    at = 0
    for chunk in range(4):
        order = [body.index(x, at) for x in (read1, "stmatrix", fence, store,
                                             "cp.async.bulk.commit_group;")]
        assert order == sorted(order), (chunk, order)
        at = order[-1] + 1
    assert store not in body[at:]
    drained = body.index("cp.async.bulk.wait_group.read 0;", at)
    assert "cp.async.bulk.wait_group 0;" not in body and "st.release" not in body
    assert "st.relaxed.gpu.b32" in body[drained:], "no flag recorded"


@pytest.mark.slow
@pytest.mark.parametrize("name", ["allgather_gemm", "allgather_gemm_adaptive"])
def test_allgather_gemm_kernel_compiles_for_sm90a(fake_sm90, name):
    """AllGatherGemm's kernel around the fused ops' Hopper tile (TMA + wgmma, a publisher
    warp), compiled for its own declaration and linked with the tile's helper: its waits poll
    with acquire loads, each followed by the proxy fence that orders them before the tile's
    TMA loads of the gathered A; the send role's commit to the proxy ring; no multicast; no
    serialized wgmma. The same for the build with the controller's split
    (``comm_sms="adaptive"``), whose queues and measurements are relaxed GPU atomics."""
    from mknumba.kernels.allgather_gemm import kernel as K
    from mknumba.kernels.launch import signature
    ptx, log = _link_sm90a(*_hopper_kernel(name), fake_sm90)
    assert "serialized" not in log, log
    assert not re.search(r"\b(div|rem)\.[su]64\b", ptx), "a 64-bit divide"
    assert ptx.count("wgmma.mma_async") >= 4, "wgmma missing"
    for instr in ("cp.async.bulk.tensor.2d", "fence.proxy.async.global", "ld.acquire.sys",
                  "st.release.sys", "fence.acq_rel.sys", "atom.add.relaxed.gpu.u64"):
        assert instr in ptx, instr
    # the compute role's wait: the proxy fence follows the poll's acquire loads
    assert ptx.index("fence.proxy.async.global") > ptx.index("ld.acquire.sys")
    assert "multimem" not in ptx                  # never NVLink multicast
    if name.endswith("adaptive"):                 # queue tickets, the controller's sums
        assert "atom.add.relaxed.gpu.u32" in ptx and "atom.global.add.u64" in ptx
        return
    # one declaration for both builds: the static one keeps none of the controller's code
    assert "atom.global.add.u64" not in ptx
    # the SIMT twin (GPUs without sm_90a) compiles too
    _, _, simt = K.build("simt")
    assert "ld.acquire.sys" in _ptx(simt.py_func, signature(simt), fake_sm90)


DIVIDES = """
import numpy as np
from mknumba import primitives as P
rng = np.random.default_rng(0)
for _ in range(2000):
    n = int(rng.integers(0, 2**63))
    d = int(rng.integers(1, 2**16))
    assert int(P.udiv64_small.py_func(np.uint64(n), d)) == n // d, (n, d)
    a, b = int(rng.integers(0, 2**31)), int(rng.integers(1, 2**31))
    assert P.udiv32(a, b) == a // b and P.umod32.py_func(a, b) == a % b
    start, stop, step = (int(x) for x in rng.integers(0, 1000, 3))
    step += 1
    assert P.steps.py_func(start, stop, step) == len(range(start, stop, step))
print("divides ok")
"""


def test_divides_without_64bit_divides_agree_with_python():
    """udiv64_small (the launch's ticket / grid), udiv32, umod32 and steps (trip counts), as
    the simulator runs them, against Python's own integer division."""
    from mpi_util import run_python
    assert "divides ok" in run_python(DIVIDES)


@pytest.mark.slow
@pytest.mark.parametrize("name", ["moe_dispatch_gemm", "moe_dispatch_gemm_adaptive"])
def test_moe_dispatch_gemm_kernel_compiles_for_sm90a(fake_sm90, name):
    """MoeDispatchGemm's kernel (the grouped GEMM around the fused ops' Hopper tile, each
    tile with its expert's tensor maps) compiles for its declaration and links: the
    counts and token units are published at system scope on every GPU and polled with acquire
    loads; the compute role's wait for a tile row is followed by the proxy fence before the
    tile's TMA loads; no multicast; no serialized wgmma and no 64-bit divide (see
    test_hopper_kernels_keep_wgmma_asynchronous). The same for the build with the
    controller's split (``comm_sms="adaptive"``: queue tickets and the controller's sums are
    relaxed GPU atomics), which also spills nothing. Its SIMT twin runs in the simulator
    (uncompiled there; left out here for CI time)."""
    ptx, log = _link_sm90a(*_hopper_kernel(name), fake_sm90)
    assert "serialized" not in log, log
    assert not re.search(r"\b(div|rem)\.[su]64\b", ptx), "a 64-bit divide"
    assert ptx.count("wgmma.mma_async") >= 4, "wgmma missing"
    for instr in ("cp.async.bulk.tensor.2d", "fence.proxy.async.global", "ld.acquire.sys",
                  "ld.acquire.gpu", "st.release.sys", "st.release.gpu", "fence.acq_rel.sys",
                  "atom.add.relaxed.gpu.u64"):
        assert instr in ptx, instr
    assert "multimem" not in ptx                  # never NVLink multicast
    if name.endswith("adaptive"):
        assert "atom.add.relaxed.gpu.u32" in ptx and "atom.global.add.u64" in ptx
        assert "0 bytes spill stores, 0 bytes spill loads" in log, log
    else:     # one declaration for both builds: the static one keeps none of the controller's
        assert "atom.global.add.u64" not in ptx
