"""The trainer: options, loops, one optimizer step, data handling and run state."""

from ember.trainer.trainer import Trainer

__all__ = ["Trainer"]
