"""``nonfinite_loss`` decides for every rank together: a NaN loss on one rank only makes all ranks skip that
batch ("skip") or all ranks raise naming the same step ("error"), without a hang."""

from __future__ import annotations

import json

import dist_harness as harness
import pytest

pytestmark = pytest.mark.distributed

SCRIPT = """\
import json
import sys

import torch
import torch.distributed as dist
from torch.utils.data import DataLoader, TensorDataset

import ember
from ember.strategies.ddp import DDPStrategy
from ember.trainer.numerics import NonFiniteLoss

mode, out = sys.argv[1], sys.argv[2]
BAD_BATCH = 2  # only rank 1 sees a NaN loss, at this batch


class Net(ember.TrainingModule):
    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.model = torch.nn.Linear(4, 1)

    def training_step(self, batch, batch_idx):
        x, y = batch
        loss = torch.nn.functional.mse_loss(self.model(x), y)
        if dist.get_rank() == 1 and batch_idx == BAD_BATCH:
            loss = loss * float("nan")
        return loss

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.1)


class Record(ember.Callback):
    def __init__(self):
        self.backward_batches, self.steps = [], []

    def on_before_backward(self, trainer, module, loss):
        self.backward_batches.append(len(self.steps))

    def on_train_batch_end(self, trainer, module, outputs, batch, batch_idx):
        self.steps.append(trainer.global_step)


torch.manual_seed(1)
data = TensorDataset(torch.randn(48, 4), torch.randn(48, 1))
record, module = Record(), Net()
trainer = ember.Trainer(
    strategy=DDPStrategy(timeout_s=30), devices=2, accelerator="cpu", max_epochs=1, limit_train_batches=6,
    nonfinite_loss=mode, log_every_n_steps=1, callbacks=[record], logger=False, enable_progress_bar=False,
    enable_checkpointing=False, enable_model_summary=False, num_sanity_val_steps=0,
)
error = None
try:
    trainer.fit(module, DataLoader(data, batch_size=4))
except NonFiniteLoss as e:
    error = str(e)
rank = dist.get_rank() if dist.is_initialized() else int(__import__("os").environ["RANK"])
result = {
    "error": error,
    "backward_batches": record.backward_batches,
    "steps": record.steps,
    "skipped": trainer.finite_guard.skipped_batches,
    "params": [p.detach().flatten().tolist() for p in module.model.parameters()],
    "finite": all(bool(torch.isfinite(p).all()) for p in module.model.parameters()),
}
with open(f"{out}/rank{rank}.json", "w") as f:
    json.dump(result, f)
"""


def _run(tmp_path, mode: str) -> list[dict]:
    script = harness.write_script(tmp_path, SCRIPT)
    out = tmp_path / "out"
    out.mkdir()
    job = harness.run(harness.spawn(script, mode, str(out)), tmp_path, timeout=120)
    assert not job.timed_out, harness.describe(job)
    files = [out / f"rank{r}.json" for r in (0, 1)]
    assert all(f.exists() for f in files), harness.describe(job)
    return [json.loads(f.read_text()) for f in files]


def test_skip_skips_the_same_batch_on_every_rank_and_parameters_stay_equal(tmp_path) -> None:
    ranks = _run(tmp_path, "skip")
    for rank in ranks:
        assert rank["error"] is None, ranks
        assert rank["skipped"] == 1, ranks
        assert rank["backward_batches"] == [0, 1, 3, 4, 5], ranks  # batch 2 skipped everywhere, not only on rank 1
        assert rank["finite"], ranks
    assert ranks[0]["steps"] == ranks[1]["steps"] == [1, 2, 2, 3, 4, 5], ranks
    assert ranks[0]["params"] == ranks[1]["params"], ranks


def test_error_raises_on_every_rank_at_the_same_step(tmp_path) -> None:
    ranks = _run(tmp_path, "error")
    for rank in ranks:
        assert rank["error"] is not None and "at optimizer step 3" in rank["error"], ranks
    assert ranks[0]["steps"] == ranks[1]["steps"], ranks
    assert ranks[0]["params"] == ranks[1]["params"], ranks
