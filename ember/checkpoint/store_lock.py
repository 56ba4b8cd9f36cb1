"""One writer per run on object storage: the lock a fit holds on its run's URL (``default_root_dir`` a URL).

A run on a store is staged locally on each machine, so the local run lock (`ember.checkpoint.run_lock`) cannot
see a second writer on another machine (two ``ember fit --resume last`` on two machines continue the same
``version_N``). Process 0 of a fit therefore also holds ``<run URL>/.writer-<N>.lock`` on the store, from
before it writes anything there until it ends, by the same rules as the local lock:

- a claim is a new object, created with a conditional write (``If-None-Match: *`` on S3 through s3fs, an
  exclusive create on ``memory://``), holding the run lock's `Holder` fields (host, machine identity, pid and
  its start time, since when, a token); of two processes claiming at the same instant exactly one creates it,
  and the winner withdraws when another claim is alive or newer;
- the holder rewrites its object every quarter of the timeout (its heartbeat: a store has no ``utime``);
- a claim is stale, and the next one takes the run over, when its holder ran on this host and its process is
  gone, or when its heartbeat is older than ``EMBER_RUN_LOCK_TIMEOUT_S`` (120 s by default) by the store's
  own clock (the modification time of an object written for the purpose), so a writer killed on another
  machine frees the run after the timeout;
- a holder whose object was removed or overtaken by a newer claim has lost the run: its next checkpoint
  write raises (`StoreRunLock.check`).

On a store whose client cannot write conditionally the claim is "check, then write": two processes starting
within the same instant could both believe they hold the run (docs/checkpoints.md says so).
"""

from __future__ import annotations

import contextlib
import json
import re
import threading
import uuid
from dataclasses import asdict
from typing import Any

from ember.checkpoint.run_lock import TIMEOUT_ENV, Holder, RunLockedError, timeout_s
from ember.checkpoint.store import join, open_store, redact

_NAME = re.compile(r"\.writer-(\d+)\.lock")
_ATTEMPTS = 20
_READ_LIMIT = 4096


class StoreRunLock:
    """This process's claim on a run on a store; `acquire` makes one, `release` ends it."""

    def __init__(self, url: str, fs: Any, root: str, path: str, holder: Holder, timeout: float) -> None:
        self.url, self.fs, self.root, self.path, self.holder, self.timeout_s = url, fs, root, path, holder, timeout
        self._data = json.dumps(asdict(holder)).encode("utf-8")
        self._lost: str | None = None
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._beat_until_released, name="ember-store-lock", daemon=True)
        self._thread.start()

    @classmethod
    def acquire(cls, url: str, timeout: float | None = None) -> StoreRunLock:
        """Claim the run at `url` for this process; `RunLockedError` (one line, naming the holder) when another
        process holds it."""
        timeout = timeout_s() if timeout is None else timeout
        fs, root = open_store(url, "default_root_dir")
        me = Holder.of_this_process()
        data = json.dumps(asdict(me)).encode("utf-8")
        return cls(url, fs, root, _claim(url, fs, root, data, timeout), me, timeout)

    def check(self) -> None:
        """Raise `RunLockedError` when another process took the run over (before this one writes a checkpoint)."""
        if self._lost is not None:
            raise RunLockedError(
                f"this process no longer holds run {redact(self.url)} ({self._lost}); it writes no checkpoint "
                f"there. Its heartbeat stalled past {self.timeout_s:g} s ({TIMEOUT_ENV}), so another process took "
                "the run over"
            )

    def release(self) -> None:
        """Stop the heartbeat and remove the claim while it still is this process's (its object holds this
        holder's token: a claim number freed by a takeover may have been taken again); a store error is
        ignored (the claim then goes stale after the timeout)."""
        if self._stop.is_set():
            return
        self._stop.set()
        if self._thread is not threading.current_thread():
            self._thread.join()
        with contextlib.suppress(Exception):
            holder = _read(self.fs, self.path)
            if holder is not None and holder.token == self.holder.token:
                self.fs.rm_file(self.path)

    def beat(self) -> None:
        """Refresh the heartbeat now: rewrite this claim, unless it is gone or a newer claim exists (lost)."""
        mine = _generation(self.path)
        claims = _claims(self.fs, self.root)
        if claims.get(mine) != self.path or any(n > mine for n in claims):
            self._lost = "its lock on the store was removed or overtaken by a newer claim"
            return
        self.fs.pipe_file(self.path, self._data)

    def _beat_until_released(self) -> None:
        while not self._stop.wait(self.timeout_s / 4):
            try:
                self.beat()
            except Exception:
                continue  # the store is briefly unreachable: the next beat tries again
            if self._lost is not None:
                return


