"""The exactness suite's world: generated configurations, their data pipelines, the module, the raw-loop oracle.

A `Config` is one point of the space users live in (data pipeline x training options). `raw_run` trains it
with a plain PyTorch loop written from the documented semantics (docs/trainer.md); `ember_run` trains it
with ``ember.Trainer.fit``. Both return a `Result` (per-batch losses, final parameters and learning rate,
optimizer steps, the global random streams afterwards) that the properties compare.

This module is also imported by the processes the suite starts (a resumed run in a new process, the ranks
of a DDP run), so it holds everything those need and nothing of pytest.
"""

from __future__ import annotations

import itertools
import math
import os
import random
from collections.abc import Iterator
from dataclasses import dataclass, field, fields
from pathlib import Path
from typing import Any

import torch
from torch import Tensor, nn
from torch.nn import functional as F
from torch.utils.data import (
    DataLoader,
    Dataset,
    IterableDataset,
    RandomSampler,
    Sampler,
    SubsetRandomSampler,
    WeightedRandomSampler,
    get_worker_info,
)

import ember
from ember.seed import sample_generator

SEED, DATA_SEED, LOADER_SEED, AUG_SEED = 1234, 99, 7, 5
IN_FEATURES, HIDDEN, OUT_FEATURES = 4, 8, 2
N_VAL, VAL_BATCH = 10, 4
RUN_NAME = "exact"

#: What the processes the suite starts import before they are forked (a fit would import them on first use).
PRELOAD = [
    "numpy",
    "sympy",
    "torch",
    "torch._dynamo",
    "torch.distributed.checkpoint",
    "ember",
    "ember.trainer.trainer",
    "ember.trainer.setup",
    "ember.callbacks.model_checkpoint",
    "ember.callbacks.rich_progress",
    "ember.strategies.ddp",
    "exact_workload",
]

SAMPLERS = ("sequential", "shuffle", "replacement", "weighted", "subset", "batch_sampler", "iterable")


@dataclass(frozen=True)
class Config:
    """One generated configuration. Its ``repr`` names only the fields that differ from the defaults,
    so the minimal failing example hypothesis prints reads as the few options that matter."""

    # data
    n: int = 16
    batch_size: int = 4
    drop_last: bool = False
    sampler: str = "shuffle"  # one of SAMPLERS
    generator: bool = True  # the sampler (and loader) draw from their own torch.Generator, not the global RNG
    num_samples: int | None = None  # RandomSampler(replacement=True) / WeightedRandomSampler draws
    num_workers: int = 0
    persistent_workers: bool = False
    augment: str = "none"  # "none" | "global": noise from the global RNG per item | "per_sample": sample_generator
    # training
    epochs: int = 2
    optimizer: str = "sgd"  # "sgd" (momentum, weight decay) | "adam"
    lr: float = 0.1
    accumulate: int = 1
    clip: tuple[str, float] | None = None  # ("norm" | "value", value)
    scheduler: str | None = None  # "step" | "epoch" | "plateau"
    dropout: float = 0.0
    limit_train_batches: int | float = 1.0
    val_check_interval: int | float | None = None  # None: no validation data
    check_val_every_n_epoch: int = 1
    num_sanity_val_steps: int = 0
    max_steps: int = -1
    manual: bool = False
    precision: str = "32-true"

    def __repr__(self) -> str:
        changed = [f"{f.name}={getattr(self, f.name)!r}" for f in fields(self) if not self._is_default(f.name)]
        return f"Config({', '.join(changed)})"

    def _is_default(self, name: str) -> bool:
        value, default = getattr(self, name), Config.__dataclass_fields__[name].default
        return bool(value == default and type(value) is type(default))  # a count of 1 is not the fraction 1.0

    def _repr_pretty_(self, printer: Any, cycle: bool) -> None:  # how hypothesis prints a falsifying example
        printer.text(repr(self))

    def as_dict(self) -> dict[str, Any]:
        return {f.name: getattr(self, f.name) for f in fields(self)}

    @property
    def has_length(self) -> bool:
        return self.sampler != "iterable"

    @property
    def monitor(self) -> str:
        """What a plateau scheduler watches: validation loss when every epoch validates, else the train loss."""
        validates_every_epoch = self.val_check_interval is not None and self.check_val_every_n_epoch == 1
        return "val/loss" if validates_every_epoch else "train/loss_epoch"


