"""A sentence-pair classifier with two validation splits and a warmup schedule sized by the trainer.

Follows the idioms of Lightning-AI/tutorials, lightning_examples/text-transformers/text-transformers.py
(``GLUEDataModule`` / ``GLUETransformer``, in its Lightning 2 form): a DataModule with ``prepare_data`` and
``setup`` that builds tokenised splits and exposes ``num_labels`` and ``eval_splits``, dict batches passed as
``self(**batch)``, ``validation_step(batch, batch_idx, dataloader_idx=0)`` over two validation dataloaders
whose outputs are kept per dataloader and reduced in ``on_validation_epoch_end``, no weight decay on biases and
LayerNorm weights, a linear warmup schedule sized by ``self.trainer.estimated_stepping_batches`` and returned
as ``[optimizer], [{"scheduler": ..., "interval": "step", "frequency": 1}]``, then ``trainer.validate``. A tiny
transformer encoder on a made-up vocabulary stands in for DistilBERT on MNLI.
"""

from __future__ import annotations

from collections import defaultdict

import torch
from lightning.pytorch import LightningDataModule, LightningModule, Trainer, seed_everything
from torch import nn
from torch.utils.data import DataLoader, Dataset

VOCAB = 50


class PairDataset(Dataset):
    """Token pairs; the label says whether the second sentence repeats the first one's leading token."""

    def __init__(self, features: dict[str, torch.Tensor]):
        self.features = features

    def __len__(self):
        return len(self.features["labels"])

    def __getitem__(self, index):
        return {k: v[index] for k, v in self.features.items()}


