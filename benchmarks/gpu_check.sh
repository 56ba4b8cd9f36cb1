#!/usr/bin/env bash
# The GPU check for one CUDA machine, within 8 minutes worst case: benchmarks/gpu_check.py (its docstring lists
# the steps, what counts as a miss and the summary table it prints).
#
#     bash benchmarks/gpu_check.sh               # on the GPU machine; exits 1 on any miss, 0 when all passed
#     bash benchmarks/gpu_check.sh --dry-run     # any machine, no CUDA needed: walk every step, check the budget
#     bash benchmarks/gpu_check.sh --cpu         # the steps that run without CUDA
#
# Options: --budget-s N (the worst case allowed, default 480), -h/--help.
set -uo pipefail
cd "$(dirname "$0")/.." || exit 2
exec python -m benchmarks.gpu_check "$@"
