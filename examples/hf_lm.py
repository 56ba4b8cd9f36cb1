"""A Hugging Face GPT-2 language model, pretrained with ember on Python's own standard library (no download).

The text is the one the character transformer (`examples.char_transformer`) reads: the first
``max_bytes`` of the standard library's top-level ``*.py`` sources, the last ``val_fraction``
validating. A byte-level BPE tokenizer is trained on the *training* part with the ``tokenizers``
package (deterministically, in a fraction of a second, so the module and the data each build the
same one; `GPT2LM` also keeps a SHA-256 of it in its weights and refuses a checkpoint trained with
another). The model is ``transformers.GPT2LMHeadModel`` built from a ``GPT2Config``: no weights
are downloaded.

Validation logs ``val/loss`` (nats per token), ``val/ppl`` (perplexity per token) and ``val/bpb``
(bits per byte of text). Per-token numbers of different tokenizations do not compare: a BPE token
covers ~3.3 bytes here, so its perplexity is much higher than a byte model's while predicting the
same text better. Bits per byte do compare: the character transformer's ``val/loss / ln 2``.

    ember fit -c configs/hf_lm.yaml                                         # ~3 min on a 2-core CPU
    ember export --ckpt last -c configs/hf_lm.yaml --format hf --out exports  # -> exports/hf_lm/
    ember predict -c configs/hf_lm.yaml --ckpt-path last                    # samples from the prompts

``exports/hf_lm`` then loads without ember: ``AutoModelForCausalLM.from_pretrained("exports/hf_lm")``,
``AutoTokenizer.from_pretrained("exports/hf_lm")``; `examples.hf_classify` fine-tunes it.
"""

from __future__ import annotations

import functools
import hashlib
import math
from collections.abc import Sequence
from typing import Any

import torch
from torch import Tensor
from torch.nn import functional as F
from torch.utils.data import DataLoader, Dataset
from torchmetrics import Metric
from torchmetrics.text import Perplexity

import ember
from examples.char_transformer import Windows, read_text_bytes, stdlib_source_files

#: The tokenizer's one special token: end of text (also used for padding).
EOT = "<|endoftext|>"


# --- tokenizer ---------------------------------------------------------------------------------------------


def stdlib_split(max_bytes: int, val_fraction: float) -> tuple[bytes, bytes]:
    """(training bytes, validation bytes): the character transformer's text and split."""
    data = read_text_bytes(stdlib_source_files(), max_bytes)
    n_train = int(len(data) * (1 - val_fraction))
    return data[:n_train], data[n_train:]


def as_text(data: bytes) -> str:
    """Bytes as text for the tokenizer (a UTF-8 sequence cut at the split becomes U+FFFD)."""
    return data.decode("utf-8", errors="replace")


@functools.lru_cache(maxsize=4)
def stdlib_tokenizer(vocab_size: int, max_bytes: int, val_fraction: float) -> Any:
    """A byte-level BPE tokenizer (``PreTrainedTokenizerFast``) with `vocab_size` entries, trained on the
    training bytes of `stdlib_split`. The same arguments give the same tokenizer (tokenizers' BPE trainer
    is deterministic); the result is cached per process."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    train, _ = stdlib_split(max_bytes, val_fraction)
    text = as_text(train)
    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),  # every byte has a token: nothing is unknown
        special_tokens=[EOT],
        show_progress=False,
    )
    tokenizer.train_from_iterator((text[i : i + 10_000] for i in range(0, len(text), 10_000)), trainer)
    return PreTrainedTokenizerFast(tokenizer_object=tokenizer, bos_token=EOT, eos_token=EOT, pad_token=EOT)


def tokenizer_digest(tokenizer: Any) -> bytes:
    """SHA-256 of the tokenizer's JSON (vocabulary, merges and settings)."""
    return hashlib.sha256(tokenizer.backend_tokenizer.to_str().encode("utf-8")).digest()


def token_byte_lengths(tokenizer: Any, vocab_size: int) -> Tensor:
    """How many bytes of text each token id stands for (0 for special tokens and unused ids).

    In a byte-level BPE vocabulary every character of a token's string stands for exactly one byte.
    """
    lengths = torch.zeros(vocab_size, dtype=torch.long)
    special = set(tokenizer.all_special_ids)
    for token, index in tokenizer.get_vocab().items():
        if index < vocab_size and index not in special:
            lengths[index] = len(token)
    return lengths


def encode(tokenizer: Any, text: str) -> Tensor:
    """Token ids of `text` as a LongTensor."""
    return torch.tensor(tokenizer(text)["input_ids"], dtype=torch.long)


# --- data --------------------------------------------------------------------------------------------------


