"""The logger guard with faults injected into a logger object: a hanging call is abandoned within the bound,
values are kept while the logger fails and replayed in order when it answers again, the end of the run writes
what is still unsent with the command that sends it, and that command sends it."""

from __future__ import annotations

import threading
import time
from pathlib import Path
from typing import Any

import pytest

from ember.loggers import Logger, unsent
from ember.loggers import guard as guard_module
from ember.loggers import replay as replay_command
from ember.loggers.guard import LoggerGuard


class Flaky(Logger):
    """Holds metrics until `save`, like CSV or MLflow; `broken` makes every call raise, `hang` makes it block."""

    def __init__(self, save_dir: str | None = None) -> None:
        super().__init__(save_dir)
        self.broken = False
        self.hang = threading.Event()
        self.release = threading.Event()
        self.queued: list[tuple[int, dict[str, float]]] = []
        self.written: list[tuple[int, dict[str, float]]] = []
        self.params: list[dict[str, Any]] = []
        self.status: str | None = None

    def _fault(self) -> None:
        if self.hang.is_set():
            self.release.wait(10)
        if self.broken:
            raise ConnectionError("service down")

    def log_metrics(self, metrics: dict[str, float], step: int) -> None:
        self._fault()
        self.queued.append((step, metrics))

    def log_hyperparams(self, params: dict[str, Any]) -> None:
        self._fault()
        self.params.append(params)

    def save(self) -> None:
        self._fault()
        self.written += self.queued
        self.queued = []

    def finalize(self, status: str) -> None:
        self.save()
        self.status = status


@pytest.fixture(autouse=True)
def fast_retries(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(guard_module, "RETRY_EVERY_S", 0.05)


def guarded(tmp_path: Path, logger: Logger, timeout_s: float = 0.2) -> LoggerGuard:
    guard = LoggerGuard()
    logger.attach(tmp_path / "out")
    guard.attach([logger], tmp_path, timeout_s)
    guard.log_metrics({"x": 0.0}, 0)  # the first call (with its longer start-up bound) goes through
    guard.save(wait=True)
    return guard


def wait_for(condition: Any, seconds: float = 5.0) -> None:
    end = time.monotonic() + seconds
    while not condition():
        assert time.monotonic() < end, "condition not reached"
        time.sleep(0.01)


def test_a_failing_logger_keeps_values_and_replays_them_in_order_when_it_answers(
    tmp_path: Path, capfd: pytest.CaptureFixture[str]
) -> None:
    logger = Flaky()
    guard = guarded(tmp_path, logger)
    logger.broken = True
    guard.log_metrics({"x": 1.0}, 1)
    guard.save(wait=True)  # fails: the channel is degraded, the rest is kept
    for step in (2, 3):
        guard.log_metrics({"x": float(step)}, step)
    guard.log_hyperparams({"lr": 0.1, "api_key": "hidden"})
    channel = guard.channels[0]
    assert channel.degraded and channel.unsent_path is not None
    _, lines = unsent.read(channel.unsent_path)
    assert [line["call"] for line in lines] == ["log_metrics"] * 3 + ["log_hyperparams"]
    assert lines[-1]["params"] == {"lr": 0.1}  # never a credential on disk
    logger.broken = False
    wait_for(lambda: not channel.degraded)
    assert logger.written == [(0, {"x": 0.0}), (1, {"x": 1.0}), (2, {"x": 2.0}), (3, {"x": 3.0})]
    assert not channel.unsent_path.exists()
    lines = guard.finalize("success")
    assert logger.status == "success"
    assert len(lines) == 1 and "everything else was sent once it answered again" in lines[0]
    assert capfd.readouterr().err.count("Flaky is failing (ConnectionError: service down)") == 1


def test_a_hanging_logger_is_abandoned_within_the_bound_and_the_end_says_how_to_send_the_rest(
    tmp_path: Path, capfd: pytest.CaptureFixture[str]
) -> None:
    logger = Flaky(save_dir=str(tmp_path / "out"))
    guard = guarded(tmp_path, logger)
    logger.hang.set()
    logger.broken = True
    start = time.monotonic()
    guard.log_metrics({"x": 1.0}, 1)
    guard.save(wait=True)  # waits at most the bound (0.2 s), once
    guard.log_metrics({"x": 2.0}, 2)
    guard.save(wait=True)  # degraded: no second wait
    lines = guard.finalize("failed")
    assert time.monotonic() - start < 10 * 0.2
    assert len(lines) == 1
    assert "did not receive 2 metric rows (steps 1-2), the run's end (a log_metrics call took over 0.2 s)" in lines[0]
    path = tmp_path / "unsent" / "0-Flaky.jsonl"
    assert lines[0].endswith(f"send them with: python -m ember.loggers.replay {path}")
    before = path.read_bytes()
    failures = guard.channels[0].failures
    logger.release.set()  # the abandoned call returns (and fails) after the run's end
    wait_for(lambda: guard.channels[0].failures > failures)
    assert path.read_bytes() == before  # already in the file the end wrote: not appended again (nor later, below)
    head, kept = unsent.read(path)
    assert head["kwargs"] == {"save_dir": str(tmp_path / "out")}
    assert [(k["call"], k.get("step")) for k in kept] == [("log_metrics", 1), ("log_metrics", 2), ("finalize", None)]
    assert capfd.readouterr().err.count("is failing") == 1

    sent: list[Flaky] = []
    original = Flaky.__init__

    def remember(self: Flaky, save_dir: str | None = None) -> None:
        original(self, save_dir)
        sent.append(self)

    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(Flaky, "__init__", remember)
        mp.setattr(Flaky, "__module__", __name__)
        assert replay_command.main([str(path)]) == 0
    assert sent[0].written == [(1, {"x": 1.0}), (2, {"x": 2.0})] and sent[0].status == "failed"
    assert not path.exists() and path.with_name(path.name + ".sent").exists()


def test_the_replay_command_refuses_what_it_cannot_send(tmp_path: Path, capfd: pytest.CaptureFixture[str]) -> None:
    assert replay_command.main([]) == 2
    assert replay_command.main([str(tmp_path / "missing.jsonl")]) == 2
    evil = tmp_path / "evil.jsonl"
    evil.write_text('{"ember_unsent": 1, "logger": "os.system", "kwargs": {}}\n')
    assert replay_command.main([str(evil)]) == 1
    err = capfd.readouterr().err
    assert "'os.system' is not an importable ember Logger" in err and evil.exists()


def test_histograms_wait_at_most_the_bound_and_are_dropped_while_failing(tmp_path: Path) -> None:
    class Slow(Flaky):
        def log_histograms(self, values: dict[str, Any], step: int) -> None:
            self._fault()

    logger = Slow()
    guard = guarded(tmp_path, logger)
    logger.hang.set()
    start = time.monotonic()
    guard.log_histograms([logger], {}, 1)
    guard.log_histograms([logger], {}, 2)
    assert time.monotonic() - start < 5 * 0.2
    assert guard.channels[0].degraded and guard.channels[0].dropped == 1
    logger.release.set()
