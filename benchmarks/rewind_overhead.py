"""Per-step cost of `SpikeGuard` when nothing spikes: the same fit with and without it, side by side.

The tiny MLP of `overhead.py` (32 -> 64 -> 2, batch 32, SGD, one thread, 3 epochs x 256 steps), in two
settings: ember's defaults (logger, progress line, ``self.log``; no checkpoint callback, whose writes would
dominate the difference) and ember minimal (nothing but the loop). Each with the guard off and on (its
defaults: a check every 8 steps, a snapshot every 256). Runs are interleaved, the order rotating each round, and
each guarded run is compared with the unguarded run of its own round (the median of those paired ratios is the
verdict's figure; noise only adds time, so best / best is shown too).

    python benchmarks/rewind_overhead.py                  # full: 20 rounds
    python benchmarks/rewind_overhead.py --short          # CI: 1 round of 1 epoch
    python benchmarks/rewind_overhead.py --instructions   # under valgrind: noise-free (about 10 minutes)
    python benchmarks/rewind_overhead.py --instructions --allocator jemalloc   # steadier heap layout

Wall-clock ratios on a shared machine wander by more than the 1% this measures; ``--instructions`` counts the
instructions each variant executes per step instead, as `overhead_instructions.py` does (a 1-epoch and a 9-epoch
run under cachegrind; the difference over 2048 steps is one step, start-up and set-up cancelled out).

Goal: guard on / guard off <= 1.01 per step, in both settings (docs/rewind.md).
"""

from __future__ import annotations

import argparse
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from overhead import STEPS_PER_EPOCH, LoopClock, Tiny, TinyNoLog, make_loader
from overhead_instructions import LONG, ONE_THREAD, SHORT, allocator_env, instructions

import ember
from ember.callbacks import SpikeGuard

GOAL = 1.01


def run(epochs: int, defaults: bool, guard: bool, root: str) -> float:
    """The training loop's time (first batch to last step) in seconds."""
    clock = LoopClock()
    callbacks: list[ember.Callback] = [clock, SpikeGuard()] if guard else [clock]
    quiet = {} if defaults else {"logger": False, "enable_progress_bar": False, "enable_model_summary": False}
    trainer = ember.Trainer(
        max_epochs=epochs,
        default_root_dir=root,
        num_sanity_val_steps=0,
        callbacks=callbacks,
        enable_checkpointing=False,
        **quiet,  # type: ignore[arg-type]
    )
    trainer.fit(Tiny() if defaults else TinyNoLog(), make_loader())
    return clock.end - clock.start


VARIANTS = ("defaults", "defaults + guard", "minimal", "minimal + guard")


def run_variant(name: str, epochs: int, root: str) -> float:
    return run(epochs, name.startswith("defaults"), name.endswith("guard"), root)


def count(name: str, epochs: int, allocator: dict[str, str] | None = None) -> int:
    """Instructions executed by one run of variant `name` for `epochs` epochs, under cachegrind, with the
    environment `allocator` (`overhead_instructions.allocator_env`) added."""
    command = ["valgrind", "--tool=cachegrind", "--cache-sim=no", "--cachegrind-out-file=/dev/null", sys.executable]
    command += [__file__, "--run", name, "--epochs", str(epochs)]
    env = dict(os.environ, PYTHONHASHSEED="0", **ONE_THREAD, **(allocator or {}))
    done = subprocess.run(command, capture_output=True, text=True, check=False, env=env)
    if done.returncode != 0:
        raise RuntimeError(f"{name!r} under valgrind failed ({done.returncode}):\n{done.stderr[-2000:]}")
    return instructions(done.stderr)


