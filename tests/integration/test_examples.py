"""Every example runs from its YAML config through the ``ember`` command for a couple of steps.

The runs go through `ember.cli.main` in this process (the command's code, from argument parsing to the
printed summary, without an interpreter start for each: eight processes spent most of this module's minute
of CPU importing torch, torchmetrics and the data libraries again; tests/integration/test_cli.py runs the
command as real processes). They run one after the other, each in the same working directory (the later
ones need the earlier ones' outputs: a checkpoint to predict from, a pretrained backbone to fine-tune), and
leave the process's environment, random streams and torch settings as found. The tests then check what each
run printed and left on disk. The outcomes of longer runs are in tests/integration/test_examples_outcomes.py.
"""

from __future__ import annotations

import contextlib
import csv
import io
import math
import os
import random
import re
import sys
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest
import torch

from ember import checkpoint as ckpt
from ember.cli import main

REPO = Path(__file__).resolve().parents[2]
CONFIGS = REPO / "configs"
SHORT = ["trainer.max_steps=2", "trainer.limit_val_batches=1", "trainer.num_sanity_val_steps=0", "trainer.logger=false"]
FINETUNE_KEY = "BackboneFinetuning[backbone=backbone]"

#: Eight runs of a few steps: about 12 s of CPU (57 s as eight processes).
pytestmark = pytest.mark.slow


@dataclass
class Run:
    args: list[str]
    stdout: str = ""
    stderr: str = ""


@contextlib.contextmanager
def _as_found() -> Iterator[None]:
    """Puts back what a run changes for the whole process: the environment (``EMBER_SEED``...), the random
    streams, the thread count and the default dtype (this module fixture runs outside the per-test restore of
    tests/conftest.py)."""
    environ, python, threads, dtype = (
        dict(os.environ),
        random.getstate(),
        torch.get_num_threads(),
        torch.get_default_dtype(),
    )
    numpy = sys.modules.get("numpy")
    numpy_state = numpy.random.get_state() if numpy is not None else None
    with torch.random.fork_rng(devices=[]):
        try:
            yield
        finally:
            os.environ.clear()
            os.environ.update(environ)
            random.setstate(python)
            if numpy is not None:
                numpy.random.set_state(numpy_state)
            if torch.get_num_threads() != threads:
                torch.set_num_threads(threads)
            torch.set_default_dtype(dtype)


def _ember(args: list[str], cwd: Path) -> Run:
    """``ember ARGS`` in `cwd`, through `ember.cli.main`; fails with its output unless it exits 0."""
    out, err, before = io.StringIO(), io.StringIO(), Path.cwd()
    with _as_found(), contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        os.chdir(cwd)
        try:
            code = main(args)
        finally:
            os.chdir(before)
    run = Run(args, out.getvalue(), err.getvalue())
    assert code == 0, f"ember {' '.join(args)} -> {code}\n{run.stdout}\n{run.stderr}"
    return run


def _wave(cwd: Path, commands: dict[str, list[str]]) -> dict[str, Run]:
    return {name: _ember(args, cwd) for name, args in commands.items()}


@pytest.fixture(scope="module")
def runs(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, dict[str, Run]]:
    """All the example runs, in one working directory."""
    cwd = tmp_path_factory.mktemp("examples")
    done = _wave(
        cwd,
        {
            "digits": ["fit", "-c", str(CONFIGS / "digits.yaml"), *SHORT],
            "digits_cnn": ["fit", "-c", str(CONFIGS / "digits_cnn.yaml"), *SHORT],
            "char_transformer": [
                "fit",
                "-c",
                str(CONFIGS / "char_transformer.yaml"),
                *SHORT,
                "data.max_bytes=50000",
                "module.n_layers=1",
                "module.max_new_tokens=8",
            ],
            "transfer_pretrain": ["fit", "-c", str(CONFIGS / "transfer_pretrain.yaml"), *SHORT],
            "gan": ["fit", "-c", str(CONFIGS / "gan.yaml"), *SHORT[:-1], "trainer.log_every_n_steps=1"],
        },
    )
    finetune = str(CONFIGS / "transfer_finetune.yaml")
    done |= _wave(
        cwd,
        {
            "char_predict": [
                "predict",
                "-c",
                str(CONFIGS / "char_transformer.yaml"),
                "--ckpt-path",
                "last",
                "data.max_bytes=50000",
                "module.n_layers=1",
                "module.max_new_tokens=8",
                "trainer.logger=false",
            ],
            "transfer_finetune": ["fit", "-c", finetune, *SHORT],
            "transfer_scratch": ["fit", "-c", finetune, "-c", str(CONFIGS / "transfer_scratch.yaml"), *SHORT],
        },
    )
    return cwd, done


def _summary(run: Run) -> dict[str, float]:
    """The metrics of the ``fit done ...`` line, after checking it ran exactly two steps."""
    line = next(line for line in run.stdout.splitlines() if line.startswith("fit done"))
    assert ", 2 steps)" in line, line
    return {k: float(v) for k, v in re.findall(r"(val/\w+) (-?[\d.]+|nan)", line)}