# --- data ------------------------------------------------------------------------------------------------


def _tensors(n: int, seed: int) -> tuple[Tensor, Tensor]:
    g = torch.Generator().manual_seed(seed)
    return torch.randn(n, IN_FEATURES, generator=g), torch.randn(n, OUT_FEATURES, generator=g)


def _augmented(x: Tensor, augment: str, index: int, epoch: int) -> Tensor:
    if augment == "global":
        return x + 0.1 * torch.randn(IN_FEATURES)
    if augment == "per_sample":
        return x + 0.1 * torch.randn(IN_FEATURES, generator=sample_generator(index, epoch, seed=AUG_SEED))
    return x


class Samples(Dataset[tuple[Tensor, Tensor]]):
    """Map-style regression samples; `augment` adds noise when an item is loaded."""

    def __init__(self, n: int, augment: str = "none", seed: int = DATA_SEED) -> None:
        self.x, self.y = _tensors(n, seed)
        self.augment, self.epoch = augment, 0

    def set_epoch(self, epoch: int) -> None:
        self.epoch = epoch

    def __len__(self) -> int:
        return len(self.x)

    def __getitem__(self, index: int) -> tuple[Tensor, Tensor]:
        return _augmented(self.x[index], self.augment, index, self.epoch), self.y[index]


class Stream(IterableDataset[tuple[Tensor, Tensor]]):
    """An iterable dataset (no length) that keeps its position, so a run over it resumes exactly.

    Worker w of W yields items w, w + W, ...; the position counts items this object has yielded. A stream
    that has ended starts over when the next epoch starts (`set_epoch`), not when it ends: its state then
    tells an ended stream from a fresh one (docs/trainer.md, "Data"). One cut short by
    ``limit_train_batches`` goes on where it was in the next epoch.
    """

    def __init__(self, n: int, augment: str = "none") -> None:
        self.x, self.y = _tensors(n, DATA_SEED)
        self.augment, self.epoch, self.position = augment, 0, 0

    def set_epoch(self, epoch: int) -> None:
        self.epoch = epoch
        if self.position >= len(self.x):
            self.position = 0

    def __iter__(self) -> Iterator[tuple[Tensor, Tensor]]:
        info = get_worker_info()
        worker, workers = (info.id, info.num_workers) if info is not None else (0, 1)
        indices = range(worker, len(self.x), workers)
        while self.position < len(indices):
            index = indices[self.position]
            self.position += 1
            yield _augmented(self.x[index], self.augment, index, self.epoch), self.y[index]

    def state_dict(self) -> dict[str, int]:
        return {"position": self.position}

    def load_state_dict(self, state: dict[str, int]) -> None:
        self.position = state["position"]


class ChunkedBatches(Sampler[list[int]]):
    """A custom batch sampler: a fresh permutation per epoch, cut into batches of size `batch_size` and
    `batch_size - 1` in turn (so batch sizes vary)."""

    def __init__(self, n: int, batch_size: int, generator: torch.Generator | None) -> None:
        self.n, self.batch_size, self.generator = n, batch_size, generator
        sizes, left = [], n
        for size in itertools.cycle((batch_size, max(batch_size - 1, 1))):
            if left <= 0:
                break
            sizes.append(min(size, left))
            left -= size
        self.sizes = sizes

    def __len__(self) -> int:
        return len(self.sizes)

    def __iter__(self) -> Iterator[list[int]]:
        order = torch.randperm(self.n, generator=self.generator).tolist()
        start = 0
        for size in self.sizes:
            yield order[start : start + size]
            start += size