def count_instructions(jobs: int, allocator: dict[str, str] | None = None) -> dict[str, float]:
    """Instructions per step of each variant."""
    runs = [(name, epochs) for name in VARIANTS for epochs in (SHORT, LONG)]
    with ThreadPoolExecutor(max_workers=jobs) as pool:
        totals = dict(zip(runs, pool.map(lambda r: count(*r, allocator), runs), strict=True))
    return {name: (totals[name, LONG] - totals[name, SHORT]) / ((LONG - SHORT) * STEPS_PER_EPOCH) for name in VARIANTS}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--short", action="store_true", help="one round of one epoch (for CI)")
    parser.add_argument("--instructions", action="store_true", help="count instructions under valgrind")
    parser.add_argument("--jobs", type=int, default=2, help="runs under valgrind at once")
    parser.add_argument(
        "--allocator", choices=("glibc", "jemalloc"), default="glibc",
        help="malloc of the --instructions runs: jemalloc's layout varies less from run to run than glibc's",
    )  # fmt: skip
    parser.add_argument("--run", choices=VARIANTS, help="run this variant once, untimed (for --instructions)")
    parser.add_argument("--epochs", type=int, default=3, help="epochs of the --run variant")
    args = parser.parse_args()
    torch.set_num_threads(1)
    if args.run is not None:
        with tempfile.TemporaryDirectory() as root:
            run_variant(args.run, args.epochs, root)
        return
    if args.instructions:
        if shutil.which("valgrind") is None:
            sys.exit("valgrind is not installed (apt-get install valgrind); nothing measured")
        steps = count_instructions(max(1, args.jobs), allocator_env(args.allocator))
        what = f"{(LONG - SHORT) * STEPS_PER_EPOCH} steps: {LONG} epochs minus {SHORT}; malloc: {args.allocator}"
        print(f"instructions per step ({what})")
        for name, value in steps.items():
            print(f"  {name:18s} {value / 1e6:8.4f} M")
        ratios = {base: steps[f"{base} + guard"] / steps[base] for base in ("defaults", "minimal")}
        verdict = "meets" if all(r <= GOAL for r in ratios.values()) else "misses"
        print(
            f"verdict: {verdict} the goal (in instructions: defaults x{ratios['defaults']:.4f} <= {GOAL}, "
            f"minimal x{ratios['minimal']:.4f} <= {GOAL})"
        )
        return
    epochs, repeats = (1, 1) if args.short else (3, 20)
    with tempfile.TemporaryDirectory() as root:
        variants: dict[str, Callable[[], float]] = {
            name: (lambda name=name: run_variant(name, epochs, root)) for name in VARIANTS
        }
        for fn in variants.values():  # warm-up
            fn()
        times: dict[str, list[float]] = {name: [] for name in VARIANTS}
        for round_ in range(repeats):
            names = list(VARIANTS)
            for name in names[round_ % len(names) :] + names[: round_ % len(names)]:
                times[name].append(variants[name]())
    steps = epochs * STEPS_PER_EPOCH
    print(f"{steps} steps per run, {repeats} rounds; per-step time (best, median), best / best, median paired ratio")
    ratios: dict[str, float] = {}
    for base in ("defaults", "minimal"):
        off, on = times[base], times[f"{base} + guard"]
        ratios[base] = statistics.median(b / a for a, b in zip(off, on, strict=True))
        for name, values in ((base, off), (f"{base} + guard", on)):
            best, median = min(values) / steps * 1e6, statistics.median(values) / steps * 1e6
            print(f"  {name:18s} {best:7.1f} us  {median:7.1f} us")
        print(f"  guard on / off ({base}): x{min(on) / min(off):.4f} best / best, x{ratios[base]:.4f} paired median")
    verdict = "meets" if all(r <= GOAL for r in ratios.values()) else "misses"
    if repeats == 1:
        verdict = "none (one repeat measures noise; run without --short for a verdict) for"
    print(
        f"verdict: {verdict} the goal (paired: defaults x{ratios['defaults']:.4f} <= {GOAL}, "
        f"minimal x{ratios['minimal']:.4f} <= {GOAL})"
    )


if __name__ == "__main__":
    main()
