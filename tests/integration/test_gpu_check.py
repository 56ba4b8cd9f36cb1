"""benchmarks/gpu_check.sh and benchmarks/gpu_throughput.py on a machine without CUDA (issue 23, "must show" 3).

The GPU check runs only on a GPU machine; what of it runs without one is run here, so it does not rot: its
options and errors, the printed plan, the CPU fallback (tests/gpu collected and skipped, the throughput
benchmark on the CPU in its short mode) and the budget that skips steps. The throughput figures are
arithmetic checked against hand-computed values; no speed is asserted.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = ROOT / "benchmarks" / "gpu_check.sh"
sys.path.insert(0, str(ROOT))

from benchmarks import gpu_throughput as throughput  # noqa: E402

pytestmark = pytest.mark.skipif(torch.cuda.is_available(), reason="checks the behaviour without CUDA")


def check(*args: str, timeout: float = 60) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    env.pop("GPU_CHECK_BUDGET_S", None)
    return subprocess.run(["bash", str(SCRIPT), *args], capture_output=True, text=True, timeout=timeout, env=env)


def test_help_describes_the_modes() -> None:
    done = check("--help")
    assert done.returncode == 0
    for option in ("--dry-run", "--cpu", "--budget-s"):
        assert option in done.stdout


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--bogus"], "unknown option '--bogus'"),
        (["--budget-s", "soon", "--dry-run"], "--budget-s needs a positive number of seconds, got 'soon'"),
        (["--budget-s=0", "--cpu"], "got '0'"),
        ([], "no CUDA device visible to torch"),
    ],
)
def test_bad_options_and_a_missing_gpu_are_one_line_and_exit_2(args: list[str], message: str) -> None:
    done = check(*args)
    assert done.returncode == 2
    assert done.stderr.strip().count("\n") == 0 and message in done.stderr, done.stderr


def test_the_dry_run_prints_the_plan_within_8_minutes() -> None:
    done = check("--dry-run")
    assert done.returncode == 0, done.stderr
    steps = [line.split() for line in done.stdout.splitlines() if line.strip().startswith(("required", "optional"))]
    names = done.stdout
    assert "tests/gpu (NCCL jobs: torchrun --nproc-per-node=<GPU count>)" in names
    assert "python benchmarks/gpu_throughput.py" in names
    required = sum(int(step[1]) for step in steps if step[0] == "required")
    assert required <= 470 < 480  # the required steps fit the default budget, which is under 8 minutes
    assert len(steps) >= 4


def test_a_budget_too_small_skips_required_steps_and_fails() -> None:
    done = check("--cpu", "--budget-s", "5")
    assert done.returncode == 1
    assert "skipped  tests/gpu" in done.stdout and "5 s left" in done.stdout


@pytest.mark.slow
def test_the_cpu_fallback_runs_every_step_that_needs_no_gpu() -> None:
    done = check("--cpu", timeout=400)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    summary = done.stdout.split("=== gpu_check summary", 1)[1]
    assert "ok  tests/gpu" in summary and "ok  gpu_throughput (cpu, short, aot_eager)" in summary
    assert "skipped" in done.stdout and "needs CUDA" in done.stdout  # tests/gpu skip with their reasons
    assert "tokens/s" in done.stdout and "verdict: none on CPU" in done.stdout


def test_throughput_arithmetic() -> None:
    result = throughput.Result(
        raw_s=[2.0, 4.0], ember_s=[2.2, 4.0], tokens_per_epoch=1000, flops_per_step=10**9, peak_flops_per_s=1e12
    )
    assert result.tokens_per_s("raw") == pytest.approx(2000 / 6)
    assert result.tokens_per_s("ember") == pytest.approx(2000 / 6.2)
    assert result.ratio == pytest.approx((1.1 + 1.0) / 2)  # the median of the per-epoch ratios
    # 10 steps per epoch: 20 GFLOP in 6 s of a 1 TFLOP/s device.
    assert result.mfu("raw", steps_per_epoch=10) == pytest.approx(20e9 / 6 / 1e12)
    assert throughput.Result([1.0], [1.0], 1, 1, None).mfu("raw", 1) is None


def test_the_flops_per_step_are_the_transformers() -> None:
    """The meta-device count agrees with the usual estimate: 6 x (non-embedding parameters) per token for the
    matrices, plus the attention's 12 x layers x d_model x seq_len (causal SDPA is counted as full here)."""
    config = throughput.Config(d_model=64, n_heads=4, n_layers=2, seq_len=32, batch_size=4)
    tokens = config.batch_size * config.seq_len
    matrices = config.n_layers * 12 * config.d_model**2 + config.d_model * 256  # blocks + lm_head
    estimate = tokens * (6 * matrices + 12 * config.n_layers * config.d_model * config.seq_len)
    assert throughput.flops_per_step(config) == pytest.approx(estimate, rel=0.02)


def test_options_of_the_throughput_benchmark(tmp_path: Path) -> None:
    config, _ = throughput.parse_args(["--device", "cpu", "--short", "--steps", "3", "--no-compile"])
    assert (config.device, config.steps, config.compile, config.d_model) == ("cpu", 3, False, 32)
    with pytest.raises(SystemExit):
        throughput.parse_args(["--device", "cuda"])  # no CUDA here: an argparse error, exit 2
    with pytest.raises(SystemExit):
        throughput.parse_args(["--device", "cpu", "--epochs", "1"])


@pytest.mark.slow
def test_the_throughput_benchmark_writes_its_figures(tmp_path: Path) -> None:
    out = tmp_path / "figures.json"
    argv = ["--device", "cpu", "--short", "--no-compile", "--steps", "2", "--json", str(out)]
    throughput.main(argv)
    figures = json.loads(out.read_text())
    assert len(figures["raw_s"]) == len(figures["ember_s"]) == 1  # 2 epochs, the first is warm-up
    assert figures["tokens_per_s"]["raw"] > 0 and figures["mfu"] == {"raw": None, "ember": None}
    assert figures["config"]["steps"] == 2
