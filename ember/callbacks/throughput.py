"""`ThroughputMonitor`: samples, batches and tokens per second, FLOP/s and MFU of training.

Per batch the callback adds to counters; rates are computed (and the device
synchronised, on GPU) only on logged steps.
"""

from __future__ import annotations

import re
import time
from collections.abc import Callable, Mapping
from typing import TYPE_CHECKING, Any

import torch
from torch import Tensor, nn
from torch.optim import Optimizer

from ember.callbacks.callback import Callback
from ember.callbacks.lr_monitor import exact
from ember.modules.logging import infer_batch_size

if TYPE_CHECKING:
    from ember.modules.module import TrainingModule
    from ember.trainer.trainer import Trainer

#: Dense peak FLOP/s per device by model name and compute dtype (vendor datasheets, without sparsity). A name
#: matches whole words of the device name (``"L4"`` is not ``"NVIDIA L40"``); the first entry that matches wins,
#: so a variant (``"H100 PCIe"``) comes before its family (``"H100"``: the SXM cards).
PEAK_FLOPS: dict[str, dict[str, float]] = {
    "H200": {"bf16": 989e12, "fp16": 989e12, "tf32": 494.5e12, "fp32": 67e12},
    "H100 PCIe": {"bf16": 756e12, "fp16": 756e12, "tf32": 378e12, "fp32": 51e12},
    "H100": {"bf16": 989e12, "fp16": 989e12, "tf32": 494.5e12, "fp32": 67e12},
    "A100": {"bf16": 312e12, "fp16": 312e12, "tf32": 156e12, "fp32": 19.5e12},
    "A10G": {"bf16": 70e12, "fp16": 70e12, "tf32": 35e12, "fp32": 31.2e12},
    "L40S": {"bf16": 362e12, "fp16": 362e12, "tf32": 183e12, "fp32": 91.6e12},
    "L40": {"bf16": 181e12, "fp16": 181e12, "tf32": 90.5e12, "fp32": 90.5e12},
    "L4": {"bf16": 121e12, "fp16": 121e12, "tf32": 60e12, "fp32": 30.3e12},
    "V100": {"fp16": 125e12, "fp32": 15.7e12},
    "T4": {"fp16": 65e12, "fp32": 8.1e12},
    "RTX 4090": {"bf16": 165.2e12, "fp16": 165.2e12, "tf32": 82.6e12, "fp32": 82.6e12},
}


def peak_flops_per_s(device: torch.device, precision: str = "32-true") -> float | None:
    """Peak dense FLOP/s of a CUDA `device` for ember `precision` from `PEAK_FLOPS`; None when unknown (CPU)."""
    if device.type != "cuda":
        return None
    name = torch.cuda.get_device_name(device)
    if precision.startswith("bf16"):
        dtype = "bf16"
    elif precision.startswith("16"):
        dtype = "fp16"
    else:
        dtype = "tf32" if torch.backends.cuda.matmul.allow_tf32 else "fp32"
    words = re.findall(r"[a-z0-9]+", name.lower())  # "NVIDIA A100-SXM4-80GB" -> nvidia, a100, sxm4, 80gb
    for model, peaks in PEAK_FLOPS.items():
        wanted = model.lower().split()
        if any(words[i : i + len(wanted)] == wanted for i in range(len(words))):
            return peaks.get(dtype)
    return None


def measure_flops(forward_fn: Callable[[], Any], loss_fn: Callable[[Any], Tensor] | None = None) -> int:
    """FLOPs of ``forward_fn()`` (and of the backward of ``loss_fn(output)`` when given), by `torch.utils.flop_counter`.

    Run it on the meta device to measure without computing, e.g.
    ``with torch.device("meta"): model = Net(); x = torch.randn(8, 64)``, then
    ``measure_flops(lambda: model(x), lambda y: y.sum())``.
    """
    from torch.utils.flop_counter import FlopCounterMode

    with FlopCounterMode(display=False) as counter:
        output = forward_fn()
        if loss_fn is not None:
            loss_fn(output).backward()
    return int(counter.get_total_flops())


