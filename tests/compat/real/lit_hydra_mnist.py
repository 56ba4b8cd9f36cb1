"""A classifier configured the Hydra way: the network and partially applied optimizer and scheduler passed in.

Follows the idioms of ashleve/lightning-hydra-template, src/models/mnist_module.py, src/data/mnist_datamodule.py
and src/train.py: ``save_hyperparameters(logger=False)`` over a ``torch.nn.Module`` and ``functools.partial``
arguments, ``MeanMetric`` / ``MaxMetric`` / ``Accuracy`` objects logged with ``on_step=False, on_epoch=True``,
``on_train_start`` resetting the validation metrics, the best accuracy logged from ``on_validation_epoch_end``
with ``sync_dist=True``, ``configure_optimizers`` calling the partials on ``self.trainer.model.parameters()``
and returning a scheduler dict with ``monitor``, ``interval`` and ``frequency``; a DataModule that saves its
own hyperparameters, sizes its batch by ``self.trainer.world_size`` in ``setup`` and splits with a seeded
generator; a CSV logger, hyperparameters sent to ``trainer.loggers`` before ``fit``, a checkpoint callback with
a custom ``filename`` and ``auto_insert_metric_name=False``, and the test on
``trainer.checkpoint_callback.best_model_path``. Synthetic 8x8 digits stand in for MNIST.
"""

from __future__ import annotations

from functools import partial
from typing import Any

import torch
from lightning import LightningDataModule, LightningModule, Trainer, seed_everything
from lightning.pytorch.callbacks import EarlyStopping, ModelCheckpoint
from lightning.pytorch.loggers import CSVLogger
from torch.utils.data import ConcatDataset, DataLoader, Dataset, TensorDataset, random_split
from torchmetrics import MaxMetric, MeanMetric
from torchmetrics.classification.accuracy import Accuracy


