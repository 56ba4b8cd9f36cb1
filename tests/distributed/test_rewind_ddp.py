"""SpikeGuard under DDP and FSDP2 (2 processes, gloo): the ranks check the loss averaged over both, so they rewind
together, to the same step, leaving out the same batches; and the run equals one process with the double batch."""

from __future__ import annotations

import json
import shutil
import sys
from pathlib import Path

import dist_harness as harness
import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "exactness"))
import rewind_workload
from rewind_workload import PoisonData, Regressor

import ember
from ember.callbacks import SpikeGuard

pytestmark = pytest.mark.distributed

BATCH, BATCHES, POISONED = 4, 24, 11  # per process; the single process takes 2 x BATCH

SCRIPT = f"""\
import json
import sys

from torch.utils.data import DataLoader

import ember
from ember.callbacks import SpikeGuard
from ember.strategies import DDPStrategy, FSDPStrategy
from rewind_workload import PoisonData, Regressor

out, kind = sys.argv[1], sys.argv[2]
poison = frozenset(range(2 * {BATCH} * {POISONED}, 2 * {BATCH} * ({POISONED} + 1)))
data = PoisonData(2 * {BATCH} * {BATCHES}, poison)
guard = SpikeGuard(factor=50, window=4, warmup_steps=2, check_every_n_steps=2, snapshot_every_n_steps=4, skip_after=1)
module = Regressor(lr=0.02, momentum=0.9)
strategy = DDPStrategy(timeout_s=30) if kind == "ddp" else FSDPStrategy(timeout_s=30)
trainer = ember.Trainer(
    strategy=strategy, devices=2, accelerator="cpu", max_epochs=1, callbacks=[guard], logger=False,
    enable_progress_bar=False, enable_checkpointing=False, enable_model_summary=False, default_root_dir=out,
)
trainer.fit(module, DataLoader(data, batch_size={BATCH}))
result = {{
    "rewinds": guard.rewinds,
    "on_disk": open(f"{{trainer.run_dir}}/rewinds.jsonl").read() if trainer.is_global_zero else None,
    "skipped": trainer.progress.skipped_positions(),
    # FSDP2's parameters are shards (DTensors): the whole of each, gathered on every rank
    "params": [getattr(p, "full_tensor", p.detach)().detach().flatten().tolist() for p in module.parameters()],
}}
with open(f"{{out}}/rank{{trainer.global_rank}}.json", "w") as f:
    json.dump(result, f)
"""


def single_process(root: Path) -> tuple[SpikeGuard, Regressor]:
    poison = frozenset(range(2 * BATCH * POISONED, 2 * BATCH * (POISONED + 1)))
    data = PoisonData(2 * BATCH * BATCHES, poison)
    guard = SpikeGuard(
        factor=50, window=4, warmup_steps=2, check_every_n_steps=2, snapshot_every_n_steps=4, skip_after=1
    )
    module = Regressor(lr=0.02, momentum=0.9)
    trainer = ember.Trainer(
        max_epochs=1,
        callbacks=[guard],
        logger=False,
        enable_progress_bar=False,
        enable_checkpointing=False,
        enable_model_summary=False,
        default_root_dir=str(root),
    )
    trainer.fit(module, torch.utils.data.DataLoader(data, batch_size=2 * BATCH))
    return guard, module


@pytest.mark.parametrize("kind", ["ddp", "fsdp"])
def test_both_ranks_rewind_together_and_match_one_process_with_the_double_batch(tmp_path: Path, kind: str) -> None:
    """Under FSDP2 the snapshot holds each rank's shards (cloned on their device) and the optimizer's sharded state."""
    script = harness.write_script(tmp_path, SCRIPT)
    shutil.copy(rewind_workload.__file__, tmp_path / "rewind_workload.py")
    out = tmp_path / "out"
    out.mkdir()
    job = harness.run(harness.spawn(script, str(out), kind), tmp_path, timeout=180)
    assert not job.timed_out, harness.describe(job)
    files = [out / f"rank{r}.json" for r in (0, 1)]
    assert all(f.exists() for f in files), harness.describe(job)
    ranks = [json.loads(f.read_text()) for f in files]

    guard, module = single_process(tmp_path / "single")
    assert len(ranks[0]["rewinds"]) == 1, ranks[0]["rewinds"]
    assert ranks[0]["rewinds"] == ranks[1]["rewinds"]  # together: same step, value, snapshot, batches and samples
    assert ranks[0]["skipped"] == ranks[1]["skipped"]
    assert ranks[0]["params"] == ranks[1]["params"]
    ddp_rewind, single_rewind = ranks[0]["rewinds"][0], guard.rewinds[0]
    for key in ("step", "spike_step", "restored_step", "skipped_batches", "reason"):
        assert ddp_rewind[key] == single_rewind[key], key
    assert POISONED in [b for _, b in single_rewind["skipped_batches"]]
    # every process records the samples of the global batches left out: both processes' own, the double batch's
    poison = set(range(2 * BATCH * POISONED, 2 * BATCH * (POISONED + 1)))
    assert len(ddp_rewind["skipped_samples"]) == len(single_rewind["skipped_samples"]) > len(poison)
    assert set(ddp_rewind["skipped_samples"]) == set(single_rewind["skipped_samples"]) >= poison
    assert [json.loads(line) for line in ranks[0]["on_disk"].splitlines()] == ranks[0]["rewinds"]
    for ddp_param, param in zip(ranks[0]["params"], module.parameters(), strict=True):
        torch.testing.assert_close(torch.tensor(ddp_param), param.detach().flatten(), rtol=0, atol=1e-6)
