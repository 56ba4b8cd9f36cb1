"""`SpikeGuard`: when the training loss spikes or goes non-finite, go back to a good state, leave out the
offending batches, and go on, on the record (docs/rewind.md).

The detector reads every training batch's loss, but never on the host per step: the losses (detached tensors)
are kept in a list, and every ``check_every_n_steps`` optimizer steps (and at an epoch's last step) they are
checked together, with one host sync. A check flags a batch whose loss is inf or NaN, or (once ``warmup_steps``
steps before its own were checked) above ``factor`` times the median of the ``window`` losses before it. The
losses of a check are judged in order, each as if checked alone, so the interval changes when a spike is found
(it lags by at most ``check_every_n_steps - 1`` steps), not what is found. Under data parallelism the
losses are averaged over the processes before the check (the loss of the global batch), so every process
reaches the same decision from the same numbers.

The good state is a rolling in-memory snapshot (``trainer.snapshot``: model, optimizers, schedulers, precision
scaler, progress, random streams and data position, copied to host memory into the same buffers each time, so
one snapshot's worth of memory): taken at the start of the first epoch and then every ``snapshot_every_n_steps``
steps, right after a check found those steps clean. On a spike the guard asks the trainer to rewind to it
(``trainer.rewind``), leaving out the batches from the snapshot's position through the spike's step and
``skip_after`` more steps; the trainer keeps that skip list in its checkpoints.
"""

from __future__ import annotations

import json
import math
import sys
from typing import TYPE_CHECKING, Any

import torch
from torch import Tensor
from torch.utils.data import IterableDataset

from ember.callbacks.callback import Callback
from ember.checkpoint.snapshot_plan import SnapshotPlan

if TYPE_CHECKING:
    from ember.checkpoint.registry import Snapshot
    from ember.modules.module import TrainingModule
    from ember.trainer.loop import FitState
    from ember.trainer.rewind import Rewind
    from ember.trainer.trainer import Trainer

#: The run directory's record of every rewind, one JSON object per line.
REWINDS_FILE = "rewinds.jsonl"


