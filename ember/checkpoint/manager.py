"""The checkpoint manager: how a checkpoint is found, gathered, written (sync or in the background) and restored.

One `CheckpointManager` per trainer (``trainer.checkpoints``). It decides *how*; *when* to save and what
to keep is `ember.callbacks.ModelCheckpoint`'s business, and the loop calls `CheckpointManager.flush` at
step boundaries (ember/trainer/boundary.py). What goes into a checkpoint is the registry
(`ember.checkpoint.registry`); the files are `writing` / `reading`; the data position across a resume is
`resume` and `data_position`; which checkpoint a ``ckpt_path`` names is `locating`.
"""

from __future__ import annotations

import atexit
import contextlib
import functools
import os
import sys
import threading
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from ember import checkpoint as ckpt
from ember.checkpoint import data_position, registry
from ember.checkpoint.hparams import for_checkpoint
from ember.checkpoint.run_lock import RunLock
from ember.checkpoint.store import redact

if TYPE_CHECKING:
    from torch import Tensor

    from ember.checkpoint.store_lock import StoreRunLock
    from ember.modules.module import TrainingModule
    from ember.trainer.trainer import Trainer


def info(trainer: Trainer, message: str) -> None:
    """One line on stderr from the global-zero process."""
    if trainer.is_global_zero:
        print(f"ember: {message}", file=sys.stderr, flush=True)


OnDone = Callable[[Path], None]


@dataclass
class _Request:
    path: Path
    weights_only: bool
    async_save: bool
    set_last: bool
    on_done: OnDone | None


#: Staged checkpoints whose finish (fsyncs, rename, ``last``) may be in flight at once, the newest included:
#: a save waits only for the finishes before the previous one, so an epoch shorter than a finish (which
#: waits on the disk for three journal commits) does not wait for its predecessor's.
FINISHES_IN_FLIGHT = 3


@dataclass
class _Background:
    """One write on a background thread; it starts once the write before it (`previous`) has ended."""

    path: Path
    previous: _Background | None
    thread: threading.Thread | None = None
    failed: bool = False


