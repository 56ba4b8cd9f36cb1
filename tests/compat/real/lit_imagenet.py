"""An image classifier that builds its own datasets in ``setup`` and reports top-1 and top-5 accuracy.

Follows the idioms of Lightning-AI/pytorch-lightning, examples/pytorch/domain_templates/imagenet.py: datasets
made in ``setup(stage)`` after a look at ``self.trainer.strategy`` (``isinstance(..., ParallelStrategy)`` to
split the batch size), module-defined dataloaders, one ``eval_step`` shared by validation and test with a
``prefix``, torchmetrics accuracies logged as objects, SGD with ``LambdaLR`` returned as
``[optimizer], [scheduler]``, ``ModelCheckpoint(monitor="val_acc1", mode="max")``, then the test on the best
checkpoint. A small residual CNN on 10-class 3x12x12 tensors with random flips stands in for ResNet on ImageNet.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
import torch.optim as optim
import torch.optim.lr_scheduler as lr_scheduler
import torch.utils.data
from lightning.pytorch import LightningModule, Trainer, seed_everything
from lightning.pytorch.callbacks import ModelCheckpoint
from lightning.pytorch.strategies import ParallelStrategy
from torch import nn
from torch.utils.data import Dataset
from torchmetrics import Accuracy

NUM_CLASSES = 10


class SyntheticImages(Dataset):
    """Class-dependent colour patterns with noise; `train` adds random horizontal flips."""

    def __init__(self, n: int, seed: int, train: bool):
        g = torch.Generator().manual_seed(seed)
        self.targets = torch.randint(0, NUM_CLASSES, (n,), generator=g)
        prototypes = torch.randn(NUM_CLASSES, 3, 12, 12, generator=torch.Generator().manual_seed(99))
        self.images = prototypes[self.targets] + 0.8 * torch.randn(n, 3, 12, 12, generator=g)
        self.train = train

    def __len__(self):
        return len(self.targets)

    def __getitem__(self, index):
        image = self.images[index]
        if self.train and torch.rand(1).item() < 0.5:
            image = image.flip(-1)
        return image, self.targets[index]


class BasicBlock(nn.Module):
    def __init__(self, channels: int):
        super().__init__()
        self.conv1 = nn.Conv2d(channels, channels, 3, padding=1, bias=False)
        self.bn1 = nn.BatchNorm2d(channels)
        self.conv2 = nn.Conv2d(channels, channels, 3, padding=1, bias=False)
        self.bn2 = nn.BatchNorm2d(channels)

    def forward(self, x):
        out = F.relu(self.bn1(self.conv1(x)))
        return F.relu(x + self.bn2(self.conv2(out)))


def tiny_resnet(num_classes: int = NUM_CLASSES, width: int = 8) -> nn.Module:
    return nn.Sequential(
        nn.Conv2d(3, width, 3, padding=1, bias=False),
        nn.BatchNorm2d(width),
        nn.ReLU(),
        BasicBlock(width),
        nn.AdaptiveAvgPool2d(1),
        nn.Flatten(),
        nn.Linear(width, num_classes),
    )


class ImageNetLightningModel(LightningModule):
    def __init__(
        self,
        data_path: str = "synthetic",
        arch: str = "tiny_resnet",
        lr: float = 0.1,
        momentum: float = 0.9,
        weight_decay: float = 1e-4,
        batch_size: int = 16,
        workers: int = 0,
    ):
        super().__init__()
        self.arch = arch
        self.lr = lr
        self.momentum = momentum
        self.weight_decay = weight_decay
        self.data_path = data_path
        self.batch_size = batch_size
        self.workers = workers
        self.model = tiny_resnet()
        self.train_dataset: Dataset | None = None
        self.eval_dataset: Dataset | None = None
        topk = {f"acc{k}": k for k in (1, 5)}
        self.train_metrics = nn.ModuleDict(
            {name: Accuracy(task="multiclass", num_classes=NUM_CLASSES, top_k=k) for name, k in topk.items()}
        )
        self.eval_metrics = nn.ModuleDict(
            {name: Accuracy(task="multiclass", num_classes=NUM_CLASSES, top_k=k) for name, k in topk.items()}
        )

    def forward(self, x):
        return self.model(x)

    def _shared(self, batch, prefix: str, metrics: nn.ModuleDict, prog_bar_loss: bool = False):
        images, target = batch
        logits = self(images)
        loss = F.cross_entropy(logits, target)
        self.log(f"{prefix}_loss", loss, prog_bar=prog_bar_loss)
        for name, metric in metrics.items():
            metric(logits, target)
            self.log(f"{prefix}_{name}", metric, prog_bar=True)  # the Metric object: reduced at epoch end
        return loss

    def training_step(self, batch, batch_idx):
        return self._shared(batch, "train", self.train_metrics)

    def eval_step(self, batch, batch_idx, prefix: str):
        return self._shared(batch, prefix, self.eval_metrics)

    def validation_step(self, batch, batch_idx):
        return self.eval_step(batch, batch_idx, "val")

    def test_step(self, batch, batch_idx):
        return self.eval_step(batch, batch_idx, "test")

    def configure_optimizers(self):
        optimizer = optim.SGD(self.parameters(), lr=self.lr, momentum=self.momentum, weight_decay=self.weight_decay)
        scheduler = lr_scheduler.LambdaLR(optimizer, lambda epoch: 0.5**epoch)
        return [optimizer], [scheduler]

    def setup(self, stage: str):
        strategy = self.trainer.strategy
        if isinstance(strategy, ParallelStrategy):  # per-process share of the batch and the workers
            share = max(1, strategy.num_processes)
            self.batch_size, self.workers = self.batch_size // share, self.workers // share
        if stage == "fit":
            self.train_dataset = SyntheticImages(64, seed=0, train=True)
        self.eval_dataset = SyntheticImages(32, seed=1, train=False)

    def train_dataloader(self):
        return torch.utils.data.DataLoader(
            dataset=self.train_dataset, batch_size=self.batch_size, shuffle=True, num_workers=self.workers
        )

    def val_dataloader(self):
        return torch.utils.data.DataLoader(self.eval_dataset, batch_size=self.batch_size, num_workers=self.workers)

    def test_dataloader(self):
        return self.val_dataloader()


def main(root_dir: str, callbacks=(), **trainer_options):
    seed_everything(42)
    model = ImageNetLightningModel()
    trainer = Trainer(
        max_epochs=2,
        accelerator="cpu",
        devices=1,
        default_root_dir=root_dir,
        logger=False,
        callbacks=[ModelCheckpoint(monitor="val_acc1", mode="max"), *callbacks],
        **trainer_options,
    )
    trainer.fit(model)
    results = trainer.test(model, ckpt_path="best")
    return {"trainer": trainer, "model": model, "test": results}
