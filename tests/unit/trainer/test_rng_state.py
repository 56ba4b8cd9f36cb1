"""The random streams a checkpoint records: compact, and restored exactly (old layouts included)."""

from __future__ import annotations

import io
import random

import pytest
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


class FakeCuda:
    """A host with `count` CUDA devices, this process on `current`: per-device RNG states without a GPU.

    Setting a device index the host lacks raises, as torch does; `set_rng_state_all` sets one per entry.
    """

    def __init__(self, monkeypatch: pytest.MonkeyPatch, count: int, current: int) -> None:
        self.count, self.current = count, current
        self.states = {i: torch.full((16,), i, dtype=torch.uint8) for i in range(count)}
        cuda = torch.cuda
        monkeypatch.setattr(cuda, "is_available", lambda: True)
        monkeypatch.setattr(cuda, "is_initialized", lambda: True)
        monkeypatch.setattr(cuda, "device_count", lambda: self.count)
        monkeypatch.setattr(cuda, "current_device", lambda: self.current)
        monkeypatch.setattr(cuda, "get_rng_state", self.get)
        monkeypatch.setattr(cuda, "set_rng_state", self.set)
        monkeypatch.setattr(cuda, "get_rng_state_all", lambda: [self.get(i) for i in range(self.count)])
        monkeypatch.setattr(cuda, "set_rng_state_all", lambda states: [self.set(s, i) for i, s in enumerate(states)])

    def index(self, device: int | str | torch.device) -> int:
        index = torch.device("cuda", device).index if isinstance(device, int) else torch.device(device).index
        if index is None or not 0 <= index < self.count:
            raise IndexError(f"CUDA device {device} does not exist on a host with {self.count}")
        return index

    def get(self, device: int | str | torch.device = "cuda") -> torch.Tensor:
        return self.states[self.index(device if device != "cuda" else self.current)].clone()

    def set(self, state: torch.Tensor, device: int | str | torch.device = "cuda") -> None:
        self.states[self.index(device if device != "cuda" else self.current)] = state.clone()


def test_each_rank_records_only_its_own_device_stream(monkeypatch: pytest.MonkeyPatch) -> None:
    FakeCuda(monkeypatch, count=8, current=5)
    state = capture_rng()
    cuda_entries = [v for k, v in state.items() if k.startswith("cuda")]
    assert len(cuda_entries) == 1  # one stream, not one per device of the host
    assert torch.equal(cuda_entries[0], torch.full((16,), 5, dtype=torch.uint8))


def test_a_checkpoint_from_an_8_gpu_host_restores_on_a_1_gpu_host(monkeypatch: pytest.MonkeyPatch) -> None:
    big = FakeCuda(monkeypatch, count=8, current=0)
    big.states[0] = torch.full((16,), 42, dtype=torch.uint8)  # rank 0's stream moved on during training
    state = capture_rng()
    small = FakeCuda(monkeypatch, count=1, current=0)
    restore_rng(state)  # raised IndexError when every device's stream was saved and set
    assert torch.equal(small.states[0], torch.full((16,), 42, dtype=torch.uint8))


def test_a_rank_restores_onto_its_own_device(monkeypatch: pytest.MonkeyPatch) -> None:
    FakeCuda(monkeypatch, count=4, current=3)
    state = capture_rng()
    host = FakeCuda(monkeypatch, count=4, current=2)  # resumed as local rank 2 of another job
    restore_rng(state)
    assert torch.equal(host.states[2], torch.full((16,), 3, dtype=torch.uint8))
    assert all(torch.equal(host.states[i], torch.full((16,), i, dtype=torch.uint8)) for i in (0, 1, 3))


def test_an_older_per_host_list_restores_this_device_entry_or_none(monkeypatch: pytest.MonkeyPatch) -> None:
    random.seed(1)
    state = {**capture_rng(), "cuda": [torch.full((16,), 10 + i, dtype=torch.uint8) for i in range(8)]}
    host = FakeCuda(monkeypatch, count=2, current=1)
    restore_rng(state)
    assert torch.equal(host.states[1], torch.full((16,), 11, dtype=torch.uint8))
    assert torch.equal(host.states[0], torch.full((16,), 0, dtype=torch.uint8))  # not this process's device
    short = {**state, "cuda": state["cuda"][:1]}  # written on a host with one device, resumed on device 1
    restore_rng(short)
    assert torch.equal(host.states[1], torch.full((16,), 11, dtype=torch.uint8))  # left as it was


