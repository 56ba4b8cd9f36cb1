"""ember.utilities: Lightning's rank-zero helpers, with the rank read from the environment, and a silent logo."""

from __future__ import annotations

import logging
import warnings

import pytest

from ember import utilities
from ember.utilities import (
    cli_lightning_logo,
    rank_zero_debug,
    rank_zero_deprecation,
    rank_zero_info,
    rank_zero_only,
    rank_zero_warn,
)


@pytest.fixture(autouse=True)
def _clean_rank(monkeypatch: pytest.MonkeyPatch) -> None:
    """No rank variable from the machine running the tests, and ``rank_zero_only.rank`` unset."""
    for name in utilities.RANK_VARIABLES:
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setattr(rank_zero_only, "rank", None)


def test_rank_zero_only_runs_the_function_on_rank_zero_only(monkeypatch: pytest.MonkeyPatch) -> None:
    calls: list[int] = []

    @rank_zero_only
    def record(x: int) -> int:
        calls.append(x)
        return x * 2

    monkeypatch.setenv("RANK", "1")
    assert record(3) is None and calls == []
    monkeypatch.setenv("RANK", "0")
    assert record(4) == 8 and calls == [4]
    monkeypatch.delenv("RANK")
    assert record(5) == 10 and calls == [4, 5]  # no variable: a single process, rank 0


def test_the_rank_variables_are_read_in_lightnings_order(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("SLURM_PROCID", "2")
    assert rank_zero_only.current_rank() == 2
    monkeypatch.setenv("LOCAL_RANK", "1")
    assert rank_zero_only.current_rank() == 1  # LOCAL_RANK before SLURM_PROCID
    monkeypatch.setenv("RANK", "0")
    assert rank_zero_only.current_rank() == 0


def test_a_set_rank_wins_over_the_environment_and_default_is_returned_elsewhere(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setenv("RANK", "0")
    monkeypatch.setattr(rank_zero_only, "rank", 3)
    assert rank_zero_only(lambda: "ran", "skipped")() == "skipped"
    monkeypatch.setattr(rank_zero_only, "rank", 0)
    assert rank_zero_only(lambda: "ran", "skipped")() == "ran"


def test_rank_zero_warn_warns_once_per_call_on_rank_zero_only(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("RANK", "0")
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        rank_zero_warn("first")
        rank_zero_warn("second", category=RuntimeWarning)
        rank_zero_deprecation("old")
    assert [(str(w.message), w.category) for w in caught] == [
        ("first", UserWarning),
        ("second", RuntimeWarning),
        ("old", DeprecationWarning),
    ]
    assert caught[0].filename == __file__  # the default stacklevel names the caller's line

    monkeypatch.setenv("RANK", "1")
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        rank_zero_warn("first")
        rank_zero_deprecation("old")
    assert caught == []


def test_rank_zero_info_and_debug_log_on_rank_zero_only(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.DEBUG, logger="ember.utilities")
    rank_zero_info("hello %s", "there")
    rank_zero_debug("details")
    monkeypatch.setenv("RANK", "1")
    rank_zero_info("not shown")
    rank_zero_debug("not shown")
    assert [(r.levelname, r.getMessage()) for r in caplog.records] == [("INFO", "hello there"), ("DEBUG", "details")]


def test_rank_zero_info_prints_to_stderr_when_logging_is_not_configured(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.setattr(logging.Logger, "hasHandlers", lambda self: False)
    rank_zero_info("epoch %d done", 3)
    assert capsys.readouterr() == ("", "epoch 3 done\n")


def test_cli_lightning_logo_prints_nothing(capsys: pytest.CaptureFixture[str]) -> None:
    assert cli_lightning_logo() is None
    assert capsys.readouterr() == ("", "")
