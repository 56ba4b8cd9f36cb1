"""The process that uploads a run's checkpoints to a store, so that the upload never holds the training loop's GIL.

An fsspec client for a real store (s3fs, gcsfs: an asyncio loop signing and sending requests) runs Python
between its reads and writes; on a thread of the training process it holds the GIL there, and every short
operation of the loop (the snapshot copy of an async save is hundreds of them) waits for it. `UploadProcess`
starts one worker process per fit instead and hands it one checkpoint at a time over a pipe: a JSON line
in (the local directory, its name, what to evict), a JSON line out (done, or the error). The worker
commits exactly as an upload thread would (`commit`: files, then the manifest, then ``last``, then the
evictions, manifest first); the caller waits for each answer, so uploads stay in the order they were asked for.

The worker imports only what an upload needs: ``ember.checkpoint.manifest`` and ``store`` (and, through
them, ``format``), fsspec and the store's client; never torch. It reads ember's modules from the same
folder as the training process, with the packages' ``__init__`` left out (they import torch). It leaves
signals to the training process (Ctrl-C in a terminal, SIGTERM and the requeue signals reach the whole
process group; the training process decides when to stop): it ignores SIGINT, SIGTERM, SIGUSR1 and
SIGUSR2, and ends when its input closes. If the training process dies (``kill -9``), the worker ends
within `_WATCH_S` seconds, so nothing is uploaded on behalf of a process that is gone.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Collection
from pathlib import Path
from typing import IO, Any

from ember.checkpoint import manifest
from ember.checkpoint.store import join, open_store

#: How often the worker checks that the training process is still its parent.
_WATCH_S = 0.05
#: How long `UploadProcess.close` waits for the worker to exit before killing it.
_EXIT_TIMEOUT_S = 30.0

# Run with ``python -c``: ember's packages as bare namespaces (their __init__ imports torch), then `serve`.
_BOOT = """
import sys, types
for name, path in (("ember", sys.argv[1]), ("ember.checkpoint", sys.argv[2])):
    package = types.ModuleType(name)
    package.__path__ = [path]
    sys.modules[name] = package
from ember.checkpoint.upload_process import serve
serve(sys.argv[3], int(sys.argv[4]))
"""


def commit(fs: Any, root: str, local: Path, global_step: int | None, set_last: bool, evict: Collection[str]) -> None:
    """Commit checkpoint directory `local` in folder `root` of `fs` under its own name (files, then the manifest),
    point ``last`` at it when `set_last`, then delete the checkpoints named in `evict` (each manifest first)."""
    name = local.name
    manifest.upload(fs, local, join(root, name), global_step)
    if set_last:
        manifest.point_last(fs, root, name)
    for old in evict:
        manifest.remove(fs, join(root, old))


class UploadFailed(RuntimeError):
    """An upload the worker process could not do, or the worker's end; ``kind`` names the error it met."""

    def __init__(self, kind: str, message: str) -> None:
        super().__init__(message)
        self.kind = kind


class UploadProcess:
    """One worker process that commits checkpoints to the store folder `url` (see the module docstring)."""

    def __init__(self, url: str) -> None:
        self.url = url
        package = Path(__file__).resolve().parent
        argv = [sys.executable, "-c", _BOOT, str(package.parent), str(package), url, str(os.getpid())]
        self._proc = subprocess.Popen(argv, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, encoding="utf-8")
        #: The worker's process id.
        self.pid = self._proc.pid

    def _ask(self, request: dict[str, Any]) -> dict[str, Any]:
        stdin, stdout = self._proc.stdin, self._proc.stdout
        assert stdin is not None and stdout is not None
        try:
            stdin.write(json.dumps(request) + "\n")
            stdin.flush()
            line = stdout.readline()
        except (BrokenPipeError, ValueError):  # its end of the pipe is gone, or ours was closed
            line = ""
        if not line:
            code = self._proc.wait()
            raise UploadFailed("UploadProcessEnded", f"the upload process ended unexpectedly (exit status {code})")
        answer: dict[str, Any] = json.loads(line)
        return answer

    def commit(self, local: Path, global_step: int | None, set_last: bool, evict: Collection[str]) -> None:
        """`commit` `local` in the worker; returns once it is done, raises `UploadFailed` if it failed."""
        job = {"local": str(local), "step": global_step, "set_last": set_last, "evict": list(evict)}
        answer = self._ask({"commit": job})
        if "error" in answer:
            raise UploadFailed(answer["error"], answer["message"])

    def imported(self) -> list[str]:
        """The top-level packages the worker has imported (sorted): what it costs, for the checks that it
        stays small."""
        modules: list[str] = self._ask({"imported": True})["modules"]
        return modules

    def close(self) -> None:
        """End the worker (its input closed) and wait for it; one that does not exit in time is killed."""
        if self._proc.stdin is not None and not self._proc.stdin.closed:
            with contextlib.suppress(BrokenPipeError):  # the worker is gone already
                self._proc.stdin.close()
        try:
            self._proc.wait(timeout=_EXIT_TIMEOUT_S)
        except subprocess.TimeoutExpired:
            self._proc.kill()
            self._proc.wait()
        if self._proc.stdout is not None:
            self._proc.stdout.close()


def serve(url: str, parent: int) -> None:
    """The worker's main loop: one JSON request per line on stdin, one JSON answer per line on stdout, until
    stdin closes. Anything else that writes to stdout is sent to stderr instead."""
    answers: IO[str] = os.fdopen(os.dup(1), "w", encoding="utf-8")
    os.dup2(2, 1)
    sys.stdout = sys.stderr
    for name in ("SIGINT", "SIGTERM", "SIGUSR1", "SIGUSR2"):
        if hasattr(signal, name):
            signal.signal(getattr(signal, name), signal.SIG_IGN)
    threading.Thread(target=_watch, args=(parent,), name="ember-upload-watch", daemon=True).start()
    try:
        fs, root = open_store(url, "ModelCheckpoint(dirpath)")
        failure: Exception | None = None
    except Exception as exc:  # answered to every request: the training process reports it
        failure = exc
    for line in sys.stdin:
        request = json.loads(line)
        answer: dict[str, Any] = {"done": True}
        try:
            if "imported" in request:
                answer = {"modules": sorted({name.split(".")[0] for name in sys.modules})}
            elif failure is not None:
                raise failure
            else:
                job = request["commit"]
                commit(fs, root, Path(job["local"]), job["step"], job["set_last"], job["evict"])
        except Exception as exc:
            answer = {"error": type(exc).__name__, "message": (str(exc).splitlines() or [""])[0][:500]}
        answers.write(json.dumps(answer) + "\n")
        answers.flush()


def _watch(parent: int) -> None:
    """End this process at once when `parent` (the training process) is no longer its parent: it died."""
    while os.getppid() == parent:
        time.sleep(_WATCH_S)
    os._exit(1)