def test_the_python_stream_is_captured_afresh_after_a_draw() -> None:
    state = random.getstate()
    try:
        random.seed(3)
        first, again = capture_rng()["python"][1], capture_rng()["python"][1]
        random.random()
        after = capture_rng()["python"][1]
        assert again is first  # unchanged words: the same tensor, not converted again
        assert after.tolist() == list(random.getstate()[1]) != first.tolist()
        random.seed(3)
        assert capture_rng()["python"][1].tolist() == first.tolist()
    finally:
        random.setstate(state)


def test_the_python_record_is_reused_only_while_nothing_was_drawn() -> None:
    state = random.getstate()
    try:
        random.seed(6)
        first = capture_rng()["python"]
        assert capture_rng()["python"] is first  # its raw state unchanged: the same record, getstate() not called
        random.gauss(0.0, 1.0)  # draws two numbers from the key, keeps the second Gaussian
        with_gauss = capture_rng()["python"]
        assert with_gauss is not first and with_gauss[2] is not None
        random.gauss(0.0, 1.0)  # returns the kept Gaussian: the key words stay as they were
        used_up = capture_rng()["python"]
        assert used_up[2] is None and used_up[1] is with_gauss[1]
        assert (used_up[0], tuple(used_up[1].tolist()), used_up[2]) == random.getstate()
        random.seed(6)
        assert capture_rng()["python"][1].tolist() == first[1].tolist()
    finally:
        random.setstate(state)


def test_the_raw_python_state_is_read_only_where_its_layout_was_checked() -> None:
    from ember.checkpoint.resume import _raw_python_state

    generator = random.Random(7)
    raw = _raw_python_state(generator)
    assert raw is not None  # CPython: the bytes after the header are the generator's state
    generator.random()
    assert _raw_python_state(generator) != raw

    class NotMersenne:
        gauss_next = None

    assert _raw_python_state(NotMersenne()) is None


def numpy_now() -> tuple[object, ...]:
    """NumPy's legacy global stream as `capture_rng` records it, read the slow way."""
    import numpy as np

    kind, keys, pos, has_gauss, cached = np.random.get_state()
    return (kind, keys.tolist(), pos, has_gauss, cached)


def captured_numpy() -> tuple[object, ...]:
    kind, keys, pos, has_gauss, cached = capture_rng()["numpy"]
    return (kind, keys.tolist(), pos, has_gauss, cached)


def test_the_numpy_stream_is_read_again_only_after_a_draw() -> None:
    np = pytest.importorskip("numpy")
    np.random.seed(3)
    first = capture_rng()["numpy"]
    assert capture_rng()["numpy"] is first  # nothing drawn: the same record, not read again
    assert captured_numpy() == numpy_now()
    np.random.random_sample()
    after = capture_rng()["numpy"]
    assert after is not first and after[2] != first[2]
    assert captured_numpy() == numpy_now()
    np.random.seed(3)  # the same state again: an equal record
    assert captured_numpy()[1:] == (first[1].tolist(), *first[2:])


def test_a_cached_gaussian_used_up_without_a_key_change_is_recorded() -> None:
    np = pytest.importorskip("numpy")
    np.random.seed(4)
    np.random.standard_normal()  # draws two normals from the key, caches the second
    with_gauss = capture_rng()["numpy"]
    assert with_gauss[3] == 1
    np.random.standard_normal()  # returns the cached one: the key words and position stay as they were
    used_up = captured_numpy()
    assert used_up[3] == 0 and used_up[1:3] == (with_gauss[1].tolist(), with_gauss[2])
    assert used_up == numpy_now()


def test_restoring_a_state_with_a_cached_gaussian_is_recorded_as_restored() -> None:
    np = pytest.importorskip("numpy")
    np.random.seed(5)
    np.random.standard_normal()
    with_gauss = capture_rng()
    expected = np.random.standard_normal()  # the cached value
    assert captured_numpy()[3] == 0  # recorded without one: the record a same-key state could reuse
    restore_rng(with_gauss)  # the same key words and position, with the cached Gaussian
    assert captured_numpy() == numpy_now() and captured_numpy()[3] == 1
    assert np.random.standard_normal() == expected
