"""`FSDPStrategy`: parameters, gradients and optimizer state sharded with FSDP2 (``fully_shard``)."""

from __future__ import annotations

import contextlib
from collections import Counter
from collections.abc import Iterator, Sequence
from typing import Any

import torch
from torch import nn
from torch.optim import Optimizer

from ember.strategies.parallel import ParallelStrategy
from ember.strategies.precision import Precision
from ember.strategies.strategy import compile_in_place, holds_dtensors, hook_takes_mesh


def repeated_block_classes(module: nn.Module) -> tuple[type[nn.Module], ...]:
    """Classes of the blocks a model repeats (e.g. transformer layers): non-leaf submodules with
    parameters whose class occurs at least twice. Sharding each such block lets FSDP overlap the
    gathering of one block's parameters with the compute of another."""
    counts: Counter[type[nn.Module]] = Counter()
    for sub in module.modules():
        if sub is module or not any(True for _ in sub.children()):
            continue
        if any(True for _ in sub.parameters()) and not isinstance(sub, (nn.ModuleList, nn.ModuleDict, nn.Sequential)):
            counts[type(sub)] += 1
    return tuple(cls for cls, n in counts.items() if n >= 2)


def transformer_block_classes(module: nn.Module) -> tuple[type[nn.Module], ...]:
    """The transformer blocks of Hugging Face models in `module` (``GPT2Block``, ``BertLayer``, ...): classes
    named in a submodule's ``_no_split_modules`` (transformers' list of modules that must stay whole) that
    occur at least twice. Embeddings named there (``BertEmbeddings``) occur once and stay in the root."""
    names: set[str] = set()
    for sub in module.modules():
        declared = getattr(sub, "_no_split_modules", None)
        if isinstance(declared, (list, tuple, set, frozenset)):
            names.update(str(name) for name in declared)
    counts = Counter(type(sub) for sub in module.modules() if type(sub).__name__ in names)
    return tuple(cls for cls, n in counts.items() if n >= 2)


def outermost_blocks(module: nn.Module, classes: tuple[type[nn.Module], ...]) -> list[nn.Module]:
    """The submodules of `module` that are instances of `classes`, except those inside another such one.

    A transformer repeats its layers and, inside each, its attention: the layers are the shard units. (FSDP2
    would also take nested units, but only applied inner first; a unit inside a sharded one is an error.)
    """
    found: list[nn.Module] = []
    inside: list[str] = []
    for name, sub in module.named_modules():
        if sub is module or any(name.startswith(prefix) for prefix in inside) or not isinstance(sub, classes):
            continue
        found.append(sub)
        inside.append(f"{name}.")
    return found


