"""A word-level LSTM language model with truncated backprop through time, on Python's own sources.

The recurrent state is carried from one batch to the next: the text is cut into `batch_size` long
columns, each batch is the next `bptt` rows of all columns, and the LSTM's hidden state at the end of
one batch is the start of the next (detached, so gradients stop at the batch boundary). This is the
setting of the classic word-language-model scripts, written here as an ember module:

- the training hidden state lives on the module (`WordLSTM.train_hidden`); the first batch of an epoch
  (``batch_idx == 0``) starts from zeros;
- validation keeps its own state (`WordLSTM.eval_hidden`, also from zeros at its first batch), so a
  validation in the middle of an epoch (``val_check_interval``) does not disturb the training state;
- the training state goes into checkpoints (`on_save_checkpoint` / `on_load_checkpoint`), so a run
  resumed inside an epoch continues exactly (its first batch then has ``batch_idx > 0``);
- the training DataLoader has its own ``generator``, so iterating it does not draw from the global RNG
  that dropout uses (see "Porting a script exactly" in docs/trainer.md).

The text is the top-level ``*.py`` modules of the running Python's standard library (no download),
split into identifiers, numbers and single punctuation characters, with ``<eos>`` at each line end.

    ember fit -c configs/word_lm.yaml
    python -m examples.word_lm
"""

from __future__ import annotations

import math
import re
from collections import Counter
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch
from torch import Tensor, nn
from torch.nn import functional as F
from torch.utils.data import DataLoader, Dataset

import ember
from examples.char_transformer import read_text_bytes, stdlib_source_files

UNK, EOS = "<unk>", "<eos>"
_TOKEN = re.compile(r"\w+|\S")

Hidden = tuple[Tensor, Tensor]


# --- data ------------------------------------------------------------------------------------------------


def tokenize(text: str) -> list[str]:
    """Identifiers/numbers and single punctuation characters, with `EOS` after every line."""
    return [token for line in text.splitlines() for token in (*_TOKEN.findall(line), EOS)]


def build_vocab(tokens: Sequence[str], size: int) -> dict[str, int]:
    """Token -> id: `UNK` is 0, then the ``size - 1`` most frequent tokens (ties: first seen first)."""
    if size < 2:
        raise ValueError(f"vocab_size={size}: use at least 2 (<unk> and one token)")
    words = [w for w, _ in Counter(t for t in tokens if t != UNK).most_common(size - 1)]
    return {word: i for i, word in enumerate([UNK, *words])}


def numericalize(tokens: Sequence[str], vocab: dict[str, int]) -> Tensor:
    """Token ids as a LongTensor; tokens outside `vocab` become `UNK`."""
    unk = vocab[UNK]
    return torch.tensor([vocab.get(t, unk) for t in tokens], dtype=torch.long)


def batchify(ids: Tensor, batch_size: int) -> Tensor:
    """Cut `ids` into `batch_size` equal columns: a (rows, batch_size) tensor; the remainder is dropped."""
    rows = len(ids) // batch_size
    if rows < 2:
        raise ValueError(f"{len(ids)} tokens are too few for batch_size={batch_size}; use more text")
    return ids[: rows * batch_size].view(batch_size, rows).t().contiguous()


class BpttChunks(Dataset[tuple[Tensor, Tensor]]):
    """Item i is rows ``[i*bptt, i*bptt + bptt)`` of a batchified matrix and the same rows shifted by one.

    Each item is already a batch of shape (seq_len, batch_size) (the last may be shorter): load it with
    ``DataLoader(chunks, batch_size=None)`` and keep the order (no shuffling) so the hidden state carries over.
    """

    def __init__(self, data: Tensor, bptt: int) -> None:
        if bptt < 1:
            raise ValueError(f"bptt={bptt} must be at least 1")
        self.data, self.bptt = data, bptt

    def __len__(self) -> int:
        return math.ceil((len(self.data) - 1) / self.bptt)

    def __getitem__(self, index: int) -> tuple[Tensor, Tensor]:
        start = index * self.bptt
        if not 0 <= start < len(self.data) - 1:
            raise IndexError(index)
        seq_len = min(self.bptt, len(self.data) - 1 - start)
        return self.data[start : start + seq_len], self.data[start + 1 : start + 1 + seq_len]


