"""Semantic segmentation with a small U-Net on generated images, with pictures of the results.

Each image is `size` x `size` grey levels (48 in configs/segmentation.yaml): a background with a random
brightness gradient and one to three shapes (circle, rectangle, triangle) of random size and position, each
brighter or darker than the background by 0.2 to 0.45, later shapes covering earlier ones; the target gives
every pixel its class (0 background, 1 circle, 2 rectangle, 3 triangle). Grey levels do not tell the classes
apart, so a pixel's class comes from the shape it belongs to. Image ``i`` of a split is drawn from a
generator seeded with ``(seed, split, i)``: the data is the same on every machine, and nothing is downloaded.

Training images get a random augmentation each time they are drawn: a flip, a rotation by a multiple
of 90 degrees and fresh Gaussian noise (validation images carry fixed noise). The draws come from
torch's global random stream, which ember checkpoints, so a resumed run sees the same augmented
images as an uninterrupted one, and ends with the same weights.

Validation logs ``val/dice`` (torchmetrics ``DiceScore``) and ``val/jaccard`` (``MeanIoU``), background
excluded, over the shape classes present in an image's prediction or target: Dice averages each image's
classes, then the images; Jaccard (IoU) averages all (image, class) pairs at once (torchmetrics' own
definitions; tests/integration/test_segmentation.py recomputes both). After every
validation `SegmentationImages` logs a grid of input / target / prediction for a few fixed validation
images to TensorBoard (``add_images``) and to W&B (``wandb.Image``).

    ember fit -c configs/segmentation.yaml                                  # see examples/README.md
    ember export --ckpt last -c configs/segmentation.yaml --format onnx --out exports
    tensorboard --logdir runs/segmentation                                  # IMAGES tab: val/examples
"""

from __future__ import annotations

import math
from typing import Any

import torch
from torch import Tensor, nn
from torch.utils.data import DataLoader, Dataset
from torchmetrics.segmentation import DiceScore, MeanIoU

import ember

#: Class index -> name; the target holds these indices.
CLASSES = ("background", "circle", "rectangle", "triangle")
#: Class index -> RGB colour in the image grids.
PALETTE = torch.tensor([[0.0, 0.0, 0.0], [0.95, 0.3, 0.25], [0.25, 0.7, 0.3], [0.3, 0.45, 0.95]])
_SPLITS = {"train": 0, "val": 1, "test": 2}


# --- data ------------------------------------------------------------------------------------------------


def draw_scene(size: int, generator: torch.Generator) -> tuple[Tensor, Tensor]:
    """(clean image (1, size, size) in [0, 1], target (size, size) of class indices) for one random scene."""

    def uniform(low: float, high: float) -> float:
        return low + (high - low) * float(torch.rand((), generator=generator))

    axis = torch.arange(size, dtype=torch.float32)
    ys, xs = torch.meshgrid(axis, axis, indexing="ij")
    angle = uniform(0, 2 * math.pi)
    ramp = (math.cos(angle) * xs + math.sin(angle) * ys) / size
    base = uniform(0.3, 0.6)
    image = (base + uniform(0.0, 0.2) * ramp).clamp(0, 1)
    target = torch.zeros(size, size, dtype=torch.long)
    for _ in range(int(torch.randint(1, 4, (), generator=generator))):
        kind = int(torch.randint(1, 4, (), generator=generator))
        radius = uniform(0.12, 0.25) * size
        cy, cx = uniform(radius, size - radius), uniform(radius, size - radius)
        if kind == 1:
            inside = (ys - cy) ** 2 + (xs - cx) ** 2 <= radius**2
        elif kind == 2:
            height = radius * uniform(0.6, 1.0)
            inside = ((ys - cy).abs() <= height) & ((xs - cx).abs() <= radius)
        else:  # a triangle pointing up: apex at the top, base at the bottom
            rel = (ys - (cy - radius)) / (2 * radius)  # 0 at the apex, 1 at the base
            inside = (rel >= 0) & (rel <= 1) & ((xs - cx).abs() <= rel * radius)
        sign = 1.0 if bool(torch.rand((), generator=generator) < 0.5) else -1.0
        level = min(max(base + sign * uniform(0.2, 0.45), 0.0), 1.0)  # brighter or darker than the background
        image = torch.where(inside, torch.tensor(level), image)
        target = torch.where(inside, torch.tensor(kind), target)
    return image.unsqueeze(0), target


