"""The hello-world example trains end to end and writes its run directory."""

from __future__ import annotations

import csv
from pathlib import Path

import pytest
import torch

import ember
from examples.digits import Classifier, DigitsData


def test_digits_has_a_held_out_test_split() -> None:
    """Validation picks the best checkpoint; the test split is held out from it and from training (issue 21,
    item 4): three disjoint splits of the 1,797 images, the same in every run, predict on the test images."""
    data = DigitsData()
    data.setup("fit")
    splits = {name: getattr(data, f"{name}_set") for name in ("train", "val", "test")}
    assert {name: len(s) for name, s in splits.items()} == {"train": 1169, "val": 359, "test": 269}
    rows = {name: {(*x.tolist(), int(y)) for x, y in s} for name, s in splits.items()}
    assert not rows["train"] & rows["test"] and not rows["val"] & rows["test"]
    assert len(rows["train"] | rows["val"] | rows["test"]) == len(set(map(tuple, _all_rows())))
    again = DigitsData()
    again.setup("test")
    assert torch.equal(again.test_set.tensors[0], data.test_set.tensors[0])
    assert torch.equal(next(iter(data.predict_dataloader()))[0], next(iter(data.test_dataloader()))[0])


def _all_rows() -> list[list[float]]:
    from examples.digits import load_digit_arrays

    x, y = load_digit_arrays()
    return [[*row.tolist(), int(label)] for row, label in zip(x, y, strict=True)]


@pytest.mark.slow
def test_digits_reaches_95_percent(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    ember.seed_everything(42)
    trainer = ember.Trainer(max_epochs=20, default_root_dir=tmp_path)
    module, data = Classifier(epochs=20), DigitsData()
    trainer.fit(module, datamodule=data)
    assert trainer.global_step == 20 * 19  # 1,169 training images / 64 per batch = 19 batches
    assert trainer.callback_metrics["val/acc"] >= 0.95

    # validate() reports the same figure the fit ended with; test() measures the held-out split
    (val,) = trainer.validate(module, datamodule=data)
    assert val["val/acc"] == pytest.approx(trainer.callback_metrics["val/acc"])
    (test,) = trainer.test(module, datamodule=data)
    assert test["test/acc"] >= 0.93 and test["test/acc"] != pytest.approx(val["val/acc"])

    run_dir = tmp_path / "classifier" / "version_0"
    assert (run_dir / "hparams.yaml").read_text().count("lr: 0.003") == 1
    with open(run_dir / "metrics.csv", newline="") as f:
        rows = list(csv.DictReader(f))
    assert len([r for r in rows if r["val/acc"]]) == 20 + 1  # one row per fit epoch, one for validate()
    assert [float(r["test/acc"]) for r in rows if r["test/acc"]] == [pytest.approx(test["test/acc"])]
    # train/loss is written every log_every_n_steps=50 optimizer steps
    assert [int(r["step"]) for r in rows if r["train/loss"]] == list(range(49, 380, 50))  # steps 50, 100, ...: N - 1
    out = capsys.readouterr().out
    # epochs numbered from 0, as in the last checkpoint's name epoch=19-step=380
    assert "epoch 19/19  step 380" in out and "total    Classifier" in out
    assert "\ntest  test/acc 0.9" in out and "train/loss" not in out.split("\ntest  ")[1]
