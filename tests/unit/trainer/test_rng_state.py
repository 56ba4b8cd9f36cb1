"""The random streams a checkpoint records: compact, and restored exactly (old layouts included)."""

from __future__ import annotations

import io
import random

import torch

from ember.checkpoint.resume import capture_rng, restore_rng


def draws() -> tuple[list[float], list[float]]:
    return [random.random() for _ in range(5)], torch.rand(5).tolist()


def test_capture_then_restore_replays_the_same_draws() -> None:
    random.seed(3)
    torch.manual_seed(3)
    state = capture_rng()
    first = draws()
    restore_rng(state)
    assert draws() == first


def test_python_state_is_one_tensor_and_survives_torch_save() -> None:
    random.seed(5)
    _version, internal, _gauss = capture_rng()["python"]
    assert isinstance(internal, torch.Tensor) and internal.dtype == torch.int64 and internal.numel() == 625
    assert tuple(internal.tolist()) == random.getstate()[1]
    buffer = io.BytesIO()
    torch.save(capture_rng(), buffer)
    buffer.seek(0)
    loaded = torch.load(buffer, weights_only=True)
    expected = draws()
    random.seed(5)
    restore_rng(loaded)
    assert draws() == expected


def test_checkpoints_with_the_python_state_as_a_tuple_or_list_still_restore() -> None:
    random.seed(7)
    torch.manual_seed(7)
    version, internal, gauss = random.getstate()
    old = {"python": (version, internal, gauss), "torch": torch.get_rng_state()}
    as_lists = {"python": [version, list(internal), gauss], "torch": torch.get_rng_state()}
    expected = draws()
    for state in (old, as_lists):
        restore_rng(state)
        assert draws() == expected
