"""Transfer learning with milestones: a frozen feature extractor unfrozen in two steps by a BaseFinetuning callback.

Follows the idioms of Lightning-AI/pytorch-lightning, examples/pytorch/domain_templates/computer_vision_fine_tuning.py:
a ``BaseFinetuning`` subclass (``freeze_before_training``, ``finetune_function``,
``unfreeze_and_add_param_group``), a ``LightningDataModule`` whose ``prepare_data`` puts the data on disk and
whose loaders come from one private ``__dataloader(train)``, a binary torchmetrics ``Accuracy``,
``rank_zero_info`` in ``configure_optimizers``, and ``MultiStepLR`` returned as ``[optimizer], [scheduler]``.
A tiny convolutional stack stands in for the pretrained ResNet; 2-class 3x16x16 tensors written to disk stand
in for the cats-and-dogs download.
"""

from __future__ import annotations

import logging
from pathlib import Path

import torch
import torch.nn.functional as F
from lightning.pytorch import LightningDataModule, LightningModule, Trainer, seed_everything
from lightning.pytorch.callbacks.finetuning import BaseFinetuning
from lightning.pytorch.utilities import rank_zero_info
from torch import nn, optim
from torch.optim.lr_scheduler import MultiStepLR
from torch.optim.optimizer import Optimizer
from torch.utils.data import DataLoader, TensorDataset
from torchmetrics import Accuracy

log = logging.getLogger(__name__)


class MilestonesFinetuning(BaseFinetuning):
    """Frozen extractor first; its last block joins the optimizer at the first milestone, the rest at the second."""

    def __init__(self, milestones: tuple = (1, 2), train_bn: bool = False):
        super().__init__()
        self.milestones = milestones
        self.train_bn = train_bn

    def freeze_before_training(self, pl_module: LightningModule):
        self.freeze(modules=pl_module.feature_extractor, train_bn=self.train_bn)

    def finetune_function(self, pl_module: LightningModule, epoch: int, optimizer: Optimizer):
        blocks = {self.milestones[0]: slice(-3, None), self.milestones[1]: slice(None, -3)}
        if epoch in blocks:
            layers = pl_module.feature_extractor[blocks[epoch]]
            self.unfreeze_and_add_param_group(modules=layers, optimizer=optimizer, train_bn=self.train_bn)


class TwoClassImageDataModule(LightningDataModule):
    def __init__(self, dl_path: str | Path = "data", num_workers: int = 0, batch_size: int = 8):
        super().__init__()
        self._dl_path = Path(dl_path)
        self._num_workers = num_workers
        self._batch_size = batch_size

    @property
    def data_path(self) -> Path:
        return self._dl_path / "two_class"

    def prepare_data(self):
        """Write the images once, as a download would."""
        if (self.data_path / "train.pt").exists():
            return
        self.data_path.mkdir(parents=True, exist_ok=True)
        g = torch.Generator().manual_seed(3)
        for split, n in (("train", 48), ("validation", 16)):
            labels = torch.randint(0, 2, (n,), generator=g)
            images = torch.randn(n, 3, 16, 16, generator=g) * 0.5
            images[labels == 1, 0] += 1.0  # class 1 is redder
            torch.save({"images": images, "labels": labels}, self.data_path / f"{split}.pt")

    def setup(self, stage: str):
        self.datasets = {}
        for split in ("train", "validation"):
            blob = torch.load(self.data_path / f"{split}.pt")
            self.datasets[split] = TensorDataset(blob["images"], blob["labels"])

    def __dataloader(self, train: bool):
        dataset = self.datasets["train" if train else "validation"]
        return DataLoader(dataset=dataset, batch_size=self._batch_size, num_workers=self._num_workers, shuffle=train)

    def train_dataloader(self):
        log.info("Training data loaded.")
        return self.__dataloader(train=True)

    def val_dataloader(self):
        log.info("Validation data loaded.")
        return self.__dataloader(train=False)


class TransferLearningModel(LightningModule):
    def __init__(
        self,
        train_bn: bool = False,
        milestones: tuple = (1, 2),
        batch_size: int = 8,
        lr: float = 1e-2,
        lr_scheduler_gamma: float = 1e-1,
        num_workers: int = 0,
        **kwargs,
    ) -> None:
        super().__init__()
        self.train_bn = train_bn
        self.milestones = milestones
        self.batch_size = batch_size
        self.lr = lr
        self.lr_scheduler_gamma = lr_scheduler_gamma
        self.num_workers = num_workers
        self.__build_model()
        self.train_acc = Accuracy(task="binary")
        self.valid_acc = Accuracy(task="binary")
        self.save_hyperparameters()

    def __build_model(self):
        self.feature_extractor = nn.Sequential(
            nn.Conv2d(3, 8, 3, padding=1),
            nn.BatchNorm2d(8),
            nn.ReLU(),
            nn.Conv2d(8, 8, 3, stride=2, padding=1),
            nn.BatchNorm2d(8),
            nn.ReLU(),
            nn.AdaptiveAvgPool2d(1),
        )
        self.fc = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 1))
        self.loss_func = F.binary_cross_entropy_with_logits

    def forward(self, x):
        x = self.feature_extractor(x)
        return self.fc(x.flatten(1))

    def loss(self, logits, labels):
        return self.loss_func(input=logits, target=labels)

    def _logits_and_targets(self, batch):
        images, labels = batch
        return self(images), labels.float().unsqueeze(1)

    def training_step(self, batch, batch_idx):
        logits, targets = self._logits_and_targets(batch)
        self.log("train_acc", self.train_acc(logits.sigmoid(), targets.int()), prog_bar=True)
        return self.loss(logits, targets)

    def validation_step(self, batch, batch_idx):
        logits, targets = self._logits_and_targets(batch)
        self.log("val_loss", self.loss(logits, targets), prog_bar=True)
        self.log("val_acc", self.valid_acc(logits.sigmoid(), targets.int()), prog_bar=True)

    def configure_optimizers(self):
        trainable = [p for p in self.parameters() if p.requires_grad]
        rank_zero_info(f"Training starts with {len(trainable)} of {len(list(self.parameters()))} parameter tensors.")
        optimizer = optim.Adam(trainable, lr=self.lr)
        return [optimizer], [MultiStepLR(optimizer, milestones=self.milestones, gamma=self.lr_scheduler_gamma)]


def main(root_dir: str, callbacks=(), **trainer_options):
    seed_everything(1234)
    dm = TwoClassImageDataModule(dl_path=Path(root_dir) / "data", batch_size=8)
    model = TransferLearningModel(milestones=(1, 2))
    trainer = Trainer(
        max_epochs=3,
        accelerator="cpu",
        devices=1,
        default_root_dir=root_dir,
        logger=False,
        enable_checkpointing=False,
        num_sanity_val_steps=0,
        callbacks=[MilestonesFinetuning(milestones=(1, 2)), *callbacks],
        **trainer_options,
    )
    trainer.fit(model, datamodule=dm)
    return {"trainer": trainer, "model": model}
