"""Property (a): ``Trainer.fit`` equals a raw PyTorch loop bitwise, over generated configurations.

The raw loop (`exact_workload.raw_run`) is written from docs/trainer.md; ember runs the same module,
data and options. Equal means: every batch's loss, every final parameter and the final learning rate
``torch.equal``, the same number of optimizer steps, the same validation losses, and the global torch
and Python random streams in the same state afterwards.
"""

from __future__ import annotations

import pytest
from exact_checks import check_parity
from exact_strategies import examples, parity_configs, record
from exact_workload import Config
from hypothesis import given, settings


@given(cfg=parity_configs())
@settings(max_examples=examples(8))
@pytest.mark.slow  # 5 s of CPU on a 2-core machine, with the processes it starts
def test_fit_equals_the_raw_loop_bitwise(cfg: Config, tmp_path_factory: pytest.TempPathFactory) -> None:
    record("parity", cfg)
    check_parity(cfg, tmp_path_factory.mktemp("parity"))
