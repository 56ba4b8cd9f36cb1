"""Bitwise resume matrix (issue 3, "must show" 1; DESIGN.md section 5, exact resume contract).

Every case trains the same seeded module twice:

- *uninterrupted*: one ``fit`` to the end;
- *split*: a ``fit`` that a callback stops (``trainer.should_stop = True``) after a chosen micro-batch,
  with ``ModelCheckpoint(every_n_train_steps=1)`` so a checkpoint sits at the step boundary where it
  stopped; then a brand-new ``Trainer`` and a brand-new module object, the global random streams
  scrambled, and ``fit(..., ckpt_path="last")`` with the same ``default_root_dir`` and ``run_name``.

The final parameters must be ``torch.equal``, and so must every per-step loss (recorded by a callback
in all three fits), every validation result, the rows of ``metrics.csv`` in the run directory, and the
state of ``ModelCheckpoint`` (and of ``EarlyStopping`` when ember has it).

The first half may do things *after* its last checkpoint that a resume is not meant to see: a stop
requested mid-epoch runs one more validation on the final weights (Lightning does the same for
``should_stop``) and the epoch-end hooks. The split run's history is therefore the first half's
history *as of its last checkpoint* (snapshotted in ``on_save_checkpoint``) followed by the second
half's.

Not covered, on purpose: random augmentation drawn from a worker's *global* RNG with
``num_workers=2``. Each DataLoader worker seeds its torch RNG with ``base_seed + worker_id`` when the
epoch's iterator is created, and its stream then advances with every sample it loads. On resume ember
re-draws the same ``base_seed`` but the workers start again from the seed, while in the uninterrupted
run they had already consumed draws for the skipped samples, so the augmentation differs and a resume
is not bitwise exact. The documented remedy is per-sample seeding (``ember.seed.sample_generator``),
which the ``workers2_sample_seeded`` case covers.
"""

from __future__ import annotations

import csv
import math
import random
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest
import torch
from torch import nn
from torch.nn import functional as F
from torch.utils.data import DataLoader, Dataset

import ember
from ember import checkpoint as ckpt
from ember.callbacks.model_checkpoint import ModelCheckpoint
from ember.loggers.csv import CSVLogger
from ember.seed import sample_generator

try:
    from ember.callbacks.early_stopping import EarlyStopping
except ImportError:  # another engineer is adding it; without it only ModelCheckpoint state is checked
    EarlyStopping = None  # type: ignore[assignment,misc]

MODEL_SEED, DATA_SEED, TRAIN_SEED, AUG_SEED = 1234, 99, 2024, 7
IN_FEATURES, HIDDEN, OUT_FEATURES = 5, 12, 2
RUN_NAME = "matrix"


@pytest.fixture(autouse=True)
def _isolate_global_rng():
    """The tests reseed and scramble the global RNGs; leave the rest of the suite's streams untouched."""
    py_state = random.getstate()
    with torch.random.fork_rng(devices=[]):
        yield
    random.setstate(py_state)


# --- data ------------------------------------------------------------------------------------------------


class Samples(Dataset[tuple[torch.Tensor, torch.Tensor]]):
    """Fixed regression samples; `augment` adds noise to the input when a sample is loaded.

    - ``"none"``: no augmentation;
    - ``"global"``: noise from the global torch RNG (exact with ``num_workers=0`` only, see the module doc);
    - ``"per_sample"``: noise from ``ember.seed.sample_generator(index, epoch, seed)``: the same in any
      worker, at any time (``set_epoch`` is called by ember before every training epoch).
    """

    def __init__(self, n: int, augment: str = "none", seed: int = DATA_SEED) -> None:
        g = torch.Generator().manual_seed(seed)
        self.x = torch.randn(n, IN_FEATURES, generator=g)
        self.y = torch.randn(n, OUT_FEATURES, generator=g)
        self.augment = augment
        self.epoch = 0

    def set_epoch(self, epoch: int) -> None:
        self.epoch = epoch

    def __len__(self) -> int:
        return len(self.x)

    def __getitem__(self, index: int) -> tuple[torch.Tensor, torch.Tensor]:
        x = self.x[index]
        if self.augment == "global":
            x = x + 0.1 * torch.randn(IN_FEATURES)
        elif self.augment == "per_sample":
            x = x + 0.1 * torch.randn(IN_FEATURES, generator=sample_generator(index, self.epoch, seed=AUG_SEED))
        return x, self.y[index]


# --- module and callbacks ------------------------------------------------------------------------------