def train_loader(cfg: Config, batch_size: int | None = None) -> DataLoader:
    """The training DataLoader of `cfg` (built the same way for the oracle and for ember)."""
    batch_size = batch_size or cfg.batch_size
    g = torch.Generator().manual_seed(LOADER_SEED) if cfg.generator else None
    workers: dict[str, Any] = {"num_workers": cfg.num_workers, "persistent_workers": cfg.persistent_workers}
    if cfg.sampler == "iterable":
        return DataLoader(Stream(cfg.n, cfg.augment), batch_size=batch_size, drop_last=cfg.drop_last, **workers)
    data = Samples(cfg.n, cfg.augment)
    batched: dict[str, Any] = {"batch_size": batch_size, "drop_last": cfg.drop_last, **workers}
    if cfg.sampler == "sequential":
        return DataLoader(data, shuffle=False, **batched)
    if cfg.sampler == "shuffle":
        return DataLoader(data, shuffle=True, generator=g, **batched)
    draws = cfg.num_samples or cfg.n
    if cfg.sampler == "replacement":
        sampler = RandomSampler(data, replacement=True, num_samples=draws, generator=g)
        return DataLoader(data, sampler=sampler, **batched)
    if cfg.sampler == "weighted":
        weights = torch.arange(1, cfg.n + 1, dtype=torch.double)
        return DataLoader(data, sampler=WeightedRandomSampler(weights, draws, replacement=True, generator=g), **batched)
    if cfg.sampler == "subset":
        return DataLoader(data, sampler=SubsetRandomSampler(list(range(0, cfg.n, 2)), generator=g), **batched)
    assert cfg.sampler == "batch_sampler", cfg.sampler
    return DataLoader(data, batch_sampler=ChunkedBatches(cfg.n, batch_size, g), **workers)


def val_loader(cfg: Config) -> DataLoader | None:
    if cfg.val_check_interval is None:
        return None
    return DataLoader(Samples(N_VAL, seed=DATA_SEED + 1), batch_size=VAL_BATCH)


def set_epoch(loader: DataLoader, epoch: int) -> None:
    """What ember documents it does before every training epoch: ``set_epoch`` on the dataset and samplers."""
    for owner in (loader.dataset, loader.sampler, loader.batch_sampler):
        if callable(getattr(owner, "set_epoch", None)):
            owner.set_epoch(epoch)


# --- model, optimizer, scheduler ---------------------------------------------------------------------------


def make_model(cfg: Config) -> nn.Module:
    return nn.Sequential(
        nn.Linear(IN_FEATURES, HIDDEN), nn.Tanh(), nn.Dropout(cfg.dropout), nn.Linear(HIDDEN, OUT_FEATURES)
    )


def make_optimizer(cfg: Config, params: Any) -> torch.optim.Optimizer:
    if cfg.optimizer == "adam":
        return torch.optim.Adam(params, lr=cfg.lr / 10)
    return torch.optim.SGD(params, lr=cfg.lr, momentum=0.9, weight_decay=1e-4)


def make_scheduler(cfg: Config, optimizer: torch.optim.Optimizer) -> Any:
    if cfg.scheduler in ("step", "epoch"):
        return torch.optim.lr_scheduler.StepLR(optimizer, step_size=2, gamma=0.5)
    if cfg.scheduler == "plateau":
        return torch.optim.lr_scheduler.ReduceLROnPlateau(optimizer, factor=0.5, patience=0, threshold=0.5)
    return None


def autocast(cfg: Config) -> Any:
    if cfg.precision == "bf16-mixed":
        return torch.autocast("cpu", dtype=torch.bfloat16)
    assert cfg.precision == "32-true", cfg.precision
    return torch.autocast("cpu", enabled=False)


def training_loss(model: nn.Module, batch: Any) -> Tensor:
    x, y = batch
    return F.mse_loss(model(x), y)


def validation_loss(model: nn.Module, batch: Any) -> Tensor:
    """A validation step that draws from the global RNG (ember must not let that shift training)."""
    x, y = batch
    out = model(x)
    return F.mse_loss(out + 0.01 * torch.randn_like(out), y)


