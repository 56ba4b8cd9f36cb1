"""`ember.tuning.scale_batch_size`: the search, the CPU peak measure, and the answer checked against peaks."""

from __future__ import annotations

import itertools
from pathlib import Path
from typing import Any

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

import ember
from ember.tuning.batch_size import BatchSizeError, measure_peak_bytes, parse_bytes, scale_batch_size, search

MB = 1_000_000


@given(st.integers(1, 5000), st.integers(1, 64), st.integers(1, 6000), st.sampled_from(["binsearch", "power"]))
def test_search_finds_the_largest_size_under_any_threshold(threshold: int, init: int, limit: int, mode: str) -> None:
    """With `fits(n) = n <= threshold`, binsearch returns min(threshold, limit); power the last doubling that fits."""
    tried: list[int] = []

    def fits(n: int) -> bool:
        tried.append(n)
        return n <= threshold

    if init > threshold or init > limit:
        if init > limit:
            return  # the caller refuses init > limit before searching
        with pytest.raises(BatchSizeError):
            search(fits, init, limit, mode)
        return
    size, why = search(fits, init, limit, mode)
    assert len(tried) == len(set(tried)), f"a size was tried twice: {tried}"
    assert size in tried and size <= threshold and size <= limit
    growth, n = [], init
    while True:  # doubling from init, capped at the limit, up to the first size that does not fit
        growth.append(min(n, limit))
        if growth[-1] > threshold or growth[-1] == limit:
            break
        n *= 2
    assert tried[: len(growth)] == growth, "growth is by doubling from init, capped at the limit"
    doublings = [g for g in growth if g <= threshold]
    if mode == "binsearch":
        assert size == min(threshold, limit)
        assert why == ("max_size" if threshold >= limit else "limit")
    else:
        assert size == max(n for n in doublings if n <= threshold)


@pytest.mark.parametrize(
    ("text", "expected"),
    [(4096, 4096), ("4096", 4096), ("512MB", 512 * MB), ("2 GiB", 2 * 2**30), ("1.5kb", 1500), ("3KiB", 3072)],
)
def test_parse_bytes(text: Any, expected: int) -> None:
    assert parse_bytes(text) == expected


@pytest.mark.parametrize("text", ["", "12XB", "-3MB", "0", "MB", True])
def test_parse_bytes_rejects(text: Any) -> None:
    with pytest.raises(ValueError, match="memory budget"):
        parse_bytes(text)


def test_the_cpu_peak_measure_sees_a_known_allocation() -> None:
    """The oracle: tensors of known sizes, one freed before the next is made, one kept across the other."""
    with measure_peak_bytes() as peak:
        a = torch.empty(2 * MB, dtype=torch.uint8)
        del a
        b = torch.empty(1 * MB, dtype=torch.uint8)
        c = torch.empty(3 * MB, dtype=torch.uint8)
        del b, c
    assert 4 * MB <= peak[0] < 4 * MB + 64_000


class _Wasteful(ember.TrainingModule):
    """A step that also allocates a temporary of 20 kB per sample: the peak grows by about that per sample."""

    def __init__(self) -> None:
        super().__init__()
        self.model = torch.nn.Linear(8, 3)
        self.loss_fn = torch.nn.CrossEntropyLoss()

    def training_step(self, batch: Any, batch_idx: int) -> Any:
        x, y = batch
        scratch = torch.ones(len(x), 5_000)  # 20 kB per sample, alive through forward and backward
        loss = self.loss_fn(self.model(x) + scratch.mean(1, keepdim=True) * 0, y)
        return loss + 0 * scratch.sum()

    def configure_optimizers(self) -> Any:
        return torch.optim.SGD(self.parameters(), lr=0.01)