class Regressor(ember.TrainingModule):
    def __init__(self, dropout: float, scheduler: str | None, steps_total: int) -> None:
        super().__init__()
        self.net = nn.Sequential(
            nn.Linear(IN_FEATURES, HIDDEN), nn.Tanh(), nn.Dropout(dropout), nn.Linear(HIDDEN, OUT_FEATURES)
        )
        self.scheduler = scheduler
        self.steps_total = steps_total

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.net(x)

    def training_step(self, batch: Any, batch_idx: int) -> Any:
        x, y = batch
        loss = F.mse_loss(self(x), y)
        self.log("train/loss", loss, on_step=True, on_epoch=True)
        return {"loss": loss}

    def validation_step(self, batch: Any, batch_idx: int, dataloader_idx: int = 0) -> Any:
        x, y = batch
        loss = F.mse_loss(self(x), y)
        self.log("val/loss", loss)
        return loss

    def configure_optimizers(self) -> Any:
        optimizer = torch.optim.Adam(self.parameters(), lr=0.01)
        if self.scheduler is None:
            return optimizer
        if self.scheduler == "steplr_step":
            sched: dict[str, Any] = {
                "scheduler": torch.optim.lr_scheduler.StepLR(optimizer, step_size=4, gamma=0.5),
                "interval": "step",
            }
        elif self.scheduler == "steplr_epoch":
            sched = {
                "scheduler": torch.optim.lr_scheduler.StepLR(optimizer, step_size=1, gamma=0.5),
                "interval": "epoch",
            }
        else:
            assert self.scheduler == "onecycle"
            sched = {
                "scheduler": torch.optim.lr_scheduler.OneCycleLR(optimizer, max_lr=0.05, total_steps=self.steps_total),
                "interval": "step",
            }
        return {"optimizer": optimizer, "lr_scheduler": sched}


@dataclass
class History:
    """What a fit did: per micro-batch (epoch, batch_idx, global_step after it, loss); validations."""

    losses: list[tuple[int, int, int, torch.Tensor]] = field(default_factory=list)
    lrs: list[float] = field(default_factory=list)
    validations: list[tuple[int, int, dict[str, float]]] = field(default_factory=list)

    def as_of(self, marks: tuple[int, int, int]) -> History:
        return History(self.losses[: marks[0]], self.lrs[: marks[1]], self.validations[: marks[2]])

    def __add__(self, other: History) -> History:
        return History(self.losses + other.losses, self.lrs + other.lrs, self.validations + other.validations)


class Recorder(ember.Callback):
    """Records every training loss, learning rate and validation; snapshots the counts at each checkpoint."""

    def __init__(self) -> None:
        self.history = History()
        self.at_checkpoint: tuple[int, int, int] | None = None
        self.checkpoint_steps: list[int] = []

    def on_train_batch_end(self, trainer, module, outputs, batch, batch_idx) -> None:
        loss = outputs["loss"].detach().clone()
        self.history.losses.append((trainer.current_epoch, batch_idx, trainer.global_step, loss))

    def on_before_optimizer_step(self, trainer, module, optimizer) -> None:
        self.history.lrs.append(optimizer.param_groups[0]["lr"])

    def on_validation_end(self, trainer, module) -> None:
        if not trainer.sanity_checking:
            metrics = dict(trainer.last_eval_metrics)
            self.history.validations.append((trainer.current_epoch, trainer.global_step, metrics))

    def on_save_checkpoint(self, trainer, module, checkpoint) -> None:
        h = self.history
        self.at_checkpoint = (len(h.losses), len(h.lrs), len(h.validations))
        self.checkpoint_steps.append(trainer.global_step)


class StopAfter(ember.Callback):
    """Sets ``trainer.should_stop`` after the `n`-th training micro-batch (counted across epochs)."""

    def __init__(self, n: int) -> None:
        self.n, self.seen = n, 0

    def on_train_batch_end(self, trainer, module, outputs, batch, batch_idx) -> None:
        self.seen += 1
        if self.seen >= self.n:
            trainer.should_stop = True


# --- the matrix -----------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Case:
    name: str
    stop_after: int  # micro-batches (across epochs) after which the first half asks to stop
    checkpoint_step: int  # global_step of the checkpoint that `last` names when the first half ends
    n_train: int = 24
    batch_size: int = 4
    max_epochs: int = 3
    accumulate: int = 1
    scheduler: str | None = None
    dropout: float = 0.0
    augment: str = "none"
    num_workers: int = 0
    loader_generator: bool = False  # False: the shuffle draws from the global torch RNG
    val_check_interval: float | None = None  # None: no validation data
    early_stopping: bool = False

    @property
    def batches_per_epoch(self) -> int:
        return math.ceil(self.n_train / self.batch_size)

    @property
    def steps_total(self) -> int:
        windows = math.ceil(self.batches_per_epoch / self.accumulate)
        return windows * self.max_epochs


