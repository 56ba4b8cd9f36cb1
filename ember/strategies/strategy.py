"""`Strategy`: everything that differs between one device, DDP and FSDP.

The loops call these methods and never ask which strategy runs. Only the
single-device strategy exists so far.
"""

from __future__ import annotations

import contextlib
import functools
import inspect
import sys
import weakref
from typing import Any

import torch
from torch import Tensor, nn
from torch.optim import Optimizer

from ember.strategies.precision import Precision, map_tensors

_NULL_CONTEXT = contextlib.nullcontext()  # stateless and reusable

#: What a training step goes through, in `Strategy` and in `Precision` (see `Strategy.runs_plain_steps`).
_STEP_METHODS = ("training_step", "no_sync", "forward_context", "backward", "optimizer_step", "preemption_requested")
_PRECISION_STEP_METHODS = ("forward_context", "scale_loss", "unscale_gradients", "optimizer_step")


def move_to_device(batch: Any, device: torch.device) -> Any:
    """Move every tensor in a (nested) batch to `device`; other values pass through.

    Every container `map_tensors` knows keeps its type: dicts, any other mapping (a Hugging Face
    ``BatchEncoding`` stays one), lists, tuples, namedtuples, dataclasses. Any other object with a ``.to``
    method (a ``PackedSequence``, a graph batch) moves itself with ``obj.to(device)``. The batch given is
    never changed.
    """
    if isinstance(batch, Tensor):
        return batch.to(device, non_blocking=True)
    return map_tensors(batch, lambda tensor: tensor.to(device, non_blocking=True), lambda obj: obj.to(device))


def hook_takes_mesh(module: nn.Module) -> bool | None:
    """Whether ``module.configure_model`` takes a device mesh (True), takes nothing (False), or is absent (None)."""
    hook = getattr(module, "configure_model", None)
    if not callable(hook):
        return None
    try:
        parameters = inspect.signature(hook).parameters.values()
    except (TypeError, ValueError):
        return True
    positional = (inspect.Parameter.POSITIONAL_ONLY, inspect.Parameter.POSITIONAL_OR_KEYWORD)
    return any(p.kind in positional or p.kind is inspect.Parameter.VAR_POSITIONAL for p in parameters)


def configure_model_once(module: nn.Module) -> None:
    """Call ``module.configure_model()`` (the form without a device mesh) the first time the module is set up."""
    if hook_takes_mesh(module) is False and module not in _CONFIGURED:
        module.configure_model()  # type: ignore[operator]
        _CONFIGURED.add(module)


def _call_module(module: nn.Module, *args: Any, **kwargs: Any) -> Any:
    return module._call_impl(*args, **kwargs)


#: Modules whose ``configure_model()`` ran, and modules compiled in place: each happens once per module, so a
#: second run with the same module keeps its layers and its compiled code.
_CONFIGURED: weakref.WeakSet[nn.Module] = weakref.WeakSet()
_COMPILED: weakref.WeakSet[nn.Module] = weakref.WeakSet()


def compile_in_place(module: nn.Module, options: dict[str, Any]) -> None:
    """What `nn.Module.compile` does: calls of `module` run compiled, its ``state_dict`` keys do not change.
    Once per module: a module compiled already keeps its compiled code.

    The compiled function's first frame is in this file. `nn.Module.compile` compiles
    ``module._call_impl`` itself, a frame inside torch.nn, and torch 2.13 skips those:
    ``nn.Sequential(...).compile()`` compiles nothing. So this fills the slot `nn.Module.compile` fills,
    ``_compiled_call_impl``, with a compiled function whose first frame is ember's.
    """
    if module in _COMPILED:
        return
    module._compiled_call_impl = torch.compile(functools.partial(_call_module, module), **options)
    _COMPILED.add(module)


def training_module_class() -> type[nn.Module] | None:
    """`TrainingModule`, or None while ``ember.modules.module`` has not been imported (then no instance exists).

    Looked up in ``sys.modules`` rather than imported: strategies sit below modules, and export is imported
    by `TrainingModule`'s own export methods (docs/architecture.md, "Who imports whom").
    """
    return getattr(sys.modules.get("ember.modules.module"), "TrainingModule", None)


def keeps_default_forward(module: nn.Module) -> bool:
    """Whether `module` is a `TrainingModule` that keeps the default ``forward``, which only calls ``self.model``."""
    base = training_module_class()
    return base is not None and isinstance(module, base) and type(module).forward is base.forward


