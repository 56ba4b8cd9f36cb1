"""`StoreMirror`: a run's checkpoints copied to object storage in the background, committed by manifest.

``ModelCheckpoint(dirpath="s3://bucket/ckpts")`` writes each checkpoint locally first (atomically, in the
run directory, as always); once it is durable, the mirror's one thread has it uploaded (`manifest.upload`:
files, then the manifest), points the store's ``last`` at it, and only then deletes from the store the
checkpoints the callback no longer keeps (manifest first). Uploads run in the order they were asked for,
so the store's ``last`` only ever moves forward, and training never waits for the network: the loop pays
for queueing a path. `wait` (the end of fit) lets the queue drain and raises the first failure.

The uploading itself runs in a worker process started with the mirror (`ember.checkpoint.upload_process`):
the thread only hands it each checkpoint and waits for its answer, so the store's client never holds the
training process's GIL. fsspec's ``memory://`` store exists only inside this process, so it is written
from the thread itself.
"""

from __future__ import annotations

import queue
import threading
from collections.abc import Callable, Collection
from dataclasses import dataclass
from pathlib import Path

from ember.checkpoint import upload_process
from ember.checkpoint.format import CheckpointWriteError
from ember.checkpoint.store import open_store, redact

#: Stores that live inside this process (another process cannot reach them): uploaded from the thread.
_IN_PROCESS = frozenset({"memory"})


@dataclass(frozen=True)
class _Upload:
    local: Path
    global_step: int | None
    set_last: bool
    keep: frozenset[str]
    after: Callable[[], None] | None


class StoreMirror:
    """Uploads checkpoint directories to the folder `url` on a store, one at a time, in the background: from a
    worker process (started here, ended by `close`), or from its thread for a store inside this process."""

    def __init__(self, url: str) -> None:
        self.url = url
        self.fs, self.root = open_store(url, "ModelCheckpoint(dirpath)")
        in_process = url.split("://", 1)[0] in _IN_PROCESS
        self._process = None if in_process else upload_process.UploadProcess(url)
        self._queue: queue.Queue[_Upload | None] = queue.Queue()
        self._thread: threading.Thread | None = None
        self._error: BaseException | None = None
        #: Names this mirror committed and may therefore evict.
        self.uploaded: list[str] = []

    def adopt(self, names: Collection[str]) -> None:
        """Count checkpoints of the run this one resumes (by name, in this folder) as this mirror's own, so
        that they leave the store once the callback no longer keeps them."""
        self.uploaded += [n for n in names if n not in self.uploaded]

    def submit(
        self,
        local: Path,
        global_step: int | None,
        set_last: bool,
        keep: Collection[str],
        after: Callable[[], None] | None = None,
    ) -> None:
        """Queue checkpoint `local` (complete on disk); once it is committed, checkpoints this mirror uploaded
        whose names are not in `keep` are deleted from the store, then `after` runs (on the upload thread:
        the caller deletes local checkpoints there, which uploads queued earlier may still be reading)."""
        if self._thread is None:
            self._thread = threading.Thread(target=self._work, name="ember-store-upload", daemon=True)
            self._thread.start()
        self._queue.put(_Upload(local, global_step, set_last, frozenset(keep), after))

    def _work(self) -> None:
        while (job := self._queue.get()) is not None:
            try:
                if self._error is None:  # after a failure, later uploads are not attempted (wait reports it)
                    self._upload(job)
            except BaseException as exc:
                self._error = exc
            finally:
                self._queue.task_done()
        self._queue.task_done()

    def wait_ready(self) -> None:
        """Block until an upload would start at once: the worker process has imported the store's client and
        opened the store (about a second after the mirror is made). Nothing needs this to be correct;
        uploads asked for earlier wait in the queue."""
        if self._process is not None:
            self._process.imported()

    @property
    def upload_pid(self) -> int | None:
        """The process id of the worker that uploads (None when the thread uploads itself)."""
        return None if self._process is None else self._process.pid

    def _upload(self, job: _Upload) -> None:
        name = job.local.name
        evict = [n for n in self.uploaded if n not in job.keep and n != name]
        if self._process is None:
            upload_process.commit(self.fs, self.root, job.local, job.global_step, job.set_last, evict)
        else:
            self._process.commit(job.local, job.global_step, job.set_last, evict)
        if name not in self.uploaded:
            self.uploaded.append(name)
        for old in evict:
            self.uploaded.remove(old)
        if job.after is not None:
            job.after()

    def wait(self) -> None:
        """Block until every queued upload is done; raise the first failure as a `CheckpointWriteError`."""
        if self._thread is not None:
            self._queue.join()
        if self._error is not None:
            error, self._error = self._error, None
            kind = error.kind if isinstance(error, upload_process.UploadFailed) else type(error).__name__
            raise CheckpointWriteError(
                f"uploading checkpoints to {redact(self.url)} failed: {kind}: "
                f"{str(error).splitlines()[0][:200] if str(error) else ''}; the local checkpoints in the run "
                "directory are complete (resume from them, or copy them to the store)"
            ) from None

    def close(self) -> None:
        """`wait`, then stop the thread and the worker process."""
        try:
            self.wait()
        finally:
            if self._thread is not None:
                self._queue.put(None)
                self._thread.join()
                self._thread = None
            process, self._process = self._process, None
            if process is not None:
                process.close()
