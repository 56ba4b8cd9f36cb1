"""The logger guard: every call the trainer makes into a logger goes through it, so a logger never blocks or stops
training.

Each logger gets a `Channel`: a thread of its own that makes the logger's calls in order, fed by a bounded
queue, so the training thread only appends to a list. A channel is **healthy** until a call raises, runs longer
than ``timeout_s``, or ``MAX_PENDING`` calls wait behind a slow one; then it is **degraded** and says so in one
line on stderr. A degraded channel sends nothing: the logger's calls are kept (in memory and in
``<run dir>/unsent/<n>-<LoggerClass>.jsonl``, `ember.loggers.unsent`) and, every ``retry_every_s`` and once
more at the end of the run, replayed on the channel's thread; when a replay goes through, the channel is
healthy again. A call that was abandoned and later returns counts the same way: its success brings a replay,
its failure keeps its values.

At the end of a run (`LoggerGuard.finalize`) the guard waits at most ``timeout_s`` for the loggers to finish,
then prints what did not reach each logger and the one-line command that sends it.

What a logger must do for this (`Logger`): a call that raises leaves what the logger was given before it queued
in the logger (a later ``save`` writes it); loggers that write on ``save`` (``holds_until_save``) count as
having delivered a value only once a ``save`` after it returned. Calls that read live tensors (histograms)
are the one kind the training thread waits for, at most ``timeout_s``; a degraded channel drops them.
"""

from __future__ import annotations

import bisect
import contextlib
import itertools
import sys
import threading
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from ember.loggers import unsent
from ember.loggers.logger import Logger

#: How long one logger call may take before the logger counts as failing (the Trainer's ``logger_timeout_s``).
TIMEOUT_S = 5.0
#: A logger's first call may take this many times ``timeout_s`` (at most a minute): it imports and starts.
STARTUP_FACTOR = 12
#: How often a failing logger is tried again during a run (and once more at its end).
RETRY_EVERY_S = 30.0
#: Calls waiting for one logger before it counts as stuck (the queue's bound).
MAX_PENDING = 1000
#: Calls a failing logger keeps in memory; later ones are still in its file, when that can be written.
MAX_KEPT = 100_000

_ids = itertools.count()


@dataclass(order=True)
class Call:
    """One call into a logger; `seq` orders a logger's calls across queue, replays and files."""

    seq: int
    name: str = field(compare=False)
    args: tuple[Any, ...] = field(compare=False, default=())
    done: threading.Event | None = field(compare=False, default=None)

    @property
    def is_kept(self) -> bool:
        """Whether a failing logger keeps this call (to replay it); ``save`` and histograms are not kept."""
        return self.name in unsent.KEPT_CALLS


