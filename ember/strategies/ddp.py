"""`DDPStrategy`: one replica per process, gradients all-reduced by DistributedDataParallel."""

from __future__ import annotations

import contextlib
from typing import Any

from torch import nn
from torch.nn.parallel import DistributedDataParallel

from ember.strategies.parallel import ParallelStrategy
from ember.strategies.precision import Precision
from ember.strategies.strategy import _NULL_CONTEXT


class _TrainingStep(nn.Module):
    """Lets DDP's forward run the whole `training_step`, so DDP prepares the backward it syncs."""

    def __init__(self, module: nn.Module) -> None:
        super().__init__()
        self.module = module

    def forward(self, batch: Any, batch_idx: int) -> Any:
        return self.module.training_step(batch, batch_idx)  # type: ignore[operator]


class DDPStrategy(ParallelStrategy):
    """Distributed data parallel over torch.distributed (gloo on CPU, NCCL on GPU).

    Options are DistributedDataParallel's: ``find_unused_parameters``,
    ``static_graph``, ``gradient_as_bucket_view``, ``bucket_cap_mb``. While
    gradients accumulate, the all-reduce is skipped (``no_sync``) until the
    window's last batch.
    """

    def __init__(
        self,
        find_unused_parameters: bool = False,
        static_graph: bool = False,
        gradient_as_bucket_view: bool = True,
        bucket_cap_mb: float = 25.0,
        precision: Precision | None = None,
        backend: str | None = None,
        timeout_s: float = 1800.0,
        use_distributed_sampler: bool = True,
    ) -> None:
        super().__init__(precision, backend, timeout_s, use_distributed_sampler)
        self.ddp_options: dict[str, Any] = {
            "find_unused_parameters": find_unused_parameters,
            "static_graph": static_graph,
            "gradient_as_bucket_view": gradient_as_bucket_view,
            "bucket_cap_mb": bucket_cap_mb,
        }
        self._ddp: DistributedDataParallel | None = None

    def setup_module(self, module: nn.Module) -> nn.Module:
        module = super().setup_module(module)
        device_ids = [self.root_device.index] if self.root_device.type == "cuda" else None
        self._ddp = DistributedDataParallel(_TrainingStep(module), device_ids=device_ids, **self.ddp_options)
        return self._ddp

    def release_model(self) -> None:
        """Drop the DDP wrapper: its gradient hooks on the parameters must be gone before the module is wrapped
        again (two reducers would fire)."""
        self._ddp = None

    def training_step(self, module: nn.Module, batch: Any, batch_idx: int) -> Any:
        assert self._ddp is not None, "setup_module runs first"
        return self._ddp(batch, batch_idx)

    def no_sync(self, module: nn.Module, enabled: bool) -> contextlib.AbstractContextManager[None]:
        if enabled and self._ddp is not None:
            return self._ddp.no_sync()
        return _NULL_CONTEXT
