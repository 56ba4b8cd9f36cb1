"""Step boundaries: where the loop writes the checkpoints asked for and acts on a preemption signal.

A boundary is the end of an accumulation window or of an epoch: a point where training can continue
exactly. *How* a checkpoint is written is the manager's (`ember.checkpoint.manager`); *which* callback
writes the checkpoint a stop or a preemption needs is decided here.
"""

from __future__ import annotations

import signal
from typing import TYPE_CHECKING

from ember import checkpoint as ckpt
from ember.checkpoint.manager import info
from ember.strategies import launcher
from ember.trainer import signals

if TYPE_CHECKING:
    from ember.callbacks.model_checkpoint import ModelCheckpoint
    from ember.modules.module import TrainingModule
    from ember.trainer.trainer import Trainer


def resumable_saver(trainer: Trainer) -> ModelCheckpoint | None:
    """The `ModelCheckpoint` that writes the checkpoints a stop or preemption saves: the first one that
    writes full (resumable) checkpoints; None when every one saves weights only (or there is none)."""
    return next((cb for cb in trainer.checkpoint_callbacks if not cb.save_weights_only), None)


def handle_preemption(trainer: Trainer, module: TrainingModule, signum: int) -> None:
    """Save a resumable ``last`` at this boundary, requeue under SLURM, and exit with `signals.EXIT_PREEMPTED`.

    The checkpoint is written by `resumable_saver`, else as ``<run dir>/checkpoints/preempted-step=N``
    (also when the only savers keep weights only, which cannot resume). ``fast_dev_run`` saves nothing.
    """
    name = signals.signal_name(signum)
    if trainer.fast_dev_run:
        info(trainer, f"received {name}: fast_dev_run saves no checkpoint; stopping at step {trainer.global_step}")
    else:
        info(trainer, f"received {name}: saving a checkpoint at step {trainer.global_step}")
    manager = trainer.checkpoints
    manager.wait()
    saver = resumable_saver(trainer)
    if trainer.fast_dev_run:
        pass
    elif saver is not None:
        saver.save_for_preemption(trainer)
    else:
        path = trainer.run_dir / ckpt.CHECKPOINT_SUBDIR / f"preempted-step={trainer.global_step}"
        if not path.exists():
            manager.request(path, False, False, True, None)
    manager.write_now()  # the process is about to exit
    manager.flush(trainer, module)
    manager.wait()
    launcher.mark_preempted(trainer.global_rank)  # under `devices=N`: the launcher exits 75 once all have saved
    job = signals.slurm_job_to_requeue()
    if job is not None and trainer.is_global_zero:
        signals.requeue_slurm_job(job)
    raise signals.Preempted(signum)


def save_last(trainer: Trainer, module: TrainingModule, fallback_name: str) -> None:
    """Write a resumable checkpoint of this boundary now and point ``last`` at it: `resumable_saver`'s, else
    ``<run dir>/checkpoints/<fallback_name>``."""
    manager, saver = trainer.checkpoints, resumable_saver(trainer)
    if saver is not None:
        saver.save_for_preemption(trainer)
    else:
        path = trainer.run_dir / ckpt.CHECKPOINT_SUBDIR / fallback_name
        if not path.exists():
            manager.request(path, False, False, True, None)
    manager.flush(trainer, module)
    manager.wait()


def at_boundary(trainer: Trainer, module: TrainingModule) -> None:
    """A step or epoch boundary: write pending checkpoints; act on a preemption signal."""
    received = trainer.run_state.preemption.received  # the state, not the properties: this runs every step
    if trainer.strategy.preemption_requested(received is not None):
        handle_preemption(trainer, module, received or signal.SIGTERM)
    manager = trainer.checkpoints
    if manager.pending:
        manager.flush(trainer, module)


def save_stop_point(trainer: Trainer, module: TrainingModule) -> None:
    """A stop inside an epoch: save ``last`` at this step boundary now, before the epoch-end hooks.

    The epoch-end processing that follows (validation of the final weights,
    ``on_train_epoch_end``, epoch schedulers, ``epoch += 1``) describes a cut-short
    epoch; a ModelCheckpoint that has saved this step skips its epoch-end save, so
    ``fit(ckpt_path="last")`` continues the epoch where it stopped.
    """
    saver = resumable_saver(trainer)
    if saver is not None:
        saver.save_for_preemption(trainer)
        trainer.checkpoints.flush(trainer, module)