def compile_target(module: nn.Module) -> nn.Module:
    """``module.model`` when `module` keeps `TrainingModule`'s default ``forward`` (which only calls it), else `module`.

    Compiling the model rather than the module makes steps that call ``self.model(x)`` run compiled too.
    """
    model = module._modules.get("model")
    if keeps_default_forward(module) and model is not None:
        return model
    return module


#: Parameter-name parts that wrappers insert; ``get_optimizer_state_dict`` knows how to strip them.
_WRAPPER_NAME_PARTS = ("_orig_mod", "_checkpoint_wrapped_module", "_fsdp_wrapped_module", "_flat_param")


def holds_dtensors(state: Any) -> bool:
    """Whether `state` (a tensor, or dicts and lists of them) holds a DTensor: a shard of a larger tensor."""
    if "torch.distributed.tensor" not in sys.modules:  # nothing can be a DTensor yet: no import needed
        return False
    from torch.distributed.tensor import DTensor

    if isinstance(state, dict):
        return any(holds_dtensors(v) for v in state.values())
    if isinstance(state, (list, tuple)):
        return any(holds_dtensors(v) for v in state)
    return isinstance(state, DTensor)


def optimizer_state_by_name(module: nn.Module, optimizer: Optimizer) -> dict[str, Any] | None:
    """``optimizer.state_dict()`` with parameter names in place of indices, or None when that needs DCP.

    The layout is ``get_optimizer_state_dict``'s (``{"state": {name: ...}, "param_groups": [{..., "params":
    [name, ...]}]}``; tests/unit/strategies/test_optimizer_state.py compares them), at a fraction of its cost,
    and without its warm-up: DCP fills an empty optimizer state by stepping the live optimizer once with zero
    gradients and a zero learning rate. Here an optimizer that holds no state yet is saved as such. None
    (use DCP) when a parameter is not a plain tensor, a name holds a wrapper's prefix, or the optimizer
    holds a parameter the module does not.
    """
    names = parameter_names(module)
    return None if names is None else optimizer_state_named(optimizer, names)


def parameter_names(module: nn.Module) -> dict[Tensor, str] | None:
    """Each parameter of `module` and its name, as `optimizer_state_by_name` names them; None when a parameter is
    not a plain tensor or a name holds a wrapper's prefix (DCP names those)."""
    names: dict[Tensor, str] = {}
    for name, param in module.named_parameters():
        if type(param) not in (nn.Parameter, Tensor) or any(part in name for part in _WRAPPER_NAME_PARTS):
            return None
        names[param] = name
    return names


def optimizer_state_named(optimizer: Optimizer, names: dict[Tensor, str]) -> dict[str, Any] | None:
    """`optimizer_state_by_name` with the parameters' `names` (`parameter_names`) given: None when the optimizer
    holds a parameter `names` lacks."""
    index_name = optimizer_index_names(optimizer, names)
    return None if index_name is None else optimizer_state_indexed(optimizer, index_name)


def optimizer_index_names(optimizer: Optimizer, names: dict[Tensor, str]) -> dict[int, str] | None:
    """Each of the optimizer's parameter indices (as ``optimizer.state_dict()`` numbers them) and its name in
    `names`; None when a parameter has none."""
    params = [param for group in optimizer.param_groups for param in group["params"]]
    if any(param not in names for param in params):
        return None
    return {index: names[param] for index, param in enumerate(params)}


def optimizer_state_indexed(optimizer: Optimizer, index_name: dict[int, str]) -> dict[str, Any]:
    """`optimizer_state_by_name` with the parameters' names by index (`optimizer_index_names`) given."""
    saved = optimizer.state_dict()
    return {
        "state": {index_name[index]: value for index, value in saved["state"].items()},
        "param_groups": [
            {**group, "params": [index_name[index] for index in group["params"]]} for group in saved["param_groups"]
        ],
    }


