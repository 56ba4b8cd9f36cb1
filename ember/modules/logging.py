"""What `TrainingModule.log` records: step values and epoch aggregates, kept as tensors.

Nothing here calls `.item()`: values stay on their device until a logger or the
progress bar asks for floats through `to_floats`, which pays one host sync for a
whole dictionary. Epoch sums and means accumulate in float64 (one scalar per
logged name), so an epoch mean equals a script's float64 ``sum(loss * n) / N``
to within float32 rounding, however many batches it spans.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import Tensor

REDUCE_FX = ("mean", "sum", "max", "min")
#: The callables ``reduce_fx`` may name (Lightning accepts the same four reductions as functions).
_REDUCE_CALLABLES: dict[Any, str] = {
    torch.mean: "mean", torch.sum: "sum", torch.max: "max", torch.min: "min", sum: "sum", max: "max", min: "min",
}  # fmt: skip
DATALOADER_SUFFIX = "/dataloader_idx_"

ReduceFn = Callable[[Tensor, str], Tensor]


def to_floats(values: Mapping[str, Tensor | float]) -> dict[str, float]:
    """Convert a dict of scalar tensors to Python floats with a single host sync (one per device they are on:
    the tensors of a device are stacked there and copied to the host together)."""
    by_device: dict[torch.device, list[tuple[str, Tensor]]] = {}
    out: dict[str, float] = {}
    for k, v in values.items():
        if isinstance(v, Tensor):
            by_device.setdefault(v.device, []).append((k, v))
        else:
            out[k] = float(v)
    for items in by_device.values():
        stacked = torch.stack([v.detach().reshape(()).to(torch.float64, copy=False) for _, v in items])
        out.update(zip((k for k, _ in items), stacked.tolist(), strict=True))
    return {k: out[k] for k in values}  # in the order given


def infer_batch_size(batch: Any) -> int:
    """Size of the first dimension of the first tensor found in `batch` (1 if none)."""
    if isinstance(batch, Tensor):
        return int(batch.shape[0]) if batch.ndim > 0 else 1
    if isinstance(batch, Mapping):
        batch = list(batch.values())
    if isinstance(batch, (list, tuple)):
        for item in batch:
            size = infer_batch_size(item)
            if size > 0:
                return size
        return 1
    return 1


@dataclass
class _Entry:
    """One logged name within one epoch of one stage."""

    on_step: bool
    on_epoch: bool
    prog_bar: bool
    reduce_fx: str
    sync_dist: bool
    logger: bool = True
    metric: Any = None  # a torchmetrics.Metric when one was logged
    total: Tensor | None = None
    weight: int = 0
    #: A float64 scalar that a CPU value is copied into before it is added (not checkpointed): on the CPU,
    #: adding a float32 tensor to a float64 one would cast it into a new tensor first, at every step.
    scratch: Tensor | None = field(default=None, repr=False)

    def accumulate(self, value: Tensor, batch_size: int) -> None:
        if value.requires_grad:  # a training loss; evaluation values (no_grad) need no new tensor object
            value = value.detach()
        if self.total is None:
            if self.reduce_fx in ("max", "min"):  # exact in any dtype
                self.total = value.to(value.dtype if value.is_floating_point() else torch.float32, copy=True)
            else:  # a float32 running total drifts by several float32 units over a few hundred batches
                self.total = torch.zeros((), dtype=torch.float64, device=value.device)
                if value.device.type == "cpu" and value.dtype != torch.float64:
                    self.scratch = torch.empty((), dtype=torch.float64)
        if self.scratch is not None:
            value = self.scratch.copy_(value)  # exact: every float32 is a float64
        if self.reduce_fx == "mean":
            self.total.add_(value, alpha=batch_size)
        elif self.reduce_fx == "sum":
            self.total.add_(value)
        elif self.reduce_fx == "max":
            torch.maximum(self.total, value, out=self.total)
        else:
            torch.minimum(self.total, value, out=self.total)
        self.weight += batch_size

    def compute(self, reduce: ReduceFn) -> Tensor | None:
        if self.metric is not None:
            value: Tensor = self.metric.compute()  # torchmetrics syncs across ranks itself
            self.metric.reset()
            return value
        if self.total is None:
            return None
        # A weighted mean over ranks is (sum of totals) / (sum of weights): reduce totals with "sum".
        op = "sum" if self.reduce_fx == "mean" else self.reduce_fx
        total = reduce(self.total, op) if self.sync_dist else self.total
        if self.reduce_fx == "mean":
            if not self.sync_dist:
                return total / max(self.weight, 1)
            # The ranks' weights summed on the device, and kept there: no host sync at the epoch end.
            weight = reduce(torch.tensor(float(self.weight), dtype=total.dtype, device=total.device), "sum")
            return total / weight.clamp_min(1)
        return total.clone()


@dataclass
class MetricCollector:
    """Holds the values logged with `self.log` for the stage that is running.

    The loops tell it which stage runs (`start_epoch`), which batch is current
    (`see`, for batch-size inference) and which dataloader (`set_suffix`);
    `TrainingModule.log` calls `log`.
    """

    reduce: ReduceFn = field(default=lambda t, _fx: t)
    #: Where the running totals live: the module's device (a restored checkpoint's totals are read onto the CPU).
    device: Callable[[], torch.device] = field(default=lambda: torch.device("cpu"))
    stage: str = "train"
    suffix: str = ""
    current_batch: Any = None
    step_values: dict[str, Tensor] = field(default_factory=dict)
    prog_bar_names: set[str] = field(default_factory=set)
    #: Names logged with ``logger=False``: shown in the progress bar and callback metrics, never sent to loggers.
    not_for_loggers: set[str] = field(default_factory=set)
    #: Names logged with both ``on_step`` and ``on_epoch`` (kept as ``name_step`` / ``name_epoch``), by plain name.
    forked: dict[str, tuple[str, str]] = field(default_factory=dict)
    _entries: dict[str, _Entry] = field(default_factory=dict)
    _batch_size: int = 1
    _sized_batch: Any = None

    def see(self, batch: Any) -> None:
        """`batch` is the current one (its size weighs the epoch means of values logged without ``batch_size``)."""
        self.current_batch = batch

    def set_suffix(self, suffix: str) -> None:
        """Append `suffix` (``"/dataloader_idx_N"`` with several eval dataloaders) to the names logged from now on."""
        self.suffix = suffix

    def start_epoch(self, stage: str) -> None:
        """Forget everything logged so far and start collecting for `stage`."""
        self.stage = stage
        self.suffix = ""
        self.step_values = {}
        self._entries = {}
        self._sized_batch = None

    def log(
        self,
        name: str,
        value: Any,
        prog_bar: bool,
        logger: bool | None,
        on_step: bool | None,
        on_epoch: bool | None,
        reduce_fx: str | Callable[..., Any],
        enable_graph: bool,
        sync_dist: bool,
        add_dataloader_idx: bool,
        batch_size: int | None,
    ) -> None:
        """Record `value` under `name`: the arguments of `TrainingModule.log`, in its order, all given (its
        defaults are the only ones, so the two cannot drift apart)."""
        if on_step is None:
            on_step = self.stage == "train"
        if on_epoch is None:
            on_epoch = self.stage != "train"
        suffix = self.suffix if add_dataloader_idx else ""
        key = name + suffix
        entry = self._entries.get(key)
        if entry is None:
            entry = self._new_entry(name, key, suffix, on_step, on_epoch, prog_bar, logger, reduce_fx, sync_dist)
        if type(value) is Tensor and value.ndim == 0:  # the common case: a scalar tensor, nothing to check
            tensor = value
        elif not isinstance(value, Tensor) and _is_metric(value):
            entry.metric = value
            step_value = value._forward_cache if on_step else None
            if isinstance(step_value, Tensor) and step_value.ndim == 0:
                self._set_step(key, suffix, step_value, on_epoch)
            return
        else:
            tensor = _as_scalar_tensor(name, value)
        if on_step:
            self._set_step(key, suffix, tensor if enable_graph else tensor.detach(), on_epoch)
        if on_epoch:
            if batch_size is None:
                batch_size = self._current_batch_size()
            entry.accumulate(tensor, batch_size)

    def _new_entry(
        self,
        name: str,
        key: str,
        suffix: str,
        on_step: bool,
        on_epoch: bool,
        prog_bar: bool,
        logger: bool | None,
        reduce_fx: str | Callable[..., Any],
        sync_dist: bool,
    ) -> _Entry:
        if not on_step and not on_epoch:
            raise ValueError(f"self.log({name!r}, on_step=False, on_epoch=False) records nothing; set one of them")
        fx = _reduce_name(name, reduce_fx)
        entry = self._entries[key] = _Entry(on_step, on_epoch, prog_bar, fx, sync_dist, logger is not False)
        names = (
            [_insert_before_suffix(key, tag, suffix) for tag in ("_step", "_epoch")] if on_step and on_epoch else [key]
        )
        if on_step and on_epoch:
            self.forked[key] = (names[0], names[1])
        if prog_bar:
            self.prog_bar_names.update(names)
        if logger is False:
            self.not_for_loggers.update(names)
        return entry

    def _set_step(self, key: str, suffix: str, value: Tensor, also_epoch: bool) -> None:
        self.step_values[_insert_before_suffix(key, "_step", suffix) if also_epoch else key] = value

    def _current_batch_size(self) -> int:
        batch = self.current_batch
        if self._sized_batch is not batch:  # inferred once per batch
            self._batch_size, self._sized_batch = infer_batch_size(batch), batch
        return self._batch_size

    def state_dict(self) -> dict[str, Any]:
        """Epoch aggregates so far (for a resume inside an epoch); torchmetrics objects are not included."""
        entries = {}
        for key, e in self._entries.items():
            if e.metric is None:
                entries[key] = {
                    "on_step": e.on_step,
                    "on_epoch": e.on_epoch,
                    "prog_bar": e.prog_bar,
                    "reduce_fx": e.reduce_fx,
                    "sync_dist": e.sync_dist,
                    "logger": e.logger,
                    "total": e.total,
                    "weight": e.weight,
                }
        return {"stage": self.stage, "entries": entries, "step_values": dict(self.step_values)}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.stage = state["stage"]
        self._entries = {key: _Entry(**fields) for key, fields in state["entries"].items()}
        device = self.device()
        for entry in self._entries.values():
            if entry.total is None:
                continue
            # Back on the module's device: a synced epoch value all-reduces the totals (NCCL takes device tensors
            # only), and a step's value adds into them without a copy to the host.
            dtype = torch.float64 if entry.reduce_fx in ("mean", "sum") else entry.total.dtype  # older: float32
            entry.total = entry.total.to(device=device, dtype=dtype)
            if entry.reduce_fx in ("mean", "sum") and device.type == "cpu":
                entry.scratch = torch.empty((), dtype=torch.float64)
        self.step_values = dict(state["step_values"])
        for k, e in self._entries.items():
            tags = ("_step", "_epoch") if e.on_step and e.on_epoch else ("",)
            names = {_insert_before_suffix(k, tag, _suffix_of(k)) for tag in tags}
            if e.on_step and e.on_epoch:
                step_name, epoch_name = (_insert_before_suffix(k, tag, _suffix_of(k)) for tag in tags)
                self.forked[k] = (step_name, epoch_name)
            if e.prog_bar:
                self.prog_bar_names.update(names)
            if not e.logger:
                self.not_for_loggers.update(names)

    def epoch_values(self) -> dict[str, Tensor]:
        """Aggregate every on_epoch entry; metrics are computed and reset."""
        out: dict[str, Tensor] = {}
        for key, entry in self._entries.items():
            if not entry.on_epoch:
                continue
            value = entry.compute(self.reduce)
            if value is not None:
                name = key
                if entry.on_step:  # both: the step value is `name_step`, the epoch value `name_epoch`
                    name = _insert_before_suffix(key, "_epoch", _suffix_of(key))
                out[name] = value
        # Computed entries are done: a later call (or a later log of the name) starts afresh.
        self._entries = {k: e for k, e in self._entries.items() if not e.on_epoch}
        return out


def _reduce_name(name: str, reduce_fx: Any) -> str:
    """``reduce_fx`` as one of `REDUCE_FX`: a name (``"avg"`` is ``"mean"``) or ``torch.mean``, ``torch.sum``, ..."""
    fx = reduce_fx.lower() if isinstance(reduce_fx, str) else _REDUCE_CALLABLES.get(reduce_fx, reduce_fx)
    fx = "mean" if fx == "avg" else fx
    if fx not in REDUCE_FX:
        raise ValueError(
            f"self.log({name!r}): reduce_fx={reduce_fx!r} is not supported; use one of {REDUCE_FX} (or torch.mean, "
            "torch.sum, torch.max, torch.min). For another reduction, log a torchmetrics.Metric that computes it."
        )
    return str(fx)


def _suffix_of(key: str) -> str:
    i = key.rfind(DATALOADER_SUFFIX)
    return key[i:] if i >= 0 else ""


def _insert_before_suffix(key: str, tag: str, suffix: str) -> str:
    if suffix:
        return key[: -len(suffix)] + tag + suffix
    return key + tag


def _is_metric(value: Any) -> bool:
    # torchmetrics is a hard dependency, but importing it costs ~0.3 s; check by duck type.
    return hasattr(value, "compute") and hasattr(value, "reset") and hasattr(value, "_forward_cache")


def _as_scalar_tensor(name: str, value: Any) -> Tensor:
    if isinstance(value, Tensor):
        if callable(getattr(value, "full_tensor", None)):  # a DTensor (a loss-parallel loss): its whole value
            value = value.full_tensor()  # type: ignore[attr-defined]
        if value.numel() != 1:
            raise ValueError(
                f"self.log({name!r}) needs a scalar; got a tensor of shape {tuple(value.shape)}. "
                "Reduce it first (e.g. .mean())."
            )
        return value.reshape(()) if value.ndim else value
    if isinstance(value, (int, float, bool)):
        return torch.tensor(float(value))
    raise TypeError(
        f"self.log({name!r}) accepts numbers, scalar tensors or torchmetrics Metrics; got {type(value).__qualname__}"
    )
