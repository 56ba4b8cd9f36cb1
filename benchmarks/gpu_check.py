"""The GPU check for one CUDA machine, within 8 minutes worst case (run it through benchmarks/gpu_check.sh).

    bash benchmarks/gpu_check.sh               # on the GPU machine; exits 1 on any miss, 0 when everything passed
    bash benchmarks/gpu_check.sh --dry-run     # on any machine (no CUDA needed): walk every step, check the budget
    bash benchmarks/gpu_check.sh --cpu         # the steps that run without CUDA (tests/gpu skip; CPU throughput)

Steps, in order (each declares its worst case: its time limit plus the grace a killed step gets):

1. tests/gpu: CUDA placement and non-dict batches, bf16-mixed and 16-mixed (one process, DDP and FSDP over NCCL),
   compile, exact resumes (deterministic, mid-epoch with synced epoch metrics, async saves staged in host
   memory, on another GPU count), tensor parallel. The NCCL jobs run one process per GPU.
2. benchmarks/gpu_throughput.py: the char transformer (bf16-mixed, compiled) under ember and a hand-written
   loop: tokens/s, MFU, and the ratio of their step times (goal: ``gpu_throughput.GOAL``).
3. benchmarks/ddp_overhead.py on CUDA (one NCCL process): ember DDP against raw DDP (goal: its ``GOAL``).

A miss is any of: a step that fails or runs out of time, a test that fails, a ratio over its goal, and a
skipped test. On a host with 2+ GPUs every skip is a miss; on a host with one GPU the tests that need two
(their skip reason says ``needs 2 CUDA devices``) are listed as not checked, and the summary says so plainly;
any other skip is a miss. The summary table lists each step: status, seconds, ratio vs the raw loop, MFU.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import signal
import subprocess
import sys
import tempfile
import time
import xml.etree.ElementTree as ET
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import NoReturn

ROOT = Path(__file__).resolve().parents[1]
#: The whole check's worst case: 8 minutes.
BUDGET_S = 480
#: What the device probe before the steps may take at most (importing torch, counting GPUs).
PROBE_S = 15
#: A step past its limit gets SIGTERM, then SIGKILL this much later (counted in its worst case).
GRACE_S = 5
#: The skip reason of a test that needs more than one GPU (tests/gpu writes it; a 1-GPU host lists them).
MULTI_GPU_REASON = "needs 2 CUDA devices"


@dataclass
class Outcome:
    """What one step found: misses (each a line saying what), notes (said, not a miss), figures for the table."""

    misses: list[str] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)
    ratio: float | None = None
    mfu: float | None = None
    detail: str = ""


@dataclass(frozen=True)
class Step:
    """One step: its command, its time limit, and how its output is judged (`judge(stdout, workdir, gpus)`)."""

    name: str
    command: tuple[str, ...]
    limit_s: int
    judge: Callable[[str, Path, int], Outcome]
    needs: tuple[str, ...] = ()  # files the command reads (the dry run checks they exist)

    @property
    def worst_s(self) -> int:
        return self.limit_s + GRACE_S


# --- judging what a step printed or wrote ---------------------------------------------------------------------


def judge_tests(junit: Path, gpus: int) -> Outcome:
    """A pytest run's JUnit XML: failures and errors are misses; skips too, except multi-GPU ones on 1 GPU."""
    out = Outcome()
    if not junit.exists():
        return Outcome(misses=["pytest wrote no report (it did not run to the end)"])
    passed = skipped_multi = 0
    for case in ET.parse(junit).getroot().iter("testcase"):
        name = f"{case.get('classname', '')}::{case.get('name', '')}"
        bad = case.find("failure") if case.find("failure") is not None else case.find("error")
        skip = case.find("skipped")
        if bad is not None:
            out.misses.append(f"{name} failed: {(bad.get('message') or '').splitlines()[0][:200]}")
        elif skip is not None:
            reason = skip.get("message") or ""
            if gpus == 1 and MULTI_GPU_REASON in reason:
                skipped_multi += 1
                out.notes.append(f"not checked on this 1-GPU host: {name} ({reason})")
            else:
                out.misses.append(f"{name} skipped on a host with {gpus} GPU(s): {reason}")
        else:
            passed += 1
    out.detail = f"{passed} passed, {len(out.misses)} missed, {skipped_multi} not checked (1 GPU)"
    if passed == 0 and not out.misses:
        out.misses.append("no test ran")
    return out


def judge_throughput(path: Path, goal: float | None) -> Outcome:
    """gpu_throughput.py's figures: the ratio of ember's step time to the raw loop's against `goal` (None: none)."""
    if not path.exists():
        return Outcome(misses=["gpu_throughput.py wrote no figures"])
    figures = json.loads(path.read_text(encoding="utf-8"))
    ratio = float(figures["ratio"])
    out = Outcome(ratio=ratio, mfu=figures["mfu"]["ember"])
    raw, ember = figures["tokens_per_s"]["raw"], figures["tokens_per_s"]["ember"]
    out.detail = f"{ember:,.0f} tokens/s (raw loop {raw:,.0f})"
    if goal is not None and ratio > goal:
        out.misses.append(f"ember / raw step time x{ratio:.3f} misses the goal x{goal}")
    return out


