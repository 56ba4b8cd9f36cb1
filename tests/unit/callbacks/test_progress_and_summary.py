"""ProgressLine and ModelSummary print what they promise: plain lines off a terminal, rich tables on one."""

from __future__ import annotations

import io
import re
import types
from typing import Any

import pytest
import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

import ember
from ember.callbacks import ModelSummary, ProgressLine
from ember.callbacks.model_summary import count_parameters, describe, human, summarize


class Regressor(ember.TrainingModule):
    def __init__(self) -> None:
        super().__init__()
        self.model = nn.Sequential(nn.Linear(4, 3), nn.Linear(3, 1))
        self.model[1].weight.requires_grad_(False)
        self.loss_fn = nn.MSELoss()

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.parameters(), lr=0.1)


def loader(n: int = 16) -> DataLoader:
    g = torch.Generator().manual_seed(0)
    return DataLoader(TensorDataset(torch.randn(n, 4, generator=g), torch.randn(n, 1, generator=g)), batch_size=4)


def test_progress_lines_per_epoch_and_inside(tmp_path) -> None:  # type: ignore[no-untyped-def]
    stream = io.StringIO()
    trainer = ember.Trainer(
        max_epochs=2,
        callbacks=[ProgressLine(every_n_batches=2, stream=stream)],
        logger=False,
        enable_model_summary=False,
    )
    trainer.fit(Regressor(), loader(), loader(8))
    lines = stream.getvalue().splitlines()
    assert [line.split("  train/loss")[0] for line in lines] == [
        # numbered from 0 as in checkpoint names (epoch=0-step=4), "/1" the last epoch's number, as in Lightning
        "epoch 0/1  step 2  batch 2/4",
        "epoch 0/1  step 4",  # the epoch line covers the last batch
        "epoch 1/1  step 6  batch 2/4",
        "epoch 1/1  step 8",
    ]
    last = trainer.progress_bar_metrics
    assert set(last) == {"train/loss", "val/loss"}
    assert f"val/loss {last['val/loss']:.4g}" in lines[-1]
    stream.truncate(0)
    stream.seek(0)
    trainer.test(Regressor(), loader(8))
    (line,) = stream.getvalue().splitlines()
    assert line.startswith("test  test/loss ") and "train/loss" not in line


def test_model_summary_counts() -> None:
    module = Regressor()
    assert count_parameters(module) == (4 * 3 + 3 + 3 + 1, 4 * 3 + 3 + 1)
    text = summarize(module)
    rows = [line.split() for line in text.splitlines()]
    assert rows[0] == ["name", "type", "params", "trainable"]
    assert rows[1] == ["model", "Sequential", "19", "16"]
    assert rows[-2] == ["total", "Regressor", "19", "16"]
    assert rows[-1] == [f"{19 * 4 / 1e6:.2f}", "MB", "of", "parameters"]


def test_model_summary_prints_at_fit_start() -> None:
    stream = io.StringIO()
    trainer = ember.Trainer(max_steps=1, callbacks=[ModelSummary(stream)], logger=False, enable_progress_bar=False)
    trainer.fit(Regressor(), loader())
    assert stream.getvalue() == summarize(Regressor()) + "\n"


def ten_batches() -> DataLoader:
    g = torch.Generator().manual_seed(0)
    return DataLoader(TensorDataset(torch.randn(20, 4, generator=g), torch.randn(20, 1, generator=g)), batch_size=2)


def test_progress_lines_every_n_percent() -> None:
    stream = io.StringIO()
    progress = ProgressLine(stream=stream, every_n_percent=25)
    trainer = ember.Trainer(max_epochs=1, callbacks=[progress], logger=False, enable_model_summary=False)
    trainer.fit(Regressor(), ten_batches())
    lines = stream.getvalue().splitlines()
    # 25 % of 10 batches: after batches 3 (2.5 rounded up), 5 and 8; batch 10 is the epoch line
    assert [line.split("  train/loss")[0] for line in lines] == [
        "epoch 0/0  step 3  batch 3/10",
        "epoch 0/0  step 5  batch 5/10",
        "epoch 0/0  step 8  batch 8/10",
        "epoch 0/0  step 10",
    ]
    assert re.search(r"\[[\d.e+]+ batches/s, 0:0\d left\]$", lines[0])


def _lines_of_a_slow_fit(monkeypatch: pytest.MonkeyPatch, **trainer_options: Any) -> list[str]:
    """The progress lines of a 10-batch fit whose batches take 10 s each on a fake clock (a line every 25 s),
    with each loss value replaced by ``L``."""
    from ember.callbacks import progress as progress_module

    clock = types.SimpleNamespace(now=0.0)
    monkeypatch.setattr(progress_module, "time", types.SimpleNamespace(monotonic=lambda: clock.now))

    class Slow(Regressor):
        def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
            clock.now += 10.0
            return super().training_step(batch, batch_idx)

    stream = io.StringIO()
    trainer = ember.Trainer(callbacks=[ProgressLine(stream=stream, every_n_seconds=25)], logger=False,
                            enable_model_summary=False, **trainer_options)  # fmt: skip
    trainer.fit(Slow(), ten_batches())
    return [re.sub(r"train/loss \S+", "L", line) for line in stream.getvalue().splitlines()]


