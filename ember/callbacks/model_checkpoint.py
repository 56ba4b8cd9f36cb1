"""`ModelCheckpoint`: when to save, what to keep, and where ``last`` points."""

from __future__ import annotations

import functools
import math
import re
import threading
import time
from datetime import timedelta
from pathlib import Path
from typing import TYPE_CHECKING, Any

from ember.callbacks.callback import Callback
from ember.callbacks.monitored import check_after_sanity
from ember.checkpoint.format import META_FILE
from ember.checkpoint.locating import CHECKPOINT_SUBDIR
from ember.checkpoint.store import check_url, is_url, join
from ember.checkpoint.writing import delete_checkpoint
from ember.strategies import launcher

if TYPE_CHECKING:
    from ember.checkpoint.mirror import StoreMirror
    from ember.checkpoint.shared_commit import SharedCommit
    from ember.modules.module import TrainingModule
    from ember.trainer.trainer import Trainer

_FIELD = re.compile(r"\{([^{}:]+)(?::([^{}]*))?\}")


def _is_checkpoint_name(name: str) -> bool:
    return bool(name) and name not in (".", "..") and not name.startswith(".") and "/" not in name


def _score_or_none(value: Any) -> float | None:
    return float(value) if isinstance(value, (int, float)) and not isinstance(value, bool) else None