def judge_ddp_overhead(stdout: str, goal: float) -> Outcome:
    """ddp_overhead.py's ``ratio ember/raw: X`` line against `goal`."""
    found = re.findall(r"^ratio ember/raw: ([0-9.]+)$", stdout, flags=re.MULTILINE)
    if not found:
        return Outcome(misses=["ddp_overhead.py printed no ratio"])
    ratio = float(found[-1])
    out = Outcome(ratio=ratio, detail="ember DDP / raw DDP, NCCL")
    if ratio > goal:
        out.misses.append(f"ember DDP / raw DDP x{ratio:.3f} misses the goal x{goal}")
    return out


# --- the plan ---------------------------------------------------------------------------------------------------


def plan(mode: str, gpus: int) -> list[Step]:
    """The steps of `mode` ("gpu", "cpu"); the dry run walks the "gpu" plan. Nothing heavy is imported here (the
    benchmarks' goals are read when a step is judged), so the dry run takes well under a second."""
    py = sys.executable
    tests = ("tests/gpu/test_cuda.py", "tests/gpu/test_model_parallel_cuda.py", "tests/gpu/test_cuda_resume.py")
    pytest = (py, "-m", "pytest", "tests/gpu", "-q", "-rs", "-p", "no:cacheprovider", "-p", "no:randomly", "-n", "0")

    def run_tests(stdout: str, work: Path, gpus: int) -> Outcome:
        if mode == "cpu":  # without CUDA every test skips: that is the point of this mode, not a miss
            return _cpu_skips(work / "gpu-tests.xml")
        return judge_tests(work / "gpu-tests.xml", gpus)

    junit = ("--junitxml", "{work}/gpu-tests.xml")
    if mode == "cpu":
        throughput_args = ("--device", "cpu", "--short", "--compile-backend", "aot_eager")
        return [
            Step("tests/gpu (collected; each skips without CUDA)", (*pytest, *junit), 120, run_tests, tests),
            Step(
                "gpu_throughput (cpu, short, aot_eager)",
                (py, "benchmarks/gpu_throughput.py", *throughput_args, "--json", "{work}/throughput.json"),
                180,
                lambda out, work, g: judge_throughput(work / "throughput.json", None),
                ("benchmarks/gpu_throughput.py",),
            ),
        ]
    nproc = str(gpus) if gpus else "<GPU count>"
    return [
        Step(f"tests/gpu (NCCL jobs: one process per GPU, {nproc})", (*pytest, *junit), 240, run_tests, tests),
        Step(
            "gpu_throughput (char transformer, bf16-mixed, compile)",
            (py, "benchmarks/gpu_throughput.py", "--json", "{work}/throughput.json"),
            150,
            lambda out, work, g: judge_throughput(work / "throughput.json", _goal("gpu_throughput")),
            ("benchmarks/gpu_throughput.py",),
        ),
        Step(
            "ddp_overhead (cuda, 1 process, NCCL)",
            (py, "benchmarks/ddp_overhead.py", "--accelerator", "cuda", "--nproc", "1", "--repeats", "5"),
            50,
            lambda out, work, g: judge_ddp_overhead(out, _goal("ddp_overhead")),
            ("benchmarks/ddp_overhead.py",),
        ),
    ]


def _goal(benchmark: str) -> float:
    """The ``GOAL`` ratio a benchmark module declares (importing it imports torch and ember)."""
    import importlib

    return float(importlib.import_module(f"benchmarks.{benchmark}").GOAL)


def _cpu_skips(junit: Path) -> Outcome:
    """--cpu: every test in tests/gpu was collected and skipped with its reason (none ran, none failed)."""
    out = judge_tests(junit, gpus=0)
    failed = [m for m in out.misses if " failed: " in m or "no report" in m]
    skipped = len(out.misses) - len(failed)
    return Outcome(misses=failed, detail=f"{skipped} skipped without CUDA (expected here)")


def worst_case_s(steps: Sequence[Step]) -> int:
    """The check's worst case: the device probe, then every step at its limit plus its grace."""
    return PROBE_S + sum(step.worst_s for step in steps)


# --- running ----------------------------------------------------------------------------------------------------


def dry_run(steps: Sequence[Step], budget_s: int) -> int:
    """Walk every step without running it: its command, its worst case, the files it needs; then the budget."""
    total, missing = worst_case_s(steps), []
    print(f"gpu_check plan (worst case {total} s of a {budget_s} s budget; probe {PROBE_S} s, grace {GRACE_S} s):")
    for step in steps:
        absent = [need for need in step.needs if not (ROOT / need).exists()]
        missing += absent
        print(f"  {step.worst_s:4d} s  {step.name}")
        print(f"           {' '.join(step.command)}")
        if absent:
            print(f"           missing: {', '.join(absent)}")
    if missing:
        print(f"gpu_check --dry-run: the plan names files that do not exist: {', '.join(missing)}", file=sys.stderr)
        return 1
    if total > budget_s:
        print(f"gpu_check --dry-run: worst case {total} s exceeds the budget of {budget_s} s", file=sys.stderr)
        return 1
    print(f"budget: ok ({total} s <= {budget_s} s)")
    return 0


