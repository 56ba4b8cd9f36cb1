"""ONNX export through the ``torch.export``-based exporter, checked in ONNX Runtime.

Inputs are named ``input`` (``input_0``, ``input_1``, ... for several), outputs ``output`` (or
``output_0``, ...). With ``dynamic_batch=True`` the first dimension of every input is the symbolic
``batch``, and the check runs at the example's batch size and at twice it.
"""

from __future__ import annotations

import contextlib
import functools
import logging
import os
import warnings
from collections.abc import Iterator
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from ember.export.checks import (
    ExportError,
    ExportResult,
    compare_outputs,
    require,
    run_artifact,
    tolerances,
    trace_failure,
)
from ember.export.files import staged
from ember.export.inputs import TracePlan, batch_size, evaluating, example_inputs, trace_plan

if TYPE_CHECKING:
    from ember.modules.module import TrainingModule

#: Above this many bytes of parameters the weights go to a ``<file>.data`` file beside the model (ONNX's
#: protobuf files cannot exceed 2 GB).
EXTERNAL_DATA_BYTES = 1 << 30


def export_onnx(
    module: TrainingModule,
    path: str | os.PathLike[str],
    example_input: Any = None,
    dynamic_batch: bool = True,
    *,
    opset_version: int | None = None,
    dynamic_shapes: Any = None,
    atol: float | None = None,
    rtol: float | None = None,
) -> ExportResult:
    """Write `module` (in eval mode) as an ONNX model at `path` and check it in ONNX Runtime.

    The example input is `example_input` or ``module.example_input_array``. The outputs of an
    ``onnxruntime.InferenceSession`` on it (and, with `dynamic_batch`, on a batch twice as large)
    must match the module's within ``atol + rtol * |expected|``, or an `ExportError` is raised and
    nothing is written. `dynamic_shapes` (torch.export's form, keyed by forward's argument names)
    replaces the dynamic batch, e.g. ``{"tokens": {0: Dim("batch"), 1: Dim("seq", max=128)}}``.
    """
    require("onnxscript", "ONNX export")
    ort = require("onnxruntime", "checking an ONNX export")
    target = Path(path)
    inputs = example_inputs(module, example_input)
    atol, rtol = tolerances(atol, rtol)
    with evaluating(module):
        plan = trace_plan(module, inputs, dynamic_batch, dynamic_shapes)
        input_names = _names("input", len(inputs))
        output_names = _names("output", len(plan.checks[0][2]))
        with staged(target) as tmp:
            program = _export(module, plan, input_names, output_names, opset_version)
            large = sum(p.numel() * p.element_size() for p in module.parameters()) > EXTERNAL_DATA_BYTES
            program.save(str(tmp), external_data=large)
            session = ort.InferenceSession(str(tmp), providers=["CPUExecutionProvider"])
            checks = []
            for on, x, reference in plan.checks:
                feed = {name: t.detach().cpu().numpy() for name, t in zip(input_names, x, strict=True)}
                run = functools.partial(session.run, output_names, feed)
                got = run_artifact("onnx", target, run, on, batch_size(x))
                checks.append(compare_outputs("onnx", target, got, reference, batch_size(x), atol, rtol, on))
            del session  # closes the file before it is renamed (Windows)
    return ExportResult("onnx", target, tuple(checks))


def _names(stem: str, count: int) -> list[str]:
    return [stem] if count == 1 else [f"{stem}_{i}" for i in range(count)]


def _export(
    module: TrainingModule, plan: TracePlan, input_names: list[str], output_names: list[str], opset: int | None
) -> Any:
    try:
        with _quiet_exporter():
            program = torch.onnx.export(
                module,
                plan.traced,
                dynamo=True,
                dynamic_shapes=plan.dynamic_shapes,
                input_names=input_names,
                output_names=output_names,
                opset_version=opset,
                verbose=False,
            )
    except ExportError:
        raise
    except Exception as exc:
        raise trace_failure("onnx export", module, exc, plan.dynamic_shapes is not None) from exc
    if program is None:  # only when given a file name; kept for the type checker
        raise ExportError("torch.onnx.export returned no program")
    return program


@contextlib.contextmanager
def _quiet_exporter() -> Iterator[None]:
    """The exporter's own noise, none of it about the user's model: a warning logged per torchvision operator
    it cannot register when torchvision is absent, and torch's FutureWarning about ``LeafSpec`` that the
    exporter's graph decomposition triggers inside torch (torch 2.13) on every export. Only that message is
    filtered; every other warning reaches the user."""
    logger = logging.getLogger("torch.onnx._internal.exporter._registration")
    level = logger.level
    logger.setLevel(logging.ERROR)
    try:
        with warnings.catch_warnings():
            warnings.filterwarnings("ignore", message=r"`isinstance\(treespec, LeafSpec\)` is deprecated",
                                    category=FutureWarning)  # fmt: skip
            yield
    finally:
        logger.setLevel(level)
