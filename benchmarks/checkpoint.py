"""Checkpoint cost: ember's save against plain torch.save, and the training stall of an async save.

A ~100M-parameter model (6 x Linear(4096, 4096)) with AdamW state after one
step (about 1.2 GB of tensors) is saved to the same disk, side by side in one
process, each measurement repeated and the best kept (noise only adds time):

- save time: ``trainer.save_checkpoint(path)`` (DCP shards + ember.pt +
  rank-0.pt, fsynced, renamed into place) against ``torch.save`` of the module
  and optimizer state dicts, once plain (the goal's baseline: returns when the
  bytes are in the page cache) and once followed by fsync (the same durability
  as ember).
- training stall: inside ``fit``, an async save at a step boundary, once it is
  written a second one (the steady state of periodic saves: the snapshot buffers
  of the first are reused), then a sync save. The stall is how much longer the
  second async save's boundary took than an ordinary one (the snapshot copy the
  loop waits for; the first one's, with fresh buffers, is shown beside it); the
  sync save time is the same for the sync save. Step times while the background
  write is in flight are shown beside step times without one.

    python benchmarks/checkpoint.py            # full: ~100M parameters, 3 repeats
    python benchmarks/checkpoint.py --short    # CI: ~3M parameters, 1 repeat

Goals: ember save / torch.save <= 1.25; async stall / sync save time <= 0.10.
"""

from __future__ import annotations

import argparse
import os
import shutil
import statistics
import sys
import tempfile
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
import ember
from ember import checkpoint as ckpt
from ember.checkpoint import writing

BATCH = 8


class Stack(ember.TrainingModule):
    def __init__(self, width: int, depth: int) -> None:
        super().__init__()
        layers: list[nn.Module] = []
        for _ in range(depth):
            layers += [nn.Linear(width, width), nn.ReLU()]
        self.model = nn.Sequential(*layers[:-1])
        self.loss_fn = nn.MSELoss()

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.AdamW(self.parameters(), lr=1e-4)


def make_loader(width: int, batches: int) -> DataLoader:
    g = torch.Generator().manual_seed(0)
    x, y = torch.randn(batches * BATCH, width, generator=g), torch.randn(batches * BATCH, width, generator=g)
    return DataLoader(TensorDataset(x, y), batch_size=BATCH)


def quiet_trainer(**kwargs: Any) -> ember.Trainer:
    return ember.Trainer(
        logger=False, enable_progress_bar=False, enable_model_summary=False, enable_checkpointing=False, **kwargs
    )


# --- save time ----------------------------------------------------------------------------------------------------


def timed(fn: Callable[[], Any]) -> float:
    start = time.perf_counter()
    fn()
    return time.perf_counter() - start


def torch_save(state: dict[str, Any], path: Path, fsync: bool) -> None:
    with open(path, "wb") as f:
        torch.save(state, f)
        if fsync:
            f.flush()
            os.fsync(f.fileno())


def remove(path: Path) -> None:
    if path.is_dir():
        shutil.rmtree(path)
    elif path.exists():
        path.unlink()


def measure_saves(trainer: ember.Trainer, module: Stack, root: Path, repeats: int) -> dict[str, list[float]]:
    state = {"module": module.state_dict(), "optimizer": trainer.optimizers[0].state_dict()}
    variants: dict[str, Callable[[Path], Any]] = {
        "ember": lambda p: trainer.save_checkpoint(p),
        "torch.save": lambda p: torch_save(state, p, fsync=False),
        "torch.save+fsync": lambda p: torch_save(state, p, fsync=True),
    }
    times: dict[str, list[float]] = {name: [] for name in variants}
    for rep in range(repeats):  # interleaved, so machine noise hits every variant alike
        for name, save in variants.items():
            path = root / f"{name}-{rep}"
            times[name].append(timed(lambda save=save, path=path: save(path)))
            remove(path)
    return times


# --- the stall of an async save inside fit -------------------------------------------------------------------------