# --- results ---------------------------------------------------------------------------------------------


@dataclass
class Result:
    losses: list[Tensor] = field(default_factory=list)
    params: dict[str, Tensor] = field(default_factory=dict)
    lr: float = 0.0
    steps: int = 0
    torch_rng: Tensor | None = None
    python_rng: Any = None
    validations: list[float] = field(default_factory=list)
    world_size: int = 1

    def to_dict(self) -> dict[str, Any]:
        python = list(self.python_rng[1]) if self.python_rng is not None else None
        return {
            "losses": [t.clone() for t in self.losses],
            "params": self.params,
            "lr": self.lr,
            "steps": self.steps,
            "torch_rng": self.torch_rng,
            "python_rng": python,
            "validations": list(self.validations),
            "world_size": self.world_size,
        }


def release_workers(*loaders: DataLoader | None) -> None:
    """Stop a loader's persistent workers now (they would live until the loader is garbage collected)."""
    for loader in loaders:
        iterator = getattr(loader, "_iterator", None)
        if iterator is not None and hasattr(iterator, "_shutdown_workers"):
            iterator._shutdown_workers()
            loader._iterator = None  # type: ignore[union-attr]


def finish(result: Result, model: nn.Module, optimizer: torch.optim.Optimizer, steps: int) -> Result:
    result.params = {k: v.detach().clone() for k, v in model.state_dict().items()}
    result.lr = float(optimizer.param_groups[0]["lr"])
    result.steps = steps
    result.torch_rng = torch.get_rng_state()
    result.python_rng = random.getstate()
    return result


def differences(got: dict[str, Any], want: dict[str, Any], *, exact: bool = True, tol: float = 0.0) -> list[str]:
    """What differs between two `Result.to_dict()`s (empty: equal). `tol`: 0 for bitwise, else the tolerance of
    `_same`. `exact`: also the random streams and the validation losses."""
    problems: list[str] = []
    if got["steps"] != want["steps"]:
        problems.append(f"optimizer steps {got['steps']} != {want['steps']}")
    if len(got["losses"]) != len(want["losses"]):
        problems.append(f"{len(got['losses'])} batches != {len(want['losses'])}")
    for i, (a, b) in enumerate(zip(got["losses"], want["losses"], strict=False)):
        if not _same(a, b, tol):
            problems.append(f"loss of batch {i}: {a.item()!r} != {b.item()!r}")
            break
    for name, value in want["params"].items():
        if not _same(got["params"][name], value, tol):
            diff = float((got["params"][name].double() - value.double()).abs().max())
            problems.append(f"parameter {name} differs (max abs {diff:.3g})")
    if got["lr"] != want["lr"]:
        problems.append(f"final learning rate {got['lr']!r} != {want['lr']!r}")
    if exact:
        if not torch.equal(got["torch_rng"], want["torch_rng"]):
            problems.append("the global torch RNG state afterwards differs")
        if got["python_rng"] != want["python_rng"]:
            problems.append("Python's random state afterwards differs")
        if got["validations"] != want["validations"]:
            problems.append(f"validation losses {got['validations']} != {want['validations']}")
    return problems


def _same(a: Tensor, b: Tensor, tol: float) -> bool:
    """Bitwise for `tol` 0; else within `tol`, relative to the value where it is above 1."""
    if tol == 0.0:
        return torch.equal(a, b)
    bound = tol * torch.clamp(b.double().abs(), min=1.0)
    return a.shape == b.shape and bool(((a.double() - b.double()).abs() <= bound).all())


# --- the oracle: a raw loop written from docs/trainer.md ---------------------------------------------------


def planned_batches(cfg: Config, loader: DataLoader) -> float:
    """Batches per epoch: ``limit_train_batches`` as a count or a fraction of ``len(loader)`` (inf: no length)."""
    length = len(loader) if cfg.has_length else math.inf
    limit = cfg.limit_train_batches
    if isinstance(limit, int):
        return min(length, limit)
    return length if limit == 1.0 else int(length * limit)


