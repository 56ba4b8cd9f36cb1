"""Bring your own data: a CSV table, images in class folders, and text files, each as a ``Dataset`` and an
``ember.DataModule`` (docs/your-data.md walks through it).

``python -m examples.your_data`` writes small example files into ``my_data/`` (or ``--root DIR``): a CSV, PNG
images in one folder per class, and one text file per class. Then it trains a classifier on each and prints
the held-out test accuracy. Nothing is downloaded: the images are scikit-learn's bundled digits, the table
and the text are generated.
"""

from __future__ import annotations

import argparse
import csv
import random
from pathlib import Path

import torch
import torchmetrics
from torch import nn
from torch.utils.data import DataLoader, Dataset, random_split

import ember

# --- files on disk (the example writes its own) -----------------------------------------------------------


def write_example_files(root: str | Path, seed: int = 0) -> Path:
    """Write ``table.csv``, ``images/<class>/<n>.png`` and ``text/<class>.txt`` under `root`; returns it."""
    root = Path(root)
    rng = random.Random(seed)
    root.mkdir(parents=True, exist_ok=True)
    # a table: 4 numeric features, the label is which of the first 3 is largest
    with open(root / "table.csv", "w", newline="") as f:
        writer = csv.writer(f)
        writer.writerow(["f0", "f1", "f2", "f3", "label"])
        for _ in range(600):
            row = [round(rng.gauss(0, 1), 4) for _ in range(4)]
            writer.writerow([*row, max(range(3), key=lambda i: row[i])])
    # images in folders: the 8x8 digits 0, 1 and 2 as grayscale PNGs
    from PIL import Image
    from sklearn.datasets import load_digits

    images, labels = load_digits(n_class=3, return_X_y=True)
    for n, (pixels, label) in enumerate(zip(images, labels, strict=True)):
        folder = root / "images" / str(label)
        folder.mkdir(parents=True, exist_ok=True)
        Image.fromarray((pixels.reshape(8, 8) * 255 / 16).astype("uint8")).save(folder / f"{n}.png")
    # text: one file per class, one example per line
    words = {"positive": ["great", "fine", "lovely", "superb", "good"], "negative": ["awful", "bad", "poor", "dull"]}
    filler = ["the", "film", "was", "quite", "and", "plot", "acting", "really"]
    (root / "text").mkdir(exist_ok=True)
    for label, vocabulary in words.items():
        lines = [" ".join([*rng.sample(filler, 4), rng.choice(vocabulary)]) for _ in range(300)]
        (root / "text" / f"{label}.txt").write_text("\n".join(lines) + "\n")
    return root


# --- Datasets: one item is an (input tensor, label) pair ------------------------------------------------


class CSVDataset(Dataset):
    """Rows of a CSV file: every column but `label_column` as float features, `label_column` as the class."""

    def __init__(self, path: str | Path, label_column: str = "label") -> None:
        with open(path, newline="") as f:
            rows = list(csv.DictReader(f))
        features = [name for name in rows[0] if name != label_column]
        self.x = torch.tensor([[float(r[name]) for name in features] for r in rows])
        self.y = torch.tensor([int(r[label_column]) for r in rows])

    def __len__(self) -> int:
        return len(self.y)

    def __getitem__(self, i: int) -> tuple[torch.Tensor, torch.Tensor]:
        return self.x[i], self.y[i]


class ImageFolder(Dataset):
    """``root/<class name>/<image>``: one folder per class; images are read when an item is asked for."""

    def __init__(self, root: str | Path, suffixes: tuple[str, ...] = (".png", ".jpg", ".jpeg")) -> None:
        self.classes = sorted(p.name for p in Path(root).iterdir() if p.is_dir())
        self.files = [
            (path, label)
            for label, name in enumerate(self.classes)
            for path in sorted((Path(root) / name).iterdir())
            if path.suffix.lower() in suffixes
        ]

    def __len__(self) -> int:
        return len(self.files)

    def __getitem__(self, i: int) -> tuple[torch.Tensor, int]:
        from PIL import Image

        path, label = self.files[i]
        with Image.open(path) as image:
            pixels = torch.frombuffer(bytearray(image.convert("L").tobytes()), dtype=torch.uint8)
            return pixels.reshape(1, image.height, image.width).float() / 255, label


