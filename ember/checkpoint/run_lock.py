"""One writer per run: the lock a fit holds on its run directory while it writes there.

A fit (process 0 of a job) holds ``<run dir>/.writer-<N>.lock`` from before it writes anything into the run
(logs, config, checkpoints) until it ends, on success, on an error and on a preemption exit alike. A second
process that wants to write the same run (``ember fit --resume last`` twice) is refused at once with
`RunLockedError`, naming the holder. The file is JSON: the holder's host, a machine identity (boot id and
PID namespace), its pid and that process's start time, since when it holds the run, and a random token. Its
modification time is the holder's heartbeat, refreshed by a background thread every quarter of the timeout.

A lock is stale, and the next claim takes the run over, when

- its holder ran on this host (same host name, boot id and PID namespace) and that process is gone (its pid
  no longer exists, is a zombie, or is now another process, started at another time), or
- its heartbeat is older than the timeout: ``EMBER_RUN_LOCK_TIMEOUT_S`` seconds, 120 by default (a holder on
  a lost node). The age is measured against the filesystem's own clock (the modification time of a file
  created for the purpose), so clocks that differ between nodes do not shorten it.

Claims never overwrite or rename another's lock: claim number N+1 is a new file, created complete (written
under a temporary name, then hard-linked to its name, which fails when the name exists), so of two processes
claiming at the same instant exactly one creates it. The winner then checks that no other claim is alive or
newer than its own (else it withdraws), and only then deletes the dead ones below. A holder whose heartbeat
finds its file gone or a newer claim beside it (it stalled past the timeout and was taken over) has lost the
run: its next checkpoint write raises instead (`RunLock.check`).
"""

from __future__ import annotations

import atexit
import contextlib
import json
import os
import random
import re
import socket
import threading
import time
import uuid
from dataclasses import asdict, dataclass
from pathlib import Path

from ember.checkpoint.format import CheckpointError

#: The environment variable that sets the heartbeat timeout, in seconds.
TIMEOUT_ENV = "EMBER_RUN_LOCK_TIMEOUT_S"
DEFAULT_TIMEOUT_S = 120.0

_NAME = re.compile(r"\.writer-(\d+)\.lock")
_TEMP_PREFIX = ".writer-tmp-"
_ATTEMPTS = 20  # claims that lost a race to a newer one before giving up (each retry re-reads the run)
_READ_LIMIT = 4096


class RunLockedError(CheckpointError):
    """Another process writes this run (or took it over from this one)."""


def timeout_s() -> float:
    """The heartbeat timeout: ``EMBER_RUN_LOCK_TIMEOUT_S``, else 120 s."""
    text = os.environ.get(TIMEOUT_ENV)
    if text is None:
        return DEFAULT_TIMEOUT_S
    try:
        value = float(text)
    except ValueError:
        value = -1.0
    if not value > 0:
        raise CheckpointError(
            f"{TIMEOUT_ENV}={text!r}: expected a number of seconds > 0 (default {DEFAULT_TIMEOUT_S:g})"
        )
    return value


@dataclass(frozen=True)
class Holder:
    """Who holds a run: read back from a lock file (data, type-checked) or made for this process."""

    host: str
    machine: str  # boot id and PID namespace: the pid is meaningful only where these match
    pid: int
    process_start: str  # the process's start time in clock ticks since boot ("" where unknown)
    since: float  # seconds since the epoch
    token: str

    @classmethod
    def of_this_process(cls) -> Holder:
        pid = os.getpid()
        return cls(socket.gethostname(), _machine(), pid, _process_start(pid), time.time(), uuid.uuid4().hex)

    @classmethod
    def parse(cls, data: bytes) -> Holder | None:
        """The holder a lock file names; None when it is not a lock ember wrote."""
        try:
            fields = json.loads(data.decode("utf-8"))
            holder = cls(**fields)
        except (ValueError, TypeError):
            return None
        kinds: dict[str, type | tuple[type, ...]] = {
            "host": str, "machine": str, "pid": int, "process_start": str, "since": (int, float), "token": str,
        }  # fmt: skip
        return holder if all(isinstance(getattr(holder, k), t) for k, t in kinds.items()) else None

    def is_on_this_host(self) -> bool:
        return self.host == socket.gethostname() and self.machine == _machine()

    def is_alive_here(self) -> bool:
        """Whether the holder's process still runs (only meaningful when it ran on this host)."""
        if self.pid <= 0:
            return False  # not a process (0 and -1 would signal a group)
        try:
            os.kill(self.pid, 0)
        except ProcessLookupError:
            return False
        except PermissionError:
            pass  # another user's process: it exists
        state, start = _process_stat(self.pid)
        if state == "Z":
            return False  # killed, not yet reaped: it writes nothing more
        return not (start and self.process_start and start != self.process_start)  # else the pid was reused

    def describe(self, heartbeat_age_s: float | None) -> str:
        since = time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(self.since))
        beat = "" if heartbeat_age_s is None else f", last heartbeat {max(heartbeat_age_s, 0.0):.0f} s ago"
        return f"pid {self.pid} on host {self.host} since {since}{beat}"


