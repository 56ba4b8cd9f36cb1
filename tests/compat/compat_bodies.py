"""Module bodies written once, in Lightning's idiom, as mixins.

Each body is combined with ``lightning.LightningModule`` and with ``ember.TrainingModule``
(`compat_harness.build`); nothing in a body knows which framework runs it. Every body records the loss of
each training step (each evaluation of the closure, for LBFGS) in ``step_losses``. The data is fixed tensors in
unshuffled loaders, so both frameworks see the same batches in the same order.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch
import torchmetrics
from torch import nn
from torch.nn import functional as F
from torch.utils.data import DataLoader, TensorDataset


def regression_data(n: int, seed: int) -> TensorDataset:
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, 6, generator=g)
    y = x @ torch.randn(6, 1, generator=g) + 0.1 * torch.randn(n, 1, generator=g)
    return TensorDataset(x, y)


def classification_data(n: int, seed: int) -> TensorDataset:
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, 8, generator=g)
    y = (x[:, :3].argmax(dim=1) + (x[:, 3] > 1.5).long()) % 3
    return TensorDataset(x, y)


def loader(dataset: TensorDataset, batch_size: int) -> DataLoader:
    return DataLoader(dataset, batch_size=batch_size, shuffle=False)


class Regression:
    """What several bodies share: a small MLP regressor, its step loss recorded and logged per step and epoch."""

    def __init__(self) -> None:
        super().__init__()
        self.net = nn.Sequential(nn.Linear(6, 16), nn.Tanh(), nn.Linear(16, 1))
        self.step_losses: list[torch.Tensor] = []

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.net(x)

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        x, y = batch
        loss = F.mse_loss(self(x), y)
        self.log("train/loss", loss, prog_bar=True, on_step=True, on_epoch=True)
        self.step_losses.append(loss.detach().clone())
        return loss

    def validation_step(self, batch: Any, batch_idx: int) -> None:
        x, y = batch
        self.log("val/loss", F.mse_loss(self(x), y), prog_bar=True)


class ClassifierBody:
    """A default-style supervised classifier: ``self.log(..., prog_bar=True)`` and a torchmetrics metric."""

    EPOCH_METRICS = ("train/loss_epoch", "val/loss", "val/acc")

    def __init__(self) -> None:
        super().__init__()
        self.model = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 3))
        self.loss_fn = nn.CrossEntropyLoss()
        self.val_acc = torchmetrics.classification.MulticlassAccuracy(num_classes=3, average="micro")
        self.step_losses: list[torch.Tensor] = []

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.model(x)

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        x, y = batch
        loss = self.loss_fn(self(x), y)
        self.log("train/loss", loss, prog_bar=True, on_epoch=True)
        self.step_losses.append(loss.detach().clone())
        return loss

    def validation_step(self, batch: Any, batch_idx: int) -> None:
        x, y = batch
        logits = self(x)
        self.log("val/loss", self.loss_fn(logits, y), prog_bar=True)
        self.val_acc(logits, y)
        self.log("val/acc", self.val_acc, prog_bar=True)

    def configure_optimizers(self) -> Any:
        return torch.optim.Adam(self.parameters(), lr=1e-2)


class GANBody:
    """Two optimizers under manual optimization, with ``toggle_optimizer``. Batches are ``(real, noise)``."""

    EPOCH_METRICS = ("d_loss_epoch", "g_loss_epoch")

    def __init__(self) -> None:
        super().__init__()
        self.automatic_optimization = False
        self.generator = nn.Sequential(nn.Linear(4, 16), nn.ReLU(), nn.Linear(16, 2))
        self.discriminator = nn.Sequential(nn.Linear(2, 16), nn.LeakyReLU(0.2), nn.Linear(16, 1))
        self.step_losses: list[torch.Tensor] = []

    def training_step(self, batch: Any, batch_idx: int) -> None:
        real, z = batch
        opt_g, opt_d = self.optimizers()
        ones, zeros = torch.ones(real.shape[0], 1), torch.zeros(real.shape[0], 1)

        self.toggle_optimizer(opt_d)
        fake = self.generator(z).detach()
        d_loss = F.binary_cross_entropy_with_logits(self.discriminator(real), ones)
        d_loss = d_loss + F.binary_cross_entropy_with_logits(self.discriminator(fake), zeros)
        opt_d.zero_grad()
        self.manual_backward(d_loss)
        opt_d.step()
        self.untoggle_optimizer(opt_d)

        self.toggle_optimizer(opt_g)
        g_loss = F.binary_cross_entropy_with_logits(self.discriminator(self.generator(z)), ones)
        opt_g.zero_grad()
        self.manual_backward(g_loss)
        opt_g.step()
        self.untoggle_optimizer(opt_g)

        self.log_dict({"d_loss": d_loss, "g_loss": g_loss}, prog_bar=True, on_epoch=True)
        self.step_losses += [d_loss.detach().clone(), g_loss.detach().clone()]

    def configure_optimizers(self) -> Any:
        opt_g = torch.optim.Adam(self.generator.parameters(), lr=2e-3, betas=(0.5, 0.999))
        opt_d = torch.optim.Adam(self.discriminator.parameters(), lr=2e-3, betas=(0.5, 0.999))
        return [opt_g, opt_d]


def gan_data(n: int) -> TensorDataset:
    g = torch.Generator().manual_seed(3)
    real = torch.randn(n, 2, generator=g) * torch.tensor([0.5, 2.0]) + torch.tensor([1.0, -1.0])
    return TensorDataset(real, torch.randn(n, 4, generator=g))


class LBFGSBody(Regression):
    """LBFGS under automatic optimization: the trainer builds the closure."""

    EPOCH_METRICS = ("train/loss_epoch", "val/loss")

    def configure_optimizers(self) -> Any:
        return torch.optim.LBFGS(self.parameters(), lr=0.5, max_iter=5, history_size=4)


class PlateauBody(Regression):
    """SGD with ReduceLROnPlateau watching ``val/loss`` through the top-level ``"monitor"`` key."""

    EPOCH_METRICS = ("train/loss_epoch", "val/loss")

    def configure_optimizers(self) -> Any:
        opt = torch.optim.SGD(self.parameters(), lr=0.05, momentum=0.9)
        plateau = torch.optim.lr_scheduler.ReduceLROnPlateau(opt, factor=0.5, patience=0, threshold=0.3)
        return {"optimizer": opt, "lr_scheduler": plateau, "monitor": "val/loss"}


class AccumulateClipBody(Regression):
    """Plain SGD, for a run with ``accumulate_grad_batches`` and ``gradient_clip_val``, and a step-wise scheduler
    given as Lightning's two lists."""

    EPOCH_METRICS = ("train/loss_epoch", "val/loss")

    def configure_optimizers(self) -> Any:
        opt = torch.optim.SGD(self.parameters(), lr=0.2)
        return [opt], [{"scheduler": torch.optim.lr_scheduler.StepLR(opt, step_size=2, gamma=0.7), "interval": "step"}]


