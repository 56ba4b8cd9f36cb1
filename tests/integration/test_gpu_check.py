"""benchmarks/gpu_check.sh (benchmarks/gpu_check.py) and benchmarks/gpu_throughput.py on a machine without CUDA.

The GPU check runs only on a GPU machine; what of it runs without one is run here, so it does not rot: its
options and errors, the dry run that walks every step and checks the 8-minute budget, how a step's results are
judged (fed the files a real run writes: pytest's JUnit XML, the throughput figures, the DDP benchmark's
lines), the summary table, and the CPU fallback. The throughput figures are arithmetic checked against
hand-computed values; no speed is asserted.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = ROOT / "benchmarks" / "gpu_check.sh"
sys.path.insert(0, str(ROOT))

from benchmarks import gpu_check  # noqa: E402
from benchmarks import gpu_throughput as throughput  # noqa: E402

pytestmark = pytest.mark.skipif(torch.cuda.is_available(), reason="checks the behaviour without CUDA")


def check(*args: str, timeout: float = 60) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    return subprocess.run(["bash", str(SCRIPT), *args], capture_output=True, text=True, timeout=timeout, env=env)


def test_help_describes_the_modes() -> None:
    done = check("--help")
    assert done.returncode == 0
    for option in ("--dry-run", "--cpu", "--budget-s"):
        assert option in done.stdout


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--bogus"], "unrecognized arguments: --bogus"),
        (["--budget-s", "soon", "--dry-run"], "argument --budget-s: invalid int value: 'soon'"),
        (["--budget-s=0", "--cpu"], "--budget-s needs a positive number of seconds, got 0"),
        ([], "no CUDA device visible to torch"),
    ],
)
def test_bad_options_and_a_missing_gpu_are_one_line_and_exit_2(args: list[str], message: str) -> None:
    done = check(*args)
    assert done.returncode == 2
    assert done.stderr.strip().count("\n") == 0 and message in done.stderr, done.stderr


def test_the_dry_run_walks_every_step_within_8_minutes_in_seconds() -> None:
    """The dry run on CPU: every step of the GPU plan with its worst case and command, and the budget checked."""
    began = time.monotonic()
    done = check("--dry-run")
    assert time.monotonic() - began < 10
    assert done.returncode == 0, done.stderr
    steps = gpu_check.plan("gpu", gpus=0)
    assert [step.name for step in steps] == [
        "tests/gpu (NCCL jobs: one process per GPU, <GPU count>)",
        "gpu_throughput (char transformer, bf16-mixed, compile)",
        "ddp_overhead (cuda, 1 process, NCCL)",
    ]
    for step in steps:
        assert f"{step.worst_s:4d} s  {step.name}" in done.stdout
        # the interpreter is the one the script runs under (`python` in gpu_check.sh), not necessarily this one
        assert step.command[0] == sys.executable and " ".join(step.command[1:]) in done.stdout
    total = gpu_check.PROBE_S + sum(step.limit_s + gpu_check.GRACE_S for step in steps)
    assert total == gpu_check.worst_case_s(steps) <= 480
    assert f"budget: ok ({total} s <= 480 s)" in done.stdout
    assert "tests/gpu/test_cuda_resume.py" in {need for step in steps for need in step.needs}


def test_the_dry_run_fails_when_the_worst_case_exceeds_the_budget() -> None:
    done = check("--dry-run", "--budget-s", "300")
    assert done.returncode == 1
    assert f"worst case {gpu_check.worst_case_s(gpu_check.plan('gpu', 0))} s exceeds the budget of 300 s" in done.stderr


def test_the_dry_run_fails_when_a_step_names_a_missing_file(capsys: pytest.CaptureFixture[str]) -> None:
    steps = gpu_check.plan("gpu", gpus=0)
    broken = [gpu_check.Step("gone", ("python", "nowhere.py"), 10, steps[2].judge, ("benchmarks/nowhere.py",))]
    assert gpu_check.dry_run([*steps, broken[0]], 480) == 1
    assert "benchmarks/nowhere.py" in capsys.readouterr().err


FAILED = '<failure message="AssertionError: rank 1 differs">x</failure>'
SKIPPED = '<skipped message="needs 2 CUDA devices for a tensor-parallel group; torch sees 1"/>'
JUNIT = (
    '<?xml version="1.0" encoding="utf-8"?><testsuites><testsuite name="pytest">\n'
    '<testcase classname="tests.gpu.test_cuda" name="test_a"/>\n'
    f'<testcase classname="tests.gpu.test_cuda" name="test_b">{FAILED}</testcase>\n'
    f'<testcase classname="tests.gpu.test_tp" name="test_c">{SKIPPED}</testcase>\n'
    "{extra}</testsuite></testsuites>\n"
)


def write_junit(path: Path, extra: str = "") -> Path:
    path.write_text(JUNIT.format(extra=extra), encoding="utf-8")
    return path


def test_a_failed_test_is_a_miss_and_a_multi_gpu_skip_is_one_on_two_gpus(tmp_path: Path) -> None:
    junit = write_junit(tmp_path / "t.xml")
    two = gpu_check.judge_tests(junit, gpus=2)
    assert two.misses == [
        "tests.gpu.test_cuda::test_b failed: AssertionError: rank 1 differs",
        "tests.gpu.test_tp::test_c skipped on a host with 2 GPU(s): needs 2 CUDA devices for a tensor-parallel "
        "group; torch sees 1",
    ]
    assert two.detail == "1 passed, 2 missed, 0 not checked (1 GPU)"


def test_on_one_gpu_multi_gpu_skips_are_said_plainly_and_other_skips_are_misses(tmp_path: Path) -> None:
    one = gpu_check.judge_tests(write_junit(tmp_path / "t.xml"), gpus=1)
    assert one.misses == ["tests.gpu.test_cuda::test_b failed: AssertionError: rank 1 differs"]
    assert one.notes == [
        "not checked on this 1-GPU host: tests.gpu.test_tp::test_c (needs 2 CUDA devices for a tensor-parallel "
        "group; torch sees 1)"
    ]
    other = '<testcase classname="t" name="test_d"><skipped message="needs bf16"/></testcase>'
    assert gpu_check.judge_tests(write_junit(tmp_path / "u.xml", other), gpus=1).misses[-1] == (
        "t::test_d skipped on a host with 1 GPU(s): needs bf16"
    )
    assert gpu_check.judge_tests(tmp_path / "absent.xml", gpus=1).misses == [
        "pytest wrote no report (it did not run to the end)"
    ]


def test_a_ratio_over_its_goal_is_a_miss(tmp_path: Path) -> None:
    figures = {"ratio": 1.05, "mfu": {"raw": 0.41, "ember": 0.39}, "tokens_per_s": {"raw": 2000.0, "ember": 1900.0}}
    (tmp_path / "f.json").write_text(json.dumps(figures), encoding="utf-8")
    missed = gpu_check.judge_throughput(tmp_path / "f.json", goal=1.03)
    assert missed.misses == ["ember / raw step time x1.050 misses the goal x1.03"]
    assert (missed.ratio, missed.mfu, missed.detail) == (1.05, 0.39, "1,900 tokens/s (raw loop 2,000)")
    assert gpu_check.judge_throughput(tmp_path / "f.json", goal=1.10).misses == []
    assert gpu_check.judge_throughput(tmp_path / "f.json", goal=None).misses == []  # the CPU fallback: no goal
    assert gpu_check.judge_ddp_overhead("x\nratio ember/raw: 1.071\nverdict: misses", 1.05).misses == [
        "ember DDP / raw DDP x1.071 misses the goal x1.05"
    ]
    assert gpu_check.judge_ddp_overhead("ratio ember/raw: 1.010\n", 1.05).ratio == 1.01
    assert gpu_check.judge_ddp_overhead("crashed", 1.05).misses == ["ddp_overhead.py printed no ratio"]


def test_the_summary_table_and_the_verdict(tmp_path: Path) -> None:
    steps = gpu_check.plan("gpu", gpus=1)
    tests = gpu_check.judge_tests(write_junit(tmp_path / "t.xml"), gpus=1)
    fast = gpu_check.Outcome(ratio=1.012, mfu=0.387, detail="1,900 tokens/s (raw loop 1,923)")
    timeout = gpu_check.Outcome(misses=["ran past its 50 s limit"])
    lines, ok = gpu_check.summary([(steps[0], "MISSED", 130.4, tests), (steps[1], "ok", 90.0, fast),
                                   (steps[2], "TIMEOUT", 55.0, timeout)], gpus=1)  # fmt: skip
    assert not ok
    assert lines[0].split() == ["step", "status", "s", "vs", "raw", "MFU", "detail"]
    assert lines[2].split()[-9:] == ["ok", "90", "1.012", "38.7%", "1,900", "tokens/s", "(raw", "loop", "1,923)"]
    assert lines[3].split()[-4:] == ["TIMEOUT", "55", "-", "-"]  # no ratio, no MFU
    assert "MISS tests/gpu (NCCL jobs: one process per GPU, 1): tests.gpu.test_cuda::test_b failed" in "\n".join(lines)
    assert any("this host has 1 GPU: NCCL between GPUs (multi-rank tests) was NOT checked" in line for line in lines)
    assert lines[-1] == "gpu_check: FAILED (2 misses)"
    lines, ok = gpu_check.summary([(steps[1], "ok", 90.0, fast)], gpus=2)
    assert ok and lines[-1] == "gpu_check: PASSED (0 misses)"


@pytest.mark.slow
def test_the_cpu_fallback_runs_every_step_that_needs_no_gpu() -> None:
    done = check("--cpu", timeout=400)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    summary = done.stdout.split("=== gpu_check summary", 1)[1]
    assert "skipped without CUDA (expected here)" in summary
    assert "gpu_throughput (cpu, short, aot_eager)" in summary and "gpu_check: PASSED (0 misses)" in summary
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
