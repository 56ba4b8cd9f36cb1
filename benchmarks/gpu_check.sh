#!/usr/bin/env bash
# GPU check for one CUDA machine, within 8 minutes: tests/gpu (NCCL DDP, bf16-mixed, FSDP on CUDA), then the
# benchmarks in their short modes, ember's DDP overhead on the GPU among them.
#
#     bash benchmarks/gpu_check.sh            # from anywhere; exits non-zero if a step failed or timed out
#
# Every step has its own time limit and is skipped (and reported) when the 8-minute budget cannot hold it;
# the summary at the end lists each step's status and seconds.
set -uo pipefail
cd "$(dirname "$0")/.."

BUDGET_S=${GPU_CHECK_BUDGET_S:-470}
start=$SECONDS
failed=0
summary=()

step() {  # step NAME LIMIT_S COMMAND...
    local name=$1 limit=$2
    shift 2
    local left=$((BUDGET_S - (SECONDS - start)))
    if ((left < limit)); then
        summary+=("skipped  ${name} (needs up to ${limit} s, ${left} s left)")
        failed=1
        return
    fi
    echo "=== ${name} (limit ${limit} s)"
    local t0=$SECONDS
    timeout --kill-after=10 "${limit}" "$@"
    local rc=$?
    local status="ok"
    if ((rc == 124 || rc == 137)); then
        status="TIMEOUT"
        failed=1
    elif ((rc != 0)); then
        status="FAILED (exit ${rc})"
        failed=1
    fi
    summary+=("${status}  ${name} ($((SECONDS - t0)) s)")
}

python - <<'EOF' || { echo "gpu_check: no CUDA device visible to torch; nothing to check"; exit 2; }
import torch
assert torch.cuda.is_available()
print(f"torch {torch.__version__}, CUDA {torch.version.cuda}, {torch.cuda.device_count()} x {torch.cuda.get_device_name(0)}")
EOF
command -v nvidia-smi >/dev/null && nvidia-smi --query-gpu=name,memory.used,memory.total --format=csv

step "tests/gpu" 200 python -m pytest tests/gpu -q -rs -p no:cacheprovider
step "ddp_overhead (cuda, 1 process, NCCL)" 50 python benchmarks/ddp_overhead.py --accelerator cuda --nproc 1 --repeats 5
step "ddp_overhead (cpu, 2 processes, gloo)" 45 python benchmarks/ddp_overhead.py --short
step "overhead" 30 python benchmarks/overhead.py --short
step "progress_overhead" 30 python benchmarks/progress_overhead.py --short
step "checkpoint" 40 python benchmarks/checkpoint.py --short
step "compile" 40 python benchmarks/compile.py --short
step "fit_fixed_cost" 20 python benchmarks/fit_fixed_cost.py --repeats 1 --epochs 1
step "import_time" 15 python benchmarks/import_time.py --repeats 1

echo "=== gpu_check summary ($((SECONDS - start)) s of ${BUDGET_S} s)"
printf '%s\n' "${summary[@]}"
exit "${failed}"