CASES = [
    # 6 batches per epoch, 18 steps: stop inside epoch 1
    Case("mid_epoch", stop_after=8, checkpoint_step=8),
    # stop right after the last batch of epoch 1 (before its epoch-end hooks ran)
    Case("epoch_end", stop_after=12, checkpoint_step=12, loader_generator=True),
    # 7 batches per epoch in windows [0-2] [3-5] [6]: the stop is asked at epoch 1 batch 4 (inside a window)
    # and happens at the window's end (batch 5), i.e. global step 3 + 2
    Case("accumulate_crossing", stop_after=12, checkpoint_step=5, n_train=28, accumulate=3, max_epochs=3),
    Case("steplr_step_interval", stop_after=9, checkpoint_step=9, scheduler="steplr_step"),
    Case("steplr_epoch_interval_at_epoch_end", stop_after=6, checkpoint_step=6, scheduler="steplr_epoch"),
    Case("onecycle", stop_after=10, checkpoint_step=10, scheduler="onecycle", loader_generator=True),
    Case("dropout_global_augmentation_workers0", stop_after=7, checkpoint_step=7, dropout=0.3, augment="global"),
    Case(
        "workers2_sample_seeded",
        stop_after=9,
        checkpoint_step=9,
        dropout=0.3,
        augment="per_sample",
        num_workers=2,
        max_epochs=2,
    ),
    # 8 batches per epoch, validation after batches 3 and 7: stop between two validations ...
    Case("val_half_between", stop_after=14, checkpoint_step=14, n_train=32, val_check_interval=0.5, dropout=0.2),
    # ... and right after one (the checkpoint at that step already counts it: it must not run again)
    Case(
        "val_half_after_validation",
        stop_after=12,
        checkpoint_step=12,
        n_train=32,
        val_check_interval=0.5,
        early_stopping=True,
        max_epochs=4,
    ),
]


@dataclass
class Outcome:
    params: dict[str, torch.Tensor]
    history: History
    csv_rows: list[dict[str, str]]
    checkpointer: ModelCheckpoint
    early_stopping: Any
    global_step: int
    epoch: int


def _loaders(case: Case) -> tuple[DataLoader, DataLoader | None]:
    generator = torch.Generator().manual_seed(11) if case.loader_generator else None
    train = DataLoader(
        Samples(case.n_train, case.augment),
        batch_size=case.batch_size,
        shuffle=True,
        generator=generator,
        num_workers=case.num_workers,
    )
    val = None
    if case.val_check_interval is not None:
        val = DataLoader(Samples(12, seed=DATA_SEED + 1), batch_size=4)
    return train, val


def _fit(case: Case, root: Path, *, stop_after: int | None = None, resume: bool = False) -> tuple[Outcome, Recorder]:
    torch.manual_seed(MODEL_SEED)
    module = Regressor(case.dropout, case.scheduler, case.steps_total)
    if resume:  # nothing of the first half's process state may matter
        torch.manual_seed(999)
        random.seed(5)
    else:
        torch.manual_seed(TRAIN_SEED)
        random.seed(TRAIN_SEED)
    recorder = Recorder()
    checkpointer = ModelCheckpoint(every_n_train_steps=1, monitor="train/loss_step", mode="min", save_top_k=2)
    callbacks: list[ember.Callback] = [recorder, checkpointer]
    stopper = None
    if case.early_stopping and EarlyStopping is not None:
        # the first check sets the best; no later one beats it by 10, so the run stops at the 4th check
        stopper = EarlyStopping(monitor="val/loss", patience=3, min_delta=10.0)
        callbacks.append(stopper)
    if stop_after is not None:
        callbacks.append(StopAfter(stop_after))
    trainer = ember.Trainer(
        max_epochs=case.max_epochs,
        accumulate_grad_batches=case.accumulate,
        val_check_interval=case.val_check_interval or 1.0,
        log_every_n_steps=1,
        callbacks=callbacks,
        default_root_dir=root,
        run_name=RUN_NAME,
        logger=CSVLogger(),
        enable_progress_bar=False,
        enable_model_summary=False,
    )
    train, val = _loaders(case)
    trainer.fit(module, train, val, ckpt_path="last" if resume else None)
    rows = _csv_rows(trainer.run_dir / "metrics.csv")
    params = {k: v.detach().clone() for k, v in module.state_dict().items()}
    outcome = Outcome(params, recorder.history, rows, checkpointer, stopper, trainer.global_step, trainer.current_epoch)
    return outcome, recorder


