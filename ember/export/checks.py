"""What every export shares: its error, its result, the output comparison and optional imports.

An export compares the outputs of the artifact it wrote with the PyTorch module's on the same input
(`compare_outputs`) before it moves the artifact into place; a mismatch is an `ExportError` naming
the format, the file and the largest absolute difference.
"""

from __future__ import annotations

import importlib
import importlib.util
import re
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from types import ModuleType
from typing import Any

import torch
from torch import Tensor

#: Default tolerances of the self-check: ``|exported - pytorch| <= atol + rtol * |pytorch|`` elementwise.
DEFAULT_ATOL = 1e-4
DEFAULT_RTOL = 1e-4

#: The ``pip install`` line that brings every optional package the exports use.
EXPORT_PACKAGES = "onnx onnxscript onnxruntime safetensors torch-model-archiver"


class ExportError(RuntimeError):
    """An export that cannot be made or that failed its check; ``str()`` is one line saying what to do."""


def tolerances(atol: float | None, rtol: float | None) -> tuple[float, float]:
    """(atol, rtol) of a check: the given ones, else `DEFAULT_ATOL` / `DEFAULT_RTOL`."""
    return DEFAULT_ATOL if atol is None else atol, DEFAULT_RTOL if rtol is None else rtol


def trace_failure(what: str, module: torch.nn.Module, exc: BaseException, dynamic: bool) -> ExportError:
    """The one-line error of a tracing exporter (`what`: "torch.export", "onnx export") that raised `exc`: the
    innermost error it wraps (the ONNX exporter wraps torch.export's), the first line of its message that
    names an exception (``...Error: ...``) or else its first line, and the way out of a dynamic batch."""
    while exc.__cause__ is not None and str(exc.__cause__).strip():
        exc = exc.__cause__
    lines = [line.strip() for line in re.sub(r"\x1b\[[0-9;]*m", "", str(exc)).splitlines() if line.strip()]
    summary = next((line for line in lines if "Error:" in line), lines[0] if lines else "")
    hint = " (dynamic_batch=False, or --static-batch, exports a fixed batch size)" if dynamic else ""
    return ExportError(f"{what} of {type(module).__qualname__} failed{hint}: {type(exc).__name__}: {summary}"[:700])


@dataclass(frozen=True)
class Check:
    """One comparison of an artifact with the PyTorch module: the batch size and the largest difference."""

    batch_size: int | None
    max_abs_diff: float


@dataclass(frozen=True)
class ExportResult:
    """What an export wrote (`path`, in `format`) and the checks it passed."""

    format: str
    path: Path
    checks: tuple[Check, ...]

    def describe_checks(self) -> str:
        """ "max abs diff 2.4e-07 at batch 4, 1.9e-07 at batch 8", or "weights only" without output checks."""
        if not self.checks:
            return "weights compared, no example input to compare outputs on"
        parts = [
            f"{c.max_abs_diff:.2g} at batch {c.batch_size}" if c.batch_size is not None else f"{c.max_abs_diff:.2g}"
            for c in self.checks
        ]
        return "max abs diff " + ", ".join(parts)


def require(name: str, purpose: str) -> ModuleType:
    """Import the optional package `name`, or raise an `ExportError` saying which ``pip install`` to run."""
    try:
        return importlib.import_module(name)
    except ImportError as exc:
        raise _missing(name.split(".")[0], purpose, str(exc)) from None


def require_installed(name: str, purpose: str, package: str) -> None:
    """Like `require` for a package used in another process (`package` is its name on PyPI): only check
    that `name` can be imported."""
    if importlib.util.find_spec(name) is None:
        raise _missing(package, purpose, f"no module named {name!r}")


def _missing(package: str, purpose: str, reason: str) -> ExportError:
    return ExportError(
        f"{purpose} needs the {package} package, which is not installed ({reason}); "
        f"run: pip install {EXPORT_PACKAGES}  (or: pip install 'ember[export]')"
    )


def flatten_outputs(value: Any, what: str) -> list[Tensor]:
    """The tensors of a forward output (a tensor, or tuples/lists/dicts of them) in a fixed order."""
    if isinstance(value, Tensor):
        return [value]
    if isinstance(value, (tuple, list)):
        return [t for item in value for t in flatten_outputs(item, what)]
    if isinstance(value, Mapping):
        return [t for item in value.values() for t in flatten_outputs(item, what)]
    raise ExportError(
        f"{what} returned a {type(value).__qualname__}; exports need forward() to return tensors "
        "(or tuples, lists or dicts of them)"
    )


def compare_outputs(
    fmt: str,
    path: Path,
    got: Sequence[Any],
    expected: Sequence[Tensor],
    batch_size: int | None,
    atol: float,
    rtol: float,
    on: str = "the example input",
) -> Check:
    """Compare an artifact's outputs with the module's on `on`; a mismatch raises an `ExportError`."""
    where = f"on {on} (batch size {batch_size})" if batch_size is not None else f"on {on}"
    if len(got) != len(expected):
        raise ExportError(
            f"{fmt} export check failed: {path} returns {len(got)} outputs, the PyTorch module {len(expected)}, "
            f"{where}; the file was not written"
        )
    worst = 0.0
    for index, (actual, reference) in enumerate(zip(got, expected, strict=True)):
        actual = torch.as_tensor(actual).detach().cpu()
        reference = reference.detach().cpu()
        if actual.shape != reference.shape:
            raise ExportError(
                f"{fmt} export check failed: {path} output {index} has shape {tuple(actual.shape)}, the PyTorch "
                f"module's {tuple(reference.shape)}, {where}; the file was not written"
            )
        if reference.numel() == 0:
            continue
        actual, reference = actual.double(), reference.double()
        diff = (actual - reference).abs()
        nan_mismatch = bool((actual.isnan() != reference.isnan()).any())
        diff = torch.where(actual.isnan() & reference.isnan(), torch.zeros_like(diff), diff)
        max_diff = float("inf") if nan_mismatch else float(diff.max())
        worst = max(worst, max_diff)
        if nan_mismatch or bool((diff > atol + rtol * reference.abs()).any()):
            raise ExportError(
                f"{fmt} export check failed: {path} output {index} differs from the PyTorch module by up to "
                f"{max_diff:.3g} (allowed: {atol:g} + {rtol:g} x |expected|) {where}; the file was not written"
            )
    return Check(batch_size, worst)


def run_artifact(fmt: str, path: Path, run: Callable[[], Any], on: str, batch_size: int | None) -> Any:
    """``run()`` (the loaded artifact on an input); an exception becomes an `ExportError` saying where."""
    try:
        return run()
    except Exception as exc:
        first = next((line.strip() for line in str(exc).splitlines() if line.strip()), "")
        raise ExportError(
            f"{fmt} export check failed: {path} cannot run on {on} (batch size {batch_size}): "
            f"{type(exc).__name__}: {first}; the file was not written"
        ) from exc