def test_progress_lines_every_n_seconds_with_rate_and_time_left(monkeypatch: pytest.MonkeyPatch) -> None:
    assert _lines_of_a_slow_fit(monkeypatch, max_epochs=1) == [
        "epoch 0/0  step 3  batch 3/10  L  [0.1 batches/s, 1:10 left]",
        "epoch 0/0  step 6  batch 6/10  L  [0.1 batches/s, 0:40 left]",
        "epoch 0/0  step 9  batch 9/10  L  [0.1 batches/s, 0:10 left]",
        "epoch 0/0  step 10  L  (100.00s)",
    ]


def test_time_left_counts_only_the_batches_max_steps_allows(monkeypatch: pytest.MonkeyPatch) -> None:
    """max_steps=7 ends the run at batch 7 of 10: the time left counts 7 - done batches, not the epoch's."""
    assert _lines_of_a_slow_fit(monkeypatch, max_steps=7)[:2] == [
        "epoch 0  step 3  batch 3/10  L  [0.1 batches/s, 0:40 left]",
        "epoch 0  step 6  batch 6/10  L  [0.1 batches/s, 0:10 left]",
    ]


def test_plain_lines_are_the_default_off_a_terminal(capsys: pytest.CaptureFixture[str]) -> None:
    trainer = ember.Trainer(max_epochs=2, logger=False, enable_checkpointing=False)
    trainer.fit(Regressor(), loader(), loader(8))
    out = capsys.readouterr().out
    assert "\x1b[" not in out  # no terminal codes in a log file
    lines = out.splitlines()
    assert lines[0].split() == ["name", "type", "params", "trainable"]  # the plain summary first
    epoch_lines = [line for line in lines if line.startswith("epoch ")]
    assert [line.split("  train/loss")[0] for line in epoch_lines] == ["epoch 0/1  step 4", "epoch 1/1  step 8"]
    assert all(re.search(r"val/loss [\d.]+  \(\d+\.\d\ds\)$", line) for line in epoch_lines)


class WithExample(ember.TrainingModule):
    def __init__(self) -> None:
        super().__init__()
        self.model = nn.Sequential(nn.Linear(64, 32), nn.ReLU(), nn.Dropout(0.5), nn.Linear(32, 10))
        self.head = nn.ModuleDict({"a": nn.Linear(10, 2)})  # never called by forward
        self.loss_fn = nn.CrossEntropyLoss()
        self.example_input_array = torch.zeros(8, 64)

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.parameters(), lr=0.1)


def test_summary_output_shapes_size_and_no_side_effects() -> None:
    module = WithExample()
    torch.manual_seed(5)
    before = torch.rand(3)
    torch.manual_seed(5)
    text = summarize(module)
    assert torch.equal(torch.rand(3), before)  # the example forward left the random stream alone
    assert module.training and module.model[2].training  # modes restored
    rows = [line.split("  ") for line in text.splitlines()]
    rows = [[cell.strip() for cell in row if cell.strip()] for row in rows]
    params = 64 * 32 + 32 + 32 * 10 + 10
    assert rows[0] == ["name", "type", "params", "trainable", "output shape"]
    assert rows[1] == ["model", "Sequential", f"{params:,}", f"{params:,}", "[8, 10]"]
    assert rows[2] == ["head", "ModuleDict", "22", "22", "-"]
    assert rows[3] == ["loss_fn", "CrossEntropyLoss", "0", "0", "-"]
    assert rows[4] == ["total", "WithExample", f"{params + 22:,}", f"{params + 22:,}"]
    assert rows[5] == [f"{(params + 22) * 4 / 1e6:.2f} MB of parameters"]


def test_summary_size_counts_bytes_per_dtype() -> None:
    module = Regressor().double()
    assert describe(module).size_mb == 19 * 8 / 1e6
    assert human(950) == "950" and human(1234) == "1.2 K" and human(3_400_000) == "3.4 M"


def test_rich_summary_table_on_a_terminal() -> None:
    from rich.console import Console

    console = Console(file=io.StringIO(), force_terminal=True, width=150)
    trainer = ember.Trainer(
        max_steps=1, callbacks=[ModelSummary(console=console)], logger=False, enable_progress_bar=False
    )
    trainer.fit(WithExample(), DataLoader(TensorDataset(torch.randn(8, 64), torch.randint(0, 10, (8,))), batch_size=4))
    text = re.sub(r"\x1b\[[0-9;?]*[A-Za-z]", "", console.file.getvalue())  # type: ignore[attr-defined]
    assert "WithExample summary" in text and "Output shape" in text
    assert re.search(r"│ *0 *│ model *│ Sequential *│ *2\.4 K *│ *2\.4 K *│ \[8, 10\]", text)
    assert "Trainable params: 2,432" in text and "Non-trainable params: 0" in text and "Total params: 2,432" in text
    assert "Size: 0.01 MB" in text


def test_summary_is_plain_text_unless_the_stream_is_a_terminal() -> None:
    class Tty(io.StringIO):
        def isatty(self) -> bool:
            return True

    plain, tty = io.StringIO(), Tty()
    for stream in (plain, tty):
        ember.Trainer(max_steps=1, callbacks=[ModelSummary(stream)], logger=False, enable_progress_bar=False).fit(
            Regressor(), loader()
        )
    assert plain.getvalue() == summarize(Regressor()) + "\n"
    assert "┃" in tty.getvalue() and "Regressor summary" in tty.getvalue()
