"""Evaluation: validate, test and predict over their loaders, and validation inside fit.

Every evaluation hook call site is here; the order is documented in docs/hooks.md and pinned by
tests/unit/trainer/test_hook_order.py. Validation inside fit leaves every random stream as it found it,
so a run that validates trains exactly like one that does not.
"""

from __future__ import annotations

import random
import sys
from typing import TYPE_CHECKING, Any

import torch

from ember import stages
from ember.trainer.data import limited

if TYPE_CHECKING:
    from ember.modules.module import TrainingModule
    from ember.trainer.trainer import Trainer


def validate_in_fit(trainer: Trainer, module: TrainingModule, loaders: list[Any], limits: list[float]) -> None:
    """Validation inside fit, leaving every random stream as it found it.

    Iterating a DataLoader without its own ``generator`` draws a seed from the
    global torch RNG, and a validation step may draw too; restoring the state
    keeps training (dropout, augmentation, shuffling) identical to a run that
    never validates.
    """
    py_state, np_state = random.getstate(), _numpy_state()
    cuda = [torch.cuda.current_device()] if torch.cuda.is_available() and torch.cuda.is_initialized() else []
    try:
        with torch.random.fork_rng(devices=cuda):
            run_evaluation(trainer, module, "validation", loaders, limits)
    finally:
        random.setstate(py_state)
        if np_state is not None:
            sys.modules["numpy"].random.set_state(np_state)


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
    trainer.num_eval_batches = list(limits)  # progress bars show n/total
    modes = [(m, m.training) for m in module.modules()]
    module.eval()
    reporter.collector = collector
    try:  # an exception (a KeyboardInterrupt included) leaves the collector and the modes as they were
        collector.start_epoch(stage)
        predictions: list[list[Any]] = [[] for _ in loaders]
        hooks.on_eval_start(stage)
        hooks.on_eval_epoch_start(stage)
        with torch.no_grad(), trainer.strategy.eval_context():
            for dl_idx, loader in enumerate(loaders):
                extra = (dl_idx,) if len(loaders) > 1 else ()
                collector.suffix = f"/dataloader_idx_{dl_idx}" if extra else ""
                for batch_idx, batch in enumerate(limited(loader, limits[dl_idx])):
                    batch = trainer.strategy.batch_to_device(batch)
                    collector.current_batch = batch
                    hooks.on_eval_batch_start(stage, batch, batch_idx, dl_idx)
                    with trainer.strategy.forward_context():
                        output = step_fn(batch, batch_idx, *extra)
                    if stage == "predict":
                        predictions[dl_idx].append(output)
                    hooks.on_eval_batch_end(stage, output, batch, batch_idx, dl_idx)
        hooks.on_eval_epoch_end(stage)
        results = trainer.reporter.finish_eval(collector.epoch_values(), len(loaders))
        hooks.on_eval_end(stage)
    finally:
        collector.suffix = ""
        collector.current_batch = None
        reporter.collector = reporter.train_collector
        for submodule, training in modes:
            submodule.training = training
    return predictions if stage == "predict" else results
