"""``--resume last`` takes the newest *fit* of the run name, never silently an older one (issue 33, item 3).

A finished fit (version_0, with checkpoints), then a fit stopped by Ctrl-C before its first checkpoint
(version_1): ``--resume last`` must not continue version_0; it says in one line, exit 2, which run it would
have taken, which older checkpoint exists and the exact command that continues it. Runs that are not fits
(an lr finder's, a validate's) are passed over. The Ctrl-C line says what ``--resume last`` will do.
"""

from __future__ import annotations

import os
import shutil
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

from ember.checkpoint import run_status
from ember.cli import main

PROJECT = Path(__file__).resolve().parent / "cli_project" / "my_project"

CONFIG = """\
seed: 3
trainer:
  max_epochs: 1
  enable_model_summary: false
  enable_progress_bar: false
  num_sanity_val_steps: 0
  callbacks:
    - _target_: ember.callbacks.ModelCheckpoint
      monitor: val/acc
      mode: max
module:
  _target_: my_project.models.Net
  hidden: 4
data:
  _target_: my_project.models.Blobs
  n: 64
  batch_size: 16
optimizer:
  _target_: torch.optim.SGD
  lr: 0.2
"""

CTRL_C = '''\
import ember


class CtrlCAt(ember.Callback):
    """Ctrl-C (a KeyboardInterrupt) after optimizer step `step`."""

    def __init__(self, step: int) -> None:
        self.step = step

    def on_train_batch_end(self, trainer, module, outputs, batch, batch_idx):
        if trainer.global_step == self.step:
            raise KeyboardInterrupt
'''

SAVER = "{_target_: ember.callbacks.ModelCheckpoint, monitor: val/acc, mode: max}"
STOP_AT_1 = "{_target_: my_project.ctrl_c.CtrlCAt, step: 1}"


def cli(*argv: str) -> int:
    return main(list(argv))


@pytest.fixture
def project(tmp_path: Path) -> Iterator[Path]:
    """A project folder, the working directory for the test (cwd, sys.path and modules put back after)."""
    shutil.copytree(PROJECT, tmp_path / "my_project", ignore=shutil.ignore_patterns("__pycache__"))
    (tmp_path / "my_project" / "ctrl_c.py").write_text(CTRL_C)
    (tmp_path / "net.yaml").write_text(CONFIG)
    saved_path, saved_cwd = list(sys.path), os.getcwd()
    os.chdir(tmp_path)
    sys.path.insert(0, str(tmp_path))
    try:
        yield tmp_path
    finally:
        os.chdir(saved_cwd)
        sys.path[:] = saved_path
        for name in [m for m in sys.modules if m.startswith("my_project")]:
            del sys.modules[name]


