"""What a checkpoint holds: a named registry of `Stateful` objects, gathered and restored.

Every entry has ``state_dict()`` / ``load_state_dict()``. The "module" and
"optimizers" entries are tensor-heavy and go through
torch.distributed.checkpoint; everything else is small and goes into
``ember.pt``. Per-process state (random streams, data position) goes into
``rank-N.pt``.
"""

from __future__ import annotations

import copy as copy_module
import warnings
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, Protocol

import torch
from torch import Tensor, nn
from torch.utils.data import IterableDataset

from ember import checkpoint as ckpt
from ember.checkpoint import data_position, writing
from ember.checkpoint.hparams import for_checkpoint
from ember.checkpoint.resume import capture_loader_generators, capture_rng
from ember.checkpoint.staging import HostShard, copy_into
from ember.version import __version__

if TYPE_CHECKING:
    from ember.checkpoint.snapshot_plan import SnapshotPlan
    from ember.modules.module import TrainingModule
    from ember.trainer.trainer import Trainer

_TENSOR_ENTRIES = ("module", "optimizers")


class Stateful(Protocol):
    def state_dict(self) -> Any: ...

    def load_state_dict(self, state: Any) -> Any: ...


class _ListState:
    """Several statefuls saved as one list (optimizers, schedulers, loggers)."""

    def __init__(self, name: str, items: list[Any]) -> None:
        self.name, self.items = name, items

    def state_dict(self) -> list[Any]:
        return [item.state_dict() for item in self.items]

    def load_state_dict(self, state: list[Any]) -> None:
        if len(state) != len(self.items):
            raise ckpt.CheckpointError(
                f"the checkpoint has {len(state)} {self.name}, this run has {len(self.items)}; "
                "configure the same ones to resume"
            )
        for item, item_state in zip(self.items, state, strict=True):
            item.load_state_dict(item_state)


class _OptimizerStates:
    """Optimizer state keyed by parameter name (not position), through the strategy.

    Names make the state independent of how parameters are sharded or
    grouped, so a checkpoint from one strategy or world size loads into another.
    """

    def __init__(self, trainer: Trainer, module: TrainingModule) -> None:
        self.trainer, self.module = trainer, module

    def state_dict(self) -> list[Any]:
        strategy = self.trainer.strategy
        return [strategy.optimizer_state(self.module, opt) for opt in self.trainer.optimizers]

    def load_state_dict(self, state: list[Any]) -> None:
        if not isinstance(state, list) or len(state) != len(self.trainer.optimizers):
            count = len(state) if isinstance(state, list) else "no list of"
            raise ckpt.CheckpointError(
                f"the checkpoint has {count} optimizers, this run has {len(self.trainer.optimizers)}; "
                "configure the same ones to resume"
            )
        for opt, opt_state in zip(self.trainer.optimizers, state, strict=True):
            self.trainer.strategy.load_optimizer_state(self.module, opt, opt_state)


def optimizer_class(optimizer: Any) -> str:
    return f"{type(optimizer).__module__}.{type(optimizer).__qualname__}"


def _group_names(module: nn.Module, optimizer: Any) -> list[list[str]]:
    """Each param group's parameter names (DCP's names: no wrapper prefixes)."""
    from ember.strategies.strategy import optimizer_state_by_name

    named = optimizer_state_by_name(module, optimizer)
    if named is None:
        return []  # sharded or wrapped: DCP checks the layout when it loads
    return [list(group["params"]) for group in named["param_groups"]]


