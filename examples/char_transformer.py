"""A small decoder-only transformer language model on Python's own standard library (no download).

The text is the source of the top-level ``*.py`` modules of the running Python's standard library,
read at run time, as UTF-8 bytes: the vocabulary is the 256 byte values, so no tokenizer is needed
and every machine has the data. Causal self-attention goes through
`torch.nn.functional.scaled_dot_product_attention`.

Validation logs ``val/loss`` (nats per byte) and ``val/ppl`` (perplexity); compare the loss with the
unigram entropy of the same bytes (`StdlibText.unigram_entropy`), what a model that ignores context
could reach at best. ``predict`` samples text from prompts.

    ember fit -c configs/char_transformer.yaml                       # ~1.5 min on a 2-core CPU
    ember predict -c configs/char_transformer.yaml --ckpt-path last  # samples from the prompts
    python -m examples.char_transformer                              # the same fit, then samples

`CharTransformer.forward(tokens) -> logits` has no data-dependent control flow, so it exports
(TorchScript, ``torch.export``, ONNX); sampling lives in `CharTransformer.generate`.
"""

from __future__ import annotations

import math
import sysconfig
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch
from torch import Tensor, nn
from torch.nn import functional as F
from torch.utils.data import DataLoader, Dataset
from torchmetrics.text import Perplexity

import ember

#: Tokens are bytes.
VOCAB_SIZE = 256


# --- data ------------------------------------------------------------------------------------------------


def stdlib_source_files() -> list[Path]:
    """The top-level ``*.py`` files of this Python's standard library, in sorted (reproducible) order."""
    root = Path(sysconfig.get_paths()["stdlib"])
    files = sorted(root.glob("*.py"))
    if not files:
        raise FileNotFoundError(
            f"no standard-library sources (*.py) under {root}; this Python ships compiled modules only. "
            "Point StdlibText(files=[...]) at any text files instead"
        )
    return files


def read_text_bytes(files: Sequence[str | Path], max_bytes: int) -> bytes:
    """The files' contents joined by blank lines, cut at `max_bytes`."""
    parts: list[bytes] = []
    size = 0
    for path in files:
        if size >= max_bytes:
            break
        data = Path(path).read_bytes() + b"\n\n"
        parts.append(data)
        size += len(data)
    return b"".join(parts)[:max_bytes]


def encode(text: str) -> Tensor:
    """A string as a LongTensor of its UTF-8 bytes."""
    return torch.tensor(list(text.encode("utf-8")), dtype=torch.long)


def decode(tokens: Tensor) -> str:
    """Byte tokens back to text (invalid UTF-8 sequences become U+FFFD)."""
    return bytes(tokens.tolist()).decode("utf-8", errors="replace")


def unigram_entropy(tokens: Tensor) -> float:
    """Entropy in nats of the tokens' empirical distribution: the best loss of a model without context."""
    counts = torch.bincount(tokens, minlength=VOCAB_SIZE).double()
    p = counts[counts > 0] / counts.sum()
    return float(-(p * p.log()).sum())


class Windows(Dataset[tuple[Tensor, Tensor]]):
    """Non-overlapping windows of `seq_len` tokens; the target is the input shifted by one."""

    def __init__(self, tokens: Tensor, seq_len: int) -> None:
        self.tokens, self.seq_len = tokens, seq_len

    def __len__(self) -> int:
        return (len(self.tokens) - 1) // self.seq_len

    def __getitem__(self, index: int) -> tuple[Tensor, Tensor]:
        start = index * self.seq_len
        chunk = self.tokens[start : start + self.seq_len + 1]
        return chunk[:-1], chunk[1:]