class Strategy:
    """One process, one device. The base for every other strategy."""

    def __init__(self, device: torch.device | str | None = None, precision: Precision | None = None) -> None:
        """`device`: where the module and batches go. None (the default) takes the Trainer's ``accelerator``
        (``cuda:0``, or the CPU); a device given here must agree with ``accelerator`` (see `configure`)."""
        self.root_device = torch.device("cpu" if device is None else device)
        #: Who chose ``root_device``: "given" (the constructor), "accelerator" (`configure`) or None (nobody yet).
        self.device_chosen_by: str | None = None if device is None else "given"
        self.precision = precision or Precision()
        #: DataLoaders yield CPU tensors already: on the CPU in fp32 a batch needs no walk at all.
        self.batches_stay_put = self.root_device.type == "cpu" and self.precision.cast_dtype is None

    def configure(self, precision: Precision, *, accelerator: str = "auto", **topology: Any) -> None:
        """Take the Trainer's precision plugin and accelerator (``Trainer(precision=..., accelerator=...)``; a
        `Strategy` instance passed to the Trainer gets them here). One process has no other topology to take;
        `ParallelStrategy` takes ``devices``, ``num_nodes``, ``accelerator`` and ``use_distributed_sampler``.

        ``accelerator`` is "cpu", "cuda" or "auto". An instance built without a device goes where it says
        ("auto": CUDA when available, unless an earlier `configure` chose already); one built with a device
        keeps it, and raises when ``accelerator`` names another kind of device.
        """
        if topology:
            raise TypeError(f"{type(self).__name__} runs one process; it takes no {', '.join(sorted(topology))}")
        self.root_device = self._device_for(accelerator)
        self.precision = precision
        self.batches_stay_put = self.root_device.type == "cpu" and precision.cast_dtype is None

    def _device_for(self, accelerator: str) -> torch.device:
        """The device `configure` settles on for `accelerator` (see there)."""
        name = type(self).__name__
        if self.device_chosen_by == "given":
            if accelerator in ("cpu", "cuda") and self.root_device.type != accelerator:
                raise ValueError(
                    f"strategy={name}(device='{self.root_device}') conflicts with accelerator={accelerator!r}; "
                    f"build the strategy without a device (it then follows accelerator) or make them agree"
                )
            if self.root_device.type == "cuda" and not torch.cuda.is_available():
                raise RuntimeError(
                    f"strategy={name}(device='{self.root_device}') but CUDA is not available here; "
                    "build the strategy with device='cpu' or without a device"
                )
            return self.root_device
        if accelerator == "auto":
            if self.device_chosen_by == "accelerator":
                return self.root_device
            accelerator = "cuda" if torch.cuda.is_available() else "cpu"
        self.device_chosen_by = "accelerator"
        return torch.device("cuda", 0) if accelerator == "cuda" else torch.device("cpu")

    def release_model(self) -> None:
        """Drop the wrapper `setup_module` made, if any (`Trainer.release_run`); one process wraps nothing."""

    # --- topology -----------------------------------------------------------
    @property
    def world_size(self) -> int:
        return 1

    @property
    def global_rank(self) -> int:
        return 0

    @property
    def is_global_zero(self) -> bool:
        return self.global_rank == 0

    # --- setup --------------------------------------------------------------
    def setup_module(self, module: nn.Module) -> nn.Module:
        """Move, cast (true precisions) and, in subclasses, wrap the module; returns what the loops call.

        A module's ``configure_model()`` (Lightning's hook to build layers late) runs first, once per module.
        """
        configure_model_once(module)
        self.precision.setup(self.root_device)
        self.batches_stay_put = self.root_device.type == "cpu" and self.precision.cast_dtype is None
        return self.precision.convert_module(module.to(self.root_device))

    def compile_module(self, module: nn.Module, options: dict[str, Any]) -> None:
        """``Trainer(compile=...)``: compile `compile_target(module)` in place (FSDP compiles per block)."""
        compile_in_place(compile_target(module), options)

    def batch_to_device(self, batch: Any) -> Any:
        if self.batches_stay_put:
            return batch
        return self.precision.convert_batch(move_to_device(batch, self.root_device))

    # --- training -----------------------------------------------------------
    def training_step(self, module: nn.Module, batch: Any, batch_idx: int) -> Any:
        """Run the module's ``training_step`` (DDP runs it inside its forward)."""
        return module.training_step(batch, batch_idx)  # type: ignore[operator]

    def runs_plain_steps(self) -> bool:
        """Whether a training step here is only ``training_step``, ``backward()`` and ``optimizer.step()``.

        True when neither this strategy nor its precision plugin changes any of
        the step methods: one process, no wrapper, gradient sync, autocast or
        loss scaling. The training loop may then take its plain path.
        """
        strategy_same = all(getattr(type(self), name) is getattr(Strategy, name) for name in _STEP_METHODS)
        precision = type(self.precision)
        return strategy_same and all(getattr(precision, n) is getattr(Precision, n) for n in _PRECISION_STEP_METHODS)

    def distribute_loader(self, loader: Any, training: bool) -> Any:
        """The DataLoader this process iterates (multi-process strategies shard it)."""
        return loader

    def setup_environment(self) -> None:
        """Join the process group and pick the device (nothing to do for one process)."""

    @property
    def world_size_requested(self) -> int:
        return 1

    def preemption_requested(self, local: bool) -> bool:
        """Whether to stop for a preemption signal now (shared across processes by parallel strategies)."""
        return local

    def needs_launch(self) -> bool:
        """Whether the processes must be started first (``devices > 1`` without a launcher)."""
        return False

    def eval_context(self) -> contextlib.AbstractContextManager[None]:
        """Context an evaluation runs in (FSDP gathers the parameters once, so ranks may run unequal batches)."""
        return _NULL_CONTEXT

    def forward_context(self) -> contextlib.AbstractContextManager[None]:
        return self.precision.forward_context()

    def backward(self, loss: Tensor) -> None:
        self.precision.scale_loss(loss).backward()

    def no_sync(self, module: nn.Module, enabled: bool) -> contextlib.AbstractContextManager[None]:
        """Skip gradient synchronisation while accumulating (nothing to skip on one device)."""
        return _NULL_CONTEXT

    def clip_gradients(self, module: nn.Module, optimizer: Optimizer, value: float, algorithm: str) -> None:
        params = [p for group in optimizer.param_groups for p in group["params"] if p.grad is not None]
        if algorithm == "norm":
            torch.nn.utils.clip_grad_norm_(params, value)
        else:
            torch.nn.utils.clip_grad_value_(params, value)

    def optimizer_step(self, optimizer: Optimizer, closure: Any = None) -> Any:
        return self.precision.optimizer_step(optimizer, closure)

    # --- checkpoint state -----------------------------------------------------
    def optimizer_state(self, module: nn.Module, optimizer: Optimizer) -> dict[str, Any]:
        """The optimizer's state keyed by parameter name (independent of sharding and world size).

        Plain parameters are named directly (`optimizer_state_by_name`); anything else (sharded DTensors,
        wrapped modules) goes through torch.distributed.checkpoint's ``get_optimizer_state_dict``, which
        produces the same layout.
        """
        named = optimizer_state_by_name(module, optimizer)
        if named is not None:
            return named
        from torch.distributed.checkpoint.state_dict import get_optimizer_state_dict

        return get_optimizer_state_dict(module, optimizer)

    def sharded_state(self, module: nn.Module, optimizers: list[Optimizer]) -> dict[str, Any] | None:
        """``{"module": ..., "optimizers": [...]}`` as this process holds them, when it holds a shard of each
        parameter (DTensors: FSDP, tensor parallel); None when its parameters are whole tensors.

        A resume reads a checkpoint into tensors laid out like these, so each process reads and allocates
        only the chunks its shards cover (about 1/world of the state), not every tensor whole. The layout is
        the one a save writes (``module.state_dict()``, `optimizer_state`).
        """
        if not holds_dtensors(list(module.parameters())):
            return None
        return {"module": module.state_dict(), "optimizers": [self.optimizer_state(module, o) for o in optimizers]}

    def load_module_state(self, module: nn.Module, state: dict[str, Any]) -> None:
        """Load full (unsharded) weights; sharding strategies distribute them."""
        module.load_state_dict(state)

    def load_optimizer_state(self, module: nn.Module, optimizer: Optimizer, state: dict[str, Any]) -> None:
        from torch.distributed.checkpoint.state_dict import set_optimizer_state_dict

        set_optimizer_state_dict(module, optimizer, state)

    # --- collectives (identity on one process) ------------------------------
    def reduce(self, tensor: Tensor, reduce_fx: str = "mean") -> Tensor:
        return tensor

    def barrier(self) -> None:
        """Wait until every process of the job gets here; one process has none to wait for."""

    def broadcast(self, obj: Any, src: int = 0) -> Any:
        return obj

    def all_gather_object(self, obj: Any) -> list[Any]:
        """Every process's `obj` (picklable), in rank order; one process: ``[obj]``."""
        return [obj]

    @property
    def distributed_sampler_kwargs(self) -> dict[str, int]:
        """``num_replicas`` and ``rank`` of this process's data shard (one process: the whole data)."""
        return {"num_replicas": 1, "rank": 0}

    def check_same_batch_count(self, count: float) -> None:
        """Several processes must train on the same number of batches per epoch; one process always does."""

    def settle(self) -> None:
        """Finish the collectives still in flight at the end of the training epochs (before ``on_train_end``)."""

    def teardown(self) -> None:
        pass
