"""Property (b): a run stopped at a random step boundary and resumed in a new process equals the
uninterrupted run bitwise, over generated configurations.

The uninterrupted run and the first half (stopped by ``trainer.should_stop`` after a drawn number of
optimizer steps; ``last`` then names the checkpoint of that step boundary) train in this process. The
second half, ``fit(ckpt_path="last")``, runs in a new process forked from a server that imported torch
and ember but never trained (`multiprocessing`'s forkserver), starting from scrambled random streams.
Equal means: the first half's batch losses followed by the second half's are the uninterrupted run's,
and the final parameters, learning rate, step count, validation losses and global random streams agree.
"""

from __future__ import annotations

import pytest
from exact_checks import check_resume, uninterrupted
from exact_strategies import examples, record, resume_configs
from exact_workload import Config
from hypothesis import assume, given, settings
from hypothesis import strategies as st


@given(cfg=resume_configs(), data=st.data())
@settings(max_examples=examples(3))
@pytest.mark.slow  # 4 s of CPU on a 2-core machine, with the processes it starts
def test_a_run_resumed_in_a_new_process_equals_the_uninterrupted_run(
    cfg: Config, data: st.DataObject, tmp_path_factory: pytest.TempPathFactory
) -> None:
    root = tmp_path_factory.mktemp("resume")
    full = uninterrupted(cfg, root / "full")
    assume(full["steps"] >= 2)  # a step boundary inside the run to stop at
    stop_at = data.draw(st.integers(1, full["steps"] - 1), label="stop_at")
    record("resume", cfg, stop_at)
    check_resume(cfg, stop_at, root, full)
