"""Persistent GEMM on one GPU: ``mknumba.gemm(a, b)`` = a @ b, bf16 in and out, fp32 accumulation.

The kernel is the compute role on its own (``roles.compute.make_compute_role``, the same role
the fused kernels run): a persistent grid (``sched.plan_grid``) whose first ``compute_blocks``
blocks walk the output tiles in grouped raster order (``sched.grouped_order``), computing each
with the role's tile function and publishing each finished tile ``t = tile_m * tiles_n + tile_n``
with ``tile_flags[t] = epoch``. The blocks held back (``reserved_sms``) return at once here; in
the fused kernels they run the communication roles and consume those flags.

Three modules, each read alone: ``plan`` (which tile build, split and order a shape runs: the
rules "auto" follows, and the ``tile=`` names an op takes), ``kernel`` (the persistent kernel:
whole tiles, split-K's slices and folds, the tail split's two phases) and ``op`` (the host op:
a plan per shape, the prepared launch, calls).

Tile implementations: ``"sm90"`` (TMA + wgmma, Hopper, 128 x 256 tiles), ``"sm90:pp"`` (the
ping-pong schedule, 128 x 128 tiles, ``roles.compute.SM90_PINGPONG_TILE``; no split-K; "auto"
takes it where 128 x 256 tiles are few and K <= ``plan.PP_MAX_K``, or fill their rounds poorly
and K <= ``plan.TMS_MAX_K``: ``plan.pp_for``; also in 128 x 64, 64 x 128 and 64 x 64 tiles,
``"sm90:pp:<BM>x<BN>"``, which "auto" takes there by the tiles' count: ``plan.pp_shape_for``, in
the variant ``plan.PP_AUTO_VARIANT`` names: ``plan.pp_auto_name``), ``"sm90:tms"`` (the sm90
tile whose epilogue leaves by TMA tensor stores it does not wait for,
``roles.compute.SM90_TMS_TILE``; no split-K: its tile flags go out at each block's end, after
its stores completed; "auto" takes it for unsplit shapes with K <= ``plan.TMS_MAX_K``) or
``"simt"`` (the generic twin: the CUDA simulator and GPUs without sm_90a), each reading B as
given: [n, k] (or a ``w.T`` view of one), or row-major [k, n] through its ``":kn"`` build
(``kernels.gemm_inputs``). Calls go through the launch frame (``kernels.launch``): planned once
per shape and layout of B, then an address bind and one driver launch. The plans of one op may
run different kernels ("auto": the ping-pong, tensor-store or default build by shape; B's two
layouts), but all launch the grid of its call counter (``plan.shared_bps``).
"""
from .op import Gemm, gemm
from .plan import pp_auto_name, pp_for, pp_shape_for, split_k_for, tail_split_for

__all__ = ["gemm", "Gemm", "split_k_for", "tail_split_for", "pp_for", "pp_shape_for",
           "pp_auto_name"]