@dataclass
class Writes:
    """Learns when each checkpoint write started (its files begin, `ember.checkpoint.stage_checkpoint`) and
    ended (it is in place, `StagedCheckpoint.finish`): on the writer thread for an async save; for a sync
    save inside fit, the files on the loop's thread and the fsyncs and rename on a background one."""

    spans: dict[str, tuple[float, float]] = field(default_factory=dict)
    starts: dict[str, float] = field(default_factory=dict)
    lock: threading.Lock = field(default_factory=threading.Lock)

    def install(self) -> Callable[[], None]:
        stage, finish = writing.stage_checkpoint, ckpt.StagedCheckpoint.finish

        def logged_stage(path: Path, *args: Any, **kwargs: Any) -> ckpt.StagedCheckpoint:
            with self.lock:
                self.starts[Path(path).name] = time.perf_counter()
            return stage(path, *args, **kwargs)

        def logged_finish(staged: ckpt.StagedCheckpoint) -> Path:
            try:
                return finish(staged)
            finally:
                with self.lock:
                    self.spans[staged.path.name] = (self.starts[staged.path.name], time.perf_counter())

        writing.stage_checkpoint = logged_stage  # type: ignore[assignment]
        ckpt.StagedCheckpoint.finish = logged_finish  # type: ignore[method-assign]

        def uninstall() -> None:
            writing.stage_checkpoint = stage  # type: ignore[assignment]
            ckpt.StagedCheckpoint.finish = finish  # type: ignore[method-assign]

        return uninstall


class StallProbe(ember.Callback):
    """After `warmup` steps, three saves, each once the previous one is written and `settle` steps later:
    an async save (its snapshot buffers are new), a second async save (they are reused: the steady state
    of periodic saves) and a sync save; then stop."""

    PLAN = (("async", True), ("async2", True), ("sync", False))

    def __init__(self, root: Path, writes: Writes, warmup: int = 3, settle: int = 2) -> None:
        self.root, self.writes, self.warmup, self.settle = root, writes, warmup, settle
        self.steps: list[tuple[float, float]] = []
        self.after: dict[str, int] = {}  # save name -> index of the step before its boundary
        self._next_due: int | None = warmup
        self._start = 0.0

    def on_train_batch_start(self, trainer: Any, module: Any, batch: Any, batch_idx: int) -> None:
        self._start = time.perf_counter()

    def on_train_batch_end(self, trainer: Any, module: Any, outputs: Any, batch: Any, batch_idx: int) -> None:
        self.steps.append((self._start, time.perf_counter()))
        n = len(self.steps)
        done = len(self.after)
        if done and self._next_due is None and self.PLAN[done - 1][0] in self.writes.spans:
            self._next_due = n + self.settle  # the previous save is written: the next one after settling
        if n == self._next_due:
            if done == len(self.PLAN):
                trainer.should_stop = True
                return
            name, async_save = self.PLAN[done]
            trainer.save_checkpoint(self.root / name, async_save=async_save)
            self.after[name] = n - 1
            self._next_due = None


@dataclass
class Stall:
    first_stall_s: float  # extra time of the boundary that started the first async save (new buffers)
    stall_s: float  # ... of the second async save (reused buffers)
    sync_s: float  # extra time of the boundary that ran the sync save
    write_s: float  # the second background write
    step_quiet_s: float
    step_during_s: float
    extra_while_writing_s: float  # loop time while writing, beyond the same number of write-free periods


def measure_stall(width: int, depth: int, root: Path) -> Stall:
    writes = Writes()
    uninstall = writes.install()
    probe = StallProbe(root, writes)
    try:
        torch.manual_seed(0)
        # The probe stops the run once the three saves are done; the background writer runs at the lowest CPU
        # priority, so how many steps that takes depends on how busy the loop keeps the cores.
        trainer = quiet_trainer(max_steps=20_000, max_time={"minutes": 10}, callbacks=[probe])
        trainer.fit(Stack(width, depth), make_loader(width, 100))
    finally:
        uninstall()
    assert len(probe.after) == len(probe.PLAN), "the run stopped before every save"
    steps = probe.steps
    gaps = [steps[i + 1][0] - steps[i][1] for i in range(len(steps) - 1)]  # boundary + data loading
    a1, a, s = probe.after["async"], probe.after["async2"], probe.after["sync"]
    usual_gap = statistics.median(g for i, g in enumerate(gaps) if i not in (a1, a, s))
    busy: set[int] = set()
    for name in ("async", "async2"):
        w_start, w_end = writes.spans[name]
        busy |= {i for i, (st, en) in enumerate(steps) if st < w_end and en > w_start}
    w_start, w_end = writes.spans["async2"]
    overlapping = [i for i, (st, en) in enumerate(steps) if st < w_end and en > w_start]
    quiet = [i for i in range(1, len(steps)) if i not in busy and i - 1 not in (a1, a, s)]
    step_quiet = statistics.median(steps[i][1] - steps[i][0] for i in quiet)
    step_during = statistics.median(steps[i][1] - steps[i][0] for i in overlapping) if overlapping else step_quiet
    period = step_quiet + usual_gap
    inside = [i for i in overlapping if steps[i][1] <= w_end]  # whole periods that ended inside the write
    extra = (steps[inside[-1]][1] - steps[a][1]) - len(inside) * period if inside else gaps[a] - usual_gap
    for name, _ in probe.PLAN:
        remove(root / name)
    return Stall(
        gaps[a1] - usual_gap, gaps[a] - usual_gap, gaps[s] - usual_gap, w_end - w_start, step_quiet, step_during, extra
    )


