"""WandbLogger: mode resolution without prompts or network, offline runs read back with wandb's reader, resume."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import torch

from ember.loggers import WandbLogger
from ember.loggers import wandb as wandb_module
from ember.loggers.wandb import STEP_METRIC, has_api_key, resolve_mode

FAKE_KEY = "0123456789abcdef0123456789abcdef01234567"  # 40 hex characters, like a real key


def read_run(run_file: Path) -> list[dict[str, Any]]:
    """Every record of a ``.wandb`` file, decoded by wandb's own reader: ``wandb leet inspect --json``.

    Runs the wandb-core command that CLI runs, directly (0.1 s instead of 1-2 s
    of Python start-up); falls back to the CLI if wandb-core's arguments change.
    """
    from wandb.util import get_core_path

    core = [get_core_path(), "leet", "inspect", "--no-observability", "--json"]
    fast = [*core, "--run-file", str(run_file), str(run_file.parent.parent)]
    out = subprocess.run(fast, capture_output=True, text=True, timeout=60)
    if out.returncode != 0:
        cli = [sys.executable, "-m", "wandb", "leet", "inspect", "--json", str(run_file)]
        out = subprocess.run(cli, capture_output=True, text=True, timeout=60, check=True)
    return [json.loads(line) for line in out.stdout.splitlines() if line.strip()]


def nested(item: dict[str, Any], key: str) -> Any:
    """`item[key]`; the reader prints a nested value either whole or as ``key.field`` entries."""
    if key in item:
        return item[key]
    return {k[len(key) + 1 :]: v for k, v in item.items() if k.startswith(key + ".")}


def run_files(root: Path) -> list[Path]:
    return sorted(root.glob("wandb/offline-run-*/run-*.wandb"))


@pytest.fixture
def no_credentials(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """An environment with no W&B key anywhere: empty netrc and settings, no variables."""
    for name in ("WANDB_API_KEY", "WANDB_IDENTITY_TOKEN_FILE", "WANDB_MODE", "WANDB_DISABLED", "WANDB_BASE_URL"):
        monkeypatch.delenv(name, raising=False)
    home = tmp_path / "home"
    home.mkdir()
    monkeypatch.setenv("NETRC", str(home / ".netrc"))
    monkeypatch.setenv("WANDB_CONFIG_DIR", str(home / "wandb"))
    monkeypatch.setattr(wandb_module, "_reachable", lambda url, timeout_s: pytest.fail("no network in this test"))
    return home


def test_api_key_sources(no_credentials: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    assert not has_api_key()
    (no_credentials / ".netrc").write_text("machine example.com login user password pw\n")
    assert not has_api_key()  # a netrc entry for another host does not count
    (no_credentials / ".netrc").write_text(f"machine api.wandb.ai login user password {FAKE_KEY}\n")
    assert has_api_key() is True
    (no_credentials / ".netrc").unlink()
    (no_credentials / "wandb").mkdir()
    (no_credentials / "wandb" / "settings").write_text(f"[default]\napi_key = {FAKE_KEY}\n")
    assert has_api_key() is True
    (no_credentials / "wandb" / "settings").unlink()
    monkeypatch.setenv("WANDB_API_KEY", FAKE_KEY)
    assert has_api_key() is True


def test_mode_is_offline_without_a_key_and_never_asks(no_credentials: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    with pytest.warns(RuntimeWarning, match="no W&B API key configured.*offline"):
        assert resolve_mode() == "offline"
    monkeypatch.setenv("WANDB_API_KEY", FAKE_KEY)
    monkeypatch.setattr(wandb_module, "_reachable", lambda url, timeout_s: False)
    with pytest.warns(RuntimeWarning, match="did not answer.*offline"):
        assert resolve_mode() == "offline"
    monkeypatch.setattr(wandb_module, "_reachable", lambda url, timeout_s: True)
    assert resolve_mode() == "online"
    for env, mode in (("offline", "offline"), ("dryrun", "offline"), ("disabled", "disabled"), ("online", "online")):
        monkeypatch.setenv("WANDB_MODE", env)
        assert resolve_mode() == mode
    assert WandbLogger(mode="offline").resolved_mode == "offline"


def test_bad_arguments() -> None:
    with pytest.raises(ValueError, match="mode"):
        WandbLogger(mode="cloud")
    with pytest.raises(ValueError, match="WANDB_API_KEY"):
        WandbLogger(api_key=FAKE_KEY)


def test_offline_run_holds_metrics_config_tags_and_continues_under_the_same_id(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("WANDB_MODE", "offline")
    monkeypatch.setenv("WANDB_API_KEY", FAKE_KEY)  # present, but must never be written anywhere
    first = WandbLogger(project="ember-tests", name="unit", tags=["a", "b"], group="g", save_dir=tmp_path)
    first.log_hyperparams({"lr": 0.1, "model": {"hidden": 8}, "api_key": FAKE_KEY})
    first.log_metrics({"train/loss": 0.5, "epoch": 0.0}, step=1)
    first.log_metrics({"train/loss": 0.25, "epoch": 0.0}, step=2)
    first.log_histograms({"grads/w": torch.tensor([1.0, 2.0, 3.0])}, step=2)
    first.finalize("success")
    state = first.state_dict()
    assert state == {"run_id": first.run_id, "project": "ember-tests"}

    resumed = WandbLogger(project="ember-tests", save_dir=tmp_path)
    resumed.load_state_dict({**state, "step": 2})
    resumed.log_metrics({"train/loss": 0.125, "epoch": 1.0}, step=3)
    resumed.finalize("success")
    assert resumed.run_id == first.run_id

    files = run_files(tmp_path)
    assert len(files) == 2 and all(first.run_id in f.name for f in files)
    records = read_run(files[0])
    (run,) = [r["run"] for r in records if r["type"] == "run"]
    assert (run["run_id"], run["project"], run["tags"], run["run_group"]) == (
        first.run_id,
        "ember-tests",
        ["a", "b"],
        "g",
    )
    config = {k: v for r in records if r["type"] == "config" for k, v in r["config"].get("update", {}).items()}
    assert {k: config[k] for k in ("lr", "model")} == {"lr": 0.1, "model": {"hidden": 8}}
    assert "api_key" not in config
    history = [r["history"]["item"] for r in records if r["type"] == "history"]
    assert [(h[STEP_METRIC], h["train/loss"]) for h in history if "train/loss" in h] == [(1, 0.5), (2, 0.25)]
    (histogram,) = [nested(h, "grads/w") for h in history if nested(h, "grads/w")]
    assert histogram["_type"] == "histogram" and sum(histogram["values"]) == 3
    later = [r["history"]["item"] for r in read_run(files[1]) if r["type"] == "history"]
    assert [(h[STEP_METRIC], h["train/loss"]) for h in later] == [(3, 0.125)]
    assert (records[-1]["type"], records[-1]["exit"]["exit_code"]) == ("exit", 0)
    for path in tmp_path.rglob("*"):
        if path.is_file():
            assert FAKE_KEY.encode() not in path.read_bytes(), path


def test_checkpoints_are_uploaded_as_artifacts_when_asked(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("WANDB_MODE", "offline")
    checkpoint = tmp_path / "checkpoints" / "epoch=0-step=4"
    checkpoint.mkdir(parents=True)
    (checkpoint / "ember.pt").write_bytes(b"weights")
    logger = WandbLogger(project="ember-tests", save_dir=tmp_path, log_checkpoints=True)
    logger.after_save_checkpoint(checkpoint)  # before the run started: nothing to attach it to
    logger.log_metrics({"a": 1.0}, step=4)
    logger.after_save_checkpoint(checkpoint)
    logger.finalize("failed")
    records = read_run(run_files(tmp_path)[0])
    (artifact,) = [r["artifact"] for r in records if r["type"] == "artifact"]
    assert (artifact["type"], artifact["name"]) == ("model", f"model-{logger.run_id}")
    assert [e["path"] for e in artifact["manifest"]["contents"]] == ["ember.pt"]
    assert records[-1]["exit"]["exit_code"] == 1