class StdlibTokens(ember.DataModule):
    """The character transformer's text as BPE tokens: windows of `seq_len` tokens (target: shifted by one).

    ``predict`` yields each prompt in `prompts` as a (1, len) batch of token ids.
    """

    def __init__(
        self,
        vocab_size: int = 2048,
        seq_len: int = 128,
        batch_size: int = 32,
        max_bytes: int = 1_000_000,
        val_fraction: float = 0.1,
        seed: int = 0,
        prompts: Sequence[str] = ("def ", "import ", "class "),
    ) -> None:
        self.vocab_size = vocab_size
        self.seq_len = seq_len
        self.batch_size = batch_size
        self.max_bytes = max_bytes
        self.val_fraction = val_fraction
        self.seed = seed
        self.prompts = list(prompts)
        self.train_tokens = torch.empty(0, dtype=torch.long)
        self.val_tokens = torch.empty(0, dtype=torch.long)
        self.val_bytes = 0

    def setup(self, stage: str) -> None:
        tokenizer = stdlib_tokenizer(self.vocab_size, self.max_bytes, self.val_fraction)
        train, val = stdlib_split(self.max_bytes, self.val_fraction)
        self.train_tokens, self.val_tokens = encode(tokenizer, as_text(train)), encode(tokenizer, as_text(val))
        self.val_bytes = len(val)
        self.tokenizer = tokenizer

    def bytes_per_token(self, split: str = "val") -> float:
        """Average bytes of text per token of the ``"train"`` or ``"val"`` part (call `setup` first)."""
        tokens = self.val_tokens if split == "val" else self.train_tokens
        lengths = token_byte_lengths(self.tokenizer, self.vocab_size)
        return float(lengths[tokens].sum()) / max(len(tokens), 1)

    def train_dataloader(self) -> DataLoader:
        generator = torch.Generator().manual_seed(self.seed)
        dataset = Windows(self.train_tokens, self.seq_len)
        return DataLoader(dataset, batch_size=self.batch_size, shuffle=True, drop_last=True, generator=generator)

    def val_dataloader(self) -> DataLoader:
        return DataLoader(Windows(self.val_tokens, self.seq_len), batch_size=64)

    def test_dataloader(self) -> DataLoader:
        return self.val_dataloader()

    def predict_dataloader(self) -> DataLoader:
        tokenizer = stdlib_tokenizer(self.vocab_size, self.max_bytes, self.val_fraction)
        prompts: Dataset[Tensor] = [encode(tokenizer, p) for p in self.prompts]  # type: ignore[assignment]
        return DataLoader(prompts, batch_size=1)


# --- model -------------------------------------------------------------------------------------------------


class BitsPerByte(Metric):
    """Cross-entropy summed over predicted tokens, divided by the bytes those tokens stand for, in bits.

    A ratio of sums (not a mean of per-batch ratios), synchronised across processes like any torchmetric.
    """

    higher_is_better = False
    full_state_update = False
    nats: Tensor
    bytes: Tensor

    def __init__(self) -> None:
        super().__init__()
        self.add_state("nats", default=torch.tensor(0.0, dtype=torch.float64), dist_reduce_fx="sum")
        self.add_state("bytes", default=torch.tensor(0, dtype=torch.long), dist_reduce_fx="sum")

    def update(self, logits: Tensor, targets: Tensor, token_bytes: Tensor) -> None:
        nll = F.cross_entropy(logits.flatten(0, 1).float(), targets.flatten(), reduction="sum")
        self.nats += nll.double()
        self.bytes += token_bytes[targets].sum()

    def compute(self) -> Tensor:
        return (self.nats / self.bytes.clamp(min=1) / math.log(2)).float()


