"""Precision plugins: how the forward runs (autocast), how weights and inputs are cast, how the loss is scaled.

| name | weights | forward | loss scaling |
|---|---|---|---|
| ``"32-true"`` (``"32"``) | fp32 | fp32 | none |
| ``"64-true"`` | fp64 | fp64 (floating inputs cast) | none |
| ``"bf16-mixed"`` | fp32 | autocast to bf16 | none |
| ``"16-mixed"`` | fp32 | autocast to fp16 | `torch.amp.GradScaler` |
| ``"bf16-true"`` / ``"16-true"`` | bf16 / fp16 | bf16 / fp16 (floating inputs cast) | none |
"""

from __future__ import annotations

import contextlib
import copy
import dataclasses
from collections import UserDict
from collections.abc import Callable, Mapping
from typing import Any

import torch
from torch import Tensor, nn
from torch.optim import Optimizer

_NULL_CONTEXT = contextlib.nullcontext()  # stateless and reusable: no allocation per step

#: Every precision name ember knows.
KNOWN_PRECISIONS = ("32-true", "32", "64-true", "bf16-mixed", "16-mixed", "bf16-true", "16-true")


def map_tensors(batch: Any, fn: Callable[[Tensor], Tensor], to: Callable[[Any], Any] | None = None) -> Any:
    """`batch` with `fn` applied to every tensor in it; each container is rebuilt as its own type.

    Containers: any `Mapping` (a ``dict``, a ``UserDict`` such as Hugging Face's ``BatchEncoding``, a dict
    subclass such as ``OrderedDict`` or ``defaultdict``: copied with their attributes, then given the new
    values; another mapping is rebuilt from a dict, or becomes a dict when its type cannot be built from one),
    lists, tuples, namedtuples and dataclass instances (``dataclasses.replace`` with every ``__init__`` field
    replaced: ``__post_init__`` derives the others from the moved ones). The batch
    itself is never changed. `to`, when given, is called on any other object with a callable ``.to`` method
    (before the namedtuple and dataclass rules, so a ``PackedSequence`` moves itself); its result replaces
    the object (None: the object moved in place). Any other value passes through.
    """
    if isinstance(batch, Tensor):
        return fn(batch)
    if type(batch) is dict:  # the common case first
        return {k: map_tensors(v, fn, to) for k, v in batch.items()}
    if isinstance(batch, Mapping):
        return _rebuild_mapping(batch, {k: map_tensors(v, fn, to) for k, v in batch.items()})
    if to is not None and callable(getattr(batch, "to", None)) and not isinstance(batch, type):
        moved = to(batch)
        return batch if moved is None else moved
    if isinstance(batch, tuple) and hasattr(batch, "_fields"):  # namedtuple
        return type(batch)(*(map_tensors(v, fn, to) for v in batch))
    if isinstance(batch, (list, tuple)):
        return type(batch)(map_tensors(v, fn, to) for v in batch)
    if dataclasses.is_dataclass(batch) and not isinstance(batch, type):
        fields = dataclasses.fields(batch)
        return dataclasses.replace(
            batch, **{f.name: map_tensors(getattr(batch, f.name), fn, to) for f in fields if f.init}
        )
    return batch


def _rebuild_mapping(batch: Mapping[Any, Any], values: dict[Any, Any]) -> Any:
    """A mapping of `batch`'s type holding `values` (see `map_tensors`)."""
    if isinstance(batch, (dict, UserDict)):  # their copies own their items: filling one leaves `batch` alone
        copied = copy.copy(batch)
        for key, value in values.items():
            copied[key] = value
        return copied
    try:
        rebuilt = type(batch)(values)  # type: ignore[call-arg]
    except (TypeError, ValueError):
        return values
    # A constructor that took the dict for something else would lose the values: keep a dict then.
    same = isinstance(rebuilt, Mapping) and len(rebuilt) == len(values)
    return rebuilt if same and all(k in rebuilt and rebuilt[k] is v for k, v in values.items()) else values


def cast_floating(batch: Any, dtype: torch.dtype) -> Any:
    """Cast every floating-point tensor in a (nested) batch to `dtype` (containers as in `map_tensors`);
    integers and others pass through."""
    return map_tensors(batch, lambda tensor: tensor.to(dtype) if tensor.is_floating_point() else tensor)


