# Sourced by the GPU scripts (run_gpu.sh, gpu_tests_parallel.sh, sanitize.sh, host_cost_ab.sh):
# the repository root as the working directory, $OUT made, never NVLink multicast on the shared
# hosts (docs/design.md §3), the repository on PYTHONPATH, and with one GPU the ranks of a
# multi-rank test share it (correctness only). Sets NGPU, and MPIRUN: the launcher of every
# multi-rank run.
cd "$(dirname "${BASH_SOURCE[0]}")/.."
OUT=${OUT:-/tmp/mknumba-gpu}
mkdir -p "$OUT"
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
export PYTHONUNBUFFERED=1 PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH}
NGPU=$(nvidia-smi -L | wc -l)
if [ "$NGPU" -lt 2 ]; then export MKNUMBA_ALLOW_SHARED_GPU=1; fi
# the device image runs as root; the ranks get the variables above
MPIRUN="mpirun --allow-run-as-root --oversubscribe --bind-to none -x NCCL_NVLS_ENABLE"
MPIRUN+=" -x PYTHONUNBUFFERED -x PYTHONPATH"
MPIRUN+="${MKNUMBA_ALLOW_SHARED_GPU:+ -x MKNUMBA_ALLOW_SHARED_GPU}"    # set: pass it on
