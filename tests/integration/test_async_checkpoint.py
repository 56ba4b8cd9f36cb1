"""Async checkpoint saves: same bytes as a sync save, training goes on meanwhile, errors reach the caller.

The big-model tests train ``nn.Linear(8192, 8192)`` (256 MiB of fp32 weights,
as much again for gradients and for the snapshot an async save copies), one
run at a time, so the peak stays near 1 GiB. The check that the loop goes on
during a write trains ``nn.Linear(4096, 4096)``: a step and a write both scale
with the weights, so a quarter of the work keeps their proportion.

Timing is measured inside one run, side by side: step times while the
background write is in flight against step times of the same run with no
write in flight, for three async saves in a row; all are printed, and the
best of the three is asserted to be within 10% by a `perf` test (deselected
by default: on a busy machine the ratio is the machine's). The step uses both cores of
the 2-core machine; the writer runs at the lowest CPU priority, so it takes
what the step leaves (its write takes longer instead).

An async save asked for after ``fit`` must still be written when the script
ends right away (the writer thread is a daemon).
"""

from __future__ import annotations

import itertools
import statistics
import subprocess
import sys
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed.checkpoint as dcp
import torch.nn.functional as F
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from ember import Callback, Trainer, TrainingModule, seed_everything
from ember import checkpoint as ckpt
from ember.callbacks.model_checkpoint import ModelCheckpoint
from ember.checkpoint import dcp_writer
from ember.checkpoint import registry as state

pytestmark = pytest.mark.slow

QUIET: dict[str, Any] = dict(
    logger=False, enable_progress_bar=False, enable_model_summary=False, enable_checkpointing=False
)
BIG = 8192
#: the model of the checks that steps go on during a write and that an async save equals a sync one (the timing
#: goal keeps `BIG`)
MEDIUM = 4096


class Linear(TrainingModule):
    def __init__(self, features: int) -> None:
        super().__init__()
        self.layer = nn.Linear(features, features)

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        x, y = batch
        return F.mse_loss(self.layer(x), y)

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.parameters(), lr=1e-3)


def loader(features: int, batches: int = 16, batch_size: int = 4) -> DataLoader:
    g = torch.Generator().manual_seed(0)
    x = torch.randn(batches * batch_size, features, generator=g)
    y = torch.randn(batches * batch_size, features, generator=g)
    return DataLoader(TensorDataset(x, y), batch_size=batch_size, shuffle=True, generator=g)


@dataclass
class Write:
    path: Path
    thread: str
    start: float
    end: float = float("nan")
    error: BaseException | None = None


@dataclass
class WriteLog:
    """Wraps the trainer's checkpoint writes: when each write ran, on which thread, how many at once."""

    delay_s: float = 0.0
    writes: list[Write] = field(default_factory=list)
    active: int = 0
    max_active: int = 0
    lock: threading.Lock = field(default_factory=threading.Lock)

    def install(self, monkeypatch: pytest.MonkeyPatch) -> WriteLog:
        """Wrap both ways the trainer writes: `state.write` (async and complete saves) and `state.stage`
        (a save inside fit in one process, whose files are written on the calling thread)."""
        for name in ("write", "stage"):
            monkeypatch.setattr(state, name, self._logged(getattr(state, name)))
        return self

    def _logged(self, original: Any) -> Any:
        def write(path: Path, *args: Any, **kwargs: Any) -> Any:
            record = Write(Path(path), threading.current_thread().name, time.perf_counter())
            with self.lock:
                self.writes.append(record)
                self.active += 1
                self.max_active = max(self.max_active, self.active)
            try:
                time.sleep(self.delay_s)
                return original(path, *args, **kwargs)
            except BaseException as exc:
                record.error = exc
                raise
            finally:
                record.end = time.perf_counter()
                with self.lock:
                    self.active -= 1

        return write

    def finished(self, path: Path) -> bool:
        return any(w.path == path and w.end == w.end for w in self.writes)  # end is NaN until done

    def of(self, path: Path) -> Write:
        (found,) = [w for w in self.writes if w.path == path]
        return found