class Shapes(Dataset[tuple[Tensor, Tensor]]):
    """`n` generated scenes of `split`: (image (1, size, size), target (size, size)).

    With `augment`, each access flips and rotates the scene at random and adds fresh noise of standard
    deviation `noise` (torch's global random stream); without, the noise is fixed per image.
    """

    def __init__(self, n: int, split: str, size: int = 64, noise: float = 0.15, seed: int = 0, augment: bool = False):
        self.n, self.split, self.size, self.noise, self.seed, self.augment = n, split, size, noise, seed, augment

    def __len__(self) -> int:
        return self.n

    def scene(self, index: int) -> tuple[Tensor, Tensor, torch.Generator]:
        generator = torch.Generator().manual_seed((self.seed * 4 + _SPLITS[self.split]) * 1_000_003 + index)
        image, target = draw_scene(self.size, generator)
        return image, target, generator

    def __getitem__(self, index: int) -> tuple[Tensor, Tensor]:
        image, target, generator = self.scene(index)
        if not self.augment:
            noisy = image + self.noise * torch.randn(image.shape, generator=generator)
            return noisy, target
        if bool(torch.rand(()) < 0.5):
            image, target = image.flip(-1), target.flip(-1)
        turns = int(torch.randint(0, 4, ()))
        image, target = image.rot90(turns, (-2, -1)), target.rot90(turns, (-2, -1))
        return image + self.noise * torch.randn(image.shape), target


class ShapesData(ember.DataModule):
    """`train_size` augmented training scenes and `val_size` fixed validation scenes."""

    def __init__(
        self,
        train_size: int = 2048,
        val_size: int = 256,
        size: int = 64,
        noise: float = 0.15,
        batch_size: int = 32,
        num_workers: int = 0,
        seed: int = 0,
    ) -> None:
        self.train_size, self.val_size, self.size, self.noise = train_size, val_size, size, noise
        self.batch_size, self.num_workers, self.seed = batch_size, num_workers, seed

    def train_dataloader(self) -> DataLoader:
        dataset = Shapes(self.train_size, "train", self.size, self.noise, self.seed, augment=True)
        generator = torch.Generator().manual_seed(self.seed)
        return DataLoader(
            dataset, batch_size=self.batch_size, shuffle=True, generator=generator, num_workers=self.num_workers
        )

    def val_dataloader(self) -> DataLoader:
        dataset = Shapes(self.val_size, "val", self.size, self.noise, self.seed)
        return DataLoader(dataset, batch_size=64, num_workers=self.num_workers)

    def test_dataloader(self) -> DataLoader:
        dataset = Shapes(self.val_size, "test", self.size, self.noise, self.seed)
        return DataLoader(dataset, batch_size=64, num_workers=self.num_workers)

    def predict_dataloader(self) -> DataLoader:
        return self.test_dataloader()


# --- model -----------------------------------------------------------------------------------------------


def conv_block(c_in: int, c_out: int) -> nn.Sequential:
    """Two 3x3 convolutions, each followed by BatchNorm and ReLU."""
    return nn.Sequential(
        nn.Conv2d(c_in, c_out, 3, padding=1, bias=False),
        nn.BatchNorm2d(c_out),
        nn.ReLU(inplace=True),
        nn.Conv2d(c_out, c_out, 3, padding=1, bias=False),
        nn.BatchNorm2d(c_out),
        nn.ReLU(inplace=True),
    )


class UNet(nn.Module):
    """A U-Net with `depth` down-sampling steps: `width` channels at full resolution, doubling per step.

    Input (batch, in_channels, H, W) with H and W divisible by ``2**depth``; output per-pixel logits
    (batch, num_classes, H, W).
    """

    def __init__(self, in_channels: int = 1, num_classes: int = 4, width: int = 16, depth: int = 3) -> None:
        super().__init__()
        widths = [width * 2**i for i in range(depth + 1)]
        self.down = nn.ModuleList([conv_block(in_channels, widths[0])])
        self.down.extend(conv_block(widths[i], widths[i + 1]) for i in range(depth))
        self.pool = nn.MaxPool2d(2)
        levels = list(reversed(range(depth)))  # from the bottom of the U up
        self.up = nn.ModuleList(nn.ConvTranspose2d(widths[i + 1], widths[i], 2, stride=2) for i in levels)
        self.merge = nn.ModuleList(conv_block(2 * widths[i], widths[i]) for i in levels)
        self.head = nn.Conv2d(widths[0], num_classes, 1)

    def forward(self, x: Tensor) -> Tensor:
        skips = []
        for i, block in enumerate(self.down):
            x = block(x if i == 0 else self.pool(x))
            skips.append(x)
        skips.pop()  # the bottom of the U is x itself
        for up, merge in zip(self.up, self.merge, strict=True):
            x = merge(torch.cat([up(x), skips.pop()], dim=1))
        return self.head(x)