def _claim(url: str, fs: Any, root: str, data: bytes, timeout: float) -> str:
    """Create the next claim on the run at `root` and keep it if every other claim is older and dead."""
    for _ in range(_ATTEMPTS):
        claims = _claims(fs, root)
        for path in claims.values():
            _refuse_if_live(url, fs, root, path, timeout)
        path = join(root, f".writer-{max(claims, default=-1) + 1}.lock")
        try:
            fs.pipe_file(path, data, mode="create")
        except FileExistsError:  # another claim took this number at the same instant: look again
            continue
        if _keeps(fs, root, path, timeout):
            for n, other in _claims(fs, root).items():
                if n < _generation(path):
                    with contextlib.suppress(FileNotFoundError):
                        fs.rm_file(other)  # dead: `_keeps` checked
            return path
    raise RunLockedError(f"run {redact(url)}: other processes kept claiming it at the same time as this one; try again")


def _claims(fs: Any, root: str) -> dict[int, str]:
    """The lock objects of the run at `root`, by claim number."""
    try:
        refresh = {"refresh": True} if getattr(fs, "async_impl", False) else {}  # s3fs, gcsfs cache listings
        entries = fs.ls(root, detail=False, **refresh)
    except FileNotFoundError:
        return {}
    found = {}
    for entry in entries:
        name = str(entry).rstrip("/").rsplit("/", 1)[-1]
        if match := _NAME.fullmatch(name):
            found[int(match.group(1))] = join(root, name)
    return dict(sorted(found.items()))


def _generation(path: str) -> int:
    match = _NAME.fullmatch(path.rsplit("/", 1)[-1])
    assert match is not None, path
    return int(match.group(1))


def _judge(fs: Any, root: str, path: str, timeout: float) -> tuple[bool, Holder | None, float | None]:
    """(whether the claim `path` is alive, its holder, its heartbeat age when that decided)."""
    holder = _read(fs, path)
    if holder is not None and holder.is_on_this_host():
        return holder.is_alive_here(), holder, None
    age = _heartbeat_age(fs, root, path)
    return age is not None and age <= timeout, holder, age


def _refuse_if_live(url: str, fs: Any, root: str, path: str, timeout: float) -> None:
    live, holder, age = _judge(fs, root, path, timeout)
    if not live:
        return
    name = path.rsplit("/", 1)[-1]
    who = holder.describe(age) if holder is not None else f"a process whose lock {name} is unreadable"
    raise RunLockedError(
        f"run {redact(url)} is being written by another process: {who} (lock {name} on the store). A run has "
        f"one writer: wait for it to finish, or stop it; a holder that died is noticed at once on its own host, "
        f"and elsewhere {timeout:g} s after its last heartbeat ({TIMEOUT_ENV})"
    )


def _keeps(fs: Any, root: str, mine: str, timeout: float) -> bool:
    """After creating `mine`: whether every other claim is older and dead (else withdraw it)."""
    generation = _generation(mine)
    for n, path in _claims(fs, root).items():
        if path != mine and (n > generation or _judge(fs, root, path, timeout)[0]):
            with contextlib.suppress(FileNotFoundError):
                fs.rm_file(mine)
            return False
    return True


def _read(fs: Any, path: str) -> Holder | None:
    try:
        if (fs.size(path) or 0) > _READ_LIMIT:
            return None
        return Holder.parse(fs.cat_file(path))
    except (OSError, ValueError):
        return None


def _heartbeat_age(fs: Any, root: str, path: str) -> float | None:
    """Seconds since the claim `path` was last written, by the store's clock; None when it is gone."""
    try:
        beat = fs.modified(path).timestamp()
    except FileNotFoundError:
        return None
    probe = join(root, f".writer-probe-{uuid.uuid4().hex}")
    try:
        fs.pipe_file(probe, b"")
        now = fs.modified(probe).timestamp()
    finally:
        with contextlib.suppress(Exception):
            fs.rm_file(probe)
    return float(now - beat)
