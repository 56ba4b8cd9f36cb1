"""``ember fit`` says why the fit ended and which checkpoint is best, on the line after its summary."""

from __future__ import annotations

import re
import sys
from pathlib import Path

import pytest

from ember import checkpoint as ckpt
from ember.cli import main

sys.path.insert(0, str(Path(__file__).resolve().parent))
from test_cli import NET_YAML, make_project

EARLY = "ember.callbacks.early_stopping.EarlyStopping"


@pytest.fixture
def project(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    monkeypatch.chdir(tmp_path)
    return make_project(tmp_path)


def fit(config: Path, capsys: pytest.CaptureFixture[str], *overrides: str) -> list[str]:
    assert (
        main(["fit", "-c", str(config), "trainer.logger=false", "trainer.enable_progress_bar=false", *overrides]) == 0
    )
    lines = capsys.readouterr().out.splitlines()
    done = next(i for i, line in enumerate(lines) if line.startswith("fit done"))
    return lines[done : done + 2]


def best_of(stop_line: str) -> tuple[Path, str, float]:
    found = re.search(r"; best checkpoint (\S+) \((\S+) ([\d.]+)\)$", stop_line)
    assert found is not None, stop_line
    return Path(found[1]), found[2], float(found[3])


def test_a_fit_that_ran_its_epochs_says_so_and_names_the_best_checkpoint(
    project: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    done, stop = fit(project, capsys, "trainer.max_epochs=3")
    assert "(3 epochs, " in done
    assert stop.startswith("stopped: max_epochs=3 reached; best checkpoint ")
    path, monitor, score = best_of(stop)
    assert monitor == "val/acc" and ckpt.newest_valid(path.parent) is not None
    recorded = ckpt.read_meta(path)["state"]["callbacks"]
    scores = [state["best_model_score"] for state in recorded.values() if "best_model_score" in state]
    assert scores and score == pytest.approx(scores[0], abs=5e-5)  # the printed score is the recorded one


def test_a_fit_stopped_by_early_stopping_says_which_callback_and_why(
    project: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    # val/acc can never rise by 2 (it is at most 1): the second check exhausts patience 1
    config = NET_YAML.replace(
        "  logger:", f"    - _target_: {EARLY}\n      monitor: val/acc\n      mode: max\n      patience: 1\n"
        "      min_delta: 2.0\n  logger:"
    )  # fmt: skip
    project.write_text(config)
    done, stop = fit(project, capsys, "trainer.max_epochs=10")
    assert "(2 epochs, " in done
    assert re.match(r"stopped: EarlyStopping: .*val/acc.*; best checkpoint ", stop), stop
    assert best_of(stop)[1] == "val/acc"


@pytest.mark.parametrize(
    ("overrides", "expected"),
    [(["trainer.max_steps=5"], "stopped: max_steps=5 reached"), (["trainer.callbacks=[]"], "stopped: max_epochs=4")],
)
def test_the_stop_line_without_a_monitored_checkpoint(
    project: Path, capsys: pytest.CaptureFixture[str], overrides: list[str], expected: str
) -> None:
    _, stop = fit(project, capsys, *overrides)
    assert stop.startswith(expected)
    if "max_steps" not in expected:
        assert "best checkpoint" not in stop  # the default checkpoint monitors nothing: no "best" to name