class CheckpointManager:
    """Finds, writes and restores the checkpoints of one trainer; writes happen at step boundaries, optionally in
    a background thread.

    During fit, a save asked for from a hook is written at the next boundary:
    the end of the current accumulation window (after its validation, if due)
    or the end of the epoch (after epoch schedulers stepped). A checkpoint
    therefore always describes a point where training can continue exactly.
    At most one async write is in flight; the next save, the end of fit
    and a preemption wait for it, and its error is raised there.

    A save that is not ``async_save`` writes every file at the boundary. In one
    process inside fit, what is left after that (fsyncs, the rename into place,
    ``last``) is waiting on the disk, and runs on a background thread like an
    async write's, so the loop does not wait for the disk; outside fit, and
    with several processes, the save is complete when it returns. Up to
    `FINISHES_IN_FLIGHT` such finishes are in flight, one after another in the
    order of the saves: the next save waits only for the ones before the
    previous, and a failure is raised at the first save (or the end of fit)
    after it. A checkpoint whose predecessor failed is removed unfinished, so
    none ever lands after one that failed.
    """

    def __init__(self) -> None:
        self.pending: list[_Request] = []
        self._writes: list[_Background] = []  # in flight, oldest first; each starts once the one before ended
        self._error: BaseException | None = None
        self._after_background: list[tuple[OnDone, Path]] = []
        self._waits_at_exit = False
        #: Copies of the last async snapshot, reused by the next one (`release` frees them).
        self._staging: dict[str, Tensor] = {}
        #: This process's claim on the run directory fit writes into (`claim_run`); None outside fit.
        self._run_lock: RunLock | None = None
        #: The same on the store, for a run whose root is a URL (`ember.checkpoint.store_lock`).
        self._store_lock: StoreRunLock | None = None

    def request(self, path: Path, weights_only: bool, async_save: bool, set_last: bool, on_done: OnDone | None) -> None:
        if any(r.path == path for r in self.pending) or any(w.path == path for w in self._writes) or path.exists():
            raise FileExistsError(f"a checkpoint at {path} exists already; ember never overwrites one")
        if set_last:
            ckpt.check_last_replaceable(path.parent)
        self.pending.append(_Request(path, weights_only, async_save, set_last, on_done))

    def flush(self, trainer: Trainer, module: TrainingModule) -> None:
        """Write every pending request now (the caller is at a boundary).

        A step whose loss the non-finite guard flagged is never saved: the guard's error is raised first,
        so ``last`` keeps naming the last good checkpoint and nothing is evicted for the bad one.
        """
        if self.pending:
            try:
                trainer.finite_guard.check()
                for lock in (self._run_lock, self._store_lock):
                    if lock is not None:
                        lock.check()  # taken over by another process: it writes the run now, not this one
            except BaseException:
                self.pending.clear()
                raise
        requests, self.pending = self.pending, []
        for req in requests:
            staged = not req.async_save and trainer.training and trainer.world_size == 1
            self._wait_until(FINISHES_IN_FLIGHT - 1 if staged else 0)
            if trainer.is_global_zero:
                trainer.run_state.logger_guard.save(wait=True)  # the logs on disk match the checkpoint
            req.on_done = _telling_loggers(trainer, req.on_done)  # e.g. W&B uploads it as an artifact
            staging = self._staging if req.async_save else None
            snapshot = registry.gather(trainer, module, req.weights_only, copy=req.async_save, staging=staging)
            if req.async_save:
                self._start(req, functools.partial(self._write, req, snapshot), snapshot.rank, low_priority=True)
            elif staged:
                self._start(req, registry.stage(req.path, snapshot, req.set_last), 0, low_priority=False)
            else:
                self._write(req, snapshot)
                if req.on_done is not None and snapshot.rank == 0:
                    req.on_done(req.path)

    def _start(
        self, req: _Request, work: Callable[[], object] | ckpt.StagedCheckpoint, rank: int, low_priority: bool
    ) -> None:
        """Run `work` (the rest of `req`'s write: a call, or a staged checkpoint to finish) on a background
        thread, once the writes in flight before it have ended."""
        write = _Background(req.path, self._writes[-1] if self._writes else None)
        args = (write, req, work, rank, low_priority)
        write.thread = threading.Thread(target=self._run_in_background, args=args, daemon=True)
        self._writes.append(write)
        write.thread.start()
        if not self._waits_at_exit:  # e.g. a save asked for after fit: nothing else would wait for it
            atexit.register(self._finish_at_exit)
            self._waits_at_exit = True

    @staticmethod
    def _write(req: _Request, snapshot: registry.Snapshot) -> None:
        registry.write(req.path, snapshot, req.set_last)

    def _run_in_background(
        self,
        write: _Background,
        req: _Request,
        work: Callable[[], object] | ckpt.StagedCheckpoint,
        rank: int,
        low_priority: bool,
    ) -> None:
        previous = write.previous
        write.previous = None  # the chain of ended writes is not kept alive
        if previous is not None and previous.thread is not None:
            previous.thread.join()
        if previous is not None and previous.failed:  # never a checkpoint after one that failed
            write.failed = True
            if isinstance(work, ckpt.StagedCheckpoint):
                work.abandon()
            return
        if low_priority:  # a whole async write: the step loop keeps the CPU, the writer takes what is left
            with contextlib.suppress(AttributeError, OSError):  # not Linux, or not allowed
                os.setpriority(os.PRIO_PROCESS, threading.get_native_id(), 19)
        try:
            work.finish() if isinstance(work, ckpt.StagedCheckpoint) else work()
        except BaseException as exc:  # handed to the main thread in wait()
            write.failed = True
            if self._error is None:
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
        """Block until every background write is finished; raise the first error."""
        self._wait_until(0)

    def _wait_until(self, in_flight: int) -> None:
        """Block until at most `in_flight` background writes are left; call what the ended ones asked for when
        done, and raise the first error of a write that ended."""
        while len(self._writes) > in_flight:
            thread = self._writes.pop(0).thread
            if thread is not None:
                thread.join()
        done, self._after_background = self._after_background, []
        for on_done, path in done:
            on_done(path)
        if self._error is not None:
            error, self._error = self._error, None
            raise ckpt.CheckpointWriteError(f"a background checkpoint write failed: {error}") from error

    def resolve(
        self,
        trainer: Trainer,
        ckpt_path: str | os.PathLike[str] | None,
        run_root: Path,
        stage: str,
        folders: Sequence[Path] = (),
        known_best: str | None = None,
        stores: Sequence[str] = (),
        run_url: str | None = None,
    ) -> tuple[Path | None, Path | None]:
        """(the checkpoint `ckpt_path` names, the run directory fit continues or None); see
        `ember.checkpoint.resolve_ckpt_path`. `folders` (explicit ``ModelCheckpoint(dirpath=...)``) are
        searched first, and ``"best"`` prefers `known_best` (this trainer's own record).

        For fit, a ``last`` that the saves could not replace (a directory) in a folder it will save into
        (`folders`, the continued run's checkpoints) is refused here, before any step
        (`ember.checkpoint.check_last_replaceable`).

        ``"last"`` with no local checkpoint takes the newest committed one of `stores` (the URLs of
        ``ModelCheckpoint(dirpath=URL)``): a run continued on a machine that shares nothing but the store.
        With `run_url` (``default_root_dir`` is a URL; `run_root` is then its staging folder) ``"last"`` is the
        newest committed checkpoint of the runs on the store (`ember.checkpoint.run_store.find_last`), and a run's
        URL (``<run_url>/version_N``) names that run's newest checkpoint: fit continues that run
        (`ember.checkpoint.run_store.find_run`)."""
        path, run_dir, message = None, None, None
        if run_url is not None and ckpt_path in ("last", "best"):
            path, run_dir, message = _last_of_store_runs(ckpt_path, run_url, run_root, stage)
        elif run_url is not None and isinstance(ckpt_path, str) and _names_a_store_run(ckpt_path, run_url):
            from ember.checkpoint import run_store

            path, run_dir, message = run_store.find_run(ckpt_path, run_root, stage)
        elif ckpt_path is not None:
            local_error: ckpt.CheckpointError | None = None
            try:
                path, run_dir, message = ckpt.resolve_ckpt_path(ckpt_path, run_root, stage, list(folders), known_best)
            except ckpt.CheckpointError as exc:
                if ckpt_path != "last" or not stores:
                    raise
                local_error = exc
            if ckpt_path == "last" and path is None and stores:
                path, message = _last_on_stores(stores, stage, message, local_error)
        if stage == "fit":
            for folder in [*folders, *([run_dir / ckpt.CHECKPOINT_SUBDIR] if run_dir is not None else [])]:
                ckpt.check_last_replaceable(folder)
        if message is not None:
            info(trainer, message)
        return path, run_dir

    def claim_run(self, run_dir: Path, run_url: str | None = None) -> None:
        """Hold `run_dir`'s writer lock until `release_run` (`ember.checkpoint.run_lock`): one writer per run;
        for a run on a store (`run_url`), its lock there too (`ember.checkpoint.store_lock`). Raises
        `RunLockedError`, naming the holder, when another process holds either."""
        self.release_run()
        self._run_lock = RunLock.acquire(run_dir)
        if run_url is not None:
            from ember.checkpoint.store_lock import StoreRunLock

            try:
                self._store_lock = StoreRunLock.acquire(run_url)
            except BaseException:
                self.release_run()
                raise

    def release_run(self) -> None:
        """Let go of the run's writer locks, if this manager holds them."""
        lock, self._run_lock = self._run_lock, None
        if lock is not None:
            lock.release()
        store_lock, self._store_lock = self._store_lock, None
        if store_lock is not None:
            store_lock.release()

    def restore(self, trainer: Trainer, module: TrainingModule, path: Path) -> dict[str, Any]:
        """Restore every registry entry from checkpoint `path` for resuming training; returns this process's
        state (random streams, data position), which the fit loop applies when training continues. A data
        position that cannot continue under this run's data settings is refused here, before any step."""
        strategy = trainer.strategy
        sharded = strategy.sharded_state(module, trainer.optimizers)  # FSDP: each process reads its shards only
        group = getattr(strategy, "checkpoint_group", None)
        loaded = registry.load(path, trainer.global_rank, trainer.world_size, sharded, group)
        registry.restore(trainer, module, loaded)
        data_position.check_rest_of_epoch(trainer, path, loaded.rank_state)  # before any step: refuse, or plan
        return loaded.rank_state

    @staticmethod
    def load_weights(trainer: Trainer, module: TrainingModule, path: Path) -> None:
        """Load only the module weights from `path` (for validate/test/predict)."""
        meta, weights = ckpt.read_module_state(path)
        hint = ckpt.mismatch_hint(meta, trainer.run_config, for_checkpoint(module.hparams))
        load = trainer.strategy.load_module_state
        ckpt.load_weights_into(module, weights, path, meta.get("module_class"), load, hint)

    def finish_quietly(self) -> None:
        """On the way out of a failed run: let an in-flight write finish; report (not raise) its error."""
        self.pending.clear()
        try:
            self.release()
        except RuntimeError as exc:
            print(f"ember: {exc}", file=sys.stderr, flush=True)

    def write_now(self) -> None:
        """Make every pending request a synchronous one (the process is about to exit)."""
        for request in self.pending:
            request.async_save = False


