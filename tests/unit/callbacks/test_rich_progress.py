"""RichProgressBar renders bars on a terminal, redraws at most ~10 times a second, and stays quiet off rank zero."""

from __future__ import annotations

import io
import math
import re
import time
from pathlib import Path
from typing import Any

import pytest
import torch
from rich.console import Console
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

import ember
from ember.callbacks import ModelSummary, ProgressLine, RichProgressBar
from ember.strategies.strategy import Strategy
from ember.trainer import setup

QUIET: dict[str, Any] = dict(logger=False, enable_model_summary=False, enable_checkpointing=False)
ANSI = re.compile(r"\x1b\[[0-9;?]*[A-Za-z]")


class Net(ember.TrainingModule):
    def __init__(self, sleep_s: float = 0.0) -> None:
        super().__init__()
        self.model = nn.Linear(4, 1)
        self.loss_fn = nn.MSELoss()
        self.sleep_s = sleep_s

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        if self.sleep_s:
            time.sleep(self.sleep_s)
        return super().training_step(batch, batch_idx)

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.parameters(), lr=0.1)


def loader(n_batches: int, batch_size: int = 2) -> DataLoader:
    g = torch.Generator().manual_seed(0)
    n = n_batches * batch_size
    return DataLoader(
        TensorDataset(torch.randn(n, 4, generator=g), torch.randn(n, 1, generator=g)), batch_size=batch_size
    )


def terminal() -> Console:
    return Console(file=io.StringIO(), force_terminal=True, width=140, color_system="truecolor")


def text_of(console: Console) -> str:
    return ANSI.sub("", console.file.getvalue())  # type: ignore[attr-defined]


def test_terminal_rendering_shows_a_bar_per_epoch_with_counts_rate_and_metrics() -> None:
    console = terminal()
    bar = RichProgressBar(console=console)
    trainer = ember.Trainer(max_epochs=2, num_sanity_val_steps=1, callbacks=[bar], **QUIET)
    trainer.fit(Net(), loader(4), loader(2))
    raw = console.file.getvalue()  # type: ignore[attr-defined]
    text = text_of(console)
    assert "\x1b[" in raw and "━" in text  # drawn with terminal codes and bar glyphs
    final = {k: f"{v:.4g}" for k, v in trainer.progress_bar_metrics.items()}
    lines = [line for line in text.splitlines() if line.startswith("Epoch")]
    for epoch in (0, 1):  # each finished epoch stays as a line: full bar, 4/4, times, rate, metrics
        pattern = rf"^Epoch {epoch}/1 +━+ 4/4 \d:\d\d:\d\d < \d:\d\d:\d\d +[\d.]+ it/s +train/loss [\d.]+  val/loss "
        assert any(re.search(pattern, line) for line in lines), lines
    # the finished epoch's line ("Epoch 1/1 ━..."), not a live frame drawn before its validation ("Epoch 1/1  ━...")
    # (epochs numbered from 0 as in checkpoint names, "/1" the last one's number, as Lightning's bar shows them)
    done = [line for line in lines if line.startswith("Epoch 1/1 ━") and " 4/4 " in line]
    assert done and all(f"train/loss {final['train/loss']}  val/loss {final['val/loss']}" in line for line in done)


def test_test_and_validate_end_with_a_metrics_table() -> None:
    console = terminal()
    trainer = ember.Trainer(callbacks=[RichProgressBar(console=console)], **QUIET)
    (metrics,) = trainer.test(Net(), loader(3))
    text = text_of(console)
    assert re.search(r"Testing +━+ 3/3 ", text) and "Test metrics" in text  # without a known total it fills at the end
    assert text.index("Test metrics") > text.rindex("Testing")  # the table comes below the final bar
    assert re.search(rf"test/loss +│ +{metrics['test/loss']:.6g}", text)
    trainer.validate(Net(), loader(3))
    assert "Validate metrics" in text_of(console)
    trainer.predict(Net(), loader(3))
    assert re.search(r"Predicting +━+ 3/3 ", text_of(console))


