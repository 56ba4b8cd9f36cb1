"""Evaluation: validate, test and predict over their loaders, and validation inside fit.

Every evaluation hook call site is here; the order is documented in docs/hooks.md and pinned by
tests/unit/trainer/test_hook_order.py. Validation inside fit leaves every random stream as it found it,
so a run that validates trains exactly like one that does not.
"""

from __future__ import annotations

import contextlib
import os
import random
import sys
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import torch

from ember import stages
from ember.checkpoint.manager import info
from ember.trainer.arguments import check_ckpt_path, split_datamodule
from ember.trainer.data import as_list, batch_transfer, check_not_empty, limited, num_batches, resolve_loaders
from ember.trainer.run import record_evaluation, running

if TYPE_CHECKING:
    from ember.modules.datamodule import DataModule
    from ember.modules.module import TrainingModule
    from ember.trainer.trainer import Trainer


@dataclass
class EvalProgress:
    """The running validation/test/predict's size, for progress displays; written by this module alone."""

    #: Batches per dataloader (inf: unknown length).
    num_batches: list[float] = field(default_factory=list)

    def start(self, limits: list[float]) -> None:
        self.num_batches = list(limits)


def validate_in_fit(
    trainer: Trainer, module: TrainingModule, loaders: list[Any], limits: list[float], sanity_check: bool = False
) -> None:
    """Validation inside fit, leaving every random stream as it found it.

    Iterating a DataLoader without its own ``generator`` draws a seed from the
    global torch RNG, and a validation step may draw too; restoring the state
    keeps training (dropout, augmentation, shuffling) identical to a run that
    never validates. ``Trainer(lightning_rng=True)`` skips the restore, as Lightning does, except for the
    sanity check, whose streams Lightning restores too.
    """
    if trainer.options.lightning_rng and not sanity_check:
        run_evaluation(trainer, module, "validation", loaders, limits)
        return
    with isolated_rng():
        run_evaluation(trainer, module, "validation", loaders, limits)


@contextlib.contextmanager
def isolated_rng() -> Iterator[None]:
    """Put the global random streams (Python, NumPy if loaded, torch CPU, the current CUDA device) back as they
    were when the block ends, however it ends: what runs inside draws without moving training's streams."""
    py_state, np_state = random.getstate(), _numpy_state()
    cuda = [torch.cuda.current_device()] if torch.cuda.is_available() and torch.cuda.is_initialized() else []
    try:
        with torch.random.fork_rng(devices=cuda):
            yield
    finally:
        random.setstate(py_state)
        if np_state is not None:
            sys.modules["numpy"].random.set_state(np_state)


def overrides(module: TrainingModule, name: str) -> bool:
    """Whether `module`'s class overrides TrainingModule's hook `name`."""
    from ember.modules.module import TrainingModule

    return getattr(type(module), name, None) is not getattr(TrainingModule, name, None)


def _numpy_state() -> Any:
    np = sys.modules.get("numpy")  # only if the program uses numpy at all
    return np.random.get_state() if np is not None else None


