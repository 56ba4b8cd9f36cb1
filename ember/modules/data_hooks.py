"""`DataHooks`: the data hooks a `DataModule` and a `TrainingModule` share (Lightning's names). The trainer
takes each from the datamodule when its class overrides it, else from the module."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    import torch


class DataHooks:
    """``prepare_data`` and the three batch-transfer hooks; the defaults do nothing (the strategy moves a batch
    when no ``transfer_batch_to_device`` is overridden)."""

    def prepare_data(self) -> None:
        """Download or write data. Runs once per node (local rank 0; global rank 0 only when the DataModule sets
        ``prepare_data_per_node = False``) before ``setup``, while the other processes wait; do not set state
        here (the other processes would not see it)."""

    def on_before_batch_transfer(self, batch: Any, dataloader_idx: int) -> Any:
        """Change a batch before it is moved to the device (runs on the CPU); return the batch."""
        return batch

    def transfer_batch_to_device(self, batch: Any, device: torch.device, dataloader_idx: int) -> Any:
        """Move a batch to `device`; the default moves every tensor in nested lists, tuples and dicts."""
        from ember.strategies.strategy import move_to_device

        return move_to_device(batch, device)

    def on_after_batch_transfer(self, batch: Any, dataloader_idx: int) -> Any:
        """Change a batch after it reached the device (e.g. GPU augmentation); return the batch."""
        return batch