class FSDPStrategy(ParallelStrategy):
    """Fully sharded data parallel (FSDP2) over torch.distributed.

    - ``shard_classes``: module classes that become their own shard unit
      (default: the transformer blocks of a Hugging Face model, see
      `transformer_block_classes`, else the repeated blocks, see
      `repeated_block_classes`); the root is always sharded too.
    - ``reshard_after_forward``: free gathered parameters after forward (less
      memory) or keep them for backward (less communication).
    - ``param_dtype`` / ``reduce_dtype``: FSDP's mixed precision policy.
    - ``cpu_offload``: keep sharded parameters and optimizer state on the CPU.
    - ``activation_checkpointing``: module classes whose activations are
      recomputed in backward.
    - ``replicate_degree``: > 1 gives HSDP: shards inside groups of
      ``world_size / replicate_degree`` processes, replicas across groups.

    ``training_step`` runs as an FSDP forward of the root, and evaluation
    gathers every shard unit first, so steps may call submodules directly
    (``self.model(input_ids=...)``) rather than ``self(...)``.

    A module with a ``configure_model()`` method has it called on the meta
    device, so a model too large for one process is never materialised whole;
    its parameters are then allocated sharded and initialised with each
    submodule's ``reset_parameters()``. (A ``configure_model(device_mesh)``
    applies a tensor-parallel plan for `ModelParallelStrategy`; FSDP skips it.)
    """

    def __init__(
        self,
        shard_classes: Sequence[type[nn.Module]] | None = None,
        reshard_after_forward: bool = True,
        param_dtype: torch.dtype | None = None,
        reduce_dtype: torch.dtype | None = None,
        cpu_offload: bool = False,
        activation_checkpointing: Sequence[type[nn.Module]] = (),
        replicate_degree: int = 1,
        precision: Precision | None = None,
        backend: str | None = None,
        timeout_s: float = 1800.0,
        use_distributed_sampler: bool = True,
    ) -> None:
        super().__init__(precision, backend, timeout_s, use_distributed_sampler)
        self.shard_classes = tuple(shard_classes) if shard_classes is not None else None
        self.reshard_after_forward = reshard_after_forward
        self.param_dtype, self.reduce_dtype = param_dtype, reduce_dtype
        self.cpu_offload = cpu_offload
        self.activation_checkpointing = tuple(activation_checkpointing)
        self.replicate_degree = replicate_degree
        self._module: nn.Module | None = None
        self._blocks: list[nn.Module] = []  # the submodules sharded on their own (compiled one by one)

    def _mesh(self) -> Any:
        from torch.distributed.device_mesh import init_device_mesh

        world = self.world_size
        if self.replicate_degree > 1:
            if world % self.replicate_degree:
                raise ValueError(f"replicate_degree={self.replicate_degree} does not divide the world size {world}")
            shape = (self.replicate_degree, world // self.replicate_degree)
            return init_device_mesh(self.root_device.type, shape, mesh_dim_names=("replicate", "shard"))
        return init_device_mesh(self.root_device.type, (world,))

    def setup_module(self, module: nn.Module) -> nn.Module:
        from torch.distributed._composable import checkpoint
        from torch.distributed.fsdp import (
            CPUOffloadPolicy,
            MixedPrecisionPolicy,
            OffloadPolicy,
            fully_shard,
            register_fsdp_forward_method,
        )

        if self._module is module:  # sharded by an earlier fit/validate/test of this trainer
            return module
        # configure_model(device_mesh) is ModelParallelStrategy's hook (a tensor-parallel plan): not called here.
        build_on_meta = hook_takes_mesh(module) is False
        if build_on_meta:
            with torch.device("meta"):
                module.configure_model()  # type: ignore[operator]
        else:
            module = module.to(self.root_device)
        self.precision.setup(self.root_device)
        module = self.precision.convert_module(module)
        options: dict[str, Any] = {
            "mesh": self._mesh(),
            "reshard_after_forward": self.reshard_after_forward,
            "mp_policy": MixedPrecisionPolicy(param_dtype=self.param_dtype, reduce_dtype=self.reduce_dtype),
            "offload_policy": CPUOffloadPolicy() if self.cpu_offload else OffloadPolicy(),
        }
        classes = self.shard_classes
        if classes is None:
            classes = transformer_block_classes(module) or repeated_block_classes(module)
        for sub in list(module.modules()):
            if sub is not module and isinstance(sub, self.activation_checkpointing):
                checkpoint(sub)
        self._blocks = outermost_blocks(module, classes)
        for sub in self._blocks:
            fully_shard(sub, **options)
        fully_shard(module, **options)
        # training_step runs inside the root's forward hooks, so a step that calls a submodule directly
        # (``self.model(input_ids=...)``, as with Hugging Face models) still gathers the root's shards and
        # reduce-scatters their gradients. (A step that calls ``self(...)`` runs the root's hooks twice; FSDP
        # then frees the root's parameters after the step and gathers them again for backward.)
        register_fsdp_forward_method(module, "training_step")
        if build_on_meta:
            module.to_empty(device="cpu" if self.cpu_offload else self.root_device)
            for sub in module.modules():
                reset = getattr(sub, "reset_parameters", None)
                if callable(reset):
                    reset()
        self.batches_stay_put = self.root_device.type == "cpu" and self.precision.cast_dtype is None
        self._module = module
        return module

    def compile_module(self, module: nn.Module, options: dict[str, Any]) -> None:
        """Compile each sharded block in place (not the root); without repeated blocks, as on one device."""
        if not self._blocks:
            super().compile_module(module, options)
        for block in self._blocks:
            compile_in_place(block, options)

    @contextlib.contextmanager
    def eval_context(self) -> Iterator[None]:
        """Gather every shard unit's parameters once for the whole evaluation.

        Evaluation splits data without padding, so ranks may run different
        numbers of batches; with the parameters already gathered, forward makes
        no collective and no rank waits for another.
        """
        from torch.distributed.fsdp import FSDPModule

        units = [m for m in (self._module.modules() if self._module is not None else []) if isinstance(m, FSDPModule)]
        if units:
            # FSDP takes the first unit whose forward runs for the root; an evaluation before any training step
            # whose step calls a block directly (``self.model(...)``) must not make that block the root.
            units[0]._get_fsdp_state()._lazy_init()
        for unit in units:
            unit.set_reshard_after_forward(False)
            unit.unshard()
        try:
            yield
        finally:
            for unit in units:
                unit.reshard()
                unit.set_reshard_after_forward(self.reshard_after_forward)

    def no_sync(self, module: nn.Module, enabled: bool) -> contextlib.AbstractContextManager[None]:
        return self._gradient_sync(not enabled)

    @contextlib.contextmanager
    def _gradient_sync(self, sync: bool) -> Iterator[None]:
        target = self._module
        if sync or target is None:
            yield
            return
        target.set_requires_gradient_sync(False)  # type: ignore[operator]
        try:
            yield
        finally:
            target.set_requires_gradient_sync(True)  # type: ignore[operator]

    def clip_gradients(self, module: nn.Module, optimizer: Optimizer, value: float, algorithm: str) -> None:
        # Gradients are DTensor shards: torch's clipping computes the global norm across ranks.
        params = [p for group in optimizer.param_groups for p in group["params"] if p.grad is not None]
        if algorithm == "norm":
            torch.nn.utils.clip_grad_norm_(params, value, foreach=True)
        else:
            torch.nn.utils.clip_grad_value_(params, value)

    def load_module_state(self, module: nn.Module, state: dict[str, Any]) -> None:
        from torch.distributed.checkpoint.state_dict import StateDictOptions, set_model_state_dict

        # Whole tensors are distributed; shards (a checkpoint read shard by shard, `sharded_state`) load as they are.
        full = not holds_dtensors(state)
        set_model_state_dict(module, state, options=StateDictOptions(full_state_dict=full))

    def load_optimizer_state(self, module: nn.Module, optimizer: Optimizer, state: dict[str, Any]) -> None:
        from torch.distributed.checkpoint.state_dict import StateDictOptions, set_optimizer_state_dict

        full = not holds_dtensors(state)
        set_optimizer_state_dict(module, optimizer, state, options=StateDictOptions(full_state_dict=full))
