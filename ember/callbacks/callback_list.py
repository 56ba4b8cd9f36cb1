"""`CallbackList`: the one object the loops call hooks on.

The module is the first member, then the callbacks in list order. For each hook
the list keeps only the members that actually override it, so a hook nobody
implements costs one empty loop. Every hook has its own typed method here, so
each call site in the loops reads like a normal method call.
"""

from __future__ import annotations

import functools
import inspect
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any

from ember.callbacks.callback import HOOK_NAMES, Callback
from ember.callbacks.lightning_hooks import AUTOMATIC_ONLY, MODULE_METHODS, explain
from ember.hints import did_you_mean

if TYPE_CHECKING:
    from torch import Tensor
    from torch.optim import Optimizer

    from ember.modules.module import TrainingModule
    from ember.trainer.trainer import Trainer


def check_hook_names(obj: object, base: type) -> None:
    """Raise if `obj`'s class defines an ``on_*`` method that is not a hook.

    Only methods defined below `base` in the MRO are checked, so the framework's
    own classes never trip it. The hooks are `HOOK_NAMES` plus the ``on_*`` methods `base` has,
    its own or inherited (the module's batch-transfer and evaluation-mode hooks). A Lightning hook that ember does not
    call gets an error naming what it meant in Lightning and the ember way; a module under manual optimization may
    define the methods Lightning calls under automatic optimization only (`AUTOMATIC_ONLY`): no one calls them.
    """
    valid = {*HOOK_NAMES, *(name for name in dir(base) if name.startswith("on_"))}
    refused = set(MODULE_METHODS) if base is not Callback else set()
    if not getattr(obj, "automatic_optimization", True):  # never called under manual optimization: left alone
        refused -= AUTOMATIC_ONLY
    for klass in type(obj).__mro__:
        if klass is base or not issubclass(klass, base):
            continue
        for name, value in vars(klass).items():
            if name in refused and callable(value):
                raise AttributeError(explain(klass.__qualname__, name, is_callback=False))
            if name.startswith("on_") and callable(value) and name not in valid:
                lightning = explain(klass.__qualname__, name, is_callback=base is Callback)
                if lightning is not None:
                    raise AttributeError(lightning)
                hint = did_you_mean(name, sorted(valid), "see docs/hooks.md for the list of hooks.")
                raise AttributeError(
                    f"{klass.__qualname__}.{name} is not an ember hook and would never be called; {hint}"
                )


def check_hook_signature(owner: str, name: str, fn: Callable[..., Any]) -> None:
    """Raise if `fn` (a module's hook, or a callback's bound to trainer and module) cannot take the arguments
    ember passes to hook `name`. Evaluation batch hooks get ``dataloader_idx`` only with several dataloaders."""
    expected = _HOOK_ARGS[name]
    try:
        signature = inspect.signature(fn)
    except (TypeError, ValueError):  # a builtin or C callable: nothing to check
        return
    batch_eval = name.endswith("_batch_start") or name.endswith("_batch_end")
    arity = len(expected) - 1 if batch_eval and not name.startswith("on_train") else len(expected)
    try:
        signature.bind(*range(arity))
    except TypeError:
        wanted = ", ".join(expected[:arity])
        extra = ""
        if arity < len(expected):
            extra = f" ({expected[-1]} is passed only with several dataloaders, as in Lightning 2: give it a default)"
        elif name == "on_train_batch_end" or name == "on_train_batch_start":
            extra = " (Lightning 2 dropped dataloader_idx from the training batch hooks; so does ember)"
        raise TypeError(f"{owner}.{name}{signature} cannot be called as {name}({wanted}){extra}") from None


def _hook_args() -> dict[str, tuple[str, ...]]:
    """Each hook's arguments after ``(trainer, module)``, read from `Callback`'s signatures."""
    args = {}
    for name in HOOK_NAMES:
        params = list(inspect.signature(getattr(Callback, name)).parameters)[3:]  # self, trainer, module
        args[name] = tuple(params)
    return args


_HOOK_ARGS = _hook_args()


def _overrides(obj: object, base: type, name: str) -> bool:
    return getattr(type(obj), name, None) is not getattr(base, name, None)


def _owner(fn: Callable[..., Any]) -> Any:
    """The object a hook function belongs to (a bound method of the module, or a partial of a callback's)."""
    bound = fn.func if isinstance(fn, functools.partial) else fn
    return getattr(bound, "__self__", None)


def _run_each(name: str) -> Callable[[CallbackList], None]:
    """The `CallbackList` method of hook `name`, which takes no arguments: calls each implementation in order."""

    def call(self: CallbackList) -> None:
        for fn in self._table[name]:
            fn()

    call.__name__, call.__qualname__ = name, f"CallbackList.{name}"
    call.__doc__ = f"Call ``{name}`` on the module, then on each callback."
    return call


