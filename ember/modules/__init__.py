"""What a user subclasses: `TrainingModule` and `DataModule`, plus `self.log` support."""

from ember.modules.datamodule import DataModule
from ember.modules.module import TrainingModule

__all__ = ["DataModule", "TrainingModule"]
