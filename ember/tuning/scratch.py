"""Short runs on a user's module that leave no trace: the machinery both finders use.

`scratch_trainer` builds a `Trainer` for a few steps with the options of the
user's trainer that shape a step (strategy, precision, accumulation, clipping)
and none of its callbacks, checkpoints or validation. `Snapshot` records what
such a run changes (module parameters and buffers, train/eval modes, the
module's attachment to a trainer, the global random streams, the generators of
the loaders, the datamodule's state) and puts it back bitwise. The user's
trainer itself is never run, so its counters, optimizers, schedulers and
callbacks are untouched.
"""

from __future__ import annotations

import copy
import gc
import random
import sys
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import torch
from torch import Tensor

from ember.callbacks.callback import Callback

if TYPE_CHECKING:
    from ember.loggers.logger import Logger
    from ember.modules.datamodule import DataModule
    from ember.modules.module import TrainingModule
    from ember.trainer.trainer import Trainer


def check_supported(trainer: Trainer, what: str) -> None:
    """Raise for strategies a scratch run cannot undo (FSDP shards the module in place)."""
    from ember.strategies.fsdp import FSDPStrategy

    if isinstance(trainer.strategy, FSDPStrategy):
        raise ValueError(
            f"{what} does not run under FSDP: sharding changes the module in place. Run it with one "
            "process or DDP (same per-process batch), then train with FSDP"
        )


def scratch_trainer(
    trainer: Trainer,
    *,
    max_steps: int,
    callbacks: list[Callback],
    logger: bool | Logger | list[Logger] | None = False,
    enable_progress_bar: bool | None = None,
) -> Trainer:
    """A trainer that runs `max_steps` optimizer steps like `trainer` would, with only `callbacks`.

    The strategy is a shallow copy of `trainer`'s (same processes and process
    group) with a copy of its precision plugin, so setting up the scratch run
    changes neither. No sanity check, validation, checkpoints or model summary;
    the progress bar follows `trainer` unless `enable_progress_bar` says otherwise.
    """
    from ember.strategies.parallel import ParallelStrategy
    from ember.trainer.trainer import Trainer

    strategy = copy.copy(trainer.strategy)
    topology: dict[str, Any] = {}
    if isinstance(strategy, ParallelStrategy):  # resolve_strategy sets these again from the keywords
        topology = {
            "accelerator": strategy.accelerator,
            "devices": strategy.devices,
            "num_nodes": strategy.num_nodes,
            "use_distributed_sampler": strategy.use_distributed_sampler,
        }
    scratch = Trainer(
        max_steps=max_steps,
        max_epochs=None,
        strategy=strategy,
        **topology,
        accumulate_grad_batches=trainer.accumulate_grad_batches,
        gradient_clip_val=trainer.gradient_clip_val,
        gradient_clip_algorithm=trainer.gradient_clip_algorithm,
        limit_train_batches=trainer.limit_train_batches,
        limit_val_batches=0,
        num_sanity_val_steps=0,
        log_every_n_steps=trainer.log_every_n_steps,
        callbacks=callbacks,
        logger=logger,
        enable_progress_bar=trainer.enable_progress_bar if enable_progress_bar is None else enable_progress_bar,
        enable_model_summary=False,
        enable_checkpointing=False,
        default_root_dir=trainer.default_root_dir,
        run_name=trainer.run_name,
        requeue_signal=None,
        deterministic=trainer.deterministic,
    )
    scratch.strategy.configure(copy.copy(trainer.strategy.precision), **topology)  # resolve_strategy set 32-true
    return scratch


def release(scratch: Trainer) -> None:
    """Drop what a finished scratch run holds on to.

    A DDP wrapper registers gradient hooks on the module's parameters; it must be
    gone before the next fit wraps the module again, or two reducers would fire.
    """
    scratch.release_run()
    gc.collect()


def _loader_generators(loaders: Iterable[Any]) -> list[torch.Generator]:
    """The generators a DataLoader draws from: its own, its sampler's, its batch sampler's (and that one's sampler)."""
    found: list[torch.Generator] = []
    for loader in loaders:
        batch_sampler = getattr(loader, "batch_sampler", None)
        owners = (loader, getattr(loader, "sampler", None), batch_sampler, getattr(batch_sampler, "sampler", None))
        for owner in owners:
            gen = getattr(owner, "generator", None)
            if isinstance(gen, torch.Generator) and all(gen is not g for g in found):
                found.append(gen)
    return found


def _as_list(loaders: Any) -> list[Any]:
    if loaders is None:
        return []
    return list(loaders) if isinstance(loaders, (list, tuple)) else [loaders]


