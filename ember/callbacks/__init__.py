"""Callbacks: the `Callback` base with every hook, and the built-in callbacks.

The built-in callbacks are imported on first use (``ember.callbacks.EarlyStopping``),
so ``import ember`` stays light; optional display libraries (rich) are imported only
when a callback draws.
"""

import importlib
from typing import Any

from ember.callbacks.callback import Callback

_WHERE = {
    "BackboneFinetuning": "finetuning",
    "BaseFinetuning": "base_finetuning",
    "EMA": "ema",
    "EarlyStopping": "early_stopping",
    "GradientMonitor": "gradient_monitor",
    "LearningRateMonitor": "lr_monitor",
    "ModelCheckpoint": "model_checkpoint",
    "ModelSummary": "model_summary",
    "ParameterHistograms": "gradient_monitor",
    "ProgressLine": "progress",
    "RichProgressBar": "rich_progress",
    "SpikeGuard": "spike_guard",
    "ThroughputMonitor": "throughput",
    "Timer": "timer",
}

__all__ = ["Callback", *sorted(_WHERE)]


def __getattr__(name: str) -> Any:
    if name in _WHERE:
        return getattr(importlib.import_module(f"ember.callbacks.{_WHERE[name]}"), name)
    raise AttributeError(f"module 'ember.callbacks' has no attribute {name!r}")