class RunLock:
    """This process's claim on a run directory; `acquire` makes one, `release` ends it."""

    def __init__(self, run_dir: Path, path: Path, holder: Holder, timeout: float) -> None:
        self.run_dir, self.path, self.holder, self.timeout_s = run_dir, path, holder, timeout
        self._lost: str | None = None
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._beat_until_released, name="ember-run-lock", daemon=True)
        self._thread.start()
        atexit.register(self.release)

    @classmethod
    def acquire(cls, run_dir: Path, timeout: float | None = None) -> RunLock:
        """Claim `run_dir` for this process; `RunLockedError` (naming the holder) when another process holds it."""
        timeout = timeout_s() if timeout is None else timeout
        me = Holder.of_this_process()
        run_dir.mkdir(parents=True, exist_ok=True)
        return cls(run_dir, _claim(run_dir, me, timeout), me, timeout)

    def check(self) -> None:
        """Raise `RunLockedError` when this process lost the run to another (before it writes a checkpoint)."""
        if self._lost is not None:
            raise RunLockedError(
                f"this process no longer holds run {self.run_dir} ({self._lost}); it writes no checkpoint there. "
                f"Its heartbeat stalled past {self.timeout_s:g} s ({TIMEOUT_ENV}), so another process took the run over"
            )

    def release(self) -> None:
        """Stop the heartbeat and remove the lock file (once; a forked child never removes its parent's)."""
        if os.getpid() != self.holder.pid or self._stop.is_set():
            return
        self._stop.set()
        if self._thread is not threading.current_thread():
            self._thread.join()
        atexit.unregister(self.release)
        if self._lost is None:
            _unlink(self.path)

    def _beat_until_released(self) -> None:
        while not self._stop.wait(self.timeout_s / 4):
            try:
                os.utime(self.path)
            except FileNotFoundError:  # taken over (or removed by hand): claim the run again if nobody holds it
                try:
                    self.path = _claim(self.run_dir, self.holder, self.timeout_s)
                except RunLockedError as exc:
                    self._lost = str(exc).split(". A run has one writer")[0]
                    return
            except OSError:
                pass  # a passing filesystem error: the next beat tries again


def _claim(run_dir: Path, me: Holder, timeout: float) -> Path:
    """Create the next claim on `run_dir` for `me` and keep it if every other claim is older and dead."""
    for _ in range(_ATTEMPTS):
        claims = _claims(run_dir)
        for path in claims.values():
            _refuse_if_live(run_dir, path, timeout)
        path = run_dir / f".writer-{max(claims, default=-1) + 1}.lock"
        if _create(path, json.dumps(asdict(me)).encode()) and _keeps(run_dir, path, timeout):
            for n, other in _claims(run_dir).items():
                if n < _generation(path.name):
                    _unlink(other)  # dead: `_keeps` checked
            return path
        time.sleep(random.uniform(0.005, 0.05))  # another claim at the same instant: look again
    raise RunLockedError(f"run {run_dir}: other processes kept claiming it at the same time as this one; try again")


def _judge(path: Path, timeout: float) -> tuple[bool, Holder | None, float | None]:
    """(whether the claim `path` is alive, its holder, its heartbeat age when that decided)."""
    holder = _read(path)
    if holder is not None and holder.is_on_this_host():
        return holder.is_alive_here(), holder, None
    age = _heartbeat_age(path)
    return age is not None and age <= timeout, holder, age


