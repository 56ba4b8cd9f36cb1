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


def counting(flag, proposal=1):
    global exchanges
    exchanges += 1
    return start_exchange(flag, proposal)


strategy.any_flag = counting
stopped_at = None
for boundary in range(1, 2001):
    time.sleep(0.002)  # a 2 ms step
    if strategy.preemption_requested(rank == 1 and boundary >= 300):
        stopped_at = boundary
        break
with open(f"{sys.argv[1]}/rank{rank}.json", "w") as f:
    json.dump({"stopped_at": stopped_at, "exchanges": exchanges}, f)
dist.barrier()
"""


def test_ranks_exchange_flags_a_few_times_a_second_and_stop_at_the_same_boundary(tmp_path) -> None:
    import json

    script = harness.write_script(tmp_path, SCRIPT)
    (tmp_path / "out").mkdir()
    job = harness.run(harness.torchrun(script, str(tmp_path / "out")), tmp_path, timeout=120)
    assert job.returncode == 0, harness.describe(job)
    ranks = [json.loads((tmp_path / "out" / f"rank{r}.json").read_text()) for r in (0, 1)]
    print(ranks)
    stopped = ranks[0]["stopped_at"]
    assert stopped is not None and stopped == ranks[1]["stopped_at"], ranks
    assert 300 < stopped < 2000, ranks
    assert ranks[0]["exchanges"] == ranks[1]["exchanges"], ranks
    # About every 0.1 s at 2+ ms a step: far fewer exchanges than boundaries (one per boundary before).
    assert ranks[0]["exchanges"] < stopped / 4, ranks
