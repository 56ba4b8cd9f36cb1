"""FSDP2 on Hugging Face models: ``strategy=fsdp`` shards a GPT-2 per ``GPT2Block`` and a BERT per ``BertLayer``
(found through transformers' ``_no_split_modules``), and trains them as DDP does: 2 gloo processes, the same
data and seeds, final weights, per-step losses and the validation loss compared with the DDP run of the same job.
The steps call ``self.model(...)`` directly, as Hugging Face code does, not the module's ``forward``.

The blocks-found rule itself is tested without processes in tests/unit/strategies/test_hf_blocks.py.
"""

from __future__ import annotations

from pathlib import Path

import dist_harness as harness
import pytest
import torch

pytest.importorskip("transformers", reason="the Hugging Face FSDP test needs transformers: pip install 'ember[hf]'")

pytestmark = [pytest.mark.distributed, pytest.mark.slow]

HF_SCRIPT = """\
import sys
from pathlib import Path

import torch
import transformers
from torch.distributed.fsdp import FSDPModule
from torch.utils.data import DataLoader, TensorDataset

import dist_workload as W
import ember

transformers.utils.logging.set_verbosity_error()
VOCAB, LENGTH = 64, 16


class LM(ember.TrainingModule):
    def __init__(self):
        super().__init__()
        config = transformers.GPT2Config(
            vocab_size=VOCAB, n_positions=LENGTH, n_embd=32, n_layer=2, n_head=2,
            resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0, bos_token_id=0, eos_token_id=0,
        )
        self.model = transformers.GPT2LMHeadModel(config)
        self.losses = []

    def training_step(self, batch, batch_idx):
        (tokens,) = batch
        loss = self.model(input_ids=tokens, labels=tokens).loss
        self.losses.append(float(loss.detach()))
        return loss

    def validation_step(self, batch, batch_idx):
        (tokens,) = batch
        self.log("val/loss", self.model(input_ids=tokens, labels=tokens).loss, sync_dist=True)

    def configure_optimizers(self):
        return torch.optim.AdamW(self.parameters(), lr=1e-2)


class Classifier(ember.TrainingModule):
    def __init__(self):
        super().__init__()
        config = transformers.BertConfig(
            vocab_size=VOCAB, hidden_size=32, num_hidden_layers=2, num_attention_heads=2, intermediate_size=64,
            max_position_embeddings=LENGTH, num_labels=3, hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0,
        )
        self.model = transformers.BertForSequenceClassification(config)
        self.losses = []

    def training_step(self, batch, batch_idx):
        tokens, labels = batch
        loss = self.model(input_ids=tokens, labels=labels).loss
        self.losses.append(float(loss.detach()))
        return loss

    def validation_step(self, batch, batch_idx):
        tokens, labels = batch
        self.log("val/loss", self.model(input_ids=tokens, labels=labels).loss, sync_dist=True)

    def configure_optimizers(self):
        return torch.optim.AdamW(self.parameters(), lr=1e-2)


def data(kind):
    # Learnable: each row counts up from a random start; the class is the start modulo 3.
    start = torch.randint(0, VOCAB, (64, 1), generator=torch.Generator().manual_seed(7))
    tokens = (start + torch.arange(LENGTH)) % VOCAB
    if kind == "gpt2":
        return TensorDataset(tokens)
    return TensorDataset(tokens, start[:, 0] % 3)


def fit(kind, strategy):
    torch.manual_seed(0)
    module = LM() if kind == "gpt2" else Classifier()
    trainer = ember.Trainer(max_epochs=2, strategy=strategy, devices=2, enable_checkpointing=False, **W.QUIET)
    train = DataLoader(data(kind), batch_size=4, shuffle=True, generator=torch.Generator())
    # Validation (also before training: the sanity check) calls self.model, never the root's forward.
    trainer.fit(module, train, DataLoader(data(kind), batch_size=8))
    units = [name for name, m in module.named_modules() if isinstance(m, FSDPModule)]
    block = module.model.transformer.h[0].mlp.c_fc.weight if kind == "gpt2" else (
        module.model.bert.encoder.layer[0].intermediate.dense.weight
    )
    local = block.to_local() if hasattr(block, "to_local") else block
    return {
        "params": W.full_state(module),
        "losses": module.losses,
        "units": units,
        "block_shapes": (tuple(local.shape), tuple(block.shape)),
        "steps": trainer.global_step,
        "val_loss": trainer.callback_metrics["val/loss"],
    }


out = Path(sys.argv[1])
for kind in ("gpt2", "bert"):
    for name, make in (("ddp", W.ddp), ("fsdp", W.fsdp)):
        W.section(out, f"{kind}_{name}", lambda: fit(kind, make()))
"""

EXPECTED_UNITS = {
    "gpt2": ["", "model.transformer.h.0", "model.transformer.h.1"],
    "bert": ["", "model.bert.encoder.layer.0", "model.bert.encoder.layer.1"],
}
BLOCK_SHAPES = {"gpt2": ((16, 128), (32, 128)), "bert": ((32, 32), (64, 32))}  # (this rank's shard, whole)


@pytest.fixture(scope="module")
def job(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, harness.Finished]:
    directory = tmp_path_factory.mktemp("hf_fsdp")
    script = harness.write_script(directory, HF_SCRIPT)
    return directory / "out", harness.run(harness.spawn(script, str(directory / "out")), directory, timeout=300)


@pytest.mark.parametrize("kind", ["gpt2", "bert"])
def test_fsdp_shards_a_hf_model_per_block_and_trains_as_ddp_does(job: tuple[Path, harness.Finished], kind: str) -> None:
    out, finished = job
    ddp = harness.results(out, f"{kind}_ddp", 2, finished)
    fsdp = harness.results(out, f"{kind}_fsdp", 2, finished)
    for rank in range(2):
        assert fsdp[rank]["units"] == EXPECTED_UNITS[kind]  # the root and one unit per transformer block
        assert ddp[rank]["units"] == []
        assert fsdp[rank]["block_shapes"] == BLOCK_SHAPES[kind]  # a block's weight: half its rows on each rank
        assert ddp[rank]["block_shapes"][0] == ddp[rank]["block_shapes"][1]  # DDP: every rank holds it whole
        assert fsdp[rank]["steps"] == ddp[rank]["steps"] == 16  # 64 samples, 2 ranks x batch 4, 2 epochs
        # Same data on each rank under both strategies, the same updates up to float summation order.
        torch.testing.assert_close(
            torch.tensor(fsdp[rank]["losses"]), torch.tensor(ddp[rank]["losses"]), rtol=1e-4, atol=1e-5
        )
        assert fsdp[rank]["val_loss"] == pytest.approx(ddp[rank]["val_loss"], rel=1e-4)
    assert fsdp[0]["losses"] != fsdp[1]["losses"]  # the ranks saw different halves of the data
    harness.assert_params_equal(ddp[0]["params"], ddp[1]["params"], f"{kind}: DDP replicas")
    harness.assert_params_equal(fsdp[0]["params"], fsdp[1]["params"], f"{kind}: FSDP gathered on both ranks")
    assert ddp[0]["params"].keys() == fsdp[0]["params"].keys()
    for key in ddp[0]["params"]:
        torch.testing.assert_close(fsdp[0]["params"][key], ddp[0]["params"][key], rtol=1e-4, atol=1e-5, msg=key)
    # Training moved the weights well beyond that tolerance, so the comparison means something.
    first, last = ddp[0]["losses"][0], ddp[0]["losses"][-1]
    assert last < first - 0.1, (first, last)
