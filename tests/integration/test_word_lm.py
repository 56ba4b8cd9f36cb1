"""examples/word_lm.py: the ember port of a truncated-BPTT script is bitwise equal to the script.

The oracle is the loop such a script has, written here without a DataLoader: the text cut into
columns, `bptt` rows per batch, the hidden state detached and carried over, SGD with clipping,
validation with its own state in the middle of the epoch, a plateau schedule at each epoch end.
"""

from __future__ import annotations

import math
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
from torch.nn import functional as F
from torch.utils.data import DataLoader

import ember
from examples.char_transformer import stdlib_source_files
from examples.word_lm import BpttChunks, StdlibWords, WordLSTM, batchify

ROOT = Path(__file__).resolve().parents[2]
QUIET = dict(logger=False, enable_progress_bar=False, enable_model_summary=False, enable_checkpointing=False)
SIZES = dict(embedding_dim=16, hidden_size=16, num_layers=2, dropout=0.3, lr=5.0)


def small_data() -> StdlibWords:
    files = [str(p) for p in stdlib_source_files()[:4]]
    data = StdlibWords(batch_size=4, eval_batch_size=3, bptt=7, max_bytes=3_000, vocab_size=300, files=files)
    data.setup("fit")
    return data


def validation_every(data: StdlibWords) -> int:
    """Training batches between validations: three per epoch, the last one at the epoch's end (ember validates the
    final weights of an epoch that does not end on the interval)."""
    return len(data.train_dataloader()) // 2 - 1


def script(data: StdlibWords, epochs: int) -> tuple[WordLSTM, list[float]]:
    """The hand-written loop: no DataLoader, no optimizer object, no framework."""
    torch.manual_seed(0)
    module = WordLSTM(data.vocab_size, **SIZES)
    lm = module.model
    lr, best_val_loss = SIZES["lr"], math.inf
    train, val = batchify(data.train_ids, 4), batchify(data.val_ids, 3)
    every, n_batches = validation_every(data), len(range(0, len(train) - 1, 7))

    def evaluate() -> float:
        lm.eval()
        total, tokens, hidden = 0.0, 0, lm.init_hidden(3)
        with torch.no_grad():
            for i in range(0, len(val) - 1, 7):
                inputs, targets = val[i : i + 7], val[i + 1 : i + 8]
                inputs = inputs[: len(targets)]
                logits, hidden = lm(inputs, hidden)
                total += len(inputs) * F.cross_entropy(logits.view(-1, data.vocab_size), targets.reshape(-1)).item()
                tokens += len(inputs)
        lm.train()
        return total / tokens

    val_losses = []
    torch.manual_seed(1)
    for _ in range(epochs):
        hidden = lm.init_hidden(4)
        for batch_idx, i in enumerate(range(0, len(train) - 1, 7)):
            inputs, targets = train[i : i + 7], train[i + 1 : i + 8]
            inputs = inputs[: len(targets)]
            hidden = (hidden[0].detach(), hidden[1].detach())
            logits, hidden = lm(inputs, hidden)
            loss = F.cross_entropy(logits.view(-1, data.vocab_size), targets.reshape(-1))
            lm.zero_grad()
            loss.backward()
            torch.nn.utils.clip_grad_norm_(lm.parameters(), 0.25)
            for p in lm.parameters():
                p.data.add_(p.grad, alpha=-lr)
            if (batch_idx + 1) % every == 0 or batch_idx == n_batches - 1:
                val_losses.append(evaluate())
        if val_losses[-1] < best_val_loss:
            best_val_loss = val_losses[-1]
        else:
            lr /= 4.0  # anneal when validation did not improve
    return module, val_losses


class ValLosses(ember.Callback):
    def __init__(self) -> None:
        self.values: list[float] = []

    def on_validation_end(self, trainer: ember.Trainer, module: ember.TrainingModule) -> None:
        if not trainer.sanity_checking:
            self.values.append(trainer.callback_metrics["val/loss"])


def ember_run(data: StdlibWords, epochs: int, **options: object) -> tuple[WordLSTM, list[float]]:
    torch.manual_seed(0)
    module = WordLSTM(data.vocab_size, **SIZES)
    recorder = ValLosses()
    trainer = ember.Trainer(
        max_epochs=epochs,
        gradient_clip_val=0.25,
        val_check_interval=validation_every(data),
        callbacks=[recorder],
        **QUIET,
    )
    torch.manual_seed(1)
    trainer.fit(module, data.train_dataloader(), data.val_dataloader())  # with the default sanity check
    return module, recorder.values


