"""Resuming on a different number of processes continues the interrupted epoch, or is refused clearly.

A checkpoint records the epoch's position as samples consumed by all processes (`ember.checkpoint.data_position`).
On another number of processes the rest of that epoch is split across the new processes: within the epoch no
sample is seen twice and none is skipped. What cannot be rebuilt (a custom sampler, an epoch cut by
``limit_train_batches``) is a `CheckpointError` that says what to do.

The runs: a one-process run over ``shuffle=True`` stopped in the middle of epoch 1 (8 of its 12 batches done,
more than a 2-process epoch's 6) and resumed by 2 processes; a 2-process run stopped in the middle of epoch 1
and resumed by one process; a one-process run over a custom sampler resumed by 2 processes (refused). The two
processes are one torchrun job (`job`) for all of them. Same world size stays bitwise: that is proven by
tests/integration/test_resume_matrix.py (one process) and the ``fsdp_resume`` section of
tests/distributed/dist_workload.py (two).
"""

from __future__ import annotations

import contextlib
import random
import shutil
import sys
from collections import Counter
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from torch import Tensor, nn
from torch.utils.data import DataLoader, Sampler, TensorDataset
from torch.utils.data.distributed import DistributedSampler

import ember
from ember.checkpoint import CheckpointError

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent / "distributed"))

import dist_harness as harness  # noqa: E402

N, BATCH, EPOCHS, SEED = 48, 4, 3, 123
QUIET: dict[str, Any] = dict(logger=False, enable_progress_bar=False, enable_model_summary=False, accelerator="cpu")


# --- the runs --------------------------------------------------------------------------------------------


class Net(ember.TrainingModule):
    """Records, per batch, the epoch and the sample indices it trained on."""

    def __init__(self) -> None:
        super().__init__()
        self.model = nn.Linear(3, 1)
        self.seen: list[tuple[int, list[int]]] = []

    def training_step(self, batch: Any, batch_idx: int) -> Tensor:
        x, y, index = batch
        self.seen.append((self.trainer.current_epoch, index.tolist()))
        return nn.functional.mse_loss(self.model(x), y)

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.parameters(), lr=0.05)


class StopAt(ember.Callback):
    def __init__(self, step: int) -> None:
        self.step = step

    def on_train_batch_end(self, trainer: Any, module: Any, outputs: Any, batch: Any, batch_idx: int) -> None:
        if trainer.global_step >= self.step:
            trainer.should_stop = True


class Reversed(Sampler[int]):
    """A custom sampler: the dataset backwards."""

    def __iter__(self) -> Iterator[int]:
        return iter(range(N - 1, -1, -1))

    def __len__(self) -> int:
        return N


def loader(sampler: str = "shuffle") -> DataLoader:
    g = torch.Generator().manual_seed(0)
    data = TensorDataset(torch.randn(N, 3, generator=g), torch.randn(N, 1, generator=g), torch.arange(N))
    if sampler == "custom":
        return DataLoader(data, batch_size=BATCH, sampler=Reversed())
    return DataLoader(data, batch_size=BATCH, shuffle=True, generator=torch.Generator().manual_seed(7))


def fit(
    root: Path,
    *,
    stop_at: int | None = None,
    resume: bool = False,
    sampler: str = "shuffle",
    strategy: Any = "auto",
    **options: Any,
) -> dict[str, Any]:
    ember.seed_everything(SEED)
    module = Net()
    trainer = ember.Trainer(
        max_epochs=EPOCHS,
        strategy=strategy,
        callbacks=[StopAt(stop_at)] if stop_at is not None else [],
        default_root_dir=root,
        run_name="ws",
        **QUIET,
        **options,
    )
    trainer.fit(module, loader(sampler), ckpt_path="last" if resume else None)
    params = {k: v.detach().clone() for k, v in module.state_dict().items()}
    return {"seen": module.seen, "steps": trainer.global_step, "world_size": trainer.world_size, "params": params}


def job(out: Path, roots: Path) -> None:
    """The 2-process job (run by torchrun through `harness`); each section saves its result per rank."""
    import dist_workload as workload

    from ember.strategies import DDPStrategy

    def ddp() -> DDPStrategy:
        return DDPStrategy(timeout_s=workload.PG_TIMEOUT_S)

    def refused() -> dict[str, Any]:
        try:
            fit(roots / "custom", resume=True, sampler="custom", strategy=ddp())
        except CheckpointError as exc:
            return {"error": str(exc)}
        return {"error": None}

    sections = {
        "one_to_two": lambda: fit(roots / "one", resume=True, strategy=ddp()),
        "two_stopped": lambda: fit(roots / "two", stop_at=8, strategy=ddp()),
        "refused": refused,
    }
    for name, run in sections.items():
        # an error is saved for its test; the other sections still run (both processes fail alike)
        with contextlib.suppress(Exception):
            workload.section(out, name, run)