def _csv_rows(path: Path) -> list[dict[str, str]]:
    with open(path, newline="", encoding="utf-8") as f:
        return [{k: v for k, v in row.items() if v != ""} for row in csv.DictReader(f)]


def _relative(path: str, root: Path) -> str:
    return str(Path(path).relative_to(root)) if path else ""


def _checkpointer_state(cb: ModelCheckpoint, root: Path) -> dict[str, Any]:
    return {
        "best_model_path": _relative(cb.best_model_path, root),
        "best_model_score": cb.best_model_score,
        "last_model_path": _relative(cb.last_model_path, root),
        "kept": {_relative(p, root): s for p, s in cb.kept.items()},
    }


def assert_same_history(actual: History, expected: History) -> None:
    assert [(e, b, s) for e, b, s, _ in actual.losses] == [(e, b, s) for e, b, s, _ in expected.losses]
    for (e, b, s, got), (*_, want) in zip(actual.losses, expected.losses, strict=True):
        assert torch.equal(got, want), f"loss at epoch {e} batch {b} (step {s}): {got.item()!r} != {want.item()!r}"
    assert actual.lrs == expected.lrs
    assert actual.validations == expected.validations


@dataclass
class Runs:
    """The three fits of one case: uninterrupted, first half (stopped), second half (resumed)."""

    full_root: Path
    split_root: Path
    full: Outcome
    first: Outcome
    first_recorder: Recorder
    second: Outcome

    @property
    def split_history(self) -> History:
        assert self.first_recorder.at_checkpoint is not None
        return self.first.history.as_of(self.first_recorder.at_checkpoint) + self.second.history


@pytest.fixture(scope="module")
def runs(tmp_path_factory: pytest.TempPathFactory):
    """Runs each case once (the tests below check different properties of the same runs)."""
    done: dict[str, Runs] = {}

    def get(case: Case) -> Runs:
        if case.name not in done:
            base = tmp_path_factory.mktemp(case.name)
            full_root, split_root = base / "full", base / "split"
            py_state = random.getstate()
            with torch.random.fork_rng(devices=[]):
                full, _ = _fit(case, full_root)
                first, first_recorder = _fit(case, split_root, stop_after=case.stop_after)
                checkpoints = split_root / RUN_NAME / "version_0" / "checkpoints"
                named = ckpt.newest_valid(checkpoints)
                assert named is not None
                assert ckpt.check_complete(named)["state"]["progress"]["global_step"] == case.checkpoint_step
                second, _ = _fit(case, split_root, resume=True)
            random.setstate(py_state)
            done[case.name] = Runs(full_root, split_root, full, first, first_recorder, second)
        return done[case.name]

    return get


CASE_PARAMS = pytest.mark.parametrize("case", CASES, ids=[c.name for c in CASES])


@CASE_PARAMS
def test_the_first_half_stops_at_the_checkpointed_step_boundary(case: Case, runs) -> None:
    r = runs(case)
    assert r.first_recorder.checkpoint_steps[-1] == case.checkpoint_step
    assert r.first.global_step == case.checkpoint_step  # no optimizer step after the checkpoint
    assert r.first_recorder.at_checkpoint is not None
    assert r.first_recorder.at_checkpoint[0] == len(r.first.history.losses)  # no training batch after it
    assert not (r.split_root / RUN_NAME / "version_1").exists()  # "last" continued the run directory


@CASE_PARAMS
def test_resumed_parameters_are_bitwise_equal(case: Case, runs) -> None:
    r = runs(case)
    assert r.full.params.keys() == r.second.params.keys()
    for name, value in r.full.params.items():
        assert torch.equal(r.second.params[name], value), f"parameter {name} differs after resume"
    assert (r.second.global_step, r.second.epoch) == (r.full.global_step, r.full.epoch)


@CASE_PARAMS
def test_per_step_losses_learning_rates_and_validations_are_identical(case: Case, runs) -> None:
    """Validation is neither rerun nor skipped: the split run's validations are the uninterrupted run's."""
    r = runs(case)
    assert_same_history(r.split_history, r.full.history)
    if case.val_check_interval is not None:
        assert len(r.full.history.validations) >= 4  # the case does validate (twice per epoch)


@CASE_PARAMS
def test_metrics_csv_reads_as_if_the_run_never_stopped(case: Case, runs) -> None:
    r = runs(case)
    assert r.second.csv_rows == r.full.csv_rows