def validation_every(cfg: Config, batches: float) -> float:
    """``val_check_interval``: an int counts batches; a float is a fraction of the epoch (inf: no length)."""
    interval = cfg.val_check_interval
    if isinstance(interval, int):
        return interval
    if math.isinf(batches) or interval is None:
        return math.inf
    return max(1, int(batches * interval))


def raw_run(cfg: Config) -> Result:
    """Train `cfg` with a plain loop; every rule below is a sentence of docs/trainer.md."""
    torch.manual_seed(SEED)
    random.seed(SEED)
    model = make_model(cfg)
    optimizer = make_optimizer(cfg, model.parameters())
    scheduler = make_scheduler(cfg, optimizer)
    loader, val = train_loader(cfg), val_loader(cfg)
    result = Result()
    batches = planned_batches(cfg, loader)
    every = validation_every(cfg, batches)
    full_windows_end = math.inf if math.isinf(batches) else int(batches) // cfg.accumulate * cfg.accumulate
    steps = 0
    metrics: dict[str, float] = {}

    def validate() -> None:
        # Validation leaves every random stream as it found it, in eval mode under no_grad.
        model.eval()
        mean = WeightedMean()
        with torch.random.fork_rng(devices=[]), torch.no_grad():
            for batch in val:  # type: ignore[union-attr]
                with autocast(cfg):
                    mean.add(validation_loss(model, batch), len(batch[0]))
        model.train()
        metrics["val/loss"] = mean.value()
        result.validations.append(metrics["val/loss"])

    def step_scheduler() -> None:
        if scheduler is None:
            return
        if cfg.scheduler == "plateau":
            scheduler.step(metrics[cfg.monitor])
        else:
            scheduler.step()

    model.train()
    optimizer.zero_grad(set_to_none=True)
    for epoch in range(cfg.epochs):
        set_epoch(loader, epoch)
        validates = val is not None and (epoch + 1) % cfg.check_val_every_n_epoch == 0
        # A whole epoch is a `for` loop over the loader; a limit takes exactly that many batches.
        whole = batches == (len(loader) if cfg.has_length else math.inf)
        epoch_batches = loader if whole else itertools.islice(loader, int(batches))
        epoch_mean, last, validated_after, stop, has_grads = WeightedMean(), -1, -1, False, False
        for i, batch in enumerate(epoch_batches):
            with autocast(cfg):
                loss = training_loss(model, batch)
            result.losses.append(loss.detach())
            epoch_mean.add(loss, len(batch[0]))
            is_last = i + 1 == batches
            if cfg.manual:  # the module's own step: zero_grad, backward, step, its step scheduler
                optimizer.zero_grad()
                loss.backward()
                optimizer.step()
                steps += 1
                if cfg.scheduler == "step":
                    scheduler.step()
            else:
                window = cfg.accumulate if i < full_windows_end else int(batches - full_windows_end)
                (loss / window if window > 1 else loss).backward()
                has_grads = True
            ends_window = (i + 1) % cfg.accumulate == 0 or is_last
            if not cfg.manual and ends_window:
                steps = _step(cfg, model, optimizer, scheduler, steps)
                has_grads = False
            last = i
            if validates and (is_last or (i + 1) % every == 0):
                validate()
                validated_after = i
            if ends_window and 0 <= cfg.max_steps <= steps:
                stop = True
                break
        if has_grads:  # a loader without a length ended inside an accumulation window
            steps = _step(cfg, model, optimizer, scheduler, steps)
        if validates and last >= 0 and validated_after != last:  # stopped early: validate the final weights
            validate()
        if epoch_mean.total is not None:  # an epoch without batches logs nothing
            metrics["train/loss_epoch"] = epoch_mean.value()
        if cfg.scheduler in ("epoch", "plateau"):  # after every epoch (the module's hook, manually)
            step_scheduler()
        if stop or 0 <= cfg.max_steps <= steps:
            break
    release_workers(loader)
    return finish(result, model, optimizer, steps)


