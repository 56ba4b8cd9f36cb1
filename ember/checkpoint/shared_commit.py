"""`SharedCommit`: the checkpoints of a job of several processes committed on a store, no shared folder needed.

With ``ModelCheckpoint(dirpath=URL)`` (or ``default_root_dir=URL``) and several processes, every process
writes its own files of a checkpoint locally (its DCP shards ``__N_<i>.distcp`` and ``rank-N.pt``; process 0
also ``ember.pt`` and DCP's ``.metadata``), into a folder of its own when it does not see process 0's
(`ember.checkpoint.writing.write_checkpoint`). Each process then uploads exactly its own files
(`manifest.writer_rank` says whose a file is) on a thread of its own, and process 0 commits the
checkpoint (the manifest listing every process's files with their sizes and checksums, then ``last``, then
the evictions) only once every process has reported that its upload succeeded.

The reports travel in `SharedCommit.exchange`, a collective on a gloo process group of this object's own,
so it never meets the collectives of a background checkpoint write on the training group. It runs where
every process is at the same point and no step is running:

- at each save (``ModelCheckpoint`` calls it before asking for the next checkpoint), without waiting for
  uploads in flight: a checkpoint every process has finished uploading is committed, the rest at a later
  exchange (so the store's ``last`` trails the newest save by a save interval, more while an upload takes
  longer than one);
- at the end of fit and after a preemption save (``final=True``): every process first waits for its own
  uploads, so the last checkpoint is committed before fit returns.

A process whose upload fails reports the failure: that checkpoint and every later one stay uncommitted
(the store's ``last`` keeps naming the previous one) and the end of fit raises the failure, naming the
process, on every process. A process killed before it reports leaves its checkpoint without a manifest,
which no reader trusts. A fit that fails (an exception on some process) commits nothing more: its
processes may not all reach the final exchange.
"""

from __future__ import annotations

import contextlib
import functools
import queue
import shutil
import threading
from collections.abc import Callable, Collection
from dataclasses import dataclass
from datetime import timedelta
from pathlib import Path
from typing import Any

from ember.checkpoint import manifest
from ember.checkpoint.format import META_FILE, CheckpointWriteError
from ember.checkpoint.store import join, open_store, redact

#: How long an exchange waits for the slowest process (the final one includes its uploads).
EXCHANGE_TIMEOUT_S = 1800.0

#: How often the upload thread looks whether the checkpoint it uploads next is in place.
_POLL_S = 0.02

#: What one process reports for one checkpoint: its uploaded files' manifest entries, or why it failed.
Report = list[dict[str, Any]] | str


@dataclass
class _Save:
    local: Path
    global_step: int | None
    set_last: bool
    keep: frozenset[str]
    after: Callable[[], None] | None

    @property
    def name(self) -> str:
        return self.local.name