class StdlibText(ember.DataModule):
    """Bytes of the standard library's sources: the first part trains, the last `val_fraction` validates.

    ``predict`` yields each prompt in `prompts` as a (1, len) batch of tokens.
    """

    def __init__(
        self,
        seq_len: int = 128,
        batch_size: int = 32,
        max_bytes: int = 1_000_000,
        val_fraction: float = 0.1,
        seed: int = 0,
        prompts: Sequence[str] = ("def ", "import ", "class "),
        files: Sequence[str] | None = None,
    ) -> None:
        self.seq_len = seq_len
        self.batch_size = batch_size
        self.max_bytes = max_bytes
        self.val_fraction = val_fraction
        self.seed = seed
        self.prompts = list(prompts)
        self.files = list(files) if files is not None else None
        self.train_tokens = torch.empty(0, dtype=torch.long)
        self.val_tokens = torch.empty(0, dtype=torch.long)

    def setup(self, stage: str) -> None:
        data = read_text_bytes(self.files if self.files is not None else stdlib_source_files(), self.max_bytes)
        tokens = torch.frombuffer(bytearray(data), dtype=torch.uint8).long()
        n_train = int(len(tokens) * (1 - self.val_fraction))
        self.train_tokens, self.val_tokens = tokens[:n_train], tokens[n_train:]

    def unigram_entropy(self, split: str = "val") -> float:
        """Unigram entropy (nats per byte) of the ``"train"`` or ``"val"`` bytes (call `setup` first)."""
        return unigram_entropy(self.val_tokens if split == "val" else self.train_tokens)

    def train_dataloader(self) -> DataLoader:
        generator = torch.Generator().manual_seed(self.seed)
        dataset = Windows(self.train_tokens, self.seq_len)
        return DataLoader(dataset, batch_size=self.batch_size, shuffle=True, drop_last=True, generator=generator)

    def val_dataloader(self) -> DataLoader:
        return DataLoader(Windows(self.val_tokens, self.seq_len), batch_size=64)

    def test_dataloader(self) -> DataLoader:
        return self.val_dataloader()

    def predict_dataloader(self) -> DataLoader:
        prompts: Dataset[Tensor] = [encode(p) for p in self.prompts]  # type: ignore[assignment]  # a list is a dataset
        return DataLoader(prompts, batch_size=1)


# --- model -----------------------------------------------------------------------------------------------


class CausalSelfAttention(nn.Module):
    """Multi-head self-attention where each position sees itself and the positions before it.

    The query, key and value projections are separate layers, so a tensor-parallel plan can split each by
    heads (`tensor_parallel_plan`); the forward then runs this process's heads, however many that is.
    """

    def __init__(self, d_model: int, n_heads: int, dropout: float) -> None:
        super().__init__()
        if d_model % n_heads:
            raise ValueError(f"d_model={d_model} must be a multiple of n_heads={n_heads}")
        self.head_dim = d_model // n_heads
        self.q = nn.Linear(d_model, d_model)
        self.k = nn.Linear(d_model, d_model)
        self.v = nn.Linear(d_model, d_model)
        self.proj = nn.Linear(d_model, d_model)
        self.dropout = dropout

    def forward(self, x: Tensor) -> Tensor:
        batch, seq, _ = x.shape
        shape = (batch, seq, -1, self.head_dim)  # -1: all heads, or this process's under tensor parallelism
        q = self.q(x).reshape(shape).transpose(1, 2)  # (batch, heads, seq, head_dim)
        k = self.k(x).reshape(shape).transpose(1, 2)
        v = self.v(x).reshape(shape).transpose(1, 2)
        y = F.scaled_dot_product_attention(q, k, v, dropout_p=self.dropout if self.training else 0.0, is_causal=True)
        return self.proj(y.transpose(1, 2).reshape(batch, seq, -1))


class Block(nn.Module):
    """Pre-norm transformer block: attention then a 4x MLP, each in a residual branch."""

    def __init__(self, d_model: int, n_heads: int, dropout: float) -> None:
        super().__init__()
        self.ln1 = nn.LayerNorm(d_model)
        self.attn = CausalSelfAttention(d_model, n_heads, dropout)
        self.ln2 = nn.LayerNorm(d_model)
        self.mlp = nn.Sequential(
            nn.Linear(d_model, 4 * d_model), nn.GELU(), nn.Linear(4 * d_model, d_model), nn.Dropout(dropout)
        )

    def forward(self, x: Tensor) -> Tensor:
        x = x + self.attn(self.ln1(x))
        return x + self.mlp(self.ln2(x))


