"""Resuming never deletes what it did not write, and notices what changed (issue 16, items 3 and 10).

- A run resumed from another run's checkpoint (``--resume PATH``, ``ckpt_path="best"``) starts a new
  version; its ``ModelCheckpoint`` must never evict the checkpoint it started from.
- A crafted checkpoint whose ``ModelCheckpoint`` state names a directory outside the run, or a symlink
  inside it, must not get that directory deleted.
- Resuming into another optimizer is an error naming both; changed settings are one warning listing each
  difference; the run directory keeps every segment's config.
"""

from __future__ import annotations

import hashlib
import sys
import warnings
from pathlib import Path
from typing import Any

import pytest
import torch
import yaml
from rel_helpers import assert_one_line_error, checkpoints, edit_meta, fit_project, last_checkpoint, run_cli

import ember
from ember.checkpoint import CheckpointError

pytestmark = pytest.mark.usefixtures("clean_imports")


def _digest(folder: Path) -> dict[str, str]:
    return {p.name: hashlib.sha256(p.read_bytes()).hexdigest() for p in sorted(folder.iterdir())}


def test_resume_from_another_runs_checkpoint_leaves_it_untouched(
    project: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    source = last_checkpoint(project)
    before = _digest(source)
    code, _, err = run_cli(["fit", "-c", "net.yaml", "--resume", str(source), "trainer.max_epochs=5"], capsys)
    assert code == 0, err
    assert _digest(source) == before, "the checkpoint the run started from was changed or deleted"
    runs = sorted(p.name for p in (project / "runs" / "net").iterdir())
    assert runs == ["version_0", "version_1"]  # the resumed run is a new version with its own checkpoints
    assert [p.name for p in checkpoints(project / "runs" / "net" / "version_1")] == ["epoch=4-step=15"]


def test_resume_from_best_leaves_it_untouched(project: Path, capsys: pytest.CaptureFixture[str]) -> None:
    overlay = project / "monitor.yaml"
    overlay.write_text(
        "trainer:\n  callbacks:\n    - _target_: ember.callbacks.ModelCheckpoint\n"
        "      monitor: val/loss\n      save_top_k: 1\n"
    )
    config = ["-c", "net.yaml", "-c", str(overlay)]
    assert run_cli(["fit", *config, "trainer.max_epochs=3"], capsys)[0] == 0  # version_1, with a best checkpoint
    best = [p for p in checkpoints(project / "runs" / "net" / "version_1")]
    before = {p: _digest(p) for p in best}
    code, _, err = run_cli(["fit", *config, "--resume", "best", "trainer.max_epochs=6"], capsys)
    assert code == 0, err
    assert {p: _digest(p) for p in best if p.exists()} == before and all(p.exists() for p in best)


def _saver_state(meta: dict[str, Any]) -> dict[str, Any]:
    (key,) = [k for k in meta["state"]["callbacks"] if k.startswith("ModelCheckpoint")]
    state: dict[str, Any] = meta["state"]["callbacks"][key]
    return state


@pytest.mark.parametrize("how", ["absolute", "relative", "symlink-inside", "best-and-last"])
def test_a_crafted_saver_state_cannot_delete_anything(project: Path, how: str) -> None:
    """The checkpoint's ModelCheckpoint state names a victim; resuming the same run and saving evicts it."""
    victim = project / "victim"
    victim.mkdir()
    (victim / "ember.pt").write_text("precious")  # looks like a checkpoint, to tempt an eviction
    (victim / "data.txt").write_text("precious")
    checkpoint = last_checkpoint(project)
    folder = checkpoint.parent
    names = {
        "absolute": str(victim),
        "relative": str(folder / ".." / ".." / ".." / ".." / "victim"),
        "symlink-inside": str(folder / "link"),
        "best-and-last": str(victim),
    }
    (folder / "link").symlink_to(victim, target_is_directory=True)

    def plant(meta: dict[str, Any]) -> None:
        state = _saver_state(meta)
        state["kept"] = {names[how]: None, **state["kept"]}
        if how == "best-and-last":
            state["best_model_path"] = state["last_model_path"] = str(victim)

    edit_meta(checkpoint, plant)
    trainer = fit_project(project, max_epochs=4, ckpt_path="last")
    assert trainer.global_step == 12  # it did train on and save (and so evict) twice
    assert (victim / "data.txt").read_text() == "precious" and (victim / "ember.pt").exists()
    assert (folder / "link").is_symlink()


# --- item 10: a resume notices what changed ------------------------------------------------------------------


def test_resuming_into_another_optimizer_is_an_error_naming_both(
    project: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    code, _, err = run_cli(["fit", "-c", "net.yaml", "--resume", "last", "optimizer._target_=torch.optim.AdamW",
                            "trainer.max_epochs=3"], capsys)  # fmt: skip
    assert code == 2
    assert_one_line_error(err, "torch.optim.sgd.SGD", "torch.optim.adamw.AdamW")


def test_resuming_with_other_param_groups_is_an_error(project: Path) -> None:
    sys.path.insert(0, str(project))
    from my_project.models import Blobs, Net

    class TwoGroups(Net):
        def configure_optimizers(self) -> Any:
            first, second = self.model[0], self.model[2]
            return torch.optim.SGD([{"params": first.parameters()}, {"params": second.parameters()}], lr=0.1)

    TwoGroups.__module__, TwoGroups.__qualname__ = "my_project.models", "Net"  # the same class name as trained
    trainer = ember.Trainer(max_epochs=3, logger=False, enable_progress_bar=False, enable_model_summary=False)
    with pytest.raises(CheckpointError, match=r"2 param group\(s\).*the checkpoint 1 param group\(s\)"):
        trainer.fit(TwoGroups(hidden=8), datamodule=Blobs(n=64), ckpt_path=last_checkpoint(project))


def test_changed_settings_are_one_warning_and_every_segment_keeps_its_config(
    project: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    run_dir = project / "runs" / "net" / "version_0"
    first = (run_dir / "config.yaml").read_text()
    with pytest.warns(RuntimeWarning, match="changed settings") as record:
        code, _, err = run_cli(["fit", "-c", "net.yaml", "--resume", "last", "trainer.max_epochs=3",
                                "optimizer.lr=0.05"], capsys)  # fmt: skip
    assert code == 0, err
    (warning,) = [w for w in record if "changed settings" in str(w.message)]
    text = str(warning.message)
    assert "trainer.max_epochs: 2 in the checkpoint, 3 now" in text
    assert "optimizer.lr: 0.1 in the checkpoint, 0.05 now" in text
    assert "optimizer 0 group 0 lr: 0.1 in the checkpoint, 0.05 now" in text
    assert (run_dir / "config.yaml").read_text() == first, "config.yaml no longer describes the first segment"
    second = yaml.safe_load((run_dir / "config-resume-1.yaml").read_text())
    assert second["trainer"]["max_epochs"] == 3 and second["optimizer"]["lr"] == 0.05
    code, _, err = run_cli(["fit", "-c", "net.yaml", "--resume", "last", "trainer.max_epochs=4"], capsys)
    assert code == 0, err
    assert yaml.safe_load((run_dir / "config-resume-2.yaml").read_text())["trainer"]["max_epochs"] == 4


def test_an_unchanged_resume_warns_about_nothing(project: Path, capsys: pytest.CaptureFixture[str]) -> None:
    with warnings.catch_warnings():
        warnings.simplefilter("error", RuntimeWarning)
        code, _, err = run_cli(["fit", "-c", "net.yaml", "--resume", "last"], capsys)
    assert code == 0, err
