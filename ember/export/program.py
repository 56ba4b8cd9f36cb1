"""``torch.export`` export: an `ExportedProgram` saved with ``torch.export.save`` (a ``.pt2`` file).

With ``dynamic_batch=True`` the first dimension of every input is the symbolic ``batch``; the check
loads the file with ``torch.export.load`` and runs ``program.module()`` at the example's batch size
and at twice it.
"""

from __future__ import annotations

import functools
import os
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from ember.export.checks import (
    DEFAULT_ATOL,
    DEFAULT_RTOL,
    ExportError,
    ExportResult,
    compare_outputs,
    flatten_outputs,
    run_artifact,
)
from ember.export.files import staged
from ember.export.inputs import (
    batch_dynamic_shapes,
    batch_size,
    evaluating,
    example_inputs,
    inputs_to_check,
    reference_outputs,
)

if TYPE_CHECKING:
    from ember.modules.module import TrainingModule


def export_program(
    module: TrainingModule,
    path: str | os.PathLike[str],
    example_input: Any = None,
    dynamic_batch: bool = True,
    *,
    dynamic_shapes: Any = None,
    atol: float | None = None,
    rtol: float | None = None,
) -> ExportResult:
    """Write ``torch.export.export(module, example_input)`` (eval mode) at `path` and check the loaded program.

    The example input is `example_input` or ``module.example_input_array``; ``torch.export.load(path)``
    must reproduce the module's outputs on it (and on twice the batch with `dynamic_batch`).
    `dynamic_shapes` (torch.export's form) replaces the dynamic batch.
    """
    target = Path(path)
    inputs = example_inputs(module, example_input)
    atol, rtol = DEFAULT_ATOL if atol is None else atol, DEFAULT_RTOL if rtol is None else rtol
    with evaluating(module):
        checked = inputs_to_check(inputs, dynamic_batch)
        expected = [reference_outputs(module, x) for _, x in checked]
        traced = checked[-1][1] if dynamic_batch and batch_size(inputs) == 1 else inputs
        if dynamic_shapes is None and dynamic_batch:
            dynamic_shapes = batch_dynamic_shapes(module, traced)
        with staged(target) as tmp:
            try:
                program = torch.export.export(module, traced, dynamic_shapes=dynamic_shapes)
            except Exception as exc:
                hint = " (dynamic_batch=False, or --static-batch, exports a fixed batch size)" if dynamic_shapes else ""
                first = next((line.strip() for line in str(exc).splitlines() if line.strip()), "")
                raise ExportError(
                    f"torch.export of {type(module).__qualname__} failed{hint}: {type(exc).__name__}: {first}"
                ) from exc
            torch.export.save(program, str(tmp))
            loaded = torch.export.load(str(tmp)).module()
            checks = []
            for (on, x), reference in zip(checked, expected, strict=True):
                with torch.no_grad():
                    out = run_artifact("torch-export", target, functools.partial(loaded, *x), on, batch_size(x))
                got = flatten_outputs(out, "the exported program")
                checks.append(compare_outputs("torch-export", target, got, reference, batch_size(x), atol, rtol, on))
    return ExportResult("torch-export", target, tuple(checks))