def tensor_parallel_plan(n_layers: int, loss_parallel: bool = False) -> dict[str, Any]:
    """Megatron-style tensor parallelism for `CharTransformer`: in each block, the query, key, value and
    first MLP projections are split by output features (`ColwiseParallel`: each process computes its
    heads and its part of the hidden layer), the attention output and second MLP projections by input
    features (`RowwiseParallel`, whose outputs are summed over the processes). Each half of a block
    thus communicates once forward and once backward. Embeddings and norms stay replicated.

    With `loss_parallel` the output projection is split over the vocabulary and stays sharded (a DTensor)
    into the loss (``ModelParallelStrategy(loss_parallel=True)`` computes the cross-entropy in parallel).
    """
    from torch.distributed.tensor import Shard
    from torch.distributed.tensor.parallel import ColwiseParallel, ParallelStyle, RowwiseParallel

    plan: dict[str, ParallelStyle] = {}
    for i in range(n_layers):
        for name in ("attn.q", "attn.k", "attn.v", "mlp.0"):
            plan[f"blocks.{i}.{name}"] = ColwiseParallel()
        for name in ("attn.proj", "mlp.2"):
            plan[f"blocks.{i}.{name}"] = RowwiseParallel()
    if loss_parallel:
        plan["lm_head"] = ColwiseParallel(output_layouts=Shard(-1), use_local_output=False)
    return plan