def fail_dcp_writes(monkeypatch: pytest.MonkeyPatch) -> None:
    """Every tensor write fails: DCP's (several processes, large states) and ember's one-process writer."""

    def write_data(self: Any, plan: Any, planner: Any) -> Any:
        raise OSError(28, "No space left on device")

    def write_tensors(directory: Path, tensors: Any, fsync: bool = True) -> None:
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(dcp.FileSystemWriter, "write_data", write_data)
    monkeypatch.setattr(dcp_writer, "write_tensors", write_tensors)


class SaveAt(Callback):
    def __init__(self, step: int, path: Path, async_save: bool) -> None:
        self.step, self.path, self.async_save = step, path, async_save

    def on_train_batch_end(self, trainer: Any, module: Any, outputs: Any, batch: Any, batch_idx: int) -> None:
        if trainer.global_step == self.step:
            trainer.save_checkpoint(self.path, async_save=self.async_save)


def deep_equal(a: Any, b: Any) -> bool:
    if isinstance(a, torch.Tensor) or isinstance(b, torch.Tensor):
        return isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor) and a.dtype == b.dtype and torch.equal(a, b)
    if isinstance(a, dict):
        return isinstance(b, dict) and a.keys() == b.keys() and all(deep_equal(a[k], b[k]) for k in a)
    if isinstance(a, (list, tuple)):
        return type(a) is type(b) and len(a) == len(b) and all(deep_equal(x, y) for x, y in zip(a, b, strict=True))
    return bool(a == b)


# --- 1. the async checkpoint equals a sync one --------------------------------------------------------------


