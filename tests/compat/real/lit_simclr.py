"""Contrastive pretraining (SimCLR) with a warmup-cosine schedule stepped every batch.

Follows the idioms of Lightning-Universe/lightning-bolts, src/pl_bolts/models/self_supervised/simclr/simclr_module.py:
two augmented views per sample drawn in the dataset, a projection head with ``BatchNorm1d``, the NT-Xent loss,
parameter groups that exclude biases and norms from weight decay, ``LambdaLR`` with a linear-warmup cosine
factor returned as ``[optimizer], [{"scheduler": ..., "interval": "step", "frequency": 1}]``,
``self.log("train_loss", loss, on_step=True, on_epoch=False)`` and ``self.log("val_loss", ..., on_epoch=True,
sync_dist=True)``, and ``ModelCheckpoint(save_last=True, save_top_k=1, monitor="val_loss")`` with
``LearningRateMonitor(logging_interval="step")``. Iterations per epoch are computed from the sample count in
``__init__`` as there. A small CNN on 3x8x8 tensors stands in for ResNet on CIFAR-10.
"""

from __future__ import annotations

import math

import torch
from lightning import LightningModule, Trainer, seed_everything
from lightning.pytorch.callbacks import LearningRateMonitor, ModelCheckpoint
from lightning.pytorch.loggers import CSVLogger
from torch import Tensor, nn
from torch.nn import functional as F
from torch.utils.data import DataLoader, Dataset


class TwoViews(Dataset):
    """Each item is two noisy, randomly flipped views of one image, with its (unused) label."""

    def __init__(self, n: int, seed: int):
        g = torch.Generator().manual_seed(seed)
        self.images = torch.rand(n, 3, 8, 8, generator=g)
        self.labels = torch.randint(0, 4, (n,), generator=g)

    def __len__(self):
        return len(self.images)

    def _view(self, image: Tensor) -> Tensor:
        if torch.rand(()) < 0.5:
            image = image.flip(-1)
        return image + 0.1 * torch.randn_like(image)

    def __getitem__(self, index):
        image = self.images[index]
        return (self._view(image), self._view(image)), self.labels[index]


def linear_warmup_decay(warmup_steps: int, total_steps: int, cosine: bool = True):
    def fn(step: int) -> float:
        if step < warmup_steps:
            return float(step + 1) / float(max(1, warmup_steps))
        progress = float(step - warmup_steps) / float(max(1, total_steps - warmup_steps))
        return 0.5 * (1.0 + math.cos(math.pi * min(progress, 1.0))) if cosine else 1.0 - progress

    return fn


class Projection(nn.Module):
    def __init__(self, input_dim=16, hidden_dim=16, output_dim=8) -> None:
        super().__init__()
        self.model = nn.Sequential(
            nn.Linear(input_dim, hidden_dim),
            nn.BatchNorm1d(hidden_dim),
            nn.ReLU(),
            nn.Linear(hidden_dim, output_dim, bias=False),
        )

    def forward(self, x):
        return F.normalize(self.model(x), dim=1)