class CharTransformer(ember.TrainingModule):
    """A decoder-only byte-level language model.

    ``forward(tokens)`` maps a (batch, seq_len) LongTensor of byte ids (seq_len <= `context`) to
    (batch, seq_len, 256) next-byte logits. The learning rate warms up for `warmup_steps` then follows
    a cosine to 10% over `total_steps` optimizer steps.
    """

    def __init__(
        self,
        context: int = 128,
        d_model: int = 128,
        n_heads: int = 4,
        n_layers: int = 2,
        dropout: float = 0.0,
        lr: float = 3e-3,
        weight_decay: float = 0.1,
        warmup_steps: int = 50,
        total_steps: int = 1000,
        max_new_tokens: int = 200,
        temperature: float = 0.8,
        top_k: int = 40,
    ) -> None:
        super().__init__()
        self.save_hyperparameters()
        self.context = context
        self.token_embedding = nn.Embedding(VOCAB_SIZE, d_model)
        self.position_embedding = nn.Embedding(context, d_model)
        self.blocks = nn.Sequential(*(Block(d_model, n_heads, dropout) for _ in range(n_layers)))
        self.ln_f = nn.LayerNorm(d_model)
        self.lm_head = nn.Linear(d_model, VOCAB_SIZE, bias=False)
        self.val_ppl = Perplexity()
        # Distinct random byte rows (a fixed generator), no longer than the context: exports trace and check on it.
        example_gen = torch.Generator().manual_seed(0)
        self.example_input_array = torch.randint(0, VOCAB_SIZE, (2, min(32, context)), generator=example_gen)

    def forward(self, tokens: Tensor) -> Tensor:
        """Next-token logits, (batch, seq_len, 256), for tokens of shape (batch, seq_len)."""
        positions = torch.arange(tokens.shape[1], device=tokens.device)
        x = self.token_embedding(tokens) + self.position_embedding(positions)
        return self.lm_head(self.ln_f(self.blocks(x)))

    def configure_model(self, device_mesh: Any) -> None:
        """Under ``ModelParallelStrategy``: split the blocks over the ``"tp"`` mesh dimension
        (`tensor_parallel_plan`); ember then shards the result with FSDP2 over ``"dp"``."""
        from torch.distributed.tensor.parallel import parallelize_module

        tp = device_mesh["tp"].size()
        if self.hparams.n_heads % tp:
            raise ValueError(f"n_heads={self.hparams.n_heads} must be a multiple of the tensor-parallel size {tp}")
        loss_parallel = bool(getattr(self.trainer.strategy, "loss_parallel", False))
        parallelize_module(self, device_mesh["tp"], tensor_parallel_plan(len(self.blocks), loss_parallel))

    def training_step(self, batch: tuple[Tensor, Tensor], batch_idx: int) -> Tensor:
        inputs, targets = batch
        loss = F.cross_entropy(self(inputs).flatten(0, 1), targets.flatten())
        self.log("train/loss", loss, prog_bar=True)
        return loss

    def validation_step(self, batch: tuple[Tensor, Tensor], batch_idx: int, dataloader_idx: int = 0) -> Tensor:
        inputs, targets = batch
        logits = self(inputs)
        loss = F.cross_entropy(logits.flatten(0, 1), targets.flatten())
        if callable(getattr(logits, "full_tensor", None)):  # sharded over the vocabulary (loss parallel)
            logits = logits.full_tensor()
        self.val_ppl.update(logits, targets)
        self.log("val/loss", loss, prog_bar=True)
        self.log("val/ppl", self.val_ppl, prog_bar=True)
        return loss

    def test_step(self, batch: tuple[Tensor, Tensor], batch_idx: int, dataloader_idx: int = 0) -> Tensor:
        inputs, targets = batch
        loss = F.cross_entropy(self(inputs).flatten(0, 1), targets.flatten())
        self.log("test/loss", loss)
        return loss

    def predict_step(self, batch: Tensor, batch_idx: int, dataloader_idx: int = 0) -> list[str]:
        """Each prompt of the batch followed by `max_new_tokens` sampled bytes, as text."""
        return [decode(row) for row in self.generate(batch, self.hparams.max_new_tokens)]

    @torch.no_grad()
    def generate(
        self,
        tokens: Tensor,
        max_new_tokens: int,
        temperature: float | None = None,
        top_k: int | None = None,
        generator: torch.Generator | None = None,
    ) -> Tensor:
        """Append `max_new_tokens` sampled tokens to `tokens` (batch, seq_len); returns the whole sequences.

        `temperature` and `top_k` default to the hyperparameters; ``top_k=0`` samples from all 256 bytes.
        """
        temperature = self.hparams.temperature if temperature is None else temperature
        top_k = self.hparams.top_k if top_k is None else top_k
        for _ in range(max_new_tokens):
            logits = self(tokens[:, -self.context :])[:, -1, :] / max(temperature, 1e-6)
            if top_k:
                kth = torch.topk(logits, min(top_k, VOCAB_SIZE)).values[:, -1:]
                logits = logits.masked_fill(logits < kth, -math.inf)
            next_token = torch.multinomial(F.softmax(logits, dim=-1), 1, generator=generator)
            tokens = torch.cat([tokens, next_token], dim=1)
        return tokens

    def configure_optimizers(self) -> dict[str, Any]:
        decay = [p for p in self.parameters() if p.ndim >= 2]  # matrices and embeddings; not biases, norms
        no_decay = [p for p in self.parameters() if p.ndim < 2]
        groups = [{"params": decay, "weight_decay": self.hparams.weight_decay}, {"params": no_decay, "weight_decay": 0}]
        opt = torch.optim.AdamW(groups, lr=self.hparams.lr, betas=(0.9, 0.99))
        warmup, total = self.hparams.warmup_steps, max(self.hparams.total_steps, 1)

        def factor(step: int) -> float:
            if step < warmup:
                return (step + 1) / warmup
            progress = min((step - warmup) / max(total - warmup, 1), 1.0)
            return 0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * progress))

        sched = torch.optim.lr_scheduler.LambdaLR(opt, factor)
        return {"optimizer": opt, "lr_scheduler": {"scheduler": sched, "interval": "step"}}


def main() -> None:
    """The run of configs/char_transformer.yaml (~1.5 minutes on a CPU), then the samples of its prompts."""
    ember.seed_everything(0)
    data = StdlibText()
    module = CharTransformer(n_layers=3, total_steps=600)
    trainer = ember.Trainer(max_steps=600, limit_val_batches=20, log_every_n_steps=25)
    trainer.fit(module, datamodule=data)
    print(f"val/loss {trainer.callback_metrics['val/loss']:.3f} nats/byte, unigram {data.unigram_entropy():.3f}")
    for (text,) in trainer.predict(module, datamodule=data):
        print(f"{text}\n---")


if __name__ == "__main__":
    main()
