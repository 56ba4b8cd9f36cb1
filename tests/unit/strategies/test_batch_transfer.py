"""`move_to_device` and `cast_floating` on every batch type a DataLoader or a collator yields.

The target device is ``meta``: a tensor that was moved reports ``device.type == "meta"``, one that was skipped
stays on the CPU, so these run without a GPU and still tell which leaves would have reached it.
"""

from __future__ import annotations

import dataclasses
import types
from collections import OrderedDict, UserDict, defaultdict, namedtuple
from collections.abc import Iterator, Mapping
from typing import Any

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from torch import Tensor

from ember.strategies.precision import cast_floating
from ember.strategies.strategy import Strategy, move_to_device

META = torch.device("meta")
Pair = namedtuple("Pair", ["inputs", "target"])


@dataclasses.dataclass
class Batch:
    inputs: Tensor
    extra: dict[str, Any]
    name: str = "b"


@dataclasses.dataclass(frozen=True)
class FrozenBatch:
    inputs: Tensor
    cached: Tensor = dataclasses.field(init=False)

    def __post_init__(self) -> None:
        object.__setattr__(self, "cached", self.inputs * 2)


class ReadOnly(Mapping[str, Any]):
    """A mapping that cannot be built from a dict."""

    def __init__(self, *items: tuple[str, Any]) -> None:
        self._items = dict(items)

    def __getitem__(self, key: str) -> Any:
        return self._items[key]

    def __iter__(self) -> Iterator[str]:
        return iter(self._items)

    def __len__(self) -> int:
        return len(self._items)


class Graph:
    """A user type that moves itself (as torch_geometric's ``Data`` does)."""

    def __init__(self, x: Tensor) -> None:
        self.x = x

    def to(self, device: torch.device) -> Graph:
        return Graph(self.x.to(device))


def tensor_leaves(batch: Any) -> list[Tensor]:
    """Every tensor in `batch`, found without `map_tensors` (so a bug there cannot hide one)."""
    if isinstance(batch, Tensor):
        return [batch]
    if isinstance(batch, (Mapping, UserDict)):
        return [t for v in batch.values() for t in tensor_leaves(v)]
    if isinstance(batch, (list, tuple)):
        return [t for v in batch for t in tensor_leaves(v)]
    if dataclasses.is_dataclass(batch):
        return [t for f in dataclasses.fields(batch) for t in tensor_leaves(getattr(batch, f.name))]
    if isinstance(batch, Graph):
        return [batch.x]
    return []


def shape_of(batch: Any) -> Any:
    """The container types and non-tensor values of `batch`, with each tensor replaced by its shape and dtype."""
    if isinstance(batch, Tensor):
        return ("tensor", tuple(batch.shape), batch.dtype)
    if isinstance(batch, (Mapping, UserDict)):
        return (type(batch), [(k, shape_of(v)) for k, v in batch.items()])
    if isinstance(batch, (list, tuple)):
        return (type(batch), [shape_of(v) for v in batch])
    if dataclasses.is_dataclass(batch):
        return (type(batch), [shape_of(getattr(batch, f.name)) for f in dataclasses.fields(batch)])
    if isinstance(batch, Graph):
        return (Graph, shape_of(batch.x))
    return batch


def assert_moved(before: Any, after: Any) -> None:
    assert shape_of(after) == shape_of(before)
    assert tensor_leaves(after), "the batch held no tensor"
    assert [t.device.type for t in tensor_leaves(after)] == ["meta"] * len(tensor_leaves(before))
    assert all(t.device.type == "cpu" for t in tensor_leaves(before)), "the batch given was changed"


BATCHES = {
    "dict": lambda: {"x": torch.ones(2), "y": torch.zeros(2, dtype=torch.long), "note": "text"},
    "OrderedDict": lambda: OrderedDict(x=torch.ones(2), y=[torch.ones(1), 3]),
    "UserDict": lambda: UserDict(x=torch.ones(2), y={"z": torch.ones(1)}),
    "MappingProxyType": lambda: types.MappingProxyType({"x": torch.ones(2)}),
    "list": lambda: [torch.ones(2), (torch.ones(1), None)],
    "tuple": lambda: (torch.ones(2), torch.ones(3)),
    "namedtuple": lambda: Pair(torch.ones(2), torch.zeros(2, dtype=torch.long)),
    "dataclass": lambda: Batch(torch.ones(2), {"mask": torch.ones(2, dtype=torch.bool)}),
    "frozen dataclass": lambda: FrozenBatch(torch.ones(2)),
    "object with .to": lambda: [Graph(torch.ones(2)), torch.ones(1)],
    "nested": lambda: {"a": [Pair(Batch(torch.ones(1), {}), UserDict(k=(torch.ones(1),)))], "b": OrderedDict()},
}


@pytest.mark.parametrize("kind", list(BATCHES))
def test_every_tensor_of_every_batch_type_reaches_the_device_and_types_stay(kind: str) -> None:
    batch = BATCHES[kind]()
    assert_moved(batch, move_to_device(batch, META))