class Channel:
    """One logger's calls: its thread, its queue, its health, what it could not send (see the module docstring)."""

    def __init__(self, logger: Logger, index: int, timeout_s: float = TIMEOUT_S) -> None:
        self.logger = logger
        self.index = index
        self.timeout_s = timeout_s
        self.retry_every_s = RETRY_EVERY_S
        self.unsent_path: Path | None = None
        self._cond = threading.Condition()
        self._pending: deque[Call] = deque()
        self._running: Call | None = None
        self._running_since = 0.0
        self._thread: threading.Thread | None = None
        self._closing = False
        self.degraded = False
        self.reason: str | None = None
        self.failures = 0
        self.recoveries = 0
        self.dropped = 0  # calls not kept (histograms while degraded, or beyond MAX_KEPT)
        self._kept: list[Call] = []  # never handed to the logger, by seq
        self._unconfirmed: list[Call] = []  # handed over, not yet followed by a successful save
        self._next_retry = 0.0
        self._calls_done = 0
        self._file_error: str | None = None
        self._warned = False

    @property
    def name(self) -> str:
        return type(self.logger).__name__

    # --- the training thread ----------------------------------------------------------------------------
    def submit(self, call: Call) -> None:
        """Queue `call` (healthy) or keep it (degraded); never waits."""
        with self._cond:
            message = self._check(time.monotonic())
            if not self.degraded:
                self._pending.append(call)
            else:
                self._keep(call)
            self._ensure_thread()
            self._cond.notify_all()
        self._say(message)

    def wait(self, call: Call | None) -> bool:
        """Wait until `call` is done (None: until nothing is queued or running), as long as the call running now is
        within its time bound (`bound_s`); a call past it degrades the channel. Returns whether it finished."""
        with self._cond:
            message = self._wait_until(
                lambda: self.degraded or (call.done.is_set() if call and call.done else self._is_idle())
            )
            done = not self.degraded
        self._say(message)
        return done

    def close(self) -> None:
        """The run ends: let a failing logger try once more, wait (each call within its bound) for the queue to
        empty, write what is still unsent to the file, and let the thread end."""
        with self._cond:
            if self.degraded and self._running is None:
                self._next_retry = 0.0
            self._ensure_thread()
            self._cond.notify_all()
            message = self._wait_until(lambda: self._is_idle() and not (self.degraded and self._next_retry == 0.0))
            if not self._is_idle() and not self.degraded:
                message = self._degrade(f"the end of the run waited {self.bound_s():g} s for it")
            self._closing = True
            self._cond.notify_all()
            if self.degraded:
                self._write_file()
        self._say(message)

    def bound_s(self) -> float:
        """How long the call running now may take: ``timeout_s``, or for a logger's first call (its start: imports,
        creating its run or database) 12 times that, at most a minute (never less than ``timeout_s``)."""
        return self.timeout_s if self._calls_done else max(self.timeout_s, min(STARTUP_FACTOR * self.timeout_s, 60.0))

    def summary(self) -> str | None:
        """One line on what this logger missed, or None when it had no trouble."""
        with self._cond:
            if not self.failures and not self.degraded and not self.dropped:
                return None
            if not self.degraded:
                lost = f"; {self.dropped} histogram calls were dropped" if self.dropped else ""
                return (
                    f"ember: {self.name} failed {self.failures} time(s) ({self.reason}); everything else was sent "
                    f"once it answered again{lost}"
                )
            missed = self._describe(self._missed())
            where = (
                f"kept in {self.unsent_path}; send them with: {unsent.REPLAY_COMMAND} {self.unsent_path}"
                if self._file_error is None and self.unsent_path is not None
                else f"NOT kept: their file could not be written ({self._file_error})"
            )
            return f"ember: {self.name} did not receive {missed} ({self.reason}): {where}"

    # --- the channel's thread -----------------------------------------------------------------------------
    def _work(self) -> None:
        while True:
            with self._cond:
                call = self._next_call()
                if call is None:
                    self._thread = None
                    self._cond.notify_all()
                    return
                self._running, self._running_since = call, time.monotonic()
            if call.name == "_replay":
                ok, error = self._replay()
            else:
                ok, error = self._run(call)
            with self._cond:
                self._running = None
                self._calls_done += 1
                message = self._settle(call, ok, error)
                if call.done is not None:
                    call.done.set()
                self._cond.notify_all()
            self._say(message)

    def _next_call(self) -> Call | None:
        """Under the lock: the next queued call, a replay when one is due, or None to end the thread."""
        while True:
            if self._pending and not self.degraded:
                return self._pending.popleft()
            retry_in = self._next_retry - time.monotonic()
            if self.degraded and retry_in <= 0:
                return Call(-1, "_replay")
            if self._closing:
                return None
            self._cond.wait(timeout=retry_in if self.degraded else None)

    def _run(self, call: Call) -> tuple[bool, BaseException | None]:
        try:
            getattr(self.logger, call.name)(*call.args)
        except Exception as exc:
            return False, exc
        return True, None

    def _replay(self) -> tuple[bool, BaseException | None]:
        """Hand every kept call to the logger in order, then ``save``; the channel is healthy again only when the
        list is empty afterwards (calls kept meanwhile are replayed too)."""
        while True:
            with self._cond:
                if not self._kept:
                    break
                call = self._kept[0]
            ok, error = self._run(call)
            if not ok:
                return False, error
            with self._cond:
                self._kept.pop(0)
                self._hand_over(call)
        if not self._unconfirmed or self._unconfirmed[-1].name != "finalize":
            ok, error = self._run(Call(-1, "save"))
            if not ok:
                return False, error
        return True, None

    def _settle(self, call: Call, ok: bool, error: BaseException | None) -> str | None:
        """Under the lock: account for a finished call (or replay); returns a line to print, if any."""
        if ok:
            if call.name == "_replay":
                self._unconfirmed.clear()
                if not self._kept and self.degraded:
                    self.degraded = False
                    self.recoveries += 1
                    self._forget_file()
            elif call.name in ("save", "finalize"):  # the logger wrote what it was given before
                self._unconfirmed = [c for c in self._unconfirmed if c.seq > call.seq]
            else:
                self._hand_over(call)
            if self.degraded:  # an abandoned call came back: try the rest now
                self._next_retry = 0.0
            return None
        self.failures += 1
        if call.name != "_replay" and call.is_kept:
            self._keep(call)
        self._next_retry = time.monotonic() + self.retry_every_s
        if self.degraded:
            return None
        text = str(error).strip()
        return self._degrade(f"{type(error).__name__}: {text.splitlines()[0] if text else ''}"[:200])

    # --- under the lock -------------------------------------------------------------------------------------
    def _wait_until(self, finished: Callable[[], bool]) -> str | None:
        """Under the lock: wait until `finished()`, as long as the call running now is within its bound (one past
        it degrades the channel, and a degraded channel's hanging call is not waited for)."""
        message = None
        while not finished():
            now = time.monotonic()
            message = self._check(now) or message
            replay_due = self.degraded and self._next_retry == 0.0
            if finished() or (self._running is None and not self._pending and not replay_due):
                break
            if self._running is not None and self.degraded and now - self._running_since > self.bound_s():
                break  # an abandoned call or a replay that hangs: never waited for twice
            started = self._running_since if self._running is not None else now
            self._cond.wait(timeout=max(0.01, started + self.bound_s() - now))
        return message

    def _is_idle(self) -> bool:
        return self._running is None and not self._pending

    def _check(self, now: float) -> str | None:
        if self.degraded:
            return None
        if self._running is not None and now - self._running_since > self.bound_s():
            return self._degrade(f"a {self._running.name} call took over {self.bound_s():g} s")
        if len(self._pending) >= MAX_PENDING:
            return self._degrade(f"{len(self._pending)} calls waited for it")
        return None

    def _degrade(self, reason: str) -> str | None:
        self.degraded, self.reason = True, self.reason or reason
        self._next_retry = time.monotonic() + self.retry_every_s
        while self._pending:  # never handed over: kept, in order, ahead of anything later
            self._keep(self._pending.popleft())
        self._cond.notify_all()
        if self._warned:
            return None
        self._warned = True
        where = self.unsent_path if self.unsent_path is not None else "memory"
        return (
            f"ember: {self.name} is failing ({reason}); training goes on without waiting for it, its values are kept "
            f"in {where} and retried every {self.retry_every_s:g} s"
        )

    def _keep(self, call: Call) -> None:
        if not call.is_kept or len(self._kept) >= MAX_KEPT:
            self.dropped += 1
            if call.done is not None:
                call.done.set()
            return
        bisect.insort(self._kept, call)
        # After the run's end the file already holds every call still missing, an abandoned one in flight included
        # (`close`): one that fails later is not appended again (the replay may have sent and moved the file since).
        if self.unsent_path is not None and self._file_error is None and not self._closing:
            try:
                line = unsent.record(call.seq, call.name, call.args)
                unsent.append(self.unsent_path, unsent.header(self.logger), line)
            except OSError as exc:
                self._file_error = f"{type(exc).__name__}: {exc}"

    def _hand_over(self, call: Call) -> None:
        if call.is_kept and self.logger.holds_until_save:
            self._unconfirmed.append(call)

    def _missed(self) -> list[Call]:
        """What the logger may not have: handed over but not saved, kept, and a call abandoned in flight."""
        running = [self._running] if self._running is not None and self._running.is_kept else []
        return sorted([*self._unconfirmed, *self._kept, *running])

    def _write_file(self) -> None:
        calls = self._missed()
        if self.unsent_path is None or not calls:
            return
        try:
            lines = [unsent.record(c.seq, c.name, c.args) for c in calls]
            unsent.write(self.unsent_path, unsent.header(self.logger), lines)
            self._file_error = None
        except OSError as exc:
            self._file_error = f"{type(exc).__name__}: {exc}"

    def _forget_file(self) -> None:
        if self.unsent_path is not None:
            with contextlib.suppress(OSError):
                self.unsent_path.unlink(missing_ok=True)

    def _ensure_thread(self) -> None:
        self._closing = False
        if self._thread is None:
            self._thread = threading.Thread(target=self._work, name=f"ember-logger-{self.name}", daemon=True)
            self._thread.start()

    @staticmethod
    def _describe(calls: list[Call]) -> str:
        steps = [int(c.args[1]) for c in calls if c.name == "log_metrics"]
        parts = [f"{len(steps)} metric rows (steps {min(steps)}-{max(steps)})"] if steps else []
        if any(c.name == "log_hyperparams" for c in calls):
            parts.append("the hyperparameters")
        if n := sum(c.name == "after_save_checkpoint" for c in calls):
            parts.append(f"{n} checkpoint notices")
        if any(c.name == "finalize" for c in calls):
            parts.append("the run's end")
        return ", ".join(parts) or "nothing kept"

    @staticmethod
    def _say(message: str | None) -> None:
        if message:
            print(message, file=sys.stderr, flush=True)


