"""An autoencoder with a sample-writing callback, then test and predict on the best checkpoint.

Follows the idioms of Lightning-AI/pytorch-lightning, examples/pytorch/basics/autoencoder.py: a
``callbacks.Callback`` subclass reached through ``from lightning.pytorch import callbacks`` whose
``on_train_epoch_end`` is decorated with ``@rank_zero_only`` and reads ``trainer.datamodule``,
``trainer.current_epoch`` and ``pl_module.device``; one ``_common_step`` for train, validation and test logging
``f"{stage}_loss"`` with ``on_step=True``; ``predict_step(batch, batch_idx, dataloader_idx=None)``; a
``LightningDataModule`` that splits its data in ``__init__`` with ``random_split`` and a seeded generator; and,
after ``fit``, ``trainer.test(ckpt_path="best", datamodule=...)`` and ``trainer.predict(ckpt_path="best", ...)``
with no module. Random 8x8 "digits" stand in for MNIST; the samples are saved with ``torch.save``.
"""

from __future__ import annotations

from pathlib import Path

import torch
import torch.nn.functional as F
from lightning.pytorch import LightningDataModule, LightningModule, Trainer, callbacks, seed_everything
from lightning.pytorch.utilities import rank_zero_only
from torch import nn
from torch.utils.data import DataLoader, TensorDataset, random_split

SIDE = 8


def digits(n: int, seed: int) -> TensorDataset:
    """Strokes on an 8x8 grid: one row and one column lit per image, labels the row index."""
    g = torch.Generator().manual_seed(seed)
    rows, cols = torch.randint(0, SIDE, (n,), generator=g), torch.randint(0, SIDE, (n,), generator=g)
    images = 0.1 * torch.rand(n, 1, SIDE, SIDE, generator=g)
    images[torch.arange(n), 0, rows, :] = 1.0
    images[torch.arange(n), 0, :, cols] = 1.0
    return TensorDataset(images, rows)


class ImageSampler(callbacks.Callback):
    def __init__(self, num_samples: int = 3, out_dir: str | None = None) -> None:
        super().__init__()
        self.num_samples = num_samples
        self.out_dir = out_dir

    @rank_zero_only
    def on_train_epoch_end(self, trainer: Trainer, pl_module: LightningModule) -> None:
        images, _ = next(iter(DataLoader(trainer.datamodule.digits_val, batch_size=self.num_samples)))
        images_flattened = images.view(images.size(0), -1)
        with torch.no_grad():
            pl_module.eval()
            images_generated = pl_module(images_flattened.to(pl_module.device))
            pl_module.train()
        out = Path(self.out_dir or trainer.default_root_dir) / "samples"
        out.mkdir(parents=True, exist_ok=True)
        if trainer.current_epoch == 0:
            torch.save(images, out / f"grid_ori_{trainer.current_epoch}.pt")
        torch.save(images_generated.reshape(images.shape), out / f"grid_generated_{trainer.current_epoch}.pt")


class LitAutoEncoder(LightningModule):
    def __init__(self, hidden_dim: int = 32, learning_rate=1e-2):
        super().__init__()
        self.save_hyperparameters()
        pixels = SIDE * SIDE
        self.encoder = nn.Sequential(nn.Linear(pixels, hidden_dim), nn.ReLU(), nn.Linear(hidden_dim, 3))
        self.decoder = nn.Sequential(nn.Linear(3, hidden_dim), nn.ReLU(), nn.Linear(hidden_dim, pixels))

    def forward(self, x):
        return self.decoder(self.encoder(x))

    def training_step(self, batch, batch_idx):
        return self._common_step(batch, batch_idx, "train")

    def validation_step(self, batch, batch_idx):
        self._common_step(batch, batch_idx, "val")

    def test_step(self, batch, batch_idx):
        self._common_step(batch, batch_idx, "test")

    def predict_step(self, batch, batch_idx, dataloader_idx=None):
        return self(self._flat(batch))

    def configure_optimizers(self):
        return torch.optim.Adam(self.parameters(), lr=self.hparams.learning_rate)

    @staticmethod
    def _flat(batch):
        images = batch[0]
        return images.flatten(start_dim=1)

    def _common_step(self, batch, batch_idx, stage: str):
        flat = self._flat(batch)
        reconstruction_error = F.mse_loss(flat, self(flat))
        self.log(f"{stage}_loss", reconstruction_error, on_step=True)
        return reconstruction_error


class MyDataModule(LightningDataModule):
    def __init__(self, batch_size: int = 16):
        super().__init__()
        dataset = digits(96, seed=0)
        self.digits_test = digits(32, seed=1)
        self.digits_train, self.digits_val = random_split(
            dataset, [64, 32], generator=torch.Generator().manual_seed(42)
        )
        self.batch_size = batch_size

    def train_dataloader(self):
        return DataLoader(self.digits_train, batch_size=self.batch_size)

    def val_dataloader(self):
        return DataLoader(self.digits_val, batch_size=self.batch_size)

    def test_dataloader(self):
        return DataLoader(self.digits_test, batch_size=self.batch_size)

    def predict_dataloader(self):
        return DataLoader(self.digits_test, batch_size=self.batch_size)


def main(root_dir: str, callbacks=(), **trainer_options):
    seed_everything(1234)
    model, datamodule = LitAutoEncoder(), MyDataModule()
    trainer = Trainer(
        max_epochs=3,
        accelerator="cpu",
        devices=1,
        default_root_dir=root_dir,
        logger=False,
        callbacks=[ImageSampler(), *callbacks],
        **trainer_options,
    )
    trainer.fit(model, datamodule=datamodule)
    results = trainer.test(ckpt_path="best", datamodule=datamodule)
    predictions = trainer.predict(ckpt_path="best", datamodule=datamodule)
    return {"trainer": trainer, "model": model, "test": results, "predict": predictions}
