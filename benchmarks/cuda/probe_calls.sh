#!/usr/bin/env bash
# One device call's worth of the standalone probes (issue 23), results under $OUT:
#   OUT=dir bash benchmarks/cuda/probe_calls.sh [runs|traffic|lrc|order|smid]
# runs (default): builds gemm_multicast64.cu in the variants below, runs each beside cuBLAS
# (under `timeout`: some are new), then Nsight Compute's L2 sector counts for the tensor-map
# placements. traffic: Nsight Compute's L2 and crossbar counters of cuBLAS's kernel beside
# ours at 512x1024x8192 (MODE 0 alone, MODE 4 in pairs), one metric group per profile. lrc:
# the L2 request coalescer's counters, and the builds that might change them (raster order, the
# tensor maps' L2 promotion), timed. order: the two tile orders at more K and M, and the
# coalescer's counters of a launch inside the timing's graphs (the 31st: the steady state).
# smid: the tiles placed by the SM each CTA runs on (RASTER 2-4) against the blockIdx orders,
# with MMAs and loads only.
set -u
cd "$(dirname "$0")"
PART=${1:-runs}
NVCC="nvcc -O3 -std=c++17 -gencode=arch=compute_90a,code=sm_90a -I ../../mknumba/roles/cuda"
S="512 1024 8192"
build() {  # name, flags
  $NVCC "${@:2}" gemm_multicast64.cu -lcuda -lcublas -o /tmp/$1 > "$OUT/build_$1.log" 2>&1 \
    || echo "build $1 failed" | tee -a "$OUT/probe.log"
}
run() {  # build, its arguments: JSON lines to probe.jsonl
  echo "== $*" >> "$OUT/probe.log"
  timeout 60 /tmp/$1 "${@:2}" >> "$OUT/probe.jsonl" 2>> "$OUT/probe.log"
  echo "$* exit $?" >> "$OUT/probe.log"
}
profile() {  # file, ncu options..., -- build and its arguments: the counters' lines to file
  local file=$1 opts=()
  shift
  while [ "$1" != -- ]; do opts+=("$1"); shift; done
  shift
  echo "## ${opts[*]} :: $*" >> "$OUT/$file"
  timeout 90 ncu --clock-control none --cache-control none "${opts[@]}" /tmp/"$@" 2>&1 \
    | grep -E "mc_gemm|nvjet|^    [a-z]|ERROR|rror" >> "$OUT/$file"
}
table() {  # every run's build, shape and times
  cat "$OUT/probe.log"
  python3 - "$OUT/probe.jsonl" <<'P'
import json, sys
smids = None
for line in open(sys.argv[1]):
    r = json.loads(line)
    if "smids" in r:     # each RASTER >= 2 run's; printed when they first differ
        if r["smids"] != smids:
            smids = r["smids"]
            print(f"%smid values ({len(smids)}): {smids}")
        continue
    s = r["shape"]
    print(f"{s['m']}x{s['n']}x{s['k']} mode {r['mode']} tmap {r['tmap']} il {r['interleave']} "
          f"raster {r['raster']} promo {r['promo']} cluster {r['cluster']}: ours "
          f"{r['ours_us']:7.2f} us ({r['ns_per_kstep']:.0f} ns a k-step), "
          f"cuBLAS {r['cublas_us']:.2f}, rel err {r['rel_err']:.1e}")
P
}
BOTH='-k regex:mc_gemm|nvjet --launch-count 2'   # our kernel's first launch, then cuBLAS's

case $PART in
traffic)
  build mc_0 -DMODE=0 & build mc_4 -DMODE=4 & wait
  for group in \
      gpu__time_duration.sum,lts__t_sectors_op_read.sum,lts__t_requests_op_read.sum \
      lts__t_sectors_srcunit_tex_op_read.sum,lts__t_sectors_srcunit_ltcfabric.sum \
      lts__t_sectors_srcnode_gpc.sum,lts__t_requests_srcunit_tex.sum \
      l1tex__m_xbar2l1tex_read_bytes.sum,l1tex__m_xbar2l1tex_read_sectors.sum \
      lts__t_sectors_lookup_hit.sum,lts__t_sectors_lookup_miss.sum; do
    profile traffic.txt $BOTH --metrics $group -- mc_0 $S 1 1
    profile traffic.txt $BOTH --metrics $group -- mc_4 $S 2 1
  done
  cat "$OUT/traffic.txt" ;;
