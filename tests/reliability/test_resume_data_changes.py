"""A mid-epoch resume whose data settings changed continues at the exact sample, or is refused before any step
(docs/checkpoints.md, "When the data changes between segments").

A checkpoint records how many samples of the epoch's order the process consumed. A resume with another batch
size takes the rest of that order in batches of the new size: no sample skipped, none seen twice. A dataset of
another length continues an unshuffled epoch where it stood; what cannot continue exactly (the dataset shrank
below the samples already consumed, a shuffled order drawn over another length, shuffling switched on or off)
is a `CheckpointError` raised before any step, saying what to do. One process throughout: another number of
processes is tests/reliability/test_world_size_resume.py.
"""

from __future__ import annotations

from collections import Counter
from pathlib import Path
from typing import Any

import pytest
import torch
from hypothesis import assume, event, given
from hypothesis import strategies as st
from torch import Tensor, nn
from torch.utils.data import DataLoader, TensorDataset

import ember
from ember.checkpoint import CheckpointError

QUIET: dict[str, Any] = dict(
    logger=False, enable_progress_bar=False, enable_model_summary=False, accelerator="cpu", run_name="data"
)
DATA_SEED = 5


class Recorder(ember.TrainingModule):
    """A linear model that records, per batch, the epoch and the sample ids it trained on."""

    def __init__(self) -> None:
        super().__init__()
        self.model = nn.Linear(2, 1)
        self.seen: list[tuple[int, list[int]]] = []

    def training_step(self, batch: Any, batch_idx: int) -> Tensor:
        x, y, index = batch
        self.seen.append((self.trainer.current_epoch, index.tolist()))
        return nn.functional.mse_loss(self.model(x), y)

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.parameters(), lr=0.01)


class StopAt(ember.Callback):
    """Stops the run after `step` steps (a checkpoint is written there, and ``last`` names it)."""

    def __init__(self, step: int) -> None:
        self.step = step

    def on_train_batch_end(self, trainer: Any, module: Any, outputs: Any, batch: Any, batch_idx: int) -> None:
        if trainer.global_step >= self.step:
            trainer.should_stop = True


def loader(n: int, batch: int, shuffle: bool = True, drop_last: bool = False) -> DataLoader:
    g = torch.Generator().manual_seed(0)
    data = TensorDataset(torch.randn(n, 2, generator=g), torch.randn(n, 1, generator=g), torch.arange(n))
    generator = torch.Generator().manual_seed(DATA_SEED)
    return DataLoader(data, batch_size=batch, shuffle=shuffle, drop_last=drop_last, generator=generator)


def fit(root: Path, data: DataLoader, *, epochs: int = 1, stop_at: int | None = None, resume: bool = False) -> Recorder:
    """A fit of a fresh `Recorder` over `data` (seeded the same every time); returns the module."""
    ember.seed_everything(11)
    module = Recorder()
    callbacks = [StopAt(stop_at)] if stop_at is not None else []
    trainer = ember.Trainer(max_epochs=epochs, default_root_dir=root, callbacks=callbacks, **QUIET)
    trainer.fit(module, data, ckpt_path="last" if resume else None)
    return module


def samples(seen: list[tuple[int, list[int]]], epoch: int = 0) -> list[int]:
    return [i for e, batch in seen if e == epoch for i in batch]


def sampler_order(n: int, shuffle: bool) -> list[int]:
    """The order of one epoch of `loader` (n, shuffle), sample by sample: the same draws from the same generator
    whatever the batch size (the worker base seed, then the permutation)."""
    plain = DataLoader(range(n), batch_size=None, shuffle=shuffle, generator=torch.Generator().manual_seed(DATA_SEED))
    return [int(i) for i in plain]


# --- the generated cases ---------------------------------------------------------------------------------


