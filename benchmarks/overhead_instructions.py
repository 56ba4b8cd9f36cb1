"""Per-step overhead of ember over a raw PyTorch loop, in instructions executed (noise-free).

Wall-clock ratios on a shared machine wander by several percent from one run to
the next, more than the goals of `overhead.py` leave. The number of instructions
a process executes does not depend on what else runs on the machine. This
script runs each variant of `overhead.py` under valgrind's cachegrind (no cache
simulation, so only instructions are counted) for 1 and for 9 epochs; the
difference over 2048 steps is what one step costs, with interpreter start-up,
imports, set-up and the first epoch's one-time costs cancelled out. Every
epoch-end action (logger writes, checkpoint saves) falls inside that difference,
spread over the steps of its epoch.

What it does not see: time spent in the kernel (file writes, fsync), waiting on
the disk, cache misses. A checkpoint's fsyncs and rename, which run on a
background thread, count as their user-space instructions only. The wall-clock
goals stay those of `overhead.py`; this is the measure that is reproducible.

    python benchmarks/overhead_instructions.py               # 10 runs under valgrind: about 15 minutes on 2 cores
    python benchmarks/overhead_instructions.py --repeats 3   # the median of 3 per-step figures per variant
    python benchmarks/overhead_instructions.py --variants raw "ember defaults"
    python benchmarks/overhead_instructions.py --allocator jemalloc   # comparing two checkouts

Comparing two checkouts, glibc's malloc adds a noise of its own: what one call costs depends on where
earlier allocations left free memory, and that layout moves with changes that run no code in the step
(an import, a buffer allocated once per epoch). Between two checkouts whose steps make the same 808
allocations, of the same sizes, glibc's `_int_malloc` alone differed by 7.7 k instructions per step
(docs/benchmarks.md). ``--allocator jemalloc`` runs every process on jemalloc (``LD_PRELOAD``, with
time-based purging off, so counts do not depend on timing), whose cost per call barely depends on the
layout: the difference between two checkouts is then the code they run. The goals' verdict is for
glibc, the allocator a user gets.

A run's start-up (interpreter, imports: about 10 G instructions) differs by a few million instructions
from one run to the next; over 2048 steps that is about 0.2% of a step (over 512 steps, as this script
once measured, it was 1%). Every run gets ``PYTHONHASHSEED=0``, which takes hash randomisation out of
that noise, and one thread per library pool (`ONE_THREAD`), which takes out threads spinning while idle.
To compare two checkouts, run the copy of this script and of `overhead.py` in each: `overhead.py` imports
the ember of the checkout it lives in, whatever ``PYTHONPATH`` says.

Needs valgrind (``apt-get install valgrind``); without it, it says so and exits with status 2.
"""

from __future__ import annotations

import argparse
import os
import re
import shutil
import statistics
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
from overhead import STEPS_PER_EPOCH, VARIANTS  # noqa: E402

SHORT, LONG = 1, 9  # epochs of the two runs per variant

#: Every run's thread pools at one thread. numpy's OpenBLAS starts a pool of threads that spin while they
#: wait for work; cachegrind counts their spinning, which lasts as long as the scheduler lets it. Once
#: measured: 26.4 M such instructions in a 1-epoch run, 30.0 M in a 3-epoch run of the same variant, which
#: read as 6.9 k instructions per step that ember never executed.
ONE_THREAD = {"OPENBLAS_NUM_THREADS": "1", "OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1"}

#: Where Debian's and Ubuntu's ``libjemalloc2`` put the library.
JEMALLOC_PATHS = ("/usr/lib/x86_64-linux-gnu/libjemalloc.so.2", "/usr/lib/aarch64-linux-gnu/libjemalloc.so.2")


def allocator_env(allocator: str) -> dict[str, str]:
    """The environment that runs a process on `allocator` ("glibc": nothing to set; "jemalloc": preloaded,
    without time-based purging). Raises FileNotFoundError, saying how to install it, if it is missing."""
    if allocator == "glibc":
        return {}
    found = next((path for path in JEMALLOC_PATHS if Path(path).is_file()), None)
    if found is None:
        raise FileNotFoundError(
            f"jemalloc is not installed (looked for {', '.join(JEMALLOC_PATHS)}): apt-get install libjemalloc2"
        )
    return {"LD_PRELOAD": found, "MALLOC_CONF": "dirty_decay_ms:-1,muzzy_decay_ms:-1"}