class SimpleDenseNet(torch.nn.Module):
    def __init__(self, input_size: int = 64, lin1_size: int = 32, lin2_size: int = 32, output_size: int = 10):
        super().__init__()
        self.model = torch.nn.Sequential(
            torch.nn.Linear(input_size, lin1_size),
            torch.nn.BatchNorm1d(lin1_size),
            torch.nn.ReLU(),
            torch.nn.Linear(lin1_size, lin2_size),
            torch.nn.BatchNorm1d(lin2_size),
            torch.nn.ReLU(),
            torch.nn.Linear(lin2_size, output_size),
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.model(x.view(x.size(0), -1))


class MNISTLitModule(LightningModule):
    def __init__(
        self,
        net: torch.nn.Module,
        optimizer: torch.optim.Optimizer,
        scheduler: torch.optim.lr_scheduler,
        compile: bool,
    ) -> None:
        super().__init__()
        self.save_hyperparameters(logger=False)
        self.net = net
        self.criterion = torch.nn.CrossEntropyLoss()
        self.train_acc = Accuracy(task="multiclass", num_classes=10)
        self.val_acc = Accuracy(task="multiclass", num_classes=10)
        self.test_acc = Accuracy(task="multiclass", num_classes=10)
        self.train_loss = MeanMetric()
        self.val_loss = MeanMetric()
        self.test_loss = MeanMetric()
        self.val_acc_best = MaxMetric()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.net(x)

    def on_train_start(self) -> None:
        # the sanity check ran the validation metrics already: start them afresh
        for metric in (self.val_loss, self.val_acc, self.val_acc_best):
            metric.reset()

    def model_step(self, batch: tuple[torch.Tensor, torch.Tensor]):
        inputs, labels = batch
        logits = self(inputs)
        return self.criterion(logits, labels), logits.argmax(dim=1), labels

    def _track(self, stage: str, batch) -> torch.Tensor:
        loss, preds, targets = self.model_step(batch)
        mean, accuracy = getattr(self, f"{stage}_loss"), getattr(self, f"{stage}_acc")
        mean(loss)
        accuracy(preds, targets)
        self.log(f"{stage}/loss", mean, on_step=False, on_epoch=True, prog_bar=True)
        self.log(f"{stage}/acc", accuracy, on_step=False, on_epoch=True, prog_bar=True)
        return loss

    def training_step(self, batch, batch_idx: int) -> torch.Tensor:
        return self._track("train", batch)

    def validation_step(self, batch, batch_idx: int) -> None:
        self._track("val", batch)

    def on_validation_epoch_end(self) -> None:
        self.val_acc_best(self.val_acc.compute())  # the best accuracy of any epoch so far
        self.log("val/acc_best", self.val_acc_best.compute(), sync_dist=True, prog_bar=True)

    def test_step(self, batch, batch_idx: int) -> None:
        self._track("test", batch)

    def setup(self, stage: str) -> None:
        if stage == "fit" and self.hparams.compile:
            self.net = torch.compile(self.net)

    def configure_optimizers(self) -> dict[str, Any]:
        optimizer = self.hparams.optimizer(params=self.trainer.model.parameters())
        config: dict[str, Any] = {"optimizer": optimizer}
        if self.hparams.scheduler is not None:
            schedule = {"scheduler": self.hparams.scheduler(optimizer=optimizer), "interval": "epoch", "frequency": 1}
            config["lr_scheduler"] = {**schedule, "monitor": "val/loss"}
        return config


class MNISTDataModule(LightningDataModule):
    def __init__(
        self,
        data_dir: str = "data/",
        train_val_test_split: tuple[int, int, int] = (96, 32, 32),
        batch_size: int = 32,
        num_workers: int = 0,
        pin_memory: bool = False,
    ) -> None:
        super().__init__()
        self.save_hyperparameters(logger=False)
        self.data_train: Dataset | None = None
        self.data_val: Dataset | None = None
        self.data_test: Dataset | None = None
        self.batch_size_per_device = batch_size

    @property
    def num_classes(self) -> int:
        return 10

    def prepare_data(self) -> None:
        pass  # the download would go here

    def setup(self, stage: str | None = None) -> None:
        if self.trainer is not None:  # each process loads its share of the batch
            processes = self.trainer.world_size
            if self.hparams.batch_size % processes:
                raise RuntimeError(f"batch size {self.hparams.batch_size} does not split over {processes} devices")
            self.batch_size_per_device = self.hparams.batch_size // processes
        if self.data_train is None and self.data_val is None and self.data_test is None:  # once, for all stages
            pool = ConcatDataset([_digits(128, seed=0), _digits(32, seed=1)])
            split = torch.Generator().manual_seed(42)
            self.data_train, self.data_val, self.data_test = random_split(
                pool, self.hparams.train_val_test_split, generator=split
            )

    def train_dataloader(self) -> DataLoader[Any]:
        return DataLoader(self.data_train, batch_size=self.batch_size_per_device, shuffle=True)

    def val_dataloader(self) -> DataLoader[Any]:
        return DataLoader(self.data_val, batch_size=self.batch_size_per_device, shuffle=False)

    def test_dataloader(self) -> DataLoader[Any]:
        return DataLoader(self.data_test, batch_size=self.batch_size_per_device, shuffle=False)


def _digits(n: int, seed: int) -> TensorDataset:
    g = torch.Generator().manual_seed(seed)
    centers = torch.randn(10, 1, 8, 8, generator=torch.Generator().manual_seed(5))
    y = torch.randint(0, 10, (n,), generator=g)
    return TensorDataset(centers[y] + 0.9 * torch.randn(n, 1, 8, 8, generator=g), y)


def log_hyperparameters(object_dict: dict[str, Any]) -> bool:
    """Send the model's and data's settings to every logger (what the template's logging utility does)."""
    trainer, model, datamodule = object_dict["trainer"], object_dict["model"], object_dict["datamodule"]
    if not trainer.logger:
        return False
    hparams = {
        "model/params/total": sum(p.numel() for p in model.parameters()),
        "model/params/trainable": sum(p.numel() for p in model.parameters() if p.requires_grad),
        "data/batch_size": datamodule.hparams.batch_size,
    }
    for logger in trainer.loggers:
        logger.log_hyperparams(hparams)
    return True


def main(root_dir: str, callbacks=(), **trainer_options):
    seed_everything(12345, workers=True)
    datamodule = MNISTDataModule(data_dir=f"{root_dir}/data")
    model = MNISTLitModule(
        net=SimpleDenseNet(),
        optimizer=partial(torch.optim.Adam, lr=0.002, weight_decay=0.0),
        scheduler=partial(torch.optim.lr_scheduler.ReduceLROnPlateau, mode="min", factor=0.1, patience=0),
        compile=False,
    )
    checkpoint = ModelCheckpoint(
        dirpath=f"{root_dir}/checkpoints",
        filename="epoch_{epoch:03d}",
        monitor="val/acc",
        mode="max",
        save_last=True,
        auto_insert_metric_name=False,
    )
    trainer = Trainer(
        max_epochs=3,
        accelerator="cpu",
        devices=1,
        default_root_dir=root_dir,
        logger=[CSVLogger(save_dir=root_dir, name="csv/", prefix="")],
        callbacks=[checkpoint, EarlyStopping(monitor="val/acc", patience=100, mode="max"), *callbacks],
        **trainer_options,
    )
    logged = log_hyperparameters({"trainer": trainer, "model": model, "datamodule": datamodule})
    trainer.fit(model=model, datamodule=datamodule)
    train_metrics = dict(trainer.callback_metrics)
    trainer.test(
        model=model,
        datamodule=datamodule,
        ckpt_path=trainer.checkpoint_callback.best_model_path,
        weights_only=False,
    )
    metric_dict = {**train_metrics, **trainer.callback_metrics}
    return {"trainer": trainer, "model": model, "test": [metric_dict], "extra": {"hyperparameters_logged": logged}}