def test_a_strategy_moves_the_batch_types_too() -> None:
    batch = BATCHES["nested"]()
    assert_moved(batch, Strategy(META).batch_to_device(batch))


def test_defaultdict_keeps_its_factory_and_frozen_dataclass_its_derived_field() -> None:
    batch: defaultdict[str, Any] = defaultdict(list, x=torch.ones(1))
    moved = move_to_device(batch, META)
    assert type(moved) is defaultdict and moved.default_factory is list
    assert moved["x"].device == META and moved["missing"] == []
    frozen = move_to_device(FrozenBatch(torch.ones(2)), META)
    assert frozen.cached.device == META  # derived again by __post_init__ from the moved field


def test_a_mapping_that_cannot_be_built_from_a_dict_becomes_a_dict() -> None:
    moved = move_to_device(ReadOnly(("x", torch.ones(2)), ("n", 1)), META)
    assert type(moved) is dict and moved["x"].device == META and moved["n"] == 1


def test_a_packed_sequence_moves_itself_and_keeps_batch_sizes_on_the_cpu() -> None:
    packed = torch.nn.utils.rnn.pack_sequence([torch.ones(3), torch.ones(2)])
    moved = move_to_device(packed, META)
    assert type(moved) is torch.nn.utils.rnn.PackedSequence
    assert moved.data.device == META and moved.batch_sizes.device.type == "cpu"  # what PackedSequence.to does


def test_a_hugging_face_collator_batch_stays_a_batch_encoding_on_the_device() -> None:
    tokenizers = pytest.importorskip("tokenizers", reason="the Hugging Face tokenizers package is not installed")
    transformers = pytest.importorskip("transformers", reason="transformers is not installed")
    vocab = {"[PAD]": 0, "[UNK]": 1, "a": 2, "b": 3}
    backend = tokenizers.Tokenizer(tokenizers.models.WordLevel(vocab, unk_token="[UNK]"))
    backend.pre_tokenizer = tokenizers.pre_tokenizers.Whitespace()
    tokenizer = transformers.PreTrainedTokenizerFast(tokenizer_object=backend, pad_token="[PAD]", unk_token="[UNK]")
    collate = transformers.DataCollatorWithPadding(tokenizer, return_tensors="pt")
    batch = collate([tokenizer("a b a"), tokenizer("b")])
    assert type(batch) is transformers.BatchEncoding

    moved = move_to_device(batch, META)
    assert type(moved) is transformers.BatchEncoding and moved is not batch
    assert set(moved) == {"input_ids", "attention_mask"}
    assert moved.input_ids.device == META and moved["attention_mask"].device == META  # attribute access works
    assert batch["input_ids"].tolist() == [[2, 3, 2], [3, 0, 0]]  # the collator's batch is left on the CPU
    cast = cast_floating(transformers.BatchEncoding({"pixels": torch.ones(1), "ids": torch.ones(1, dtype=torch.long)}),
                         torch.float16)  # fmt: skip
    assert type(cast) is transformers.BatchEncoding
    assert (cast["pixels"].dtype, cast["ids"].dtype) == (torch.float16, torch.long)


def test_cast_floating_keeps_dataclasses_and_mappings() -> None:
    cast = cast_floating(Batch(torch.ones(2), UserDict(m=torch.ones(1, dtype=torch.int32))), torch.bfloat16)
    assert type(cast) is Batch and type(cast.extra) is UserDict
    assert (cast.inputs.dtype, cast.extra["m"].dtype, cast.name) == (torch.bfloat16, torch.int32, "b")


def _containers(children: st.SearchStrategy[Any]) -> st.SearchStrategy[Any]:
    keys = st.sampled_from(["a", "b", "c"])
    return st.one_of(
        st.dictionaries(keys, children, max_size=3),
        st.dictionaries(keys, children, max_size=3).map(OrderedDict),
        st.dictionaries(keys, children, max_size=3).map(UserDict),
        st.dictionaries(keys, children, max_size=3).map(types.MappingProxyType),
        st.lists(children, max_size=3),
        st.lists(children, max_size=3).map(tuple),
        st.tuples(children, children).map(lambda pair: Pair(*pair)),
        st.tuples(children, st.dictionaries(keys, children, max_size=2)).map(lambda pair: Batch(*pair)),
    )


_LEAVES = st.one_of(
    st.sampled_from([torch.float32, torch.int64, torch.bool]).map(lambda dtype: torch.zeros(2, dtype=dtype)),
    st.integers(-3, 3),
    st.none(),
    st.text(max_size=2),
)


@settings(max_examples=60, deadline=None)
@given(st.recursive(_LEAVES, _containers, max_leaves=12).map(lambda inner: [torch.ones(1), inner]))
def test_any_nesting_of_the_supported_containers_moves_every_tensor(batch: Any) -> None:
    assert_moved(batch, move_to_device(batch, META))
