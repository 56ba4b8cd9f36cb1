"""Per-step cost of the progress displays, measured side by side on the tiny model of `overhead.py`.

Tiny MLP (32 -> 64 -> 2), batch 32, SGD, one thread, 3 epochs x 256 steps, no
loggers, checkpoints or summary, so the display is the only difference. Runs
are interleaved (no display, plain lines, rich bars, repeated) and the ratio
uses the best of the repeats per variant, with the median beside it. Times are
the process's CPU time (one thread), so other work on a busy machine does not
blur them. The rich
bar draws to a forced terminal writing to /dev/null at its default 10 Hz, so
the drawing cost is real.

    python benchmarks/progress_overhead.py            # 10 repeats
    python benchmarks/progress_overhead.py --short    # CI: 1 repeat of 1 epoch

Goal: each display adds less than 5% to the step time (ratio <= 1.05).
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))
from overhead import STEPS_PER_EPOCH, Tiny, make_loader

import ember
from ember.callbacks import ProgressLine, RichProgressBar


def run(epochs: int, display: ember.Callback | None) -> float:
    trainer = ember.Trainer(
        max_epochs=epochs,
        logger=False,
        enable_model_summary=False,
        enable_checkpointing=False,
        enable_progress_bar=display is not None,
        callbacks=[display] if display is not None else None,
    )
    module, loader = Tiny(), make_loader()
    start = time.process_time()  # this process's CPU time: other processes on a busy machine do not count
    trainer.fit(module, loader)
    return time.process_time() - start


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--short", action="store_true", help="one repeat of one epoch (for CI)")
    args = parser.parse_args()
    torch.set_num_threads(1)
    epochs, repeats = (1, 1) if args.short else (3, 10)
    from rich.console import Console

    with open(os.devnull, "w") as devnull:
        terminal = Console(file=devnull, force_terminal=True, width=120)
        bars: list[RichProgressBar] = []

        def rich_run() -> float:
            bars.append(RichProgressBar(console=terminal))
            return run(epochs, bars[-1])

        variants: dict[str, Callable[[], float]] = {
            "no display": lambda: run(epochs, None),
            "ProgressLine": lambda: run(epochs, ProgressLine(stream=devnull)),
            "RichProgressBar": rich_run,
        }
        for fn in variants.values():  # warm-up: first-call costs (imports, allocator) out of the timing
            fn()
        times: dict[str, list[float]] = {name: [] for name in variants}
        for _ in range(repeats):
            for name, fn in variants.items():
                times[name].append(fn())
    steps = epochs * STEPS_PER_EPOCH
    best = {name: min(values) for name, values in times.items()}
    print(f"{steps} steps per run, {repeats} runs each; per-step time (best, median) and best / no display")
    for name, values in times.items():
        ratio = best[name] / best["no display"]
        median = statistics.median(values)
        print(f"  {name:16s} {best[name] / steps * 1e6:7.1f} us  {median / steps * 1e6:7.1f} us   x{ratio:.3f}")
    per_run = [bar.refresh_count for bar in bars[1:]]
    print(f"RichProgressBar redraws per run: {min(per_run)}-{max(per_run)} (10 per second plus the first and last)")
    worst = max(best["ProgressLine"], best["RichProgressBar"]) / best["no display"]
    verdict = "meets" if worst <= 1.05 else "misses"
    if repeats == 1:  # one lucky or unlucky run decides nothing
        verdict = "none (one repeat measures noise; run without --short for a verdict) for"
    print(f"verdict: {verdict} the goal (worst display x{worst:.3f} <= 1.05)")


if __name__ == "__main__":
    main()
