"""Transfer learning on digits: pretrain a CNN backbone on 0-4, fine-tune it on a few images of 5-9.

Three runs of the same network (`examples.digits.conv_backbone` plus a linear head):

1. **pretrain** on every training image of digits 0-4; at the end of fit the backbone's weights are
   written to ``save_backbone_to``;
2. **fine-tune** on a small set of digits 5-9 (``train_per_class`` images of each): the backbone is
   loaded from that file and a new head is trained. The `BackboneFinetuning` callback freezes the
   backbone (``requires_grad=False``, eval mode so BatchNorm keeps its statistics) and at epoch
   ``unfreeze_at_epoch`` adds it to the running optimizer at a tenth of the learning rate;
3. **from scratch**: the same network and data, randomly initialised, everything trained from the start.

::

    ember fit -c configs/transfer_pretrain.yaml                                  # writes runs/transfer/backbone.pt
    ember fit -c configs/transfer_finetune.yaml                                  # fine-tune
    ember fit -c configs/transfer_finetune.yaml -c configs/transfer_scratch.yaml # baseline from scratch

Compare the two ``val/acc`` figures (examples/README.md has the measured ones).
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

import torch
from torch import Tensor, nn
from torch.nn import functional as F
from torch.utils.data import DataLoader, Dataset, TensorDataset

import ember
from ember import checkpoint
from ember.seed import sample_generator
from examples.digits import CNNClassifier, load_digit_arrays


class ShiftedImages(Dataset[tuple[Tensor, Tensor]]):
    """(1, 8, 8) images moved by up to `max_shift` pixels each way (zeros fill in), labels unchanged.

    Each sample's shift comes from ``ember.seed.sample_generator(index, epoch, seed)``, so the
    augmentation is reproducible and a resumed run sees the same samples.
    """

    def __init__(self, images: Tensor, labels: Tensor, max_shift: int, seed: int = 0) -> None:
        self.images, self.labels = images, labels
        self.max_shift, self.seed = max_shift, seed
        self.epoch = 0

    def set_epoch(self, epoch: int) -> None:
        """Called by ember before every training epoch: a new shift per epoch."""
        self.epoch = epoch

    def __len__(self) -> int:
        return len(self.images)

    def __getitem__(self, index: int) -> tuple[Tensor, Tensor]:
        image, s = self.images[index], self.max_shift
        if s:
            generator = sample_generator(index, self.epoch, self.seed)
            top, left = torch.randint(0, 2 * s + 1, (2,), generator=generator).tolist()
            image = F.pad(image, (s, s, s, s))[:, top : top + 8, left : left + 8]
        return image, self.labels[index]


class DigitSubset(ember.DataModule):
    """The digits images of `classes` as (1, 8, 8) tensors, labels renumbered 0..len(classes)-1.

    A fixed-seed `val_fraction` of each class validates; ``train_per_class`` keeps only that many
    training images of each class (the small target set), the same ones for any seed of the run.
    ``max_shift`` > 0 moves training images by up to that many pixels (augmentation).
    """

    def __init__(
        self,
        classes: Sequence[int] = (0, 1, 2, 3, 4),
        train_per_class: int | None = None,
        batch_size: int = 32,
        val_fraction: float = 0.3,
        max_shift: int = 0,
        seed: int = 0,
    ) -> None:
        self.classes = list(classes)
        self.train_per_class = train_per_class
        self.batch_size = batch_size
        self.val_fraction = val_fraction
        self.max_shift = max_shift
        self.seed = seed

    def setup(self, stage: str) -> None:
        x, y = load_digit_arrays()
        x = x.reshape(-1, 1, 8, 8)
        generator = torch.Generator().manual_seed(self.seed)
        train_idx: list[torch.Tensor] = []
        val_idx: list[torch.Tensor] = []
        for digit in self.classes:
            members = (y == digit).nonzero().flatten()
            members = members[torch.randperm(len(members), generator=generator)]
            n_val = int(len(members) * self.val_fraction)
            val_idx.append(members[:n_val])
            train_idx.append(members[n_val:][: self.train_per_class])
        relabel = torch.full((10,), -1, dtype=torch.long)
        relabel[self.classes] = torch.arange(len(self.classes))
        train, val = torch.cat(train_idx), torch.cat(val_idx)
        self.train_set = ShiftedImages(x[train], relabel[y[train]], self.max_shift, self.seed)
        self.val_set = TensorDataset(x[val], relabel[y[val]])

    def train_dataloader(self) -> DataLoader:
        generator = torch.Generator().manual_seed(self.seed)
        return DataLoader(self.train_set, batch_size=self.batch_size, shuffle=True, generator=generator)

    def val_dataloader(self) -> DataLoader:
        return DataLoader(self.val_set, batch_size=256)

    def test_dataloader(self) -> DataLoader:
        return self.val_dataloader()


class TransferClassifier(CNNClassifier):
    """`CNNClassifier` with a loadable backbone (``model.backbone``, also reachable as ``backbone``).

    - ``label_smoothing``: of the training loss (pretraining uses 0.1: less specialised features);
    - ``backbone_path``: load the backbone's weights from this file (written by ``save_backbone_to``);
    - ``save_backbone_to``: write the backbone's weights to this file when fit ends.

    `configure_optimizers` trains the parameters that require grad when fit starts, so with
    `BackboneFinetuning` the optimizer begins with the head and the callback adds the backbone later.
    """

    def __init__(
        self,
        num_classes: int = 5,
        width: int = 32,
        lr: float = 3e-3,
        epochs: int = 30,
        weight_decay: float = 1e-2,
        label_smoothing: float = 0.0,
        backbone_path: str | None = None,
        save_backbone_to: str | None = None,
    ) -> None:
        super().__init__(lr=lr, width=width, epochs=epochs, num_classes=num_classes)
        self.save_hyperparameters()
        self.loss_fn = nn.CrossEntropyLoss(label_smoothing=label_smoothing)
        if backbone_path is not None:
            self.backbone.load_state_dict(torch.load(backbone_path, weights_only=True))

    @property
    def backbone(self) -> nn.Module:
        """The convolutional feature extractor (``model.backbone``)."""
        return self.model.get_submodule("backbone")

    def configure_optimizers(self) -> dict[str, object]:
        trainable = [p for p in self.parameters() if p.requires_grad]
        opt = torch.optim.AdamW(trainable, lr=self.hparams.lr, weight_decay=self.hparams.weight_decay)
        sched = torch.optim.lr_scheduler.CosineAnnealingLR(opt, T_max=self.hparams.epochs)
        return {"optimizer": opt, "lr_scheduler": sched}

    def on_fit_end(self) -> None:
        """Write the backbone's weights to ``save_backbone_to`` (when set)."""
        if self.hparams.save_backbone_to is not None and self.trainer.is_global_zero:
            checkpoint.save_weights(Path(self.hparams.save_backbone_to), self.backbone.state_dict())
