"""The example input an export traces the module on and checks its artifact with.

It comes from the ``example_input`` argument, else the module's ``example_input_array``: a tensor,
or a tuple of tensors for a ``forward`` that takes several positional arguments. The first
dimension of each tensor is the batch.
"""

from __future__ import annotations

import contextlib
import inspect
from collections.abc import Iterator
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch
from torch import Tensor

from ember.export.checks import ExportError, flatten_outputs

if TYPE_CHECKING:
    from ember.modules.module import TrainingModule

Inputs = tuple[Tensor, ...]


def example_inputs(module: TrainingModule, example_input: Any = None) -> Inputs:
    """`example_input`, else ``module.example_input_array``, as a tuple of tensors on the module's device."""
    value = example_input if example_input is not None else getattr(module, "example_input_array", None)
    name = type(module).__qualname__
    if value is None:
        raise ExportError(
            f"{name} has no example input: pass example_input=... or set self.example_input_array in __init__ "
            "(e.g. torch.zeros(2, 64)); exports trace the module on it and check the artifact against it"
        )
    inputs = (value,) if isinstance(value, Tensor) else tuple(value) if isinstance(value, (tuple, list)) else ()
    if not inputs or not all(isinstance(t, Tensor) for t in inputs):
        raise ExportError(
            f"{name}: the example input must be a tensor or a tuple of tensors (the positional arguments of "
            f"forward), got {type(value).__qualname__}"
        )
    device = _module_device(module)
    return tuple(t.detach().to(device) for t in inputs)


def _module_device(module: torch.nn.Module) -> torch.device:
    param = next(module.parameters(), None)
    return param.device if param is not None else torch.device("cpu")


def batch_size(inputs: Inputs) -> int | None:
    """The size of the first dimension of the first input (None for a 0-d input)."""
    return inputs[0].shape[0] if inputs[0].ndim else None


def other_batch(inputs: Inputs) -> Inputs:
    """The inputs with twice the batch: each followed by a variant of itself (rows rolled along the last
    dimension, so integer ids stay valid ids and the new rows differ from the old ones)."""
    return tuple(torch.cat([t, t.roll(1, dims=-1) if t.ndim >= 2 else t.flip(0)]) if t.ndim else t for t in inputs)


def inputs_to_check(inputs: Inputs, dynamic_batch: bool) -> list[tuple[str, Inputs]]:
    """(what, inputs) to compare an artifact on: the example input, and with a dynamic batch the
    example twice over (`other_batch`)."""
    checks = [("the example input", inputs)]
    if dynamic_batch:
        checks.append(("the example input twice over", other_batch(inputs)))
    return checks


def batch_dynamic_shapes(module: torch.nn.Module, inputs: Inputs) -> dict[str, Any]:
    """``dynamic_shapes`` for `torch.export` with dimension 0 of every input as one shared ``batch``."""
    batch = torch.export.Dim("batch", min=1)
    signature = inspect.signature(module.forward)
    try:
        bound = signature.bind(*inputs)
    except TypeError as exc:
        raise ExportError(
            f"{type(module).__qualname__}.forward{signature} does not take the {len(inputs)} example input(s): {exc}"
        ) from None

    def spec(t: Tensor) -> dict[int, Any] | None:
        return {0: batch} if t.ndim else None

    shapes: dict[str, Any] = {}
    for name, value in bound.arguments.items():
        if signature.parameters[name].kind is inspect.Parameter.VAR_POSITIONAL:
            shapes[name] = tuple(spec(t) for t in value)
        else:
            shapes[name] = spec(value)
    return shapes


@contextlib.contextmanager
def evaluating(module: torch.nn.Module) -> Iterator[None]:
    """Eval mode (no dropout, fixed norm statistics) for the export; the previous mode comes back after."""
    was_training = module.training
    module.eval()
    try:
        yield
    finally:
        module.train(was_training)


def reference_outputs(module: torch.nn.Module, inputs: Inputs) -> list[Tensor]:
    """The module's own outputs on `inputs` (no gradients), flattened, to compare an artifact with."""
    name = type(module).__qualname__
    try:
        with torch.no_grad():
            outputs = module(*inputs)
    except Exception as exc:
        shapes = ", ".join(f"{tuple(t.shape)} {str(t.dtype).removeprefix('torch.')}" for t in inputs)
        first = next((line.strip() for line in str(exc).splitlines() if line.strip()), "")
        raise ExportError(
            f"{name}.forward fails on the example input ({shapes}): {type(exc).__name__}: {first}; "
            "fix the example input (example_input= or example_input_array) or forward"
        ) from exc
    return flatten_outputs(outputs, f"{name}.forward")


@dataclass(frozen=True)
class TracePlan:
    """What the tracing exports (torch.export, ONNX) share: the inputs to trace on, the dynamic shapes, and
    each check to run on the artifact: (what, inputs, the module's outputs on them)."""

    traced: Inputs
    dynamic_shapes: Any
    checks: list[tuple[str, Inputs, list[Tensor]]]


def trace_plan(module: torch.nn.Module, inputs: Inputs, dynamic_batch: bool, dynamic_shapes: Any) -> TracePlan:
    """The `TracePlan` of `inputs` (call it under `evaluating`). `dynamic_shapes` given wins over the dynamic
    batch; a dynamic batch is traced on at least 2 rows (torch.export specialises a dimension of size 1)."""
    checked = inputs_to_check(inputs, dynamic_batch)
    traced = checked[-1][1] if dynamic_batch and batch_size(inputs) == 1 else inputs
    if dynamic_shapes is None and dynamic_batch:
        dynamic_shapes = batch_dynamic_shapes(module, traced)
    return TracePlan(traced, dynamic_shapes, [(on, x, reference_outputs(module, x)) for on, x in checked])
