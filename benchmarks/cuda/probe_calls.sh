#!/usr/bin/env bash
# One device call's worth of the standalone probes (issue 23), results under $OUT:
#   OUT=dir bash benchmarks/cuda/probe_calls.sh [runs|traffic|lrc|order]
# runs (default): builds gemm_multicast64.cu in the variants below, runs each beside cuBLAS
# (under `timeout`: some are new), then Nsight Compute's L2 sector counts for the tensor-map
# placements. traffic: Nsight Compute's L2 and crossbar counters of cuBLAS's kernel beside
# ours at 512x1024x8192 (MODE 0 alone, MODE 4 in pairs), one metric group per profile. lrc:
# the L2 request coalescer's counters, and the builds that might change them (raster order, the
# tensor maps' L2 promotion), timed. order: the two tile orders at more K and M, and the
# coalescer's counters of a launch inside the timing's graphs (the 31st: the steady state).
set -u
cd "$(dirname "$0")"
PART=${1:-runs}
NVCC="nvcc -O3 -std=c++17 -gencode=arch=compute_90a,code=sm_90a -I ../../mknumba/roles/cuda"
build() {  # name, flags
  $NVCC "${@:2}" gemm_multicast64.cu -lcuda -lcublas -o /tmp/$1 > "$OUT/build_$1.log" 2>&1 \
    || echo "build $1 failed" | tee -a "$OUT/probe.log"
}
if [ "$PART" = traffic ]; then
  build mc_0 -DMODE=0 & build mc_4 -DMODE=4 & wait
  ncu --query-metrics --chip gh100 > "$OUT/metrics_all.txt" 2>&1
  grep -iE "^(lts__t_(sectors|requests)_src|lts__t_sectors_op|l1tex__m_)" "$OUT/metrics_all.txt" \
    | awk '{print $1}' > "$OUT/metrics_picked.txt"
  P="--clock-control none --cache-control none --launch-count 2"
  for group in \
      gpu__time_duration.sum,lts__t_sectors_op_read.sum,lts__t_requests_op_read.sum \
      lts__t_sectors_srcunit_tex_op_read.sum,lts__t_sectors_srcunit_ltcfabric.sum \
      lts__t_sectors_srcnode_gpc.sum,lts__t_requests_srcunit_tex.sum \
      l1tex__m_xbar2l1tex_read_bytes.sum,l1tex__m_xbar2l1tex_read_sectors.sum \
      lts__t_sectors_lookup_hit.sum,lts__t_sectors_lookup_miss.sum; do
    for run in "mc_0 512 1024 8192 1 1" "mc_4 512 1024 8192 2 1"; do
      echo "## $group :: $run" >> "$OUT/traffic.txt"
      timeout 90 ncu $P -k regex:"mc_gemm|nvjet" --metrics $group /tmp/$run 2>&1 \
        | grep -E "mc_gemm|nvjet|^    [a-z]|ERROR|rror" >> "$OUT/traffic.txt"
    done
  done
  cat "$OUT/traffic.txt"
  exit 0
fi
if [ "$PART" = lrc ]; then
  build mc_0 -DMODE=0 & build mc_0r -DMODE=0 -DRASTER=1 & build mc_0p128 -DMODE=0 -DPROMO=128 &
  build mc_0p0 -DMODE=0 -DPROMO=0 & build mc_4 -DMODE=4 & build mc_4p128 -DMODE=4 -DPROMO=128 &
  wait
  for b in mc_0 mc_0r mc_0p128 mc_0p0 mc_4 mc_4p128; do
    timeout 40 /tmp/$b 512 1024 8192 1 1 512 1024 8192 2 1 >> "$OUT/probe.jsonl" \
      2>> "$OUT/probe.log"
  done
  M=gpu__time_duration.sum,lts__t_sectors_srcunit_tex_op_read.sum,lrc__xbar2gpc_sectors_op_read.sum
  M=$M,lrc__lrc2xbar_sectors_op_read.sum
  M=$M,lrc__lrc2xbar_sectors_op_read_coalescing_achieved_type_hardware.sum
  M=$M,lrc__lrc2xbar_sectors_op_read_coalescing_achieved_type_programmatic.sum
  for run in "mc_0 512 1024 8192 1 1" "mc_0r 512 1024 8192 1 1" "mc_0p128 512 1024 8192 1 1"; do
    echo "## $run" >> "$OUT/lrc.txt"
    timeout 60 ncu --clock-control none --cache-control none --launch-count 2 \
      -k regex:"mc_gemm|nvjet" --metrics $M /tmp/$run 2>&1 \
      | grep -E "mc_gemm|nvjet|^    [a-z]|ERROR|rror" >> "$OUT/lrc.txt"
  done
  cat "$OUT/probe.log" "$OUT/lrc.txt"
  python3 - "$OUT/probe.jsonl" <<'P'
