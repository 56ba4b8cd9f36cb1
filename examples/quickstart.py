# examples/quickstart.py: the README's quickstart, complete. Run it: python examples/quickstart.py
import torch
import torchmetrics
from sklearn.datasets import load_digits
from torch import nn
from torch.utils.data import DataLoader, TensorDataset, random_split

import ember


class Classifier(ember.TrainingModule):
    def __init__(self, lr: float = 3e-3, hidden: int = 128) -> None:
        super().__init__()
        self.save_hyperparameters()  # -> self.hparams.lr, self.hparams.hidden
        self.model = nn.Sequential(nn.Flatten(), nn.Linear(64, hidden), nn.ReLU(), nn.Linear(hidden, 10))
        self.loss_fn = nn.CrossEntropyLoss()
        self.metrics = {"acc": torchmetrics.Accuracy(task="multiclass", num_classes=10)}

    def configure_optimizers(self) -> dict[str, object]:
        opt = torch.optim.AdamW(self.parameters(), lr=self.hparams.lr)
        return {"optimizer": opt, "lr_scheduler": torch.optim.lr_scheduler.CosineAnnealingLR(opt, 20)}


# 1,797 8x8 digit images bundled with scikit-learn (no download): 64 features in [0, 1] and a label
images, labels = load_digits(return_X_y=True)
dataset = TensorDataset(torch.tensor(images, dtype=torch.float32) / 16, torch.tensor(labels))
train_set, val_set, test_set = random_split(dataset, [0.7, 0.15, 0.15], generator=torch.Generator().manual_seed(0))
train_loader = DataLoader(train_set, batch_size=64, shuffle=True)
val_loader = DataLoader(val_set, batch_size=256)
test_loader = DataLoader(test_set, batch_size=256)
predict_loader = DataLoader(test_set, batch_size=256)  # predict_step takes the inputs of each (x, y) batch

ember.seed_everything(0)
module = Classifier()
trainer = ember.Trainer(max_epochs=20)
trainer.fit(module, train_loader, val_loader)  # or datamodule=...; writes runs/classifier/version_N/
print(trainer.callback_metrics["val/acc"])
trainer.test(module, test_loader)  # -> [{"test/loss": ..., "test/acc": ...}]
predictions = trainer.predict(module, predict_loader)  # list of predict_step outputs: logits per batch
print(torch.cat(predictions).argmax(-1)[:10], "predicted for the first 10 test images")
