"""Hello world: an MLP on scikit-learn's bundled 8x8 digits (no download).

Run it with ``python -m examples.digits``; it reaches about 97% validation
accuracy on a laptop CPU in a few seconds.
"""

from __future__ import annotations

import torch
import torchmetrics
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

import ember


class Classifier(ember.TrainingModule):
    """A two-layer MLP; the default steps train it from ``model``, ``loss_fn`` and ``metrics``."""

    def __init__(self, lr: float = 3e-3, hidden: int = 128, epochs: int = 20) -> None:
        super().__init__()
        self.save_hyperparameters()
        self.model = nn.Sequential(nn.Flatten(), nn.Linear(64, hidden), nn.ReLU(), nn.Linear(hidden, 10))
        self.loss_fn = nn.CrossEntropyLoss()
        self.metrics = {"acc": torchmetrics.Accuracy(task="multiclass", num_classes=10)}

    def configure_optimizers(self) -> dict[str, object]:
        opt = torch.optim.AdamW(self.parameters(), lr=self.hparams.lr)
        sched = torch.optim.lr_scheduler.CosineAnnealingLR(opt, T_max=self.hparams.epochs)
        return {"optimizer": opt, "lr_scheduler": sched}


class DigitsData(ember.DataModule):
    """The 1,797 digits images, scaled to [0, 1], split 80/20 with a fixed seed."""

    def __init__(self, batch_size: int = 64, val_fraction: float = 0.2, seed: int = 0) -> None:
        self.batch_size = batch_size
        self.val_fraction = val_fraction
        self.seed = seed

    def setup(self, stage: str) -> None:
        from sklearn.datasets import load_digits

        images, labels = load_digits(return_X_y=True)
        x = torch.tensor(images, dtype=torch.float32) / 16.0
        y = torch.tensor(labels, dtype=torch.long)
        order = torch.randperm(len(x), generator=torch.Generator().manual_seed(self.seed))
        n_val = int(len(x) * self.val_fraction)
        val, train = order[:n_val], order[n_val:]
        self.train_set = TensorDataset(x[train], y[train])
        self.val_set = TensorDataset(x[val], y[val])

    def train_dataloader(self) -> DataLoader:
        generator = torch.Generator().manual_seed(self.seed)
        return DataLoader(self.train_set, batch_size=self.batch_size, shuffle=True, generator=generator)

    def val_dataloader(self) -> DataLoader:
        return DataLoader(self.val_set, batch_size=256)

    def test_dataloader(self) -> DataLoader:
        return self.val_dataloader()

    def predict_dataloader(self) -> DataLoader:
        return self.val_dataloader()  # predict_step takes the images of each (images, labels) batch


def main() -> None:
    ember.seed_everything(42)
    trainer = ember.Trainer(max_epochs=20)
    trainer.fit(Classifier(epochs=20), datamodule=DigitsData())
    print(f"val/acc {trainer.callback_metrics['val/acc']:.4f}")


if __name__ == "__main__":
    main()
