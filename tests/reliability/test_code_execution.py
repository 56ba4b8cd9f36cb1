"""A checkpoint is data: nothing named in one is imported or called, on any loading path (issue 16, items 1-2).

Every payload below writes a marker file if ember ever imports or calls what the checkpoint names. Each
is tried on every way a checkpoint is loaded: ``fit(ckpt_path=...)``, ``validate/test/predict``,
``load_from_checkpoint``, ``ember fit --resume``, ``ember validate/test/predict --ckpt-path``, and
``ember export --ckpt`` with and without ``-c``. The marker must never appear.
"""

from __future__ import annotations

import contextlib
import pickle
import shutil
import sys
import warnings
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch
from rel_helpers import assert_one_line_error, edit_meta, last_checkpoint, make_project, run_cli

import ember
from ember.checkpoint import CheckpointError
from ember.config import ConfigError

pytestmark = pytest.mark.usefixtures("clean_imports")

MARKER = "PWNED"


class _Reduce:
    """Pickles as ``os.system(<command>)``: a payload for files that are unpickled."""

    def __init__(self, command: str) -> None:
        self.command = command

    def __reduce__(self) -> tuple[Any, ...]:
        import os

        return (os.system, (self.command,))


def _touch(marker: Path) -> str:
    return f"touch {marker}"


def _module_system(meta: dict[str, Any], marker: Path) -> None:
    meta["config"]["module"] = {"_target_": "os.system", "command": _touch(marker)}


def _nested_target(meta: dict[str, Any], marker: Path) -> None:
    meta["config"]["module"]["hidden"] = {"_target_": "subprocess.run", "args": ["touch", str(marker)]}


def _data_section(meta: dict[str, Any], marker: Path) -> None:
    meta["config"]["data"] = {"_target_": "os.system", "command": _touch(marker)}


def _callbacks_section(meta: dict[str, Any], marker: Path) -> None:
    meta["config"]["trainer"]["callbacks"] = [{"_target_": "os.system", "command": _touch(marker)}]


def _module_class(meta: dict[str, Any], marker: Path) -> None:
    meta["config"] = None  # nothing else to rebuild from: the class name and hparams are all there is
    meta["module_class"] = "os.system"
    meta["hparams"] = {"command": _touch(marker)}


def _importable_module(meta: dict[str, Any], marker: Path) -> None:
    """A module whose import has a side effect, next to where the user runs ember (on sys.path)."""
    (Path.cwd() / "evil_mod.py").write_text(f"open({str(marker)!r}, 'w').close()\nclass Net: pass\n")
    meta["config"]["module"]["_target_"] = "evil_mod.Net"
    meta["module_class"] = "evil_mod.Net"


def _pickled_meta(checkpoint: Path, marker: Path) -> None:
    torch.save({"format_version": 1, "payload": _Reduce(_touch(marker))}, checkpoint / "ember.pt")


def _pickled_metadata(checkpoint: Path, marker: Path) -> None:
    (checkpoint / ".metadata").write_bytes(pickle.dumps(_Reduce(_touch(marker))))


META_PAYLOADS: dict[str, Callable[[dict[str, Any], Path], None]] = {
    "module-os.system": _module_system,
    "nested-_target_": _nested_target,
    "data-section": _data_section,
    "callbacks-section": _callbacks_section,
    "module_class": _module_class,
    "import-side-effect": _importable_module,
}
FILE_PAYLOADS: dict[str, Callable[[Path, Path], None]] = {
    "ember.pt-pickle": _pickled_meta,
    ".metadata-pickle": _pickled_metadata,
}


def _plant(name: str, checkpoint: Path, marker: Path) -> None:
    if name in META_PAYLOADS:
        edit_meta(checkpoint, lambda meta: META_PAYLOADS[name](meta, marker))
    else:
        FILE_PAYLOADS[name](checkpoint, marker)


def _snapshot(project: Path) -> Path:
    """A copy of the project's runs (the planted checkpoint included), to restore before each loading path."""
    copy = project.parent / f"{project.name}-pristine"
    shutil.copytree(project / "runs", copy)
    return copy


def _restore(project: Path, pristine: Path) -> None:
    """Every loading path starts from the planted checkpoint, whatever the previous path did to the runs."""
    shutil.rmtree(project / "runs", ignore_errors=True)
    shutil.rmtree(project / "exports", ignore_errors=True)
    shutil.copytree(pristine, project / "runs")