@pytest.mark.slow  # 10 s of CPU on a 2-core machine, with the processes it starts
def test_the_answer_is_the_largest_size_under_the_budget_by_measured_peaks(tiny: Any, tmp_path: Path) -> None:
    _, Blobs, make = tiny
    budget = 1_500_000
    data, module = Blobs(batch_size=16, n=400), _Wasteful()
    weights = {k: v.clone() for k, v in module.state_dict().items()}
    result = scale_batch_size(
        make(default_root_dir=tmp_path), module, datamodule=data, memory_budget=budget, verbose=False
    )
    sizes = [t.batch_size for t in result.trials]
    assert sizes[:6] == [2, 4, 8, 16, 32, 64] and len(sizes) == len(set(sizes))
    for trial in result.trials:  # every verdict is the budget against the peak measured in that trial
        assert trial.peak_bytes is not None and trial.fits == (trial.peak_bytes <= budget), trial
    by_size = sorted(result.trials, key=lambda t: t.batch_size)
    for smaller, larger in itertools.pairwise(by_size):
        assert smaller.peak_bytes is not None and larger.peak_bytes is not None
        assert larger.peak_bytes > smaller.peak_bytes  # the peak grows with the batch
    slope = (by_size[-1].peak_bytes - by_size[0].peak_bytes) / (by_size[-1].batch_size - by_size[0].batch_size)
    assert 20_000 <= slope < 40_000  # the step's 20 kB per sample, plus the batch and activations
    n = result.batch_size
    fitting = {t.batch_size for t in result.trials if t.fits}
    assert n == max(fitting) and n + 1 in {t.batch_size for t in result.trials if not t.fits}
    # Measured again, in runs of their own: n fits the budget and n + 1 does not.
    again = {
        size: scale_batch_size(
            make(default_root_dir=tmp_path), _Wasteful(), datamodule=Blobs(n=400), init_size=size, max_size=size,
            memory_budget=10**12, verbose=False,
        ).trials[0].peak_bytes
        for size in (n, n + 1)
    }  # fmt: skip
    assert again[n] is not None and again[n + 1] is not None
    assert again[n] <= budget < again[n + 1]
    assert data.batch_size == 16 and result.override == f"data.batch_size={n}" and result.limited_by == "memory budget"
    for key, value in module.state_dict().items():
        assert torch.equal(value, weights[key]), key


@pytest.mark.slow  # 5 s of CPU on a 2-core machine, with the processes it starts
def test_max_size_and_the_data_set_cap_the_search(tiny: Any, tmp_path: Path) -> None:
    Net, Blobs, make = tiny
    capped = scale_batch_size(make(default_root_dir=tmp_path), Net(), datamodule=Blobs(), max_size=24, verbose=False)
    assert [t.batch_size for t in capped.trials] == [2, 4, 8, 16, 24] and capped.batch_size == 24
    assert capped.limited_by == "max_size"
    whole = scale_batch_size(
        make(default_root_dir=tmp_path), Net(), datamodule=Blobs(n=40), init_size=16, memory_budget="1GB",
        verbose=False,
    )  # fmt: skip
    assert [t.batch_size for t in whole.trials] == [16, 32, 40] and whole.limited_by == "data set size"


@pytest.mark.slow  # 2 s of CPU on a 2-core machine, with the processes it starts
def test_a_plain_dataloader_is_rebuilt_per_size(tiny: Any, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    Net, Blobs, make = tiny
    loader = Blobs().train_dataloader()
    result = scale_batch_size(make(default_root_dir=tmp_path), Net(), loader, max_size=8, memory_budget="1GB")
    assert result.batch_size == 8 and loader.batch_size == 16
    out = capsys.readouterr().out
    assert "largest batch size 8" in out and "use it with data.batch_size=8" in out


def test_errors_say_what_to_do(tiny: Any, tmp_path: Path) -> None:
    Net, Blobs, make = tiny
    trainer = make(default_root_dir=tmp_path)
    with pytest.raises(ValueError, match="needs memory_budget"):
        scale_batch_size(trainer, Net(), datamodule=Blobs())
    with pytest.raises(ValueError, match="has no attribute 'bs'"):
        scale_batch_size(trainer, Net(), datamodule=Blobs(), batch_arg_name="bs", max_size=8)
    with pytest.raises(BatchSizeError, match="batch size 2 does not fit already"):
        scale_batch_size(trainer, Net(), datamodule=Blobs(), memory_budget=10, verbose=False)
    with pytest.raises(ValueError, match="mode='grow'"):
        scale_batch_size(trainer, Net(), datamodule=Blobs(), mode="grow", max_size=8)
