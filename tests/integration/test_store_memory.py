"""Checkpoints on object storage through every path-taking entry point, against fsspec's ``memory://`` store
(in-process, so the ``ember`` command runs through `ember.cli.main`). What a user gives as a URL is never
folded into a local folder named ``memory:`` or ``s3:``."""

from __future__ import annotations

import shutil
import sys
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
from torch import nn
from torch.nn import functional as F
from torch.utils.data import DataLoader, TensorDataset

import ember
from ember.callbacks.model_checkpoint import ModelCheckpoint
from ember.checkpoint import CheckpointError, manifest
from ember.checkpoint.store import open_store
from ember.cli import main

PROJECT = Path(__file__).resolve().parent / "cli_project"


@pytest.fixture
def url() -> Iterator[str]:
    """A ``memory://`` folder of this test's own, removed afterwards."""
    folder = f"memory://ember-test-{uuid.uuid4().hex}/ckpts"
    yield folder
    fs, root = open_store(folder)
    bucket = root.rsplit("/", 1)[0]
    if fs.exists(bucket):
        fs.rm(bucket, recursive=True)


class Tiny(ember.TrainingModule):
    def __init__(self) -> None:
        super().__init__()
        self.net = nn.Sequential(nn.Linear(3, 8), nn.Dropout(0.2), nn.Linear(8, 1))

    def training_step(self, batch: Any, batch_idx: int) -> Any:
        x, y = batch
        loss = F.mse_loss(self.net(x), y)
        self.log("train/loss", loss)
        return loss

    def validation_step(self, batch: Any, batch_idx: int) -> None:
        x, y = batch
        self.log("val/loss", F.mse_loss(self.net(x), y))

    def configure_optimizers(self) -> Any:
        return torch.optim.AdamW(self.parameters(), lr=0.05)


def _loader() -> DataLoader[Any]:
    g = torch.Generator().manual_seed(0)
    data = TensorDataset(torch.randn(24, 3, generator=g), torch.randn(24, 1, generator=g))
    return DataLoader(data, batch_size=4, shuffle=True, generator=torch.Generator().manual_seed(1))


def _fit(root: Path, max_steps: int, callbacks: list[Any], ckpt_path: str | None = None) -> ember.Trainer:
    ember.seed_everything(0)
    trainer = ember.Trainer(
        max_steps=max_steps, default_root_dir=root, callbacks=callbacks, logger=False,
        enable_progress_bar=False, enable_model_summary=False,
    )  # fmt: skip
    trainer.fit(Tiny(), _loader(), ckpt_path=ckpt_path)
    return trainer


def _params(trainer: ember.Trainer) -> list[torch.Tensor]:
    module = trainer.run_state.module
    assert module is not None
    return [p.detach().clone() for p in module.parameters()]


def _committed(url: str) -> dict[str, int]:
    fs, root = open_store(url)
    out = {}
    for info in fs.ls(root, detail=True):
        name = info["name"].rsplit("/", 1)[-1]
        found = manifest.committed(fs, f"{root}/{name}", url) if info["type"] == "directory" else None
        if found is not None:
            out[name] = found["global_step"]
    return out


@pytest.mark.parametrize("root", ["memory://k:s3cret@bucket/runs", "s3://bucket/runs?token=s3cret"])
def test_a_url_root_dir_with_credentials_is_refused_in_one_line_and_makes_no_local_folder(
    root: str, tmp_path: Path
) -> None:
    with pytest.raises(CheckpointError, match=r"default_root_dir=.*://.*credentials.*environment") as info:
        ember.Trainer(default_root_dir=root)
    assert "s3cret" not in str(info.value) and len(str(info.value).splitlines()) == 1
    assert list(Path.cwd().iterdir()) == []  # no 's3:' / 'memory:' folder


def test_save_checkpoint_to_a_url_is_refused_and_writes_nothing(tmp_path: Path) -> None:
    trainer = _fit(tmp_path / "runs", 1, [])
    with pytest.raises(ValueError, match="ModelCheckpoint\\(dirpath=URL\\)"):
        trainer.save_checkpoint("memory://bucket/one")
    assert not (Path.cwd() / "memory:").exists()