def _python_paths(project: Path, checkpoint: Path) -> dict[str, Callable[[], Any]]:
    sys.path.insert(0, str(project))
    from my_project.models import Blobs, Net

    def trainer() -> ember.Trainer:
        return ember.Trainer(max_epochs=3, logger=False, enable_progress_bar=False, enable_model_summary=False)

    def optimizer_module() -> Net:
        module = Net(hidden=8)
        module.optimizer_config = {"optimizer": {"_target_": "torch.optim.SGD", "lr": 0.1}, "lr_scheduler": None}
        return module

    return {
        "fit(ckpt_path)": lambda: trainer().fit(optimizer_module(), datamodule=Blobs(n=64), ckpt_path=checkpoint),
        "validate(ckpt_path)": lambda: trainer().validate(Net(hidden=8), datamodule=Blobs(n=64), ckpt_path=checkpoint),
        "test(ckpt_path)": lambda: trainer().test(Net(hidden=8), datamodule=Blobs(n=64), ckpt_path=checkpoint),
        "predict(ckpt_path)": lambda: trainer().predict(Net(hidden=8), datamodule=Blobs(n=64), ckpt_path=checkpoint),
        "load_from_checkpoint": lambda: Net.load_from_checkpoint(checkpoint),
    }


def _cli_paths(config: Path, checkpoint: Path) -> dict[str, list[str]]:
    c, ck = str(config), str(checkpoint)
    return {
        "ember fit --resume": ["fit", "-c", c, "--resume", ck, "trainer.max_epochs=3"],
        "ember validate --ckpt-path": ["validate", "-c", c, "--ckpt-path", ck],
        "ember test --ckpt-path": ["test", "-c", c, "--ckpt-path", ck],
        "ember predict --ckpt-path": ["predict", "-c", c, "--ckpt-path", ck],
        "ember export -c": ["export", "--ckpt", ck, "-c", c, "--format", "safetensors", "--out", "exports"],
        "ember export": ["export", "--ckpt", ck, "--format", "safetensors", "--out", "exports"],
        "ember export --module": [
            *["export", "--ckpt", ck, "--module", "my_project.models.ExampleNet"],
            *["--format", "safetensors", "--out", "exports"],
        ],
    }


PAYLOADS = [*META_PAYLOADS, *FILE_PAYLOADS]


@pytest.mark.parametrize("payload", PAYLOADS)
def test_no_python_loading_path_runs_what_a_checkpoint_names(project: Path, payload: str) -> None:
    checkpoint = last_checkpoint(project)
    marker = project / MARKER
    _plant(payload, checkpoint, marker)
    pristine = _snapshot(project)
    for name, load in _python_paths(project, checkpoint).items():
        _restore(project, pristine)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            with contextlib.suppress(CheckpointError, TypeError, ValueError):
                load()  # refusing the file is fine; running its payload is not
        assert not marker.exists(), f"{name} ran the payload of {payload}"


@pytest.mark.parametrize("payload", PAYLOADS)
def test_no_command_line_loading_path_runs_what_a_checkpoint_names(
    project: Path, payload: str, capsys: pytest.CaptureFixture[str]
) -> None:
    checkpoint = last_checkpoint(project)
    marker = project / MARKER
    _plant(payload, checkpoint, marker)
    pristine = _snapshot(project)
    for name, argv in _cli_paths(project / "net.yaml", checkpoint).items():
        _restore(project, pristine)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            code, _, err = run_cli(argv, capsys)
        assert not marker.exists(), f"{name} ran the payload of {payload}"
        assert code in (0, 2), f"{name}: exit {code}\n{err}"
        if code == 2:
            assert_one_line_error(err)