def check_optimizers(path: Path, meta: dict[str, Any], saved: Any, trainer: Trainer, module: nn.Module) -> list[str]:
    """Refuse a resume into other optimizers; return the hyperparameter differences (for a warning).

    A different optimizer class or param-group layout (groups and the parameters in each) is a
    `CheckpointError` naming both: loading one optimizer's state into another would silently keep the
    checkpoint's param groups. Hyperparameters that differ (``lr``, ``weight_decay``, ...) are returned:
    resuming keeps the checkpoint's values, which is what an uninterrupted run would have.
    """
    classes = meta.get("optimizer_classes")
    differences: list[str] = []
    if not isinstance(saved, list):
        return differences
    for i, (optimizer, state) in enumerate(zip(trainer.optimizers, saved, strict=False)):
        now = optimizer_class(optimizer)
        was = classes[i] if isinstance(classes, list) and i < len(classes) and isinstance(classes[i], str) else None
        if was is not None and was != now:
            raise ckpt.CheckpointError(
                f"checkpoint {path} was trained with {was} (optimizer {i}), this run builds {now}; resume with "
                "the same optimizer, or start a new run from its weights (TrainingModule.load_from_checkpoint)"
            )
        groups = state.get("param_groups") if isinstance(state, dict) else None
        if not isinstance(groups, list):
            continue
        saved_names = [list(g.get("params", [])) if isinstance(g, dict) else [] for g in groups]
        current = _group_names(module, optimizer)
        if current and current != saved_names:
            raise ckpt.CheckpointError(
                f"checkpoint {path}: optimizer {i} ({now}) has {_describe_groups(current)} now, the checkpoint "
                f"{_describe_groups(saved_names)}; resume with the same parameter groups, or start a new run "
                "from its weights (TrainingModule.load_from_checkpoint)"
            )
        for j, (old, new) in enumerate(zip(groups, optimizer.param_groups, strict=False)):
            differences += _group_differences(f"optimizer {i} group {j}", old, new)
    return differences


def _describe_groups(groups: list[list[str]]) -> str:
    sizes = ", ".join(f"{len(g)} ({', '.join(g[:2])}{', ...' if len(g) > 2 else ''})" for g in groups)
    return f"{len(groups)} param group(s) of {sizes} parameters"


def _group_differences(where: str, old: Any, new: dict[str, Any]) -> list[str]:
    if not isinstance(old, dict):
        return []
    scheduled = "initial_lr" in old and "initial_lr" in new  # a scheduler moves lr; compare its start value
    found = []
    for key in sorted(set(old) & set(new), key=str):
        if key == "params" or (key == "lr" and scheduled):
            continue
        if isinstance(old[key], (int, float, bool, str, tuple, list, type(None))) and old[key] != new[key]:
            found.append(f"{where} {key}: {old[key]!r} in the checkpoint, {new[key]!r} now")
    return found


class _CallbackStates:
    """Callbacks keyed by `state_key`; a callback missing from the checkpoint keeps its fresh state."""

    def __init__(self, trainer: Trainer) -> None:
        self.trainer = trainer

    def state_dict(self) -> dict[str, Any]:
        return {cb.state_key: cb.state_dict() for cb in self.trainer.callbacks}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        for cb in self.trainer.callbacks:
            if cb.state_key in state:
                cb.load_state_dict(state[cb.state_key])


class _LoggerStates:
    def __init__(self, trainer: Trainer) -> None:
        self.trainer = trainer

    def state_dict(self) -> list[Any]:
        return [logger.state_dict() for logger in self.trainer.loggers]

    def load_state_dict(self, state: list[Any]) -> None:
        step = self.trainer.global_step
        for logger, logger_state in zip(self.trainer.loggers, state, strict=False):
            logger.load_state_dict({**logger_state, "step": step})


def registry(trainer: Trainer, module: TrainingModule) -> dict[str, Stateful]:
    """Everything an exact resume restores, by name."""
    entries: dict[str, Stateful] = {
        "module": module,
        "optimizers": _OptimizerStates(trainer, module),
        "lr_schedulers": _ListState("lr schedulers", [c.scheduler for c in trainer.lr_scheduler_configs]),
        "precision": trainer.strategy.precision,
        "progress": trainer.progress,
        "metrics": trainer.reporter.train_collector,
        "callbacks": _CallbackStates(trainer),
        "loggers": _LoggerStates(trainer),
    }
    if trainer.datamodule is not None:
        entries["datamodule"] = trainer.datamodule
    return entries


def data_state(trainer: Trainer) -> dict[str, Any]:
    """Position of an iterable dataset, kept by the loader (StatefulDataLoader) or by the dataset itself.

    Map-style data needs none: its position is re-derived from the sampler (see `resume`).
    """
    loader = trainer.train_dataloader
    if loader is None:
        return {}
    # The position in samples consumed by all processes, for a resume on another number of processes.
    position = {"position": data_position.record(trainer)}
    dataset = getattr(loader, "dataset", None)
    if not isinstance(dataset, IterableDataset):
        # The loader's own generators as they are now: the next epoch's permutation is drawn from them.
        return {"loader_generators": capture_loader_generators(loader), **position}
    if callable(getattr(loader, "state_dict", None)):
        return {"loader": loader.state_dict(), **position}
    dataset_state = getattr(dataset, "state_dict", None)
    if isinstance(dataset, IterableDataset) and callable(dataset_state):
        return {"dataset": dataset_state(), **position}
    return position


