"""Weights export: the module's ``state_dict`` as a safetensors file (no pickle, loadable anywhere).

Tensors that are the same tensor under two names (tied weights) are stored once; the file's metadata
(``ember.aliases``) maps the other names to it and `load_safetensors` restores them, so
``module.load_state_dict(load_safetensors(path))`` works. The metadata also holds the module class
(``ember.module_class``) and, when they are JSON, its hyperparameters (``ember.hparams``).
"""

from __future__ import annotations

import contextlib
import json
import os
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
from torch import Tensor

from ember.export.checks import (
    Check,
    ExportError,
    ExportResult,
    compare_outputs,
    flatten_outputs,
    require,
    tolerances,
)
from ember.export.files import staged
from ember.export.inputs import batch_size, evaluating, example_inputs, reference_outputs

if TYPE_CHECKING:
    from ember.modules.module import TrainingModule


def export_safetensors(
    module: TrainingModule,
    path: str | os.PathLike[str],
    example_input: Any = None,
    *,
    atol: float | None = None,
    rtol: float | None = None,
) -> ExportResult:
    """Write ``module.state_dict()`` to `path` as safetensors, then check the file.

    Every tensor read back must equal the module's bit for bit. With an example input (`example_input`
    or ``module.example_input_array``) the module is also run with the file's tensors in place of its
    own (``torch.func.functional_call``) and its outputs compared; without one only the weights are.
    """
    st = require("safetensors.torch", "safetensors export")
    target = Path(path)
    state = module.state_dict()
    tensors, aliases = _unique_tensors(module, state)
    cls = type(module)
    metadata = {
        "format": "pt",
        "ember.module_class": f"{cls.__module__}:{cls.__qualname__}",
        "ember.aliases": json.dumps(aliases),
    }
    with contextlib.suppress(TypeError, ValueError):  # hyperparameters that are not JSON are left out
        metadata["ember.hparams"] = json.dumps(dict(module.hparams))
    has_example = example_input is not None or getattr(module, "example_input_array", None) is not None
    inputs = example_inputs(module, example_input) if has_example else None
    atol, rtol = tolerances(atol, rtol)
    with staged(target) as tmp:
        st.save_file(tensors, str(tmp), metadata=metadata)
        loaded = load_safetensors(tmp)
        _check_weights(target, loaded, state)
        checks: tuple[Check, ...] = ()
        if inputs is not None:
            with evaluating(module):
                expected = reference_outputs(module, inputs)
                device = inputs[0].device
                with torch.no_grad():
                    out = torch.func.functional_call(module, {k: v.to(device) for k, v in loaded.items()}, inputs)
                got = flatten_outputs(out, f"{cls.__qualname__}.forward")
            checks = (compare_outputs("safetensors", target, got, expected, batch_size(inputs), atol, rtol),)
    return ExportResult("safetensors", target, checks)


def load_safetensors(path: str | os.PathLike[str]) -> dict[str, Tensor]:
    """The state dict in a file written by `export_safetensors`, tied names included (on the CPU)."""
    st = require("safetensors.torch", "reading safetensors")
    safe_open = require("safetensors", "reading safetensors").safe_open
    with safe_open(str(path), framework="pt") as f:
        aliases = json.loads((f.metadata() or {}).get("ember.aliases", "{}"))
    state: dict[str, Tensor] = st.load_file(str(path))
    for name, original in aliases.items():
        state[name] = state[original]
    return state


def _unique_tensors(module: TrainingModule, state: dict[str, Any]) -> tuple[dict[str, Tensor], dict[str, str]]:
    """CPU copies of the state's tensors, each shared tensor once; and {alias: name stored}."""
    tensors: dict[str, Tensor] = {}
    aliases: dict[str, str] = {}
    seen: dict[tuple[Any, ...], str] = {}
    for name, value in state.items():
        if not isinstance(value, Tensor):
            raise ExportError(
                f"{type(module).__qualname__}.state_dict()[{name!r}] is a {type(value).__qualname__}; "
                "safetensors holds tensors only"
            )
        key = (
            value.device,
            value.untyped_storage().data_ptr(),
            value.storage_offset(),
            value.shape,
            value.stride(),
            value.dtype,
        )
        if value.numel() and key in seen:
            aliases[name] = seen[key]
            continue
        seen[key] = name
        tensors[name] = value.detach().to("cpu", copy=True).contiguous()
    return tensors, aliases


def _check_weights(path: Path, loaded: dict[str, Tensor], state: dict[str, Any]) -> None:
    missing = sorted(set(state) - set(loaded))
    if missing:
        raise ExportError(f"safetensors export check failed: {path} lacks {missing[:5]}; the file was not written")
    for name, value in state.items():
        if not torch.equal(loaded[name], value.detach().cpu()):
            diff = (loaded[name].double() - value.detach().cpu().double()).abs().max()
            raise ExportError(
                f"safetensors export check failed: {path} holds {name} different from the module's "
                f"(max abs diff {float(diff):.3g}); the file was not written"
            )
