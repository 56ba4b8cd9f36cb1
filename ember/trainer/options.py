"""Checking and normalising `Trainer` options: every bad value fails here, before any work."""

from __future__ import annotations

import difflib
import re
from datetime import timedelta
from typing import Any

import torch

from ember.strategies.precision import resolve_precision
from ember.strategies.strategy import Strategy
from ember.trainer.data import check_limit

_ACCELERATORS = ("auto", "cpu", "cuda")


def check(
    *,
    accumulate_grad_batches: int,
    log_every_n_steps: int,
    check_val_every_n_epoch: int,
    limits: dict[str, float | int],
    gradient_clip_val: float | None,
    gradient_clip_algorithm: str,
    val_check_interval: float | int,
    num_sanity_val_steps: int,
) -> None:
    """Raise on the first bad value, with a message that names the option and the fix."""
    check_positive_int("accumulate_grad_batches", accumulate_grad_batches)
    check_positive_int("log_every_n_steps", log_every_n_steps)
    check_positive_int("check_val_every_n_epoch", check_val_every_n_epoch)
    for name, value in limits.items():
        check_limit(name, value)
    if gradient_clip_algorithm not in ("norm", "value"):
        raise ValueError(f"gradient_clip_algorithm={gradient_clip_algorithm!r}; choose 'norm' or 'value'")
    check_val_check_interval(val_check_interval)
    if gradient_clip_val is not None and (
        isinstance(gradient_clip_val, bool) or not isinstance(gradient_clip_val, (int, float)) or gradient_clip_val < 0
    ):
        raise ValueError(f"gradient_clip_val={gradient_clip_val!r} must be a number >= 0 (0 or None: no clipping)")
    if isinstance(num_sanity_val_steps, bool) or not isinstance(num_sanity_val_steps, int) or num_sanity_val_steps < -1:
        raise ValueError(f"num_sanity_val_steps={num_sanity_val_steps!r}: use a batch count >= 0, or -1 for all")


def check_positive_int(name: str, value: Any) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ValueError(f"{name} must be a positive int; got {value!r}")


def check_val_check_interval(value: Any) -> None:
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise TypeError(
            f"val_check_interval must be a fraction of an epoch (float) or a batch count (int); got {value!r}"
        )
    if isinstance(value, float) and not 0.0 < value <= 1.0:
        raise ValueError(f"val_check_interval={value}: a fraction must lie in (0, 1]; use an int for a batch count")
    if isinstance(value, int) and value < 1:
        raise ValueError(f"val_check_interval={value}: a batch count must be at least 1")


def parse_max_time(value: float | str | timedelta | dict[str, int] | None) -> float | None:
    if value is None:
        return None
    seconds: float | None = None
    if isinstance(value, timedelta):
        seconds = value.total_seconds()
    elif isinstance(value, dict):
        try:
            seconds = timedelta(**value).total_seconds()
        except TypeError:
            raise ValueError(
                f"max_time={value!r}: dict keys must be timedelta fields "
                "(days, hours, minutes, seconds, milliseconds, ...)"
            ) from None
    elif isinstance(value, str):
        match = re.fullmatch(r"(\d+):(\d\d):(\d\d):(\d\d)", value)
        if not match:
            raise ValueError(f"max_time={value!r}: use 'DD:HH:MM:SS', seconds, or a timedelta")
        d, h, m, s = map(int, match.groups())
        seconds = timedelta(days=d, hours=h, minutes=m, seconds=s).total_seconds()
    elif isinstance(value, (int, float)) and not isinstance(value, bool):
        seconds = float(value)
    if seconds is None or not seconds > 0:
        raise ValueError(
            f"max_time={value!r}: use a positive budget: seconds (> 0), 'DD:HH:MM:SS', a timedelta or a dict"
        )
    return seconds


_STRATEGIES = ("auto", "single_device", "ddp", "fsdp", "model_parallel")


