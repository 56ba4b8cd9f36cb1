"""`DataModule`: the data side of a run, kept apart from the model."""

from __future__ import annotations

import inspect
from typing import TYPE_CHECKING, Any

from ember.modules.data_hooks import DataHooks
from ember.modules.hparams import AttributeDict, init_args_to_record

if TYPE_CHECKING:
    from ember.trainer.trainer import Trainer


class DataModule(DataHooks):
    """Bundles dataset preparation and the dataloaders of every stage.

    Override `prepare_data` to download or write files (once per node, before `setup`), `setup` to build
    datasets (it is called with the stage: "fit", "validate", "test" or "predict") and the ``*_dataloader``
    methods to return DataLoaders (or lists of them for validation/test/predict). A stage
    whose dataloader method is not overridden has no data. The batch-transfer hooks
    (`on_before_batch_transfer`, `transfer_batch_to_device`, `on_after_batch_transfer`) change how a batch
    reaches the device; a DataModule's override wins over the module's. `state_dict` /
    `load_state_dict` carry any state you want in checkpoints. `trainer` is the trainer of the run that uses it
    (None before the first).
    """

    #: Run `prepare_data` on local rank 0 of every node (True) or on global rank 0 only (False).
    prepare_data_per_node: bool = True

    @property
    def trainer(self) -> Trainer | None:
        """The trainer whose fit/validate/test/predict uses this DataModule, from the start of that run on (it
        stays after the run, as in Lightning); None before any run (``if self.trainer is not None:`` in ``setup``
        reads ``self.trainer.world_size``)."""
        trainer: Trainer | None = self.__dict__.get("_trainer")
        return trainer

    @trainer.setter
    def trainer(self, trainer: Trainer | None) -> None:
        """Attach the DataModule to `trainer` (each run that uses it does), as Lightning's ``datamodule.trainer``."""
        self.__dict__["_trainer"] = trainer

    def attach(self, trainer: Trainer) -> None:
        """Called by the trainer when a run that uses this DataModule starts: sets `trainer`."""
        self.trainer = trainer

    @property
    def hparams(self) -> AttributeDict:
        """What `save_hyperparameters` recorded (Lightning's ``self.hparams``: ``self.hparams.batch_size``)."""
        recorded: AttributeDict = self.__dict__.setdefault("_hparams", AttributeDict())
        return recorded

    def save_hyperparameters(self, *names: str, ignore: list[str] | tuple[str, ...] = (), logger: bool = True) -> None:
        """Record the arguments of the calling ``__init__`` in `hparams` (Lightning's call; ``logger`` is
        accepted for ports: a DataModule's hyperparameters are not sent to the loggers)."""
        frame = inspect.currentframe()
        self.hparams.update(init_args_to_record(self, frame.f_back if frame is not None else None, names, ignore))

    def setup(self, stage: str) -> None:
        """Build datasets for `stage` ("fit", "validate", "test" or "predict")."""

    def teardown(self, stage: str) -> None:
        """Release what `setup` built."""

    def train_dataloader(self) -> Any:
        """The training DataLoader."""
        raise NotImplementedError(f"{type(self).__qualname__} does not define train_dataloader()")

    def val_dataloader(self) -> Any:
        """The validation DataLoader, or a list of them."""
        raise NotImplementedError(f"{type(self).__qualname__} does not define val_dataloader()")

    def test_dataloader(self) -> Any:
        """The test DataLoader, or a list of them."""
        raise NotImplementedError(f"{type(self).__qualname__} does not define test_dataloader()")

    def predict_dataloader(self) -> Any:
        """The predict DataLoader, or a list of them."""
        raise NotImplementedError(f"{type(self).__qualname__} does not define predict_dataloader()")

    def state_dict(self) -> dict[str, Any]:
        """State to save in checkpoints (empty by default)."""
        return {}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Restore the state returned by `state_dict`."""

    def has_dataloader(self, stage: str) -> bool:
        """Whether the ``<stage>_dataloader`` method is overridden ("train", "val", "test", "predict")."""
        name = f"{stage}_dataloader"
        return getattr(type(self), name) is not getattr(DataModule, name)