def test_checkpoints_go_to_the_store_keep_top_k_and_resume_bitwise_anywhere(tmp_path: Path, url: str) -> None:
    every = lambda: ModelCheckpoint(dirpath=url, every_n_train_steps=2, save_top_k=2, async_save=True)  # noqa: E731
    full = _fit(tmp_path / "a", 12, [every()])
    stored = _committed(url)
    assert sorted(stored.values()) == [10, 12]  # top-2 by recency; older ones left the store
    fs, root = open_store(url)
    assert fs.cat_file(f"{root}/last").decode().strip() == "epoch=1-step=12"
    assert not (Path.cwd() / "memory:").exists()
    # A fresh machine: nothing local; the store's `last` resumes the step-6 state exactly.
    _fit(tmp_path / "b", 6, [ModelCheckpoint(dirpath=url + "2", every_n_train_steps=2, save_top_k=-1)])
    assert _committed(url + "2") == {"epoch=0-step=2": 2, "epoch=0-step=4": 4, "epoch=0-step=6": 6}
    shutil.rmtree(tmp_path / "b")
    resumed = _fit(tmp_path / "c", 12, [], ckpt_path=url + "2/last")
    assert resumed.global_step == 12
    assert all(torch.equal(a, b) for a, b in zip(_params(full), _params(resumed), strict=True))


def test_validate_and_a_checkpoint_url_or_its_folder(tmp_path: Path, url: str) -> None:
    _fit(tmp_path / "a", 4, [ModelCheckpoint(dirpath=url, every_n_train_steps=2, save_top_k=-1)])
    trainer = ember.Trainer(default_root_dir=tmp_path / "v", logger=False, enable_progress_bar=False)
    val = DataLoader(TensorDataset(torch.randn(4, 3), torch.randn(4, 1)), batch_size=2)
    for given in (f"{url}/epoch=0-step=2", url, f"{url}/last"):
        trainer.validate(Tiny(), val, ckpt_path=given)
        assert trainer.ckpt_path is not None and Path(trainer.ckpt_path).name in ("epoch=0-step=2", "epoch=0-step=4")
    with pytest.raises(CheckpointError, match="no committed checkpoint"):
        trainer.validate(Tiny(), val, ckpt_path=f"{url}/nothing-here")


def test_a_model_checkpoint_url_with_credentials_is_refused_without_showing_them() -> None:
    with pytest.raises(CheckpointError) as info:
        ModelCheckpoint(dirpath="s3://AKIDEXAMPLE:wJalrXUtnFEMI@bucket/ckpts")
    assert "wJalrXUtnFEMI" not in str(info.value) and "AKIDEXAMPLE" not in str(info.value)


# --- the ember command ----------------------------------------------------------------------------------

YAML = """\
seed: 7
trainer:
  max_steps: 6
  enable_model_summary: false
  enable_progress_bar: false
  num_sanity_val_steps: 0
  logger: false
  callbacks:
    - _target_: ember.callbacks.model_checkpoint.ModelCheckpoint
      dirpath: {url}
      every_n_train_steps: 3
      save_top_k: -1
module:
  _target_: my_project.models.Net
  hidden: 8
data:
  _target_: my_project.models.Blobs
  batch_size: 16
optimizer:
  _target_: torch.optim.SGD
  lr: 0.5
"""


@pytest.fixture
def project(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, url: str) -> Iterator[Path]:
    shutil.copytree(PROJECT / "my_project", tmp_path / "my_project", ignore=shutil.ignore_patterns("__pycache__"))
    (tmp_path / "net.yaml").write_text(YAML.format(url=url))
    monkeypatch.setattr(sys, "path", list(sys.path))
    yield tmp_path / "net.yaml"
    for name in [m for m in sys.modules if m.startswith("my_project")]:
        del sys.modules[name]


