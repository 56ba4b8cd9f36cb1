"""Callbacks: the `Callback` base with every hook, and the built-in callbacks."""

from ember.callbacks.callback import Callback
from ember.callbacks.model_summary import ModelSummary
from ember.callbacks.progress import ProgressLine

__all__ = ["Callback", "ModelSummary", "ProgressLine"]
