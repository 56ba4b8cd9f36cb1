"""Checkpoints on a store whose manifest lies (docs/checkpoints.md, "What a reader trusts"): each lie is refused in
one line that names the checkpoint's URL, never the temporary folder it was downloaded into."""

from __future__ import annotations

import json
import uuid
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
from torch.utils.data import DataLoader, TensorDataset

import ember
from ember.checkpoint import CheckpointError
from ember.checkpoint.store import open_store

QUIET: dict[str, Any] = dict(logger=False, enable_progress_bar=False, enable_model_summary=False)


class Line(ember.TrainingModule):
    def __init__(self) -> None:
        super().__init__()
        self.net = torch.nn.Linear(3, 1)

    def training_step(self, batch: Any, batch_idx: int) -> Any:
        x, y = batch
        return torch.nn.functional.mse_loss(self.net(x), y)

    def configure_optimizers(self) -> Any:
        return torch.optim.SGD(self.parameters(), lr=0.1)


def _loader() -> DataLoader[Any]:
    g = torch.Generator().manual_seed(0)
    return DataLoader(TensorDataset(torch.randn(16, 3, generator=g), torch.randn(16, 1, generator=g)), batch_size=4)


@pytest.fixture
def saved(tmp_path: Path) -> Iterator[str]:
    """The URL of a committed checkpoint (step 2) on a ``memory://`` folder of this test's own."""
    folder = f"memory://ember-attack-{uuid.uuid4().hex}/ck"
    saver = ember.callbacks.ModelCheckpoint(dirpath=folder, every_n_train_steps=2)
    ember.Trainer(default_root_dir=str(tmp_path), max_steps=2, callbacks=[saver], **QUIET).fit(Line(), _loader())
    yield f"{folder}/epoch=0-step=2"
    fs, path = open_store(folder)
    fs.rm(path.rsplit("/", 1)[0], recursive=True)


def _rewrite_manifest(url: str, change: Callable[[dict[str, Any]], None]) -> None:
    fs, path = open_store(url)
    manifest = json.loads(fs.cat_file(f"{path}/manifest.json"))
    change(manifest)
    fs.pipe_file(f"{path}/manifest.json", json.dumps(manifest).encode())


def _resume(root: Path, url: str) -> None:
    ember.Trainer(default_root_dir=str(root), max_steps=3, **QUIET).fit(Line(), _loader(), ckpt_path=url)


def _entry(manifest: dict[str, Any], name: str) -> dict[str, Any]:
    return next(f for f in manifest["files"] if f["name"] == name)


def test_a_manifest_lying_about_a_size_or_checksum_is_refused_naming_the_url(saved: str, tmp_path: Path) -> None:
    _rewrite_manifest(saved, lambda m: _entry(m, "ember.pt").update(sha256="0" * 64))
    with pytest.raises(CheckpointError, match=f"^checkpoint {saved}: ember.pt does not match its manifest"):
        _resume(tmp_path, saved)
    _rewrite_manifest(saved, lambda m: _entry(m, "ember.pt").update(size=_entry(m, "ember.pt")["size"] + 1))
    with pytest.raises(CheckpointError, match=f"^checkpoint {saved}: ember.pt is \\d+ bytes, its manifest says"):
        _resume(tmp_path, saved)


def test_a_manifest_that_leaves_out_a_file_is_refused_naming_the_url(saved: str, tmp_path: Path) -> None:
    _rewrite_manifest(saved, lambda m: m.update(files=[f for f in m["files"] if f["name"] != ".metadata"]))
    with pytest.raises(CheckpointError, match=f"^checkpoint {saved}: .metadata is not in its manifest.json"):
        _resume(tmp_path, saved)
