"""A rolling snapshot's plan: what one in-memory snapshot of the training state keeps for the next.

A snapshot (``trainer.snapshot``) gathers the model's and optimizers' tensors and copies them into host buffers.
Gathering them afresh each time walks every submodule (``state_dict``) and every parameter's name (the optimizer
state is keyed by name): fixed host work that does not depend on the model's size. A `SnapshotPlan` keeps what
that walk found, the model's state entries (key and live tensor, in ``state_dict``'s order) and each parameter's
name, from one snapshot to the next, together with the host buffers the copies go into (``staging``).

Before each use the plan checks that the model's structure is still the one it was built from: every submodule's
parameters, buffers, children and state-dict hooks are the same objects as then (the plan holds them, so an
object's identity cannot be taken by a new one). Anything else (a parameter or buffer replaced, a submodule added,
a hook registered) rebuilds the plan from a fresh ``state_dict`` walk. The optimizer state is read each time (it
appears at the first step, param groups may be added): only the parameters' names are kept. Shapes and dtypes are
checked at each copy (`ember.checkpoint.staging.staging_buffer`), so a tensor resized in place gets a new buffer.
A model the plan cannot describe by its parameters and buffers alone (a submodule that overrides ``state_dict`` or
holds extra state, a tensor subclass such as a DTensor, names the optimizer state cannot use) is gathered the
general way (`ember.checkpoint.registry.gather`), as without a plan. Either way the snapshot is the same, key for
key and byte for byte (tests/unit/checkpoint/test_snapshot_plan.py).
"""

from __future__ import annotations

import copy
import operator
from typing import TYPE_CHECKING, Any

import torch
from torch import Tensor, nn

from ember.checkpoint.format import _TENSOR_MARK
from ember.checkpoint.staging import copy_into, staging_buffer
from ember.strategies.strategy import Strategy, optimizer_index_names, optimizer_state_indexed, parameter_names

if TYPE_CHECKING:
    from ember.trainer.trainer import Trainer

_PLAIN = (Tensor, nn.Parameter)
_IMMUTABLE = (int, float, bool, str, bytes, complex, type(None))
_SEQUENCES = (list, tuple)