class GLUEDataModule(LightningDataModule):
    task_text_field_map = {"mnli": ["premise", "hypothesis"], "mrpc": ["sentence1", "sentence2"]}
    glue_task_num_labels = {"mnli": 3, "mrpc": 2}

    def __init__(self, task_name: str = "mnli", max_seq_length: int = 12, train_batch_size: int = 16, **kwargs):
        super().__init__()
        self.task_name = task_name
        self.max_seq_length = max_seq_length
        self.train_batch_size = train_batch_size
        self.eval_batch_size = train_batch_size
        self.text_fields = self.task_text_field_map[task_name]
        self.num_labels = self.glue_task_num_labels[task_name]

    def prepare_data(self):
        pass  # datasets.load_dataset(...) and the tokenizer download go here

    def _split(self, n: int, seed: int) -> dict[str, list]:
        g = torch.Generator().manual_seed(seed)
        first = torch.randint(3, VOCAB, (n, self.max_seq_length // 2), generator=g)
        second = torch.randint(3, VOCAB, (n, self.max_seq_length // 2), generator=g)
        labels = torch.randint(0, self.num_labels, (n,), generator=g)
        second[labels == 0, 0] = first[labels == 0, 0]
        return {self.text_fields[0]: first, self.text_fields[1]: second, "label": labels}

    def setup(self, stage: str):
        raw = {
            "train": self._split(64, 0),
            "validation_matched": self._split(16, 1),
            "validation_mismatched": self._split(16, 2),
        }
        self.dataset = {split: PairDataset(self.convert_to_features(batch)) for split, batch in raw.items()}
        self.eval_splits = [x for x in self.dataset if "validation" in x]

    def convert_to_features(self, example_batch):
        a, b = (example_batch[f] for f in self.text_fields)
        sep = torch.full((a.size(0), 1), 2)
        input_ids = torch.cat([torch.ones_like(sep), a, sep, b], dim=1)  # [CLS] a [SEP] b
        return {"input_ids": input_ids, "attention_mask": torch.ones_like(input_ids), "labels": example_batch["label"]}

    def train_dataloader(self):
        return DataLoader(self.dataset["train"], batch_size=self.train_batch_size, shuffle=True)

    def val_dataloader(self):
        if len(self.eval_splits) == 1:
            return DataLoader(self.dataset["validation"], batch_size=self.eval_batch_size)
        return [DataLoader(self.dataset[x], batch_size=self.eval_batch_size) for x in self.eval_splits]


class TinyEncoderForSequenceClassification(nn.Module):
    def __init__(self, num_labels: int, dim: int = 16):
        super().__init__()
        self.embeddings = nn.Embedding(VOCAB, dim)
        layer = nn.TransformerEncoderLayer(dim, nhead=2, dim_feedforward=32, dropout=0.1, batch_first=True)
        self.encoder = nn.TransformerEncoder(layer, num_layers=1, enable_nested_tensor=False)
        self.LayerNorm = nn.LayerNorm(dim)
        self.classifier = nn.Linear(dim, num_labels)

    def forward(self, input_ids, attention_mask, labels=None):
        hidden = self.encoder(self.embeddings(input_ids), src_key_padding_mask=attention_mask == 0)
        logits = self.classifier(self.LayerNorm(hidden[:, 0]))
        loss = nn.functional.cross_entropy(logits, labels) if labels is not None else None
        return loss, logits


class GLUETransformer(LightningModule):
    def __init__(
        self,
        num_labels: int,
        task_name: str,
        learning_rate: float = 3e-3,
        adam_epsilon: float = 1e-8,
        warmup_steps: int = 2,
        weight_decay: float = 0.01,
        train_batch_size: int = 16,
        eval_splits: list | None = None,
        **kwargs,
    ):
        super().__init__()
        self.save_hyperparameters()
        self.model = TinyEncoderForSequenceClassification(num_labels)
        self.outputs = defaultdict(list)

    def forward(self, **inputs):
        return self.model(**inputs)

    def training_step(self, batch, batch_idx):
        loss = self(**batch)[0]
        self.log("train_loss", loss)
        return loss

    def validation_step(self, batch, batch_idx, dataloader_idx=0):
        val_loss, logits = self(**batch)[:2]
        preds = torch.argmax(logits, axis=1)
        self.outputs[dataloader_idx].append({"loss": val_loss, "preds": preds, "labels": batch["labels"]})

    def on_validation_epoch_end(self):
        for dataloader_idx, outputs in self.outputs.items():
            split = self.hparams.eval_splits[dataloader_idx].rsplit("_", 1)[-1]  # matched / mismatched
            correct = torch.cat([(o["preds"] == o["labels"]).float() for o in outputs])
            self.log(f"val_loss_{split}", torch.stack([o["loss"] for o in outputs]).mean(), prog_bar=True)
            self.log_dict({f"accuracy_{split}": correct.mean()}, prog_bar=True)
        self.outputs.clear()

    def configure_optimizers(self):
        """AdamW without decay on biases and LayerNorm weights; linear warmup, then linear decay to zero at the
        last step the trainer will take."""
        no_decay = ("bias", "LayerNorm.weight")
        decayed, plain = [], []
        for name, param in self.model.named_parameters():
            (plain if name.endswith(no_decay) else decayed).append(param)
        optimizer = torch.optim.AdamW(
            [{"params": decayed, "weight_decay": self.hparams.weight_decay}, {"params": plain, "weight_decay": 0.0}],
            lr=self.hparams.learning_rate,
            eps=self.hparams.adam_epsilon,
        )
        total, warmup = self.trainer.estimated_stepping_batches, self.hparams.warmup_steps

        def factor(step: int) -> float:
            return step / max(1, warmup) if step < warmup else max(0.0, (total - step) / max(1, total - warmup))

        scheduler = {
            "scheduler": torch.optim.lr_scheduler.LambdaLR(optimizer, factor),
            "interval": "step",
            "frequency": 1,
        }
        return [optimizer], [scheduler]


def main(root_dir: str, callbacks=(), **trainer_options):
    seed_everything(42)
    dm = GLUEDataModule(task_name="mnli")
    dm.setup("fit")
    model = GLUETransformer(num_labels=dm.num_labels, eval_splits=dm.eval_splits, task_name=dm.task_name)
    trainer = Trainer(
        max_epochs=2,
        accelerator="cpu",
        devices=1,
        default_root_dir=root_dir,
        logger=False,
        enable_checkpointing=False,
        callbacks=list(callbacks),
        **trainer_options,
    )
    trainer.fit(model, datamodule=dm)
    results = trainer.validate(model, dm)
    return {"trainer": trainer, "model": model, "validate": results}
