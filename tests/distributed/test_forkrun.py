"""The tests' launcher (`forkrun.py`) behaves as torchrun does where the distributed tests rely on it: every rank
gets torchrun's variables and runs the script as ``__main__``; a failing rank stops the others and the job
fails; a SIGTERM sent to the launcher reaches every rank."""

from __future__ import annotations

import json
import signal
import time

import dist_harness as harness
import pytest

pytestmark = pytest.mark.distributed

RANKS = """\
import json, os, sys, time
from pathlib import Path

out = Path(sys.argv[1])
rank = int(os.environ["RANK"])
names = ("RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT", "TORCHELASTIC_RUN_ID")
(out / f"rank{rank}.json").write_text(json.dumps({"env": {k: os.environ.get(k) for k in names},
                                                  "argv": sys.argv[1:], "main": __name__, "pid": os.getpid()}))
if sys.argv[2] == "fail" and rank == 1:
    sys.exit(3)
if sys.argv[2] in ("fail", "wait"):
    (out / f"ready{rank}").touch()
    time.sleep(60)  # ended by the launcher
"""


def test_every_rank_runs_the_script_as_main_with_torchruns_variables(tmp_path) -> None:
    script = harness.write_script(tmp_path, RANKS)
    job = harness.run(harness.spawn(script, str(tmp_path), "ok", nproc=3), tmp_path, timeout=60)
    assert job.returncode == 0, harness.describe(job)
    ranks = [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in range(3)]
    ports = {r["env"]["MASTER_PORT"] for r in ranks}
    run_ids = {r["env"]["TORCHELASTIC_RUN_ID"] for r in ranks}
    assert len(ports) == len(run_ids) == 1 and None not in ports | run_ids
    assert len({r["pid"] for r in ranks}) == 3
    for rank, result in enumerate(ranks):
        assert result["main"] == "__main__" and result["argv"] == [str(tmp_path), "ok"]
        env = result["env"]
        assert (env["RANK"], env["LOCAL_RANK"], env["WORLD_SIZE"], env["LOCAL_WORLD_SIZE"]) == (
            str(rank),
            str(rank),
            "3",
            "3",
        )
        assert env["MASTER_ADDR"] == "127.0.0.1"


def test_a_failing_rank_stops_the_others_and_fails_the_job(tmp_path) -> None:
    script = harness.write_script(tmp_path, RANKS)
    job = harness.run(harness.spawn(script, str(tmp_path), "fail"), tmp_path, timeout=60)
    assert job.returncode == 1, harness.describe(job)
    assert job.seconds < 30, f"rank 0 was not stopped: the job took {job.seconds:.1f} s"
    assert "rank 1" in job.output and "ended with 3" in job.output, job.output
    assert not job.leftover


def test_a_sigterm_to_the_launcher_reaches_every_rank(tmp_path) -> None:
    script = harness.write_script(tmp_path, RANKS)
    job = harness.Job(harness.spawn(script, str(tmp_path), "wait"), tmp_path)
    deadline = time.monotonic() + 30
    while not all((tmp_path / f"ready{r}").exists() for r in (0, 1)) and time.monotonic() < deadline:
        time.sleep(0.05)
    job.proc.send_signal(signal.SIGTERM)
    finished = job.wait(timeout=30)
    assert finished.returncode == 1, harness.describe(finished)
    assert finished.seconds < 25, f"the ranks outlived the signal: {finished.seconds:.1f} s"
    assert "ended with -15" in finished.output, finished.output