def is_held(run_dir: Path) -> bool | None:
    """Whether a live process holds `run_dir`'s writer lock; None when the run has no lock file at all."""
    claims = _claims(run_dir)
    if not claims:
        return None
    timeout = timeout_s()
    return any(_judge(path, timeout)[0] for path in claims.values())


def _refuse_if_live(run_dir: Path, path: Path, timeout: float) -> None:
    live, holder, age = _judge(path, timeout)
    if not live:
        return
    who = holder.describe(age) if holder is not None else f"a process whose lock {path.name} is unreadable"
    raise RunLockedError(
        f"run {run_dir} is being written by another process: {who} (lock {path.name}). A run has one writer: wait "
        f"for it to finish, or stop it; a holder that died is noticed at once on its own host, and elsewhere "
        f"{timeout:g} s after its last heartbeat ({TIMEOUT_ENV})"
    )


def _keeps(run_dir: Path, mine: Path, timeout: float) -> bool:
    """After creating `mine`: whether every other claim is older and dead (else withdraw it)."""
    generation = _generation(mine.name)
    for n, path in _claims(run_dir).items():
        if path != mine and (n > generation or _judge(path, timeout)[0]):
            _unlink(mine)
            return False
    return True


def _claims(run_dir: Path) -> dict[int, Path]:
    """The lock files of `run_dir`, by claim number."""
    try:
        names = os.listdir(run_dir)
    except FileNotFoundError:
        return {}
    found = {int(m.group(1)): run_dir / name for name in names if (m := _NAME.fullmatch(name))}
    return dict(sorted(found.items()))


def _generation(name: str) -> int:
    match = _NAME.fullmatch(name)
    assert match is not None
    return int(match.group(1))


def _create(path: Path, content: bytes) -> bool:
    """Create `path` holding `content`, complete when it appears; False when the name exists."""
    temp = path.with_name(f"{_TEMP_PREFIX}{uuid.uuid4().hex}")
    with open(temp, "xb") as f:
        f.write(content)
        f.flush()
        os.fsync(f.fileno())
    try:
        os.link(temp, path)
        return True
    except FileExistsError:
        return os.stat(temp).st_nlink == 2  # NFS: a retried link whose first attempt succeeded
    except OSError:  # no hard links on this filesystem: an exclusive create (briefly empty; see `_refuse_if_live`)
        return _create_exclusive(path, content)
    finally:
        _unlink(temp)


def _create_exclusive(path: Path, content: bytes) -> bool:
    try:
        fd = os.open(path, os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o644)
    except FileExistsError:
        return False
    try:
        os.write(fd, content)
        os.fsync(fd)
    finally:
        os.close(fd)
    return True


def _read(path: Path) -> Holder | None:
    try:
        with open(path, "rb") as f:
            return Holder.parse(f.read(_READ_LIMIT))
    except OSError:
        return None


def _heartbeat_age(path: Path) -> float | None:
    """Seconds since `path` was last touched, by the filesystem's clock; None when it is gone."""
    try:
        beat = os.stat(path).st_mtime
    except FileNotFoundError:
        return None
    return _filesystem_now(path.parent) - beat


def _filesystem_now(folder: Path) -> float:
    """The time by the clock that stamps files in `folder` (on NFS, the server's)."""
    probe = folder / f"{_TEMP_PREFIX}{uuid.uuid4().hex}"
    try:
        probe.touch(exist_ok=False)
        return probe.stat().st_mtime
    except OSError:
        return time.time()
    finally:
        _unlink(probe)


def _unlink(path: Path) -> None:
    with contextlib.suppress(FileNotFoundError):
        os.unlink(path)


def _machine() -> str:
    """This machine and PID namespace: a pid names the same process only where both match."""
    parts = []
    try:
        parts.append(Path("/proc/sys/kernel/random/boot_id").read_text().strip())
        parts.append(os.readlink("/proc/self/ns/pid"))
    except OSError:
        pass
    return "/".join(parts)


def _process_start(pid: int) -> str:
    return _process_stat(pid)[1]


def _process_stat(pid: int) -> tuple[str, str]:
    """(state, start time in clock ticks since boot) of process `pid` from /proc; ("", "") where unknown."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return "", ""
    fields = stat[stat.rfind(")") + 2 :].split()  # the command name, in parentheses, may hold spaces
    return (fields[0], fields[19]) if len(fields) > 19 else ("", "")
