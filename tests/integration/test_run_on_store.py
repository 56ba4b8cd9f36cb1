"""A run directory on object storage (``default_root_dir`` a URL), against fsspec's in-process ``memory://``
store: checkpoints, logs and ``status.json`` reach the store; ``last`` resumes on a machine whose local
staging folder is empty, bitwise; two runs get two versions, also when the store's listing lags; a
preempted run's logs and status are on the store when it exits."""

from __future__ import annotations

import json
import os
import signal
import sys
import time
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
from ember.checkpoint import manifest, run_store
from ember.checkpoint.store import open_store
from ember.cli import main

PROJECT = Path(__file__).resolve().parent / "cli_project"


@pytest.fixture
def url() -> Iterator[str]:
    """A ``memory://`` root of this test's own, removed afterwards."""
    root = f"memory://ember-runs-{uuid.uuid4().hex}/runs"
    yield root
    fs, path = open_store(root)
    bucket = path.rsplit("/", 1)[0]
    if fs.exists(bucket):
        fs.rm(bucket, recursive=True)


@pytest.fixture(autouse=True)
def cache(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """This test's staging cache (``EMBER_CACHE``), and a log sync every 50 ms."""
    monkeypatch.setenv(run_store.CACHE_ENV, str(tmp_path / "cache"))
    monkeypatch.setenv(run_store.SYNC_ENV, "0.05")
    return tmp_path / "cache"


class Tiny(ember.TrainingModule):
    def __init__(self) -> None:
        super().__init__()
        self.save_hyperparameters()
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


def _fit(root: str | Path, max_steps: int, ckpt_path: str | None = None, **options: Any) -> ember.Trainer:
    ember.seed_everything(0)
    options = {"logger": False, "enable_progress_bar": False, "enable_model_summary": False, **options}
    trainer = ember.Trainer(max_steps=max_steps, default_root_dir=root, **options)
    trainer.fit(Tiny(), _loader(), ckpt_path=ckpt_path)
    return trainer


def _params(trainer: ember.Trainer) -> list[torch.Tensor]:
    module = trainer.run_state.module
    assert module is not None
    return [p.detach().clone() for p in module.parameters()]


def _store_files(url: str) -> dict[str, bytes]:
    """Every object under `url`, by its name relative to `url`."""
    fs, root = open_store(url)
    return {name[len(root) + 1 :]: fs.cat_file(name) for name in fs.find(root)}


def test_fit_puts_checkpoints_logs_and_status_on_the_store_and_stages_them_in_the_cache(url: str, cache: Path) -> None:
    trainer = _fit(url, 12, logger=True, log_every_n_steps=1)
    assert trainer.run_url == f"{url}/tiny/version_0"
    assert trainer.run_dir == run_store.staging_dir(url) / "tiny" / "version_0"
    assert cache in trainer.run_dir.parents and not (Path.cwd() / "memory:").exists()
    stored = _store_files(trainer.run_url)
    local = {p.relative_to(trainer.run_dir).as_posix() for p in trainer.run_dir.rglob("*") if p.is_file()}
    logs = {n for n in local if not n.startswith("checkpoints/") and not n.split("/")[-1].startswith(".")}
    assert {"metrics.csv", "status.json"} <= logs
    assert any(n.startswith("tensorboard/") and "events.out.tfevents" in n for n in logs)
    for name in logs:  # the last sync ran after the loggers closed and status.json recorded the end
        assert stored[name] == (trainer.run_dir / name).read_bytes(), name
    assert json.loads(stored["status.json"])["status"] == "finished"
    assert b"train/loss" in stored["metrics.csv"].splitlines()[0]
    assert stored["checkpoints/last"].decode().strip() == "epoch=1-step=12"
    fs, root = open_store(trainer.run_url)
    found = manifest.committed(fs, f"{root}/checkpoints/epoch=1-step=12", "ckpt")
    assert found is not None and found["global_step"] == 12
    assert json.loads(stored["claim.json"])["holder"]["pid"] == os.getpid()


def test_resume_last_on_an_empty_machine_is_bitwise_exact_and_continues_the_version(
    url: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    full = _fit(tmp_path / "local", 16)
    first = _fit(url, 8)
    monkeypatch.setenv(run_store.CACHE_ENV, str(tmp_path / "other-machine"))  # nothing staged here
    resumed = _fit(url, 16, ckpt_path="last")
    assert resumed.ckpt_path is not None and Path(resumed.ckpt_path).name == "epoch=1-step=8"
    assert resumed.run_url == first.run_url == f"{url}/tiny/version_0"
    assert resumed.run_dir == tmp_path / "other-machine" / first.run_dir.relative_to(tmp_path / "cache")
    assert all(torch.equal(a, b) for a, b in zip(_params(full), _params(resumed), strict=True))
    assert _store_files(url)["tiny/version_0/checkpoints/last"].decode().strip() == "epoch=2-step=16"


def test_resume_last_with_nothing_on_the_store_starts_a_new_run(url: str) -> None:
    trainer = _fit(url, 2, ckpt_path="last")
    assert trainer.ckpt_path is None and trainer.run_url == f"{url}/tiny/version_0"


def test_two_runs_get_two_versions_from_any_machine(url: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    first = _fit(url, 1)
    monkeypatch.setenv(run_store.CACHE_ENV, str(tmp_path / "machine-b"))  # knows nothing of version_0
    second = _fit(url, 1)
    assert (first.run_url, second.run_url) == (f"{url}/tiny/version_0", f"{url}/tiny/version_1")
    assert second.run_dir.name == "version_1"


def test_a_claim_is_a_conditional_create_so_a_lagging_listing_still_gives_a_new_version(
    url: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(run_store, "store_versions", lambda fs, root: [])  # as if the listing lagged the claims
    runs = [run_store.claim_version(f"{url}/net", tmp_path / f"machine-{i}") for i in range(3)]
    assert [r[1] for r in runs] == [f"{url}/net/version_{i}" for i in range(3)]
    assert all(path.is_dir() and path.name == f"version_{i}" for i, (path, _) in enumerate(runs))


def test_logs_reach_the_store_while_the_fit_runs(url: str) -> None:
    seen: list[str] = []

    class Watch(ember.Callback):
        def on_train_batch_end(self, trainer: Any, module: Any, outputs: Any, batch: Any, batch_idx: int) -> None:
            if trainer.global_step != 3:
                return
            fs, root = open_store(trainer.run_url)
            deadline = time.monotonic() + 5
            while time.monotonic() < deadline and not fs.exists(f"{root}/status.json"):
                time.sleep(0.02)
            seen.append(json.loads(fs.cat_file(f"{root}/status.json"))["status"])

    _fit(url, 6, callbacks=[Watch()])
    assert seen == ["running"]


def test_a_preempted_fit_leaves_its_status_and_a_loadable_last_on_the_store(url: str, tmp_path: Path) -> None:
    class Preempt(ember.Callback):
        def on_train_batch_end(self, trainer: Any, module: Any, outputs: Any, batch: Any, batch_idx: int) -> None:
            if trainer.global_step == 5:
                os.kill(os.getpid(), signal.SIGTERM)

    with pytest.raises(SystemExit):
        _fit(url, 50, callbacks=[Preempt()])
    stored = _store_files(f"{url}/tiny/version_0")
    status = json.loads(stored["status.json"])
    assert status["status"] == "preempted" and status["global_step"] == 5
    path, run_dir, _ = run_store.find_last(f"{url}/tiny", tmp_path / "fresh", "fit") or (None, None, None)
    assert path is not None and path.name == stored["checkpoints/last"].decode().strip() == "epoch=0-step=5"
    assert run_dir == tmp_path / "fresh" / "version_0"


def test_a_bad_sync_period_is_refused_in_one_line(url: str, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(run_store.SYNC_ENV, "often")
    with pytest.raises(ValueError, match=r"EMBER_SYNC_EVERY_S='often' must be a number of seconds > 0"):
        _fit(url, 1)


def test_best_with_a_root_on_the_store_says_what_to_give(url: str) -> None:
    _fit(url, 2)
    with pytest.raises(ember.checkpoint.CheckpointError, match=r"ckpt_path='best'.*give the checkpoint's URL"):
        _fit(url, 4, ckpt_path="best")


YAML = """\
seed: 7
trainer:
  max_steps: 6
  enable_model_summary: false
  enable_progress_bar: false
  num_sanity_val_steps: 0
  log_every_n_steps: 1
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
def project(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[Path]:
    import shutil

    shutil.copytree(PROJECT / "my_project", tmp_path / "my_project", ignore=shutil.ignore_patterns("__pycache__"))
    (tmp_path / "net.yaml").write_text(YAML)
    monkeypatch.setattr(sys, "path", list(sys.path))
    yield tmp_path / "net.yaml"
    for name in [m for m in sys.modules if m.startswith("my_project")]:
        del sys.modules[name]


def test_cli_fit_with_a_root_on_the_store_then_resume_last_on_an_empty_machine(
    project: Path, url: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    root = f"trainer.default_root_dir={url}"
    assert main(["fit", "-c", str(project), root]) == 0, capsys.readouterr().err
    stored = _store_files(f"{url}/net/version_0")
    assert {"config.yaml", "metrics.csv", "status.json", "checkpoints/last"} <= set(stored)
    capsys.readouterr()
    monkeypatch.setenv(run_store.CACHE_ENV, str(tmp_path / "other-machine"))
    assert main(["fit", "-c", str(project), root, "trainer.max_steps=9", "--resume", "last"]) == 0
    err = capsys.readouterr().err
    assert f"resuming from {url}/net/version_0/checkpoints/" in err
    stored = _store_files(f"{url}/net/version_0")
    assert json.loads(stored["status.json"])["global_step"] == 9
    assert "config-resume-1.yaml" in stored  # the first segment's config.yaml was brought back, and kept
    steps = [int(row.split(b",")[0]) for row in stored["metrics.csv"].splitlines()[1:]]
    assert steps == sorted(steps) and steps[0] < 6 <= steps[-1]  # both segments' rows, in order


def test_a_run_on_the_store_is_named_by_its_url_first_and_its_staging_folder_second(
    project: Path, url: str, cache: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    assert main(["fit", "-c", str(project), f"trainer.default_root_dir={url}"]) == 0, capsys.readouterr().err
    staging = run_store.staging_dir(url) / "net" / "version_0"
    out = capsys.readouterr().out
    assert f"; run {url}/net/version_0 (staged in {staging})\n" in out, out
    status = json.loads(_store_files(f"{url}/net/version_0")["status.json"])
    assert (status["url"], status["staging"]) == (f"{url}/net/version_0", str(staging))
    assert json.loads((staging / "status.json").read_text())["url"] == f"{url}/net/version_0"


def test_the_best_checkpoint_of_a_run_on_the_store_is_named_by_its_url(url: str) -> None:
    from ember.callbacks.model_checkpoint import ModelCheckpoint
    from ember.cli import describe_stop

    saver = ModelCheckpoint(monitor="val/loss")  # after each epoch's validation
    ember.seed_everything(0)
    options = {"logger": False, "enable_progress_bar": False, "enable_model_summary": False}
    trainer = ember.Trainer(max_steps=12, default_root_dir=url, callbacks=[saver], **options)
    trainer.fit(Tiny(), _loader(), _loader())
    name = Path(saver.best_model_path).name
    line = describe_stop(trainer)
    staged = saver.best_model_path
    assert f"best checkpoint {trainer.run_url}/checkpoints/{name} (staged in {staged}) (val/loss " in line
    assert name in {"epoch=0-step=6", "epoch=1-step=12"}


def test_a_local_run_is_named_by_its_folder(tmp_path: Path) -> None:
    from ember.cli import run_location

    trainer = _fit(tmp_path / "runs", 2)
    assert run_location(trainer) == f"run dir {trainer.run_dir}"
    assert "url" not in json.loads((trainer.run_dir / "status.json").read_text())


def test_cli_test_and_export_take_last_of_a_run_on_the_store(
    project: Path, url: str, capsys: pytest.CaptureFixture[str]
) -> None:
    root = f"trainer.default_root_dir={url}"
    assert main(["fit", "-c", str(project), root]) == 0, capsys.readouterr().err
    capsys.readouterr()
    assert main(["test", "-c", str(project), root, "--ckpt", "last"]) == 0
    assert f"test: loading {url}/net/version_0/checkpoints/epoch=" in capsys.readouterr().err
    assert any(name.startswith("eval/test-epoch=") for name in _store_files(f"{url}/net/version_0"))  # synced
    assert main(["validate", "-c", str(project), root, "--run", "version_0", "--ckpt", "last"]) == 0
    assert f"validate: loading {url}/net/version_0/checkpoints" in capsys.readouterr().err
    assert main(["predict", "-c", str(project), root, "--ckpt", "last"]) == 0, capsys.readouterr().err
    stored = _store_files(f"{url}/net/version_0")
    outputs = [name for name in stored if name.startswith("eval/predict-epoch=") and name.endswith(".pt")]
    line = capsys.readouterr().out.strip()  # the store's copy first, then the staged one
    assert f"outputs saved to {url}/net/version_0/{outputs[0]} (staged in " in line, line
    assert len(outputs) == 1 and stored[outputs[0]] == Path(line.split()[-1].rstrip(")")).read_bytes()
    out = project.parent / "exports"
    export = ["export", "-c", str(project), root, "--format", "safetensors", "--out", str(out), "--name", "net"]
    assert main([*export, "--ckpt", "last"]) == 0, capsys.readouterr().err
    assert (out / "net.safetensors").stat().st_size > 0
    capsys.readouterr()
    for argv in (
        [*export, "--ckpt", "best"],
        ["test", "-c", str(project), root, "--run", "version_0", "--ckpt", "best"],
    ):
        assert main(argv) == 2
        err = capsys.readouterr().err.strip().splitlines()
        assert len(err) == 1 and "store" in err[0] and "Traceback" not in err[0], err


def test_an_evaluation_that_leaves_nothing_releases_its_version_on_the_store(url: str) -> None:
    ember.seed_everything(0)
    trainer = ember.Trainer(default_root_dir=url, logger=False, enable_progress_bar=False, enable_model_summary=False)
    trainer.validate(Tiny(), _loader())  # no checkpoint: nothing to record, the claimed version is given back
    assert not trainer.run_dir.exists()
    fs, root = open_store(url)
    assert fs.find(root) == []
    assert _fit(url, 1).run_url == f"{url}/tiny/version_0"  # the number is free again


def test_a_root_on_a_store_nothing_can_open_fails_in_one_line_before_writing_anything(cache: Path) -> None:
    with pytest.raises(
        ember.checkpoint.CheckpointError, match=r"default_root_dir=nosuch://b/runs.*cannot open"
    ) as info:
        _fit("nosuch://b/runs", 1)
    assert len(str(info.value).splitlines()) == 1 and "install" in str(info.value)
    assert not cache.exists() and list(Path.cwd().iterdir()) == []


def test_a_root_on_a_file_url_whose_folders_do_not_exist_yet(tmp_path: Path) -> None:
    """fsspec's local filesystem does not make parent folders unless asked, unlike an object store: every run on a
    ``file://`` root failed to claim its version ('cannot create a run ... FileNotFoundError')."""
    root = (tmp_path / "store" / "runs").as_uri()
    first = _fit(root, 3)
    assert first.run_url == f"{root}/tiny/version_0"
    assert (tmp_path / "store/runs/tiny/version_0/checkpoints/last").read_text().strip() == "epoch=0-step=3"
    again = _fit(root, 5, ckpt_path="last")
    assert again.run_url == first.run_url and again.global_step == 5
    saver = ember.callbacks.ModelCheckpoint(dirpath=(tmp_path / "ck" / "deep").as_uri(), every_n_train_steps=2)
    _fit(tmp_path / "local", 2, callbacks=[saver])
    assert (tmp_path / "ck/deep/last").read_text().strip() == "epoch=0-step=2"


STOP_AT_1 = """\
import ember


class CtrlCAt(ember.Callback):
    def on_train_batch_end(self, trainer, module, outputs, batch, batch_idx):
        if trainer.global_step == 1:
            raise KeyboardInterrupt
"""


def test_cli_resume_last_on_the_store_refuses_to_extend_an_older_run(
    project: Path, url: str, capsys: pytest.CaptureFixture[str]
) -> None:
    (project.parent / "my_project" / "ctrl_c.py").write_text(STOP_AT_1)
    root = f"trainer.default_root_dir={url}"
    assert main(["fit", "-c", str(project), root]) == 0
    stop = "trainer.callbacks=[{_target_: my_project.ctrl_c.CtrlCAt}]"
    assert main(["fit", "-c", str(project), root, stop]) == 130
    assert "net/version_1 has no checkpoint yet, so there is nothing to resume" in capsys.readouterr().err
    before = _store_files(f"{url}/net/version_0")

    assert main(["fit", "-c", str(project), root, "trainer.max_steps=9", "--resume", "last"]) == 2
    line = capsys.readouterr().err.splitlines()[-1]
    assert f"--resume last: the newest run, {url}/net/version_1 (stopped: interrupted), has no checkpoint" in line
    assert f"to continue {url}/net/version_0 from {url}/net/version_0/checkpoints/epoch=" in line
    assert _store_files(f"{url}/net/version_0") == before  # version_0 not extended

    # The command the line gives continues the older run.
    continue_older = line.split("`")[1].split()
    assert continue_older[-2:] == ["--resume", f"{url}/net/version_0"]
    assert main(continue_older[1:]) == 0
    err = capsys.readouterr().err
    assert f"resuming run {url}/net/version_0 from {url}/net/version_0/checkpoints/" in err
    status = json.loads(_store_files(f"{url}/net/version_0")["status.json"])
    assert status["global_step"] == 9 and status["status"] == "finished"
    assert not _store_files(f"{url}/net/version_2")  # no new run


def test_cli_fit_on_a_run_another_machine_writes_now_is_refused_in_one_line(
    project: Path, url: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    root = f"trainer.default_root_dir={url}"
    assert main(["fit", "-c", str(project), root]) == 0, capsys.readouterr().err
    fs, path = open_store(f"{url}/net/version_0")
    holder = {"host": "other-node", "machine": "m", "pid": 4242, "process_start": "7", "since": time.time()}
    fs.pipe_file(f"{path}/.writer-0.lock", json.dumps({**holder, "token": "t" * 32}).encode())  # machine B's fit
    before = _store_files(f"{url}/net/version_0")
    monkeypatch.setenv(run_store.CACHE_ENV, str(tmp_path / "machine-c"))
    capsys.readouterr()
    assert main(["fit", "-c", str(project), root, "trainer.max_steps=9", "--resume", "last"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert f"run {url}/net/version_0 is being written by another process: pid 4242 on host other-node" in err[-1]
    assert _store_files(f"{url}/net/version_0") == before  # refused before anything was written
    assert not fs.exists(f"{path.rsplit('/', 1)[0]}/version_1")


def test_a_run_url_without_a_committed_checkpoint_is_refused_saying_so(url: str) -> None:
    first = _fit(url, 2, enable_checkpointing=False)  # a run on the store, with no checkpoint
    assert first.run_url == f"{url}/tiny/version_0"
    with pytest.raises(ember.checkpoint.CheckpointError) as refused:
        _fit(url, 4, ckpt_path=first.run_url)
    assert str(refused.value) == f"ckpt_path={url}/tiny/version_0: this run has no committed checkpoint on the store"