def _last_on_stores(
    stores: Sequence[str], stage: str, message: str | None, local_error: ckpt.CheckpointError | None
) -> tuple[Path | None, str | None]:
    """The newest committed checkpoint of the first of `stores` that has one, downloaded. When no store has
    one: `local_error` (why ``last`` found nothing locally) is raised if there is one; else fit starts a new
    run (None, `message`) and the other stages raise."""
    for url in stores:
        try:
            path = ckpt.fetch_checkpoint(url, "ModelCheckpoint(dirpath)")
        except ckpt.CheckpointError:
            continue
        what = "resuming from" if stage == "fit" else f"{stage}: loading"
        return path, f"{what} {redact(url)}/{path.name} ({ckpt.describe(path)}), the newest on the store"
    if local_error is not None:
        raise local_error
    if stage != "fit":
        where = ", ".join(map(redact, stores))
        raise ckpt.CheckpointError(f"ckpt_path='last': no complete checkpoint here nor in {where}")
    return None, message


def _names_a_store_run(ckpt_path: str, run_url: str) -> bool:
    from ember.checkpoint import run_store
    from ember.checkpoint.store import is_url

    return is_url(ckpt_path) and run_store.is_run_url(ckpt_path, run_url)


def _last_of_store_runs(
    which: str, run_url: str, run_root: Path, stage: str
) -> tuple[Path | None, Path | None, str | None]:
    """``ckpt_path='last'`` for runs whose root is on a store: (checkpoint, run directory, line to print)."""
    from ember.checkpoint import run_store

    if which == "best":
        raise ckpt.CheckpointError(
            f"ckpt_path='best' with default_root_dir on a store ({redact(run_url)}): give the checkpoint's URL "
            "(ModelCheckpoint's best_model_path names it), or 'last'"
        )
    found = run_store.find_last(run_url, run_root, stage)
    if found is not None:
        return found
    if stage != "fit":
        raise ckpt.CheckpointError(f"ckpt_path='last': no committed checkpoint under {redact(run_url)}")
    return None, None, f"no checkpoint under {redact(run_url)}; starting a new run"


def _telling_loggers(trainer: Trainer, on_done: OnDone | None) -> OnDone:
    """`on_done`, preceded by ``logger.after_save_checkpoint(path)`` for every logger (rank zero, main thread)."""

    def done(path: Path) -> None:
        trainer.run_state.logger_guard.after_save_checkpoint(path)
        if on_done is not None:
            on_done(path)

    return done
