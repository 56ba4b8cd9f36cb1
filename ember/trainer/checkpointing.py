"""The trainer's side of checkpoints: which checkpoint ``ckpt_path`` means, saving, resuming.

The file format lives in `checkpoint.py`, what goes into a checkpoint in
`state.py`; *when* to save is the `ModelCheckpoint` callback's business.
"""

from __future__ import annotations

import atexit
import contextlib
import functools
import os
import signal
import sys
import threading
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from ember import checkpoint as ckpt
from ember.strategies import launcher
from ember.trainer import signals, state

if TYPE_CHECKING:
    from torch import Tensor

    from ember.callbacks.model_checkpoint import ModelCheckpoint
    from ember.modules.module import TrainingModule
    from ember.trainer.loop import FitLoop
    from ember.trainer.trainer import Trainer

def info(trainer: Trainer, message: str) -> None:
    """One line on stderr from the global-zero process."""
    if trainer.is_global_zero:
        print(f"ember: {message}", file=sys.stderr, flush=True)


def resolve_ckpt_path(
    trainer: Trainer, ckpt_path: str | os.PathLike[str] | None, run_root: Path, stage: str
) -> tuple[Path | None, Path | None]:
    """(the checkpoint `ckpt_path` names, the run directory fit continues or None); see
    `ember.checkpoint.resolve_ckpt_path`. The folders of explicit ``ModelCheckpoint(dirpath=...)`` are
    searched first, and ``"best"`` prefers this trainer's own record."""
    if ckpt_path is None:
        return None, None
    savers = [cb for cb in trainer.user_callbacks if isinstance(cb, _model_checkpoint_class())]
    folders = [Path(cb.dirpath) for cb in savers if cb.dirpath]
    known_best = next((cb.best_model_path for cb in savers if cb.best_model_path), None)
    path, run_dir, message = ckpt.resolve_ckpt_path(ckpt_path, run_root, stage, folders, known_best)
    if message is not None:
        info(trainer, message)
    return path, run_dir


def _model_checkpoint_class() -> type[ModelCheckpoint]:
    from ember.callbacks.model_checkpoint import ModelCheckpoint

    return ModelCheckpoint


OnDone = Callable[[Path], None]


@dataclass
class _Request:
    path: Path
    weights_only: bool
    async_save: bool
    set_last: bool
    on_done: OnDone | None


class CheckpointWriter:
    """Writes checkpoints at step boundaries, optionally in a background thread.

    During fit, a save asked for from a hook is written at the next boundary:
    the end of the current accumulation window (after its validation, if due)
    or the end of the epoch (after epoch schedulers stepped). A checkpoint
    therefore always describes a point where training can continue exactly.
    At most one background write is in flight; the next save, the end of fit
    and a preemption wait for it, and its error is raised there.

    A save that is not ``async_save`` writes every file at the boundary. In one
    process inside fit, what is left after that (fsyncs, the rename into place,
    ``last``) is waiting on the disk, and runs on a background thread like an
    async write's, so the loop does not wait for the disk; outside fit, and
    with several processes, the save is complete when it returns.
    """

    def __init__(self) -> None:
        self.pending: list[_Request] = []
        self._thread: threading.Thread | None = None
        self._error: BaseException | None = None
        self._after_background: list[tuple[OnDone, Path]] = []
        self._waits_at_exit = False
        self._in_flight: Path | None = None  # the checkpoint the background thread is writing
        #: Copies of the last async snapshot, reused by the next one (`release` frees them).
        self._staging: dict[str, Tensor] = {}

    def request(self, path: Path, weights_only: bool, async_save: bool, set_last: bool, on_done: OnDone | None) -> None:
        if any(r.path == path for r in self.pending) or path == self._in_flight or path.exists():
            raise FileExistsError(f"a checkpoint at {path} exists already; ember never overwrites one")
        self.pending.append(_Request(path, weights_only, async_save, set_last, on_done))

    def flush(self, trainer: Trainer, module: TrainingModule) -> None:
        """Write every pending request now (the caller is at a boundary).

        A step whose loss the non-finite guard flagged is never saved: the guard's error is raised first,
        so ``last`` keeps naming the last good checkpoint and nothing is evicted for the bad one.
        """
        if self.pending:
            try:
                trainer.finite_guard.check()
            except BaseException:
                self.pending.clear()
                raise
        requests, self.pending = self.pending, []
        for req in requests:
            self.wait()
            if trainer.is_global_zero:
                for logger in trainer.loggers:  # the logs on disk match the checkpoint
                    logger.save()
            req.on_done = _telling_loggers(trainer, req.on_done)  # e.g. W&B uploads it as an artifact
            staging = self._staging if req.async_save else None
            snapshot = state.gather(trainer, module, req.weights_only, copy=req.async_save, staging=staging)
            if req.async_save:
                self._start(req, functools.partial(self._write, req, snapshot), snapshot.rank, low_priority=True)
            elif trainer.training and snapshot.world_size == 1:
                self._start(req, state.stage(req.path, snapshot, req.set_last).finish, 0, low_priority=False)
            else:
                self._write(req, snapshot)
                if req.on_done is not None and snapshot.rank == 0:
                    req.on_done(req.path)

    def _start(self, req: _Request, work: Callable[[], object], rank: int, low_priority: bool) -> None:
        """Run `work` (the rest of `req`'s write) on the background thread."""
        self._in_flight = req.path
        args = (req, work, rank, low_priority)
        self._thread = threading.Thread(target=self._run_in_background, args=args, daemon=True)
        self._thread.start()
        if not self._waits_at_exit:  # e.g. a save asked for after fit: nothing else would wait for it
            atexit.register(self._finish_at_exit)
            self._waits_at_exit = True

    @staticmethod
    def _write(req: _Request, snapshot: state.Snapshot) -> None:
        state.write(req.path, snapshot, req.set_last)

    def _run_in_background(self, req: _Request, work: Callable[[], object], rank: int, low_priority: bool) -> None:
        if low_priority:  # a whole async write: the step loop keeps the CPU, the writer takes what is left
            with contextlib.suppress(AttributeError, OSError):  # not Linux, or not allowed
                os.setpriority(os.PRIO_PROCESS, threading.get_native_id(), 19)
        try:
            work()
        except BaseException as exc:  # handed to the main thread in wait()
            self._error = exc
        else:
            if req.on_done is not None and rank == 0:
                self._after_background.append((req.on_done, req.path))

    def _finish_at_exit(self) -> None:
        """At interpreter exit, complete a write still in flight (its thread is a daemon); report its error."""
        try:
            self.wait()
        except RuntimeError as exc:
            print(f"ember: {exc}", file=sys.stderr, flush=True)

    def release(self) -> None:
        """Wait for the write in flight, then free the async snapshot buffers (the end of fit)."""
        self.wait()
        self._staging = {}

    def wait(self) -> None:
        """Block until the background write (if any) is finished; raise its error."""
        if self._thread is not None:
            self._thread.join()
            self._thread = None
            self._in_flight = None
        done, self._after_background = self._after_background, []
        for on_done, path in done:
            on_done(path)
        if self._error is not None:
            error, self._error = self._error, None
            raise ckpt.CheckpointWriteError(f"a background checkpoint write failed: {error}") from error