class Precision:
    """Full fp32: no autocast, no casting, no loss scaling. The base of every precision plugin."""

    name = "32-true"
    #: dtype floating inputs and weights are cast to (None: leave them alone).
    cast_dtype: torch.dtype | None = None

    def forward_context(self) -> contextlib.AbstractContextManager[None]:
        """Context the training/eval steps run in (autocast for mixed precision)."""
        return _NULL_CONTEXT

    def convert_module(self, module: nn.Module) -> nn.Module:
        return module.to(self.cast_dtype) if self.cast_dtype is not None else module

    def convert_batch(self, batch: Any) -> Any:
        return cast_floating(batch, self.cast_dtype) if self.cast_dtype is not None else batch

    def setup(self, device: torch.device) -> None:
        """Called once the device is known (the grad scaler needs it)."""

    def scale_loss(self, loss: Tensor) -> Tensor:
        return loss

    def unscale_gradients(self, optimizer: Optimizer) -> None:
        """Undo loss scaling on the gradients before clipping (no-op here)."""

    def optimizer_step(self, optimizer: Optimizer, closure: Any = None) -> Any:
        return optimizer.step(closure) if closure is not None else optimizer.step()

    def step_metrics(self) -> dict[str, Tensor]:
        """Values to log with the step metrics (e.g. skipped steps); tensors, read only when logged."""
        return {}

    def state_dict(self) -> dict[str, Any]:
        return {}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        pass


class TruePrecision(Precision):
    """Weights and floating inputs in one dtype (fp64, bf16 or fp16)."""

    def __init__(self, name: str, dtype: torch.dtype) -> None:
        self.name, self.cast_dtype = name, dtype


class MixedPrecision(Precision):
    """fp32 weights, forward under autocast; fp16 adds a dynamic loss scaler.

    With "16-mixed", a step whose gradients hold inf/NaN is skipped by the
    scaler (and the scale halved); `skipped_steps` counts them on the device,
    without a host sync, and is logged as ``train/skipped_steps``.
    """

    def __init__(self, name: str, dtype: torch.dtype) -> None:
        self.name, self.dtype = name, dtype
        self.scaler: torch.amp.GradScaler | None = None
        self.skipped_steps: Tensor | None = None
        self._autocast: Any = None

    def setup(self, device: torch.device) -> None:
        self._autocast = torch.autocast(device.type, dtype=self.dtype)
        if self.dtype == torch.float16:
            self.scaler = torch.amp.GradScaler(device.type)
            self.skipped_steps = torch.zeros((), dtype=torch.int64, device=device)

    def forward_context(self) -> contextlib.AbstractContextManager[None]:
        if self._autocast is None:
            raise RuntimeError("the precision plugin was not set up; the strategy calls setup(device)")
        return self._autocast

    def scale_loss(self, loss: Tensor) -> Tensor:
        return self.scaler.scale(loss) if self.scaler is not None else loss

    def unscale_gradients(self, optimizer: Optimizer) -> None:
        """Unscale `optimizer`'s gradients once per step (a manual step's ``clip_gradients`` may have done it)."""
        if self.scaler is not None and not self._unscaled(optimizer):
            self.scaler.unscale_(optimizer)

    def _unscaled(self, optimizer: Optimizer) -> bool:
        from torch.amp.grad_scaler import OptState

        assert self.scaler is not None
        return bool(self.scaler._per_optimizer_states[id(optimizer)]["stage"] is OptState.UNSCALED)

    def optimizer_step(self, optimizer: Optimizer, closure: Any = None) -> Any:
        if self.scaler is None:
            return super().optimizer_step(optimizer, closure)
        if closure is not None:
            raise ValueError("16-mixed does not support optimizer closures (e.g. LBFGS); use bf16-mixed or 32-true")
        # unscale_gradients ran before clipping; the found-inf flags are device tensors: no host sync here
        found = self.scaler._found_inf_per_device(optimizer)
        result = self.scaler.step(optimizer)
        self.scaler.update()
        assert self.skipped_steps is not None
        for flag in found.values():
            self.skipped_steps += flag.to(self.skipped_steps.device, torch.int64)
        return result

    def step_metrics(self) -> dict[str, Tensor]:
        return {"train/skipped_steps": self.skipped_steps} if self.skipped_steps is not None else {}

    def state_dict(self) -> dict[str, Any]:
        if self.scaler is None:
            return {}
        assert self.skipped_steps is not None
        return {"scaler": self.scaler.state_dict(), "skipped_steps": self.skipped_steps.clone()}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        if self.scaler is not None and "scaler" in state_dict:
            self.scaler.load_state_dict(state_dict["scaler"])
            assert self.skipped_steps is not None
            self.skipped_steps.copy_(state_dict["skipped_steps"])


def resolve_precision(value: str | int) -> Precision:
    """Map a ``Trainer(precision=...)`` value to a plugin, with an error listing the valid ones."""
    name = str(value)
    if name not in KNOWN_PRECISIONS:
        raise ValueError(f"precision={value!r} is not valid; choose one of: {', '.join(KNOWN_PRECISIONS)}")
    if name in ("32-true", "32"):
        return Precision()
    if name == "64-true":
        return TruePrecision(name, torch.float64)
    if name == "bf16-true":
        return TruePrecision(name, torch.bfloat16)
    if name == "16-true":
        return TruePrecision(name, torch.float16)
    return MixedPrecision(name, torch.bfloat16 if name == "bf16-mixed" else torch.float16)
