"""The config schema: what a run config may contain, typed, and key paths into it.

`RunConfig` is the whole file; `TrainerConfig` mirrors the `ember.Trainer` keywords field for field
(tests/unit/test_config.py compares them with the signature). ``module``, ``data``, ``optimizer`` and
``lr_scheduler`` are ``_target_`` sections: a dotted path plus constructor keywords.
"""

from __future__ import annotations

import dataclasses
import re
import types
import typing
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from omegaconf import MISSING


class ConfigError(Exception):
    """A config or command-line mistake found before any work starts; ``str()`` is one line."""


@dataclass
class TrainerConfig:
    """The keywords of `ember.Trainer`, field for field (tests/unit/test_config.py keeps them in step)."""

    max_epochs: int | None = None
    max_steps: int = -1
    max_time: Any = None  # seconds, "DD:HH:MM:SS" or {hours: 2}
    accelerator: str = "auto"
    devices: int | str = "auto"
    strategy: Any = "auto"  # a name, or a _target_ section
    num_nodes: int = 1
    precision: str | int = "32-true"
    accumulate_grad_batches: int = 1
    gradient_clip_val: float | None = None
    gradient_clip_algorithm: str = "norm"
    val_check_interval: float | int = 1.0
    check_val_every_n_epoch: int = 1
    num_sanity_val_steps: int = 2
    limit_train_batches: float | int = 1.0
    limit_val_batches: float | int = 1.0
    limit_test_batches: float | int = 1.0
    limit_predict_batches: float | int = 1.0
    log_every_n_steps: int = 50
    callbacks: list[Any] | None = None  # _target_ sections
    logger: Any = True  # true, false, a _target_ section or a list of them
    enable_progress_bar: bool = True
    enable_model_summary: bool = True
    enable_checkpointing: bool = True
    default_root_dir: str = "runs"
    run_name: str | None = None
    requeue_signal: str | int | None = "SIGUSR1"
    deterministic: bool = False
    fast_dev_run: bool | int = False
    detect_anomaly: bool = False
    use_distributed_sampler: bool = True
    nonfinite_loss: str | None = None
    compile: Any = False  # true, false, or a mapping of torch.compile keywords
    tune_cpu_allocator: bool = True


@dataclass
class RunConfig:
    """A whole run: what `ember fit -c FILE` reads. ``module`` and ``data`` are ``_target_`` plus kwargs."""

    seed: int | None = None
    trainer: TrainerConfig = field(default_factory=TrainerConfig)
    module: dict[str, Any] = MISSING
    data: dict[str, Any] = MISSING
    optimizer: dict[str, Any] | None = None
    lr_scheduler: dict[str, Any] | None = None


def split_key(key: str) -> list[str | int]:
    """``"trainer.callbacks[0].monitor"`` -> ``["trainer", "callbacks", 0, "monitor"]``."""
    return [int(p[1:-1]) if p.startswith("[") else p for p in re.findall(r"\[\d+\]|[^.\[\]]+", key)]


def lookup(container: Any, parts: Sequence[str | int]) -> tuple[bool, Any]:
    """(found, value) of the key `parts` in nested dicts and lists."""
    for part in parts:
        if isinstance(container, dict):
            found = part in container
        else:
            found = isinstance(container, list) and isinstance(part, int) and part < len(container)
        if not found:
            return False, None
        container = container[part]
    return True, container


def schema_type(key: str) -> str | None:
    """The schema's type for `key` in words ("int or null"), or None where the schema does not say."""
    cls: Any = RunConfig
    hint: Any = None
    for part in split_key(key):
        if not (isinstance(part, str) and dataclasses.is_dataclass(cls)):
            return None
        hint = typing.get_type_hints(cls).get(part)
        cls = hint
    return describe_type(hint)


def describe_type(hint: Any) -> str | None:
    """``int | None`` -> "int or null"; None for `Any` and types it cannot name."""
    if hint is None or hint is Any:
        return None
    if typing.get_origin(hint) in (typing.Union, types.UnionType):
        names = [describe_type(a) for a in typing.get_args(hint)]
        return None if None in names else " or ".join(n for n in names if n)
    if hint is type(None):
        return "null"
    if dataclasses.is_dataclass(hint):
        return "a mapping of options"
    origin = typing.get_origin(hint) or hint
    return {dict: "a mapping", list: "a list"}.get(origin, getattr(hint, "__name__", None))
