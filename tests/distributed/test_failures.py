"""A failing process ends the job promptly; a killed one is restarted and resumes exactly (issue 6, "must show" 4).

- Rank 1 raises at step 3 (`dist_workload.raise_job`): under torchrun, and as two plain processes with SLURM
  variables (no agent to stop the others: each process must end on its own). Every rank must exit non-zero
  within 60 s of the raise, the ValueError must be in the output, no process may be left.
- Under ``torchrun --max-restarts=1`` with ``ModelCheckpoint(every_n_train_steps=1)`` and
  ``fit(ckpt_path="last")``, rank 1 SIGKILLs itself at step 7 on the first attempt (`dist_workload.kill_job`);
  the restarted job must end bitwise equal to the uninterrupted ``ddp_shuffled`` run of the shared job.
- A preemption signal (SIGTERM) on one rank only stops every rank at the same step boundary with a checkpoint
  (`dist_workload.preempt_job`).
"""

from __future__ import annotations

import sys
from pathlib import Path

import dist_harness as harness
import pytest

from ember.trainer import signals

pytestmark = pytest.mark.distributed

ERROR = "ValueError: boom from rank 1 at step 3"

RAISE_SCRIPT = """\
import sys
from pathlib import Path

import dist_workload

dist_workload.raise_job(Path(sys.argv[1]))
"""

KILL_SCRIPT = """\
import sys
from pathlib import Path

import dist_workload

dist_workload.kill_job(Path(sys.argv[1]))
"""


def _seconds_after_the_raise(tmp_path, job: harness.Finished) -> float:
    marker = tmp_path / "out" / "raised_at"
    assert marker.exists(), f"rank 1 never reached the raise; {harness.describe(job)}"
    return job.ended_at - float(marker.read_text())


def test_a_rank_that_raises_ends_every_rank_under_torchrun(tmp_path) -> None:
    script = harness.write_script(tmp_path, RAISE_SCRIPT)
    job = harness.run(harness.torchrun(script, "out"), tmp_path, timeout=150)
    assert not job.timed_out, harness.describe(job)
    elapsed = _seconds_after_the_raise(tmp_path, job)
    print(f"torchrun exited {job.returncode} {elapsed:.1f} s after rank 1 raised")
    assert job.returncode != 0
    assert elapsed < 60, harness.describe(job)
    assert ERROR in job.output, harness.describe(job)
    assert not list((tmp_path / "out").glob("done-rank*")), "a rank finished fit normally"
    assert not job.leftover, "worker processes outlived torchrun"


def test_a_rank_that_raises_ends_every_rank_without_an_agent(tmp_path) -> None:
    script = harness.write_script(tmp_path, RAISE_SCRIPT)
    port = str(harness.free_port())
    jobs = []
    for rank in (0, 1):
        env = {"SLURM_NTASKS": "2", "SLURM_PROCID": str(rank), "SLURM_LOCALID": str(rank), "MASTER_PORT": port}
        env |= {"SLURM_NODELIST": "localhost", "SLURM_JOB_ID": "77", "SLURM_JOB_NAME": "train"}
        jobs.append(harness.Job([sys.executable, str(script), "out"], tmp_path, harness.clean_env(env)))
    finished = [job.wait(timeout=150) for job in jobs]
    for rank, job in enumerate(finished):
        assert not job.timed_out, f"rank {rank} hangs: {harness.describe(job)}"
        elapsed = _seconds_after_the_raise(tmp_path, job)
        print(f"rank {rank} exited {job.returncode} {elapsed:.1f} s after rank 1 raised")
        assert job.returncode != 0, f"rank {rank}: {harness.describe(job)}"
        assert elapsed < 60, f"rank {rank}: {harness.describe(job)}"
    assert ERROR in finished[1].output, harness.describe(finished[1])
    assert not list((tmp_path / "out").glob("done-rank*")), "a rank finished fit normally"


def test_a_killed_rank_is_restarted_and_the_job_resumes_bitwise(main_job, tmp_path) -> None:
    script = harness.write_script(tmp_path, KILL_SCRIPT)
    job = harness.run(harness.torchrun(script, "out", max_restarts=1), tmp_path, timeout=120)
    assert job.returncode == 0, harness.describe(job)
    assert (tmp_path / "out" / "killed").read_text() == "killed at step 7", "rank 1 was never killed"
    ranks = harness.results(tmp_path / "out", "killed", 2)
    reference = main_job.results("ddp_shuffled")
    for rank, result in enumerate(ranks):
        assert result["restart_count"] == 1, f"rank {rank} did not run in the restarted attempt"
        assert result["steps"] == reference[rank]["steps"] == 36
        resumed_at = 36 - len(result["losses"])
        assert resumed_at in (6, 7), f"rank {rank} resumed at step {resumed_at}; the kill came after step 7"
        assert result["losses"] == reference[rank]["losses"][resumed_at:], f"rank {rank}: losses after the resume"
        assert result["seen"] == reference[rank]["seen"][resumed_at:], f"rank {rank}: samples after the resume"
        harness.assert_params_equal(result["params"], reference[rank]["params"], f"rank {rank} vs uninterrupted")


PREEMPT_SCRIPT = """\
import sys
from pathlib import Path

import dist_workload

dist_workload.preempt_job(Path(sys.argv[1]))
"""


def test_a_preemption_signal_on_one_rank_stops_every_rank_at_the_same_step(tmp_path) -> None:
    """SIGTERM reaches rank 1 only: both ranks stop at one boundary, save a checkpoint there, and exit with
    EXIT_PREEMPTED; the run resumed from it continues exactly as an uninterrupted one."""
    script = harness.write_script(tmp_path, PREEMPT_SCRIPT)
    job = harness.run(harness.spawn(script, "out"), tmp_path, timeout=150)
    ranks = harness.results(tmp_path / "out", "preempted", 2, job)
    assert job.returncode == 0, harness.describe(job)
    sent_at = ranks[1]["sent_at"]
    assert sent_at is not None, "rank 1 never signalled itself"
    for rank, result in enumerate(ranks):
        assert result["code"] == signals.EXIT_PREEMPTED, f"rank {rank} left fit with {result['code']}"
        step, when = result["stopped"]
        print(f"rank {rank} stopped at step {step}, {when - sent_at:.2f} s after the signal")
        assert when - sent_at < 10, f"rank {rank} took {when - sent_at:.1f} s to act on the signal"
    assert ranks[0]["stopped_at"] == ranks[1]["stopped_at"] >= 5
    assert Path(ranks[0]["ckpt"]).name == f"preempted-step={ranks[0]['stopped_at']}"
    for rank, result in enumerate(ranks):
        resumed, reference = result["resumed"], result["reference"]
        assert resumed["steps"] == reference["steps"] == result["stopped_at"] + 6
        assert resumed["losses"] == reference["losses"][-6:], f"rank {rank}: losses after the resume"
        harness.assert_params_equal(resumed["params"], reference["params"], f"rank {rank}: resumed vs uninterrupted")
