"""Fine-tuning a local Hugging Face model: which standard-library module does a line of code come from?

The pretrained model is the directory ``ember export --format hf`` wrote from `examples.hf_lm`
(``exports/hf_lm``: GPT-2 weights, config and tokenizer); ``from_pretrained`` reads it from disk, nothing
is downloaded. ``GPT2ForSequenceClassification`` puts a new linear head on the last token of each line.

The task: lines of eight modules of the running Python's standard library (by default modules that sort
after the language model's ~1 MB of pretraining text, so it never saw them), each line labelled with its
module. Lines shorter than `min_chars`, repeated within a module, or found in more than one module are
dropped; `train_per_class` lines of each module train, `val_per_class` others validate (a fixed split).
Validation logs macro F1 (``val/f1``, torchmetrics) and accuracy.

    ember fit -c configs/hf_classify.yaml                                  # fine-tune exports/hf_lm
    ember fit -c configs/hf_classify.yaml -c configs/hf_classify_scratch.yaml   # same network, random weights
    python -m examples.hf_classify --seeds 0 1 2 3 4                       # both, over seeds: a table
"""

from __future__ import annotations

import argparse
import math
import sysconfig
import time
from collections import Counter
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch
from torch import Tensor
from torch.nn import functional as F
from torch.utils.data import DataLoader, TensorDataset
from torchmetrics import Accuracy, F1Score

import ember

#: Modules that sort after ``configparser`` (where the language model's 1 MB of text ends on Python 3.11).
DEFAULT_MODULES = ("datetime", "doctest", "inspect", "pydoc", "subprocess", "tarfile", "turtle", "typing")


# --- data ------------------------------------------------------------------------------------------------


def labelled_lines(modules: Sequence[str], min_chars: int = 12) -> list[list[str]]:
    """For each module of the standard library, its distinct stripped lines of at least `min_chars` characters
    that occur in no other of the `modules` (in file order)."""
    root = Path(sysconfig.get_paths()["stdlib"])
    per_module: list[list[str]] = []
    for name in modules:
        path = root / f"{name}.py"
        if not path.is_file():
            raise FileNotFoundError(f"no standard-library module {path}; choose modules this Python ships as .py")
        lines = (line.strip() for line in path.read_text(encoding="utf-8", errors="replace").splitlines())
        per_module.append(list(dict.fromkeys(line for line in lines if len(line) >= min_chars)))
    owners = Counter(line for lines in per_module for line in lines)
    return [[line for line in lines if owners[line] == 1] for lines in per_module]


def split_lines(
    per_module: list[list[str]], train_per_class: int, val_per_class: int, seed: int
) -> tuple[list[tuple[str, int]], list[tuple[str, int]]]:
    """(train, val) lists of (line, label): a seeded draw of each module's lines, the same for every run."""
    generator = torch.Generator().manual_seed(seed)
    train: list[tuple[str, int]] = []
    val: list[tuple[str, int]] = []
    for label, lines in enumerate(per_module):
        if len(lines) < train_per_class + val_per_class:
            raise ValueError(f"module {label} has {len(lines)} usable lines, fewer than train + val per class")
        order = torch.randperm(len(lines), generator=generator).tolist()
        train += [(lines[i], label) for i in order[:train_per_class]]
        val += [(lines[i], label) for i in order[train_per_class : train_per_class + val_per_class]]
    return train, val


def tokenize(tokenizer: Any, rows: list[tuple[str, int]], max_tokens: int) -> TensorDataset:
    """(input_ids, attention_mask, label) tensors; lines cut at `max_tokens` and padded on the right."""
    encoded = tokenizer(
        [line for line, _ in rows], max_length=max_tokens, truncation=True, padding="max_length", return_tensors="pt"
    )
    labels = torch.tensor([label for _, label in rows], dtype=torch.long)
    return TensorDataset(encoded["input_ids"], encoded["attention_mask"], labels)