def _telling_loggers(trainer: Trainer, on_done: OnDone | None) -> OnDone:
    """`on_done`, preceded by ``logger.after_save_checkpoint(path)`` for every logger (rank zero, main thread)."""

    def done(path: Path) -> None:
        for logger in trainer.loggers:
            logger.after_save_checkpoint(path)
        if on_done is not None:
            on_done(path)

    return done


def resume(loop: FitLoop, path: Path) -> None:
    """Restore everything from checkpoint `path` into the fit `loop` belongs to; the loop keeps this process's
    state (random streams, data position) for when training continues."""
    trainer = loop.trainer
    loaded = state.load(path, trainer.global_rank, trainer.world_size)
    state.restore(trainer, loop.module, loaded)
    loop.resumed_from = path
    loop.resume_state = loaded.rank_state
    loop.epoch_start_state = loaded.rank_state.get("epoch_start")


def load_weights(trainer: Trainer, module: TrainingModule, path: Path) -> None:
    """Load only the module weights from `path` (for validate/test/predict)."""
    meta, weights = ckpt.read_module_state(path)
    hint = ckpt.mismatch_hint(meta, trainer.run_config, dict(module.hparams))
    ckpt.load_weights_into(module, weights, path, meta.get("module_class"), trainer.strategy.load_module_state, hint)


def finish_writes_quietly(trainer: Trainer) -> None:
    """On the way out of a failed run: let an in-flight write finish; report (not raise) its error."""
    trainer.checkpoint_writer.pending.clear()
    try:
        trainer.checkpoint_writer.release()
    except RuntimeError as exc:
        print(f"ember: {exc}", file=sys.stderr, flush=True)


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
    trainer.checkpoint_writer.wait()
    saver = resumable_saver(trainer)
    if trainer.fast_dev_run:
        pass
    elif saver is not None:
        saver.save_for_preemption(trainer)
    else:
        path = trainer.run_dir / ckpt.CHECKPOINT_SUBDIR / f"preempted-step={trainer.global_step}"
        if not path.exists():
            trainer.checkpoint_writer.request(path, False, False, True, None)
    for request in trainer.checkpoint_writer.pending:
        request.async_save = False  # the process is about to exit: write now
    trainer.checkpoint_writer.flush(trainer, module)
    trainer.checkpoint_writer.wait()
    launcher.mark_preempted(trainer.global_rank)  # under `devices=N`: the launcher exits 75 once all have saved
    job = signals.slurm_job_to_requeue()
    if job is not None and trainer.is_global_zero:
        signals.requeue_slurm_job(job)
    raise signals.Preempted(signum)


def at_boundary(trainer: Trainer, module: TrainingModule) -> None:
    """A step or epoch boundary: write pending checkpoints; act on a preemption signal."""
    received = trainer.preemption.received
    if trainer.strategy.preemption_requested(received is not None):
        handle_preemption(trainer, module, received or signal.SIGTERM)
    if trainer.checkpoint_writer.pending:
        trainer.checkpoint_writer.flush(trainer, module)


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
        trainer.checkpoint_writer.flush(trainer, module)
