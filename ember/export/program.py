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
    ExportResult,
    compare_outputs,
    flatten_outputs,
    run_artifact,
    tolerances,
    trace_failure,
)
from ember.export.files import staged
from ember.export.inputs import batch_size, evaluating, example_inputs, trace_plan

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
    atol, rtol = tolerances(atol, rtol)
    with evaluating(module):
        plan = trace_plan(module, inputs, dynamic_batch, dynamic_shapes)
        with staged(target) as tmp:
            try:
                program = torch.export.export(module, plan.traced, dynamic_shapes=plan.dynamic_shapes)
            except Exception as exc:
                raise trace_failure("torch.export", module, exc, plan.dynamic_shapes is not None) from exc
            torch.export.save(program, str(tmp))
            loaded = torch.export.load(str(tmp)).module()
            checks = []
            for on, x, reference in plan.checks:
                with torch.no_grad():
                    out = run_artifact("torch-export", target, functools.partial(loaded, *x), on, batch_size(x))
                got = flatten_outputs(out, "the exported program")
                checks.append(compare_outputs("torch-export", target, got, reference, batch_size(x), atol, rtol, on))
    return ExportResult("torch-export", target, tuple(checks))