class TextLines(Dataset):
    """``root/<class name>.txt``, one example per line; a line becomes its UTF-8 bytes, padded or cut."""

    def __init__(self, root: str | Path, max_bytes: int = 64) -> None:
        self.classes = sorted(p.stem for p in Path(root).glob("*.txt"))
        self.items = [
            (line, label)
            for label, name in enumerate(self.classes)
            for line in (Path(root) / f"{name}.txt").read_text(encoding="utf-8").splitlines()
            if line.strip()
        ]
        self.max_bytes = max_bytes

    def __len__(self) -> int:
        return len(self.items)

    def __getitem__(self, i: int) -> tuple[torch.Tensor, int]:
        line, label = self.items[i]
        data = line.encode("utf-8")[: self.max_bytes].ljust(self.max_bytes, b"\0")
        return torch.tensor(list(data)), label


# --- one DataModule for any of them ---------------------------------------------------------------------


class FilesData(ember.DataModule):
    """Any map-style `Dataset` split into train / validation / test (70/15/15, a fixed seed).

    `kind` chooses the dataset: ``"csv"`` (`CSVDataset` of ``path``), ``"images"`` (`ImageFolder`) or ``"text"``
    (`TextLines`). The test split is held out: neither training nor checkpoint selection sees it.
    ``write_example_files=True`` first writes this example's files (`write_example_files`) into the folder
    above `path` when `path` does not exist (configs/your_data.yaml uses it; your own data does not).
    """

    def __init__(
        self, path: str, kind: str = "csv", batch_size: int = 32, seed: int = 0, write_example_files: bool = False
    ) -> None:
        self.path, self.kind, self.batch_size, self.seed = path, kind, batch_size, seed
        self.write_example_files = write_example_files

    def setup(self, stage: str) -> None:
        if self.write_example_files and not Path(self.path).exists():  # the example's own files, once
            write_example_files(Path(self.path).parent)
        datasets = {"csv": CSVDataset, "images": ImageFolder, "text": TextLines}
        full = datasets[self.kind](self.path)
        generator = torch.Generator().manual_seed(self.seed)
        self.train_set, self.val_set, self.test_set = random_split(full, [0.7, 0.15, 0.15], generator=generator)

    def train_dataloader(self) -> DataLoader:
        generator = torch.Generator().manual_seed(self.seed)
        return DataLoader(self.train_set, batch_size=self.batch_size, shuffle=True, generator=generator)

    def val_dataloader(self) -> DataLoader:
        return DataLoader(self.val_set, batch_size=256)

    def test_dataloader(self) -> DataLoader:
        return DataLoader(self.test_set, batch_size=256)

    def predict_dataloader(self) -> DataLoader:
        """The held-out test split again: ``ember predict`` writes the model's outputs for it."""
        return DataLoader(self.test_set, batch_size=256)


# --- a model for each input kind ----------------------------------------------------------------------


class Classifier(ember.TrainingModule):
    """A small classifier; ``kind`` picks the input layers (features, 1x8x8 images, byte strings)."""

    def __init__(self, kind: str = "csv", num_classes: int = 3, lr: float = 1e-2) -> None:
        super().__init__()
        self.save_hyperparameters()
        stems = {
            "csv": nn.Linear(4, 64),
            "images": nn.Sequential(nn.Flatten(), nn.Linear(64, 64)),
            "text": nn.EmbeddingBag(256, 64, mode="mean"),
        }
        self.model = nn.Sequential(stems[kind], nn.ReLU(), nn.Linear(64, num_classes))
        self.loss_fn = nn.CrossEntropyLoss()
        self.metrics = {"acc": torchmetrics.Accuracy(task="multiclass", num_classes=num_classes)}

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.AdamW(self.parameters(), lr=self.hparams.lr)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--root", default="my_data", help="where to write the example files (my_data)")
    parser.add_argument("--epochs", type=int, default=10)
    args = parser.parse_args(argv)
    root = write_example_files(args.root)
    ember.seed_everything(0)
    for kind, path, classes in (("csv", root / "table.csv", 3), ("images", root / "images", 3),
                                ("text", root / "text", 2)):  # fmt: skip
        trainer = ember.Trainer(max_epochs=args.epochs, run_name=f"your_data_{kind}", enable_progress_bar=False,
                                enable_model_summary=False)  # fmt: skip
        data = FilesData(str(path), kind)
        trainer.fit(Classifier(kind, classes), datamodule=data)
        (result,) = trainer.test(trainer.module, datamodule=data)
        print(f"{kind}: test/acc {result['test/acc']:.4f} on {len(data.test_set)} held-out examples")


if __name__ == "__main__":
    main()
