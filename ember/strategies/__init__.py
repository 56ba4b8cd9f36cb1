"""Strategies (device placement, backward, optimizer step, collectives) and precision plugins."""

from ember.strategies.precision import Precision
from ember.strategies.strategy import Strategy

__all__ = ["Precision", "Strategy"]
