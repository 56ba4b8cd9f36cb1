"""TorchServe handler for an ember `TrainingModule`; ``ember export --format torchserve`` copies this file
into the model archive with `SETTINGS` filled in.

TorchServe calls `handle(data, context)` with a list of requests. A request body is JSON, either
``{"inputs": X}`` or ``X`` itself, where ``X`` is one batch as nested lists (the tensor ``forward``
takes; for a ``forward`` with several tensor arguments, a list with one batch per argument). Each
request is answered with the module's ``predict_step(batch, 0)`` as JSON, tensors as nested lists.

The module is rebuilt from its class and constructor arguments and loads the archive's weights
(``torch.load(..., weights_only=True)``), so the worker's Python needs torch, ember and whatever the
module's code imports; that code itself travels in the archive.
"""

from __future__ import annotations

import importlib
import json
import os
import sys
from typing import Any

import torch

#: Written at export time: ``module_class`` ("package.module:Class"), ``init_args`` (its constructor
#: arguments), ``weights_file`` (in the archive) and ``input_dtypes`` (one per forward argument).
SETTINGS: dict[str, Any] = {}

_loaded: dict[str, Any] = {}


def load_module(model_dir: str, device: torch.device) -> Any:
    """Rebuild the module from `SETTINGS`, load the archive's weights and switch to eval mode."""
    if model_dir not in sys.path:
        sys.path.insert(0, model_dir)
    module_name, _, qualname = SETTINGS["module_class"].partition(":")
    cls: Any = importlib.import_module(module_name)
    for part in qualname.split("."):
        cls = getattr(cls, part)
    module = cls(**SETTINGS["init_args"])
    weights_path = os.path.join(model_dir, SETTINGS["weights_file"])
    module.load_state_dict(torch.load(weights_path, map_location="cpu", weights_only=True))
    return module.to(device).eval()


def decode(body: Any, device: torch.device) -> Any:
    """A request body (JSON bytes, or the value TorchServe already parsed) as ``predict_step``'s batch."""
    if isinstance(body, (bytes, bytearray)):
        body = body.decode("utf-8")
    if isinstance(body, str):
        body = json.loads(body)
    if isinstance(body, dict):
        if "inputs" not in body:
            raise ValueError(f'expected a JSON body {{"inputs": [...]}} or the list itself; got keys {sorted(body)}')
        body = body["inputs"]
    dtypes = SETTINGS["input_dtypes"]
    if len(dtypes) == 1:
        return torch.tensor(body, dtype=getattr(torch, dtypes[0]), device=device)
    if not isinstance(body, list) or len(body) != len(dtypes):
        raise ValueError(f"expected a list of {len(dtypes)} inputs, one batch per forward argument")
    return tuple(torch.tensor(v, dtype=getattr(torch, d), device=device) for v, d in zip(body, dtypes, strict=True))


def encode(value: Any) -> Any:
    """A ``predict_step`` output as JSON values: tensors become nested lists."""
    if isinstance(value, torch.Tensor):
        return value.detach().cpu().tolist()
    if isinstance(value, dict):
        return {str(k): encode(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [encode(v) for v in value]
    return value


def handle(data: list[dict[str, Any]] | None, context: Any) -> list[Any] | None:
    """TorchServe's entry point: one reply per request (None for a call without data)."""
    if "module" not in _loaded:
        gpu = context.system_properties.get("gpu_id")
        device = torch.device(f"cuda:{gpu}" if gpu is not None and torch.cuda.is_available() else "cpu")
        _loaded["device"] = device
        _loaded["module"] = load_module(context.system_properties["model_dir"], device)
    if data is None:
        return None
    module, device = _loaded["module"], _loaded["device"]
    replies = []
    for request in data:
        body = request.get("body")
        if body is None:
            body = request.get("data")
        with torch.no_grad():
            replies.append(encode(module.predict_step(decode(body, device), 0)))
    return replies