@dataclass
class Loaded:
    """A checkpoint read from disk: its ``ember.pt`` content, its tensors and this rank's state."""

    path: Path
    meta: dict[str, Any]
    tensor_state: dict[str, Any]
    rank_state: dict[str, Any]


@dataclass
class Snapshot:
    """Everything a checkpoint write needs, detached from the live objects (safe to write in the background)."""

    meta: dict[str, Any]
    tensors: dict[str, Tensor]
    rank_state: dict[str, Any]
    rank: int = 0
    world_size: int = 1
    group: Any = None


#: Rank-state entries a snapshot may share with the live run instead of copying: the random streams, the loader's
#: generator states and the data position are captured afresh for each snapshot, and an epoch's start state is
#: captured once and replaced, never changed.
_NEVER_MUTATED = frozenset({"rng", "epoch_start", "loader_generators", "position"})

#: Values a copy of state may share with the original: they cannot be changed in place.
_IMMUTABLE = (int, float, bool, str, bytes, complex, type(None))


def copy_state(value: Any) -> Any:
    """A copy of a state dict that the live objects' later changes cannot reach: its dicts, lists and tuples
    rebuilt, its plain tensors cloned, immutable values shared, anything else deep-copied. What
    ``copy.deepcopy`` gives for state (which holds no object twice), at a fraction of its cost: a snapshot
    taken every few steps copies it each time."""
    kind = type(value)
    if kind in _IMMUTABLE:
        return value
    if kind is dict:
        return {key: copy_state(item) for key, item in value.items()}
    if kind is list:
        return [copy_state(item) for item in value]
    if kind is tuple:
        return tuple(copy_state(item) for item in value)
    if kind is Tensor and not value.requires_grad:
        return value.clone()
    return copy_module.deepcopy(value)


def gather(
    trainer: Trainer,
    module: TrainingModule,
    weights_only: bool,
    copy: bool,
    staging: dict[str, Tensor] | None = None,
    on_cpu: bool = False,
    only: tuple[str, ...] | None = None,
    plan: SnapshotPlan | None = None,
) -> Snapshot:
    """Collect the registry; with `copy`, tensors are copied so training may go on while it is written.

    The copies go into `staging`: host (CPU) buffers of an earlier snapshot whose write has finished, reused
    when key, shape and dtype match, else allocated and kept there (`ember.checkpoint.staging`). A periodic
    async save then costs the loop one copy, not an allocation that touches fresh pages, and a GPU run keeps
    no second copy of its weights and optimizer state in device memory between saves. Sharded state (FSDP2,
    tensor parallel) is staged shard by shard: each DTensor's local shard in a host buffer (a `HostShard`).
    With `on_cpu` and no `staging`, the copies are made in host memory too (a rewind's snapshot: device
    memory stays the model's). With `only`, just those entries are gathered, without the hyperparameters
    and config (a rewind's snapshot: what `restore_snapshot` puts back). With a `plan` (and `copy`), the model's
    and optimizers' state is gathered and copied by it, into its buffers (`ember.checkpoint.snapshot_plan`).
    """
    entries = registry(trainer, module)
    names = ("module",) if weights_only else tuple(entries) if only is None else tuple(n for n in only if n in entries)
    planned = None
    if plan is not None and copy and not weights_only and all(name in names for name in _TENSOR_ENTRIES):
        planned = plan.tensor_state(trainer, module)  # tensors already copied; None: the general way
    states = {name: entries[name].state_dict() for name in names if planned is None or name not in _TENSOR_ENTRIES}
    if planned is None:
        skeleton, tensors = ckpt.split_tensors({k: states.pop(k) for k in _TENSOR_ENTRIES if k in states})
    else:
        skeleton, tensors = planned
    meta: dict[str, Any] = {
        "ember_version": __version__,
        "weights_only": weights_only,
        "module_class": f"{type(module).__module__}.{type(module).__qualname__}",
        "optimizer_classes": [optimizer_class(opt) for opt in trainer.optimizers],
        "hparams": for_checkpoint(module.hparams) if only is None else None,
        "config": trainer.run_config if only is None else None,
        "tensor_skeleton": skeleton,
        "state": states,
    }
    trainer.hooks.on_save_checkpoint(meta)
    epoch_start = trainer.fit_loop.epoch_start_state if trainer.fit_loop is not None else None
    rank_state = {"rng": capture_rng(), "epoch_start": epoch_start, **data_state(trainer)}
    if copy:
        if planned is None:
            tensors = {k: copy_into(staging, k, v.detach(), on_cpu) for k, v in tensors.items()}
        if staging is not None and torch.cuda.is_initialized() and torch.cuda.is_available():
            torch.cuda.synchronize()  # the copies into pinned memory ran asynchronously; the writer reads them
        # a planned skeleton is a copy already (`snapshot_plan._split_copy`)
        meta = {k: v if planned is not None and k == "tensor_skeleton" else copy_state(v) for k, v in meta.items()}
        rank_state = {k: v if k in _NEVER_MUTATED else copy_state(v) for k, v in rank_state.items()}
    strategy = trainer.strategy
    group = getattr(strategy, "checkpoint_group", None)
    return Snapshot(meta, tensors, rank_state, strategy.global_rank, strategy.world_size, group)