def run_evaluation(
    trainer: Trainer, module: TrainingModule, stage: str, loaders: list[Any], limits: list[float]
) -> list[Any]:
    """Run `stage` ("validation", "test" or "predict") over `loaders`.

    Returns the predictions per dataloader for "predict", else one dict of
    epoch metrics (floats) per dataloader. Train/eval mode of every submodule
    is restored afterwards, so a backbone frozen in eval mode stays that way.
    """
    hooks, reporter = trainer.hooks, trainer.reporter
    collector = reporter.eval_collector
    step_fn = getattr(module, stages.by_loop(stage).step)
    trainer.eval_progress.start(limits)  # progress bars show n/total
    modes = [(m, m.training) for m in module.modules()]
    getattr(module, f"on_{stage}_model_eval")()  # module.eval() unless the module overrides the hook
    restore_hook = f"on_{stage}_model_train"
    restore = getattr(module, restore_hook) if overrides(module, restore_hook) else None
    reporter.use(collector)
    try:  # an exception (a KeyboardInterrupt included) leaves the collector and the modes as they were
        collector.start_epoch(stage)
        predictions: list[list[Any]] = [[] for _ in loaders]
        hooks.on_eval_start(stage)
        hooks.on_eval_epoch_start(stage)
        no_grad = torch.inference_mode() if trainer.options.inference_mode else torch.no_grad()
        with no_grad, trainer.strategy.eval_context():
            for dl_idx, loader in enumerate(loaders):
                extra = (dl_idx,) if len(loaders) > 1 else ()  # as in Lightning: only with several dataloaders
                collector.set_suffix(f"/dataloader_idx_{dl_idx}" if extra else "")
                to_device = batch_transfer(trainer, module, dl_idx)
                for batch_idx, batch in enumerate(limited(loader, limits[dl_idx])):
                    if to_device is not None:
                        batch = to_device(batch)
                    collector.see(batch)
                    hooks.on_eval_batch_start(stage, batch, batch_idx, *extra)
                    with trainer.strategy.forward_context():
                        output = step_fn(batch, batch_idx, *extra)
                    if stage == "predict":
                        predictions[dl_idx].append(output)
                    hooks.on_eval_batch_end(stage, output, batch, batch_idx, *extra)
        collector.set_suffix("")  # as in Lightning, the epoch-end hook logs plain names, whatever the last loader
        hooks.on_eval_epoch_end(stage)
        results = trainer.reporter.finish_eval(collector.epoch_values(), len(loaders))
        hooks.on_eval_end(stage)
    finally:
        collector.set_suffix("")
        collector.see(None)
        reporter.use(reporter.train_collector)
        if restore is not None:
            restore()
        else:
            for submodule, training in modes:
                submodule.training = training
    return predictions if stage == "predict" else results


def evaluate(
    trainer: Trainer,
    stage: stages.Stage,
    module: TrainingModule | None,
    loaders: Any,
    datamodule: DataModule | None,
    ckpt_path: str | os.PathLike[str] | None,
) -> list[Any]:
    """`Trainer.validate` / `test` / `predict`: the arguments checked, the weights loaded, one pass over the data.

    Without a module, as in Lightning: the trainer's most recent module (the fitted one), its datamodule when
    no data is given, and, when no ``ckpt_path`` is given either, the best checkpoint of its `ModelCheckpoint`
    if it recorded one (a line says so), else the module's current weights.
    """
    loaders, datamodule = split_datamodule(stage.name, loaders, datamodule)
    check_ckpt_path(stage.name, ckpt_path)
    as_list(loaders)  # a wrong kind of data fails here, before any hook
    if module is None:
        module, datamodule, ckpt_path = _previous_run(trainer, stage, loaders, datamodule, ckpt_path)
    with running(trainer, stage, module, datamodule, ckpt_path):
        if trainer.ckpt_path is not None:
            trainer.checkpoints.load_weights(trainer, module, trainer.ckpt_path)
        given = resolve_loaders(stage.loop, loaders, datamodule, module)
        resolved = [trainer.strategy.distribute_loader(d, False) for d in given]
        if not resolved:
            raise ValueError(f"{stage.loop} needs data: pass dataloaders, a datamodule with a {stage.loop} "
                             f"dataloader, or define {stage.loader}_dataloader() on the module")  # fmt: skip
        check_not_empty(stage.loop, resolved)
        limit = getattr(trainer.options, stage.limit_option)
        limits = [num_batches(d, limit, stage.limit_option) for d in resolved]
        results = run_evaluation(trainer, module, stage.loop, resolved, limits)
        record_evaluation(trainer, stage, results)
        return results
    raise AssertionError("unreachable")  # pragma: no cover  (mypy: running re-raises)


def _previous_run(
    trainer: Trainer,
    stage: stages.Stage,
    loaders: Any,
    datamodule: DataModule | None,
    ckpt_path: str | os.PathLike[str] | None,
) -> tuple[TrainingModule, DataModule | None, str | os.PathLike[str] | None]:
    """What `evaluate` runs when no module is given: the trainer's most recent module and datamodule, and its
    best checkpoint when no ``ckpt_path`` is given."""
    module = trainer.run_state.module
    if module is None:
        raise ValueError(
            f"{stage.name}: no module given and this trainer has run none; pass it: "
            f"trainer.{stage.name}(module, dataloaders) (after fit, the fitted module is used)"
        )
    if loaders is None and datamodule is None:
        datamodule = trainer.datamodule
    best = next((cb.best_model_path for cb in trainer.checkpoint_callbacks if cb.best_model_path), None)
    if ckpt_path is None and best:
        info(trainer, f"{stage.name}: no module given: using the fitted module with its best checkpoint, {best}")
        ckpt_path = "best"
    return module, datamodule, ckpt_path
