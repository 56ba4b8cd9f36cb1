"""tests/compat/real: LightningModules in the shape of real public ones, ported by `ember port` and trained by
both frameworks. The harness (`real_harness`) is a module beside the tests."""

from __future__ import annotations

import sys
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))


@pytest.fixture(autouse=True, scope="package")
def _one_thread() -> Iterator[None]:
    """One intra-op thread: the runs are tiny, and on a shared machine a second thread mostly waits."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)
