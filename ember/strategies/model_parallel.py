"""`ModelParallelStrategy`: tensor parallelism inside groups of processes, FSDP2 across them, on a 2-D mesh.

The processes form a ``("dp", "tp")`` device mesh of ``data_parallel_size x tensor_parallel_size``. The
module's ``configure_model(device_mesh)`` hook applies its tensor-parallel plan on ``device_mesh["tp"]``
(``parallelize_module`` with ``ColwiseParallel`` / ``RowwiseParallel``, ...); ember then shards the result
with FSDP2 (``fully_shard``) over ``device_mesh["dp"]``, unless the hook did that itself. The processes of
one tensor-parallel group see the same batches; the data is split over the data-parallel dimension only.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator, Sequence
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor, nn
from torch.optim import Optimizer

from ember.strategies.collectives import keep
from ember.strategies.fsdp import outermost_blocks, repeated_block_classes
from ember.strategies.parallel import ParallelStrategy
from ember.strategies.precision import Precision
from ember.strategies.strategy import compile_in_place, holds_dtensors, hook_takes_mesh

#: Names of the two mesh dimensions, outer (data parallel) first.
MESH_DIM_NAMES = ("dp", "tp")

_REDUCE_OPS = {"sum": dist.ReduceOp.SUM, "mean": dist.ReduceOp.SUM, "max": dist.ReduceOp.MAX, "min": dist.ReduceOp.MIN}


def mesh_shape(
    world_size: int, processes_per_node: int, data_parallel_size: int | str, tensor_parallel_size: int | str
) -> tuple[int, int]:
    """``(dp, tp)`` for `world_size` processes; ``"auto"`` sizes follow from the other one.

    ``tensor_parallel_size="auto"`` is the processes per node (tensor parallelism wants the fast links inside
    a node); ``data_parallel_size="auto"`` is ``world_size / tp``. The product must be the world size.
    """
    check_size("data_parallel_size", data_parallel_size)
    check_size("tensor_parallel_size", tensor_parallel_size)
    if tensor_parallel_size == "auto":
        if data_parallel_size == "auto":
            tp = processes_per_node
        else:
            assert isinstance(data_parallel_size, int)
            tp = world_size // data_parallel_size
    else:
        assert isinstance(tensor_parallel_size, int)
        tp = tensor_parallel_size
    dp = world_size // max(tp, 1) if data_parallel_size == "auto" else data_parallel_size
    assert isinstance(dp, int)
    if dp * tp != world_size:
        raise ValueError(
            f"data_parallel_size={data_parallel_size!r} x tensor_parallel_size={tensor_parallel_size!r} does not "
            f"fill the {world_size} processes ({dp} x {tp} = {dp * tp}); choose sizes whose product is "
            f"{world_size}, or leave data_parallel_size='auto' with a tensor_parallel_size that divides {world_size}"
        )
    return dp, tp


def check_size(name: str, value: Any) -> None:
    """A mesh size is a positive int or ``"auto"``."""
    if value != "auto" and (isinstance(value, bool) or not isinstance(value, int) or value < 1):
        raise ValueError(f"{name}={value!r}: use a positive number of processes or 'auto'")


def _is_dtensor(value: Any) -> bool:
    from torch.distributed.tensor import DTensor

    return isinstance(value, DTensor)


def total_norm(grads: Sequence[Tensor], norm_type: float) -> Tensor:
    """The norm of all `grads` together, as a plain tensor equal on every process.

    Gradients may be plain tensors (replicated parameters) and DTensors on different meshes (tensor-parallel
    on ``tp``, FSDP-sharded on ``dp``, both on the 2-D mesh): torch's clipping stacks the per-tensor norms,
    which fails across meshes. Here the norms are computed per (mesh, placements) group with torch's foreach
    kernels, each group's made whole (`full_tensor`, a collective over its mesh), then combined.
    """
    groups: dict[Any, list[Tensor]] = {}
    for grad in grads:
        key = (grad.device_mesh, grad.placements) if _is_dtensor(grad) else None  # type: ignore[attr-defined]
        groups.setdefault(key, []).append(grad)
    norms = []
    for group in groups.values():
        norm = torch.nn.utils.get_total_norm(group, norm_type, foreach=True)
        norms.append(norm.full_tensor() if _is_dtensor(norm) else norm)  # type: ignore[attr-defined]
    if not norms:
        return torch.zeros(())
    return torch.nn.utils.get_total_norm(norms, norm_type)


class ModelParallelStrategy(ParallelStrategy):
    """Tensor parallelism (TP) combined with FSDP2 on a 2-D ``("dp", "tp")`` device mesh.

    - ``data_parallel_size`` x ``tensor_parallel_size`` must equal the number of processes; ``"auto"``
      for both makes the processes of each node one TP group (``tensor_parallel_size`` = processes per
      node) and the nodes the data-parallel replicas; ``"auto"`` for one size fills it from the other.
    - The module defines ``configure_model(self, device_mesh)``: it applies its TP plan to its layers on
      ``device_mesh["tp"]`` (``torch.distributed.tensor.parallel.parallelize_module``) and may call
      ``fully_shard(..., mesh=device_mesh["dp"])`` itself. When it does not, ember shards the repeated
      blocks (or ``shard_classes``) and the root with FSDP2 over ``"dp"`` (when ``dp > 1``), with
      ``reshard_after_forward``, ``param_dtype`` and ``reduce_dtype`` as in `FSDPStrategy`.
    - ``loss_parallel``: run the training step and its backward inside torch's ``loss_parallel()``, so a
      cross-entropy over logits sharded on the class dimension (an output projection planned with
      ``ColwiseParallel(use_local_output=False)``) never gathers the logits. The step's loss is then a
      DTensor, which ``self.log`` takes as it is.
    - Every process of a TP group gets the same batches: distributed samplers split the data over the
      ``dp`` dimension only (`distributed_sampler_kwargs`), and ``sync_dist`` reductions run over ``dp``.

    Sequence parallelism is part of the plan (``SequenceParallel`` on norms and dropout with
    ``PrepareModuleInput`` on the blocks, as torch documents); ember needs no option for it.
    """

    def __init__(
        self,
        data_parallel_size: int | str = "auto",
        tensor_parallel_size: int | str = "auto",
        shard_classes: Sequence[type[nn.Module]] | None = None,
        reshard_after_forward: bool = True,
        param_dtype: torch.dtype | None = None,
        reduce_dtype: torch.dtype | None = None,
        loss_parallel: bool = False,
        precision: Precision | None = None,
        backend: str | None = None,
        timeout_s: float = 1800.0,
        use_distributed_sampler: bool = True,
    ) -> None:
        super().__init__(precision, backend, timeout_s, use_distributed_sampler)
        check_size("data_parallel_size", data_parallel_size)  # whether they fill the world: once it is known
        check_size("tensor_parallel_size", tensor_parallel_size)
        self.data_parallel_size = data_parallel_size
        self.tensor_parallel_size = tensor_parallel_size
        self.shard_classes = tuple(shard_classes) if shard_classes is not None else None
        self.reshard_after_forward = reshard_after_forward
        self.param_dtype, self.reduce_dtype = param_dtype, reduce_dtype
        self.loss_parallel = loss_parallel
        self._device_mesh: Any = None
        self._module: nn.Module | None = None
        self._fsdp_units: list[nn.Module] = []  # every FSDP-sharded module (ember's or the hook's)
        self._blocks: list[nn.Module] = []  # blocks ember sharded on their own (compiled one by one)

    # --- topology -----------------------------------------------------------
    @property
    def device_mesh(self) -> Any:
        """The ``("dp", "tp")`` `DeviceMesh` (built when the processes have joined)."""
        if self._device_mesh is None:
            raise RuntimeError("the device mesh exists once the processes have joined (in fit/validate/test)")
        return self._device_mesh

    @property
    def distributed_sampler_kwargs(self) -> dict[str, int]:
        """The data shard of this process's data-parallel group: TP peers share one."""
        if self._device_mesh is None:
            return super().distributed_sampler_kwargs
        dp_mesh = self._device_mesh["dp"]
        return {"num_replicas": dp_mesh.size(), "rank": dp_mesh.get_local_rank()}

    def setup_environment(self) -> None:
        """Join the process group, then build the ``(dp, tp)`` mesh."""
        super().setup_environment()
        if self._device_mesh is not None:
            return
        from torch.distributed.device_mesh import init_device_mesh

        per_node = max(self.cluster.world_size // max(self.cluster.num_nodes, 1), 1)
        shape = mesh_shape(self.world_size, per_node, self.data_parallel_size, self.tensor_parallel_size)
        self._device_mesh = init_device_mesh(self.root_device.type, shape, mesh_dim_names=MESH_DIM_NAMES)

    # --- setup --------------------------------------------------------------
    def setup_module(self, module: nn.Module) -> nn.Module:
        """Move and cast the module, let its ``configure_model(device_mesh)`` apply the TP plan, shard over dp."""
        from torch.distributed.fsdp import FSDPModule, MixedPrecisionPolicy, fully_shard

        if self._module is module:  # parallelized by an earlier fit/validate/test of this trainer
            return module
        takes_mesh = hook_takes_mesh(module)
        if not takes_mesh:
            what = "takes no device mesh" if takes_mesh is False else "is missing"
            raise TypeError(
                f"ModelParallelStrategy calls {type(module).__qualname__}.configure_model(device_mesh), which "
                f"{what}: define `def configure_model(self, device_mesh)` and apply the tensor-parallel plan there "
                "(parallelize_module(layer, device_mesh['tp'], {...})); for data parallelism alone use "
                "strategy='fsdp' or 'ddp'"
            )
        self.precision.setup(self.root_device)
        module = self.precision.convert_module(module.to(self.root_device))
        mesh = self.device_mesh
        module.configure_model(mesh)  # type: ignore[operator]
        _check_parallelized(module, mesh)
        self._fsdp_units = [m for m in module.modules() if isinstance(m, FSDPModule)]
        if not self._fsdp_units and mesh["dp"].size() > 1:
            options: dict[str, Any] = {
                "mesh": mesh["dp"],
                "reshard_after_forward": self.reshard_after_forward,
                "mp_policy": MixedPrecisionPolicy(param_dtype=self.param_dtype, reduce_dtype=self.reduce_dtype),
            }
            classes = self.shard_classes if self.shard_classes is not None else repeated_block_classes(module)
            self._blocks = outermost_blocks(module, classes)
            for sub in self._blocks:
                fully_shard(sub, **options)
            fully_shard(module, **options)
            self._fsdp_units = [*self._blocks, module]
        self._scope_metrics(module)
        self.batches_stay_put = self.root_device.type == "cpu" and self.precision.cast_dtype is None
        self._module = module
        return module

    def _scope_metrics(self, module: nn.Module) -> None:
        """torchmetrics synchronise over the data-parallel processes only (TP peers hold the same values)."""
        from torchmetrics import Metric

        group = self.device_mesh["dp"].get_group()
        for metric in module.modules():
            if isinstance(metric, Metric) and metric.process_group is None:
                metric.process_group = group

    def compile_module(self, module: nn.Module, options: dict[str, Any]) -> None:
        """Compile each repeated block in place (as FSDP does); without such blocks, as on one device."""
        blocks = self._blocks or outermost_blocks(module, repeated_block_classes(module))
        if not blocks:
            super().compile_module(module, options)
        for block in blocks:
            compile_in_place(block, options)

    # --- training -----------------------------------------------------------
    def forward_context(self) -> contextlib.AbstractContextManager[None]:
        if not self.loss_parallel:
            return self.precision.forward_context()
        return self._with_loss_parallel(self.precision.forward_context())

    @contextlib.contextmanager
    def _with_loss_parallel(self, inner: contextlib.AbstractContextManager[None]) -> Iterator[None]:
        from torch.distributed.tensor.parallel import loss_parallel

        with inner, loss_parallel():
            yield

    def backward(self, loss: Tensor) -> None:
        if not self.loss_parallel:
            super().backward(loss)
            return
        from torch.distributed.tensor.parallel import loss_parallel

        with loss_parallel():
            super().backward(loss)

    def no_sync(self, module: nn.Module, enabled: bool) -> contextlib.AbstractContextManager[None]:
        """While accumulating, FSDP keeps the unsharded gradients and skips the reduce-scatter."""
        return self._gradient_sync(not enabled)

    @contextlib.contextmanager
    def _gradient_sync(self, sync: bool) -> Iterator[None]:
        if sync or not self._fsdp_units:
            yield
            return
        for unit in self._fsdp_units:
            unit.set_requires_gradient_sync(False, recurse=False)  # type: ignore[operator]
        try:
            yield
        finally:
            for unit in self._fsdp_units:
                unit.set_requires_gradient_sync(True, recurse=False)  # type: ignore[operator]

    @contextlib.contextmanager
    def eval_context(self) -> Iterator[None]:
        """Gather the FSDP shards once for the whole evaluation.

        Data-parallel groups may run different numbers of evaluation batches (no padding); with the dp
        shards gathered, a forward communicates only inside its TP group, whose processes run the same
        batches.
        """
        for unit in self._fsdp_units:
            unit.set_reshard_after_forward(False, recurse=False)  # type: ignore[operator]
            unit.unshard()  # type: ignore[operator]
        try:
            yield
        finally:
            for unit in self._fsdp_units:
                unit.reshard()  # type: ignore[operator]
                unit.set_reshard_after_forward(self.reshard_after_forward, recurse=False)  # type: ignore[operator]

    def clip_gradients(self, module: nn.Module, optimizer: Optimizer, value: float, algorithm: str) -> None:
        """Clip by the global norm over every shard (`total_norm`) or by value, on the local shards."""
        grads = [p.grad for group in optimizer.param_groups for p in group["params"] if p.grad is not None]
        if algorithm == "value":
            for grad in grads:
                local = grad.to_local() if _is_dtensor(grad) else grad
                local.clamp_(-value, value)
            return
        coefficient = (value / (total_norm(grads, 2.0) + 1e-6)).clamp(max=1.0)
        locals_ = [g.to_local() if _is_dtensor(g) else g for g in grads]
        torch._foreach_mul_(locals_, coefficient)

    # --- checkpoint state -----------------------------------------------------
    def load_module_state(self, module: nn.Module, state: dict[str, Any]) -> None:
        """Load full weights: each process keeps the part its mesh coordinates own (any mesh shape)."""
        from torch.distributed.checkpoint.state_dict import StateDictOptions, set_model_state_dict

        # Whole tensors are distributed; shards (a checkpoint read shard by shard, `sharded_state`) load as they are.
        full = not holds_dtensors(state)
        set_model_state_dict(module, state, options=StateDictOptions(full_state_dict=full))

    def load_optimizer_state(self, module: nn.Module, optimizer: Optimizer, state: dict[str, Any]) -> None:
        from torch.distributed.checkpoint.state_dict import StateDictOptions, set_optimizer_state_dict

        full = not holds_dtensors(state)
        set_optimizer_state_dict(module, optimizer, state, options=StateDictOptions(full_state_dict=full))

    # --- collectives ----------------------------------------------------------
    def reduce(self, tensor: Tensor, reduce_fx: str = "mean") -> Tensor:
        """Reduce over the data-parallel processes: TP peers hold the same value, so it counts once."""
        if not dist.is_initialized() or self._device_mesh is None:
            return super().reduce(tensor, reduce_fx)
        dp_mesh = self._device_mesh["dp"]
        out = tensor.clone()
        keep(out)
        dist.all_reduce(out, op=_REDUCE_OPS[reduce_fx], group=dp_mesh.get_group())
        return out / dp_mesh.size() if reduce_fx == "mean" else out


def _check_parallelized(module: nn.Module, mesh: Any) -> None:
    """After the hook: parameters are real (not meta), and with tp > 1 some of them are tensor-parallel."""
    meta = [name for name, p in module.named_parameters() if p.is_meta]
    if meta:
        raise RuntimeError(
            f"after configure_model(device_mesh), {len(meta)} parameter(s) are on the meta device ({meta[0]}, ...); "
            "ModelParallelStrategy parallelizes layers built in __init__: build them there"
        )
    if mesh["tp"].size() > 1 and not any(_is_dtensor(p) for p in module.parameters()):
        raise RuntimeError(
            f"configure_model(device_mesh) of {type(module).__qualname__} left every parameter unsharded, but "
            f"tensor_parallel_size={mesh['tp'].size()}: apply a plan with parallelize_module(layer, "
            "device_mesh['tp'], {'name': ColwiseParallel(), ...}), or use tensor_parallel_size=1"
        )
