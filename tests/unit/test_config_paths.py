"""`ember.config.paths`: a relative path in a config's module/data sections is found beside the config file
(or in its project) when the working directory does not have it; and the ``ember`` command works from any
directory with such a config, or says in one line which file is missing."""

from __future__ import annotations

import os
import sys
from pathlib import Path

import pytest
from hypothesis import given
from hypothesis import strategies as st

from ember.cli import main
from ember.config.paths import looks_like_path, resolve_paths

REPO = Path(__file__).resolve().parents[2]

CONFIG = """\
seed: 0
trainer:
  max_epochs: 1
  logger: false
  enable_progress_bar: false
  enable_model_summary: false
  default_root_dir: {runs}
module:
  _target_: examples.your_data.Classifier
  kind: csv
data:
  _target_: examples.your_data.FilesData
  path: {path}
  kind: csv
"""


@pytest.fixture
def project(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """`tmp_path/project` with configs/train.yaml naming data/table.csv (written there), run from elsewhere."""
    from examples.your_data import write_example_files

    root = tmp_path / "project"
    (root / "configs").mkdir(parents=True)
    (root / "pyproject.toml").write_text("")
    data = root / "configs" / "data"
    write_example_files(data)
    for extra in ("images", "text"):
        import shutil

        shutil.rmtree(data / extra)
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    monkeypatch.chdir(elsewhere)
    monkeypatch.setattr(sys, "path", [str(REPO), *sys.path])
    return root


def test_a_path_beside_the_config_is_found_from_another_directory(
    project: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    config = project / "configs" / "train.yaml"
    config.write_text(CONFIG.format(runs=tmp_path / "runs", path="data/table.csv"))
    assert main(["fit", "-c", str(config)]) == 0, capsys.readouterr().err
    assert "fit done" in capsys.readouterr().out
    assert main(["fit", "-c", str(config), "--print-config"]) == 0
    assert f"path: {project / 'configs' / 'data' / 'table.csv'}" in capsys.readouterr().out


def test_a_path_in_the_working_directory_wins(project: Path, tmp_path: Path) -> None:
    local = Path("data")
    local.mkdir()
    (local / "table.csv").write_text("f0\n")
    config = project / "configs" / "train.yaml"
    config.write_text(CONFIG.format(runs=tmp_path / "runs", path="data/table.csv"))
    resolved = {"data": {"_target_": "a.B", "path": "data/table.csv"}, "trainer": {"default_root_dir": "runs/x"}}
    assert resolve_paths(resolved, [config]) == resolved  # found here: kept as written


def test_a_path_of_the_project_root_and_other_sections(project: Path) -> None:
    (project / "shared.csv").write_text("f0\n")
    config = project / "configs" / "train.yaml"
    resolved = {
        "module": {"_target_": "pkg/mod.Class", "files": ["shared.csv", "gone/x.csv"], "kind": "csv"},
        "trainer": {"default_root_dir": "shared.csv"},
    }
    out = resolve_paths(resolved, [config])
    assert out["module"]["files"] == [str(project / "shared.csv"), "gone/x.csv"]  # found nowhere: as written
    assert out["module"]["_target_"] == "pkg/mod.Class" and out["module"]["kind"] == "csv"
    assert out["trainer"] == resolved["trainer"]  # run directories stay relative to where the command runs


def test_a_missing_data_file_is_one_line_and_exit_2(
    project: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    config = project / "configs" / "train.yaml"
    config.write_text(CONFIG.format(runs=tmp_path / "runs", path="data/missing.csv"))
    assert main(["fit", "-c", str(config)]) == 2
    err = capsys.readouterr().err
    assert "Traceback" not in err
    last = err.splitlines()[-1]  # after the line saying what the fit runs on
    assert last.startswith("ember: error: no such file: data/missing.csv (from ") and "beside the config" in last
    assert not list((tmp_path / "runs").glob("*/version_*"))  # the run directory it claimed was released


@pytest.mark.parametrize(
    ("value", "is_path"),
    [
        ("data/x.csv", True),
        ("blobs.csv", True),
        ("images", False),
        ("1e-3", False),
        ("0.5", False),
        ("https://host/x.csv", False),
        ("/abs/x.csv", False),
        ("~/x.csv", False),
        ("", False),
    ],
)
def test_what_looks_like_a_path(value: str, is_path: bool) -> None:
    assert looks_like_path(value) is is_path


@given(st.text(alphabet="abc./-_:1", max_size=12))
def test_resolving_never_changes_what_is_not_found(value: str) -> None:
    resolved = {"data": {"_target_": "x.Y", "value": value}}
    cwd = os.getcwd()
    out = resolve_paths(resolved, [Path(cwd) / "no-such-folder" / "c.yaml"])
    assert out["data"]["value"] == value or Path(out["data"]["value"]).exists()
