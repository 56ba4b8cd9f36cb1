"""ember: an opinionated training-loop framework for PyTorch.

Public API: `Trainer`, `TrainingModule`, `DataModule`, `Callback`,
`seed_everything`. Callbacks live in `ember.callbacks`, loggers in
`ember.loggers`, strategies in `ember.strategies`.
"""

from ember.callbacks.callback import Callback
from ember.modules.datamodule import DataModule
from ember.modules.module import TrainingModule
from ember.seed import seed_everything
from ember.trainer.trainer import Trainer
from ember.version import __version__

__all__ = ["Callback", "DataModule", "Trainer", "TrainingModule", "__version__", "seed_everything"]