def stage(path: Path, snapshot: Snapshot, set_last: bool = False) -> ckpt.StagedCheckpoint:
    """One process: write the snapshot's files now; the result's ``finish()`` makes them the checkpoint."""
    return writing.stage_checkpoint(path, snapshot.meta, snapshot.tensors, snapshot.rank_state, set_last)


def write(path: Path, snapshot: Snapshot, set_last: bool = False) -> Path:
    return writing.write_checkpoint(
        path,
        snapshot.meta,
        snapshot.tensors,
        snapshot.rank_state,
        snapshot.rank,
        snapshot.world_size,
        snapshot.group,
        set_last,
    )


def load(path: Path, rank: int = 0, world_size: int = 1, sharded: Any = None, group: Any = None) -> Loaded:
    """Read checkpoint `path` for process `rank` of `world_size`. With `sharded` (the strategy's
    `sharded_state`: module and optimizer state as this process holds it), the tensors it names are read
    shard by shard (a collective over `group`), the rest whole."""
    meta = ckpt.read_meta(path)
    shards: dict[str, Tensor] = {}
    if sharded is not None:
        shards = ckpt.read_shards(path, ckpt.split_tensors(sharded)[1], group)
    tensors = {**ckpt.read_tensors(path, keys=lambda key: key not in shards), **shards}
    tensor_state = ckpt.join_checked(path, meta["tensor_skeleton"], tensors)
    return Loaded(path, meta, tensor_state, _rank_state(path, meta, rank, world_size))


def _rank_state(path: Path, meta: dict[str, Any], rank: int, world_size: int) -> dict[str, Any]:
    """This process's part of the checkpoint. On another number of processes, process r reads the state of
    process min(r, saved - 1): its random streams are a starting point, and its ``position`` (the same on
    every process) tells the loop where the interrupted epoch stands globally (`data_position`)."""
    saved_world = int(meta.get("world_size", 1))
    if saved_world != world_size:
        if rank == 0:
            warnings.warn(
                f"checkpoint {path} was written by {saved_world} process(es) and resumes on {world_size}: weights, "
                "optimizer and progress carry over, and the rest of an interrupted epoch is split across the new "
                "processes (no sample skipped or seen twice), but the random streams were per process, so the "
                "continuation is not bitwise that of an uninterrupted run",
                RuntimeWarning,
                stacklevel=3,
            )
        rank = min(rank, saved_world - 1)
    return {**ckpt.read_rank_meta(path, rank), "saved_world_size": saved_world}


def load_module_weights(module: nn.Module, loaded: Loaded, load: Any = None, hint: str = "") -> None:
    """Load the module's weights, with an error listing the first mismatched keys (then `hint`)."""
    weights = loaded.tensor_state["module"]
    ckpt.load_weights_into(module, weights, loaded.path, loaded.meta.get("module_class"), load, hint)