class StdlibWords(ember.DataModule):
    """Word tokens of the standard library's sources: the first part trains, the last `val_fraction` validates.

    The vocabulary is ``<unk>`` and the ``vocab_size - 1`` most frequent training tokens; other tokens
    become ``<unk>``. The model's output size is `vocab_size` (``module.vocab_size: ${data.vocab_size}``).
    Training batches are (bptt, batch_size) chunks in order; validation uses `eval_batch_size` columns.
    """

    def __init__(
        self,
        batch_size: int = 20,
        eval_batch_size: int = 10,
        bptt: int = 35,
        max_bytes: int = 600_000,
        val_fraction: float = 0.1,
        vocab_size: int = 10_000,
        seed: int = 0,
        files: Sequence[str] | None = None,
    ) -> None:
        self.batch_size = batch_size
        self.eval_batch_size = eval_batch_size
        self.bptt = bptt
        self.max_bytes = max_bytes
        self.val_fraction = val_fraction
        self.vocab_size = vocab_size
        self.seed = seed
        self.files = list(files) if files is not None else None
        self.vocab: dict[str, int] = {}
        self.train_ids = torch.empty(0, dtype=torch.long)
        self.val_ids = torch.empty(0, dtype=torch.long)

    def setup(self, stage: str) -> None:
        if self.vocab:
            return  # read once; fit, validate and test share it
        files: Sequence[str | Path] = self.files if self.files is not None else stdlib_source_files()
        tokens = tokenize(read_text_bytes(files, self.max_bytes).decode("utf-8", errors="replace"))
        n_train = int(len(tokens) * (1 - self.val_fraction))
        self.vocab = build_vocab(tokens[:n_train], self.vocab_size)
        self.train_ids = numericalize(tokens[:n_train], self.vocab)
        self.val_ids = numericalize(tokens[n_train:], self.vocab)

    def train_dataloader(self) -> DataLoader:
        # Its own generator: iterating a DataLoader without one draws a seed from the global RNG that
        # dropout also uses, and a script without a DataLoader would not make that draw.
        generator = torch.Generator().manual_seed(self.seed)
        chunks = BpttChunks(batchify(self.train_ids, self.batch_size), self.bptt)
        return DataLoader(chunks, batch_size=None, generator=generator)

    def val_dataloader(self) -> DataLoader:
        return DataLoader(BpttChunks(batchify(self.val_ids, self.eval_batch_size), self.bptt), batch_size=None)

    def test_dataloader(self) -> DataLoader:
        return self.val_dataloader()


# --- model -----------------------------------------------------------------------------------------------


class LSTMLanguageModel(nn.Module):
    """Embedding -> dropout -> multi-layer LSTM -> dropout -> linear decoder over the vocabulary.

    ``forward(tokens, hidden)`` maps (seq_len, batch) ids and an (h, c) state to (seq_len, batch, vocab)
    logits and the new state. ``tied=True`` shares the embedding and decoder weights (needs
    ``embedding_dim == hidden_size``).
    """

    def __init__(
        self, vocab_size: int, embedding_dim: int, hidden_size: int, num_layers: int, dropout: float, tied: bool
    ) -> None:
        super().__init__()
        if tied and embedding_dim != hidden_size:
            raise ValueError(f"tied=True needs embedding_dim == hidden_size; got {embedding_dim} and {hidden_size}")
        self.num_layers, self.hidden_size = num_layers, hidden_size
        self.drop = nn.Dropout(dropout)
        self.encoder = nn.Embedding(vocab_size, embedding_dim)
        self.rnn = nn.LSTM(embedding_dim, hidden_size, num_layers, dropout=dropout)
        self.decoder = nn.Linear(hidden_size, vocab_size)
        nn.init.uniform_(self.encoder.weight, -0.1, 0.1)
        nn.init.uniform_(self.decoder.weight, -0.1, 0.1)
        nn.init.zeros_(self.decoder.bias)
        if tied:
            self.decoder.weight = self.encoder.weight

    def forward(self, tokens: Tensor, hidden: Hidden) -> tuple[Tensor, Hidden]:
        output, (h, c) = self.rnn(self.drop(self.encoder(tokens)), hidden)
        return self.decoder(self.drop(output)), (h, c)

    def init_hidden(self, batch_size: int) -> Hidden:
        """A zero (h, c) state for `batch_size` columns, on the parameters' device and dtype."""
        weight = self.decoder.weight
        shape = (self.num_layers, batch_size, self.hidden_size)
        return weight.new_zeros(shape), weight.new_zeros(shape)


