"""What a user subclasses: `TrainingModule` and `DataModule`, plus `self.log` support, and `LightningOptimizer`
(Lightning's name for what ``self.optimizers()`` returns under manual optimization)."""

from ember.modules.datamodule import DataModule
from ember.modules.module import TrainingModule
from ember.modules.optimizers import LightningOptimizer

__all__ = ["DataModule", "LightningOptimizer", "TrainingModule"]