def test_redraws_at_most_rate_times_a_second() -> None:
    bar = RichProgressBar(refresh_rate_hz=10, console=terminal())
    trainer = ember.Trainer(max_epochs=1, num_sanity_val_steps=0, callbacks=[bar], **QUIET)
    start = time.monotonic()
    trainer.fit(Net(sleep_s=0.002), loader(200, batch_size=1))
    elapsed = time.monotonic() - start
    assert elapsed > 0.4
    # one draw on the first batch, then one per 1/10 s, plus the final draw
    assert 3 <= bar.refresh_count <= math.ceil(elapsed * 10) + 2


def test_many_tiny_epochs_do_not_redraw_more_often() -> None:
    bar = RichProgressBar(refresh_rate_hz=10, console=terminal())
    trainer = ember.Trainer(max_epochs=100, num_sanity_val_steps=0, callbacks=[bar], **QUIET)
    start = time.monotonic()
    trainer.fit(Net(), loader(1), loader(1))
    elapsed = time.monotonic() - start
    assert bar.refresh_count <= math.ceil(elapsed * 10) + 2
    assert len([line for line in text_of(bar.console).splitlines() if line.startswith("Epoch 99/99")]) >= 1  # type: ignore[arg-type]


class RankOne(Strategy):
    @property
    def global_rank(self) -> int:
        return 1

    claimed = False

    def broadcast(self, obj: Any, src: int = 0) -> Any:
        """What process 0 would send: first the run directory it claimed, then what it has (no refusal of the
        run's writer lock: None)."""
        if obj is None and not self.claimed:
            self.claimed = True
            return Path("runs/net/version_0")
        return obj


def test_nothing_from_other_ranks(capsys: pytest.CaptureFixture[str]) -> None:
    console, stream = terminal(), io.StringIO()
    callbacks = [RichProgressBar(console=console), ModelSummary(stream), ProgressLine(stream=io.StringIO())]
    trainer = ember.Trainer(max_epochs=1, strategy=RankOne(), callbacks=callbacks, **QUIET)
    trainer.fit(Net(), loader(3), loader(1))
    trainer.test(Net(), loader(1))
    assert console.file.getvalue() == "" and stream.getvalue() == ""  # type: ignore[attr-defined]
    assert callbacks[2].stream.getvalue() == ""  # type: ignore[attr-defined, union-attr]
    assert capsys.readouterr().out == ""


def test_default_display_is_rich_on_a_terminal_and_plain_lines_elsewhere(monkeypatch: pytest.MonkeyPatch) -> None:
    trainer = ember.Trainer()
    monkeypatch.setattr(setup, "stdout_is_terminal", lambda: True)
    kinds = [type(cb) for cb in setup.default_callbacks(trainer)]
    assert RichProgressBar in kinds and ProgressLine not in kinds
    monkeypatch.setattr(setup, "stdout_is_terminal", lambda: False)
    kinds = [type(cb) for cb in setup.default_callbacks(trainer)]
    assert ProgressLine in kinds and RichProgressBar not in kinds
    mine = ember.Trainer(callbacks=[RichProgressBar()])
    assert not any(isinstance(cb, (ProgressLine, RichProgressBar)) for cb in setup.default_callbacks(mine))


def test_a_failing_run_stops_the_display() -> None:
    class Failing(Net):
        def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
            if batch_idx == 2:
                raise RuntimeError("boom")
            return super().training_step(batch, batch_idx)

    bar = RichProgressBar(console=terminal())
    with pytest.raises(RuntimeError, match="boom"):
        ember.Trainer(max_epochs=1, callbacks=[bar], **QUIET).fit(Failing(), loader(4))
    assert bar._progress is None
    assert "\x1b[?25h" in bar.console.file.getvalue()  # type: ignore[union-attr]  # cursor shown again