JOB_SCRIPT = """\
import sys
from pathlib import Path

sys.path.insert(0, {here!r})
import test_world_size_resume

test_world_size_resume.job(Path(sys.argv[1]), Path(sys.argv[2]))
"""


class Runs:
    def __init__(self, base: Path) -> None:
        self.base, self.roots = base, base / "roots"
        self.one_first: dict[str, Any] = {}
        self.job: harness.Finished | None = None

    def results(self, name: str) -> list[dict[str, Any]]:
        try:
            return harness.results(self.base / "out", name, 2, self.job)
        except AssertionError as exc:
            pytest.fail(str(exc), pytrace=False)

    def copy_of(self, name: str) -> Path:
        """A copy of a run's root as the job left it (a resume writes new checkpoints and moves `last`)."""
        pristine = self.base / f"pristine-{name}"
        if not pristine.exists():
            shutil.copytree(self.roots / name, pristine)
        target = self.base / f"copy-{name}-{len(list(self.base.glob(f'copy-{name}-*')))}"
        shutil.copytree(pristine, target)
        return target


@pytest.fixture(scope="module")
def runs(tmp_path_factory: pytest.TempPathFactory) -> Runs:
    base = tmp_path_factory.mktemp("world_size")
    result = Runs(base)
    with _own_random_state():
        # one process: 12 batches per epoch; stopped after step 20 = epoch 1, batch 8 (a checkpoint there)
        result.one_first = fit(result.roots / "one", stop_at=20)
        fit(result.roots / "custom", stop_at=5, sampler="custom")
    script = harness.write_script(base, JOB_SCRIPT.format(here=str(HERE)))
    command = harness.spawn(script, str(base / "out"), str(result.roots))
    result.job = harness.run(command, cwd=base, timeout=300)
    if (result.roots / "two").exists():
        result.copy_of("two")  # before any resume touches it
    return result


def _own_random_state() -> Any:
    class Own:
        def __enter__(self) -> None:
            self.python, self.fork = random.getstate(), torch.random.fork_rng(devices=[])
            self.fork.__enter__()

        def __exit__(self, *exc: Any) -> None:
            self.fork.__exit__(*exc)
            random.setstate(self.python)

    return Own()


def epoch_samples(seen: list[tuple[int, list[int]]], epoch: int) -> list[int]:
    return [i for e, batch in seen if e == epoch for i in batch]


def distributed_order(rank: int, epoch: int) -> list[int]:
    sampler = DistributedSampler(range(N), num_replicas=2, rank=rank, shuffle=True, seed=SEED)  # type: ignore[arg-type]
    sampler.set_epoch(epoch)
    return list(sampler)


# --- one process -> two ---------------------------------------------------------------------------------


@pytest.mark.distributed
def test_a_one_process_checkpoint_saved_mid_epoch_continues_the_epoch_on_two_processes(runs: Runs) -> None:
    ranks = runs.results("one_to_two")
    before = epoch_samples(runs.one_first["seen"], 1)
    assert len(before) == 8 * BATCH  # the checkpoint is after 8 of the epoch's 12 batches
    rest = [epoch_samples(r["seen"], 1) for r in ranks]
    assert [len(r) for r in rest] == [2 * BATCH, 2 * BATCH]  # 16 samples left: 2 batches on each process
    assert Counter(before + rest[0] + rest[1]) == Counter(range(N)), "epoch 1: a sample skipped or seen twice"
    for rank, result in enumerate(ranks):
        assert result["world_size"] == 2
        assert epoch_samples(result["seen"], 2) == distributed_order(rank, 2)  # later epochs: seed and epoch
        assert result["steps"] == 20 + 2 + N // (2 * BATCH)
    harness.assert_params_equal(ranks[0]["params"], ranks[1]["params"], "rank 0 vs rank 1")


@pytest.mark.distributed
def test_a_custom_sampler_saved_mid_epoch_is_refused_on_two_processes_with_what_to_do(runs: Runs) -> None:
    for result in runs.results("refused"):
        message = result["error"]
        assert message is not None, "a resume that cannot be split was not refused"
        assert "in the middle of epoch 0 (after 5 batches on each of 1 process(es)); this run has 2" in message
        assert "custom sampler" in message
        assert "Resume it on 1 process(es), or resume from a checkpoint saved at an epoch end" in message