import json, sys
for line in open(sys.argv[1]):
    r = json.loads(line)
    print(f"mode {r['mode']} raster {r['raster']} promo {r['promo']} cluster {r['cluster']} "
          f"ours {r['ours_us']:6.2f} us ({r['ns_per_kstep']:.0f} ns), cuBLAS {r['cublas_us']:.2f}")
P
  exit 0
fi
if [ "$PART" = order ]; then
  build mc_0 -DMODE=0 & build mc_0r -DMODE=0 -DRASTER=1 & wait
  for b in mc_0 mc_0r; do
    timeout 60 /tmp/$b 512 1024 512 1 1 512 1024 2048 1 1 512 1024 8192 1 1 \
      256 1024 8192 1 1 >> "$OUT/probe.jsonl" 2>> "$OUT/probe.log"
  done
  M=gpu__time_duration.sum,lts__t_sectors_srcunit_tex_op_read.sum,lrc__xbar2gpc_sectors_op_read.sum
  M=$M,lrc__lrc2xbar_sectors_op_read.sum,lts__t_sectors_srcunit_ltcfabric.sum
  for b in mc_0 mc_0r; do  # a launch inside the timing's graphs: the steady state, not the first
    echo "## $b, launch 30" >> "$OUT/order.txt"
    timeout 90 ncu --clock-control none --cache-control none --graph-profiling node \
      --launch-skip 30 --launch-count 1 -k regex:mc_gemm --metrics $M \
      /tmp/$b 512 1024 8192 1 1 2>&1 | grep -E "mc_gemm|^    [a-z]|ERROR|rror" >> "$OUT/order.txt"
  done
  cat "$OUT/probe.log" "$OUT/order.txt"
  python3 - "$OUT/probe.jsonl" <<'P'
import json, sys
for line in open(sys.argv[1]):
    r = json.loads(line)
    s = r["shape"]
    print(f"{s['m']}x{s['n']}x{s['k']} raster {r['raster']} ours {r['ours_us']:6.2f} us "
          f"({r['ns_per_kstep']:.0f} ns), cuBLAS {r['cublas_us']:.2f}")
P
  exit 0
fi
build mc_0 -DMODE=0 & build mc_0p -DMODE=0 -DTMAP=1 & build mc_0c -DMODE=0 -DTMAP=2 &
build mc_4 -DMODE=4 & build mc_4p -DMODE=4 -DTMAP=1 & build mc_2p -DMODE=2 -DTMAP=1 &
build mc_0i -DMODE=0 -DINTERLEAVE=1 & build mc_0pi -DMODE=0 -DTMAP=1 -DINTERLEAVE=1 & wait
run() {  # build, its arguments
  echo "== $*" >> "$OUT/probe.log"
  timeout 40 /tmp/$1 "${@:2}" >> "$OUT/probe.jsonl" 2>> "$OUT/probe.log"
  echo "$* exit $?" >> "$OUT/probe.log"
}
S="512 1024 8192"
for b in mc_0 mc_0p mc_0c mc_4 mc_4p mc_2p mc_0i mc_0pi; do
  run $b $S 1 1 $S 2 1 128 1024 8192 1 1 512 1024 512 1 1 512 1024 512 2 1
done
run mc_0p 1024 1024 8192 1 1 2048 1024 8192 1 1
M=gpu__time_duration.sum,lts__t_sectors_op_read.sum
M=$M,lts__throughput.avg.pct_of_peak_sustained_elapsed
M=$M,l1tex__throughput.avg.pct_of_peak_sustained_elapsed
for b in mc_0 mc_0p; do
  for cl in "1 1" "2 1"; do
    timeout 60 ncu --clock-control none --cache-control none -k regex:mc_gemm --launch-count 1 \
      --metrics $M /tmp/$b $S $cl > "$OUT/ncu_${b}_${cl/ /x}.txt" 2>&1
    echo "ncu $b $cl exit $?" >> "$OUT/probe.log"
  done
done
cat "$OUT/probe.log"
grep -h "sectors_op_read\|time_duration\|lts__throughput\|l1tex__throughput" "$OUT"/ncu_*.txt
python3 - "$OUT/probe.jsonl" <<'P'
import json, sys
for line in open(sys.argv[1]):
    r = json.loads(line)
    print(f"{r['shape']['m']}x{r['shape']['n']}x{r['shape']['k']} mode {r['mode']} tmap "
          f"{r.get('tmap', 0)} il {r.get('interleave', 0)} cluster {r['cluster']} ours "
          f"{r['ours_us']:7.2f} us "
          f"({r['ns_per_kstep']:.0f} ns a k-step), cuBLAS {r['cublas_us']:.2f}")
P
