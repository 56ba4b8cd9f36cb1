"""Linear regression with L1/L2 penalties and an optimizer class as a hyperparameter, fitted twice.

Follows the idioms of Lightning-Universe/lightning-bolts, src/pl_bolts/models/regression/linear_regression.py
(brought to Lightning 2's hooks): ``optimizer: Type[Optimizer] = Adam`` saved by ``save_hyperparameters()`` and
called in ``configure_optimizers``, the penalties read from ``self.hparams``, a ``training_step`` returning a
dict with ``loss`` and ``log``, numpy arrays wrapped as tensors as its ``SklearnDataModule`` does; plus
``ReduceLROnPlateau`` in the scheduler-dict form with ``monitor``, ``interval``, ``frequency`` and ``strict``, a
callback that keeps the best ``trainer.callback_metrics["val_loss"]`` seen in ``on_validation_end``, a second
``fit`` on the same trainer with more data, and ``load_from_checkpoint`` of the best checkpoint. A noisy linear
target on 10 features stands in for scikit-learn's diabetes data.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import torch
from lightning import Callback, LightningModule, Trainer, seed_everything
from lightning.pytorch.callbacks import ModelCheckpoint
from torch import Tensor, nn
from torch.nn import functional as F
from torch.optim import Adam
from torch.optim.optimizer import Optimizer
from torch.utils.data import DataLoader, TensorDataset


class LinearRegression(LightningModule):
    def __init__(
        self,
        input_dim: int,
        output_dim: int = 1,
        bias: bool = True,
        learning_rate: float = 5e-2,
        optimizer: type[Optimizer] = Adam,
        l1_strength: float = 0.0,
        l2_strength: float = 0.0,
        **kwargs: Any,
    ) -> None:
        super().__init__()
        self.save_hyperparameters()
        self.optimizer = optimizer
        self.linear = nn.Linear(in_features=self.hparams.input_dim, out_features=self.hparams.output_dim, bias=bias)

    def forward(self, x: Tensor) -> Tensor:
        return self.linear(x)

    def training_step(self, batch: tuple[Tensor, Tensor], batch_idx: int) -> dict[str, Tensor]:
        inputs, targets = batch
        inputs = inputs.flatten(1)
        squared = F.mse_loss(self(inputs), targets, reduction="sum")
        weight = self.linear.weight
        penalty = self.hparams.l1_strength * weight.abs().sum() + self.hparams.l2_strength * weight.square().sum()
        loss = (squared + penalty) / inputs.size(0)
        self.log("train_mse_loss", loss, prog_bar=True)
        return {"loss": loss, "log": {"train_mse_loss": loss}}

    def validation_step(self, batch: tuple[Tensor, Tensor], batch_idx: int) -> dict[str, Tensor]:
        x, y = batch
        val_loss = F.mse_loss(self(x.view(x.size(0), -1)), y)
        self.log("val_loss", val_loss, prog_bar=True)
        return {"val_loss": val_loss}

    def configure_optimizers(self):
        optimizer = self.optimizer(self.parameters(), lr=self.hparams.learning_rate)
        scheduler = torch.optim.lr_scheduler.ReduceLROnPlateau(optimizer, factor=0.5, patience=0)
        return {
            "optimizer": optimizer,
            "lr_scheduler": {
                "scheduler": scheduler,
                "monitor": "val_loss",
                "interval": "epoch",
                "frequency": 1,
                "strict": True,
            },
        }


class BestMetric(Callback):
    def __init__(self, monitor: str = "val_loss") -> None:
        super().__init__()
        self.monitor = monitor
        self.best: float | None = None

    def on_validation_end(self, trainer: Trainer, pl_module: LightningModule) -> None:
        if trainer.sanity_checking:
            return
        current = float(trainer.callback_metrics[self.monitor])
        if self.best is None or current < self.best:
            self.best = current


def sklearn_like(n: int, seed: int) -> tuple[np.ndarray, np.ndarray]:
    rng = np.random.default_rng(seed)
    x = rng.normal(size=(n, 10))
    w = np.linspace(-1.0, 1.0, 10)
    return x, x @ w + 0.1 * rng.normal(size=n)


def loader(x: np.ndarray, y: np.ndarray, batch_size: int = 16, shuffle: bool = False) -> DataLoader:
    dataset = TensorDataset(torch.from_numpy(x).float(), torch.from_numpy(y).float().unsqueeze(-1))
    return DataLoader(dataset, batch_size=batch_size, shuffle=shuffle)


def main(root_dir: str, callbacks=(), **trainer_options):
    seed_everything(1234)
    model = LinearRegression(input_dim=10, l1_strength=0.01, l2_strength=0.01)
    best_metric = BestMetric()
    checkpoint = ModelCheckpoint(monitor="val_loss")
    trainer = Trainer(
        max_epochs=3,
        accelerator="cpu",
        devices=1,
        default_root_dir=root_dir,
        logger=False,
        num_sanity_val_steps=0,
        callbacks=[best_metric, checkpoint, *callbacks],
        **trainer_options,
    )
    val = loader(*sklearn_like(32, seed=1))
    trainer.fit(model, train_dataloaders=loader(*sklearn_like(48, seed=0)), val_dataloaders=val)
    # a second round on more data, same trainer
    trainer.fit(model, train_dataloaders=loader(*sklearn_like(96, seed=2)), val_dataloaders=val)
    best = LinearRegression.load_from_checkpoint(checkpoint.best_model_path, weights_only=False)
    return {"trainer": trainer, "model": model, "reloaded": best, "extra": {"best_val_loss": best_metric.best}}
