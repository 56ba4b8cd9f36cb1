"""CSVLogger: versioned folders, a header that grows, atomic rewrites, hparams.yaml."""

from __future__ import annotations

import csv
from pathlib import Path

from ember.loggers import CSVLogger


def read_rows(path: Path) -> list[dict[str, str]]:
    with open(path, newline="") as f:
        return list(csv.DictReader(f))


def test_rows_and_growing_header(tmp_path: Path) -> None:
    logger = CSVLogger(save_dir=tmp_path, name="run")
    assert logger.version == "version_0"
    logger.log_metrics({"train/loss": 0.5}, step=1)
    logger.save()
    logger.log_metrics({"train/loss": 0.25, "val/acc": 0.75}, step=2)
    logger.finalize("success")
    rows = read_rows(tmp_path / "run" / "version_0" / "metrics.csv")
    assert rows == [
        {"step": "1", "train/loss": "0.5", "val/acc": ""},
        {"step": "2", "train/loss": "0.25", "val/acc": "0.75"},
    ]
    assert not list((tmp_path / "run" / "version_0").glob("*.tmp"))


def test_versions_increment(tmp_path: Path) -> None:
    (tmp_path / "run" / "version_0").mkdir(parents=True)
    (tmp_path / "run" / "version_3").mkdir()
    (tmp_path / "run" / "version_x").mkdir()
    assert CSVLogger(save_dir=tmp_path, name="run").version == "version_4"
    assert CSVLogger(save_dir=tmp_path, name="run", version="mine").log_dir == tmp_path / "run" / "mine"


def test_hparams_yaml(tmp_path: Path) -> None:
    logger = CSVLogger(save_dir=tmp_path, name="run")
    logger.log_hyperparams({"lr": 0.1, "layers": [1, 2], "act": object})
    text = (logger.log_dir / "hparams.yaml").read_text()
    assert "lr: 0.1" in text and "- 1" in text and "act: <class 'object'>" in text


def test_nothing_written_without_rows(tmp_path: Path) -> None:
    logger = CSVLogger(save_dir=tmp_path, name="run")
    logger.finalize("success")
    assert not (tmp_path / "run").exists()


def test_appends_when_columns_are_unchanged(tmp_path: Path) -> None:
    logger = CSVLogger(save_dir=tmp_path, name="run")
    for step in range(1, 4):
        logger.log_metrics({"a": float(step)}, step=step)
        logger.save()
    logger.log_metrics({"a": 4.0, "b": 1.0}, step=4)
    logger.save()
    rows = read_rows(logger.metrics_path)
    assert [r["a"] for r in rows] == ["1.0", "2.0", "3.0", "4.0"]
    assert [r["b"] for r in rows] == ["", "", "", "1.0"]
    assert logger.metrics_path.read_text().count("step") == 1