class WordLSTM(ember.TrainingModule):
    """An LSTM language model trained with truncated BPTT, its hidden state carried across batches.

    SGD at `lr` with gradients clipped by the trainer (``gradient_clip_val``); the learning rate is
    divided by 4 at the end of an epoch whose last ``val/loss`` is not below the best so far
    (``ReduceLROnPlateau(factor=0.25, patience=0, threshold=0)``).
    ``val/loss`` is the mean loss per token (each batch weighted by its length); its exponential is the
    perplexity.
    """

    def __init__(
        self,
        vocab_size: int,
        embedding_dim: int = 128,
        hidden_size: int = 128,
        num_layers: int = 2,
        dropout: float = 0.2,
        tied: bool = False,
        lr: float = 20.0,
    ) -> None:
        super().__init__()
        self.save_hyperparameters()
        self.model = LSTMLanguageModel(vocab_size, embedding_dim, hidden_size, num_layers, dropout, tied)
        #: The training state after the latest batch (None: start from zeros).
        self.train_hidden: Hidden | None = None
        #: The evaluation state after the latest validation/test batch.
        self.eval_hidden: Hidden | None = None

    def forward(self, tokens: Tensor, hidden: Hidden | None = None) -> tuple[Tensor, Hidden]:
        """(logits, new state) for (seq_len, batch) token ids; `hidden` None starts from zeros."""
        return self.model(tokens, hidden if hidden is not None else self.model.init_hidden(tokens.shape[1]))

    def _loss(self, logits: Tensor, targets: Tensor) -> Tensor:
        return F.cross_entropy(logits.view(-1, logits.shape[-1]), targets.reshape(-1))

    def training_step(self, batch: tuple[Tensor, Tensor], batch_idx: int) -> Tensor:
        inputs, targets = batch
        logits, hidden = self(inputs, self.train_hidden if batch_idx > 0 else None)
        self.train_hidden = (hidden[0].detach(), hidden[1].detach())  # backprop stops at the batch boundary
        loss = self._loss(logits, targets)
        self.log("train/loss", loss, prog_bar=True)
        return loss

    def _eval_step(self, stage: str, batch: tuple[Tensor, Tensor], batch_idx: int) -> Tensor:
        inputs, targets = batch
        logits, self.eval_hidden = self(inputs, self.eval_hidden if batch_idx > 0 else None)
        loss = self._loss(logits, targets)
        self.log(f"{stage}/loss", loss, prog_bar=True, batch_size=len(inputs))  # weighted by the chunk's length
        return loss

    def validation_step(self, batch: tuple[Tensor, Tensor], batch_idx: int, dataloader_idx: int = 0) -> Tensor:
        return self._eval_step("val", batch, batch_idx)

    def test_step(self, batch: tuple[Tensor, Tensor], batch_idx: int, dataloader_idx: int = 0) -> Tensor:
        return self._eval_step("test", batch, batch_idx)

    def on_save_checkpoint(self, checkpoint: dict[str, Any]) -> None:
        # A checkpoint inside an epoch carries the state the next batch starts from.
        checkpoint["word_lm_hidden"] = None if self.train_hidden is None else [t.clone() for t in self.train_hidden]

    def on_load_checkpoint(self, checkpoint: dict[str, Any]) -> None:
        saved = checkpoint.get("word_lm_hidden")
        self.train_hidden = None if saved is None else (saved[0].to(self.device), saved[1].to(self.device))

    def configure_optimizers(self) -> dict[str, Any]:
        opt = torch.optim.SGD(self.parameters(), lr=self.hparams.lr)
        plateau = torch.optim.lr_scheduler.ReduceLROnPlateau(opt, mode="min", factor=0.25, patience=0, threshold=0)
        return {"optimizer": opt, "lr_scheduler": {"scheduler": plateau, "monitor": "val/loss"}}


def main() -> None:
    """The run of configs/word_lm.yaml: two epochs, validating twice an epoch."""
    ember.seed_everything(0)
    data = StdlibWords()
    module = WordLSTM(data.vocab_size)
    trainer = ember.Trainer(max_epochs=2, gradient_clip_val=0.25, val_check_interval=0.5)
    trainer.fit(module, datamodule=data)
    loss = trainer.callback_metrics["val/loss"]
    print(f"val/loss {loss:.3f} nats/token, perplexity {math.exp(loss):.1f}")


if __name__ == "__main__":
    main()
