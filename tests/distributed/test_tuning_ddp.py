"""The finders under DDP with 2 gloo processes: every rank runs them and all agree.

One 2-process job (`JOB`) runs, on both ranks: a DDP fit from a seeded module (the reference); the same with
`lr_find` first (the range test all-reduces each step's loss, so both ranks see one curve); and
`scale_batch_size` with a different memory budget on each rank (a size fits only if it fits on both). Nothing
evaluates, so the modules leave the accuracy metric out (its import would cost each rank about 2 s of CPU).
"""

from __future__ import annotations

import dist_harness as harness
import pytest

pytestmark = pytest.mark.distributed

#: Per-rank memory budgets of the batch-size section (rank 1's is the tighter one).
BUDGETS = (2_400_000, 1_600_000)

JOB = f"""\
import sys
from pathlib import Path
from typing import Any

import torch
from torch.utils.data import DataLoader

import dist_workload as w
import ember
from ember.tuning import lr_find, scale_batch_size

out = Path(sys.argv[1])
BUDGETS = {BUDGETS!r}


class Wide(w.Net):
    def training_step(self, batch: Any, batch_idx: int) -> Any:
        scratch = torch.ones(len(batch[0]), 12_500)  # 50 kB per sample: the peak grows with the batch
        return super().training_step(batch, batch_idx) + 0 * scratch.sum()


def loader(batch_size: int = 4) -> DataLoader:
    generator = torch.Generator().manual_seed(7)
    return DataLoader(w.train_set(w.N_SHUFFLED), batch_size=batch_size, shuffle=True, generator=generator)


def trainer(root: str, **options: Any) -> ember.Trainer:
    return ember.Trainer(
        strategy=w.ddp(), devices=2, accelerator="cpu", default_root_dir=out / root, enable_checkpointing=False,
        **w.QUIET, **options,
    )


def fit(find: bool) -> dict[str, Any]:
    ember.seed_everything(w.SEED)
    t, module, data = trainer("fit", max_epochs=2), w.Net(dropout=0.1, adamw=True, accuracy=False), loader()
    found: dict[str, Any] = {{}}
    if find:
        before = {{k: v.clone() for k, v in module.state_dict().items()}}
        rng, gen = torch.get_rng_state(), data.generator.get_state()
        result = lr_find(t, module, data, num_steps=30, min_lr=1e-5, max_lr=100.0, verbose=False)
        found = {{
            "suggestion": result.suggestion, "losses": result.losses, "smoothed": result.smoothed,
            "stopped_early": result.stopped_early,
            "restored": all(torch.equal(before[k], v) for k, v in module.state_dict().items())
            and torch.equal(rng, torch.get_rng_state()) and torch.equal(gen, data.generator.get_state()),
        }}
    t.fit(module, data)
    return {{**w.where(t), **found, "params": w.full_state(module), "steps": t.global_step}}


def batch_size() -> dict[str, Any]:
    ember.seed_everything(w.SEED)
    rank = w.rank()
    result = scale_batch_size(
        trainer("bs"), Wide(accuracy=False), loader(), memory_budget=BUDGETS[rank], steps_per_trial=2, verbose=False
    )
    trials = [(t.batch_size, t.fits, t.peak_bytes, t.local_peak_bytes) for t in result.trials]
    return {{"batch_size": result.batch_size, "trials": trials, "rank": rank}}


w.section(out, "plain_fit", lambda: fit(False))
w.section(out, "lr_find", lambda: fit(True))
w.section(out, "batch_size", batch_size)
"""


@pytest.fixture(scope="module")
def job(tmp_path_factory: pytest.TempPathFactory) -> tuple[harness.Finished, object]:
    directory = tmp_path_factory.mktemp("tuning_ddp")
    script = harness.write_script(directory, JOB)
    finished = harness.run(harness.spawn(script, str(directory / "out")), cwd=directory, timeout=240)
    print(f"tuning job: {harness.describe(finished)}")
    return finished, directory / "out"


def _results(job: tuple[harness.Finished, object], name: str) -> list[dict]:
    finished, out = job
    return harness.results(out, name, 2, finished)  # type: ignore[arg-type]


def test_both_ranks_see_one_curve_and_suggest_the_same_lr(job) -> None:
    ranks = _results(job, "lr_find")
    assert [r["rank"] for r in ranks] == [0, 1] and ranks[0]["strategy"] == "DDPStrategy"
    assert ranks[0]["suggestion"] is not None
    assert ranks[0]["suggestion"] == ranks[1]["suggestion"]
    assert ranks[0]["losses"] == ranks[1]["losses"]  # all-reduced: bitwise the same numbers
    assert ranks[0]["stopped_early"] == ranks[1]["stopped_early"]
    assert len(ranks[0]["losses"]) <= 30


def test_the_finder_restores_each_rank_and_the_fit_after_it_is_the_fit_without_it(job) -> None:
    found, plain = _results(job, "lr_find"), _results(job, "plain_fit")
    for rank in range(2):
        assert found[rank]["restored"], f"rank {rank}: parameters, random state or generator changed"
        assert found[rank]["steps"] == plain[rank]["steps"] == 2 * 12
        harness.assert_params_equal(found[rank]["params"], plain[rank]["params"], f"rank {rank}: after lr_find")
    harness.assert_params_equal(found[0]["params"], found[1]["params"], "rank 0 vs rank 1")


def test_the_batch_size_fits_on_every_rank(job) -> None:
    ranks = _results(job, "batch_size")
    assert ranks[0]["batch_size"] == ranks[1]["batch_size"]
    assert [t[:3] for t in ranks[0]["trials"]] == [t[:3] for t in ranks[1]["trials"]]  # (size, fits, peak)
    fitting = []
    for (size, fits, peak, local0), (_, _, _, local1) in zip(ranks[0]["trials"], ranks[1]["trials"], strict=True):
        assert peak == max(local0, local1)
        assert fits == (local0 <= BUDGETS[0] and local1 <= BUDGETS[1]), (size, local0, local1)
        if fits:
            fitting.append(size)
    assert ranks[0]["batch_size"] == max(fitting)
    # Rank 1's tighter budget decided: some size fitted on rank 0 alone and was refused.
    pairs = zip(ranks[0]["trials"], ranks[1]["trials"], strict=True)
    assert any(a[3] <= BUDGETS[0] and b[3] > BUDGETS[1] for a, b in pairs)
