"""Turn what `configure_optimizers` returns into optimizers plus scheduler configs.

Accepted forms:

- an optimizer, or a list/tuple of optimizers;
- a dict ``{"optimizer": opt, "lr_scheduler": sched_or_dict}``, or a list of such dicts;
- a scheduler dict ``{"scheduler": s, "interval": "step"|"epoch", "frequency": 1, "monitor": "val/loss"}``.

`ReduceLROnPlateau` needs ``monitor``; every other scheduler steps without arguments.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from torch.optim import Optimizer
from torch.optim.lr_scheduler import LRScheduler, ReduceLROnPlateau

from ember.hints import did_you_mean

_OPTIMIZER_KEYS = ("optimizer", "lr_scheduler")
_SCHEDULER_KEYS = ("scheduler", "interval", "frequency", "monitor", "strict", "name")


@dataclass
class SchedulerConfig:
    """A scheduler with when it steps."""

    scheduler: LRScheduler | ReduceLROnPlateau
    interval: str = "epoch"
    frequency: int = 1
    monitor: str | None = None
    strict: bool = True
    name: str | None = None

    @property
    def needs_metric(self) -> bool:
        return isinstance(self.scheduler, ReduceLROnPlateau)


@dataclass
class OptimizerSetup:
    optimizers: list[Optimizer]
    schedulers: list[SchedulerConfig]


def _check_keys(where: str, given: Mapping[str, Any], valid: Sequence[str]) -> None:
    for key in given:
        if key not in valid:
            hint = did_you_mean(str(key), valid, f"valid keys: {', '.join(valid)}")
            raise ValueError(f"configure_optimizers: unknown key {key!r} in the {where} dict; {hint}")


def _parse_scheduler(value: Any) -> SchedulerConfig:
    if isinstance(value, Mapping):
        _check_keys("lr_scheduler", value, _SCHEDULER_KEYS)
        if "scheduler" not in value:
            raise ValueError("configure_optimizers: the lr_scheduler dict needs a 'scheduler' entry")
        config = SchedulerConfig(**value)
    else:
        config = SchedulerConfig(scheduler=value)
    if not isinstance(config.scheduler, (LRScheduler, ReduceLROnPlateau)):
        raise TypeError(
            f"configure_optimizers: expected a torch.optim.lr_scheduler scheduler, "
            f"got {type(config.scheduler).__qualname__}"
        )
    if config.interval not in ("step", "epoch"):
        raise ValueError(f"configure_optimizers: interval must be 'step' or 'epoch', got {config.interval!r}")
    if not isinstance(config.frequency, int) or config.frequency < 1:
        raise ValueError(f"configure_optimizers: frequency must be a positive int, got {config.frequency!r}")
    if config.needs_metric and not config.monitor:
        raise ValueError(
            "configure_optimizers: ReduceLROnPlateau needs a metric to watch; return "
            '{"optimizer": opt, "lr_scheduler": {"scheduler": sched, "monitor": "val/loss"}}'
        )
    return config


def parse_optimizers(returned: Any) -> OptimizerSetup:
    """Validate and normalise the value returned by `configure_optimizers`."""
    items = list(returned) if isinstance(returned, (list, tuple)) else [returned]
    if not items:
        raise ValueError("configure_optimizers returned an empty list; return at least one optimizer")
    optimizers: list[Optimizer] = []
    schedulers: list[SchedulerConfig] = []
    for item in items:
        if isinstance(item, Optimizer):
            optimizers.append(item)
        elif isinstance(item, Mapping):
            _check_keys("optimizer", item, _OPTIMIZER_KEYS)
            if not isinstance(item.get("optimizer"), Optimizer):
                raise TypeError(
                    "configure_optimizers: a dict needs an 'optimizer' entry holding a torch.optim.Optimizer"
                )
            optimizers.append(item["optimizer"])
            if item.get("lr_scheduler") is not None:
                schedulers.append(_parse_scheduler(item["lr_scheduler"]))
        else:
            raise TypeError(
                "configure_optimizers must return an optimizer, a list of optimizers, or "
                '{"optimizer": ..., "lr_scheduler": ...} dicts; '
                f"got {type(item).__qualname__}"
            )
    return OptimizerSetup(optimizers, schedulers)


class ManualOptimizer:
    """What `TrainingModule.optimizers()` returns under manual optimization.

    It behaves like the wrapped optimizer, but `step()` goes through the
    trainer (precision scaling, hooks, `global_step` counting).
    """

    def __init__(self, optimizer: Optimizer, step_fn: Any) -> None:
        self.optimizer = optimizer
        self._step_fn = step_fn

    def step(self, closure: Any = None) -> None:
        """Step the optimizer through the trainer; increments `global_step`."""
        self._step_fn(self.optimizer, closure)

    def zero_grad(self, set_to_none: bool = True) -> None:
        self.optimizer.zero_grad(set_to_none=set_to_none)

    @property
    def param_groups(self) -> list[dict[str, Any]]:
        return self.optimizer.param_groups

    def __getattr__(self, name: str) -> Any:
        return getattr(self.optimizer, name)
