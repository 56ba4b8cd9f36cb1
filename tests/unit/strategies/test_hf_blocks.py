"""Which submodules FSDP shards on their own: the transformer blocks of Hugging Face models (from transformers'
``_no_split_modules``), else the repeated blocks. The 2-process training runs are in
tests/distributed/test_hf_fsdp.py."""

from __future__ import annotations

import pytest
from torch import nn

from ember.strategies.fsdp import repeated_block_classes, transformer_block_classes

transformers = pytest.importorskip("transformers", reason="needs transformers: pip install 'ember[hf]'")


def gpt2() -> nn.Module:
    config = transformers.GPT2Config(
        vocab_size=32, n_positions=8, n_embd=16, n_layer=3, n_head=2, bos_token_id=0, eos_token_id=0
    )
    return transformers.GPT2LMHeadModel(config)


def bert() -> nn.Module:
    config = transformers.BertConfig(
        vocab_size=32, hidden_size=16, num_hidden_layers=2, num_attention_heads=2, intermediate_size=32
    )
    return transformers.BertForSequenceClassification(config)


class Wrapper(nn.Module):
    """A TrainingModule-like holder: the HF model one level down, plus a head of its own."""

    def __init__(self, model: nn.Module) -> None:
        super().__init__()
        self.model = model
        self.head = nn.Linear(2, 2)


def test_gpt2_and_bert_shard_per_transformer_block() -> None:
    assert [c.__name__ for c in transformer_block_classes(gpt2())] == ["GPT2Block"]
    assert [c.__name__ for c in transformer_block_classes(Wrapper(gpt2()))] == ["GPT2Block"]
    # BERT names BertEmbeddings too (keep it whole on one device); it occurs once and stays in the root.
    assert {c.__name__ for c in transformer_block_classes(bert())} == {"BertLayer"}
    assert {c.__name__ for c in transformer_block_classes(Wrapper(bert()))} == {"BertLayer"}


def test_the_generic_rule_would_shard_inside_the_blocks_too() -> None:
    # Why the HF rule comes first: every repeated class with children, attention and MLP included.
    names = {c.__name__ for c in repeated_block_classes(gpt2())}
    assert {"GPT2Block", "GPT2Attention", "GPT2MLP"} <= names


def test_models_without_hf_blocks_fall_back_to_repeated_blocks() -> None:
    class Block(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.linear = nn.Linear(4, 4)

    plain = nn.Sequential(Block(), Block(), nn.Linear(4, 2))
    assert transformer_block_classes(plain) == ()
    assert repeated_block_classes(plain) == (Block,)

    class OneLayer(nn.Module):  # declares a block class that occurs once: nothing to shard on its own
        _no_split_modules = ["Block"]

        def __init__(self) -> None:
            super().__init__()
            self.block = Block()

    assert transformer_block_classes(OneLayer()) == ()