class SharedCommit:
    """One process's side of committing a job's checkpoints to the store folder `url` (see the module)."""

    def __init__(self, url: str, rank: int, world_size: int, timeout_s: float = EXCHANGE_TIMEOUT_S) -> None:
        import torch.distributed as dist

        self.url, self.rank, self.world_size = url, rank, world_size
        self.fs, self.root = open_store(url, "ModelCheckpoint(dirpath)")
        # Every process makes it in the same order (ModelCheckpoint.setup): a group of its own, never used by a
        # background write, so an exchange may run while one is in flight.
        self._group = dist.new_group(backend="gloo", timeout=timedelta(seconds=timeout_s))
        self._saves: list[_Save] = []  # asked for, in order; not yet committed or dropped
        self._results: dict[str, Report] = {}  # this process's upload outcomes, written by the upload thread
        self._queue: queue.Queue[Callable[[], None] | None] = queue.Queue()
        self._thread: threading.Thread | None = None
        self._commit_error: BaseException | None = None
        self._written_or_never = threading.Event()  # set at the end: uploads stop waiting for folders
        #: Why a checkpoint could not be committed (the first failure), raised by `close`.
        self.failure: str | None = None
        #: Process 0: the names it committed and may therefore evict.
        self.uploaded: list[str] = []

    def adopt(self, names: Collection[str]) -> None:
        """Count checkpoints of the run this one resumes as committed by this job (they leave the store once
        the callback no longer keeps them)."""
        self.uploaded += [n for n in names if n not in self.uploaded]

    def add(
        self,
        local: Path,
        global_step: int | None,
        set_last: bool,
        keep: Collection[str],
        after: Callable[[], None] | None = None,
    ) -> None:
        """Note checkpoint `local`, just asked for on every process (in the same order everywhere). The upload
        thread uploads this process's files of it as soon as the folder is in place (written, sync or in the
        background); once committed, process 0 points ``last`` at it (`set_last`), evicts the checkpoints it
        committed whose names are not in `keep`, then runs `after`."""
        save = _Save(local, global_step, set_last, frozenset(keep), after)
        self._saves.append(save)
        self._run(functools.partial(self._upload, save))

    def exchange(self, final: bool = False) -> None:
        """Report uploads and commit what every process finished (a collective: every process calls it at the
        same point). With `final`, first upload everything noted and wait for it, so that all is committed
        (or failed) when this returns."""
        if final:  # every write is done (fit waited for them): a folder not there now never will be
            self._written_or_never.set()
            self._drain()
        report = {s.name: self._results[s.name] for s in self._saves if s.name in self._results}
        import torch.distributed as dist

        reports: list[dict[str, Report] | None] = [None] * self.world_size
        dist.all_gather_object(reports, report, group=self._group)
        self._settle([r or {} for r in reports])
        if final:
            self._drain()

    def _settle(self, reports: list[dict[str, Report]]) -> None:
        """Commit (process 0), in order, each checkpoint every process reported on; drop the failed ones."""
        while self._saves:
            save = self._saves[0]
            outcomes = [r.get(save.name) for r in reports]
            if any(outcome is None for outcome in outcomes):
                return  # in order: a later checkpoint never becomes `last` before this one
            self._saves.pop(0)
            self._results.pop(save.name, None)
            failed = [(rank, o) for rank, o in enumerate(outcomes) if isinstance(o, str)]
            if failed and self.failure is None:
                rank, why = failed[0]
                self.failure = f"process {rank} could not upload its files of {save.name}: {why}"
            if self.failure is None and self.rank == 0:
                files = [entry for o in outcomes if isinstance(o, list) for entry in o]
                self._run(functools.partial(self._commit, save, files))
            elif self.rank != 0 and not (save.local / META_FILE).exists():
                shutil.rmtree(save.local, ignore_errors=True)  # this process's own part: on the store now

    def _upload(self, save: _Save) -> None:
        """Upload this process's files of `save` once its folder is in place; record the entries or the error."""
        while not save.local.is_dir() and not self._written_or_never.wait(_POLL_S):
            pass
        try:
            names = [n for n in manifest.local_files(save.local) if manifest.writer_rank(n) == self.rank]
            if not names:
                raise FileNotFoundError(f"no files of process {self.rank} in {save.local}")
            remote = join(self.root, save.name)
            self._results[save.name] = manifest.upload_files(self.fs, save.local, remote, names)
        except Exception as exc:
            self._results[save.name] = f"{type(exc).__name__}: {(str(exc).splitlines() or [''])[0][:200]}"

    def _commit(self, save: _Save, files: list[dict[str, Any]]) -> None:
        """Process 0, on the upload thread: the manifest, then ``last``, then evictions, then `save.after`."""
        if self._commit_error is not None:
            return
        try:
            manifest.write_manifest(self.fs, join(self.root, save.name), files, save.global_step)
            if save.name not in self.uploaded:
                self.uploaded.append(save.name)
            if save.set_last:
                manifest.point_last(self.fs, self.root, save.name)
            for old in [n for n in self.uploaded if n not in save.keep and n != save.name]:
                manifest.remove(self.fs, join(self.root, old))
                self.uploaded.remove(old)
            if save.after is not None:
                save.after()
        except BaseException as exc:
            self._commit_error = exc

    def _run(self, job: Callable[[], None]) -> None:
        if self._thread is None:
            self._thread = threading.Thread(target=self._work, name="ember-store-upload", daemon=True)
            self._thread.start()
        self._queue.put(job)

    def _work(self) -> None:
        while (job := self._queue.get()) is not None:
            try:
                job()
            finally:
                self._queue.task_done()
        self._queue.task_done()

    def _drain(self) -> None:
        if self._thread is not None:
            self._queue.join()

    def close(self, final: bool) -> None:
        """End of fit: with `final` (every process got here normally, or all stopped for a preemption), the
        final `exchange`, then raise the first failure as a `CheckpointWriteError`; without, stop without
        committing more (a failing fit: the other processes may never get here)."""
        try:
            if final:
                self.exchange(final=True)
        finally:
            self._written_or_never.set()
            if self._thread is not None:
                self._queue.put(None)
                if final:
                    self._thread.join()
                self._thread = None
            with contextlib.suppress(Exception):
                import torch.distributed as dist

                dist.destroy_process_group(self._group)
        error = self.failure
        if error is None and self._commit_error is not None:
            error = f"{type(self._commit_error).__name__}: {str(self._commit_error)[:200]}"
        if final and error is not None:
            raise CheckpointWriteError(
                f"committing checkpoints to {redact(self.url)} failed: {error}; the store's 'last' names the last "
                "checkpoint every process uploaded (resume from it, or from the local checkpoints)"
            )
