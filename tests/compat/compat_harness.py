"""Run one module body under Lightning and under ember, and compare what came out.

`build` makes the module class from a body and a framework's base class, seeded the same way.
`fit_lightning` and `fit_ember` train it with each framework's Trainer (no logger, progress bar, checkpoint or
summary, no sanity check) and return a `Run`: the per-step losses, the epoch metrics seen at each
``on_train_epoch_end``, the final parameters, the global step, the final learning rates and the names in the
progress bar.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import pytest
import torch

import ember

pl = pytest.importorskip(
    "lightning", reason="tests/compat compares ember with Lightning; install it (it is in the dev extra)"
)


@dataclass
class Run:
    losses: list[torch.Tensor]
    epochs: list[dict[str, float]]
    params: dict[str, torch.Tensor]
    global_step: int
    lrs: list[float]
    prog_bar: list[str]


def build(body: type, base: type, *args: Any) -> Any:
    """An instance of ``class <body><base>(body, base)``, its parameters drawn after ``torch.manual_seed(0)``."""
    cls = type(f"{body.__name__}On{base.__name__}", (body, base), {})
    torch.manual_seed(0)
    return cls(*args)


class Snapshot:
    """A callback body: the epoch metrics in ``trainer.callback_metrics`` at each ``on_train_epoch_end``."""

    def __init__(self, names: tuple[str, ...]) -> None:
        self.names, self.epochs = names, []

    def on_train_epoch_end(self, trainer: Any, module: Any) -> None:
        metrics = trainer.callback_metrics
        self.epochs.append({name: float(metrics[name]) for name in self.names if name in metrics})


def _run(module: Any, trainer: Any, snapshot: Snapshot) -> Run:
    return Run(
        losses=list(module.step_losses),
        epochs=snapshot.epochs,
        params={k: v.detach().clone() for k, v in module.state_dict().items()},
        global_step=trainer.global_step,
        lrs=[group["lr"] for opt in trainer.optimizers for group in opt.param_groups],
        prog_bar=sorted(trainer.progress_bar_metrics),
    )


def fit_lightning(module: Any, *data: Any, datamodule: Any = None, **options: Any) -> Run:
    snapshot = build(Snapshot, pl.Callback, type(module).EPOCH_METRICS)
    trainer = pl.Trainer(
        accelerator="cpu", devices=1, logger=False, enable_progress_bar=False, enable_checkpointing=False,
        enable_model_summary=False, num_sanity_val_steps=0, callbacks=[snapshot], **options,
    )  # fmt: skip
    trainer.fit(module, *data, datamodule=datamodule)
    return _run(module, trainer, snapshot)


def fit_ember(module: Any, *data: Any, datamodule: Any = None, **options: Any) -> Run:
    snapshot = build(Snapshot, ember.Callback, type(module).EPOCH_METRICS)
    trainer = ember.Trainer(
        accelerator="cpu", logger=False, enable_progress_bar=False, enable_checkpointing=False,
        enable_model_summary=False, num_sanity_val_steps=0, callbacks=[snapshot], **options,
    )  # fmt: skip
    trainer.fit(module, *data, datamodule=datamodule)
    return _run(module, trainer, snapshot)


def assert_same_run(ember_run: Run, lightning_run: Run, metrics_tol: float = 1e-6) -> None:
    """Per-step losses and final parameters bitwise equal; epoch metrics equal within `metrics_tol`, relative or
    absolute (ember sums a batch-weighted mean in float64, Lightning in float32: they agree to float32 rounding);
    same step count and learning rates."""
    assert len(ember_run.losses) == len(lightning_run.losses) > 0
    for i, (a, b) in enumerate(zip(ember_run.losses, lightning_run.losses, strict=True)):
        assert torch.equal(a, b), f"step {i}: ember {a.item()!r} != Lightning {b.item()!r}"
    assert ember_run.params.keys() == lightning_run.params.keys()
    for name, value in ember_run.params.items():
        assert torch.equal(value, lightning_run.params[name]), f"parameter {name} differs"
    assert ember_run.global_step == lightning_run.global_step
    assert ember_run.lrs == lightning_run.lrs
    assert ember_run.prog_bar == lightning_run.prog_bar  # what logging with prog_bar=True shows
    assert len(ember_run.epochs) == len(lightning_run.epochs) > 0
    for epoch, (mine, theirs) in enumerate(zip(ember_run.epochs, lightning_run.epochs, strict=True)):
        assert mine.keys() == theirs.keys() and mine, f"epoch {epoch}: ember {sorted(mine)}, Lightning {sorted(theirs)}"
        for name, value in theirs.items():
            assert math.isclose(mine[name], value, rel_tol=metrics_tol, abs_tol=metrics_tol), (
                f"epoch {epoch} {name}: ember {mine[name]!r} != Lightning {value!r}"
            )
