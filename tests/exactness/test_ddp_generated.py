"""Property (c): under DDP with 2 gloo processes, batch B per process equals one process with batch 2B
within 1e-6, over generated configurations of the subset where both see the same samples per step.

The subset (`exact_strategies.ddp_configs`): a ``shuffle=False`` loader, which ember splits so that the two
processes hold the two halves of each batch of one process with batch 2B; an even number of samples; no
dropout or augmentation from the global RNG (each process draws its own); fp32. The two processes are new
processes (forked from a clean server) that join a gloo process group; the reference trains in this process.
Compared: every step's loss (the mean of the two processes' against the one process's), the final
parameters on both processes, the final learning rate and the step count.
"""

from __future__ import annotations

import pytest
from exact_checks import check_ddp
from exact_strategies import ddp_configs, examples, record
from exact_workload import Config
from hypothesis import given, settings

pytestmark = pytest.mark.distributed


@given(cfg=ddp_configs())
@settings(max_examples=examples(2))
def test_two_processes_with_batch_b_equal_one_process_with_batch_2b(
    cfg: Config, tmp_path_factory: pytest.TempPathFactory
) -> None:
    record("ddp", cfg)
    check_ddp(cfg, tmp_path_factory.mktemp("ddp"))