class CallbackList:
    """Calls a hook on the module first, then on each callback in order."""

    def __init__(self, trainer: Trainer, module: TrainingModule, callbacks: Sequence[Callback]) -> None:
        from ember.callbacks.model_checkpoint import ModelCheckpoint
        from ember.modules.module import TrainingModule

        # Checkpoint callbacks go last, so a checkpoint holds every other callback's state after the hook.
        callbacks = sorted(callbacks, key=lambda cb: isinstance(cb, ModelCheckpoint))
        check_hook_names(module, TrainingModule)
        for callback in callbacks:
            if not isinstance(callback, Callback):
                raise TypeError(
                    f"callbacks must be ember.Callback instances; got {type(callback).__qualname__}. "
                    "Subclass ember.Callback."
                )
            check_hook_names(callback, Callback)
        self.callbacks = list(callbacks)
        self._table: dict[str, list[Callable[..., Any]]] = {}
        for name in HOOK_NAMES:
            fns: list[Callable[..., Any]] = []
            if _overrides(module, TrainingModule, name):
                fns.append(getattr(module, name))
                check_hook_signature(type(module).__qualname__, name, fns[-1])
            for cb in callbacks:
                if _overrides(cb, Callback, name):
                    fns.append(functools.partial(getattr(cb, name), trainer, module))
                    check_hook_signature(type(cb).__qualname__, name, fns[-1])
            self._table[name] = fns

    def instrument(self, wrap: Callable[[str, Any, Callable[..., Any]], Callable[..., Any]]) -> None:
        """Replace every hook function by ``wrap(hook name, owner, fn)``; the owner is the module or the callback.

        For observers of the whole run (``Trainer(profiler=...)`` times each hook this way). A hook
        being called while this runs keeps calling the functions it started with.
        """
        for name, fns in self._table.items():
            self._table[name] = [wrap(name, _owner(fn), fn) for fn in fns]

    def implemented(self, name: str) -> bool:
        """Whether the module or any callback implements hook `name`."""
        return bool(self._table[name])

    def bound(self, name: str) -> Callable[..., None] | None:
        """What the loop calls for hook `name` (resolved once per epoch): None when nobody implements it (the loop
        skips the call), the one implementation itself when there is one (a per-batch hook then costs one call, not
        a call of this list's method that loops over one), else this list's method, which calls each in order."""
        fns = self._table[name]
        if len(fns) == 1:
            return fns[0]
        method: Callable[..., None] = getattr(self, name)
        return method if fns else None

    def _call(self, name: str, *args: Any) -> None:
        for fn in self._table[name]:
            fn(*args)

    def setup(self, stage: str) -> None:
        self._call("setup", stage)

    def teardown(self, stage: str) -> None:
        self._call("teardown", stage)

    on_fit_start = _run_each("on_fit_start")
    on_fit_end = _run_each("on_fit_end")
    on_sanity_check_start = _run_each("on_sanity_check_start")
    on_sanity_check_end = _run_each("on_sanity_check_end")
    on_train_start = _run_each("on_train_start")
    on_train_end = _run_each("on_train_end")
    on_train_epoch_start = _run_each("on_train_epoch_start")
    on_train_epoch_end = _run_each("on_train_epoch_end")
    on_train_stop = _run_each("on_train_stop")

    def on_train_batch_start(self, batch: Any, batch_idx: int) -> None:
        for fn in self._table["on_train_batch_start"]:  # per-batch hook: looped inline, no *args packing
            fn(batch, batch_idx)

    def on_train_batch_end(self, outputs: Any, batch: Any, batch_idx: int) -> None:
        for fn in self._table["on_train_batch_end"]:  # per-batch hook: looped inline, no *args packing
            fn(outputs, batch, batch_idx)

    def on_before_backward(self, loss: Tensor) -> None:
        for fn in self._table["on_before_backward"]:  # per-batch hook: looped inline, no *args packing
            fn(loss)

    def on_after_backward(self) -> None:
        for fn in self._table["on_after_backward"]:  # per-batch hook: looped inline, no *args packing
            fn()

    def on_before_optimizer_step(self, optimizer: Optimizer) -> None:
        for fn in self._table["on_before_optimizer_step"]:  # per-batch hook: looped inline, no *args packing
            fn(optimizer)

    def on_before_zero_grad(self, optimizer: Optimizer) -> None:
        for fn in self._table["on_before_zero_grad"]:  # per-batch hook: looped inline, no *args packing
            fn(optimizer)

    # Evaluation hooks are shared by validation, test and predict: the stage
    # name picks the hook, e.g. stage "test" calls on_test_batch_end.
    def on_eval_start(self, stage: str) -> None:
        self._call(f"on_{stage}_start")

    def on_eval_end(self, stage: str) -> None:
        self._call(f"on_{stage}_end")

    def on_eval_epoch_start(self, stage: str) -> None:
        self._call(f"on_{stage}_epoch_start")

    def on_eval_epoch_end(self, stage: str) -> None:
        self._call(f"on_{stage}_epoch_end")

    # ``dataloader_idx`` is passed only when the evaluation has several dataloaders, as in Lightning: a hook
    # written as ``on_validation_batch_end(self, outputs, batch, batch_idx)`` works with one.
    def on_eval_batch_start(self, stage: str, batch: Any, batch_idx: int, *dataloader_idx: int) -> None:
        self._call(f"on_{stage}_batch_start", batch, batch_idx, *dataloader_idx)

    def on_eval_batch_end(self, stage: str, outputs: Any, batch: Any, batch_idx: int, *dataloader_idx: int) -> None:
        self._call(f"on_{stage}_batch_end", outputs, batch, batch_idx, *dataloader_idx)

    def on_save_checkpoint(self, checkpoint: dict[str, Any]) -> None:
        self._call("on_save_checkpoint", checkpoint)

    def on_load_checkpoint(self, checkpoint: dict[str, Any]) -> None:
        self._call("on_load_checkpoint", checkpoint)

    def on_exception(self, exception: BaseException) -> None:
        self._call("on_exception", exception)
