"""TorchScript export: ``torch.jit.script`` or ``torch.jit.trace``, saved with ``torch.jit.save``.

``method="script"`` compiles ``forward`` (keeping its Python control flow); a module that keeps the
default ``forward`` (``self.model(x)``) has its ``model`` scripted, which computes the same thing.
``method="trace"`` records the operations run on the example input.
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Iterator
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from ember.export.checks import ExportError, ExportResult, compare_outputs, flatten_outputs, tolerances
from ember.export.files import staged
from ember.export.inputs import Inputs, batch_size, evaluating, example_inputs, reference_outputs
from ember.strategies.strategy import keeps_default_forward, training_module_class

if TYPE_CHECKING:
    from ember.modules.module import TrainingModule

METHODS = ("script", "trace")


def export_torchscript(
    module: TrainingModule,
    path: str | os.PathLike[str],
    method: str = "script",
    example_input: Any = None,
    *,
    atol: float | None = None,
    rtol: float | None = None,
) -> ExportResult:
    """Write `module` (in eval mode) as TorchScript at `path`, then check ``torch.jit.load(path)`` on the
    example input (`example_input` or ``module.example_input_array``) against the module."""
    if method not in METHODS:
        raise ExportError(f"torchscript method {method!r}: choose 'script' or 'trace'")
    target = Path(path)
    inputs = example_inputs(module, example_input)
    atol, rtol = tolerances(atol, rtol)
    with evaluating(module):
        expected = reference_outputs(module, inputs)
        uses_default_forward = keeps_default_forward(module)
        with staged(target) as tmp:
            compiled = _compile(module, method, inputs, uses_default_forward)
            torch.jit.save(compiled, str(tmp))
            loaded = torch.jit.load(str(tmp), map_location=inputs[0].device)
            with torch.no_grad():
                got = flatten_outputs(loaded(*inputs), "the TorchScript module")
            check = compare_outputs("torchscript", target, got, expected, batch_size(inputs), atol, rtol)
    return ExportResult("torchscript", target, (check,))


def _compile(module: TrainingModule, method: str, inputs: Inputs, uses_default_forward: bool) -> Any:
    name = type(module).__qualname__
    try:
        with _jit_compatible(module):
            if method == "trace":
                return torch.jit.trace(module, inputs, check_trace=False)
            # The default forward takes (*args, **kwargs), which TorchScript cannot compile; it only calls
            # self.model, so script that.
            return torch.jit.script(module.model if uses_default_forward else module)
    except Exception as exc:
        lines = [line for line in str(exc).splitlines() if line.strip()]
        detail = f"{type(exc).__name__}: {lines[0].strip() if lines else ''}"
        hint = "; try method='trace' (--method trace)" if method == "script" else ""
        raise ExportError(f"torch.jit.{method} of {name} failed: {detail}{hint}") from exc


_JIT_VIEWS: dict[type, type] = {}


def _jit_view(cls: type) -> type:
    """`cls` as TorchScript can walk it: an unattached ``trainer`` is None rather than an error (TorchScript
    calls ``getattr`` on every attribute), and the properties and untyped attributes of `TrainingModule`
    are left out of compilation."""
    if cls not in _JIT_VIEWS:
        _JIT_VIEWS[cls] = type(
            cls.__name__,
            (cls,),
            {
                "__module__": cls.__module__,
                "__qualname__": cls.__qualname__,
                "trainer": property(lambda self: self._trainer),
                "__jit_unused_properties__": [
                    "trainer",
                    "device",
                    "on_gpu",
                    "has_trainer",
                    "hparams_to_loggers",
                    "global_step",
                    "current_epoch",
                    "hparams",
                ],
                "__jit_ignored_attributes__": ["trainer", "example_input_array", "optimizer_config"],
            },
        )
    return _JIT_VIEWS[cls]


@contextlib.contextmanager
def _jit_compatible(module: TrainingModule) -> Iterator[None]:
    """Give `module`, and any `TrainingModule` inside it, the class of `_jit_view` while TorchScript
    compiles or traces it."""
    base = training_module_class()
    swapped = [(m, type(m)) for m in module.modules() if base is not None and isinstance(m, base)]
    for m, cls in swapped:
        m.__class__ = _jit_view(cls)
    try:
        yield
    finally:
        for m, cls in swapped:
            m.__class__ = cls
