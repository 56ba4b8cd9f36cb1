"""tests/forked_cli.py: an `ember` command forked from the preloaded server prints and exits as the real
``python -m ember`` does, with the command's own environment, ``PYTHONPATH``, directory and streams."""

from __future__ import annotations

import os
import re
import subprocess
import sys
import time
from pathlib import Path

import forked_cli
import pytest

pytestmark = pytest.mark.slow

MODELS = """\
import os
import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

import ember


class Tiny(ember.TrainingModule):
    def __init__(self, fail: bool = False):
        super().__init__()
        self.fail = fail
        self.model = nn.Linear(2, 2)

    def training_step(self, batch, batch_idx):
        if self.fail:
            raise ZeroDivisionError("planted in training_step")
        x, y = batch
        return nn.functional.cross_entropy(self.model(x), y)

    def configure_optimizers(self):
        print("MARKER", os.environ.get("MARKER"), flush=True)
        return torch.optim.SGD(self.parameters(), lr=0.1)


class Points(ember.DataModule):
    def train_dataloader(self):
        x = torch.randn(16, 2, generator=torch.Generator().manual_seed(0))
        return DataLoader(TensorDataset(x, (x[:, 0] > 0).long()), batch_size=8)
"""
CONFIG = """\
trainer: {max_epochs: 1, enable_progress_bar: false, enable_model_summary: false, logger: false}
module: {_target_: forked_cli_models.Tiny, fail: FAIL}
data: {_target_: forked_cli_models.Points}
"""


def _timeless(text: str) -> str:
    return re.sub(r"\d+(\.\d+)?", "#", text)


@pytest.fixture
def project(tmp_path: Path) -> tuple[Path, dict[str, str]]:
    """A config in one folder, its module in another reached only through PYTHONPATH, run from a third."""
    (tmp_path / "lib").mkdir()
    (tmp_path / "lib" / "forked_cli_models.py").write_text(MODELS)
    (tmp_path / "configs").mkdir()
    for fail in ("false", "true"):
        (tmp_path / "configs" / f"fail-{fail}.yaml").write_text(CONFIG.replace("FAIL", fail))
    (tmp_path / "work").mkdir()
    env = {**os.environ, "PYTHONPATH": str(tmp_path / "lib"), "MARKER": "seen"}
    return tmp_path, env


def test_a_forked_command_prints_and_exits_as_the_real_one(project: tuple[Path, dict[str, str]]) -> None:
    """A fit side by side: a real ``python -m ember`` and a fork, with the user's module on PYTHONPATH only."""
    root, env = project
    args = ["fit", "-c", str(root / "configs" / "fail-false.yaml")]
    real = forked_cli.run([*args, "trainer.run_name=t"], cwd=root / "work", env=env, fresh=True)
    forked = forked_cli.run([*args, "trainer.run_name=f"], cwd=root / "work", env=env)
    assert forked.returncode == real.returncode == 0, real.stderr + forked.stderr
    assert _timeless(forked.stdout).replace("/f/", "/t/") == _timeless(real.stdout)
    assert forked.stderr.replace("/f/", "/t/") == real.stderr
    assert "MARKER seen" in forked.stdout  # the command's environment, not the server's
    assert (root / "work" / "runs" / "f" / "version_0").is_dir()  # its working directory


def test_a_forked_command_s_errors_match_the_command_run_in_process(
    project: tuple[Path, dict[str, str]], capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    """A user's mistake (exit 2, one line) and a bug in the user's code (exit 1, the exception's traceback), as
    `ember.cli.main` prints and returns them in this process."""
    from ember.cli import main

    root, env = project
    monkeypatch.chdir(root / "work")
    monkeypatch.setattr(sys, "path", [str(root / "lib"), *sys.path])
    missing = ["fit", "-c", str(root / "configs" / "missing.yaml")]
    assert main(missing) == 2
    expected = capsys.readouterr().err
    forked = forked_cli.run(missing, cwd=root / "work", env=env)
    assert (forked.returncode, forked.stderr) == (2, expected)
    assert expected.startswith("ember: error: ") and len(expected.splitlines()) == 1

    failing = ["fit", "-c", str(root / "configs" / "fail-true.yaml")]
    with pytest.raises(ZeroDivisionError, match="planted in training_step"):
        main(failing)
    forked = forked_cli.run(failing, cwd=root / "work", env=env)
    assert forked.returncode == 1
    assert forked.stderr.splitlines()[-1] == "ZeroDivisionError: planted in training_step"
    assert "Traceback (most recent call last):" in forked.stderr


def test_the_server_s_sys_path_does_not_leak_into_a_command(project: tuple[Path, dict[str, str]]) -> None:
    """Without PYTHONPATH the user's module is not importable, however many commands ran with it before."""
    root, env = project
    config = str(root / "configs" / "fail-false.yaml")
    assert forked_cli.run(["fit", "-c", config], cwd=root / "work", env=env).returncode == 0
    bare = {k: v for k, v in env.items() if k != "PYTHONPATH"}
    done = forked_cli.run(["fit", "-c", config], cwd=root / "work", env=bare)
    assert done.returncode == 2 and "forked_cli_models" in done.stderr and "Traceback" not in done.stderr


def test_a_command_past_its_timeout_is_killed_and_raises_as_subprocess_run_does(tmp_path: Path) -> None:
    (tmp_path / "slow.py").write_text("import time\ntime.sleep(60)\n")
    # a whole config: one without `data` is refused before its module is imported, in less than the timeout
    (tmp_path / "slow.yaml").write_text("module: {_target_: slow.Nothing}\ndata: {_target_: slow.Nothing}\n")
    forked_cli.run(["--help"], cwd=tmp_path, env=dict(os.environ))  # the server is up: the timeout is the command's
    started = time.monotonic()
    with pytest.raises(subprocess.TimeoutExpired):
        forked_cli.run(["fit", "-c", "slow.yaml"], cwd=tmp_path, env=dict(os.environ), timeout=1)
    assert time.monotonic() - started < 30  # killed at the timeout, not after the command's 60 s