class ModelCheckpoint(Callback):
    """Saves checkpoints during fit and keeps the best ones.

    - When: every ``every_n_epochs`` epochs (default 1 when no other trigger is
      given), every ``every_n_train_steps`` optimizer steps, and/or every
      ``train_time_interval`` (seconds or ``timedelta``). Saves are written at
      the next step or epoch boundary, so each one resumes exactly.
    - What to keep: with ``monitor``, the ``save_top_k`` best by ``mode``
      ("min"/"max"); without, the ``save_top_k`` most recent. ``-1`` keeps all,
      ``0`` none (besides ``last``).
    - ``save_last`` (default True): a ``last`` file in ``dirpath`` names the
      newest complete checkpoint; ``fit(ckpt_path="last")`` resumes from it.
    - ``dirpath`` defaults to ``<run dir>/checkpoints``; ``filename`` is a
      template such as ``"{epoch}-{step}-{val/acc:.3f}"``: as in Lightning,
      each field becomes ``name=value`` (``"{epoch}-{val_loss:.2f}"`` names
      ``epoch=0-val_loss=0.12``; ``/`` in a name becomes ``_``, since a
      checkpoint is one directory), or only ``value`` with
      ``auto_insert_metric_name=False`` (the rest of the template is kept as
      written: ``"epoch_{epoch:03d}"`` names ``epoch_000``). A field that was
      not logged is an error (Lightning writes 0).
    - ``save_weights_only`` writes module weights only (not resumable);
      ``async_save`` writes in a background thread while training goes on.
    - ``dirpath`` may be a URL (``s3://bucket/ckpts``, any fsspec protocol):
      each checkpoint is written to ``<run dir>/checkpoints`` first, then
      uploaded in the background and committed on the store by a manifest
      written last (`ember.checkpoint.mirror`); the store's ``last`` follows,
      and evicted checkpoints leave the store too. Resume anywhere with
      ``ckpt_path="s3://bucket/ckpts/last"``. With several processes no
      local folder need be shared: each uploads the files it wrote and
      process 0 commits the checkpoint once all reported
      (`ember.checkpoint.shared_commit`).

    `best_model_path` / `best_model_score` name the best checkpoint; the
    callback's own state (kept checkpoints, best score) survives a resume.
    """

    def __init__(
        self,
        dirpath: str | Path | None = None,
        filename: str = "{epoch}-{step}",
        monitor: str | None = None,
        mode: str = "min",
        save_top_k: int = 1,
        save_last: bool = True,
        every_n_train_steps: int | None = None,
        every_n_epochs: int | None = None,
        train_time_interval: float | timedelta | None = None,
        save_weights_only: bool = False,
        async_save: bool = False,
        auto_insert_metric_name: bool = True,
    ) -> None:
        if mode not in ("min", "max"):
            raise ValueError(f"ModelCheckpoint(mode={mode!r}): use 'min' or 'max'")
        if not isinstance(save_top_k, int) or save_top_k < -1:
            raise ValueError(f"ModelCheckpoint(save_top_k={save_top_k!r}): use -1 (all), 0 (none) or a count")
        for name, value in (("every_n_train_steps", every_n_train_steps), ("every_n_epochs", every_n_epochs)):
            if value is not None and (not isinstance(value, int) or value < 1):
                raise ValueError(f"ModelCheckpoint({name}={value!r}) must be a positive int")
        if not _FIELD.search(filename) and save_top_k != 1:
            raise ValueError(
                f"ModelCheckpoint(filename={filename!r}) needs a field such as {{step}} to tell saves apart"
            )
        if "/" in _FIELD.sub("", filename):
            raise ValueError(
                f"ModelCheckpoint(filename={filename!r}): a checkpoint is one directory in dirpath; drop the '/' "
                "(put folders in dirpath)"
            )
        #: The store folder checkpoints are uploaded to (``dirpath`` given as a URL), else None.
        self.store_url: str | None = None
        if is_url(dirpath):
            assert isinstance(dirpath, str)
            check_url(dirpath, "ModelCheckpoint(dirpath)")
            self.store_url, dirpath = dirpath.rstrip("/"), None  # written locally first, in the run directory
        self.dirpath = Path(dirpath) if dirpath is not None else None
        self._mirror: StoreMirror | None = None  # one process: uploads and commits
        self._shared: SharedCommit | None = None  # several processes: each uploads its files, process 0 commits
        self._failed: BaseException | None = None  # the exception this fit ended with (on_exception)
        self._removing: threading.Thread | None = None  # deleting evicted checkpoints
        self.filename = filename
        self.auto_insert_metric_name = auto_insert_metric_name
        self.monitor = monitor
        self.mode = mode
        self.save_top_k = save_top_k
        self.save_last = save_last
        self.every_n_train_steps = every_n_train_steps
        if isinstance(train_time_interval, timedelta):
            train_time_interval = train_time_interval.total_seconds()
        self.train_time_interval_s: float | None = train_time_interval
        no_trigger = every_n_train_steps is None and train_time_interval is None
        self.every_n_epochs = every_n_epochs if every_n_epochs is not None else (1 if no_trigger else None)
        self.save_weights_only = save_weights_only
        self.async_save = async_save
        # State that survives a resume:
        self.kept: dict[str, float | None] = {}  # path -> monitored score (None without monitor), oldest first
        self.best_model_path = ""
        self.best_model_score: float | None = None
        self.last_model_path = ""
        self._last_saved_step = -1
        self._last_save_time = time.monotonic()

    # --- state ------------------------------------------------------------------
    @property
    def state_key(self) -> str:
        """Includes the settings, so several instances in one run keep separate state (as in Lightning)."""
        settings = {
            "monitor": self.monitor,
            "mode": self.mode,
            "every_n_train_steps": self.every_n_train_steps,
            "every_n_epochs": self.every_n_epochs,
            "train_time_interval": self.train_time_interval_s,
        }
        return f"ModelCheckpoint{settings}"

    def state_dict(self) -> dict[str, Any]:
        return {
            "kept": dict(self.kept),
            "best_model_path": self.best_model_path,
            "best_model_score": self.best_model_score,
            "last_model_path": self.last_model_path,
            "last_saved_step": self._last_saved_step,
            "dirpath": str(self.dirpath) if self.dirpath else "",
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore the ranking from a checkpoint, keeping only checkpoints in this callback's `dirpath`.

        The paths come from a file, so they are data: an entry outside `dirpath` (a checkpoint of another
        run this one was started from, or anything a crafted file names) is forgotten, never evicted.
        """
        kept = state["kept"]
        if not isinstance(kept, dict):
            raise TypeError(f"ModelCheckpoint state 'kept' is {type(kept).__name__}, expected a dict")
        if self.store_url is not None:  # on a store, a checkpoint is a name in its folder, wherever it was staged
            kept = {self._on_this_machine(p): s for p, s in kept.items()}
        self.kept = {p: _score_or_none(s) for p, s in kept.items() if self._owns(p)}
        best = self._on_this_machine(state["best_model_path"])
        if isinstance(best, str) and self._owns(best):
            self.best_model_path, self.best_model_score = best, _score_or_none(state["best_model_score"])
        last = self._on_this_machine(state["last_model_path"])
        self.last_model_path = last if isinstance(last, str) and self._owns(last) else ""
        step = state["last_saved_step"]
        self._last_saved_step = step if isinstance(step, int) else -1
        uploader = self._mirror or self._shared
        if uploader is not None:  # the store holds the resumed run's checkpoints under the same names
            names = [Path(p).name for p in (*kept, last) if isinstance(p, str) and p]
            uploader.adopt([n for n in names if _is_checkpoint_name(n)])

    def _on_this_machine(self, path: object) -> object:
        """For a store ``dirpath``: `path` (a checkpoint staged on the machine that wrote the state, maybe another)
        as the same checkpoint's staging path here, so the ranking survives a resume on new machines; else
        `path` unchanged."""
        if self.store_url is None or self.dirpath is None or not isinstance(path, str) or not path:
            return path
        name = Path(path).name
        return str(self.dirpath / name) if _is_checkpoint_name(name) else path

    def _owns(self, path: str) -> bool:
        """Whether `path` names a checkpoint directory directly inside `dirpath` (by resolved path; a
        symlink never counts): the only places this callback may ever delete."""
        if self.dirpath is None or not isinstance(path, str) or not path:
            return False
        candidate = Path(path)
        if not _is_checkpoint_name(candidate.name):
            return False
        try:
            return candidate.parent.resolve() == self.dirpath.resolve() and not candidate.is_symlink()
        except (OSError, RuntimeError):
            return False

    def _remove_in_background(self, paths: list[str]) -> None:
        """Delete evicted checkpoints on a thread of their own, once the deletions asked for before have ended: a
        checkpoint takes a while to delete (each fsynced file's unlink waits on the disk), and the loop need not
        wait for it (`teardown` does)."""
        if not paths:
            return
        args = (self._removing, paths)
        self._removing = threading.Thread(target=self._remove_after, args=args, name="ember-evict", daemon=True)
        self._removing.start()

    def _remove_after(self, previous: threading.Thread | None, paths: list[str]) -> None:
        if previous is not None:
            previous.join()
        self._remove_all(paths)

    def _wait_for_removals(self) -> None:
        removing, self._removing = self._removing, None
        if removing is not None:
            removing.join()

    def _remove_all(self, paths: list[str]) -> None:
        for path in paths:
            self._remove(path)

    def _remove(self, path: str) -> None:
        """Delete an evicted checkpoint of this callback; anything else is left alone."""
        if self._owns(path) and (Path(path) / META_FILE).exists():
            delete_checkpoint(Path(path))

    # --- triggers -----------------------------------------------------------------
    def on_sanity_check_end(self, trainer: Trainer, module: TrainingModule) -> None:
        """A misspelt `monitor` stops the fit here, before its first step (`callbacks.monitored`)."""
        check_after_sanity(trainer, "ModelCheckpoint", self.monitor)

    def setup(self, trainer: Trainer, module: TrainingModule, stage: str) -> None:
        if self.dirpath is None and stage == "fit":
            self.dirpath = trainer.run_dir / CHECKPOINT_SUBDIR
            if self.store_url is None and trainer.run_url is not None:  # the run lives on a store: so do its saves
                self.store_url = join(trainer.run_url, CHECKPOINT_SUBDIR)
        if self.store_url is None or stage != "fit" or self._mirror is not None or self._shared is not None:
            return
        self._failed = None
        if trainer.world_size > 1:  # every process uploads its own files (`ember.checkpoint.shared_commit`)
            from ember.checkpoint.shared_commit import SharedCommit

            self._shared = SharedCommit(self.store_url, trainer.global_rank, trainer.world_size)
        elif trainer.is_global_zero:
            from ember.checkpoint.mirror import StoreMirror

            self._mirror = StoreMirror(self.store_url)

    def on_exception(self, trainer: Trainer, module: TrainingModule, exception: BaseException) -> None:
        self._failed = exception

    def teardown(self, trainer: Trainer, module: TrainingModule, stage: str) -> None:
        """Wait for evicted checkpoints to be deleted, and with a store ``dirpath`` for the uploads still queued
        (several processes: the final commit, unless the fit failed); raise the first upload that failed."""
        self._wait_for_removals()
        mirror, self._mirror = self._mirror, None
        if mirror is not None:
            mirror.close()
        shared, self._shared = self._shared, None
        if shared is not None:  # a preemption stops every process at the same boundary: they all get here
            failed = self._failed
            preempted = isinstance(failed, SystemExit) and failed.code == launcher.EXIT_PREEMPTED
            shared.close(final=failed is None or preempted)

    def on_train_start(self, trainer: Trainer, module: TrainingModule) -> None:
        self._last_save_time = time.monotonic()

    def on_train_batch_end(
        self, trainer: Trainer, module: TrainingModule, outputs: Any, batch: Any, batch_idx: int
    ) -> None:
        step = trainer.global_step
        if step == self._last_saved_step:
            return
        by_steps = self.every_n_train_steps is not None and step > 0 and step % self.every_n_train_steps == 0
        interval = self.train_time_interval_s
        by_time = interval is not None and time.monotonic() - self._last_save_time >= interval
        if by_steps or by_time:
            self._save(trainer)

    def on_train_epoch_end(self, trainer: Trainer, module: TrainingModule) -> None:
        due = self.every_n_epochs is not None and (trainer.current_epoch + 1) % self.every_n_epochs == 0
        if due and trainer.global_step != self._last_saved_step:
            self._save(trainer)

    def save_for_preemption(self, trainer: Trainer) -> None:
        """Save now (at a boundary) unless this step is saved already; ``last`` is updated either way."""
        if trainer.global_step != self._last_saved_step:
            self._save(trainer, force_last=True)

    # --- saving -------------------------------------------------------------------
    def format_name(self, trainer: Trainer) -> str:
        """The checkpoint's directory name from `filename` and the current epoch, step and metrics."""
        metrics = trainer.callback_metrics

        def field(match: re.Match[str]) -> str:
            key, spec = match.group(1), match.group(2) or ""
            if key == "epoch":
                value: Any = trainer.current_epoch
            elif key == "step":
                value = trainer.global_step
            elif key in metrics:
                value = metrics[key]
            else:
                raise KeyError(
                    f"ModelCheckpoint(filename={self.filename!r}): {key!r} was not logged; logged: {sorted(metrics)}"
                )
            text = format(value, spec)
            return f"{key.replace('/', '_')}={text}" if self.auto_insert_metric_name else text

        return _FIELD.sub(field, self.filename)

    def _unique_path(self, name: str) -> Path:
        assert self.dirpath is not None
        path, n = self.dirpath / name, 0
        while path.exists() or str(path) in self.kept:
            n += 1
            path = self.dirpath / f"{name}-v{n}"
        return path

    def _score(self, trainer: Trainer) -> float | None:
        if self.monitor is None:
            return None
        metrics = trainer.callback_metrics
        if self.monitor not in metrics:
            raise KeyError(
                f"ModelCheckpoint(monitor={self.monitor!r}): the metric was not logged; logged: {sorted(metrics)}"
            )
        return metrics[self.monitor]

    def _better(self, a: float, b: float) -> bool:
        return a < b if self.mode == "min" else a > b

    def _save(self, trainer: Trainer, force_last: bool = False) -> None:
        """Save now; with `force_last` (a stop or preemption) also before the monitored metric exists.

        Nothing is saved under ``fast_dev_run``: its one-step model must never become `last` or `best`.
        """
        if trainer.fast_dev_run:
            return
        if self._shared is not None:  # every process is here: report finished uploads, commit what all finished
            self._shared.exchange()
        ranked = not (force_last and self.monitor is not None and self.monitor not in trainer.callback_metrics)
        score = self._score(trainer) if ranked else None
        if score is not None and math.isnan(score):
            score = math.inf if self.mode == "min" else -math.inf
        try:
            name = self.format_name(trainer)
        except KeyError:
            if not force_last:
                raise
            name = f"stopped-step={trainer.global_step}"  # the template's metrics are not logged yet
        path = self._unique_path(name)
        keep = ranked and self._admits(score)
        if not keep and not (self.save_last or force_last):
            return
        evicted: list[str] = []
        if keep:
            self.kept[str(path)] = score
            evicted = self._evict()
            if score is not None and (self.best_model_score is None or self._better(score, self.best_model_score)):
                self.best_model_path, self.best_model_score = str(path), score
            elif score is None:
                self.best_model_path = str(path)
        # What this save makes obsolete is decided now, against the ranking as this save leaves it: the
        # deletion runs only once this checkpoint is durable (possibly after later saves changed `kept`), and
        # must not remove a checkpoint that was still kept when this one was asked for.
        stale = [old for old in (*evicted, self.last_model_path) if old and old not in self.kept]
        self.last_model_path = str(path)
        self._last_saved_step = trainer.global_step
        self._last_save_time = time.monotonic()

        self._write(trainer, path, stale, set_last=self.save_last or force_last)

    def _write(self, trainer: Trainer, path: Path, stale: list[str], set_last: bool) -> None:
        """Ask for checkpoint `path`; once it is durable (on a store: committed there), delete the local
        checkpoints of `stale` that are still out of the ranking."""
        step = trainer.global_step

        def obsolete() -> list[str]:
            return [old for old in stale if old not in self.kept and old != self.last_model_path]

        def after_write(written: Path) -> None:  # runs once `written` is complete and `last` names it
            if self._shared is not None:
                return
            if self._mirror is None:
                self._remove_in_background(obsolete())
                return
            # The store keeps what the folder keeps; a local checkpoint is deleted only once the uploads
            # queued before (its own among them) are done, on the upload thread.
            keep = {Path(p).name for p in (*self.kept, self.last_model_path) if p}
            remove = functools.partial(self._remove_all, obsolete())
            self._mirror.submit(written, step, set_last, keep, after=remove)

        trainer.save_checkpoint(
            path, self.save_weights_only, async_save=self.async_save, set_last=set_last, on_done=after_write
        )
        if self._shared is not None:  # committed on the store by process 0 once every process uploaded its part
            names = {Path(p).name for p in (*self.kept, self.last_model_path) if p}
            self._shared.add(path, step, set_last, names, after=lambda: self._remove_all(obsolete()))

    def _admits(self, score: float | None) -> bool:
        if self.save_top_k == -1:
            return True
        if self.save_top_k == 0:
            return False
        if score is None or len(self.kept) < self.save_top_k:
            return True
        worst = self._worst()
        return worst is None or self._better(score, worst[1])

    def _worst(self) -> tuple[str, float] | None:
        scored = [(p, s) for p, s in self.kept.items() if s is not None]
        if not scored:
            return None
        return max(scored, key=lambda ps: ps[1]) if self.mode == "min" else min(scored, key=lambda ps: ps[1])

    def _evict(self) -> list[str]:
        evicted = []
        while self.save_top_k >= 0 and len(self.kept) > self.save_top_k:
            if self.monitor is None:
                oldest = next(iter(self.kept))
            else:
                worst = self._worst()
                assert worst is not None
                oldest = worst[0]
            del self.kept[oldest]
            evicted.append(oldest)
        return evicted