@CASE_PARAMS
def test_callback_state_is_carried_over(case: Case, runs) -> None:
    r = runs(case)
    got = _checkpointer_state(r.second.checkpointer, r.split_root)
    assert got == _checkpointer_state(r.full.checkpointer, r.full_root)
    assert got["best_model_path"] and len(got["kept"]) == 2
    if case.early_stopping and EarlyStopping is not None:
        assert r.full.early_stopping.stopped_epoch is not None  # the case is built so that it stops the run
        assert r.full.epoch < case.max_epochs
        for attr in ("wait_count", "best_score", "stopped_epoch"):
            assert getattr(r.second.early_stopping, attr) == getattr(r.full.early_stopping, attr), attr


# --- two ModelCheckpoint instances ---------------------------------------------------------------------


def _fit_two_checkpointers(root: Path, *, stop_after: int | None = None, resume: bool = False):
    """A step-checkpointer (every step, keeps the 2 lowest train losses) beside an epoch-checkpointer
    (every epoch, keeps the best val loss): each must get its own state back on resume."""
    torch.manual_seed(MODEL_SEED)
    module = Regressor(0.0, None, 0)
    if resume:
        torch.manual_seed(999)
    else:
        torch.manual_seed(TRAIN_SEED)
    by_step = ModelCheckpoint(every_n_train_steps=1, monitor="train/loss_step", save_top_k=2)
    by_epoch = ModelCheckpoint(every_n_epochs=1, monitor="val/loss", save_top_k=1, filename="best-{epoch}-{step}")
    callbacks: list[ember.Callback] = [by_step, by_epoch]
    if stop_after is not None:
        callbacks.append(StopAfter(stop_after))
    trainer = ember.Trainer(
        max_epochs=3,
        callbacks=callbacks,
        default_root_dir=root,
        run_name=RUN_NAME,
        logger=False,
        enable_progress_bar=False,
        enable_model_summary=False,
    )
    case = Case("two", stop_after=0, checkpoint_step=0, val_check_interval=1.0)
    train, val = _loaders(case)
    trainer.fit(module, train, val, ckpt_path="last" if resume else None)
    return [_checkpointer_state(cb, root) for cb in (by_step, by_epoch)]


def test_two_model_checkpoints_keep_their_own_state_across_resume(tmp_path: Path) -> None:
    full = _fit_two_checkpointers(tmp_path / "full")
    # stop at the end of epoch 1 (6 batches per epoch), where both have saved; `last` names the epoch-end one
    _fit_two_checkpointers(tmp_path / "split", stop_after=12)
    resumed = _fit_two_checkpointers(tmp_path / "split", resume=True)
    assert Path(full[1]["best_model_path"]).name.startswith("best-")
    assert resumed == full


# --- default checkpointing (every epoch) and a stop inside an epoch -----------------------------------------


def _fit_default_checkpointing(root: Path, *, stop_after: int | None = None, resume: bool = False):
    torch.manual_seed(MODEL_SEED)
    module = Regressor(0.2, None, 0)
    torch.manual_seed(999 if resume else TRAIN_SEED)
    callbacks = [StopAfter(stop_after)] if stop_after is not None else []
    trainer = ember.Trainer(
        max_epochs=3,
        callbacks=callbacks,
        default_root_dir=root,
        run_name=RUN_NAME,
        logger=False,
        enable_progress_bar=False,
        enable_model_summary=False,
    )  # enable_checkpointing=True: the default ModelCheckpoint() saves at every epoch end
    train, _ = _loaders(Case("default", stop_after=0, checkpoint_step=0))
    trainer.fit(module, train, ckpt_path="last" if resume else None)
    return {k: v.detach().clone() for k, v in module.state_dict().items()}, trainer.global_step


def test_stop_inside_an_epoch_with_default_checkpointing_resumes_exactly(tmp_path: Path) -> None:
    """A stop in the middle of an epoch (``should_stop``, ``max_time``) with the default every-epoch
    ``ModelCheckpoint``: the epoch-end save that follows the stop must not claim the cut-short epoch as
    complete, or ``fit(ckpt_path="last")`` skips the rest of that epoch."""
    full, full_steps = _fit_default_checkpointing(tmp_path / "full")
    _, stopped_at = _fit_default_checkpointing(tmp_path / "split", stop_after=8)  # epoch 1, batch 1 of 6
    assert stopped_at == 8
    resumed, resumed_steps = _fit_default_checkpointing(tmp_path / "split", resume=True)
    assert resumed_steps == full_steps == 18
    for name, value in full.items():
        assert torch.equal(resumed[name], value), name
