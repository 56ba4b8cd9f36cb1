"""A process whose last collective finishes while it exits does not abort (ember/strategies/collectives.py).

gloo's worker thread drops its reference to a collective's tensors just after the work completes; when that
drop leaves the tensor's Python object as its only holder, it takes the GIL, and when the interpreter is
already shutting down the process aborts ("terminate called without an active exception"). The script makes
that timing certain instead of rare: rank 1 leaves a collective in flight and exits; rank 0 joins it 0.1 s
later, while rank 1 runs an exit handler that keeps the GIL for half a second (registered before ember is
imported, so it runs after ember's own handlers) and then shuts down. Without `collectives.keep` this
aborted rank 1 in 4 of 4 runs of the flag exchange. With the exit's wait switched off as well, only keep's
own holder (taken before the collective is issued) stands between the worker and the GIL: keeping the
tensor after issuing it, and counting on the wait, aborted that case.
"""

from __future__ import annotations

import sys

import dist_harness as harness
import pytest

pytestmark = pytest.mark.distributed

SCRIPT = """\
import atexit
import os
import sys
import time
from pathlib import Path

out = Path(sys.argv[1])
collective = sys.argv[2]
exit_waits = sys.argv[3] == "wait"
rank = int(os.environ["RANK"])


def hold_the_gil():
    sys.setswitchinterval(100.0)  # no thread switches: a worker thread waiting for the GIL keeps waiting
    end = time.monotonic() + 0.5
    while time.monotonic() < end:
        pass


if rank == 1:
    atexit.register(hold_the_gil)  # before ember's handlers are registered, so it runs after them

import torch

from ember.strategies import collectives
from ember.strategies.ddp import DDPStrategy

if not exit_waits:
    atexit.unregister(collectives.let_workers_finish)

strategy = DDPStrategy(timeout_s=30)
strategy.devices = 2
strategy.setup_environment()
if rank == 0:
    while not (out / "exiting").exists():
        time.sleep(0.005)
    time.sleep(0.1)  # rank 1 is past its script by now, in its exit handlers
if collective == "flag exchange" and rank == 0:
    strategy.any_flag(False)[0].wait()
elif collective == "flag exchange":
    strategy.any_flag(True)  # left in flight; this process keeps no reference to its tensor
elif collective == "reduce":
    if rank == 1:
        (out / "exiting").touch()  # rank 0 joins 0.1 s later; this call returns once it has
    strategy.reduce(torch.ones(3), "sum")
(out / f"rank{rank}-done").touch()
if rank == 1:
    (out / "exiting").touch()
"""


@pytest.mark.parametrize("exit_waits", ["wait", "no wait"])
@pytest.mark.parametrize("collective", ["flag exchange", "reduce"])
def test_a_collective_that_completes_while_the_process_exits_does_not_abort_it(
    tmp_path, collective: str, exit_waits: str
) -> None:
    script = harness.write_script(tmp_path, SCRIPT)
    out = tmp_path / "out"
    out.mkdir()
    port = str(harness.free_port())
    jobs = []
    for rank in (0, 1):
        env = harness.clean_env(
            {"MASTER_ADDR": "127.0.0.1", "MASTER_PORT": port, "RANK": str(rank), "WORLD_SIZE": "2",
             "LOCAL_RANK": str(rank), "LOCAL_WORLD_SIZE": "2"}
        )  # fmt: skip
        jobs.append(harness.Job([sys.executable, str(script), str(out), collective, exit_waits], tmp_path, env))
    for rank, job in enumerate(jobs):
        finished = job.wait(timeout=120)
        assert "terminate called" not in finished.output, f"rank {rank}: {harness.describe(finished)}"
        assert finished.returncode == 0, f"rank {rank}: {harness.describe(finished)}"
    assert sorted(p.name for p in out.glob("rank*-done")) == ["rank0-done", "rank1-done"]