class SnapshotPlan:
    """The host buffers of a rolling snapshot and the model's state entries it copies, kept between snapshots.

    Pass one to ``trainer.snapshot(plan)`` each time; the snapshot it returns holds the plan's buffers, so the
    next snapshot taken with the same plan overwrites it (a rolling snapshot keeps one).
    """

    def __init__(self) -> None:
        #: Host buffers by checkpoint key, reused snapshot after snapshot (as an async save's staging).
        self.staging: dict[str, Tensor] = {}
        #: How many times the plan was built from a fresh ``state_dict`` walk.
        self.builds = 0
        self._module: nn.Module | None = None
        self._watched: list[Any] = []  # the dicts whose values make the structure, and their values then
        self._expected: list[Any] = []
        self._transient: list[set[str]] = []  # each submodule's non-persistent buffer names, and how many then
        self._transient_sizes: list[int] = []
        self._keys: list[str] = []  # the module's checkpoint keys, in state_dict order
        self._sources: list[Tensor] = []  # their live tensors
        self._buffers: list[Tensor] = []  # and the host buffers they are copied into
        self._layout: list[tuple[Any, ...]] = []  # (shape, dtype, device) of each source when its buffer was taken
        self._foreach = False  # whether the sources are all host tensors (one `_foreach_copy_`)
        self._skeleton: dict[str, Any] = {}  # the module's part of the tensor skeleton (shared: never changed)
        self._names: dict[Tensor, str] = {}
        #: By optimizer (its id; it is kept, so the id is not reused): the optimizer, its parameters, their names.
        self._optimizer_names: dict[int, tuple[Any, list[Tensor], dict[int, str]]] = {}
        self._usable = False

    def tensor_state(self, trainer: Trainer, module: nn.Module) -> tuple[Any, dict[str, Tensor]] | None:
        """The module's and optimizers' state as `ember.checkpoint.format.split_tensors` splits it (the skeleton,
        then ``{key: tensor}``), the tensors copied into the plan's host buffers and the skeleton's other values
        copied as ``registry.copy_state`` copies them; None when the plan cannot describe this model (gather it
        the general way)."""
        if module is not self._module or not self._unchanged():
            self._build(trainer, module)
        if not self._usable:
            return None
        optimizers = []
        for optimizer in trainer.optimizers:
            index_name = self._index_names(optimizer)
            if index_name is None:
                return None  # a parameter the module does not hold: the general path decides
            optimizers.append(optimizer_state_indexed(optimizer, index_name))
        sources, buffers = self._sources, self._buffers
        layout = [(source.shape, source.dtype, source.device) for source in sources]
        if layout != self._layout:  # the first use, or a tensor resized or cast in place: buffers that fit it
            pairs = zip(self._keys, sources, strict=True)
            buffers[:] = [staging_buffer(self.staging, key, source) for key, source in pairs]
            self._layout = layout
            self._foreach = all(source.device.type == "cpu" for source in sources)
        grad = torch.is_grad_enabled()
        torch._C._set_grad_enabled(False)  # the buffers are no part of any graph (a context manager costs more)
        try:
            if self._foreach:
                torch._foreach_copy_(buffers, sources)
            else:
                for buffer, source in zip(buffers, sources, strict=True):
                    buffer.copy_(source)
        finally:
            torch._C._set_grad_enabled(grad)
        tensors = dict(zip(self._keys, buffers, strict=True))
        optimizer_skeleton = _split_copy(optimizers, "/optimizers", self.staging, tensors)
        return {"module": self._skeleton, "optimizers": optimizer_skeleton}, tensors

    def release(self) -> None:
        """Let go of the model, its tensors and the optimizers the plan watched (a fit ended); the host buffers stay.
        The next snapshot walks the model again."""
        self._module, self._usable = None, False
        self._watched, self._expected, self._transient, self._transient_sizes = [], [], [], []
        self._sources, self._buffers, self._layout, self._names, self._optimizer_names = [], [], [], {}, {}

    def _index_names(self, optimizer: Any) -> dict[int, str] | None:
        """The optimizer's parameter names by index: those found for the same parameters last time (compared by
        identity: a param group added or changed finds them again)."""
        params = [param for group in optimizer.param_groups for param in group["params"]]
        last = self._optimizer_names.get(id(optimizer))
        same = last is not None and last[0] is optimizer and len(last[1]) == len(params)
        if last is not None and same and all(map(operator.is_, params, last[1])):
            return last[2]
        index_name = optimizer_index_names(optimizer, self._names)
        if index_name is not None:
            self._optimizer_names[id(optimizer)] = (optimizer, params, index_name)
        return index_name

    def _unchanged(self) -> bool:
        current = [value for watched in self._watched for value in watched.values()]
        return (
            len(current) == len(self._expected)
            and all(map(operator.is_, current, self._expected))
            and list(map(len, self._transient)) == self._transient_sizes
        )

    def _build(self, trainer: Trainer, module: nn.Module) -> None:
        self.builds += 1
        self._module, self._usable = module, False
        modules = list(module.modules())
        self._watched = [
            watched
            for m in modules
            for watched in (m._parameters, m._buffers, m._modules, m._state_dict_hooks, m._state_dict_pre_hooks)
        ]
        self._expected = [value for watched in self._watched for value in watched.values()]
        self._transient = [m._non_persistent_buffers_set for m in modules]  # a buffer made non-persistent
        self._transient_sizes = list(map(len, self._transient))
        names = parameter_names(module)
        if names is None or type(trainer.strategy).optimizer_state is not Strategy.optimizer_state:
            return
        if any(_custom_state(m) for m in modules):
            return
        entries = [(f"/module/{key}", value) for key, value in module.state_dict(keep_vars=True).items()]
        if any(type(value) not in _PLAIN for _, value in entries):
            return
        self._keys, self._sources = [key for key, _ in entries], [value for _, value in entries]
        self._buffers, self._layout = [], []
        self._names, self._optimizer_names, self._usable = names, {}, True
        self._skeleton = {key[len("/module/") :]: {_TENSOR_MARK: key} for key in self._keys}


def _custom_state(module: nn.Module) -> bool:
    """Whether `module`'s state dict may hold more than its parameters and persistent buffers."""
    kind = type(module)
    return (
        kind.state_dict is not nn.Module.state_dict
        or kind._save_to_state_dict is not nn.Module._save_to_state_dict
        or kind.get_extra_state is not nn.Module.get_extra_state
        or bool(module._state_dict_hooks or module._state_dict_pre_hooks)
    )


def _split_copy(value: Any, path: str, staging: dict[str, Tensor], tensors: dict[str, Tensor]) -> Any:
    """`split_tensors` then `copy_state` in one walk: containers rebuilt as split_tensors rebuilds them, tensors
    copied into `staging` (``tensors[path]``) and replaced by their marker, immutable values shared, anything else
    deep-copied. Plain dicts, lists and tuples are told by their type first: ``isinstance(value, Tensor)`` goes
    through torch's metaclass, several times the cost."""
    kind = type(value)
    if kind in _IMMUTABLE:
        return value
    if kind is dict or (kind not in _SEQUENCES and not isinstance(value, Tensor) and isinstance(value, dict)):
        return {
            k: v if type(v) in _IMMUTABLE else _split_copy(v, f"{path}/{k}", staging, tensors) for k, v in value.items()
        }
    if kind in _SEQUENCES or (not isinstance(value, Tensor) and isinstance(value, list | tuple)):
        items = [
            v if type(v) in _IMMUTABLE else _split_copy(v, f"{path}/{i}", staging, tensors) for i, v in enumerate(value)
        ]
        return items if isinstance(value, list) else tuple(items)
    if isinstance(value, Tensor):
        tensors[path] = copy_into(staging, path, value.detach(), on_cpu=True)
        return {_TENSOR_MARK: path}
    return copy.deepcopy(value)
