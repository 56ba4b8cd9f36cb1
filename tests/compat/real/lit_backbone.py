"""A classifier around a backbone passed in (and left out of the saved hyperparameters), stopped early.

Follows the idioms of Lightning-AI/pytorch-lightning, examples/pytorch/basics/backbone_image_classifier.py: a
plain ``torch.nn.Module`` backbone handed to the LightningModule, ``save_hyperparameters(ignore=["backbone"])``,
``self.log("train_loss", loss, on_epoch=True)`` and ``self.log("valid_loss", loss, on_step=True)`` (both
logged per step and per epoch), ``predict_step`` returning logits, then ``EarlyStopping`` and
``ModelCheckpoint`` on the plain name ``"valid_loss"`` and ``load_from_checkpoint`` with the backbone given
again. 28x28 inputs shrunk to 8x8 random class prototypes stand in for MNIST.
"""

from __future__ import annotations

import lightning as L
import torch
from lightning.pytorch.callbacks import EarlyStopping, ModelCheckpoint
from torch.nn import functional as F
from torch.utils.data import DataLoader, TensorDataset


class Backbone(torch.nn.Module):
    """Two linear layers over the flattened image, ReLU after each."""

    def __init__(self, hidden_dim=32):
        super().__init__()
        self.l1 = torch.nn.Linear(8 * 8, hidden_dim)
        self.l2 = torch.nn.Linear(hidden_dim, 10)

    def forward(self, x):
        hidden = torch.relu(self.l1(x.flatten(1)))
        return torch.relu(self.l2(hidden))


class LitClassifier(L.LightningModule):
    def __init__(self, backbone: Backbone | None = None, learning_rate: float = 5e-3):
        super().__init__()
        self.save_hyperparameters(ignore=["backbone"])
        self.backbone = backbone if backbone is not None else Backbone()

    def forward(self, x):
        return self.backbone(x)

    def _loss(self, batch):
        inputs, labels = batch
        return F.cross_entropy(self(inputs), labels)

    def training_step(self, batch, batch_idx):
        loss = self._loss(batch)
        self.log("train_loss", loss, on_epoch=True)
        return loss

    def validation_step(self, batch, batch_idx):
        self.log("valid_loss", self._loss(batch), on_step=True)

    def test_step(self, batch, batch_idx):
        self.log("test_loss", self._loss(batch))

    def predict_step(self, batch, batch_idx, dataloader_idx=None):
        return self(batch[0])

    def configure_optimizers(self):
        return torch.optim.Adam(self.parameters(), lr=self.hparams.learning_rate)


def prototypes(n: int, seed: int) -> TensorDataset:
    g = torch.Generator().manual_seed(seed)
    centers = torch.randn(10, 1, 8, 8, generator=torch.Generator().manual_seed(7))
    y = torch.randint(0, 10, (n,), generator=g)
    return TensorDataset(centers[y] + 0.7 * torch.randn(n, 1, 8, 8, generator=g), y)


def main(root_dir: str, callbacks=(), **trainer_options):
    L.seed_everything(1234)
    train, val, test = prototypes(64, 0), prototypes(32, 1), prototypes(32, 2)
    model = LitClassifier(Backbone(hidden_dim=32))
    checkpoint = ModelCheckpoint(monitor="valid_loss")
    trainer = L.Trainer(
        max_epochs=4,
        accelerator="cpu",
        devices=1,
        default_root_dir=root_dir,
        logger=False,
        callbacks=[EarlyStopping(monitor="valid_loss", patience=1), checkpoint, *callbacks],
        **trainer_options,
    )
    trainer.fit(model, DataLoader(train, batch_size=16), DataLoader(val, batch_size=16))
    results = trainer.test(model, DataLoader(test, batch_size=16))
    best = LitClassifier.load_from_checkpoint(checkpoint.best_model_path, backbone=Backbone(hidden_dim=32))
    predictions = trainer.predict(best, DataLoader(test, batch_size=16))
    return {"trainer": trainer, "model": model, "test": results, "predict": predictions, "reloaded": best}