class ThroughputMonitor(Callback):
    """Logs training throughput on the trainer's logging steps (``trainer.logs_this_batch``).

    Logged per process, as the mean over the batches since the previous
    logged step (time spent in validation is left out):

    - ``throughput/batches_per_s`` and ``throughput/samples_per_s`` (the batch
      size is the first dimension of the first tensor in the batch, or
      ``batch_size_fn(batch)``);
    - ``throughput/tokens_per_s`` when the batch says how many tokens it holds:
      ``length_fn(batch)``, else a dict batch's ``"num_tokens"``, else the sum of
      its ``"attention_mask"``, else the size of its ``"input_ids"``;
    - ``throughput/flops_per_s`` when the FLOPs of a batch (forward + backward)
      are known: ``flops_per_batch``, or measured once with
      `torch.utils.flop_counter` on ``module.example_input_array`` (scaled by
      batch size) when the module sets one;
    - ``throughput/mfu`` (model FLOPs utilisation) when the device's peak
      FLOP/s is known: ``peak_flops_per_s``, or `PEAK_FLOPS` for common GPUs.

    `last` holds the most recent figures as floats.
    """

    def __init__(
        self,
        *,
        batch_size_fn: Callable[[Any], int] | None = None,
        length_fn: Callable[[Any], int | Tensor] | None = None,
        flops_per_batch: float | None = None,
        peak_flops_per_s: float | None = None,
        measure_flops: bool = True,
    ) -> None:
        self.batch_size_fn = batch_size_fn
        self.length_fn = length_fn
        self.flops_per_batch = flops_per_batch
        self.peak_flops_per_s = peak_flops_per_s
        self.measure = measure_flops
        #: The most recent figures, as floats (empty until the first logged step).
        self.last: dict[str, float] = {}
        self._flops_per_sample: float | None = None
        self._peak: float | None = None
        self._sync: Callable[[], None] = lambda: None
        self._reset_window(time.perf_counter())
        self._paused_at: float | None = None

    def _reset_window(self, now: float) -> None:
        self._window_start = now
        self._paused_s = 0.0
        self._batches = 0
        self._samples = 0
        self._tokens: int | Tensor = 0
        self._has_tokens = False

    def on_train_start(self, trainer: Trainer, module: TrainingModule) -> None:
        """Find the FLOPs per sample and the device peak; start the clock."""
        device = trainer.strategy.root_device
        self._peak = self.peak_flops_per_s or peak_flops_per_s(device, getattr(trainer.strategy.precision, "name", ""))
        if device.type == "cuda":
            self._sync = lambda: torch.cuda.synchronize(device)
        if self.flops_per_batch is None and self.measure and module.example_input_array is not None:
            self._flops_per_sample = flops_per_sample(module, module.example_input_array)
        self._sync()
        self._reset_window(time.perf_counter())

    def on_train_batch_start(self, trainer: Trainer, module: TrainingModule, batch: Any, batch_idx: int) -> None:
        """Count the batch's samples and tokens (tokens may stay a device tensor until the next log)."""
        self._batches += 1
        self._samples += self.batch_size_fn(batch) if self.batch_size_fn else infer_batch_size(batch)
        tokens = self.length_fn(batch) if self.length_fn else count_tokens(batch)
        if tokens is not None:
            self._tokens = self._tokens + tokens
            self._has_tokens = True

    def on_before_optimizer_step(self, trainer: Trainer, module: TrainingModule, optimizer: Optimizer) -> None:
        """On logged steps, log the rates of the window that ends here.

        A window runs from one logged step's ``on_before_optimizer_step`` to the
        next, so it spans whole steps: it counts the batches started in it.
        """
        if not trainer.logs_this_batch:
            return
        self._sync()
        now = time.perf_counter()
        elapsed = now - self._window_start - self._paused_s
        batches, samples = self._batches, self._samples
        tokens = float(self._tokens) if self._has_tokens else None
        self._reset_window(now)
        if elapsed <= 0 or batches == 0:
            return
        self.last = self.compute(elapsed, batches, samples, tokens)
        for name, value in self.last.items():
            module.log(name, exact(value), on_step=True, on_epoch=False)

    def compute(self, elapsed_s: float, batches: int, samples: int, tokens: float | None) -> dict[str, float]:
        """The figures for `batches` batches of `samples` samples (and `tokens` tokens) in `elapsed_s` seconds."""
        figures = {
            "throughput/batches_per_s": batches / elapsed_s,
            "throughput/samples_per_s": samples / elapsed_s,
        }
        if tokens is not None:
            figures["throughput/tokens_per_s"] = tokens / elapsed_s
        flops = None
        if self.flops_per_batch is not None:
            flops = self.flops_per_batch * batches
        elif self._flops_per_sample is not None:
            flops = self._flops_per_sample * samples
        if flops is not None:
            figures["throughput/flops_per_s"] = flops / elapsed_s
            if self._peak:
                figures["throughput/mfu"] = flops / elapsed_s / self._peak
        return figures

    def on_validation_start(self, trainer: Trainer, module: TrainingModule) -> None:
        """Pause the clock while validation runs inside fit."""
        if trainer.stage == "fit" and not trainer.sanity_checking:
            self._paused_at = time.perf_counter()

    def on_validation_end(self, trainer: Trainer, module: TrainingModule) -> None:
        """Resume the clock."""
        if self._paused_at is not None:
            self._paused_s += time.perf_counter() - self._paused_at
            self._paused_at = None

    def state_dict(self) -> dict[str, Any]:
        """Nothing: rates restart with a resumed run."""
        return {}


