#!/usr/bin/env bash
# GPU check for one CUDA machine, within 8 minutes: tests/gpu (CUDA placement, bf16-mixed and 16-mixed,
# compile=True, NCCL DDP / FSDP2 / tensor parallel jobs with one process per GPU, exact resume on the GPU with
# deterministic=True), the char transformer's throughput (bf16-mixed, compiled: tokens/s and MFU of ember
# against a hand-written loop, benchmarks/gpu_throughput.py), ember's DDP overhead on NCCL, then, as far as
# the budget allows, the CPU benchmarks in their short modes.
#
#     bash benchmarks/gpu_check.sh               # on the GPU machine; exits non-zero if a required step failed
#     bash benchmarks/gpu_check.sh --dry-run     # print the plan (steps, time limits, commands); run nothing
#     bash benchmarks/gpu_check.sh --cpu         # CPU fallback: the steps that run without CUDA, in short modes
#
# Options: --budget-s N (default 470, or $GPU_CHECK_BUDGET_S), -h/--help. Every step has its own time limit and
# is skipped (and reported) when the budget cannot hold it; a skipped required step fails the check, a skipped
# optional one does not. The summary at the end lists each step's status and seconds.
set -uo pipefail
cd "$(dirname "$0")/.."

usage() {
    sed -n '2,14p' "$0" | sed 's/^# \{0,1\}//'
}

BUDGET_S=${GPU_CHECK_BUDGET_S:-470}
mode=gpu
while (($#)); do
    case $1 in
        --dry-run) mode=dry-run ;;
        --cpu) mode=cpu ;;
        --budget-s)
            shift
            BUDGET_S=${1:-}
            ;;
        --budget-s=*) BUDGET_S=${1#*=} ;;
        -h | --help)
            usage
            exit 0
            ;;
        *)
            echo "gpu_check: unknown option '$1'; see --help" >&2
            exit 2
            ;;
    esac
    shift
done
if ! [[ $BUDGET_S =~ ^[0-9]+$ ]] || ((BUDGET_S < 1)); then
    echo "gpu_check: --budget-s needs a positive number of seconds, got '${BUDGET_S}'" >&2
    exit 2
fi

gpus=$(python -c 'import torch; print(torch.cuda.device_count() if torch.cuda.is_available() else 0)' 2>/dev/null)
gpus=${gpus:-0}
if [[ $mode == gpu ]] && ((gpus == 0)); then
    echo "gpu_check: no CUDA device visible to torch; nothing to check (--cpu runs the CPU fallback, --dry-run the plan)" >&2
    exit 2
fi

# The plan: "required|optional<TAB>limit_s<TAB>name<TAB>command", one step per line, in order.
plan=()
add() { plan+=("$1"$'\t'"$2"$'\t'"$3"$'\t'"$4"); }
if [[ $mode == cpu ]]; then
    add required 120 "tests/gpu (collected; skipped without CUDA)" "python -m pytest tests/gpu -q -rs -p no:cacheprovider"
    add required 180 "gpu_throughput (cpu, short, aot_eager)" \
        "python benchmarks/gpu_throughput.py --device cpu --short --compile-backend aot_eager"
else
    # tests/gpu starts its NCCL jobs under torchrun with one process per GPU (tests/gpu/test_cuda.py, _processes).
    add required 230 "tests/gpu (NCCL jobs: torchrun --nproc-per-node=$( ((gpus)) && echo "$gpus" || echo '<GPU count>'))" \
        "python -m pytest tests/gpu -q -rs -p no:cacheprovider"
    add required 170 "gpu_throughput (char transformer, bf16-mixed, compile)" "python benchmarks/gpu_throughput.py"
    add required 50 "ddp_overhead (cuda, 1 process, NCCL)" \
        "python benchmarks/ddp_overhead.py --accelerator cuda --nproc 1 --repeats 5"
    add optional 45 "ddp_overhead (cpu, 2 processes, gloo)" "python benchmarks/ddp_overhead.py --short"
    add optional 30 "overhead" "python benchmarks/overhead.py --short"
    add optional 40 "checkpoint" "python benchmarks/checkpoint.py --short"
    add optional 40 "compile" "python benchmarks/compile.py --short"
fi

if [[ $mode == dry-run ]]; then
    echo "gpu_check plan (budget ${BUDGET_S} s; ${gpus} CUDA device(s) here; NCCL jobs use one process per GPU):"
    for entry in "${plan[@]}"; do
        IFS=$'\t' read -r kind limit name command <<<"$entry"
        printf '  %-8s %4s s  %s\n           %s\n' "$kind" "$limit" "$name" "$command"
    done
    exit 0
fi

if [[ $mode == gpu ]]; then
    python - <<'EOF'
import torch
print(f"torch {torch.__version__}, CUDA {torch.version.cuda}, {torch.cuda.device_count()} x {torch.cuda.get_device_name(0)}")
EOF
    command -v nvidia-smi >/dev/null && nvidia-smi --query-gpu=name,memory.used,memory.total --format=csv
else
    echo "gpu_check --cpu: the steps that run without CUDA (nothing here measures a GPU)"
fi

start=$SECONDS
failed=0
summary=()
for entry in "${plan[@]}"; do
    IFS=$'\t' read -r kind limit name command <<<"$entry"
    left=$((BUDGET_S - (SECONDS - start)))
    if ((left < limit)); then
        summary+=("skipped  ${name} (needs up to ${limit} s, ${left} s left)")
        [[ $kind == required ]] && failed=1
        continue
    fi
    echo "=== ${name} (limit ${limit} s)"
    t0=$SECONDS
    # shellcheck disable=SC2086  # the command is a plain word list
    timeout --kill-after=10 "${limit}" ${command}
    rc=$?
    status="ok"
    if ((rc == 124 || rc == 137)); then
        status="TIMEOUT"
    elif ((rc != 0)); then
        status="FAILED (exit ${rc})"
    fi
    [[ $status != ok && $kind == required ]] && failed=1
    summary+=("${status}  ${name} ($((SECONDS - t0)) s)")
done

echo "=== gpu_check summary ($((SECONDS - start)) s of ${BUDGET_S} s)"
printf '%s\n' "${summary[@]}"
exit "${failed}"
