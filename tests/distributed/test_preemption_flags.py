"""How ranks agree on a preemption signal: a few exchanges a second, not a collective per step, and every
rank stops at the same boundary."""

from __future__ import annotations

import dist_harness as harness
import pytest

pytestmark = pytest.mark.distributed

SCRIPT = """\
import json
import sys
import time

import torch.distributed as dist

from ember.strategies.ddp import DDPStrategy

strategy = DDPStrategy()
strategy.devices = 2
strategy.flag_interval_s = 0.1
strategy.setup_environment()
rank = dist.get_rank()
exchanges = 0
start_exchange = strategy.any_flag
started = []


def counting(flag, proposal=1):
    global exchanges
    exchanges += 1
    started.append(start_exchange(flag, proposal))
    return started[-1]


strategy.any_flag = counting
stopped_at = None
start = time.monotonic()
for boundary in range(1, 2001):
    time.sleep(0.002)  # a 2 ms step
    if strategy.preemption_requested(rank == 1 and boundary >= 300):
        stopped_at = boundary
        break
seconds = time.monotonic() - start
# The end of a run: the exchange started at the last boundary is finished, none stays pending, and the
# next run begins with an exchange at its first boundary on every rank.
strategy.teardown()
finished = started[-1][0].is_completed()
before = exchanges
next_run_stops = strategy.preemption_requested(False)
with open(f"{sys.argv[1]}/rank{rank}.json", "w") as f:
    json.dump({"stopped_at": stopped_at, "exchanges": before, "seconds": seconds, "finished": finished,
               "next_run_exchanges": exchanges - before, "next_run_stops": next_run_stops}, f)
strategy.teardown()
dist.barrier()
"""


def test_ranks_exchange_flags_a_few_times_a_second_and_stop_at_the_same_boundary(tmp_path) -> None:
    import json

    script = harness.write_script(tmp_path, SCRIPT)
    (tmp_path / "out").mkdir()
    job = harness.run(harness.spawn(script, str(tmp_path / "out")), tmp_path, timeout=120)
    assert job.returncode == 0, harness.describe(job)
    ranks = [json.loads((tmp_path / "out" / f"rank{r}.json").read_text()) for r in (0, 1)]
    print(ranks)
    stopped = ranks[0]["stopped_at"]
    assert stopped is not None and stopped == ranks[1]["stopped_at"], ranks
    assert 300 < stopped < 2000, ranks
    assert ranks[0]["exchanges"] == ranks[1]["exchanges"], ranks
    # About every 0.1 s (flag_interval_s), whatever a step takes on a busy machine: at 2+ ms a step, far fewer
    # exchanges than boundaries (one per boundary before). Twice the count, plus the first two exchanges (the
    # ranks learn the step time) and the one that carries the stop, as margin.
    seconds = max(rank["seconds"] for rank in ranks)
    assert ranks[0]["exchanges"] <= 2 * seconds / 0.1 + 4, ranks
    assert ranks[0]["exchanges"] < stopped, ranks
    for rank in ranks:  # teardown finished the exchange in flight; a new run exchanges at once
        assert rank["finished"] is True and rank["next_run_exchanges"] == 1, ranks
        assert rank["next_run_stops"] is False, ranks


PROFILED = """\
import json
import sys
import time

import torch
import torch.distributed as dist
from torch.utils.data import DataLoader, TensorDataset

import ember
from ember.strategies.ddp import DDPStrategy

rank = int(__import__("os").environ["RANK"])
started = []
pending_at_train_end = []


class Watch(ember.Callback):
    def on_train_end(self, trainer, module):
        pending_at_train_end.append(trainer.strategy._flag_work is not None)


class Net(ember.TrainingModule):
    def __init__(self):
        super().__init__()
        self.model = torch.nn.Linear(4, 1)
        self.loss_fn = torch.nn.MSELoss()

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.1)


strategy = DDPStrategy()
start_exchange = strategy.any_flag
strategy.any_flag = lambda flag, proposal=1: started.append(start_exchange(flag, proposal)) or started[-1]
data = DataLoader(TensorDataset(torch.randn(32, 4), torch.randn(32, 1)), batch_size=4)
trainer = ember.Trainer(strategy=strategy, devices=2, accelerator="cpu", max_epochs=2, callbacks=[Watch()],
                        logger=False, enable_progress_bar=False, enable_model_summary=False,
                        enable_checkpointing=False)
trainer.fit(Net(), data)

# Under a profiler, an exchange is finished at the boundary that starts it: rank 1 starts its own 0.3 s
# later, so without waiting rank 0's would still be in flight when preemption_requested returns.
strategy._boundaries_to_exchange = 1
if rank == 1:
    time.sleep(0.3)
with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]):
    strategy.preemption_requested(False)
    done_under_profiler = started[-1][0].is_completed()
strategy.teardown()
with open(f"{sys.argv[1]}/rank{rank}.json", "w") as f:
    json.dump({"pending_at_train_end": pending_at_train_end, "done_under_profiler": done_under_profiler}, f)
dist.barrier()
"""


def test_no_exchange_is_in_flight_when_training_ends_or_while_a_profiler_records(tmp_path) -> None:
    """A torch profiler stopped while gloo's worker still recorded the exchange crashed the process now and
    then (SIGSEGV freeing the profiler's records; the batch-size finder stops one in ``on_train_end``)."""
    import json

    script = harness.write_script(tmp_path, PROFILED)
    (tmp_path / "out").mkdir()
    job = harness.run(harness.spawn(script, str(tmp_path / "out")), tmp_path, timeout=120)
    assert job.returncode == 0, harness.describe(job)
    ranks = [json.loads((tmp_path / "out" / f"rank{r}.json").read_text()) for r in (0, 1)]
    for rank in ranks:
        assert rank["pending_at_train_end"] == [False], ranks  # on_train_end ran once, no exchange pending
    assert ranks[0]["done_under_profiler"] is True and ranks[1]["done_under_profiler"] is True, ranks