def test_cli_url_root_dir_with_credentials_exits_2_in_one_line(
    project: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    assert main(["fit", "-c", str(project), "trainer.default_root_dir=s3://AKID:s3cret@bucket/runs"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "credentials" in err[0] and "Traceback" not in err[0] and "s3cret" not in err[0]
    assert not (Path.cwd() / "s3:").exists()


@pytest.mark.parametrize(
    "override",
    [
        "trainer.default_root_dir=s3://AKID:s3cret@bucket/runs",
        "trainer.callbacks=[{_target_: ember.callbacks.ModelCheckpoint, dirpath: 's3://AKID:s3cret@bucket/ck'}]",
    ],
)
def test_cli_print_config_refuses_a_url_with_credentials_without_showing_them(
    project: Path, override: str, capsys: pytest.CaptureFixture[str]
) -> None:
    """--print-config checks the config but built nothing, so it printed the secret and exited 0."""
    assert main(["fit", "-c", str(project), override, "--print-config"]) == 2
    out, err = capsys.readouterr()
    assert out == "" and "s3cret" not in err and "AKID" not in err
    assert err.strip().count("\n") == 0 and "credentials or query parameters in a URL are not accepted" in err


def test_cli_fit_to_the_store_then_resume_and_test_from_urls(
    project: Path, url: str, capsys: pytest.CaptureFixture[str]
) -> None:
    root = f"trainer.default_root_dir={project.parent / 'runs'}"
    assert main(["fit", "-c", str(project), root]) == 0
    assert sorted(_committed(url).values()) == [3, 6]
    capsys.readouterr()
    assert main(["fit", "-c", str(project), root, "trainer.max_steps=9", "--resume", f"{url}/last"]) == 0
    assert f"resuming from {url}/" in capsys.readouterr().err
    assert max(_committed(url).values()) == 9
    assert main(["test", "-c", str(project), root, "--ckpt", f"{url}/last"]) == 0
    assert f"test: loading {url}/" in capsys.readouterr().err
    assert main(["test", "-c", str(project), root, "--ckpt", f"{url}/missing"]) == 2
    assert "no committed checkpoint" in capsys.readouterr().err


def test_fit_last_on_a_machine_without_local_checkpoints_takes_the_stores_newest(tmp_path: Path, url: str) -> None:
    saver = lambda: ModelCheckpoint(dirpath=url, every_n_train_steps=2, save_top_k=1)  # noqa: E731
    full = _fit(tmp_path / "a", 8, [saver()])
    _fit(tmp_path / "b", 4, [ModelCheckpoint(dirpath=url + "-b", every_n_train_steps=2, save_top_k=1)])
    resumed = _fit(tmp_path / "c", 8, [ModelCheckpoint(dirpath=url + "-b", every_n_train_steps=2)], ckpt_path="last")
    assert resumed.ckpt_path is not None and Path(resumed.ckpt_path).name == "epoch=0-step=4"
    assert all(torch.equal(a, b) for a, b in zip(_params(full), _params(resumed), strict=True))
    empty = _fit(tmp_path / "d", 1, [ModelCheckpoint(dirpath=url + "-none")], ckpt_path="last")
    assert empty.ckpt_path is None  # nothing local, nothing on the store: a new run


def test_a_logger_save_dir_url_is_refused_in_one_line() -> None:
    from ember.loggers import CSVLogger, TensorBoardLogger

    for cls in (CSVLogger, TensorBoardLogger):
        with pytest.raises(ValueError, match=r"save_dir=s3://b/logs\): logs are written to a local folder"):
            cls(save_dir="s3://b/logs")
    assert list(Path.cwd().iterdir()) == []


def test_cli_export_from_a_checkpoint_url_and_never_to_one(
    project: Path, url: str, capsys: pytest.CaptureFixture[str]
) -> None:
    root = f"trainer.default_root_dir={project.parent / 'runs'}"
    assert main(["fit", "-c", str(project), root]) == 0
    out = project.parent / "exports"
    argv = ["export", "-c", str(project), root, "--ckpt", f"{url}/last", "--format", "safetensors"]
    assert main([*argv, "--out", str(out), "--name", "net"]) == 0, capsys.readouterr().err
    assert (out / "net.safetensors").stat().st_size > 0
    capsys.readouterr()
    assert main([*argv, "--out", "s3://bucket/exports"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "exports are written to a local folder" in err[0]
    assert not (Path.cwd() / "s3:").exists()


def test_a_local_fit_with_checkpoints_never_imports_fsspec(tmp_path: Path) -> None:
    import subprocess

    code = f"""
import sys, torch
sys.path.insert(0, {str(Path(__file__).parent)!r})
from test_store_memory import Tiny, _loader
import ember
from ember.callbacks.model_checkpoint import ModelCheckpoint
trainer = ember.Trainer(max_steps=2, default_root_dir={str(tmp_path)!r}, logger=False, enable_progress_bar=False,
                        callbacks=[ModelCheckpoint(every_n_train_steps=1, async_save=True)])
trainer.fit(Tiny(), _loader())
trainer.fit(Tiny(), _loader(), ckpt_path="last")
print(sorted(m for m in sys.modules if m.split(".")[0] in ("fsspec", "s3fs", "botocore")))
"""
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.strip().splitlines()[-1] == "[]"
    assert len(list((tmp_path / "tiny").glob("version_*/checkpoints/epoch=*"))) >= 1


def test_a_resume_on_a_new_machine_keeps_the_ranking_of_the_checkpoints_on_the_store(tmp_path: Path, url: str) -> None:
    """The kept checkpoints are named in the state by the paths of the machine that saved them: matched by name
    in the store folder, the resumed run still keeps them (save_top_k=-1 keeps all) instead of evicting them."""
    keep_all = lambda: ModelCheckpoint(dirpath=url, every_n_train_steps=2, save_top_k=-1)  # noqa: E731
    _fit(tmp_path / "machine-a", 4, [keep_all()])
    assert _committed(url) == {"epoch=0-step=2": 2, "epoch=0-step=4": 4}
    saver = keep_all()
    _fit(tmp_path / "machine-b", 8, [saver], ckpt_path="last")
    committed = _committed(url)
    assert sorted(committed.values()) == [2, 4, 6, 8]  # the first machine's two kept as well
    assert sorted(Path(p).name for p in saver.kept) == sorted(committed)