def test_the_data_gives_three_validations_per_epoch() -> None:
    n = len(small_data().train_dataloader())
    assert n >= 10  # then n % (n // 2 - 1) is 2 or 3: validations after 2 intervals and at the end


@pytest.mark.slow  # 8 s of CPU on a 2-core machine, with the processes it starts
def test_ember_port_is_bitwise_equal_to_the_script() -> None:
    data = small_data()
    expected, expected_losses = script(data, epochs=2)
    module, losses = ember_run(data, epochs=2)
    for (name, a), b in zip(module.state_dict().items(), expected.state_dict().values(), strict=True):
        assert torch.equal(a, b), name
    assert len(losses) == len(expected_losses) == 6
    for got, want in zip(losses, expected_losses, strict=True):  # float64 epoch means: equal to float32 rounding
        assert abs(got - want) <= float(np.spacing(np.float32(want))) / 2


@pytest.mark.slow  # 2 s of CPU on a 2-core machine, with the processes it starts
def test_without_its_own_generator_the_training_loader_changes_dropout() -> None:
    # What docs/trainer.md warns about: iter(DataLoader) draws a seed from the global RNG dropout uses.
    data = small_data()
    expected, _ = script(data, epochs=1)
    chunks = BpttChunks(batchify(data.train_ids, 4), 7)
    data.train_dataloader = lambda: DataLoader(chunks, batch_size=None)  # type: ignore[method-assign]
    module, _ = ember_run(data, epochs=1)
    assert not all(torch.equal(a, b) for a, b in zip(module.parameters(), expected.parameters(), strict=True))


@pytest.mark.slow  # 8 s of CPU on a 2-core machine, with the processes it starts
def test_resuming_inside_an_epoch_restores_the_hidden_state(tmp_path: Path) -> None:
    data = small_data()

    def run(max_steps: int, resume: bool) -> WordLSTM:
        torch.manual_seed(0)
        module = WordLSTM(data.vocab_size, **SIZES)
        trainer = ember.Trainer(
            max_steps=max_steps,
            gradient_clip_val=0.25,
            val_check_interval=validation_every(data),
            default_root_dir=tmp_path,
            run_name="lm",
            logger=False,
            enable_progress_bar=False,
            enable_model_summary=False,
        )
        torch.manual_seed(1)
        trainer.fit(module, data.train_dataloader(), data.val_dataloader(), ckpt_path="last" if resume else None)
        return module

    n = len(data.train_dataloader())
    full = run(n + n // 2 + 2, resume=False)  # into the second epoch, past its first validation
    (tmp_path / "lm").rename(tmp_path / "full")
    run(n // 2 + 2, resume=False)  # stops in the middle of the first epoch, after a validation
    resumed = run(n + n // 2 + 2, resume=True)
    assert resumed.train_hidden is not None
    for a, b in zip(full.parameters(), resumed.parameters(), strict=True):
        assert torch.equal(a, b)


@pytest.mark.slow
def test_the_config_runs_through_the_ember_command(tmp_path: Path) -> None:
    overrides = [
        "trainer.max_steps=4",
        "trainer.val_check_interval=2",
        "trainer.limit_val_batches=2",
        "trainer.logger=false",
        "data.max_bytes=40000",
        "data.vocab_size=300",
    ]
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    out = subprocess.run(
        [sys.executable, "-m", "ember", "fit", "-c", str(ROOT / "configs" / "word_lm.yaml"), *overrides],
        capture_output=True,
        text=True,
        cwd=tmp_path,
        env=env,
        timeout=180,
    )
    assert out.returncode == 0, out.stderr[-2000:]
    checkpoints = list((tmp_path / "runs" / "word_lm").glob("version_*/checkpoints/*"))
    assert checkpoints, out.stdout
    module = WordLSTM.load_from_checkpoint(sorted(p for p in checkpoints if p.is_dir())[-1])
    assert module.model.decoder.out_features == 300
    assert math.isfinite(float(module.model.decoder.weight.detach().abs().sum()))