def _last_checkpoint(cwd: Path, run_name: str) -> Path:
    path = ckpt.newest_valid(cwd / "runs" / run_name / "version_0" / "checkpoints")
    assert path is not None, f"no checkpoint for {run_name}"
    return path


@pytest.mark.parametrize(("name", "run_name"), [("digits", "classifier"), ("digits_cnn", "digits_cnn")])
def test_digits_examples(runs: tuple[Path, dict[str, Run]], name: str, run_name: str) -> None:
    cwd, done = runs
    metrics = _summary(done[name])
    assert 0.0 <= metrics["val/acc"] <= 1.0
    assert 0.0 < metrics["val/loss"] < 2 * math.log(10)  # two steps from a random start
    meta, weights = ckpt.read_module_state(_last_checkpoint(cwd, run_name))
    assert ckpt.read_meta(_last_checkpoint(cwd, run_name))["state"]["progress"]["global_step"] == 2
    if name == "digits_cnn":
        assert meta["module_class"] == "examples.digits.CNNClassifier"
        assert weights["model.backbone.0.weight"].shape == (32, 1, 3, 3)
        assert weights["model.head.weight"].shape == (10, 32 * 32)


def test_char_transformer_fit_and_predict(runs: tuple[Path, dict[str, Run]]) -> None:
    cwd, done = runs
    metrics = _summary(done["char_transformer"])
    assert 4.5 < metrics["val/loss"] < 6.5  # near ln(256) = 5.55 after two steps
    assert metrics["val/ppl"] == pytest.approx(math.exp(metrics["val/loss"]), rel=1e-3)
    meta = ckpt.read_meta(_last_checkpoint(cwd, "char_transformer"))
    assert meta["state"]["progress"]["global_step"] == 2
    assert meta["hparams"]["n_layers"] == 1 and meta["hparams"]["context"] == 128

    assert "3 batches of outputs saved" in done["char_predict"].stdout
    # predicting from a run's checkpoint writes into that run (eval/predict-<checkpoint>.pt), not a new version
    (saved,) = (cwd / "runs" / "char_transformer" / "version_0" / "eval").glob("predict-*.pt")
    predictions = torch.load(saved, weights_only=True)
    assert [len(batch) for batch in predictions] == [1, 1, 1]
    for prompt, (text,) in zip(["def ", "import ", "class "], predictions, strict=True):
        assert text.startswith(prompt)
        assert len(prompt) < len(text) <= len(prompt) + 8


def test_transfer_pretrain_finetune_and_scratch(runs: tuple[Path, dict[str, Run]]) -> None:
    cwd, done = runs
    for name in ("transfer_pretrain", "transfer_finetune", "transfer_scratch"):
        assert 0.0 <= _summary(done[name])["val/acc"] <= 1.0
    pretrained = torch.load(cwd / "runs" / "transfer_pretrain" / "backbone.pt", weights_only=True)
    assert pretrained["0.weight"].shape == (32, 1, 3, 3)

    # Fine-tuning: the callback froze the pretrained backbone for these two steps (eval mode, so the
    # BatchNorm statistics too), and its state is in the checkpoint.
    meta, weights = ckpt.read_module_state(_last_checkpoint(cwd, "transfer_finetune"))
    for key, value in pretrained.items():
        assert torch.equal(weights[f"model.backbone.{key}"], value), key
    full = ckpt.read_meta(_last_checkpoint(cwd, "transfer_finetune"))
    assert full["state"]["callbacks"][FINETUNE_KEY] == {"unfrozen_at_epoch": None, "backbone_lr": None}
    assert meta["hparams"]["backbone_path"] == "runs/transfer_pretrain/backbone.pt"

    # From scratch: no callback, a random backbone that trained.
    meta, weights = ckpt.read_module_state(_last_checkpoint(cwd, "transfer_scratch"))
    assert meta["hparams"]["backbone_path"] is None
    assert FINETUNE_KEY not in ckpt.read_meta(_last_checkpoint(cwd, "transfer_scratch"))["state"]["callbacks"]
    assert not torch.equal(weights["model.backbone.0.weight"], pretrained["0.weight"])


def test_gan_logs_both_losses(runs: tuple[Path, dict[str, Run]]) -> None:
    cwd, done = runs
    metrics = _summary(done["gan"])
    assert 0.5 < metrics["val/swd"] < 2.0  # untrained generator: far from the ring of radius 2
    meta = ckpt.read_meta(_last_checkpoint(cwd, "gan"))
    assert meta["state"]["progress"]["global_step"] == 2  # one batch: a discriminator and a generator step
    with open(cwd / "runs" / "gan" / "version_0" / "metrics.csv", newline="") as f:
        rows = [row for row in csv.DictReader(f) if row.get("train/d_loss")]
    # logged once per batch, at the batches taken before it (Lightning's axis under manual optimization), not
    # at the optimizer steps (2 per batch)
    assert [int(row["step"]) for row in rows] == [0]
    for row in rows:
        assert 0.0 < float(row["train/d_loss"]) < 5.0 and 0.0 < float(row["train/g_loss"]) < 5.0
