"""Helpers of the reliability tests: a user project, ways to tamper with a checkpoint, in-process CLI runs."""

from __future__ import annotations

import shutil
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch

from ember.cli import main

HERE = Path(__file__).resolve().parent
PROJECT = HERE.parent / "integration" / "cli_project" / "my_project"

CONFIG = """\
seed: 7
trainer:
  max_epochs: 2
  enable_model_summary: false
  enable_progress_bar: false
  num_sanity_val_steps: 0
  logger: false
module:
  _target_: my_project.models.Net
  hidden: 8
data:
  _target_: my_project.models.Blobs
  n: 64
  batch_size: 16
optimizer:
  _target_: torch.optim.SGD
  lr: 0.1
"""


def make_project(root: Path, config: str = CONFIG) -> Path:
    """`root`/my_project (the integration tests' user project) and `root`/net.yaml; returns the config path."""
    root.mkdir(parents=True, exist_ok=True)
    if not (root / "my_project").exists():
        shutil.copytree(PROJECT, root / "my_project", ignore=shutil.ignore_patterns("__pycache__"))
    (root / "net.yaml").write_text(config)
    return root / "net.yaml"


def fit_project(project: Path, max_epochs: int, ckpt_path: str | Path | None) -> Any:
    """`Trainer.fit` from Python on the project's Net (hidden=8, the config's SGD) and Blobs(n=64), warnings
    silenced; returns the trainer."""
    import sys
    import warnings

    import ember

    sys.path.insert(0, str(project))
    from my_project.models import Blobs, Net  # type: ignore[import-not-found]

    module = Net(hidden=8)
    module.optimizer_config = {"optimizer": {"_target_": "torch.optim.SGD", "lr": 0.1}, "lr_scheduler": None}
    trainer = ember.Trainer(max_epochs=max_epochs, logger=False, enable_progress_bar=False, enable_model_summary=False)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        trainer.fit(module, datamodule=Blobs(n=64), ckpt_path=ckpt_path)
    return trainer


def checkpoints(root: Path) -> list[Path]:
    """Every complete-looking checkpoint directory under `root`, sorted."""
    return sorted(p.parent for p in root.rglob("ember.pt"))


def last_checkpoint(root: Path) -> Path:
    """The checkpoint the first ``checkpoints/last`` file under `root` names."""
    pointer = next(root.rglob("checkpoints/last"))
    return pointer.parent / pointer.read_text().strip()


def edit_meta(checkpoint: Path, edit: Callable[[dict[str, Any]], None]) -> None:
    """Rewrite a checkpoint's ``ember.pt`` after `edit` changed its content in place (as an attacker would)."""
    meta = torch.load(checkpoint / "ember.pt", weights_only=True)
    edit(meta)
    torch.save(meta, checkpoint / "ember.pt")


def run_cli(argv: list[str], capsys: pytest.CaptureFixture[str]) -> tuple[int, str, str]:
    """``ember ARGV`` in this process: (exit code, stdout, stderr)."""
    code = main(argv)
    captured = capsys.readouterr()
    return code, captured.out, captured.err


def assert_one_line_error(err: str, *fragments: str) -> str:
    """stderr holds exactly one ``ember: error:`` line (notes may precede it), no traceback; returns it."""
    assert "Traceback" not in err, err
    errors = [line for line in err.splitlines() if line.startswith("ember: error:")]
    assert len(errors) == 1, err
    for fragment in fragments:
        assert fragment in errors[0], errors[0]
    return errors[0]
