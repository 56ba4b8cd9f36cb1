"""The hello-world example trains end to end and writes its run directory."""

from __future__ import annotations

import csv
from pathlib import Path

import pytest

import ember
from examples.digits import Classifier, DigitsData


@pytest.mark.slow
def test_digits_reaches_95_percent(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    ember.seed_everything(42)
    trainer = ember.Trainer(max_epochs=20, default_root_dir=tmp_path)
    module, data = Classifier(epochs=20), DigitsData()
    trainer.fit(module, datamodule=data)
    assert trainer.global_step == 20 * 23  # 1,438 training images / 64 per batch = 23 batches
    assert trainer.callback_metrics["val/acc"] >= 0.95

    # validate() reports the same figure the fit ended with; test() uses the same loader here.
    (val,) = trainer.validate(module, datamodule=data)
    assert val["val/acc"] == pytest.approx(trainer.callback_metrics["val/acc"])
    (test,) = trainer.test(module, datamodule=data)
    assert test["test/acc"] == pytest.approx(val["val/acc"])

    run_dir = tmp_path / "classifier" / "version_0"
    assert (run_dir / "hparams.yaml").read_text().count("lr: 0.003") == 1
    with open(run_dir / "metrics.csv", newline="") as f:
        rows = list(csv.DictReader(f))
    assert len([r for r in rows if r["val/acc"]]) == 20 + 1  # one row per fit epoch, one for validate()
    assert [float(r["test/acc"]) for r in rows if r["test/acc"]] == [pytest.approx(test["test/acc"])]
    # train/loss is written every log_every_n_steps=50 optimizer steps
    assert [int(r["step"]) for r in rows if r["train/loss"]] == list(range(50, 461, 50))
    out = capsys.readouterr().out
    assert "epoch 20/20  step 460" in out and "total    Classifier" in out
    assert "\ntest  test/acc 0.97" in out and "train/loss" not in out.split("\ntest  ")[1]