def count_tokens(batch: Any) -> int | Tensor | None:
    """Tokens in a dict batch: ``num_tokens``, else ``attention_mask.sum()`` (a tensor), else ``input_ids.numel()``."""
    if not isinstance(batch, Mapping):
        return None
    if "num_tokens" in batch:
        value = batch["num_tokens"]
        return value if isinstance(value, Tensor) else int(value)
    mask = batch.get("attention_mask")
    if isinstance(mask, Tensor):
        return mask.sum()
    ids = batch.get("input_ids")
    if isinstance(ids, Tensor):
        return ids.numel()
    return None


def flops_per_sample(module: nn.Module, example_input: Any) -> float | None:
    """Forward + backward FLOPs of one sample, measured on `example_input` (its first dimension is the batch).

    Runs in eval mode with the random streams forked and the gradients put back
    afterwards, so training is unaffected. None when nothing was counted.
    """
    from ember.strategies.strategy import move_to_device

    param = next(module.parameters(), None)
    device = param.device if param is not None else torch.device("cpu")
    inputs = move_to_device(example_input, device)
    saved = [(p, p.grad) for p in module.parameters()]
    modes = [(m, m.training) for m in module.modules()]

    def forward() -> Any:
        return module(*inputs) if isinstance(inputs, (tuple, list)) else module(inputs)

    def loss(output: Any) -> Tensor:
        sums = [t.float().sum() for t in _flatten(output) if isinstance(t, Tensor) and t.requires_grad]
        return torch.stack(sums).sum() if sums else torch.zeros((), requires_grad=True)

    try:
        with torch.random.fork_rng(devices=[device.index or 0] if device.type == "cuda" else []):
            module.eval()
            for p, _ in saved:
                p.grad = None
            flops = measure_flops(forward, loss)
    finally:
        for p, grad in saved:
            p.grad = grad
        for m, training in modes:
            m.training = training
    return flops / infer_batch_size(inputs) if flops else None


def _flatten(value: Any) -> list[Any]:
    if isinstance(value, Mapping):
        return [x for v in value.values() for x in _flatten(v)]
    if isinstance(value, (tuple, list)):
        return [x for v in value for x in _flatten(v)]
    return [value]