class SpikeGuard(Callback):
    """Rewinds training to its newest good snapshot when the loss spikes or is not finite (docs/rewind.md).

    - ``factor``: a batch's loss above ``factor`` x the median of the ``window`` losses before it is a spike.
    - ``window``, ``warmup_steps``: losses the median is taken over; steps checked before spikes by ``factor`` count
      (default: ``window``). A non-finite loss is a spike from the first step.
    - ``check_every_n_steps``: how often the losses are read on the host (the detector's lag, in steps, is at most
      one less than this). Each check is one host sync (and, with several processes, one all-reduce). Past the
      warm-up the lag only adds to the steps trained again after a rewind, which goes back to the newest snapshot
      before the spike whatever the lag (docs/rewind.md).
    - ``snapshot_every_n_steps``: how often the in-memory snapshot is renewed (a multiple of
      ``check_every_n_steps``: a snapshot is taken right after a clean check).
    - ``skip_after``: optimizer steps' worth of batches left out after the spike's own (PaLM left out 200-500
      batches after going back about 100 steps). The batches from the snapshot to the spike are left out too.
    - ``lr_scale``, ``lr_scale_steps``: after a rewind, multiply the learning rate of every parameter group by
      ``lr_scale`` for ``lr_scale_steps`` steps (1.0: leave it).
    - ``max_rewinds``, ``rewind_window_steps``: more than ``max_rewinds`` rewinds whose spikes lie within
      ``rewind_window_steps`` steps stop the fit with `ember.trainer.rewind.TooManyRewinds`, after going back to
      the snapshot and saving it as a resumable ``last``.

    Each rewind is printed as one line, logged to the loggers (``rewind/count``, ``rewind/spike_step``,
    ``rewind/restored_step``, ``rewind/skipped_batches``) and written to ``rewinds.jsonl`` in the run directory.
    A mixed-precision scaler's own skipped steps (an inf gradient) are not spikes: only losses are read.
    """

    def __init__(
        self,
        factor: float = 4.0,
        window: int = 64,
        *,
        warmup_steps: int | None = None,
        check_every_n_steps: int = 16,
        snapshot_every_n_steps: int = 256,
        skip_after: int = 0,
        lr_scale: float = 1.0,
        lr_scale_steps: int = 0,
        max_rewinds: int = 3,
        rewind_window_steps: int = 1000,
    ) -> None:
        _check(
            _real(factor) and factor > 1 and math.isfinite(factor),
            f"factor={factor!r}: use a finite number above 1, e.g. 4.0",
        )
        for name, value in (("window", window), ("check_every_n_steps", check_every_n_steps)):
            _check(_whole(value) and value >= 1, f"{name}={value!r}: use a whole number >= 1")
        _check(
            _whole(snapshot_every_n_steps)
            and snapshot_every_n_steps >= 1
            and snapshot_every_n_steps % check_every_n_steps == 0,
            f"snapshot_every_n_steps={snapshot_every_n_steps!r}: use a multiple of check_every_n_steps "
            f"({check_every_n_steps}); a snapshot is taken right after a clean check",
        )
        for name, value in (
            ("warmup_steps", 0 if warmup_steps is None else warmup_steps),
            ("skip_after", skip_after),
            ("lr_scale_steps", lr_scale_steps),
            ("max_rewinds", max_rewinds),
            ("rewind_window_steps", rewind_window_steps),
        ):
            _check(_whole(value) and value >= 0, f"{name}={value!r}: use a whole number >= 0")
        _check(
            _real(lr_scale) and lr_scale > 0 and math.isfinite(lr_scale),
            f"lr_scale={lr_scale!r}: use a positive number, e.g. 0.5",
        )
        self.factor, self.window = float(factor), window
        self.warmup_steps = window if warmup_steps is None else warmup_steps
        self.check_every_n_steps, self.snapshot_every_n_steps = check_every_n_steps, snapshot_every_n_steps
        self.skip_after, self.lr_scale, self.lr_scale_steps = skip_after, float(lr_scale), lr_scale_steps
        self.max_rewinds, self.rewind_window_steps = max_rewinds, rewind_window_steps
        #: Every rewind so far (what ``rewinds.jsonl`` holds); checkpointed.
        self.rewinds: list[dict[str, Any]] = []
        self._losses: list[Tensor] = []  # unchecked losses, one per batch
        self._steps: list[int] = []  # the optimizer step each of them fed (1-based)
        self._history: list[float] = []  # the last `window` checked losses
        self._floor = math.inf  # at most the least of them (see `_check`); set with `_history` by `_keep_history`
        self._checked = 0  # steps checked since the fit started
        self._snapshot: Snapshot | None = None
        self._snapshot_step = 0  # the global step it holds
        #: `_history`, `_checked` and `_lr_until` when the snapshot was taken
        self._snapshot_detector: tuple[list[float], int, int] = ([], 0, -1)
        self._judged = False  # whether the last check's last loss was judged (a snapshot may follow it)
        self._seen_step = 0  # the global step at the last batch end (or epoch start): whether a batch took a step
        self._plan = SnapshotPlan()  # the snapshot's buffers and what it found of the model, kept between snapshots
        self._lr_until = -1  # the step at which a learning-rate scale ends (-1: none in force)
        self._last_batch: float = math.inf  # the epoch's last batch index and the fit's max_steps, read per epoch
        self._max_steps = -1
        self._progress: FitState  # the trainer's one FitState, read per batch; set at each epoch start

    # --- hooks -----------------------------------------------------------------------------------
    def setup(self, trainer: Trainer, module: TrainingModule, stage: str) -> None:
        """A new fit starts with nothing kept (a resumed one gets its record back from the checkpoint)."""
        if stage == "fit":
            self.rewinds, self._losses, self._steps, self._checked = [], [], [], 0
            self._keep_history([])
            self._snapshot, self._snapshot_step, self._lr_until = None, 0, -1
            self._snapshot_detector, self._judged = ([], 0, -1), False

    def teardown(self, trainer: Trainer, module: TrainingModule, stage: str) -> None:
        """The fit is over: the snapshot plan lets go of the model and optimizers it watched (its buffers stay)."""
        if stage == "fit":
            self._plan.release()

    def on_train_epoch_start(self, trainer: Trainer, module: TrainingModule) -> None:
        """The first snapshot: the fit's start (a resumed fit takes its first after its first clean check)."""
        self._last_batch, self._max_steps = trainer.epoch_plan.num_batches - 1, trainer.max_steps
        self._progress, self._seen_step = trainer.progress, trainer.global_step
        if self._snapshot is None and trainer.progress.batch_idx == 0 and trainer.global_step == 0:
            self._take_snapshot(trainer)

    def on_train_start(self, trainer: Trainer, module: TrainingModule) -> None:
        """Refuse iterable data that cannot go back to a snapshot's position (it would leave out the wrong batches)."""
        loader = trainer.train_dataloader
        dataset = getattr(loader, "dataset", None)
        if (
            isinstance(dataset, IterableDataset)
            and not callable(getattr(loader, "state_dict", None))
            and not callable(getattr(dataset, "state_dict", None))
        ):
            raise ValueError(
                f"SpikeGuard: the training data is an IterableDataset ({type(dataset).__qualname__}) without "
                "state_dict()/load_state_dict(), so a rewind cannot go back to its snapshot's position; give the "
                "dataset state_dict()/load_state_dict() or use torchdata's StatefulDataLoader (docs/checkpoints.md)"
            )

    def on_train_batch_end(
        self, trainer: Trainer, module: TrainingModule, outputs: Any, batch: Any, batch_idx: int
    ) -> None:
        """Keep this batch's loss; at every ``check_every_n_steps``-th step boundary, check the losses kept."""
        loss = outputs.get("loss") if type(outputs) is dict else None
        step, steps = self._progress.global_step, self._steps
        stepped, self._seen_step = step != self._seen_step, step
        if loss is not None:
            losses = self._losses
            if not losses:  # a check's first loss is checked here (refused at once), the others by the check's stack
                _check_loss(loss)
            losses.append(loss)
            # the step this batch fed: the one it ended, or, when it took none (inside an accumulation window, a
            # step skipped for a non-finite loss, none taken by hand), the next one
            steps.append(step if stepped else step + 1)
        if not stepped:
            return  # no step ended here
        if 0 <= self._lr_until <= step:  # at any step: the scale lasts lr_scale_steps, checking step or not
            self._end_lr_scale(trainer)
        if not steps or steps[-1] != step:
            return
        if step % self.check_every_n_steps and batch_idx != self._last_batch and step != self._max_steps:
            return  # not a checking step (the epoch's last step and max_steps are: a fit may end with them)
        spike = self._check(trainer)
        if spike is None:
            if self._judged and step % self.snapshot_every_n_steps == 0:
                self._take_snapshot(trainer)  # only once this step's loss was judged: warm-up losses may hide damage
            return
        self._rewind(trainer, step, *spike)

    def on_train_epoch_end(self, trainer: Trainer, module: TrainingModule) -> None:
        """A learning-rate scale that ended with a step taken after the epoch's last batch (the last, partial
        accumulation window of data of unknown length) ends here."""
        if 0 <= self._lr_until <= trainer.global_step:
            self._end_lr_scale(trainer)

    def on_train_stop(self, trainer: Trainer, module: TrainingModule) -> None:
        """The fit stops at this step boundary before its epoch's end (``max_time``, ``trainer.should_stop``): check
        the losses the last check did not see, so a spike in the fit's last steps is still rewound."""
        if self._steps and self._steps[-1] == trainer.global_step:
            spike = self._check(trainer)
            if spike is not None:
                self._rewind(trainer, trainer.global_step, *spike)

    def _take_snapshot(self, trainer: Trainer) -> None:
        self._snapshot, self._snapshot_step = trainer.snapshot(self._plan), trainer.global_step
        self._snapshot_detector = (list(self._history), self._checked, self._lr_until)

    # --- detection -------------------------------------------------------------------------------
    def _check(self, trainer: Trainer) -> tuple[int, float, float] | None:
        """The first kept loss that is a spike: (its step, its value, the median it was compared with, nan if it was
        not judged); None if none is. One host sync (and one all-reduce with several processes).

        Each loss is judged as if it had been checked alone, in order: against the median of the `window` losses
        before it, once it has losses before it and `warmup_steps` steps before its own were checked. So what a
        check finds does not depend on how many steps it holds (``check_every_n_steps``). Sets `_judged`: whether
        the check's last loss was judged."""
        losses, steps = _stacked(self._losses), self._steps
        self._losses.clear()  # the lists are refilled, never reallocated
        if trainer.world_size > 1:
            losses = trainer.strategy.reduce(losses.float(), "mean")
        values: list[float] = losses.tolist()  # the check's one host sync
        history, checked, count = self._history, self._checked, len(set(steps))
        # the last loss is judged when anything is (a loss with losses before it, past the warm-up by its own step)
        self._judged = judged = (len(values) > 1 or bool(history)) and checked + count - 1 >= self.warmup_steps
        # No larger than any loss a value here is judged against (the window's, and this check's earlier ones),
        # hence than the median it is compared with.
        floor = min(self._floor, *values)
        # Clean without a median when every value is finite (their sum is: a NaN or an inf would make it NaN or inf;
        # an overflow only takes the exact path) and none is above factor x `floor`.
        exact = not (math.isfinite(sum(values)) and (not judged or max(values) <= self.factor * floor))
        if exact:
            spike = self._first_spike(values, steps, self.factor * floor)
            if spike is not None:
                steps.clear()
                return spike
        self._checked = checked + count
        steps.clear()
        history += values  # in place: snapshots and checkpoints hold copies
        if len(history) > self.window:
            del history[: len(history) - self.window]
        # losses leaving the window never make a floor too high; after the exact path, the tightest one
        self._floor = min(history) if exact else floor
        return None

    def limit(self, median: float) -> float:
        """The loss above which a batch is a spike, given the median it is judged against: ``factor`` x median; for a
        negative median (a loss such as a negative log-likelihood), above the median by ``factor - 1`` times its
        magnitude. Never below ``factor`` x a floor under the median, which `_check`'s fast path relies on."""
        return median * (self.factor if median >= 0 else 2 - self.factor)

    def _first_spike(self, values: list[float], steps: list[int], bound: float) -> tuple[int, float, float] | None:
        """`_check`'s exact path: each value in order, judged against the median of the `window` losses before it
        (computed only for a value above `bound`, factor x a floor under every such median)."""
        before, done, previous = list(self._history), self._checked, None
        for value, step in zip(values, steps, strict=True):
            if previous is not None and step != previous:
                done += 1  # the steps before this loss's own
            judged = bool(before) and done >= self.warmup_steps
            if not math.isfinite(value):
                return step, value, _median(before[-self.window :]) if judged else math.nan
            if judged and value > bound:
                median = _median(before[-self.window :])
                if value > self.limit(median):
                    return step, value, median
            before.append(value)
            previous = step
        return None

    def _keep_history(self, history: list[float]) -> None:
        """Replace the detector's checked losses (a new fit, a rewind, a resume), and their floor."""
        self._history, self._floor = history, min(history, default=math.inf)

    # --- rewinding -------------------------------------------------------------------------------
    def _rewind(self, trainer: Trainer, step: int, spike_step: int, value: float, median: float) -> None:
        if self._snapshot is None:
            raise RuntimeError(
                f"SpikeGuard: the loss spiked at step {spike_step} ({value:.4g}) before any snapshot was taken; "
                "resume from a checkpoint that predates it, or lower the learning rate"
            )
        restored_step = self._snapshot_step
        recent = [r for r in self.rewinds if r["spike_step"] > spike_step - self.rewind_window_steps]
        stop = None
        if len(recent) >= self.max_rewinds:
            spikes = [*(str(r["spike_step"]) for r in recent), str(spike_step)]
            times = f"{len(spikes)} times within {self.rewind_window_steps} steps (steps" if recent else "at step"
            stop = (
                f"SpikeGuard: the loss spiked {times} {', '.join(spikes)}{')' if recent else ''}; "
                f"max_rewinds={self.max_rewinds}. "
                f"The fit went back to step {restored_step} and saved it as 'last': check the data and the learning "
                "rate, then resume with ckpt_path='last'"
            )
        record = {
            "step": step,
            "spike_step": spike_step,
            "value": value if math.isfinite(value) else str(value),
            "median": median if math.isfinite(median) else None,
            "reason": "non-finite" if not math.isfinite(value) else f"above {self.factor:g} x median",
            "restored_step": restored_step,
        }
        steps = spike_step - restored_step + self.skip_after

        def applied(rewind: Rewind) -> None:
            self._record(trainer, rewind, record)

        trainer.rewind(self._snapshot, steps, stop=stop, on_applied=applied)

    def _record(self, trainer: Trainer, rewind: Rewind, record: dict[str, Any]) -> None:
        """Write down a rewind the trainer applied: the record, the loggers, one line on screen."""
        record["skipped_batches"] = [list(position) for position in rewind.skipped]
        record["skipped_samples"] = _global_samples(trainer, rewind.samples)
        record["stopped"] = rewind.stop is not None
        self.rewinds.append(record)
        self._losses.clear()
        self._steps.clear()
        # The detector goes back too (the losses since the snapshot were of left-out batches), and so does a
        # learning-rate scale: the restored rates carry the one in force when the snapshot was taken, if any.
        history, self._checked, self._lr_until = self._snapshot_detector
        self._keep_history(list(history))
        restored = record["restored_step"]
        if self.lr_scale != 1.0 and self.lr_scale_steps and rewind.stop is None:
            if self._lr_until >= 0:
                self._scale_lr(trainer, 1 / self.lr_scale)  # the snapshot's rates carry an earlier rewind's scale
            self._scale_lr(trainer, self.lr_scale)
            self._lr_until = restored + self.lr_scale_steps
        if not trainer.is_global_zero:
            return
        with open(trainer.run_dir / REWINDS_FILE, "a", encoding="utf-8") as file:
            file.write(json.dumps(record) + "\n")
        metrics = {
            "rewind/count": float(len(self.rewinds)),
            "rewind/spike_step": float(record["spike_step"]),
            "rewind/restored_step": float(restored),
            "rewind/skipped_batches": float(len(rewind.skipped)),
        }
        for logger in trainer.loggers:
            logger.log_metrics(metrics, record["step"])
        print(
            f"ember: loss spike at step {record['spike_step']} ({record['reason']}, {record['value']}): rewound to "
            f"step {restored}, left out {len(rewind.skipped)} batch{'es' * (len(rewind.skipped) != 1)} "
            f"(rewind {len(self.rewinds)})",
            file=sys.stderr,
            flush=True,
        )

    def _end_lr_scale(self, trainer: Trainer) -> None:
        self._scale_lr(trainer, 1 / self.lr_scale)
        self._lr_until = -1

    @staticmethod
    def _scale_lr(trainer: Trainer, scale: float) -> None:
        for optimizer in trainer.optimizers:
            for group in optimizer.param_groups:
                group["lr"] = group["lr"] * scale

    # --- state -----------------------------------------------------------------------------------
    def state_dict(self) -> dict[str, Any]:
        """The record of rewinds, a learning-rate scale in force, and the detector's checked losses (a resumed fit
        judges its first losses as the uninterrupted fit would)."""
        return {
            "rewinds": [dict(r) for r in self.rewinds],
            "lr_until": self._lr_until,
            "history": list(self._history),
            "checked": self._checked,
        }

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self.rewinds = [dict(r) for r in state_dict.get("rewinds", [])]
        self._lr_until = int(state_dict.get("lr_until", -1))
        self._keep_history([float(v) for v in state_dict.get("history", [])])  # absent from older checkpoints
        self._checked = int(state_dict.get("checked", 0))