@dataclass
class Snapshot:
    """Everything a scratch run may change, copied; `restore` writes it back.

    `take` clones every parameter and buffer; restoring copies them into the
    same tensors (``copy_``), so optimizers and references held elsewhere keep
    pointing at the module's own parameters. Lazy ones (``nn.LazyLinear`` before
    its first forward) have no values yet: the run initialises them in its first
    forward, as a fit's first step would, and `capture_initialised` records them
    before the first optimizer step changes them (`CaptureInitialised` calls it),
    so the module comes back initialised, with those initial values.
    """

    module: TrainingModule
    tensors: dict[str, Tensor]
    modes: list[tuple[torch.nn.Module, bool]]
    #: The trainer the module was attached to before the scratch run (put back after it).
    trainer: Trainer | None
    grads: dict[str, Tensor | None]
    python_rng: Any
    torch_rng: Tensor
    numpy_rng: Any = None
    cuda_rng: list[Tensor] | None = None
    generators: list[tuple[torch.Generator, Tensor]] = field(default_factory=list)
    datamodule: DataModule | None = None
    datamodule_state: Any = None
    #: Names of the parameters and buffers that were lazy (uninitialised) and whose initial values are not recorded yet.
    lazy: set[str] = field(default_factory=set)

    @classmethod
    def take(cls, module: TrainingModule, datamodule: DataModule | None = None, loaders: Any = None) -> Snapshot:
        named = _named_tensors(module)
        tensors = {name: t.detach().clone() for name, t in named if not is_lazy(t)}
        np = sys.modules.get("numpy")
        cuda = torch.cuda.get_rng_state_all() if torch.cuda.is_available() and torch.cuda.is_initialized() else None
        return cls(
            module=module,
            tensors=tensors,
            modes=[(m, m.training) for m in module.modules()],
            trainer=module.trainer if module.has_trainer else None,
            grads={name: _clone(p.grad) for name, p in module.named_parameters(remove_duplicate=False)},
            python_rng=random.getstate(),
            torch_rng=torch.get_rng_state(),
            numpy_rng=np.random.get_state() if np is not None else None,
            cuda_rng=cuda,
            generators=[(g, g.get_state()) for g in _loader_generators(_as_list(loaders))],
            datamodule=datamodule,
            datamodule_state=copy.deepcopy(datamodule.state_dict()) if datamodule is not None else None,
            lazy={name for name, t in named if is_lazy(t)},
        )

    def capture_initialised(self) -> None:
        """Record the values of the lazy tensors the run has initialised since (call it before an optimizer step)."""
        for name, tensor in _named_tensors(self.module):
            if name in self.lazy and not is_lazy(tensor):
                self.tensors[name] = tensor.detach().clone()
                self.lazy.discard(name)

    def add_loader_generators(self, loaders: Any) -> None:
        """Also restore the generators of `loaders` (a loader built by a datamodule during the run)."""
        known = [g for g, _ in self.generators]
        for gen in _loader_generators(_as_list(loaders)):
            if all(gen is not g for g in known):
                self.generators.append((gen, gen.get_state()))

    def restore(self) -> None:
        self.capture_initialised()  # initialised after the last optimizer step: still its initial values
        current = dict(_named_tensors(self.module))
        if current.keys() != self.tensors.keys() | self.lazy:
            raise RuntimeError(
                "the module's parameters and buffers changed names during the run "
                f"({sorted(set(current) ^ (set(self.tensors) | self.lazy))[:5]}); cannot put them back"
            )
        with torch.no_grad():
            for name, saved in self.tensors.items():
                target = current[name]
                if target.shape != saved.shape or target.dtype != saved.dtype:
                    raise RuntimeError(f"{name} changed shape or dtype during the run; cannot put it back")
                target.copy_(saved)
        for submodule, training in self.modes:
            submodule.training = training
        self.module.trainer = self.trainer
        for name, param in self.module.named_parameters(remove_duplicate=False):
            param.grad = self.grads.get(name)
        random.setstate(self.python_rng)
        torch.set_rng_state(self.torch_rng)
        if self.numpy_rng is not None:
            sys.modules["numpy"].random.set_state(self.numpy_rng)
        if self.cuda_rng is not None:
            torch.cuda.set_rng_state_all(self.cuda_rng)
        for gen, state in self.generators:
            gen.set_state(state)
        if self.datamodule is not None:
            self.datamodule.load_state_dict(self.datamodule_state)


def _clone(tensor: Tensor | None) -> Tensor | None:
    return None if tensor is None else tensor.detach().clone()


def is_lazy(tensor: Tensor) -> bool:
    """Whether `tensor` is an uninitialised parameter or buffer of a lazy module."""
    return bool(torch.nn.parameter.is_lazy(tensor))


class CaptureInitialised(Callback):
    """Before each optimizer step, has `snapshot` record the lazy tensors the run initialised (see `Snapshot`)."""

    def __init__(self, snapshot: Snapshot) -> None:
        self.snapshot = snapshot

    def on_before_optimizer_step(self, trainer: Trainer, module: TrainingModule, optimizer: Any) -> None:
        if self.snapshot.lazy:
            self.snapshot.capture_initialised()


class KeepLoaderGenerators(Callback):
    """Adds the generators of the training loader a datamodule built for the run to `snapshot`, unread."""

    def __init__(self, snapshot: Snapshot) -> None:
        self.snapshot = snapshot

    def on_fit_start(self, trainer: Trainer, module: TrainingModule) -> None:
        self.snapshot.add_loader_generators(trainer.train_dataloader)


def _named_tensors(module: TrainingModule) -> list[tuple[str, Tensor]]:
    named: list[tuple[str, Tensor]] = list(module.named_parameters(remove_duplicate=False))
    named += [(name, b) for name, b in module.named_buffers(remove_duplicate=False) if b is not None]
    return named