@given(
    n_old=st.integers(6, 40),
    batch_old=st.integers(1, 8),
    batch_new=st.integers(1, 8),
    shuffle=st.booleans(),
    drop_last=st.booleans(),
    data=st.data(),
)
def test_a_resume_with_other_data_settings_sees_each_sample_of_the_epoch_as_an_uninterrupted_run_would(
    tmp_path_factory: pytest.TempPathFactory,
    n_old: int,
    batch_old: int,
    batch_new: int,
    shuffle: bool,
    drop_last: bool,
    data: st.DataObject,
) -> None:
    batches_old = len(loader(n_old, batch_old, drop_last=drop_last))
    assume(batches_old >= 2)  # a step inside the epoch to cut at
    cut = data.draw(st.integers(1, batches_old - 1), label="cut after step")
    n_new = data.draw(st.one_of(st.just(n_old), st.integers(1, 48)), label="n_new")
    assume(len(loader(n_new, batch_new, drop_last=drop_last)) > 0)  # else fit refuses the empty loader, resume or not
    root = tmp_path_factory.mktemp("run")
    before = samples(fit(root, loader(n_old, batch_old, shuffle, drop_last), stop_at=cut).seen)
    consumed = cut * batch_old
    assert before == sampler_order(n_old, shuffle)[:consumed]

    resumed_data = loader(n_new, batch_new, shuffle, drop_last)
    if n_new != n_old and (shuffle or n_new < consumed):
        module = Recorder()
        with pytest.raises(CheckpointError, match="in the middle of epoch 0") as error:
            ember.seed_everything(11)
            ember.Trainer(max_epochs=1, default_root_dir=root, **QUIET).fit(module, resumed_data, ckpt_path="last")
        assert module.seen == [], "a step ran before the resume was refused"
        assert ("shuffled" if shuffle else f"fewer than the {consumed}") in str(error.value)
        event("refused")
        return
    event("continued at another batch size" if batch_new != batch_old else "continued at the same batch size")
    after = fit(root, resumed_data, resume=True).seen
    rest = sampler_order(n_new, shuffle)[consumed:]
    kept = rest[: len(rest) // batch_new * batch_new] if drop_last else rest
    # the uninterrupted run's epoch, with the new batch size after the cut: the same samples, in the same order
    assert samples(after) == kept, "the rest of the epoch is not where the checkpoint left it"
    assert Counter(before + samples(after)) == Counter(sampler_order(n_new, shuffle)[:consumed] + kept)
    sizes = [len(batch) for _, batch in after]
    assert all(size == batch_new for size in sizes[:-1]) and (not sizes or 0 < sizes[-1] <= batch_new)


# --- the cases -----------------------------------------------------------------------------------


def _cut_at_step_3(root: Path) -> list[int]:
    """64 samples in batches of 8, stopped after step 3: 24 samples consumed."""
    return samples(fit(root, loader(64, 8), stop_at=3).seen)


@pytest.mark.parametrize("batch_new", [16, 4])
def test_a_new_batch_size_neither_skips_nor_repeats_and_later_epochs_are_the_uninterrupted_runs(
    tmp_path: Path, batch_new: int
) -> None:
    before = _cut_at_step_3(tmp_path / "cut")
    after = fit(tmp_path / "cut", loader(64, batch_new), epochs=2, resume=True).seen
    assert Counter(before + samples(after, 0)) == Counter(range(64)), "epoch 0: a sample skipped or seen twice"
    assert samples(after, 0) == sampler_order(64, True)[24:]
    sizes = {16: [16, 16, 8], 4: [4] * 10}[batch_new]  # the 40 samples left, in batches of the new size
    assert [len(b) for e, b in after if e == 0] == sizes
    # the generators are left as an uninterrupted epoch leaves them: epoch 1 is the uninterrupted run's
    uninterrupted = fit(tmp_path / "whole", loader(64, batch_new), epochs=2).seen
    assert [b for e, b in after if e == 1] == [b for e, b in uninterrupted if e == 1]


def test_a_dataset_shorter_than_the_position_is_refused_before_any_step(tmp_path: Path) -> None:
    _cut_at_step_3(tmp_path)
    module = Recorder()
    trainer = ember.Trainer(max_epochs=1, default_root_dir=tmp_path, **QUIET)
    with pytest.raises(CheckpointError) as error:
        trainer.fit(module, loader(20, 8), ckpt_path="last")
    message = str(error.value)
    assert module.seen == [] and trainer.global_step == 3
    assert "in the middle of epoch 0 (after 3 batches, 24 samples)" in message
    assert "shuffled order of 64 samples" in message  # the checkpoint's epoch was shuffled: no 20-sample order
    assert "from a checkpoint saved at an epoch end" in message and "\n" not in message


def test_an_unshuffled_dataset_shorter_than_the_position_is_refused_naming_both_sizes(tmp_path: Path) -> None:
    fit(tmp_path, loader(64, 8, shuffle=False), stop_at=3)
    module = Recorder()
    trainer = ember.Trainer(max_epochs=1, default_root_dir=tmp_path, **QUIET)
    with pytest.raises(CheckpointError) as error:
        trainer.fit(module, loader(20, 8, shuffle=False), ckpt_path="last")
    assert module.seen == []
    assert "has 20 samples, fewer than the 24 already trained on in this epoch" in str(error.value)


def test_an_unshuffled_dataset_that_grew_continues_at_the_sample(tmp_path: Path) -> None:
    before = samples(fit(tmp_path, loader(64, 8, shuffle=False), stop_at=3).seen)
    after = fit(tmp_path, loader(70, 16, shuffle=False), resume=True).seen
    assert before + samples(after) == list(range(70))


def test_switching_shuffle_mid_epoch_is_refused(tmp_path: Path) -> None:
    _cut_at_step_3(tmp_path)
    module = Recorder()
    with pytest.raises(CheckpointError, match="came from a RandomSampler, this run's come from a SequentialSampler"):
        ember.Trainer(max_epochs=1, default_root_dir=tmp_path, **QUIET).fit(
            module, loader(64, 8, shuffle=False), ckpt_path="last"
        )
    assert module.seen == []