def run_step(step: Step, work: Path, gpus: int) -> tuple[str, float, Outcome]:
    """Run one step under its limit; its status, seconds and what was judged."""
    command = [part.replace("{work}", str(work)) for part in step.command]
    print(f"=== {step.name} (limit {step.limit_s} s)", flush=True)
    start = time.monotonic()
    # In a session of its own, so a step past its limit is stopped with everything it started (torchrun's workers).
    proc = subprocess.Popen(
        command, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, start_new_session=True
    )
    try:
        stdout, _ = proc.communicate(timeout=step.limit_s)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGTERM)
        try:
            stdout, _ = proc.communicate(timeout=GRACE_S)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            stdout, _ = proc.communicate()
        print(stdout, end="")
        return "TIMEOUT", time.monotonic() - start, Outcome(misses=[f"ran past its {step.limit_s} s limit"])
    print(stdout, end="", flush=True)
    outcome = step.judge(stdout, work, gpus)
    if proc.returncode != 0 and not outcome.misses:
        outcome.misses.append(f"exit status {proc.returncode}")
    return ("ok" if not outcome.misses else "MISSED"), time.monotonic() - start, outcome


def summary(rows: Sequence[tuple[Step, str, float, Outcome]], gpus: int) -> tuple[list[str], bool]:
    """The summary table and the misses and notes under it; whether everything passed."""

    def number(value: float | None, form: str) -> str:
        return "-" if value is None else format(value, form)

    lines = [f"{'step':58s} {'status':8s} {'s':>5s} {'vs raw':>7s} {'MFU':>6s}  detail"]
    for step, status, seconds, out in rows:
        lines.append(
            f"{step.name[:58]:58s} {status:8s} {seconds:5.0f} {number(out.ratio, '.3f'):>7s} "
            f"{number(out.mfu, '.1%'):>6s}  {out.detail}"
        )
    misses = [f"MISS {step.name}: {m}" for step, _, _, out in rows for m in out.misses]
    notes = [f"note {step.name}: {n}" for step, _, _, out in rows for n in out.notes]
    if gpus == 1 and any(out.notes for _, _, _, out in rows):
        notes.append("this host has 1 GPU: NCCL between GPUs (multi-rank tests) was NOT checked; run on 2+ GPUs")
    ok = not misses
    return [*lines, *misses, *notes, f"gpu_check: {'PASSED' if ok else 'FAILED'} ({len(misses)} misses)"], ok


def count_gpus() -> int:
    import torch

    return torch.cuda.device_count() if torch.cuda.is_available() else 0


class _Parser(argparse.ArgumentParser):
    def error(self, message: str) -> NoReturn:
        """A mistake on the command line: one line and exit 2."""
        self.exit(2, f"gpu_check: {message}; see --help\n")


def main(argv: list[str] | None = None) -> int:
    parser = _Parser(prog="gpu_check", description=__doc__.split("\n\n")[0])
    modes = parser.add_mutually_exclusive_group()
    modes.add_argument("--dry-run", action="store_true", help="walk every step and check the budget; run nothing")
    modes.add_argument("--cpu", action="store_true", help="the steps that run without CUDA")
    parser.add_argument("--budget-s", type=int, default=BUDGET_S, help=f"worst case allowed (default {BUDGET_S})")
    args = parser.parse_args(argv)
    if args.budget_s < 1:
        parser.error(f"--budget-s needs a positive number of seconds, got {args.budget_s}")
    if args.dry_run:  # no GPU needed, nothing imported: the plan as a GPU machine would run it
        return dry_run(plan("gpu", 0), args.budget_s)
    # --cpu runs nothing that looks for a GPU, and its steps are judged as on a host without one: torch (~1.5 s of
    # CPU to import) stays out of this process.
    gpus = 0 if args.cpu else count_gpus()
    steps = plan("cpu" if args.cpu else "gpu", gpus)
    if not args.cpu and gpus == 0:
        print("gpu_check: no CUDA device visible to torch; --dry-run walks the plan, --cpu runs what needs none",
              file=sys.stderr)  # fmt: skip
        return 2
    if worst_case_s(steps) > args.budget_s:
        print(f"gpu_check: worst case {worst_case_s(steps)} s exceeds the budget of {args.budget_s} s", file=sys.stderr)
        return 1
    with tempfile.TemporaryDirectory(prefix="gpu_check-") as tmp:
        rows = [(step, *run_step(step, Path(tmp), gpus)) for step in steps]
    lines, ok = summary(rows, gpus)
    print(
        "=== gpu_check summary (" + (f"{gpus} GPU(s)" if not args.cpu else "CPU fallback, nothing measures a GPU") + ")"
    )
    print("\n".join(lines))
    return 0 if ok else 1


if __name__ == "__main__":
    sys.path.insert(0, str(ROOT))
    sys.exit(main())
