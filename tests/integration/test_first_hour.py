"""A new user's first hour, from a fresh clone (issue 21): the README's main job and its equivalents, run as
separate ``ember`` processes the way a user types them, then the run directory they leave.

The clone is a copy of what a checkout holds for the user (``configs/``, ``examples/``, ``pyproject.toml``);
ember itself is importable from a folder that holds nothing else, so ``examples`` imports only the way
docs/cli.md says: from the config's folder or its project's root. Steps:

1. ``ember fit -c configs/digits.yaml`` (3 epochs): the first line says what it runs on; one run directory.
2. ``ember test --ckpt-path best`` and ``--ckpt-path last``: each says which checkpoint it loaded and writes
   ``eval/test-<checkpoint>.json`` into that run; no new version.
3. ``ember export --ckpt last --format torch-export``: the artifact loads and runs.
4. ``ember fit --resume last`` to 4 epochs continues the same run; resuming it again has nothing to do.
5. From another directory: the clone's config and a user's own project layout both import.

Each test's first command is a real ``python -m ember``; the later ones are forked from a process that has
imported torch and ember already (tests/forked_cli.py, which checks that a fork prints and exits alike).
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
from pathlib import Path

import forked_cli
import pytest
import torch

REPO = Path(__file__).resolve().parents[2]

pytestmark = pytest.mark.slow


def ember(*args: str, cwd: Path, site: Path, expect: int = 0, fresh: bool = False) -> subprocess.CompletedProcess[str]:
    """``python -m ember ARGS``: a real interpreter for each test's first command, forked from one that imported
    torch and ember already for the others (tests/forked_cli.py)."""
    env = {**os.environ, "PYTHONPATH": str(site), "WANDB_MODE": "offline"}
    done = forked_cli.run(args, cwd=cwd, env=env, timeout=300, fresh=fresh)
    assert done.returncode == expect, f"ember {' '.join(args)} -> {done.returncode}\n{done.stdout}\n{done.stderr}"
    return done


@pytest.fixture(scope="module")
def clone(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    """(a fresh clone's folder, a folder on PYTHONPATH holding only the ember package)."""
    root = tmp_path_factory.mktemp("first_hour")
    checkout = root / "ember-clone"
    checkout.mkdir()
    for name in ("configs", "examples"):
        shutil.copytree(REPO / name, checkout / name, ignore=shutil.ignore_patterns("__pycache__"))
    shutil.copy(REPO / "pyproject.toml", checkout / "pyproject.toml")
    site = root / "site"
    site.mkdir()
    (site / "ember").symlink_to(REPO / "ember", target_is_directory=True)
    return checkout, site


def test_the_first_hour(clone: tuple[Path, Path]) -> None:
    checkout, site = clone
    quick = ["trainer.max_epochs=3", "trainer.enable_progress_bar=false"]

    # 1. the README's main job (shortened to 3 epochs)
    fit = ember("fit", "-c", "configs/digits.yaml", *quick, cwd=checkout, site=site, fresh=True)
    assert fit.stderr.splitlines()[0] == "ember: fit on cpu: 1 process, strategy single_device, precision 32-true"
    assert "fit done in " in fit.stdout and "(3 epochs, 57 steps)" in fit.stdout  # 1,169 images / 64 = 19 batches
    run = checkout / "runs" / "classifier" / "version_0"
    rows = [line.split(",") for line in (run / "metrics.csv").read_text().splitlines()]
    header, values = rows[0], rows[1:]
    val_acc = [float(r[header.index("val/acc")]) for r in values if r[header.index("val/acc")]]
    best_epoch = max(range(len(val_acc)), key=lambda i: (val_acc[i], -i))
    best = f"epoch={best_epoch}-step={19 * (best_epoch + 1)}"
    checkpoints = sorted(p.name for p in (run / "checkpoints").iterdir() if p.is_dir())
    assert checkpoints == sorted({best, "epoch=2-step=57"})  # ModelCheckpoint(monitor="val/acc"): best and last

    # 2. evaluate best and last: into the same run, saying which checkpoint
    tested = ember("test", "-c", "configs/digits.yaml", "--ckpt-path", "best", cwd=checkout, site=site)
    assert tested.stderr.startswith(
        f"ember: test: loading the best checkpoint runs/classifier/version_0/checkpoints/{best} "
        f"(epoch {best_epoch}, step {19 * (best_epoch + 1)}, val/acc {val_acc[best_epoch]:.4f})"
    )
    record = json.loads((run / "eval" / f"test-{best}.json").read_text())
    assert f"test/acc {record['metrics']['test/acc']:.4f}" in tested.stdout
    ember("test", "-c", "configs/digits.yaml", "--ckpt-path", "last", cwd=checkout, site=site)
    assert (run / "eval" / "test-epoch=2-step=57.json").is_file()

    # 3. export the last checkpoint with torch.export, and run the artifact without ember's classes
    exported = ember("export", "--ckpt", "last", "-c", "configs/digits.yaml", "--format", "torch-export",
                     "--out", "exports", cwd=checkout, site=site)  # fmt: skip
    assert exported.stdout.startswith("export done in ")
    program = torch.export.load(checkout / "exports" / "classifier.pt2").module()
    assert program(torch.rand(5, 64)).shape == (5, 10)

    # 4. resume to 4 epochs: the same run continues; then there is nothing left to do
    resumed = ember("fit", "-c", "configs/digits.yaml", "trainer.max_epochs=4", "--resume", "last",
                    cwd=checkout, site=site)  # fmt: skip
    assert "ember: resuming from runs/classifier/version_0/checkpoints/epoch=2-step=57 (epoch 2, step 57" in (
        resumed.stderr
    )
    assert "(4 epochs, 76 steps)" in resumed.stdout
    again = ember("fit", "-c", "configs/digits.yaml", "trainer.max_epochs=4", "--resume", "last",
                  cwd=checkout, site=site)  # fmt: skip
    assert "ember: this run already finished (4/4 epochs done); nothing to do" in again.stderr.splitlines()

    # the run directory a user finds afterwards
    assert sorted(p.name for p in (checkout / "runs" / "classifier").iterdir()) == ["version_0"]
    layout = sorted(str(p.relative_to(run)) for p in run.iterdir())
    assert layout == ["checkpoints", "config-resume-1.yaml", "config-resume-2.yaml", "config.yaml", "eval",
                      "hparams.yaml", "metrics.csv", "status.json", "tensorboard"]  # fmt: skip
    evaluated = sorted({f"test-{best}.json", "test-epoch=2-step=57.json"})
    assert sorted(p.name for p in (run / "eval").iterdir()) == evaluated
    assert (run / "checkpoints" / "last").read_text().strip() == "epoch=3-step=76"
    header = (run / "metrics.csv").read_text().splitlines()[0].split(",")
    assert {"val/acc", "test/acc", "train/loss"} <= set(header)


USER_CONFIG = """\
trainer: {max_epochs: 1, enable_progress_bar: false, enable_model_summary: false, logger: false}
module: {_target_: my_models.nets.Tiny}
data: {_target_: my_models.nets.Points}
"""
USER_MODELS = """\
import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

import ember


class Tiny(ember.TrainingModule):
    def __init__(self):
        super().__init__()
        self.model = nn.Linear(2, 2)
        self.loss_fn = nn.CrossEntropyLoss()

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.1)


class Points(ember.DataModule):
    def train_dataloader(self):
        x = torch.randn(32, 2)
        return DataLoader(TensorDataset(x, (x[:, 0] > 0).long()), batch_size=8)
"""


def test_configs_import_from_their_project_in_any_directory(clone: tuple[Path, Path], tmp_path: Path) -> None:
    """docs/cli.md's rule: ``_target_`` imports from the config's folder and its project's root (the folder with
    pyproject.toml, setup.py, setup.cfg or .git), whatever the working directory."""
    checkout, site = clone
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    config = str(checkout / "configs" / "digits.yaml")
    done = ember("fit", "-c", config, "trainer.max_steps=2", "trainer.logger=false", cwd=elsewhere, site=site,
                 fresh=True)  # fmt: skip
    assert "(1 epoch, 2 steps)" in done.stdout and (elsewhere / "runs" / "classifier" / "version_0").is_dir()

    project = tmp_path / "my_project"  # a user's own layout: package at the root, configs in a folder
    (project / "my_models").mkdir(parents=True)
    (project / "configs").mkdir()
    (project / "my_models" / "__init__.py").write_text("")
    (project / "my_models" / "nets.py").write_text(USER_MODELS)
    (project / "configs" / "train.yaml").write_text(USER_CONFIG)
    user_config = str(project / "configs" / "train.yaml")
    failed = ember("fit", "-c", user_config, cwd=elsewhere, site=site, expect=2)  # no project marker yet
    assert failed.stderr.startswith("ember: error: ") and "my_models" in failed.stderr
    assert "Traceback" not in failed.stderr
    (project / "pyproject.toml").write_text('[project]\nname = "my-project"\nversion = "0.1"\n')
    done = ember("fit", "-c", user_config, cwd=elsewhere, site=site)
    assert "fit done in " in done.stdout and "(1 epoch, 4 steps)" in done.stdout
