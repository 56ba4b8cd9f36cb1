"""Callbacks: the `Callback` base with every hook, and the built-in callbacks.

Optional display libraries (rich) are imported only when a callback draws.
"""

from ember.callbacks.callback import Callback
from ember.callbacks.early_stopping import EarlyStopping
from ember.callbacks.ema import EMA
from ember.callbacks.gradient_monitor import GradientMonitor, ParameterHistograms
from ember.callbacks.lr_monitor import LearningRateMonitor
from ember.callbacks.model_checkpoint import ModelCheckpoint
from ember.callbacks.model_summary import ModelSummary
from ember.callbacks.progress import ProgressLine
from ember.callbacks.rich_progress import RichProgressBar
from ember.callbacks.throughput import ThroughputMonitor
from ember.callbacks.timer import Timer

__all__ = [
    "EMA",
    "Callback",
    "EarlyStopping",
    "GradientMonitor",
    "LearningRateMonitor",
    "ModelCheckpoint",
    "ModelSummary",
    "ParameterHistograms",
    "ProgressLine",
    "RichProgressBar",
    "ThroughputMonitor",
    "Timer",
]