# --- two processes -> one -------------------------------------------------------------------------------


@pytest.mark.distributed
def test_a_two_process_checkpoint_saved_mid_epoch_continues_the_epoch_on_one_process(runs: Runs) -> None:
    stopped = runs.results("two_stopped")
    assert [r["steps"] for r in stopped] == [8, 8]  # 6 batches per epoch on each: epoch 1, batch 2
    before = epoch_samples(stopped[0]["seen"], 1) + epoch_samples(stopped[1]["seen"], 1)
    assert len(before) == 2 * 2 * BATCH
    with _own_random_state(), pytest.warns(RuntimeWarning, match="written by 2 process"):
        resumed = fit(runs.copy_of("two"), resume=True)
    rest = epoch_samples(resumed["seen"], 1)
    assert len(rest) == N - len(before)  # the rest of the epoch, not half an epoch again
    assert Counter(before + rest) == Counter(range(N)), "epoch 1: a sample skipped or seen twice"
    # in the order the two processes would have taken them: position p of DistributedSampler's global order
    order = [i for pair in zip(distributed_order(0, 1), distributed_order(1, 1), strict=True) for i in pair]
    assert rest == order[len(before) :]
    assert sorted(epoch_samples(resumed["seen"], 2)) == list(range(N))  # then whole epochs of one process
    assert resumed["steps"] == 8 + len(rest) // BATCH + N // BATCH


@pytest.mark.distributed
def test_an_epoch_cut_by_limit_train_batches_is_refused_on_another_world_size(runs: Runs) -> None:
    runs.results("two_stopped")  # the checkpoint exists
    with _own_random_state(), pytest.warns(RuntimeWarning), pytest.raises(CheckpointError) as error:
        fit(runs.copy_of("two"), resume=True, limit_train_batches=10)
    assert "limit_train_batches cuts the epoch short" in str(error.value)
    assert "Resume it on 2 process(es)" in str(error.value)


# --- the split itself ---------------------------------------------------------------------------------------


@given(
    n=st.integers(1, 60),
    saved_world=st.integers(1, 4),
    new_world=st.integers(1, 4),
    batch=st.integers(1, 6),
    drop_last=st.booleans(),
    shuffle=st.booleans(),
    data=st.data(),
)
@settings(max_examples=200, deadline=None, database=None)
def test_the_rest_of_an_epoch_is_split_without_a_sample_skipped_or_seen_twice(
    n: int, saved_world: int, new_world: int, batch: int, drop_last: bool, shuffle: bool, data: st.DataObject
) -> None:
    from ember.checkpoint.data_position import distributed_order as global_order
    from ember.checkpoint.data_position import split_rest

    order = global_order(n, saved_world, seed=3, shuffle=shuffle, drop_last=False, epoch=2)
    for rank in range(saved_world):  # position p is what process p % W took as its (p // W)-th sample
        sampler = DistributedSampler(range(n), saved_world, rank, shuffle=shuffle, seed=3)  # type: ignore[arg-type]
        sampler.set_epoch(2)
        assert order[rank::saved_world] == list(sampler)
    real = order[:n]
    assert sorted(real) == list(range(n))
    consumed = data.draw(st.integers(0, n), label="consumed")
    rest = real[consumed:]
    split = [split_rest(rest, new_world, rank, batch, drop_last) for rank in range(new_world)]
    counts = {len(batches) for batches in split}
    assert len(counts) == 1, f"processes get different numbers of batches: {[len(b) for b in split]}"
    taken = [i for batches in split for b in batches for i in b]
    assert all(0 < len(b) <= batch for batches in split for b in batches)
    assert set(taken) <= set(rest)
    if drop_last:
        assert all(len(b) == batch for batches in split for b in batches)
        assert len(taken) == len(set(taken)), "with drop_last no sample is repeated"
        assert len(rest) - len(taken) < new_world * (batch + 1)  # only what drop_last drops
    else:
        assert set(taken) == set(rest), "a sample of the epoch was skipped"
        repeated = len(taken) - len(rest)
        assert 0 <= repeated <= new_world - 1, f"{repeated} samples repeated"
        # when every process's share already makes the same number of batches, nothing repeats
        lengths = [len(rest[r::new_world]) for r in range(new_world)]
        if len({-(-length // batch) for length in lengths}) == 1:
            assert repeated == 0