def resolve_strategy(
    strategy: str | Strategy,
    accelerator: str,
    devices: int | str,
    num_nodes: int,
    precision: str | int,
    use_distributed_sampler: bool = True,
) -> Strategy:
    """Build the strategy the options describe; ``"auto"`` is DDP when more than one process runs.

    ``"model_parallel"`` is `ModelParallelStrategy` with both sizes ``"auto"`` (tensor parallel within each
    node, data parallel across nodes); pass an instance (or a ``_target_`` section) for other sizes.
    """
    from ember.strategies.ddp import DDPStrategy
    from ember.strategies.environment import detect
    from ember.strategies.fsdp import FSDPStrategy
    from ember.strategies.parallel import ParallelStrategy

    if accelerator not in _ACCELERATORS:
        raise ValueError(f"accelerator={accelerator!r} is not valid; choose one of: {', '.join(_ACCELERATORS)}")
    if accelerator == "cuda" and not torch.cuda.is_available():
        raise RuntimeError("accelerator='cuda' but CUDA is not available here; use accelerator='cpu' or 'auto'")
    check_positive_int("num_nodes", num_nodes)
    use_cuda = accelerator == "cuda" or (accelerator == "auto" and torch.cuda.is_available())
    if devices == "auto":
        cluster = detect()
        # The launcher's processes per node; a num_nodes that disagrees is reported in setup_environment.
        count = max(cluster.world_size // max(cluster.num_nodes, 1), 1) if cluster.kind != "single" else 1
    elif isinstance(devices, int) and not isinstance(devices, bool) and devices >= 1:
        count = devices
    elif isinstance(devices, str) and devices.isdigit() and int(devices) >= 1:
        count = int(devices)
    else:
        raise ValueError(f"devices={devices!r}: use a positive number of processes (devices=1 is one device) or 'auto'")
    if use_cuda and count > torch.cuda.device_count():
        raise ValueError(f"devices={count} but this machine has {torch.cuda.device_count()} CUDA device(s)")
    plugin = resolve_precision(precision)
    if isinstance(strategy, str) and strategy not in _STRATEGIES:
        raise ValueError(
            f"strategy={strategy!r} is not valid; choose one of: {', '.join(_STRATEGIES)} or a Strategy instance"
        )
    if strategy == "auto":
        strategy = "ddp" if count * num_nodes > 1 or detect().kind != "single" else "single_device"
    if strategy == "single_device":
        if count * num_nodes > 1:
            raise ValueError(f"strategy='single_device' runs one process; devices={devices}, num_nodes={num_nodes}")
        return Strategy("cuda:0" if use_cuda else "cpu", plugin)
    if strategy == "model_parallel":
        from ember.strategies.model_parallel import ModelParallelStrategy

        strategy = ModelParallelStrategy()  # one TP group per node; a Strategy instance sets the sizes
    elif isinstance(strategy, str):
        strategy = DDPStrategy() if strategy == "ddp" else FSDPStrategy()
    strategy.precision = plugin
    if isinstance(strategy, ParallelStrategy):
        strategy.devices, strategy.num_nodes = count, num_nodes
        strategy.accelerator = accelerator
        strategy.use_distributed_sampler = use_distributed_sampler
    return strategy


_COMPILE_KEYS = ("mode", "fullgraph", "dynamic", "backend", "options")
_COMPILE_MODES = ("default", "reduce-overhead", "max-autotune", "max-autotune-no-cudagraphs")


def compile_options(value: bool | dict[str, Any]) -> dict[str, Any] | None:
    """``compile=True`` -> {} (torch.compile defaults); a dict is checked key by key; False -> None."""
    if value is False or value is None:
        return None
    if value is True:
        return {}
    if not isinstance(value, dict):
        raise TypeError(f"compile must be True, False or a dict of torch.compile options; got {value!r}")
    for key in value:
        if key not in _COMPILE_KEYS:
            close = difflib.get_close_matches(str(key), _COMPILE_KEYS, n=1)
            hint = f"; did you mean {close[0]!r}?" if close else f"; valid: {', '.join(_COMPILE_KEYS)}"
            raise ValueError(f"compile: unknown option {key!r}{hint}")
    if value.get("mode", "default") not in _COMPILE_MODES:
        raise ValueError(f"compile: mode={value['mode']!r}; choose one of: {', '.join(_COMPILE_MODES)}")
    return dict(value)
