"""CSVLogger: a header that grows, appends and atomic rewrites, hparams.yaml, resume."""

from __future__ import annotations

import csv
from pathlib import Path

import pytest
import torch
import yaml
from hypothesis import example, given, settings
from hypothesis import strategies as st

from ember.loggers import CSVLogger
from ember.loggers.csv import _plain
from ember.loggers.logger import public_params


def read_rows(path: Path) -> list[dict[str, str]]:
    with open(path, newline="") as f:
        return list(csv.DictReader(f))


def test_rows_and_growing_header(tmp_path: Path) -> None:
    logger = CSVLogger(save_dir=tmp_path)
    logger.log_metrics({"train/loss": 0.5}, step=1)
    logger.save()
    logger.log_metrics({"train/loss": 0.25, "val/acc": 0.75}, step=2)
    logger.finalize("success")
    rows = read_rows(tmp_path / "metrics.csv")
    assert rows == [
        {"step": "1", "train/loss": "0.5", "val/acc": ""},
        {"step": "2", "train/loss": "0.25", "val/acc": "0.75"},
    ]
    assert not list(tmp_path.glob("*.tmp"))


def test_without_save_dir_it_writes_into_the_attached_run_dir(tmp_path: Path) -> None:
    logger = CSVLogger()
    with pytest.raises(RuntimeError, match="no save_dir yet"):
        _ = logger.log_dir
    logger.attach(tmp_path / "run" / "version_3")
    logger.log_metrics({"a": 1.0}, step=1)
    logger.save()
    assert (tmp_path / "run" / "version_3" / "metrics.csv").exists()
    explicit = CSVLogger(save_dir=tmp_path / "mine")
    explicit.attach(tmp_path / "ignored")
    assert explicit.log_dir == tmp_path / "mine"


def test_hparams_yaml(tmp_path: Path) -> None:
    logger = CSVLogger(save_dir=tmp_path)
    logger.log_hyperparams({"lr": 0.1, "layers": [1, 2], "act": object})
    assert not (logger.log_dir / "hparams.yaml").exists()  # written with the rows, not before the first batch
    logger.save()
    text = (logger.log_dir / "hparams.yaml").read_text()
    assert "lr: 0.1" in text and "- 1" in text and "act: <class 'object'>" in text


def test_nothing_written_without_rows(tmp_path: Path) -> None:
    logger = CSVLogger(save_dir=tmp_path / "run")
    logger.finalize("success")
    assert not (tmp_path / "run").exists()


def test_appends_when_columns_are_unchanged(tmp_path: Path) -> None:
    logger = CSVLogger(save_dir=tmp_path)
    for step in range(1, 4):
        logger.log_metrics({"a": float(step)}, step=step)
        logger.save()
    logger.log_metrics({"a": 4.0, "b": 1.0}, step=4)
    logger.save()
    rows = read_rows(logger.metrics_path)
    assert [r["a"] for r in rows] == ["1.0", "2.0", "3.0", "4.0"]
    assert [r["b"] for r in rows] == ["", "", "", "1.0"]
    assert logger.metrics_path.read_text().count("step") == 1


def test_resume_drops_rows_after_the_checkpoint_step(tmp_path: Path) -> None:
    first = CSVLogger(save_dir=tmp_path)
    for step in range(1, 6):
        first.log_metrics({"a": float(step)}, step=step)
    first.finalize("failed")
    resumed = CSVLogger(save_dir=tmp_path)
    resumed.load_state_dict({"step": 3})
    resumed.log_metrics({"a": 40.0, "b": 1.0}, step=4)
    resumed.finalize("success")
    rows = read_rows(tmp_path / "metrics.csv")
    assert [(r["step"], r["a"], r["b"]) for r in rows] == [
        ("1", "1.0", ""),
        ("2", "2.0", ""),
        ("3", "3.0", ""),
        ("4", "40.0", "1.0"),
    ]


def test_hparams_are_written_by_finalize_without_rows(tmp_path: Path) -> None:
    logger = CSVLogger(save_dir=tmp_path / "run")
    logger.log_hyperparams({"lr": 0.1})
    logger.finalize("failed")
    assert (tmp_path / "run" / "hparams.yaml").read_text() == "lr: 0.1\n"
    assert not (tmp_path / "run" / "metrics.csv").exists()


_SCALARS = st.one_of(
    st.none(), st.booleans(), st.integers(-(2**40), 2**40), st.floats(allow_nan=False),
    st.text(max_size=12),  # strings that read as numbers, bools, null or dates must stay strings
    st.sampled_from(["null", "true", "no", "1e3", "0x10", "2026-12-03", "~", "a: b", "- x", "'q'", "#c"]),
)  # fmt: skip
_PARAMS = st.dictionaries(
    st.text(min_size=1, max_size=8),
    st.recursive(_SCALARS, lambda inner: st.lists(inner, max_size=3) | st.dictionaries(
        st.text(min_size=1, max_size=6), inner, max_size=3), max_leaves=8),
    max_size=6,
)  # fmt: skip


@settings(max_examples=60, deadline=None)
@given(params=_PARAMS)
@example(params={"APIKEY": None})  # a name like a credential, drawn by freshly drawn examples: left out
@example(params={"a": {"token": 1, "b": 2}})
def test_hparams_yaml_reads_back_as_omegaconf_wrote_it(params: dict, tmp_path_factory: pytest.TempPathFactory) -> None:
    """Differential: the file loads to the values, and to what ``OmegaConf.to_yaml`` (the writer before) gave;
    entries named like credentials are left out (`public_params`)."""
    from omegaconf import OmegaConf

    directory = tmp_path_factory.mktemp("hparams")
    logger = CSVLogger(save_dir=directory)
    logger.log_hyperparams(params)
    logger.save()
    written = yaml.safe_load((directory / "hparams.yaml").read_text(encoding="utf-8"))
    plain = _plain(public_params(params))
    assert written == (plain or None) or written == plain
    assert written == yaml.safe_load(OmegaConf.to_yaml(OmegaConf.create(plain)))


def test_hparams_of_numpy_and_enum_types_are_written_as_plain_values(tmp_path: Path) -> None:
    import enum

    import numpy as np

    class Size(enum.IntEnum):
        SMALL = 3

    logger = CSVLogger(save_dir=tmp_path)
    params = {"lr": np.float64(0.5), "n": np.int64(7), "size": Size.SMALL, "flag": np.bool_(True),
              "scale": torch.tensor(2.5), "weights": torch.ones(2)}  # fmt: skip
    logger.log_hyperparams(params)
    logger.save()
    assert yaml.safe_load((tmp_path / "hparams.yaml").read_text()) == {
        "lr": 0.5, "n": 7, "size": 3, "flag": True, "scale": 2.5, "weights": repr(torch.ones(2)),
    }  # fmt: skip
