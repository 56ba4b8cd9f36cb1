"""examples/segmentation.py from its config, shrunk: the image grids read back from the TensorBoard event file
and the W&B run, Dice and Jaccard against a direct computation, the best checkpoint by val/dice, an exact resume
under random augmentation, and the ONNX export run in ONNX Runtime."""

from __future__ import annotations

import csv
import io
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from PIL import Image

import ember
from ember import config
from ember.cli import build
from examples import segmentation

pytestmark = pytest.mark.slow

CONFIG = Path(__file__).resolve().parents[2] / "configs" / "segmentation.yaml"
SIZE = 32
SMALL = [
    "data.train_size=32",
    "data.val_size=16",
    f"data.size={SIZE}",
    "data.batch_size=8",  # 4 steps per epoch
    "module.width=4",
    "module.depth=2",
    "module.total_steps=8",
    "trainer.max_epochs=2",
    "trainer.enable_progress_bar=false",
    "trainer.enable_model_summary=false",
]
COLUMNS = 8  # SegmentationImages(num_images=8) in the config


def from_config(root: Path, *overrides: str) -> tuple[ember.Trainer, Any, Any]:
    loaded = config.load([CONFIG], [*SMALL, f"trainer.default_root_dir={root}", *overrides])
    resolved = config.resolve(loaded)
    config.check(loaded, resolved, "fit")
    return build(resolved)


@pytest.fixture(scope="module")
def fitted(tmp_path_factory: pytest.TempPathFactory) -> tuple[ember.Trainer, segmentation.Segmenter, Any]:
    root = tmp_path_factory.mktemp("segmentation")
    trainer, module, data = from_config(root)
    trainer.fit(module, datamodule=data)
    return trainer, module, data


def test_every_validation_logs_an_image_grid_to_tensorboard(fitted: tuple[ember.Trainer, Any, Any]) -> None:
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    trainer, module, data = fitted
    events = EventAccumulator(str(trainer.run_dir / "tensorboard"), size_guidance={"images": 0})
    events.Reload()
    grids = events.Images("val/examples")
    assert [g.step for g in grids] == [4, 8]  # after each of the 2 epochs; not in the sanity check
    for grid in grids:
        assert (grid.height, grid.width) == (3 * SIZE + 4, COLUMNS * SIZE)  # input / target / prediction columns
    pixels = np.asarray(Image.open(io.BytesIO(grids[-1].encoded_image_string)).convert("RGB")).astype(int)
    assert pixels.shape == (3 * SIZE + 4, COLUMNS * SIZE, 3)

    # What the grid shows: the first validation images, their targets, and the trained model's predictions.
    images, targets = (
        torch.stack(t) for t in zip(*[data.val_dataloader().dataset[i] for i in range(COLUMNS)], strict=True)
    )
    with torch.no_grad():
        predicted = module.eval()(images).argmax(1)
    expected = segmentation.comparison_columns(images, targets, predicted)
    expected = torch.cat(list(expected), dim=2).permute(1, 2, 0).mul(255).numpy()
    assert np.abs(pixels - expected).max() <= 1.0  # TensorBoard scales to 0-255 and truncates
    target_band = pixels[SIZE + 2 : 2 * SIZE + 2]
    assert {tuple(c) for c in target_band.reshape(-1, 3)} <= {
        tuple(int(255 * v) for v in c) for c in segmentation.PALETTE.tolist()
    }


def test_the_same_grids_go_to_wandb(fitted: tuple[ember.Trainer, Any, Any]) -> None:
    trainer, _, _ = fitted
    media = sorted(trainer.run_dir.glob("wandb/offline-run-*/files/media/images/val/examples_*.png"))
    assert len(media) == 2
    for path in media:
        assert Image.open(path).size == (COLUMNS * SIZE, 3 * SIZE + 4)


def test_dice_and_jaccard_are_averaged_over_images_and_shape_classes(fitted: tuple[ember.Trainer, Any, Any]) -> None:
    trainer, module, data = fitted
    per_image_dice, pair_iou = [], []
    with torch.no_grad():
        for images, targets in data.val_dataloader():
            predicted = module.eval()(images).argmax(1)
            for p, t in zip(predicted, targets, strict=True):
                dice = []
                for c in range(1, len(segmentation.CLASSES)):
                    inter, p_c, t_c = int(((p == c) & (t == c)).sum()), int((p == c).sum()), int((t == c).sum())
                    if p_c + t_c:  # classes absent from both prediction and target do not count
                        dice.append(2 * inter / (p_c + t_c))
                        pair_iou.append(inter / (p_c + t_c - inter))
                if dice:
                    per_image_dice.append(sum(dice) / len(dice))
    # Dice: each image's classes averaged, then the images; Jaccard: all (image, class) pairs at once.
    assert trainer.callback_metrics["val/dice"] == pytest.approx(sum(per_image_dice) / len(per_image_dice), abs=1e-5)
    assert trainer.callback_metrics["val/jaccard"] == pytest.approx(sum(pair_iou) / len(pair_iou), abs=1e-5)


def test_the_best_checkpoint_is_chosen_by_val_dice(fitted: tuple[ember.Trainer, Any, Any]) -> None:
    trainer, _, _ = fitted
    with open(trainer.run_dir / "metrics.csv", newline="") as f:
        dice = [float(row["val/dice"]) for row in csv.DictReader(f) if row.get("val/dice")]
    assert len(dice) == 2
    checkpoint = next(cb for cb in trainer.callbacks if isinstance(cb, ember.callbacks.ModelCheckpoint))
    assert checkpoint.best_model_score == pytest.approx(max(dice), abs=1e-6)
    assert Path(checkpoint.best_model_path).name.startswith(f"epoch={dice.index(max(dice))}-val_dice=")


def test_augmentation_is_random_per_draw_and_a_resume_is_exact(tmp_path: Path) -> None:
    dataset = segmentation.Shapes(4, "train", augment=True)
    torch.manual_seed(0)
    first, second = dataset[0], dataset[0]
    assert not torch.equal(first[0], second[0])  # fresh noise (and maybe a flip or turn) each draw
    quiet = ("trainer.logger=false", "trainer.callbacks=[]", "trainer.num_sanity_val_steps=0", "data.train_size=16")

    def fit(root: Path, epochs: int, ckpt: str | None = None) -> Any:
        trainer, module, data = from_config(root, *quiet, f"trainer.max_epochs={epochs}")
        ember.seed_everything(0)
        trainer.fit(module, datamodule=data, ckpt_path=ckpt)
        return module

    whole = fit(tmp_path / "whole", 2)
    fit(tmp_path / "parts", 1)
    resumed = fit(tmp_path / "parts", 2, ckpt="last")
    for key, value in whole.state_dict().items():
        assert torch.equal(resumed.state_dict()[key], value), key


def test_onnx_export_matches_in_onnx_runtime(fitted: tuple[ember.Trainer, Any, Any], tmp_path: Path) -> None:
    import onnxruntime

    _, module, data = fitted
    result = module.to_onnx(tmp_path / "segmenter.onnx")  # ember checks it in ONNX Runtime at batch 2 and 4
    assert [c.batch_size for c in result.checks] == [2, 4]
    images = torch.stack([data.val_dataloader().dataset[i][0] for i in range(7)])  # another batch size
    session = onnxruntime.InferenceSession(str(result.path), providers=["CPUExecutionProvider"])
    (logits,) = session.run(None, {session.get_inputs()[0].name: images.numpy()})
    with torch.no_grad():
        expected = module.eval()(images)
    assert logits.shape == (7, 4, SIZE, SIZE)
    assert np.abs(logits - expected.numpy()).max() < 1e-4