lrc)
  build mc_0 -DMODE=0 & build mc_0r -DMODE=0 -DRASTER=1 & build mc_0p128 -DMODE=0 -DPROMO=128 &
  build mc_0p0 -DMODE=0 -DPROMO=0 & build mc_4 -DMODE=4 & build mc_4p128 -DMODE=4 -DPROMO=128 &
  wait
  for b in mc_0 mc_0r mc_0p128 mc_0p0 mc_4 mc_4p128; do run $b $S 1 1 $S 2 1; done
  M=gpu__time_duration.sum,lts__t_sectors_srcunit_tex_op_read.sum,lrc__xbar2gpc_sectors_op_read.sum
  M=$M,lrc__lrc2xbar_sectors_op_read.sum
  M=$M,lrc__lrc2xbar_sectors_op_read_coalescing_achieved_type_hardware.sum
  M=$M,lrc__lrc2xbar_sectors_op_read_coalescing_achieved_type_programmatic.sum
  for b in mc_0 mc_0r mc_0p128; do profile lrc.txt $BOTH --metrics $M -- $b $S 1 1; done
  cat "$OUT/lrc.txt"; table ;;
order)
  build mc_0 -DMODE=0 & build mc_0r -DMODE=0 -DRASTER=1 & wait
  for b in mc_0 mc_0r; do
    run $b 512 1024 512 1 1 512 1024 2048 1 1 $S 1 1 256 1024 8192 1 1
  done
  M=gpu__time_duration.sum,lts__t_sectors_srcunit_tex_op_read.sum,lrc__xbar2gpc_sectors_op_read.sum
  M=$M,lrc__lrc2xbar_sectors_op_read.sum,lts__t_sectors_srcunit_ltcfabric.sum
  for b in mc_0 mc_0r; do  # a launch inside the timing's graphs: the steady state, not the first
    profile order.txt --graph-profiling node --launch-skip 30 --launch-count 1 -k regex:mc_gemm \
      --metrics $M -- $b $S 1 1
  done
  cat "$OUT/order.txt"; table ;;
smid)
  build mc_0 -DMODE=0 & build mc_0r -DMODE=0 -DRASTER=1 & build mc_0s2 -DMODE=0 -DRASTER=2 &
  build mc_0s3 -DMODE=0 -DRASTER=3 & build mc_0s4 -DMODE=0 -DRASTER=4 &
  build mc_4 -DMODE=4 & build mc_4s2 -DMODE=4 -DRASTER=2 & build mc_4s4 -DMODE=4 -DRASTER=4 &
  wait
  for b in mc_0 mc_0r mc_0s2 mc_0s3 mc_0s4 mc_4 mc_4s2 mc_4s4; do
    run $b 512 1024 512 1 1 512 1024 2048 1 1 $S 1 1 256 1024 8192 1 1
  done
  table ;;
runs)
  build mc_0 -DMODE=0 & build mc_0p -DMODE=0 -DTMAP=1 & build mc_0c -DMODE=0 -DTMAP=2 &
  build mc_4 -DMODE=4 & build mc_4p -DMODE=4 -DTMAP=1 & build mc_2p -DMODE=2 -DTMAP=1 &
  build mc_0i -DMODE=0 -DINTERLEAVE=1 & build mc_0pi -DMODE=0 -DTMAP=1 -DINTERLEAVE=1 & wait
  for b in mc_0 mc_0p mc_0c mc_4 mc_4p mc_2p mc_0i mc_0pi; do
    run $b $S 1 1 $S 2 1 128 1024 8192 1 1 512 1024 512 1 1 512 1024 512 2 1
  done
  run mc_0p 1024 1024 8192 1 1 2048 1024 8192 1 1
  M=gpu__time_duration.sum,lts__t_sectors_op_read.sum
  M=$M,lts__throughput.avg.pct_of_peak_sustained_elapsed
  M=$M,l1tex__throughput.avg.pct_of_peak_sustained_elapsed
  for b in mc_0 mc_0p; do
    for cl in "1 1" "2 1"; do
      profile ncu.txt -k regex:mc_gemm --launch-count 1 --metrics $M -- $b $S $cl
    done
  done
  cat "$OUT/ncu.txt"; table ;;
*) echo "usage: OUT=dir bash $0 [runs|traffic|lrc|order|smid]" >&2; exit 2 ;;
esac
