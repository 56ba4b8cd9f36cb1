"""Shared runs of the distributed tests (issue 6, "must show" 1-5; DESIGN.md section 8).

Starting two workers costs 10-20 s on a loaded 2-core machine, so the DDP, FSDP and evaluation runs share
one 2-process job (`main_job`, the sections of `dist_workload.main_job`, each saved per rank), and the
single-process references run once inside the pytest process (`single`). Tests that need their own
launch (multi-node, SLURM, failures, re-launch) start it themselves and compare against these.
"""

from __future__ import annotations

import contextlib
import os
import random
import sys
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))

import dist_harness as harness
import dist_workload as workload

MAIN_SCRIPT = """\
import sys
from pathlib import Path

import dist_workload

dist_workload.main_job(Path(sys.argv[1]))
"""


@dataclass
class MainJob:
    """The shared 2-process job: where its results are and how it ended."""

    out: Path
    job: harness.Finished

    def results(self, name: str) -> list[dict[str, Any]]:
        """Both ranks' result of section `name`; fails with the section's error or the job's output."""
        try:
            return harness.results(self.out, name, 2, self.job)
        except AssertionError as exc:
            pytest.fail(str(exc), pytrace=False)


@pytest.fixture(scope="session")
def main_job(tmp_path_factory: pytest.TempPathFactory) -> MainJob:
    directory = tmp_path_factory.mktemp("main_job")
    script = harness.write_script(directory, MAIN_SCRIPT)
    # The accuracy metric's torchmetrics (about 2 CPU-s) imported once by the launcher, not again by each rank.
    cmd = harness.spawn(script, str(directory / "out"), preload=["torchmetrics.classification"])
    job = harness.run(cmd, cwd=directory, timeout=240)
    print(f"main job: {harness.describe(job)}")
    return MainJob(directory / "out", job)


@pytest.fixture(scope="session")
def single(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    """One process, batch 8: the run DDP/FSDP with 2 x batch 4 must reproduce; and the eval references."""
    root = tmp_path_factory.mktemp("single")
    with _own_random_state():
        trainer, module = workload.fit_sequential("single_device", root, batch_size=8)
        seq = workload.summary(trainer, module)
        evals = {
            "even": workload.evaluate("single_device", workload.N_VAL),
            "uneven": workload.evaluate("single_device", workload.N_VAL_UNEVEN),
        }
    return {"seq": seq, "eval": evals}


@pytest.fixture
def own_random_state() -> Iterator[None]:
    """For tests that train in the pytest process: leave the global random streams and EMBER_SEED as found."""
    with _own_random_state():
        yield


@contextlib.contextmanager
def _own_random_state() -> Iterator[None]:
    seed, python, numpy = os.environ.get("EMBER_SEED"), random.getstate(), sys.modules.get("numpy")
    numpy_state = numpy.random.get_state() if numpy is not None else None
    with torch.random.fork_rng(devices=[]):
        try:
            yield
        finally:
            random.setstate(python)
            if numpy is not None:
                numpy.random.set_state(numpy_state)
            if seed is None:
                os.environ.pop("EMBER_SEED", None)
            else:
                os.environ["EMBER_SEED"] = seed
