"""From a trained module to production: ONNX, TorchScript, ``torch.export``, safetensors weights, a
TorchServe archive and a Hugging Face ``save_pretrained`` directory.

Every export traces (or saves) the module in eval mode on an example input (the ``example_input``
argument, else ``module.example_input_array``), writes its artifact into a hidden folder beside the
destination, loads it back, compares its outputs with the PyTorch module's on that input (ONNX through
ONNX Runtime, with a second batch size when the batch is dynamic), and only then renames it into
place. A mismatch is an `ExportError` naming the format, the file and the largest difference.

The optional packages (onnx, onnxscript, onnxruntime, safetensors, torch-model-archiver) are imported
by the export that needs them: ``pip install 'ember[export]'`` (the Hugging Face export: ``'ember[hf]'``).
See docs/export.md.
"""

from __future__ import annotations

import os
from typing import TYPE_CHECKING, Any

from ember.export.checks import DEFAULT_ATOL, DEFAULT_RTOL, Check, ExportError, ExportResult
from ember.export.hf import export_hf
from ember.export.onnx import export_onnx
from ember.export.program import export_program
from ember.export.torchscript import export_torchscript
from ember.export.torchserve import export_torchserve, read_manifest
from ember.export.weights import export_safetensors, load_safetensors

if TYPE_CHECKING:
    from ember.modules.module import TrainingModule

#: Every format, with the file suffix ``ember export`` gives it.
FORMATS = {
    "onnx": ".onnx",
    "torchscript": ".torchscript.pt",
    "torch-export": ".pt2",
    "safetensors": ".safetensors",
    "torchserve": ".mar",
    "hf": "",  # a directory (save_pretrained): config.json, model.safetensors, tokenizer files
}

__all__ = [
    "DEFAULT_ATOL",
    "DEFAULT_RTOL",
    "FORMATS",
    "Check",
    "ExportError",
    "ExportResult",
    "export",
    "export_hf",
    "export_onnx",
    "export_program",
    "export_safetensors",
    "export_torchscript",
    "export_torchserve",
    "load_safetensors",
    "read_manifest",
]


def export(
    module: TrainingModule,
    format: str,
    path: str | os.PathLike[str],
    example_input: Any = None,
    *,
    dynamic_batch: bool = True,
    method: str = "script",
    atol: float | None = None,
    rtol: float | None = None,
) -> ExportResult:
    """Export `module` to `path` in `format` (a key of `FORMATS`) and check it; see the module docstring.

    `dynamic_batch` applies to "onnx" and "torch-export", `method` ("script" or "trace") to
    "torchscript"; `atol` and `rtol` bound the check (TorchServe compares within `atol`). "hf" writes a
    ``save_pretrained`` directory of the module's transformers model and tokenizer (`export_hf`).
    """
    if format == "onnx":
        return export_onnx(module, path, example_input, dynamic_batch, atol=atol, rtol=rtol)
    if format == "torchscript":
        return export_torchscript(module, path, method, example_input, atol=atol, rtol=rtol)
    if format == "torch-export":
        return export_program(module, path, example_input, dynamic_batch, atol=atol, rtol=rtol)
    if format == "safetensors":
        return export_safetensors(module, path, example_input, atol=atol, rtol=rtol)
    if format == "torchserve":
        return export_torchserve(module, path, example_input, atol=atol)
    if format == "hf":
        return export_hf(module, path, example_input=example_input, atol=atol, rtol=rtol)
    raise ExportError(f"unsupported export format {format!r}; choose one of {', '.join(FORMATS)}")