def _global_samples(trainer: Trainer, samples: list[list[int] | None]) -> list[int]:
    """The dataset indices of the left-out batches, position by position; with several processes, each position's
    global batch: every process's indices in rank order (one collective: every process applies a rewind), so each
    process records the same list. A process whose order cannot be rebuilt (None) adds none; processes that share
    their data (tensor-parallel peers) count once."""
    every = trainer.strategy.all_gather_object(samples) if trainer.world_size > 1 else [samples]
    found: list[int] = []
    for position in zip(*every, strict=True):
        kept: list[list[int]] = []
        for batch in position:
            if batch is not None and batch not in kept:
                kept.append(batch)
        found += [index for batch in kept for index in batch]
    return found


def _median(values: list[float]) -> float:
    """The median, as `statistics.median` takes it, without its checks."""
    ordered = sorted(values)
    middle = len(ordered) // 2
    return ordered[middle] if len(ordered) % 2 else (ordered[middle - 1] + ordered[middle]) / 2


def _check_loss(loss: Any) -> None:
    if not isinstance(loss, Tensor) or loss.ndim:
        raise ValueError(
            f"SpikeGuard: training_step's 'loss' is {_describe(loss)}; the guard watches one scalar loss tensor per "
            "batch: return the batch's mean loss as 'loss' (e.g. loss.mean())"
        )


def _stacked(losses: list[Any]) -> Tensor:
    """The kept losses as one 1-D tensor; a loss that is not one scalar tensor (only a check's first loss is checked
    when it is kept) is refused with the same message."""
    try:
        stacked = torch.stack(losses)
    except (TypeError, RuntimeError):
        stacked = None
    if stacked is None or stacked.ndim != 1:
        for loss in losses:
            _check_loss(loss)
    return stacked if stacked is not None else torch.stack(losses)  # scalar tensors stack fails on: its own error


def _describe(loss: Any) -> str:
    if isinstance(loss, Tensor):
        return f"a tensor of shape {tuple(loss.shape)}"
    return f"a {type(loss).__qualname__}"


def _whole(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _real(value: Any) -> bool:
    return isinstance(value, int | float) and not isinstance(value, bool)


def _check(ok: bool, message: str) -> None:
    if not ok:
        raise ValueError(f"SpikeGuard: {message}")
