"""What a failure leaves behind (issue 16, items 5, 12, 13 and 14).

- A step whose loss the non-finite guard flagged is never saved: ``last`` keeps naming the last good
  checkpoint and nothing good is evicted.
- A preemption always leaves a checkpoint that resumes, also when the only `ModelCheckpoint` keeps
  weights only; under the ``devices=N`` launcher SIGTERM still exits 75, with one line.
- ``fast_dev_run`` writes nothing a later command picks up.
- An exception at any point leaves the Trainer reusable, and the failure hooks run.
"""

from __future__ import annotations

import math
import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path
from typing import Any

import pytest
import torch
from rel_helpers import assert_one_line_error, run_cli
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

import ember
from ember import checkpoint as ckpt
from ember.callbacks import ModelCheckpoint
from ember.strategies.strategy import Strategy
from ember.trainer.numerics import NonFiniteLoss
from ember.trainer.signals import EXIT_PREEMPTED

QUIET: dict[str, Any] = dict(logger=False, enable_progress_bar=False, enable_model_summary=False)


class Net(ember.TrainingModule):
    """A linear regression whose loss turns NaN from optimizer step `nan_from_step` on (0: never); sends
    itself `signum` after step `signal_at_step`."""

    def __init__(self, nan_from_step: int = 0, signal_at_step: int = 0, signum: int = signal.SIGTERM) -> None:
        super().__init__()
        self.model = nn.Linear(4, 1)
        self.loss_fn = nn.MSELoss()
        self.nan_from_step, self.signal_at_step, self.signum = nan_from_step, signal_at_step, signum

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        loss: torch.Tensor = super().training_step(batch, batch_idx)
        if self.nan_from_step and self.global_step + 1 >= self.nan_from_step:
            loss = loss * float("nan")
        return loss

    def on_train_batch_end(self, outputs: Any, batch: Any, batch_idx: int) -> None:
        if self.signal_at_step and self.global_step == self.signal_at_step:
            os.kill(os.getpid(), self.signum)

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.parameters(), lr=0.05)


def loader(n: int = 32, batch_size: int = 4) -> DataLoader:
    g = torch.Generator().manual_seed(0)
    return DataLoader(TensorDataset(torch.randn(n, 4, generator=g), torch.randn(n, 1, generator=g)), batch_size)


def finite(path: Path) -> bool:
    _, weights = ckpt.read_module_state(path)
    return all(bool(torch.isfinite(w).all()) for w in weights.values())


# --- item 5 -----------------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("saver", "nan_step"),
    [
        (dict(every_n_train_steps=2, save_top_k=1), 5),  # the reported case: steps 2 and 4 saved, NaN from step 5
        (dict(every_n_train_steps=2, save_top_k=2, async_save=True), 6),  # NaN at a save step itself
        (dict(every_n_epochs=1, save_top_k=1), 16),  # NaN at the last step of epoch 2: the epoch-end save
    ],
    ids=["steps", "steps-async", "epoch-end"],
)
def test_a_flagged_step_is_never_saved(tmp_path: Path, saver: dict[str, Any], nan_step: int) -> None:
    folder = tmp_path / "ckpts"
    trainer = ember.Trainer(
        max_epochs=4, nonfinite_loss="error", log_every_n_steps=1000, callbacks=[ModelCheckpoint(folder, **saver)],
        **QUIET,
    )  # fmt: skip
    with pytest.raises(NonFiniteLoss, match=f"step {nan_step}"):
        trainer.fit(Net(nan_from_step=nan_step), loader())
    saved = ckpt.checkpoints_in(folder)
    assert saved and all(finite(path) for path in saved), "a checkpoint holds the NaN weights"
    last = ckpt.newest_valid(folder)
    assert last is not None and finite(last)
    step = ckpt.read_meta(last)["state"]["progress"]["global_step"]
    assert step < nan_step
    resumed = ember.Trainer(max_epochs=1, **QUIET)  # the last good checkpoint still resumes
    resumed.fit(Net(), loader(), ckpt_path=last)


def test_preemption_after_a_flagged_step_saves_nothing(tmp_path: Path) -> None:
    folder = tmp_path / "ckpts"
    trainer = ember.Trainer(max_epochs=3, nonfinite_loss="error", callbacks=[ModelCheckpoint(folder)], **QUIET)
    with pytest.raises(NonFiniteLoss):
        trainer.fit(Net(nan_from_step=11, signal_at_step=11), loader())  # epoch 2, after epoch 1's good save
    assert [p.name for p in ckpt.checkpoints_in(folder)] == ["epoch=0-step=8"]
    assert (folder / "last").read_text().strip() == "epoch=0-step=8"