# --- report ---------------------------------------------------------------------------------------------------------


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--short", action="store_true", help="a ~3M-parameter model, one repeat (for CI)")
    parser.add_argument("--dir", default=None, help="where to write (default: the system temp directory)")
    args = parser.parse_args()
    width, depth, repeats = (1024, 3, 1) if args.short else (4096, 6, 3)

    with tempfile.TemporaryDirectory(dir=args.dir, prefix="ember-ckpt-bench-") as tmp:
        root = Path(tmp)
        torch.manual_seed(0)
        module = Stack(width, depth)
        trainer = quiet_trainer(max_steps=1)
        trainer.fit(module, make_loader(width, 1))  # one AdamW step: the optimizer state exists
        n_params = sum(p.numel() for p in module.parameters())
        _, tensors = ckpt.split_tensors({"m": module.state_dict(), "o": trainer.optimizers[0].state_dict()})
        n_bytes = sum(t.numel() * t.element_size() for t in tensors.values())
        print(
            f"model: {depth} x Linear({width}, {width}) = {n_params / 1e6:.1f}M parameters; with AdamW state "
            f"{n_bytes / 1e9:.2f} GB of tensors; {torch.get_num_threads()} torch threads; writing to {root}"
        )
        saves = measure_saves(trainer, module, root, repeats)
        del trainer, module, tensors
        stalls = [measure_stall(width, depth, root) for _ in range(repeats)]

    best = {name: min(values) for name, values in saves.items()}
    save_ratio = best["ember"] / best["torch.save"]
    print(f"save time, best of {repeats} (median):")
    for name, values in saves.items():
        median = statistics.median(values)
        print(f"  {name:17s} {best[name]:7.2f} s ({median:.2f} s)  x{best[name] / best['torch.save']:.2f} torch.save")
    print(
        f"  ember / torch.save = {save_ratio:.2f} (goal <= 1.25); "
        f"ember / (torch.save + fsync) = {best['ember'] / best['torch.save+fsync']:.2f}"
    )

    stall = min(st.stall_s for st in stalls)
    sync = min(st.sync_s for st in stalls)
    stall_ratio = stall / sync
    print(f"async save inside fit, best of {repeats}:")
    for i, st in enumerate(stalls):
        print(
            f"  run {i}: stall {st.stall_s:.3f} s (first async save {st.first_stall_s:.3f} s), "
            f"sync save {st.sync_s:.2f} s, background write {st.write_s:.2f} s; "
            f"step {st.step_quiet_s:.3f} s without a write, {st.step_during_s:.3f} s during it "
            f"(x{st.step_during_s / st.step_quiet_s:.2f}); extra loop time while writing (stall included) "
            f"{st.extra_while_writing_s:.2f} s"
        )
    print(f"  stall / sync save = {stall:.3f} s / {sync:.2f} s = {stall_ratio:.3f} (goal <= 0.10)")
    ok_save, ok_stall = save_ratio <= 1.25, stall_ratio <= 0.10
    if args.short:
        print("(--short: a small model; the goals are meant for the full ~100M-parameter run)")
    verdict = "meets" if ok_save and ok_stall else "misses"
    if repeats == 1:  # one lucky or unlucky run decides nothing
        verdict = "none (one repeat measures noise; run without --short for a verdict) for"
    print(
        f"verdict: {verdict} the goals "
        f"(save / torch.save x{save_ratio:.2f} <= 1.25{'' if ok_save else ' missed'}, "
        f"async stall / sync save x{stall_ratio:.3f} <= 0.10{'' if ok_stall else ' missed'})"
    )


if __name__ == "__main__":
    main()