def test_resume_last_refuses_to_continue_an_older_run_when_the_newest_has_no_checkpoint(
    project: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    assert cli("fit", "-c", "net.yaml") == 0  # version_0: finished, checkpoints
    assert cli("fit", "-c", "net.yaml", "trainer.max_epochs=3", f"trainer.callbacks=[{SAVER}, {STOP_AT_1}]") == 130
    interrupted = capsys.readouterr().err.splitlines()[-1]
    assert interrupted == (
        "ember: interrupted; runs/net/version_1 has no checkpoint yet, so there is nothing to resume; run the "
        "command again (without --resume) to start over"
    )
    before = sorted(p.name for p in (project / "runs" / "net").iterdir())

    assert cli("fit", "-c", "net.yaml", "trainer.max_epochs=3", "--resume", "last") == 2
    err = capsys.readouterr().err.splitlines()
    assert len(err) == 2 and err[0].startswith("ember: fit on cpu")  # the hardware line, then the error
    old = "runs/net/version_0/checkpoints/epoch=0-step=3"
    assert err[1] == (
        "ember: error: --resume last: the newest run, runs/net/version_1 (stopped: interrupted), has no "
        f"checkpoint; to continue runs/net/version_0 from {old}: `ember fit -c net.yaml trainer.max_epochs=3 "
        "--resume runs/net/version_0`; to start over: `ember fit -c net.yaml trainer.max_epochs=3`"
    )
    assert sorted(p.name for p in (project / "runs" / "net").iterdir()) == before  # nothing made, nothing run
    assert run_status.read_record(project / "runs" / "net" / "version_0")["epoch"] == 1  # version_0 untouched

    # the command it names continues version_0 in place, from epoch 1 to 3
    assert cli("fit", "-c", "net.yaml", "trainer.max_epochs=3", "--resume", "runs/net/version_0") == 0
    out = capsys.readouterr()
    assert "ember: resuming run runs/net/version_0 from " + old + " (epoch 0, step 3, val/acc" in out.err
    assert "fit done in" in out.out and "(3 epochs, 9 steps)" in out.out and "run dir runs/net/version_0" in out.out
    assert sorted(p.name for p in (project / "runs" / "net").iterdir()) == before

    # a run directory names that run's newest checkpoint for the evaluations too, which write into that run
    assert cli("test", "-c", "net.yaml", "--ckpt-path", "runs/net/version_0") == 0
    newest = "runs/net/version_0/checkpoints/epoch=2-step=9"
    assert capsys.readouterr().err.splitlines()[0].startswith(f"ember: test: loading {newest} (epoch 2, step 9, ")
    assert (project / "runs/net/version_0/eval/test-epoch=2-step=9.json").is_file()


def test_resume_last_continues_the_newest_fit_and_passes_over_runs_that_are_not_fits(
    project: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    assert cli("fit", "-c", "net.yaml") == 0  # version_0
    tune = ["tune", "lr", "-c", "net.yaml", "--num-steps", "8", "--no-plot", "trainer.callbacks=[]"]
    assert cli(*tune) == 0  # version_1: an lr finder's run
    assert cli("validate", "-c", "net.yaml") == 0  # version_2: a validate of its own
    commands = [run_status.read_record(project / "runs" / "net" / f"version_{i}")["command"] for i in range(3)]
    assert commands == ["fit", "tune lr", "validate"]
    capsys.readouterr()

    assert cli("fit", "-c", "net.yaml", "trainer.max_epochs=2", "--resume", "last") == 0
    out = capsys.readouterr()
    assert "resuming from runs/net/version_0/checkpoints/epoch=0-step=3 (epoch 0, step 3" in out.err
    assert "(2 epochs, 6 steps)" in out.out and "run dir runs/net/version_0" in out.out


def test_ctrl_c_after_a_checkpoint_names_the_run_and_checkpoint_resume_last_continues(
    project: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    stop = "{_target_: my_project.ctrl_c.CtrlCAt, step: 4}"  # in epoch 1, after epoch 0's checkpoint
    assert cli("fit", "-c", "net.yaml", "trainer.max_epochs=2", f"trainer.callbacks=[{SAVER}, {stop}]") == 130
    assert capsys.readouterr().err.splitlines()[-1] == (
        "ember: interrupted; `--resume last` continues runs/net/version_0 from its checkpoint epoch=0-step=3"
    )
    assert cli("fit", "-c", "net.yaml", "trainer.max_epochs=2", "--resume", "last") == 0
    assert "run dir runs/net/version_0" in capsys.readouterr().out


def test_a_run_directory_without_a_checkpoint_is_named_as_one(
    project: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """A fit stopped before its first checkpoint leaves a run directory with no ``checkpoints/`` folder; given as
    ``--resume``, it was read as a checkpoint and refused as 'incomplete: .metadata is missing'."""
    assert cli("fit", "-c", "net.yaml", "trainer.max_epochs=3", f"trainer.callbacks=[{SAVER}, {STOP_AT_1}]") == 130
    assert not (project / "runs/net/version_0/checkpoints").exists()
    capsys.readouterr()

    assert cli("fit", "-c", "net.yaml", "--resume", "runs/net/version_0") == 2
    assert capsys.readouterr().err.splitlines()[-1] == (
        "ember: error: runs/net/version_0 is a run directory without a complete checkpoint; nothing to load from it"
    )
    assert sorted(p.name for p in (project / "runs" / "net").iterdir()) == ["version_0"]


def test_a_folder_of_runs_or_of_checkpoints_given_as_resume_says_what_to_give(
    project: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """Both were read as one checkpoint and refused as 'incomplete: .metadata is missing'."""
    assert cli("fit", "-c", "net.yaml") == 0
    capsys.readouterr()
    assert cli("fit", "-c", "net.yaml", "--resume", "runs/net") == 2
    assert capsys.readouterr().err.splitlines()[-1] == (
        "ember: error: runs/net is a folder of runs (version_0), not a checkpoint: give a run directory "
        "(runs/net/version_0), a checkpoint, or 'last'"
    )
    assert cli("fit", "-c", "net.yaml", "--resume", "runs/net/version_0/checkpoints") == 2
    assert capsys.readouterr().err.splitlines()[-1] == (
        "ember: error: runs/net/version_0/checkpoints is a folder of checkpoints, not a checkpoint: give one of "
        "them, its 'last' (runs/net/version_0/checkpoints/last) or the run directory (runs/net/version_0)"
    )
    assert sorted(p.name for p in (project / "runs" / "net").iterdir()) == ["version_0"]