# --- item 12 ----------------------------------------------------------------------------------------------------


def test_preemption_with_only_a_weights_only_saver_leaves_a_resumable_last(tmp_path: Path) -> None:
    folder = tmp_path / "ckpts"

    def trainer() -> ember.Trainer:
        saver = ModelCheckpoint(folder, save_weights_only=True)
        return ember.Trainer(max_epochs=3, default_root_dir=tmp_path / "runs", callbacks=[saver], **QUIET)

    preempted = trainer()
    with pytest.raises(SystemExit) as info:
        preempted.fit(Net(signal_at_step=11), loader())
    assert info.value.code == EXIT_PREEMPTED
    found = ckpt.newest_valid(tmp_path / "runs" / "net" / "version_0" / "checkpoints", resumable=True)
    assert found is not None and found.name == "preempted-step=11"
    assert not ckpt.read_meta(found)["weights_only"]
    resumed = trainer()
    resumed.fit(Net(), loader(), ckpt_path="last")  # finds the full checkpoint, not the weights-only `last`
    assert resumed.global_step == 24 and resumed.run_dir == preempted.run_dir


LAUNCHED = textwrap.dedent(
    """
    import sys, time
    from pathlib import Path
    import torch
    from torch import nn
    from torch.utils.data import DataLoader, TensorDataset
    import ember

    class Slow(ember.TrainingModule):
        def __init__(self):
            super().__init__()
            self.model, self.loss_fn = nn.Linear(4, 1), nn.MSELoss()

        def training_step(self, batch, batch_idx):
            if self.global_step == 3 and self.trainer.is_global_zero:
                Path("started").touch()
            time.sleep(0.05)
            return super().training_step(batch, batch_idx)

        def configure_optimizers(self):
            return torch.optim.SGD(self.parameters(), lr=0.1)

    g = torch.Generator().manual_seed(0)
    data = DataLoader(TensorDataset(torch.randn(64, 4, generator=g), torch.randn(64, 1, generator=g)), batch_size=4)
    callbacks = [ember.callbacks.ModelCheckpoint(save_weights_only=True)]
    trainer = ember.Trainer(devices=2, accelerator="cpu", strategy="ddp", max_epochs=50, logger=False,
                            enable_progress_bar=False, enable_model_summary=False, callbacks=callbacks)
    trainer.fit(Slow(), data, ckpt_path="last")
    """
)


@pytest.mark.slow
@pytest.mark.distributed
@pytest.mark.parametrize("target", ["launcher", "process group"])
def test_sigterm_under_the_devices_launcher_exits_75_with_one_line(tmp_path: Path, target: str) -> None:
    (tmp_path / "job.py").write_text(LAUNCHED)
    env = {k: v for k, v in os.environ.items() if not k.startswith(("RANK", "WORLD_SIZE", "MASTER_", "LOCAL_"))}
    env.update(OMP_NUM_THREADS="1", PYTHONPATH=str(Path(ember.__file__).parents[1]))
    proc = subprocess.Popen([sys.executable, "job.py"], cwd=tmp_path, env=env, stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True, start_new_session=True)  # fmt: skip
    try:
        deadline = time.monotonic() + 180
        while not (tmp_path / "started").exists():
            assert proc.poll() is None and time.monotonic() < deadline, proc.communicate()[0]
            time.sleep(0.1)
        if target == "launcher":
            proc.send_signal(signal.SIGTERM)
        else:
            os.killpg(proc.pid, signal.SIGTERM)  # as a cluster scheduler does
        output, _ = proc.communicate(timeout=120)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
    assert proc.returncode == EXIT_PREEMPTED, output
    assert "Traceback" not in output, output
    assert "ember: preempted: all 2 processes saved a checkpoint" in output
    last = ckpt.newest_valid(next((tmp_path / "runs").glob("*/version_0/checkpoints")), resumable=True)
    assert last is not None and not ckpt.read_meta(last)["weights_only"]


# --- item 13 ----------------------------------------------------------------------------------------------------