class StdlibLines(ember.DataModule):
    """Lines of standard-library modules labelled by module, tokenized with the pretrained model's tokenizer."""

    def __init__(
        self,
        model_dir: str = "exports/hf_lm",
        modules: Sequence[str] = DEFAULT_MODULES,
        train_per_class: int = 64,
        val_per_class: int = 128,
        min_chars: int = 12,
        max_tokens: int = 32,
        batch_size: int = 32,
        seed: int = 0,
    ) -> None:
        self.model_dir = model_dir
        self.modules = list(modules)
        self.train_per_class = train_per_class
        self.val_per_class = val_per_class
        self.min_chars = min_chars
        self.max_tokens = max_tokens
        self.batch_size = batch_size
        self.seed = seed
        self.train_rows: list[tuple[str, int]] = []
        self.val_rows: list[tuple[str, int]] = []

    def setup(self, stage: str) -> None:
        from transformers import AutoTokenizer

        tokenizer = AutoTokenizer.from_pretrained(require_model_dir(self.model_dir), local_files_only=True)
        per_module = labelled_lines(self.modules, self.min_chars)
        self.train_rows, self.val_rows = split_lines(per_module, self.train_per_class, self.val_per_class, self.seed)
        self.train_set = tokenize(tokenizer, self.train_rows, self.max_tokens)
        self.val_set = tokenize(tokenizer, self.val_rows, self.max_tokens)

    def train_dataloader(self) -> DataLoader:
        generator = torch.Generator().manual_seed(self.seed)
        return DataLoader(self.train_set, batch_size=self.batch_size, shuffle=True, generator=generator)

    def val_dataloader(self) -> DataLoader:
        return DataLoader(self.val_set, batch_size=256)

    def test_dataloader(self) -> DataLoader:
        return self.val_dataloader()


def require_model_dir(model_dir: str) -> str:
    """`model_dir` if it holds a ``save_pretrained`` model, else an error that says how to make one."""
    if not (Path(model_dir) / "config.json").is_file():
        raise FileNotFoundError(
            f"{model_dir} holds no pretrained model (config.json); make it with: ember fit -c configs/hf_lm.yaml "
            f"&& ember export --ckpt last -c configs/hf_lm.yaml --format hf --out {Path(model_dir).parent}"
        )
    return model_dir


# --- model -----------------------------------------------------------------------------------------------


class LineClassifier(ember.TrainingModule):
    """``GPT2ForSequenceClassification`` from `model_dir`: pretrained weights, or (``from_scratch``) the same
    configuration with random weights. ``forward(input_ids, attention_mask) -> logits``. The learning rate
    warms up over `warmup_steps`, then follows a cosine to 10% at `total_steps`."""

    def __init__(
        self,
        model_dir: str = "exports/hf_lm",
        num_classes: int = len(DEFAULT_MODULES),
        from_scratch: bool = False,
        lr: float = 1e-3,
        weight_decay: float = 0.01,
        warmup_steps: int = 20,
        total_steps: int = 200,
    ) -> None:
        super().__init__()
        self.save_hyperparameters()
        from transformers import AutoConfig, GPT2ForSequenceClassification
        from transformers.utils import logging

        require_model_dir(model_dir)
        if from_scratch:
            config = AutoConfig.from_pretrained(model_dir, num_labels=num_classes, local_files_only=True)
            self.model: Any = GPT2ForSequenceClassification(config)
        else:
            verbosity, bars = logging.get_verbosity(), logging.is_progress_bar_enabled()
            logging.set_verbosity_error()  # not the notice that the new head is untrained: that is the point
            logging.disable_progress_bar()
            try:
                self.model = GPT2ForSequenceClassification.from_pretrained(
                    model_dir, num_labels=num_classes, local_files_only=True
                )
            finally:
                logging.set_verbosity(verbosity)
                if bars:
                    logging.enable_progress_bar()
        self.val_f1 = F1Score(task="multiclass", num_classes=num_classes, average="macro")
        self.val_acc = Accuracy(task="multiclass", num_classes=num_classes)

    def on_fit_start(self) -> None:
        modules = getattr(self.trainer.datamodule, "modules", None)
        if modules is not None and len(modules) != self.hparams.num_classes:
            raise ValueError(
                f"module.num_classes={self.hparams.num_classes} but the data has {len(modules)} modules "
                f"({', '.join(modules)}); make them equal"
            )

    def forward(self, input_ids: Tensor, attention_mask: Tensor) -> Tensor:
        """Class logits, (batch, num_classes)."""
        return self.model(input_ids=input_ids, attention_mask=attention_mask).logits

    def training_step(self, batch: tuple[Tensor, Tensor, Tensor], batch_idx: int) -> Tensor:
        input_ids, attention_mask, labels = batch
        loss = F.cross_entropy(self(input_ids, attention_mask), labels)
        self.log("train/loss", loss, prog_bar=True)
        return loss

    def validation_step(self, batch: tuple[Tensor, Tensor, Tensor], batch_idx: int, dataloader_idx: int = 0) -> None:
        input_ids, attention_mask, labels = batch
        logits = self(input_ids, attention_mask)
        self.val_f1.update(logits, labels)
        self.val_acc.update(logits, labels)
        self.log("val/loss", F.cross_entropy(logits, labels), prog_bar=True)
        self.log("val/f1", self.val_f1, prog_bar=True)
        self.log("val/acc", self.val_acc)

    def configure_optimizers(self) -> dict[str, Any]:
        hp = self.hparams
        trainable = [p for p in self.parameters() if p.requires_grad]  # BackboneFinetuning may freeze the body
        opt = torch.optim.AdamW(trainable, lr=hp.lr, weight_decay=hp.weight_decay)
        warmup, total = hp.warmup_steps, max(hp.total_steps, 1)

        def factor(step: int) -> float:
            if step < warmup:
                return (step + 1) / warmup
            progress = min((step - warmup) / max(total - warmup, 1), 1.0)
            return 0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * progress))

        sched = torch.optim.lr_scheduler.LambdaLR(opt, factor)
        return {"optimizer": opt, "lr_scheduler": {"scheduler": sched, "interval": "step"}}