def test_async_save_equals_sync_save_bitwise(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Two identical runs save at step 2, one async and one sync; training goes on to step 5 meanwhile."""
    log = WriteLog().install(monkeypatch)
    final: dict[str, torch.Tensor] = {}
    for mode in ("async", "sync"):
        seed_everything(0)
        module = Linear(MEDIUM)  # 64 MiB of weights: the write is still in flight while the next steps run
        trainer = Trainer(max_steps=5, callbacks=[SaveAt(2, tmp_path / mode, mode == "async")], **QUIET)
        trainer.fit(module, loader(MEDIUM))
        final[mode] = module.layer.weight.detach().clone()
        del module, trainer
    assert log.of(tmp_path / "async").thread != threading.current_thread().name
    assert log.of(tmp_path / "sync").thread == threading.current_thread().name
    assert torch.equal(final["async"], final["sync"])  # the runs agree, so step 2 was the same state in both

    a, s = ckpt.read_tensors(tmp_path / "async"), ckpt.read_tensors(tmp_path / "sync")
    assert a.keys() == s.keys() and "/module/layer.weight" in a
    for key in a:
        assert a[key].dtype == s[key].dtype and torch.equal(a[key], s[key]), key
    assert not torch.equal(a["/module/layer.weight"], final["async"])  # the snapshot predates 3 more steps
    del a, s
    assert deep_equal(ckpt.read_meta(tmp_path / "async"), ckpt.read_meta(tmp_path / "sync"))
    assert deep_equal(ckpt.read_rank_meta(tmp_path / "async"), ckpt.read_rank_meta(tmp_path / "sync"))
    shards = sorted(p.name for p in (tmp_path / "sync").glob("*.distcp"))
    assert shards == sorted(p.name for p in (tmp_path / "async").glob("*.distcp")) and shards
    for name in (*shards, "ember.pt", "rank-0.pt"):  # bitwise, file by file
        assert (tmp_path / "async" / name).read_bytes() == (tmp_path / "sync" / name).read_bytes(), name


# --- 2. the training loop is not blocked by the write ------------------------------------------------------


class Timeline(Callback):
    """Times every step; runs `trials` async saves one after another (each after a few write-free steps),
    then one sync save, then stops."""

    def __init__(self, directory: Path, log: WriteLog, trials: int = 3, warmup: int = 5, settle: int = 3) -> None:
        self.directory, self.log, self.trials, self.settle = directory, log, trials, settle
        self.steps: list[tuple[float, float]] = []  # (start, end) of every training batch
        self.saved_after: list[int] = []  # index of the step at whose boundary each async save began
        self.sync_after: int | None = None
        self._next_save: int | None = warmup
        self._start = 0.0

    def path(self, trial: int) -> Path:
        return self.directory / f"async-{trial}"

    def on_train_batch_start(self, trainer: Any, module: Any, batch: Any, batch_idx: int) -> None:
        self._start = time.perf_counter()

    def on_train_batch_end(self, trainer: Any, module: Any, outputs: Any, batch: Any, batch_idx: int) -> None:
        self.steps.append((self._start, time.perf_counter()))
        n = len(self.steps)
        if self.sync_after is not None:
            trainer.should_stop = n > self.sync_after + self.settle
        elif n == self._next_save and len(self.saved_after) < self.trials:
            trainer.save_checkpoint(self.path(len(self.saved_after)), async_save=True)
            self.saved_after.append(n - 1)
            self._next_save = None
        elif n == self._next_save:
            trainer.save_checkpoint(self.directory / "sync")
            self.sync_after = n - 1
        elif self._next_save is None and self.log.finished(self.path(len(self.saved_after) - 1)):
            self._next_save = n + self.settle


@dataclass
class AsyncTrials:
    """What `run_async_trials` measured: per async save, the step-time ratio during its write and the loop's stall."""

    ratios: list[float]
    stalls: list[float]
    ended: list[int]  # steps that ended while each write was in flight
    sync_s: float


def run_async_trials(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, features: int = BIG) -> AsyncTrials:
    """3 async saves of a `features`-wide model (the big one unless told), then a sync one; checks that each
    write ran beside the loop (on another thread, the next step starting before it ended) and measures how the
    steps fared meanwhile."""
    log = WriteLog().install(monkeypatch)
    timeline = Timeline(tmp_path, log)
    seed_everything(0)
    trainer = Trainer(max_steps=400, callbacks=[timeline], **QUIET)
    trainer.fit(Linear(features), loader(features))
    assert timeline.sync_after is not None, "the async writes did not finish within 400 steps"

    steps, main = timeline.steps, threading.current_thread().name
    windows = [(w.start, w.end) for w in log.writes]

    def quiet(i: int) -> bool:  # a step with no write in flight (the first one warms up)
        return i > 0 and all(steps[i][1] < a or steps[i][0] > b for a, b in windows)

    sync = log.of(tmp_path / "sync")
    sync_s = sync.end - sync.start
    usual_gap = statistics.median(steps[i + 1][0] - steps[i][1] for i in range(1, timeline.saved_after[0]))
    ratios, stalls, ended, lines = [], [], [], []
    for trial, saved in enumerate(timeline.saved_after):
        write = log.of(timeline.path(trial))
        assert write.thread != main and write.error is None
        next_start = steps[saved + 1][0]
        assert next_start < write.end, f"trial {trial}: the loop waited for the background write"
        ended_during = [i for i, (s, e) in enumerate(steps) if write.start < e < write.end]
        during = [e - s for s, e in steps if s >= write.start and e <= write.end]
        overlapping = [e - s for s, e in steps if s < write.end and e > write.start]
        before = [i for i in range(saved + 1) if quiet(i)][-3:]
        after = [i for i in range(saved + 1, len(steps)) if quiet(i)][:3]
        step_quiet = statistics.median(steps[i][1] - steps[i][0] for i in before + after)
        ratio = statistics.median(during or overlapping) / step_quiet
        stall = next_start - steps[saved][1] - usual_gap
        ratios.append(ratio)
        stalls.append(stall)
        ended.append(len(ended_during))
        lines.append(
            f"trial {trial}: write {write.end - write.start:.2f} s, {len(ended_during)} steps ended during it; "
            f"step {statistics.median(during or overlapping) * 1e3:.0f} ms during vs {step_quiet * 1e3:.0f} ms "
            f"without a write (ratio {ratio:.2f}); loop stall {stall * 1e3:.0f} ms = {stall / sync_s:.2f} x sync save"
        )
        ckpt.check_complete(write.path)
    print("\n" + "\n".join(lines) + f"\nsync save {sync_s * 1e3:.0f} ms; best step-time ratio {min(ratios):.2f}")
    return AsyncTrials(ratios, stalls, ended, sync_s)


def test_training_continues_during_async_write(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Each of 3 async saves: the loop goes on at once, and steps complete while the write is in flight."""
    trials = run_async_trials(tmp_path, monkeypatch, features=MEDIUM)
    assert sum(trials.ended) >= 1, "no training step completed while an async write was in flight"
    assert min(trials.stalls) < trials.sync_s, "the async save blocked the loop as long as a sync save"


@pytest.mark.perf
def test_steps_keep_their_pace_during_async_write(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The goal: steps during the write within 10% of steps without one, for the best of 3 (the writer runs at
    the lowest CPU priority; measured 0.98-1.03 here, 1.03-1.08 with a CPU-bound process beside it)."""
    ratios = run_async_trials(tmp_path, monkeypatch).ratios
    assert min(ratios) <= 1.10, f"steps during the async writes took {min(ratios):.2f}x (best of 3) as long as without"


# --- 3. a failed background write is raised, not swallowed -------------------------------------------------


def small() -> tuple[Linear, DataLoader]:
    seed_everything(0)
    return Linear(4), loader(4, batches=8)


def no_temp_dirs(directory: Path) -> bool:
    return not [p for p in directory.iterdir() if p.name.startswith(".")]


def test_failed_background_write_is_raised_at_end_of_fit(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    log = WriteLog().install(monkeypatch)
    fail_dcp_writes(monkeypatch)
    module, data = small()
    trainer = Trainer(max_steps=4, callbacks=[SaveAt(2, tmp_path / "ckpt", async_save=True)], **QUIET)
    with pytest.raises(RuntimeError, match="background checkpoint write failed") as info:
        trainer.fit(module, data)
    assert "No space left on device" in str(info.value)
    assert log.of(tmp_path / "ckpt").error is not None and log.of(tmp_path / "ckpt").thread != "MainThread"
    assert trainer.global_step == 4  # reported when fit ended, after the remaining steps
    assert not (tmp_path / "ckpt").exists() and no_temp_dirs(tmp_path)


def test_failed_background_write_is_raised_at_next_save(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    WriteLog().install(monkeypatch)
    fail_dcp_writes(monkeypatch)
    module, data = small()
    saver = ModelCheckpoint(tmp_path / "ckpts", every_n_train_steps=2, save_top_k=-1, async_save=True)
    trainer = Trainer(max_steps=8, callbacks=[saver], **QUIET)
    with pytest.raises(RuntimeError, match="background checkpoint write failed") as info:
        trainer.fit(module, data)
    assert "No space left on device" in str(info.value)
    assert trainer.global_step == 4, "the error of step 2's write should stop the run at the next save (step 4)"
    directory = tmp_path / "ckpts"
    assert not directory.exists() or (list(directory.iterdir()) == [])  # no checkpoint, no `last`, no temp dir


def test_failed_background_write_outside_fit(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    module, data = small()
    trainer = Trainer(max_steps=2, **QUIET)
    trainer.fit(module, data)
    with monkeypatch.context() as patch:
        fail_dcp_writes(patch)
        trainer.save_checkpoint(tmp_path / "a", async_save=True)  # fails in the background
        with pytest.raises(RuntimeError, match="No space left on device"):
            trainer.save_checkpoint(tmp_path / "b")
    assert not (tmp_path / "a").exists() and not (tmp_path / "b").exists() and no_temp_dirs(tmp_path)
    trainer.save_checkpoint(tmp_path / "b")  # reported once; the next save works
    ckpt.check_complete(tmp_path / "b")


# --- 4. at most one write in flight ------------------------------------------------------------------------


def test_at_most_one_write_in_flight(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    log = WriteLog(delay_s=0.15).install(monkeypatch)  # writes much slower than steps
    module, data = small()
    directory = tmp_path / "ckpts"
    saver = ModelCheckpoint(directory, every_n_train_steps=1, save_top_k=-1, async_save=True)
    trainer = Trainer(max_steps=6, callbacks=[saver], **QUIET)
    trainer.fit(module, data)

    assert len(log.writes) == 6
    assert log.max_active == 1
    assert all(w.thread != threading.current_thread().name for w in log.writes)
    ordered = sorted(log.writes, key=lambda w: w.start)
    for before, after in itertools.pairwise(ordered):
        assert after.start >= before.end, f"{after.path.name} started before {before.path.name} was written"
    # fit returned only after the last write: every checkpoint is complete and `last` names the newest
    assert {p.name for p in directory.iterdir() if p.is_dir()} == {f"epoch=0-step={s}" for s in range(1, 7)}
    for path in ckpt.checkpoints_in(directory):
        ckpt.check_complete(path)
    assert (directory / "last").read_text().strip() == "epoch=0-step=6"


# --- 5. an async save still in flight when the process exits -----------------------------------------------

EXIT_SCRIPT = """
import sys, time
import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset
import ember
from ember.checkpoint import writing

original = writing.write_checkpoint
def slow_disk(*args, **kwargs):
    time.sleep(0.5)
    return original(*args, **kwargs)
writing.write_checkpoint = slow_disk

class Net(ember.TrainingModule):
    def __init__(self):
        super().__init__()
        self.model, self.loss_fn = nn.Linear(4, 1), nn.MSELoss()
    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.1)

data = DataLoader(TensorDataset(torch.randn(8, 4), torch.randn(8, 1)), batch_size=4)
trainer = ember.Trainer(max_epochs=1, logger=False, enable_progress_bar=False, enable_model_summary=False,
                        enable_checkpointing=False)
trainer.fit(Net(), data)
trainer.save_checkpoint(sys.argv[1], async_save=True)  # after fit: nothing in ember waits for it
"""


def test_async_save_in_flight_at_exit_is_completed(tmp_path: Path) -> None:
    """The script ends right after an async save: the write finishes (or its error is printed), never vanishes."""
    target = tmp_path / "final"
    done = subprocess.run(
        [sys.executable, "-c", EXIT_SCRIPT, str(target)], capture_output=True, text=True, timeout=120, cwd=tmp_path
    )
    assert done.returncode == 0, done.stderr
    assert target.is_dir(), "the async save was lost when the interpreter exited (daemon writer thread killed)"
    ckpt.check_complete(target)
    assert not [p for p in tmp_path.iterdir() if p.name.startswith(".")]


def test_periodic_async_saves_reuse_their_snapshot_buffers(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Every async save copies into the buffers of the previous one (its write has finished by then), and
    each checkpoint still holds the weights of its own step; fit frees the buffers when it ends."""
    from ember.checkpoint import registry as state

    copies: list[dict[str, torch.Tensor]] = []
    original = state.gather

    def gather(*args: Any, **kwargs: Any) -> Any:
        snapshot = original(*args, **kwargs)
        copies.append(dict(snapshot.tensors))
        return snapshot

    monkeypatch.setattr(state, "gather", gather)

    class Every2(Callback):
        def __init__(self) -> None:
            self.live: dict[int, torch.Tensor] = {}

        def on_train_batch_end(self, trainer: Any, module: Any, outputs: Any, batch: Any, batch_idx: int) -> None:
            if trainer.global_step % 2 == 0:
                self.live[trainer.global_step] = module.layer.weight.detach().clone()
                trainer.save_checkpoint(tmp_path / f"step{trainer.global_step}", async_save=True)

    seed_everything(0)
    saver = Every2()
    trainer = Trainer(max_steps=6, callbacks=[saver], **QUIET)
    trainer.fit(Linear(64), loader(64))
    assert len(copies) == 3
    weight = "/module/layer.weight"
    pointers = {c[weight].data_ptr() for c in copies}
    assert len(pointers) == 1, "the second and third snapshots did not reuse the first one's buffers"
    for step, live in saver.live.items():
        saved = ckpt.read_module_state(tmp_path / f"step{step}")[1]["layer.weight"]
        assert torch.equal(saved, live), f"checkpoint of step {step}"
    assert trainer.checkpoints._staging == {}, "fit kept the snapshot buffers after it ended"