def test_export_with_the_users_config_builds_the_users_module_and_reports_the_saved_difference(
    project: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """The saved config never wins over ``-c``: a differing saved section is reported, not used."""
    checkpoint = last_checkpoint(project)
    marker = project / MARKER
    _plant("module-os.system", checkpoint, marker)
    argv = ["export", "--ckpt", str(checkpoint), "-c", str(project / "net.yaml"), "--format", "safetensors"]
    code, out, err = run_cli([*argv, "--out", "exports"], capsys)
    assert code == 0, err
    assert "export done" in out and (project / "exports" / "net.safetensors").is_file()
    assert "module._target_" in err and "os.system" in err and "not used" in err
    assert not marker.exists()


def test_export_without_a_config_names_the_ways_to_give_the_module(
    project: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    checkpoint = last_checkpoint(project)
    code, _, err = run_cli(["export", "--ckpt", str(checkpoint), "--format", "safetensors", "--out", "x"], capsys)
    assert code == 2
    assert_one_line_error(err, "-c", "--module", "my_project.models.Net")
    assert not (project / "x").exists()


def test_export_with_module_class_named_by_the_user_uses_the_saved_hparams_as_data(
    project: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    checkpoint = last_checkpoint(project)
    argv = ["export", "--ckpt", str(checkpoint), "--module", "my_project.models.Net", "--format", "safetensors"]
    code, _, err = run_cli([*argv, "--out", "exports"], capsys)
    assert code == 2  # Net has no example_input_array and no data section is given
    assert_one_line_error(err, "example_input_array", "-c")
    argv[argv.index("my_project.models.Net")] = "my_project.models.ExampleNet"
    code, _, err = run_cli([*argv, "--out", "exports"], capsys)
    assert code == 0, err
    from safetensors.torch import load_file

    weights = load_file(project / "exports" / "example_net.safetensors")
    assert weights["model.0.weight"].shape == (8, 4)  # hidden=8 from the saved hparams


def test_trusted_rebuild_is_opt_in_and_still_builds_only_training_modules(
    project: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """``--trust-checkpoint`` rebuilds from the recorded config, but never calls a non-module target."""
    checkpoint = last_checkpoint(project)
    marker = project / MARKER
    argv = ["export", "--ckpt", str(checkpoint), "--trust-checkpoint", "--format", "safetensors", "--out", "ok"]
    code, _, err = run_cli(argv, capsys)
    assert code == 0, err
    _plant("module-os.system", checkpoint, marker)
    code, _, err = run_cli([*argv[:-1], "bad"], capsys)
    assert code == 2
    assert_one_line_error(err, "os.system", "TrainingModule")
    assert not marker.exists()
    edit_meta(checkpoint, lambda meta: meta["config"].update(module={"_target_": "my_project.models.Net"}))
    edit_meta(checkpoint, lambda meta: _nested_target(meta, marker))
    code, _, err = run_cli([*argv[:-1], "bad2"], capsys)
    assert code == 2
    assert_one_line_error(err, "module.hidden", "_target_")
    assert not marker.exists()


# --- item 2: a YAML _target_ is checked before it is called ------------------------------------------------

SECTIONS = {
    "module": "module:\n  _target_: os.system\n  command: 'touch {marker}'\n",
    "data": "data:\n  _target_: os.system\n  command: 'touch {marker}'\n",
    "callbacks": "trainer:\n  callbacks:\n    - _target_: subprocess.run\n      args: [touch, '{marker}']\n",
    "logger": "trainer:\n  logger:\n    - _target_: subprocess.run\n      args: [touch, '{marker}']\n",
    "strategy": "trainer:\n  strategy:\n    _target_: os.system\n    command: 'touch {marker}'\n",
    "optimizer": "optimizer:\n  _target_: subprocess.run\n  args: [touch, '{marker}']\n",
}


@pytest.mark.parametrize("section", SECTIONS)
def test_a_config_target_of_the_wrong_kind_is_refused_before_it_is_called(
    tmp_path: Path, section: str, capsys: pytest.CaptureFixture[str]
) -> None:
    config = make_project(tmp_path / "p")
    marker = tmp_path / MARKER
    overlay = tmp_path / "overlay.yaml"
    overlay.write_text(SECTIONS[section].format(marker=marker))
    code, _, err = run_cli(["fit", "-c", str(config), "-c", str(overlay)], capsys)
    assert code == 2
    assert_one_line_error(err, "is a function" if section != "optimizer" else "not a")
    assert not marker.exists()
    assert not (tmp_path / "runs").exists()


def test_instantiate_checks_the_kind_before_calling(tmp_path: Path) -> None:
    """The building function itself refuses, whatever called it (not only the config check)."""
    from ember.config import instantiate

    marker = tmp_path / MARKER
    expected = r"module\._target_: os\.system is a function, not a class deriving from ember\.TrainingModule"
    with pytest.raises(ConfigError, match=expected):
        instantiate({"_target_": "os.system", "command": _touch(marker)}, "module", base=ember.TrainingModule)
    with pytest.raises(ConfigError, match="not a subclass of"):
        instantiate({"_target_": "torch.nn.Linear", "in_features": 1, "out_features": 1}, "data", base=ember.DataModule)
    assert not marker.exists()