def restore(trainer: Trainer, module: TrainingModule, loaded: Loaded) -> None:
    """Restore every registry entry for resuming training.

    State that does not fit this run (a damaged or foreign file) is a `CheckpointError` naming the entry;
    a different optimizer is refused (`check_optimizers`); changed hyperparameters and config values are
    one warning listing each difference.
    """
    if loaded.meta.get("weights_only"):
        raise ckpt.CheckpointError(
            f"checkpoint {loaded.path} holds weights only (saved with weights_only=True / save_weights_only); "
            "it cannot resume training. Load it with TrainingModule.load_from_checkpoint, or resume from a "
            "full checkpoint"
        )
    trainer.hooks.on_load_checkpoint(loaded.meta)  # may reshape the optimizers (e.g. BackboneFinetuning)
    hint = ckpt.mismatch_hint(loaded.meta, trainer.run_config, for_checkpoint(module.hparams))
    load_module_weights(module, loaded, trainer.strategy.load_module_state, hint)
    saved_optimizers = loaded.tensor_state.get("optimizers")
    differences = check_optimizers(loaded.path, loaded.meta, saved_optimizers, trainer, module)
    differences += _config_differences(loaded.meta, trainer, module)
    entries = registry(trainer, module)
    _load_entry(loaded.path, "optimizers", entries["optimizers"], saved_optimizers)
    for name, state in loaded.meta["state"].items():
        if name in entries:
            _load_entry(loaded.path, name, entries[name], state)
        else:
            warnings.warn(
                f"checkpoint {loaded.path}: ignoring state {name!r} that this run has no use for", stacklevel=2
            )
    if differences and trainer.is_global_zero:
        listed = "; ".join(differences[:12]) + (f"; and {len(differences) - 12} more" if len(differences) > 12 else "")
        warnings.warn(
            f"resuming from {loaded.path} with changed settings: {listed}. Optimizer and scheduler state continue "
            "from the checkpoint; the other values apply from here on",
            RuntimeWarning,
            stacklevel=3,
        )


def _load_entry(path: Path, name: str, entry: Stateful, state: Any) -> None:
    try:
        entry.load_state_dict(state)
    except ckpt.CheckpointError:
        raise
    except (TypeError, KeyError, ValueError, AttributeError, IndexError, RuntimeError) as exc:
        raise ckpt.CheckpointError(
            f"checkpoint {path}: its {name!r} state does not fit this run ({type(exc).__name__}: {exc})"
        ) from exc


def _config_differences(meta: dict[str, Any], trainer: Trainer, module: TrainingModule) -> list[str]:
    """What differs between the run that wrote the checkpoint and this one: the resolved YAML config when
    both have one, else the module's hyperparameters."""
    saved, now = meta.get("config"), trainer.run_config
    prefix = ""
    if not (isinstance(saved, dict) and now is not None):
        saved, now, prefix = meta.get("hparams"), for_checkpoint(module.hparams), "hparams"
        if not isinstance(saved, dict):
            return []
    return [f"{key}: {old!r} in the checkpoint, {new!r} now" for key, old, new in ckpt.differences(saved, now, prefix)]


def _restored(value: Tensor) -> Tensor:
    """A copy of a snapshot's tensor to load: a sharded (DTensor) entry's host copy of this process's shard made a
    DTensor again, sharded as it was (on its mesh's device); any other tensor cloned."""
    if isinstance(value, HostShard) and value.sharding:
        from torch.distributed.tensor import DTensor

        shape, stride, mesh, placements = value.sharding
        local = value.buffer.clone()
        return DTensor.from_local(local, mesh, placements, run_check=False, shape=shape, stride=stride)
    return value.clone()


#: The entries a rewind puts back: the training state. Callbacks and loggers keep theirs (they saw what happened).
TRAINING_ENTRIES = ("module", "optimizers", "lr_schedulers", "precision", "progress", "metrics", "datamodule")


def restore_snapshot(trainer: Trainer, module: TrainingModule, snapshot: Snapshot) -> None:
    """Put back the `TRAINING_ENTRIES` of an in-memory `gather(..., copy=True)` snapshot (a rewind).

    The snapshot's tensors are copied first: the optimizers take the tensors they load as their own state and
    update them in place, and the snapshot must stay as it was for a later rewind to the same point.
    """
    where = Path("<in-memory snapshot>")
    tensors = {key: _restored(value) for key, value in snapshot.tensors.items()}
    tensor_state = ckpt.join_checked(where, snapshot.meta["tensor_skeleton"], tensors)
    loaded = Loaded(where, snapshot.meta, tensor_state, snapshot.rank_state)
    load_module_weights(module, loaded, trainer.strategy.load_module_state)
    entries = registry(trainer, module)
    _load_entry(where, "optimizers", entries["optimizers"], tensor_state["optimizers"])
    for name, state in snapshot.meta["state"].items():
        if name in TRAINING_ENTRIES and name in entries:
            _load_entry(where, name, entries[name], copy_module.deepcopy(state))
