"""What the loop calls for a hook (`CallbackList.bound`): nothing, the one implementation itself, or the list."""

from __future__ import annotations

from typing import Any

from ember import Callback, TrainingModule
from ember.callbacks.callback_list import CallbackList


class Recorder(Callback):
    def __init__(self, calls: list[tuple[Any, ...]], tag: str) -> None:
        self.calls, self.tag = calls, tag

    def on_train_batch_end(self, trainer: Any, module: Any, outputs: Any, batch: Any, batch_idx: int) -> None:
        self.calls.append((self.tag, trainer, module, outputs, batch, batch_idx))


def test_no_implementation_is_none_and_the_loop_skips_the_call() -> None:
    hooks = CallbackList("trainer", TrainingModule(), [])  # type: ignore[arg-type]
    assert hooks.bound("on_train_batch_end") is None
    assert hooks.bound("on_train_batch_start") is None


def test_one_implementation_is_called_directly_with_the_trainer_and_module() -> None:
    calls: list[tuple[Any, ...]] = []
    module = TrainingModule()
    hooks = CallbackList("trainer", module, [Recorder(calls, "a")])  # type: ignore[arg-type]
    end = hooks.bound("on_train_batch_end")
    assert end is not None and getattr(end, "__self__", None) is not hooks  # not the list's loop over one function
    end({"loss": 1.0}, "batch", 3)
    assert calls == [("a", "trainer", module, {"loss": 1.0}, "batch", 3)]


def test_several_implementations_are_called_in_order_through_the_list() -> None:
    calls: list[tuple[Any, ...]] = []
    module = TrainingModule()
    hooks = CallbackList("trainer", module, [Recorder(calls, "a"), Recorder(calls, "b")])  # type: ignore[arg-type]
    end = hooks.bound("on_train_batch_end")
    assert end is not None
    end({"loss": 2.0}, "batch", 5)
    assert [call[0] for call in calls] == ["a", "b"]
    assert all(call[3:] == ({"loss": 2.0}, "batch", 5) for call in calls)


def test_an_instrumented_implementation_is_what_the_loop_calls() -> None:
    calls: list[tuple[Any, ...]] = []
    wrapped: list[str] = []
    hooks = CallbackList("trainer", TrainingModule(), [Recorder(calls, "a")])  # type: ignore[arg-type]

    def wrap(name: str, owner: Any, fn: Any) -> Any:
        def timed(*args: Any) -> None:
            wrapped.append(name)
            fn(*args)

        return timed

    hooks.instrument(wrap)
    end = hooks.bound("on_train_batch_end")
    assert end is not None
    end(None, "batch", 0)
    assert wrapped == ["on_train_batch_end"] and len(calls) == 1
