"""Strategies (device placement, backward, optimizer step, collectives) and precision plugins.

`Strategy` is one process on one device; `DDPStrategy`, `FSDPStrategy` and
`ModelParallelStrategy` (tensor parallel x FSDP2) run one process per device
(see docs/distributed.md). The multi-process ones are imported on first use, so
``import ember`` stays light.
"""

from typing import Any

from ember.strategies.precision import Precision
from ember.strategies.strategy import Strategy

__all__ = ["DDPStrategy", "FSDPStrategy", "ModelParallelStrategy", "ParallelStrategy", "Precision", "Strategy"]


def __getattr__(name: str) -> Any:
    if name == "DDPStrategy":
        from ember.strategies.ddp import DDPStrategy

        return DDPStrategy
    if name == "FSDPStrategy":
        from ember.strategies.fsdp import FSDPStrategy

        return FSDPStrategy
    if name == "ParallelStrategy":  # the base of the multi-process ones (isinstance checks, as in Lightning)
        from ember.strategies.parallel import ParallelStrategy

        return ParallelStrategy
    if name == "ModelParallelStrategy":
        from ember.strategies.model_parallel import ModelParallelStrategy

        return ModelParallelStrategy
    raise AttributeError(f"module 'ember.strategies' has no attribute {name!r}")
