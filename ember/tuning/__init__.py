"""Find and tune: the learning-rate finder, the batch-size finder, sweeps on Optuna, and the profiler.

::

    from ember.tuning import lr_find, scale_batch_size
    result = lr_find(trainer, module, datamodule=data)      # result.suggestion, result.plot_path
    found = scale_batch_size(trainer, module, datamodule=data, max_size=4096)

``ember tune lr|batch-size -c CONFIG`` and ``ember sweep -c CONFIG --space SPACE`` run them from
YAML; ``Trainer(profiler="simple" | "pytorch" | ProfilerConfig(...))`` profiles a run. Everything is
imported on first use, so ``import ember`` does not import Optuna or matplotlib. See docs/tuning.md.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from ember.tuning.batch_size import BatchSizeResult, scale_batch_size
    from ember.tuning.lr_finder import LRFinderResult, lr_find
    from ember.tuning.profiler import Profiler, ProfilerConfig
    from ember.tuning.space import SweepSpace
    from ember.tuning.sweep import run_sweep
    from ember.tuning.sweep_report import SweepResult

_WHERE = {
    "BatchSizeResult": "batch_size",
    "LRFinderResult": "lr_finder",
    "Profiler": "profiler",
    "ProfilerConfig": "profiler",
    "SweepResult": "sweep_report",
    "SweepSpace": "space",
    "lr_find": "lr_finder",
    "run_sweep": "sweep",
    "scale_batch_size": "batch_size",
}

__all__ = [
    "BatchSizeResult",
    "LRFinderResult",
    "Profiler",
    "ProfilerConfig",
    "SweepResult",
    "SweepSpace",
    "lr_find",
    "run_sweep",
    "scale_batch_size",
]


def __getattr__(name: str) -> Any:
    if name in _WHERE:
        return getattr(importlib.import_module(f"ember.tuning.{_WHERE[name]}"), name)
    raise AttributeError(f"module 'ember.tuning' has no attribute {name!r}")