@pytest.mark.usefixtures("clean_imports")
def test_fast_dev_run_writes_nothing_later_commands_pick_up(project: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """The trained run is moved away: a fast_dev_run with a ModelCheckpoint in its config must not become
    `best` or `last` for the next command."""
    (project / "runs").rename(project / "elsewhere")
    overlay = project / "monitor.yaml"
    overlay.write_text(
        "trainer:\n  callbacks:\n    - _target_: ember.callbacks.ModelCheckpoint\n      monitor: val/loss\n"
    )
    code, _, err = run_cli(["fit", "-c", "net.yaml", "-c", str(overlay), "trainer.fast_dev_run=true"], capsys)
    assert code == 0, err
    written = [p for p in (project / "runs").rglob("*") if p.is_file()] if (project / "runs").exists() else []
    assert written == [], written
    for command in ("test", "validate", "predict"):
        code, _, err = run_cli([command, "-c", "net.yaml", "--ckpt-path", "best"], capsys)
        assert code == 2
        assert_one_line_error(err, "best")


def test_fast_dev_run_from_python_saves_nothing_even_when_preempted(tmp_path: Path) -> None:
    trainer = ember.Trainer(fast_dev_run=True, callbacks=[ModelCheckpoint(tmp_path / "ckpts")], **QUIET)
    trainer.fit(Net(), loader())
    assert not (tmp_path / "ckpts").exists()
    trainer = ember.Trainer(fast_dev_run=3, default_root_dir=tmp_path / "runs", **QUIET)
    with pytest.raises(SystemExit):
        trainer.fit(Net(signal_at_step=1), loader())
    assert not any(p.is_file() for p in (tmp_path / "runs").rglob("*")) if (tmp_path / "runs").exists() else True


# --- item 14 ----------------------------------------------------------------------------------------------------


class Recorder(ember.Callback):
    def __init__(self) -> None:
        self.calls: list[str] = []

    def on_exception(self, trainer: ember.Trainer, module: ember.TrainingModule, exception: BaseException) -> None:
        self.calls.append(f"on_exception:{type(exception).__name__}")

    def teardown(self, trainer: ember.Trainer, module: ember.TrainingModule, stage: str) -> None:
        self.calls.append(f"teardown:{stage}")


class Interrupting(Net):
    interrupt = True

    def validation_step(self, batch: Any, batch_idx: int, dataloader_idx: int = 0) -> Any:
        if self.interrupt and batch_idx == 1:
            raise KeyboardInterrupt
        return super().validation_step(batch, batch_idx, dataloader_idx)


def test_an_interrupted_validate_leaves_the_trainer_reusable(tmp_path: Path) -> None:
    module = Interrupting()
    module.train()
    module.model.eval()  # a submodule mode the evaluation must put back
    trainer = ember.Trainer(max_epochs=2, **QUIET)
    with pytest.raises(KeyboardInterrupt):
        trainer.validate(module, loader())
    assert trainer.stage is None
    assert module.training and not module.model.training
    assert trainer.collector is trainer.reporter.train_collector
    module.interrupt = False
    module.model.train()
    trainer.fit(module, loader(), loader(8))
    metrics = trainer.callback_metrics
    assert math.isfinite(metrics["train/loss"]) and math.isfinite(metrics["val/loss"])
    assert trainer.global_step == 16
    # logger=False: nothing was sent; as in Lightning, logged_metrics holds the latest values meant for loggers
    assert trainer.logged_metrics["val/loss"] == metrics["val/loss"]


def test_an_interrupted_sanity_check_resets_the_flag() -> None:
    module = Interrupting()
    trainer = ember.Trainer(max_epochs=1, num_sanity_val_steps=2, **QUIET)
    with pytest.raises(KeyboardInterrupt):
        trainer.fit(module, loader(), loader(8))
    assert not trainer.sanity_checking and trainer.stage is None


class BrokenSetup(Strategy):
    def setup_module(self, module: nn.Module) -> nn.Module:
        raise RuntimeError("no device")


def test_a_failing_strategy_setup_runs_the_failure_hooks_and_resets_the_stage() -> None:
    recorder = Recorder()
    trainer = ember.Trainer(max_epochs=1, strategy=BrokenSetup(), callbacks=[recorder], **QUIET)
    with pytest.raises(RuntimeError, match="no device"):
        trainer.fit(Net(), loader())
    assert trainer.stage is None
    assert recorder.calls == ["on_exception:RuntimeError", "teardown:fit"]