class GPT2LM(ember.TrainingModule):
    """``transformers.GPT2LMHeadModel`` (from a ``GPT2Config``) trained as a causal LM on `StdlibTokens`.

    ``forward(tokens) -> logits`` of shape (batch, seq_len, vocab_size). ``self.tokenizer`` is the
    tokenizer it was trained with (``ember export --format hf`` saves it beside the model). The
    learning rate warms up for `warmup_steps`, then follows a cosine to 10% over `total_steps`.
    """

    token_bytes: Tensor
    tokenizer_sha256: Tensor

    def __init__(
        self,
        vocab_size: int = 2048,
        context: int = 128,
        n_embd: int = 128,
        n_layer: int = 3,
        n_head: int = 4,
        dropout: float = 0.0,
        lr: float = 3e-3,
        weight_decay: float = 0.1,
        warmup_steps: int = 50,
        total_steps: int = 1000,
        max_bytes: int = 1_000_000,
        val_fraction: float = 0.1,
        max_new_tokens: int = 60,
        temperature: float = 0.8,
        top_k: int = 40,
    ) -> None:
        super().__init__()
        self.save_hyperparameters()
        from transformers import GPT2Config, GPT2LMHeadModel

        self.tokenizer = stdlib_tokenizer(vocab_size, max_bytes, val_fraction)
        eot = self.tokenizer.convert_tokens_to_ids(EOT)
        config = GPT2Config(
            vocab_size=vocab_size,
            n_positions=context,
            n_embd=n_embd,
            n_layer=n_layer,
            n_head=n_head,
            resid_pdrop=dropout,
            embd_pdrop=dropout,
            attn_pdrop=dropout,
            bos_token_id=eot,
            eos_token_id=eot,
            pad_token_id=eot,
        )
        self.model: Any = GPT2LMHeadModel(config)
        self.register_buffer("token_bytes", token_byte_lengths(self.tokenizer, vocab_size), persistent=False)
        digest = torch.tensor(list(tokenizer_digest(self.tokenizer)), dtype=torch.uint8)
        self.register_buffer("tokenizer_sha256", digest)  # saved: a checkpoint names the tokenizer it needs
        self.val_ppl = Perplexity()
        self.val_bpb = BitsPerByte()
        example_gen = torch.Generator().manual_seed(0)
        self.example_input_array = torch.randint(0, vocab_size, (2, min(32, context)), generator=example_gen)

    def on_fit_start(self) -> None:
        self.check_tokenizer()

    def check_tokenizer(self) -> None:
        """Raise if the loaded weights were trained with another tokenizer than ``self.tokenizer``."""
        if bytes(self.tokenizer_sha256.tolist()) != tokenizer_digest(self.tokenizer):
            raise RuntimeError(
                "these weights were trained with another tokenizer than the one built from this module's "
                "arguments (vocab_size, max_bytes, val_fraction) on this Python's standard library; "
                "use the arguments and the Python version of the training run"
            )

    def forward(self, tokens: Tensor) -> Tensor:
        """Next-token logits, (batch, seq_len, vocab_size), for token ids of shape (batch, seq_len)."""
        return self.model(input_ids=tokens, use_cache=False).logits

    def training_step(self, batch: tuple[Tensor, Tensor], batch_idx: int) -> Tensor:
        inputs, targets = batch
        loss = F.cross_entropy(self(inputs).flatten(0, 1), targets.flatten())
        self.log("train/loss", loss, prog_bar=True)
        return loss

    def validation_step(self, batch: tuple[Tensor, Tensor], batch_idx: int, dataloader_idx: int = 0) -> Tensor:
        inputs, targets = batch
        logits = self(inputs)
        loss = F.cross_entropy(logits.flatten(0, 1).float(), targets.flatten())
        self.val_ppl.update(logits.float(), targets)
        self.val_bpb.update(logits, targets, self.token_bytes)
        self.log("val/loss", loss, prog_bar=True)
        self.log("val/ppl", self.val_ppl)
        self.log("val/bpb", self.val_bpb, prog_bar=True)
        return loss

    def test_step(self, batch: tuple[Tensor, Tensor], batch_idx: int, dataloader_idx: int = 0) -> Tensor:
        inputs, targets = batch
        logits = self(inputs)
        self.val_bpb.update(logits, targets, self.token_bytes)
        loss = F.cross_entropy(logits.flatten(0, 1).float(), targets.flatten())
        self.log("test/loss", loss)
        self.log("test/bpb", self.val_bpb)
        return loss

    def predict_step(self, batch: Tensor, batch_idx: int, dataloader_idx: int = 0) -> list[str]:
        """Each prompt of the batch followed by `max_new_tokens` sampled tokens, as text."""
        self.check_tokenizer()
        hp = self.hparams
        out = self.model.generate(
            batch,
            attention_mask=torch.ones_like(batch),
            max_new_tokens=min(hp.max_new_tokens, hp.context - batch.shape[1]),
            do_sample=True,
            temperature=hp.temperature,
            top_k=hp.top_k,
            pad_token_id=self.model.config.pad_token_id,
        )
        return self.tokenizer.batch_decode(out)

    def configure_optimizers(self) -> dict[str, Any]:
        hp = self.hparams
        decay = [p for p in self.parameters() if p.ndim >= 2]  # matrices and embeddings; not biases, norms
        no_decay = [p for p in self.parameters() if p.ndim < 2]
        groups = [{"params": decay, "weight_decay": hp.weight_decay}, {"params": no_decay, "weight_decay": 0.0}]
        opt = torch.optim.AdamW(groups, lr=hp.lr, betas=(0.9, 0.99))
        return {"optimizer": opt, "lr_scheduler": {"scheduler": warmup_cosine(opt, hp), "interval": "step"}}


def warmup_cosine(opt: torch.optim.Optimizer, hp: Any) -> torch.optim.lr_scheduler.LambdaLR:
    """Linear warm-up over ``hp.warmup_steps``, then a cosine to 10% at ``hp.total_steps``."""
    warmup, total = hp.warmup_steps, max(hp.total_steps, 1)

    def factor(step: int) -> float:
        if step < warmup:
            return (step + 1) / warmup
        progress = min((step - warmup) / max(total - warmup, 1), 1.0)
        return 0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * progress))

    return torch.optim.lr_scheduler.LambdaLR(opt, factor)


def main() -> None:
    """The run of configs/hf_lm.yaml, then its bits per byte beside the byte model's unigram entropy."""
    ember.seed_everything(0)
    data = StdlibTokens()
    module = GPT2LM(total_steps=600)
    trainer = ember.Trainer(max_steps=600, precision="bf16-mixed", log_every_n_steps=25)
    trainer.fit(module, datamodule=data)
    metrics = trainer.callback_metrics
    print(f"val/bpb {metrics['val/bpb']:.3f} bits/byte, val/ppl {metrics['val/ppl']:.1f} per token")


if __name__ == "__main__":
    main()