class SimCLR(LightningModule):
    def __init__(
        self,
        num_samples: int,
        batch_size: int,
        hidden_mlp: int = 16,
        feat_dim: int = 8,
        warmup_epochs: int = 1,
        max_epochs: int = 3,
        temperature: float = 0.5,
        exclude_bn_bias: bool = True,
        learning_rate: float = 1e-2,
        weight_decay: float = 1e-6,
        **kwargs,
    ) -> None:
        super().__init__()
        self.save_hyperparameters()
        self.num_samples = num_samples
        self.batch_size = batch_size
        self.hidden_mlp = hidden_mlp
        self.feat_dim = feat_dim
        self.exclude_bn_bias = exclude_bn_bias
        self.weight_decay = weight_decay
        self.temperature = temperature
        self.learning_rate = learning_rate
        self.warmup_epochs = warmup_epochs
        self.max_epochs = max_epochs
        self.encoder = nn.Sequential(
            nn.Conv2d(3, 8, 3, padding=1), nn.BatchNorm2d(8), nn.ReLU(), nn.AdaptiveAvgPool2d(2), nn.Flatten()
        )
        self.projection = Projection(input_dim=32, hidden_dim=self.hidden_mlp, output_dim=self.feat_dim)
        self.train_iters_per_epoch = self.num_samples // self.batch_size

    def forward(self, x):
        return self.encoder(x)

    def shared_step(self, batch):
        (img1, img2), _ = batch
        z1 = self.projection(self(img1))
        z2 = self.projection(self(img2))
        return self.nt_xent_loss(z1, z2, self.temperature)

    def training_step(self, batch, batch_idx):
        loss = self.shared_step(batch)
        self.log("train_loss", loss, on_step=True, on_epoch=False)
        return loss

    def validation_step(self, batch, batch_idx):
        loss = self.shared_step(batch)
        self.log("val_loss", loss, on_step=False, on_epoch=True, sync_dist=True)
        return loss

    def exclude_from_wt_decay(self, named_params, weight_decay, skip_list=("bias", "bn")):
        """Two parameter groups: decayed weights, and biases and norm parameters without decay."""
        groups = {True: [], False: []}
        for name, param in named_params:
            if param.requires_grad:
                skip = param.ndim == 1 or any(part in name for part in skip_list)
                groups[skip].append(param)
        return [{"params": groups[False], "weight_decay": weight_decay}, {"params": groups[True], "weight_decay": 0.0}]

    def configure_optimizers(self):
        if self.exclude_bn_bias:
            params = self.exclude_from_wt_decay(self.named_parameters(), weight_decay=self.weight_decay)
        else:
            params = self.parameters()
        optimizer = torch.optim.Adam(params, lr=self.learning_rate, weight_decay=self.weight_decay)
        warmup_steps = self.train_iters_per_epoch * self.warmup_epochs
        total_steps = self.train_iters_per_epoch * self.max_epochs
        scheduler = {
            "scheduler": torch.optim.lr_scheduler.LambdaLR(
                optimizer, linear_warmup_decay(warmup_steps, total_steps, cosine=True)
            ),
            "interval": "step",
            "frequency": 1,
        }
        return [optimizer], [scheduler]

    def nt_xent_loss(self, out_1, out_2, temperature):
        """NT-Xent: each embedding's partner view is its positive among all 2N - 1 others (cosine similarities
        over `temperature`, a softmax cross-entropy per row)."""
        z = torch.cat([out_1, out_2])
        logits = z @ z.t() / temperature
        logits.fill_diagonal_(float("-inf"))  # an embedding is not its own candidate
        n = out_1.size(0)
        partner = torch.cat([torch.arange(n, 2 * n), torch.arange(0, n)]).to(z.device)
        return F.cross_entropy(logits, partner)


def main(root_dir: str, callbacks=(), **trainer_options):
    seed_everything(1234)
    train, val = TwoViews(64, seed=0), TwoViews(16, seed=1)
    model = SimCLR(num_samples=len(train), batch_size=16, max_epochs=3)
    lr_monitor = LearningRateMonitor(logging_interval="step")
    model_checkpoint = ModelCheckpoint(save_last=True, save_top_k=1, monitor="val_loss")
    trainer = Trainer(
        max_epochs=3,
        accelerator="cpu",
        devices=1,
        default_root_dir=root_dir,
        logger=CSVLogger(root_dir),
        log_every_n_steps=1,
        callbacks=[model_checkpoint, lr_monitor, *callbacks],
        **trainer_options,
    )
    trainer.fit(
        model,
        DataLoader(train, batch_size=16, shuffle=True, drop_last=True),
        DataLoader(val, batch_size=16),
    )
    best = SimCLR.load_from_checkpoint(model_checkpoint.best_model_path)
    return {"trainer": trainer, "model": model, "reloaded": best}