class WeightedMean:
    """An epoch value of ``self.log``: the batch-size weighted mean, summed in float64 (docs/trainer.md)."""

    def __init__(self) -> None:
        self.total: Tensor | None = None
        self.weight = 0

    def add(self, value: Tensor, batch_size: int) -> None:
        value = value.detach().to(torch.float64)
        if self.total is None:
            self.total = torch.zeros((), dtype=torch.float64)
        self.total.add_(value, alpha=batch_size)
        self.weight += batch_size

    def value(self) -> float:
        assert self.total is not None
        return float(self.total / max(self.weight, 1))


def _step(cfg: Config, model: nn.Module, optimizer: torch.optim.Optimizer, scheduler: Any, steps: int) -> int:
    if cfg.clip is not None:
        algorithm, value = cfg.clip
        if algorithm == "norm":
            torch.nn.utils.clip_grad_norm_(model.parameters(), value)
        else:
            torch.nn.utils.clip_grad_value_(model.parameters(), value)
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    if cfg.scheduler == "step":
        scheduler.step()
    return steps + 1


# --- ember ---------------------------------------------------------------------------------------------------


class Net(ember.TrainingModule):
    """The oracle's model, loss and optimizer behind ember's API; records every batch's loss."""

    def __init__(self, cfg: Config) -> None:
        super().__init__()
        self.cfg = cfg
        self.model = make_model(cfg)
        self.automatic_optimization = not cfg.manual
        self.losses: list[Tensor] = []

    def forward(self, x: Tensor) -> Tensor:
        return self.model(x)

    def training_step(self, batch: Any, batch_idx: int) -> Any:
        loss = training_loss(self.model, batch)
        self.losses.append(loss.detach())
        self.log("train/loss", loss, on_step=True, on_epoch=True)
        if self.automatic_optimization:
            return loss
        optimizer = self.optimizers()
        optimizer.zero_grad()  # type: ignore[union-attr]
        self.manual_backward(loss)
        optimizer.step()  # type: ignore[union-attr]
        if self.cfg.scheduler == "step":
            self.lr_schedulers().step()  # type: ignore[union-attr]
        return None

    def on_train_epoch_end(self) -> None:
        if not self.automatic_optimization and self.cfg.scheduler == "epoch":
            self.lr_schedulers().step()  # type: ignore[union-attr]

    def validation_step(self, batch: Any, batch_idx: int) -> None:
        self.log("val/loss", validation_loss(self.model, batch))

    def configure_optimizers(self) -> Any:
        optimizer = make_optimizer(self.cfg, self.model.parameters())
        scheduler = make_scheduler(self.cfg, optimizer)
        if scheduler is None:
            return optimizer
        interval = "step" if self.cfg.scheduler == "step" else "epoch"
        config: dict[str, Any] = {"scheduler": scheduler, "interval": interval}
        if self.cfg.scheduler == "plateau":
            config["monitor"] = self.cfg.monitor
        return {"optimizer": optimizer, "lr_scheduler": config}


class Validations(ember.Callback):
    """Records every validation's ``val/loss`` inside fit (not the sanity check's)."""

    def __init__(self) -> None:
        self.values: list[float] = []

    def on_validation_end(self, trainer: Any, module: Any) -> None:
        if not trainer.sanity_checking:
            self.values.append(trainer.last_eval_metrics["val/loss"])

    def state_dict(self) -> dict[str, Any]:
        return {"values": list(self.values)}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.values = list(state["values"])


class StopAt(ember.Callback):
    """Asks the run to stop once `step` optimizer steps are done (it stops at that step boundary).

    Checked after every batch and at every epoch end: a loader without a length takes the step of its last,
    partial accumulation window after its last batch.
    """

    def __init__(self, step: int) -> None:
        self.step = step

    def on_train_batch_end(self, trainer: Any, module: Any, outputs: Any, batch: Any, batch_idx: int) -> None:
        if trainer.global_step >= self.step:
            trainer.should_stop = True

    def on_train_epoch_end(self, trainer: Any, module: Any) -> None:
        if trainer.global_step >= self.step:
            trainer.should_stop = True