def instructions(valgrind_stderr: str) -> int:
    """The ``I refs`` total of cachegrind's summary."""
    match = re.search(r"I\s+refs:\s+([\d,]+)", valgrind_stderr)
    if match is None:
        raise RuntimeError(f"no instruction count in valgrind's output:\n{valgrind_stderr[-2000:]}")
    return int(match.group(1).replace(",", ""))


def count(variant: str, epochs: int, allocator: dict[str, str] | None = None) -> int:
    """Instructions executed by one run of `variant` for `epochs` epochs (all threads), with the environment
    `allocator` (`allocator_env`) added."""
    command = [
        "valgrind",
        "--tool=cachegrind",
        "--cache-sim=no",
        "--cachegrind-out-file=/dev/null",
        sys.executable,
        str(HERE / "overhead.py"),
        "--run",
        variant,
        "--epochs",
        str(epochs),
    ]
    env = dict(os.environ, PYTHONHASHSEED="0", **ONE_THREAD, **(allocator or {}))
    done = subprocess.run(command, capture_output=True, text=True, check=False, env=env)
    if done.returncode != 0:
        raise RuntimeError(f"{variant!r} under valgrind failed ({done.returncode}):\n{done.stderr[-2000:]}")
    return instructions(done.stderr)


def per_step(short_run: int, long_run: int) -> float:
    """Instructions per step: the difference between the two runs over the steps between them."""
    return (long_run - short_run) / ((LONG - SHORT) * STEPS_PER_EPOCH)


def median_per_step(pairs: list[tuple[int, int]]) -> float:
    """The median of the per-step figures of several (short run, long run) pairs."""
    return statistics.median(per_step(short_run, long_run) for short_run, long_run in pairs)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--jobs", type=int, default=os.cpu_count() or 1, help="runs under valgrind at once")
    parser.add_argument("--repeats", type=int, default=1, help="pairs of runs per variant (the median is shown)")
    parser.add_argument(
        "--variants", nargs="+", choices=VARIANTS, default=list(VARIANTS), help="the variants to run (raw always runs)"
    )
    parser.add_argument(
        "--allocator", choices=("glibc", "jemalloc"), default="glibc", help="malloc of every run (see above)"
    )
    args = parser.parse_args()
    try:
        allocator = allocator_env(args.allocator)
    except FileNotFoundError as exc:
        print(exc, file=sys.stderr)
        return 2
    if shutil.which("valgrind") is None:
        print("valgrind is not installed (apt-get install valgrind); nothing measured", file=sys.stderr)
        return 2
    if args.repeats < 1:
        parser.error("--repeats must be 1 or more")
    variants = ["raw", *(variant for variant in VARIANTS if variant in args.variants and variant != "raw")]
    runs = [(variant, epochs, r) for r in range(args.repeats) for variant in variants for epochs in (SHORT, LONG)]
    with ThreadPoolExecutor(max_workers=max(1, args.jobs)) as pool:
        totals = dict(zip(runs, pool.map(lambda run: count(run[0], run[1], allocator), runs), strict=True))
    pairs = {
        variant: [(totals[variant, SHORT, r], totals[variant, LONG, r]) for r in range(args.repeats)]
        for variant in variants
    }
    steps = {variant: median_per_step(pairs[variant]) for variant in variants}
    raw = steps["raw"]
    what = f"the median of {args.repeats} pairs of runs" if args.repeats > 1 else "one pair of runs"
    print(
        f"instructions per step ({(LONG - SHORT) * STEPS_PER_EPOCH} steps: {LONG} epochs minus {SHORT}; {what}; "
        f"malloc: {args.allocator})"
    )
    for variant, value in steps.items():
        each = sorted(per_step(short_run, long_run) for short_run, long_run in pairs[variant])
        spread = f"   (pairs: {', '.join(f'{v / 1e6:.4f}' for v in each)} M)" if args.repeats > 1 else ""
        print(f"  {variant:18s} {value / 1e6:8.4f} M   x{value / raw:.4f}{spread}")
    if "ember minimal" in steps and "ember defaults" in steps and args.allocator == "glibc":
        minimal, defaults = steps["ember minimal"] / raw, steps["ember defaults"] / raw
        verdict = "meets" if minimal <= 1.03 and defaults <= 1.10 else "misses"
        figures = f"minimal x{minimal:.4f} <= 1.03, defaults x{defaults:.4f} <= 1.10"
        print(f"verdict: {verdict} the goals (in instructions: {figures})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