class LoggerGuard:
    """The one path from the trainer to its loggers: each call goes to every logger's `Channel`.

    The trainer keeps one guard for its loggers; `attach` (at each run's start) points it at the run directory
    and the time bound.
    """

    def __init__(self, loggers: list[Logger] | None = None, timeout_s: float = TIMEOUT_S) -> None:
        self.timeout_s = timeout_s
        self.channels: list[Channel] = []
        self.attach(loggers or [], None, timeout_s)

    def attach(self, loggers: list[Logger], run_dir: Path | None, timeout_s: float) -> None:
        """Guard `loggers` (channels of loggers already guarded are kept) and keep unsent values under `run_dir`."""
        self.timeout_s = timeout_s
        known = {id(ch.logger): ch for ch in self.channels}
        self.channels = [known.get(id(lg)) or Channel(lg, i, timeout_s) for i, lg in enumerate(loggers)]
        for ch in self.channels:
            ch.timeout_s = timeout_s
            if run_dir is not None:
                ch.unsent_path = Path(run_dir) / "unsent" / f"{ch.index}-{ch.name}.jsonl"

    def _send(self, name: str, *args: Any) -> None:
        for channel in self.channels:
            channel.submit(Call(next(_ids), name, args))

    def log_metrics(self, metrics: dict[str, float], step: int) -> None:
        """``logger.log_metrics(metrics, step)`` for every logger, without waiting (`metrics` must not change)."""
        self._send("log_metrics", metrics, step)

    def log_hyperparams(self, params: dict[str, Any]) -> None:
        """``logger.log_hyperparams(params)`` for every logger, without waiting."""
        self._send("log_hyperparams", params)

    def after_save_checkpoint(self, path: Path) -> None:
        """``logger.after_save_checkpoint(path)`` for every logger, without waiting."""
        self._send("after_save_checkpoint", path)

    def save(self, wait: bool = False) -> None:
        """``logger.save()`` for every logger; with `wait`, return once they are done (a checkpoint follows and the
        logs on disk should match it), at most ``timeout_s`` later."""
        self._send("save")
        if wait:
            for channel in self.channels:
                channel.wait(None)

    def log_histograms(self, loggers: list[Logger], values: dict[str, Any], step: int) -> None:
        """``logger.log_histograms(values, step)`` for each of `loggers`; waits (each call within its bound) because
        `values` are live tensors that the next optimizer step changes."""
        waiting = []
        for channel in self.channels:
            if any(channel.logger is lg for lg in loggers):
                call = Call(next(_ids), "log_histograms", (values, step), threading.Event())
                channel.submit(call)
                waiting.append((channel, call))
        for channel, call in waiting:
            channel.wait(call)

    def finalize(self, status: str) -> list[str]:
        """End the run on every logger: ``finalize(status)``, at most ``timeout_s`` of waiting in all; print and
        return one line per logger that missed something."""
        self._send("finalize", status)
        for channel in self.channels:
            channel.close()
        lines = [line for channel in self.channels if (line := channel.summary()) is not None]
        for line in lines:
            print(line, file=sys.stderr, flush=True)
        return lines