def trainer_options(cfg: Config) -> dict[str, Any]:
    clip_algorithm, clip_val = cfg.clip if cfg.clip is not None else ("norm", None)
    return {
        "max_epochs": cfg.epochs,
        "max_steps": cfg.max_steps,
        "accumulate_grad_batches": cfg.accumulate,
        "gradient_clip_val": clip_val,
        "gradient_clip_algorithm": clip_algorithm,
        "limit_train_batches": cfg.limit_train_batches,
        "val_check_interval": cfg.val_check_interval if cfg.val_check_interval is not None else 1.0,
        "check_val_every_n_epoch": cfg.check_val_every_n_epoch,
        "num_sanity_val_steps": cfg.num_sanity_val_steps,
        "precision": cfg.precision,
        "logger": False,
        "enable_progress_bar": False,
        "enable_model_summary": False,
        "accelerator": "cpu",
    }


def ember_run(
    cfg: Config,
    root: Path,
    *,
    stop_at: int | None = None,
    resume: bool = False,
    strategy: Any = "auto",
    batch_size: int | None = None,
) -> Result:
    """Train `cfg` through ``ember.Trainer.fit``.

    `stop_at`: stop after that many optimizer steps, with a checkpoint at that step boundary (``last``).
    `resume`: continue from ``last`` under `root`, starting from scrambled random streams.
    """
    torch.manual_seed(SEED)
    random.seed(SEED)
    module = Net(cfg)
    if resume:  # nothing of this process's streams may matter: the checkpoint's are put back
        torch.manual_seed(987654)
        random.seed(987654)
    validations = Validations()
    callbacks: list[ember.Callback] = [validations]
    checkpointing = stop_at is not None or resume
    if stop_at is not None:
        callbacks.append(StopAt(stop_at))
    trainer = ember.Trainer(
        **trainer_options(cfg),
        strategy=strategy,
        callbacks=callbacks,
        enable_checkpointing=checkpointing,
        default_root_dir=root,
        run_name=RUN_NAME,
    )
    loader = train_loader(cfg, batch_size)
    trainer.fit(module, loader, val_loader(cfg), ckpt_path="last" if resume else None)
    release_workers(loader, trainer.train_dataloader)
    result = Result(losses=module.losses, validations=validations.values, world_size=trainer.world_size)
    return finish(result, module.model, trainer.optimizers[0], trainer.global_step)


# --- entry points of the processes the suite starts -----------------------------------------------------------


def _as_a_plain_process() -> None:
    """One thread, and DataLoader workers forked as in the pytest process (a forkserver's children would
    otherwise start their workers through a forkserver of their own, which costs seconds per epoch)."""
    import multiprocessing

    torch.set_num_threads(1)
    multiprocessing.set_start_method("fork", force=True)


def resume_in_child(cfg_fields: dict[str, Any], root: str, out: str) -> None:
    """In a new process: resume `cfg`'s run from ``last`` under `root`; save its `Result` to `out`."""
    _as_a_plain_process()
    result = ember_run(Config(**cfg_fields), Path(root), resume=True)
    torch.save(result.to_dict(), out)


def ddp_rank(cfg_fields: dict[str, Any], root: str, out: str, rank: int, port: int) -> None:
    """Rank `rank` of a 2-process gloo job: `cfg` with DDP, batch ``cfg.batch_size`` per process."""
    import torch.distributed as dist

    from ember.strategies import DDPStrategy

    _as_a_plain_process()
    for name in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT"):
        os.environ.pop(name, None)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2)
    try:
        result = ember_run(Config(**cfg_fields), Path(root), strategy=DDPStrategy(timeout_s=60))
        torch.save(result.to_dict(), out)
    finally:
        dist.destroy_process_group()