class OwnLoadersBody(Regression):
    """A module that brings its own ``train_dataloader()`` and ``val_dataloader()``."""

    EPOCH_METRICS = ("train/loss_epoch", "val/loss")

    def train_dataloader(self) -> DataLoader:
        return loader(regression_data(40, seed=1), batch_size=8)

    def val_dataloader(self) -> DataLoader:
        return loader(regression_data(16, seed=2), batch_size=8)

    def configure_optimizers(self) -> Any:
        return torch.optim.AdamW(self.parameters(), lr=1e-2, weight_decay=0.1)


class FileDataBody:
    """A DataModule (mixed with ``lightning.LightningDataModule`` or ``ember.DataModule``): ``prepare_data``
    writes the data to a file once, ``setup`` reads it. `calls` records the order."""

    def __init__(self, root: Path) -> None:
        super().__init__()
        self.root = root
        self.calls: list[str] = []

    def prepare_data(self) -> None:
        self.calls.append("prepare_data")
        path = self.root / "data.pt"
        if not path.exists():
            train, val = regression_data(48, seed=4), regression_data(16, seed=5)
            torch.save({"train": train.tensors, "val": val.tensors}, path)

    def setup(self, stage: str) -> None:
        self.calls.append("setup:fit" if stage == "fit" else f"setup:{stage}")  # Lightning's stage is a str enum
        tensors = torch.load(self.root / "data.pt", weights_only=True)
        self.train_set, self.val_set = TensorDataset(*tensors["train"]), TensorDataset(*tensors["val"])

    def train_dataloader(self) -> DataLoader:
        return loader(self.train_set, batch_size=12)

    def val_dataloader(self) -> DataLoader:
        return loader(self.val_set, batch_size=8)


class FileDataModuleBody(Regression):
    """The module trained on `FileDataBody`."""

    EPOCH_METRICS = ("train/loss_epoch", "val/loss")

    def configure_optimizers(self) -> Any:
        return torch.optim.SGD(self.parameters(), lr=0.05)