# --- pretrained vs from scratch, over seeds ----------------------------------------------------------------


def run(
    seed: int,
    from_scratch: bool,
    model_dir: str,
    epochs: int,
    lr: float,
    train_per_class: int,
    modules: Sequence[str],
    root: str,
) -> tuple[float, float]:
    """(final val/f1, fit seconds) of one quiet run with the configs' other defaults."""
    ember.seed_everything(seed)
    data = StdlibLines(model_dir=model_dir, modules=modules, train_per_class=train_per_class)
    steps = epochs * math.ceil(len(data.modules) * data.train_per_class / data.batch_size)
    module = LineClassifier(
        model_dir=model_dir, num_classes=len(modules), from_scratch=from_scratch, lr=lr, total_steps=steps
    )
    trainer = ember.Trainer(
        max_epochs=epochs,
        logger=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        enable_checkpointing=False,
        default_root_dir=root,
    )
    start = time.perf_counter()
    trainer.fit(module, datamodule=data)
    return trainer.callback_metrics["val/f1"], time.perf_counter() - start


def main(argv: Sequence[str] | None = None) -> None:
    """Pretrained and from-scratch runs for each seed (same data, steps and optimizer); prints a table."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2, 3, 4])
    parser.add_argument("--model-dir", default="exports/hf_lm")
    parser.add_argument("--epochs", type=int, default=10)
    parser.add_argument("--lr", type=float, default=1e-3, help="learning rate of both runs")
    parser.add_argument("--train-per-class", type=int, default=64, help="training lines per module")
    parser.add_argument("--modules", nargs="+", default=list(DEFAULT_MODULES), help="standard-library modules")
    parser.add_argument("--scratch-lrs", type=float, nargs="*", default=[], help="also try these for scratch")
    args = parser.parse_args(argv)
    scratch_lrs = [args.lr, *args.scratch_lrs]
    columns = [f"pretrained, lr {args.lr:g}", *(f"from scratch, lr {lr:g}" for lr in scratch_lrs)]
    print("| seed (val/f1) | " + " | ".join(columns) + " |")
    print("|---" * (1 + len(columns)) + "|")
    totals: list[list[float]] = [[] for _ in range(1 + len(scratch_lrs))]
    seconds = 0.0
    for seed in args.seeds:
        settings = [(False, args.lr), *((True, lr) for lr in scratch_lrs)]
        row = [
            run(seed, scratch, args.model_dir, args.epochs, lr, args.train_per_class, args.modules, "runs/seeds")
            for scratch, lr in settings
        ]
        seconds += sum(s for _, s in row)
        for column, (f1, _) in zip(totals, row, strict=True):
            column.append(f1)
        print(f"| {seed} | " + " | ".join(f"{f1:.4f}" for f1, _ in row) + " |", flush=True)
    means = " | ".join(f"{sum(c) / len(c):.4f}" for c in totals)
    print(f"| mean | {means} |")
    print(f"{len(args.seeds) * len(totals)} fits in {seconds:.0f} s")


if __name__ == "__main__":
    main()