class Segmenter(ember.TrainingModule):
    """Per-pixel cross-entropy on a `UNet`; Dice and Jaccard (IoU) of the shape classes on validation.

    The learning rate follows a one-cycle schedule over `total_steps`; `image_size` is the side of the
    example input that exports trace on (any multiple of ``2**depth`` works at run time).
    """

    def __init__(
        self,
        width: int = 16,
        depth: int = 3,
        lr: float = 3e-3,
        weight_decay: float = 1e-4,
        total_steps: int = 1000,
        image_size: int = 64,
    ) -> None:
        super().__init__()
        self.save_hyperparameters()
        self.model = UNet(1, len(CLASSES), width, depth)
        self.loss_fn = nn.CrossEntropyLoss()
        self.val_dice = DiceScore(num_classes=len(CLASSES), include_background=False, input_format="index")
        self.val_jaccard = MeanIoU(num_classes=len(CLASSES), include_background=False, input_format="index")
        self.example_input_array = torch.zeros(2, 1, image_size, image_size)  # exports trace on it

    def training_step(self, batch: tuple[Tensor, Tensor], batch_idx: int) -> Tensor:
        images, targets = batch
        loss = self.loss_fn(self(images), targets)
        self.log("train/loss", loss, prog_bar=True)
        return loss

    def validation_step(self, batch: tuple[Tensor, Tensor], batch_idx: int, dataloader_idx: int = 0) -> Tensor:
        return self._evaluate("val", batch)

    def test_step(self, batch: tuple[Tensor, Tensor], batch_idx: int, dataloader_idx: int = 0) -> Tensor:
        return self._evaluate("test", batch)

    def _evaluate(self, stage: str, batch: tuple[Tensor, Tensor]) -> Tensor:
        images, targets = batch
        logits = self(images)
        predicted = logits.argmax(1)
        self.val_dice.update(predicted, targets)
        self.val_jaccard.update(predicted, targets)
        loss = self.loss_fn(logits, targets)
        self.log(f"{stage}/loss", loss)
        self.log(f"{stage}/dice", self.val_dice, prog_bar=True)
        self.log(f"{stage}/jaccard", self.val_jaccard, prog_bar=True)
        return loss

    def predict_step(self, batch: Any, batch_idx: int, dataloader_idx: int = 0) -> Tensor:
        """The predicted class of every pixel, (batch, H, W)."""
        images = batch[0] if isinstance(batch, (tuple, list)) else batch
        return self(images).argmax(1)

    def configure_optimizers(self) -> dict[str, Any]:
        hp = self.hparams
        opt = torch.optim.AdamW(self.parameters(), lr=hp.lr, weight_decay=hp.weight_decay)
        sched = torch.optim.lr_scheduler.OneCycleLR(opt, max_lr=hp.lr, total_steps=max(hp.total_steps, 2))
        return {"optimizer": opt, "lr_scheduler": {"scheduler": sched, "interval": "step"}}


# --- pictures --------------------------------------------------------------------------------------------


def colorize(masks: Tensor) -> Tensor:
    """Class indices (N, H, W) -> RGB images (N, 3, H, W) in [0, 1] (`PALETTE`)."""
    return PALETTE.to(masks.device)[masks].permute(0, 3, 1, 2)


def comparison_columns(images: Tensor, targets: Tensor, predicted: Tensor) -> Tensor:
    """One RGB image per sample, (N, 3, 3H + 4, W): input above target above prediction, 2-pixel white gaps."""
    grey = images.clamp(0, 1).expand(-1, 3, -1, -1)
    gap = torch.ones(images.shape[0], 3, 2, images.shape[3], device=images.device)
    return torch.cat([grey, gap, colorize(targets), gap, colorize(predicted)], dim=2)


class SegmentationImages(ember.Callback):
    """After every validation (not the sanity check), logs input / target / prediction of the first
    `num_images` validation images, one column each (`comparison_columns`): to TensorBoard with
    ``add_images(tag, ...)``, which tiles the columns side by side, and to W&B as one ``wandb.Image`` of
    the same layout, at the current optimizer step. Loggers of other kinds are skipped."""

    def __init__(self, num_images: int = 8, tag: str = "val/examples") -> None:
        self.num_images = num_images
        self.tag = tag
        self._batch: tuple[Tensor, Tensor] | None = None

    def on_validation_batch_end(
        self, trainer: Any, module: Any, outputs: Any, batch: Any, batch_idx: int, dataloader_idx: int = 0
    ) -> None:
        if batch_idx == 0 and dataloader_idx == 0:
            images, targets = batch
            self._batch = (images[: self.num_images].detach(), targets[: self.num_images].detach())

    def on_validation_epoch_end(self, trainer: Any, module: Any) -> None:
        if trainer.sanity_checking or self._batch is None or not trainer.is_global_zero:
            return
        images, targets = self._batch
        with torch.no_grad():
            predicted = module(images).argmax(1)
        columns = comparison_columns(images, targets, predicted).float().cpu()
        for logger in trainer.loggers:
            self._log(logger, columns, trainer.global_step)

    def _log(self, logger: Any, columns: Tensor, step: int) -> None:
        from ember.loggers import TensorBoardLogger, WandbLogger

        if isinstance(logger, TensorBoardLogger):
            logger.experiment.add_images(self.tag, columns, step)
        elif isinstance(logger, WandbLogger):
            import wandb

            from ember.loggers.wandb import STEP_METRIC

            grid = torch.cat(list(columns), dim=2)  # side by side, as TensorBoard tiles them: (3, 3H + 4, N*W)
            caption = "input | target | prediction (" + ", ".join(f"{n}" for n in CLASSES[1:]) + ")"
            pixels = (grid.permute(1, 2, 0) * 255).round().to(torch.uint8).numpy()
            image = wandb.Image(pixels, caption=caption)
            logger.experiment.log({self.tag: image, STEP_METRIC: step})
