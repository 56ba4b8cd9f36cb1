"""Hyperparameters as a checkpoint holds them: plain data only, so a reader that runs no code
(``weights_only``) reads back everything ember writes. A class or a function is held by its import path and
found again only among the modules the reading process has imported; any other object is not held, and
`from_checkpoint` says which keyword to pass instead."""

from __future__ import annotations

import inspect
import sys
from typing import Any

import torch

#: How a checkpoint holds a hyperparameter that is a class or a function: its import path.
REFERENCE = "__ember_reference__"
#: How a checkpoint marks a hyperparameter it does not hold (an object that is not plain data): its type.
NOT_SAVED = "__ember_not_saved__"
_PLAIN = (type(None), bool, int, float, str, torch.Tensor, torch.Size)


def for_checkpoint(hparams: dict[str, Any]) -> dict[str, Any]:
    """`hparams` as a checkpoint holds them: plain data as it is (numbers, strings, tensors, lists, tuples and
    dicts of them); a class or a function as ``{REFERENCE: "module.Qualname"}``; anything else as
    ``{NOT_SAVED: "its type"}``, which `load_from_checkpoint` asks to be given again. A checkpoint never holds
    what its reader (``weights_only``) would refuse."""
    return {str(key): _plain(value) for key, value in hparams.items()}


def _plain(value: Any) -> Any:
    if isinstance(value, _PLAIN):
        return value.detach().cpu() if isinstance(value, torch.Tensor) else value
    if isinstance(value, (list, tuple)):
        items = [_plain(v) for v in value]
        return items if isinstance(value, list) else tuple(items)
    if isinstance(value, dict) and all(isinstance(k, str) for k in value):
        return {k: _plain(v) for k, v in value.items()}
    reference = _reference(value) if inspect.isclass(value) or callable(value) else None
    if reference is not None:
        return {REFERENCE: reference}
    return {NOT_SAVED: f"{type(value).__module__}.{type(value).__qualname__}"}


def _reference(value: Any) -> str | None:
    """``"module:name"`` that finds `value` again (its qualified name, else its plain name: ``torch.relu``), or
    None (a lambda, a local class, an instance)."""
    module = getattr(value, "__module__", None)
    if not isinstance(module, str):
        return None
    for name in (getattr(value, "__qualname__", None), getattr(value, "__name__", None)):
        if isinstance(name, str) and "<" not in name and _resolve(module, name) is value:
            return f"{module}:{name}"
    return None


def not_saved(hparams: dict[str, Any]) -> dict[str, str]:
    """The hyperparameters `for_checkpoint` would not hold, with their types."""
    saved = for_checkpoint(hparams)
    return {k: v[NOT_SAVED] for k, v in saved.items() if isinstance(v, dict) and set(v) == {NOT_SAVED}}


def from_checkpoint(saved: dict[str, Any], given: dict[str, Any], owner: str) -> dict[str, Any]:
    """The keyword arguments to rebuild `owner` from its checkpoint's hyperparameters: references resolved among
    the modules this process has imported already (reading a checkpoint never imports, so never runs code),
    `given` (``load_from_checkpoint``'s keywords) taking precedence. A hyperparameter the checkpoint does not
    hold, or a reference to a module not imported, is an error that says what to pass."""
    out: dict[str, Any] = {}
    for key, value in saved.items():
        if key not in given:
            out[key] = _restored(key, value, owner)
    return {**out, **given}


def _restored(key: str, value: Any, owner: str) -> Any:
    if isinstance(value, dict) and set(value) == {NOT_SAVED}:
        raise TypeError(
            f"cannot rebuild {owner}: its hyperparameter {key!r} (a {value[NOT_SAVED]}) is not in the checkpoint "
            f"(it is not plain data); pass it: load_from_checkpoint(path, {key}=...)"
        )
    if isinstance(value, dict) and set(value) == {REFERENCE} and isinstance(value[REFERENCE], str):
        module, _, qualname = value[REFERENCE].partition(":")
        found = _resolve(module, qualname)
        if found is None:
            raise TypeError(
                f"cannot rebuild {owner}: its hyperparameter {key!r} names {module}.{qualname}, which this process "
                f"has not imported (a checkpoint never imports code); import {module} first, or pass "
                f"load_from_checkpoint(path, {key}=...)"
            )
        return found
    if isinstance(value, list):
        return [_restored(key, v, owner) for v in value]
    if isinstance(value, tuple):
        return tuple(_restored(key, v, owner) for v in value)
    if isinstance(value, dict):
        return {k: _restored(key, v, owner) for k, v in value.items()}
    return value


def _resolve(module: str | None, qualname: str) -> Any:
    """`module.qualname` among the modules already imported; None if it is not there."""
    found: Any = sys.modules.get(module or "")
    for part in qualname.split("."):
        if found is None:
            return None
        found = getattr(found, part, None)
    return found
