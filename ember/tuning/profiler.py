"""``Trainer(profiler=...)``: where a run's time goes.

``profiler="simple"`` times every hook and every action of the loop and, at the
end of fit (validate, test, predict), prints a table sorted by time and writes
it to ``<run dir>/profiler/<stage>.txt`` (and ``.json``). ``profiler="pytorch"``
does the same and also runs ``torch.profiler`` over a window of training steps
(``wait`` steps skipped, ``warmup`` steps traced and thrown away, ``active``
steps kept, ``repeat`` times), writing a Chrome/Perfetto trace
``<run dir>/profiler/trace-<stage>-rank<R>-<N>.json`` in which every action below
is a ``record_function`` range named ``ember/<action>``. `ProfilerConfig` sets
the options.

Actions (each row's *self* time excludes the actions nested in it, so the self
times add up to the run's wall time; the run's own row, ``<stage> (other)``, is
the part no action covers: the loop's own bookkeeping):

- ``setup``: from the start of fit to its first hook (process group, loggers,
  module to device, datamodule setup, optimizers, checkpoint restore);
- ``train/data_fetch``: getting the next training batch from the loader;
  ``batch_to_device``: moving and casting a batch;
- ``train/forward`` (``training_step``, loss included), ``train/backward``,
  ``train/clip_gradients``, ``train/optimizer_step``;
- ``logging``, ``logging/epoch_end``: turning logged values into floats and
  handing them to the loggers;
- ``checkpoint/write``: writing checkpoints at step boundaries;
  ``checkpoint/wait``: waiting for a background write;
- ``sanity_check``, ``validation``, ``test``, ``predict``: evaluation loops;
- ``hook/<Owner>.<hook>``: each hook of each callback and of the module;
- ``teardown``: from the last hook to the end (loggers closed, files flushed).

How it attaches, so the loop pays nothing without a profiler: the trainer calls
`Profiler.begin` and `Profiler.end` around a run; the profiler's callback, at
``setup``, wraps the hooks of the run's `CallbackList`, the strategy's
``training_step``, ``backward``, ``clip_gradients``, ``optimizer_step`` and
``batch_to_device``, the trainer's logging methods and its checkpoint writer's
``flush`` and ``wait``, on the instances, and `end` removes the wrappers. The
loop itself has one call per epoch (`Profiler.time_batches`), and a run with a
profiler takes the general step path (``steps_are_plain`` is false). Each timed
action costs two ``perf_counter`` calls and a few list operations (about a
microsecond). The profiler is not thread-safe; ember calls all of these from the
main thread.
"""

from __future__ import annotations

import json
import time
from collections.abc import Callable, Iterator
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from ember.callbacks.callback import Callback
from ember.checkpoint.files import atomic_write
from ember.tuning.profile_report import ActionStats, ProfileReport

if TYPE_CHECKING:
    from ember.modules.module import TrainingModule
    from ember.trainer.trainer import Trainer

KINDS = ("simple", "pytorch")

#: Strategy methods timed, and their action names.
_STRATEGY_ACTIONS = {
    "training_step": "train/forward",
    "backward": "train/backward",
    "clip_gradients": "train/clip_gradients",
    "optimizer_step": "train/optimizer_step",
    "batch_to_device": "batch_to_device",
}
_REPORTER_ACTIONS = {"log_metrics": "logging", "log_epoch_metrics": "logging/epoch_end"}
_WRITER_ACTIONS = {"flush": "checkpoint/write", "wait": "checkpoint/wait"}
_EVAL_ACTIONS = {"validation": "validation", "test": "test", "predict": "predict"}


@dataclass
class ProfilerConfig:
    """Options of ``Trainer(profiler=ProfilerConfig(...))`` (a YAML config may give them as a mapping).

    - ``kind``: ``"simple"`` (the table) or ``"pytorch"`` (the table and a torch.profiler trace).
    - ``dirpath``: where the table and traces go (default ``<run dir>/profiler``).
    - ``wait``, ``warmup``, ``active``, ``repeat``: the trace window, in training steps
      (batches for validate/test/predict), as in ``torch.profiler.schedule``.
    - ``record_shapes``, ``profile_memory``, ``with_stack``: passed to ``torch.profiler.profile``.
    - ``print_table``: print the table when the run ends (process 0).
    """

    kind: str = "simple"
    dirpath: str | None = None
    wait: int = 1
    warmup: int = 1
    active: int = 3
    repeat: int = 1
    record_shapes: bool = False
    profile_memory: bool = False
    with_stack: bool = False
    print_table: bool = True

    def __post_init__(self) -> None:
        if self.kind not in KINDS:
            raise ValueError(f"profiler kind {self.kind!r}; choose 'simple' or 'pytorch'")
        for name in ("wait", "warmup", "active", "repeat"):
            value = getattr(self, name)
            low = 1 if name == "active" else 0
            if isinstance(value, bool) or not isinstance(value, int) or value < low:
                raise ValueError(f"profiler {name}={value!r}: use an int >= {low}")


class Profiler:
    """Times named actions as a stack (see the module docstring); one instance per `Trainer`."""

    def __init__(self, config: ProfilerConfig | None = None) -> None:
        self.config = config or ProfilerConfig()
        self.reports: list[ProfileReport] = []
        self._stats: dict[str, ActionStats] = {}
        self._stack: list[list[Any]] = []  # [name, start, seconds of nested actions, record_function or None]
        self._wrapped: list[tuple[Any, str, Any]] = []
        self._stage = ""
        self._open_phase: str | None = None
        self._torch_profiler: Any = None
        self._record_function: Any = None
        self._traces: list[Path] = []
        self._trainer: Trainer | None = None
        self.callback = _ProfilerCallback(self)

    # --- timing -----------------------------------------------------------------
    def start(self, name: str) -> None:
        """Open action `name` (nested in the open one, if any)."""
        rf = None
        if self._torch_profiler is not None:
            rf = self._record_function(f"ember/{name}")
            rf.__enter__()
        self._stack.append([name, time.perf_counter(), 0.0, rf])

    def stop(self) -> None:
        """Close the innermost open action."""
        now = time.perf_counter()
        name, started, nested, rf = self._stack.pop()
        if rf is not None:
            rf.__exit__(None, None, None)
        elapsed = now - started
        stats = self._stats.get(name)
        if stats is None:
            stats = self._stats[name] = ActionStats(name)
        stats.calls += 1
        stats.total += elapsed
        stats.self += elapsed - nested
        if self._stack:
            self._stack[-1][2] += elapsed

    def wrap(self, name: str, fn: Callable[..., Any]) -> Callable[..., Any]:
        """`fn`, timed as action `name`."""
        start, stop = self.start, self.stop

        def timed(*args: Any, **kwargs: Any) -> Any:
            start(name)
            try:
                return fn(*args, **kwargs)
            finally:
                stop()

        timed.__wrapped__ = fn  # type: ignore[attr-defined]
        return timed

    def time_batches(self, batches: Iterator[Any]) -> Iterator[Any]:
        """`batches`, with each ``next()`` timed as ``train/data_fetch`` (the loop calls this once per epoch)."""
        start, stop = self.start, self.stop
        while True:
            start("train/data_fetch")
            try:
                item = next(batches)
            except StopIteration:
                return
            finally:
                stop()
            yield item

    # --- a run ------------------------------------------------------------------
    def begin(self, trainer: Trainer, stage: str) -> None:
        """Called by the trainer first thing in fit/validate/test/predict."""
        self._stats, self._stack, self._traces = {}, [], []
        self._stage, self._trainer, self._open_phase = stage, trainer, None  # a run rejected before it began left some
        self.start(f"{stage} (other)")
        self._phase("setup")

    def _phase(self, name: str | None) -> None:
        """Close the open top-level phase (setup, an evaluation, teardown) and open `name`."""
        if self._open_phase is not None:
            while self._stack and self._stack[-1][0] != self._open_phase:
                self.stop()  # an action an exception left open
            if self._stack:
                self.stop()
        self._open_phase = name
        if name is not None:
            self.start(name)

    def instrument(self, trainer: Trainer) -> None:
        """Wrap the run's hooks, strategy step methods, logging and checkpoint writes (at the ``setup`` hook)."""
        for attr, name in _STRATEGY_ACTIONS.items():
            self._wrap_attr(trainer.strategy, attr, name)
        for attr, name in _REPORTER_ACTIONS.items():
            self._wrap_attr(trainer.reporter, attr, name)
        for attr, name in _WRITER_ACTIONS.items():
            self._wrap_attr(trainer.checkpoints, attr, name)
        trainer.hooks.instrument(self._wrap_hook)
        if self.config.kind == "pytorch":
            self._start_torch_profiler(trainer)

    def _wrap_attr(self, obj: Any, attr: str, name: str) -> None:
        original = getattr(obj, attr)  # an AttributeError here means ember renamed what the profiler times
        wrapper = self.wrap(name, original)
        setattr(obj, attr, wrapper)
        self._wrapped.append((obj, attr, wrapper))

    def _wrap_hook(self, hook: str, owner: Any, fn: Callable[..., Any]) -> Callable[..., Any]:
        if owner is self.callback:
            return fn
        return self.wrap(f"hook/{type(owner).__name__}.{hook}", fn)

    def end(self, trainer: Trainer) -> ProfileReport:
        """Called by the trainer last thing in fit/validate/test/predict: unwrap, report, write the files."""
        self._stop_torch_profiler()
        for obj, attr, wrapper in reversed(self._wrapped):
            if obj.__dict__.get(attr) is wrapper:
                delattr(obj, attr)
        self._wrapped = []
        while self._stack:
            self.stop()
        self._open_phase = None
        root = self._stats.get(f"{self._stage} (other)")
        report = ProfileReport(self._stage, root.total if root else 0.0, list(self._stats.values()))
        report.traces = list(self._traces)
        self.reports.append(report)
        try:
            run_dir = trainer.run_dir
        except RuntimeError:
            return report  # the run failed before it had a directory
        self._write(trainer, report, run_dir)
        if self.config.print_table and trainer.is_global_zero:
            print(report.table(), flush=True)
            for trace in report.traces:
                print(f"profiler: trace {trace}", flush=True)
        return report

    def _directory(self, run_dir: Path) -> Path:
        return Path(self.config.dirpath) if self.config.dirpath else run_dir / "profiler"

    def _write(self, trainer: Trainer, report: ProfileReport, run_dir: Path) -> None:
        directory = self._directory(run_dir)
        suffix = "" if trainer.global_rank == 0 else f"-rank{trainer.global_rank}"
        try:
            directory.mkdir(parents=True, exist_ok=True)
            report.path = directory / f"{report.stage}{suffix}.txt"
            atomic_write(report.path, report.table() + "\n")
            data = {"stage": report.stage, "wall_s": report.wall_s, "actions": [asdict(a) for a in report.actions]}
            atomic_write(directory / f"{report.stage}{suffix}.json", json.dumps(data, indent=1) + "\n")
        except OSError as exc:
            print(f"ember: profiler: cannot write {directory}: {exc}", flush=True)

    # --- torch.profiler ---------------------------------------------------------------
    def _start_torch_profiler(self, trainer: Trainer) -> None:
        import torch
        from torch.profiler import ProfilerActivity, profile, record_function, schedule

        self._record_function = record_function
        activities = [ProfilerActivity.CPU]
        if torch.cuda.is_available() and trainer.strategy.root_device.type == "cuda":
            activities.append(ProfilerActivity.CUDA)
        c = self.config
        self._torch_profiler = profile(
            activities=activities,
            schedule=schedule(wait=c.wait, warmup=c.warmup, active=c.active, repeat=c.repeat),
            on_trace_ready=self._save_trace,
            record_shapes=c.record_shapes,
            profile_memory=c.profile_memory,
            with_stack=c.with_stack,
        )
        self._torch_profiler.__enter__()

    def _save_trace(self, prof: Any) -> None:
        assert self._trainer is not None
        directory = self._directory(self._trainer.run_dir)
        directory.mkdir(parents=True, exist_ok=True)
        rank = self._trainer.global_rank
        path = directory / f"trace-{self._stage}-rank{rank}-{len(self._traces)}.json"
        prof.export_chrome_trace(str(path))
        self._traces.append(path)

    def step(self) -> None:
        """One step of the trace window (the callback calls it after every training batch)."""
        if self._torch_profiler is not None:
            self._torch_profiler.step()

    def _stop_torch_profiler(self) -> None:
        if self._torch_profiler is not None:
            prof, self._torch_profiler = self._torch_profiler, None
            # Actions still open hold record_function ranges that must close inside the trace.
            for entry in reversed(self._stack):
                if entry[3] is not None:
                    entry[3].__exit__(None, None, None)
                    entry[3] = None
            prof.__exit__(None, None, None)


class _ProfilerCallback(Callback):
    """The profiler's view of the run: instruments at setup, marks the phases, steps the trace window."""

    def __init__(self, profiler: Profiler) -> None:
        self.profiler = profiler

    @property
    def state_key(self) -> str:
        return "Profiler"

    def setup(self, trainer: Trainer, module: TrainingModule, stage: str) -> None:
        self.profiler.instrument(trainer)

    def on_fit_start(self, trainer: Trainer, module: TrainingModule) -> None:
        self.profiler._phase(None)

    def on_fit_end(self, trainer: Trainer, module: TrainingModule) -> None:
        self.profiler._phase("teardown")

    def on_train_batch_end(
        self, trainer: Trainer, module: TrainingModule, outputs: Any, batch: Any, batch_idx: int
    ) -> None:
        self.profiler.step()

    def _eval_start(self, trainer: Trainer, stage: str) -> None:
        name = "sanity_check" if trainer.sanity_checking else _EVAL_ACTIONS[stage]
        if trainer.stage == "fit":
            self.profiler.start(name)
        else:
            self.profiler._phase(name)

    def _eval_end(self, trainer: Trainer) -> None:
        if trainer.stage == "fit":
            self.profiler.stop()
        else:
            self.profiler._phase("teardown")

    def on_validation_start(self, trainer: Trainer, module: TrainingModule) -> None:
        self._eval_start(trainer, "validation")

    def on_validation_end(self, trainer: Trainer, module: TrainingModule) -> None:
        self._eval_end(trainer)

    def on_test_start(self, trainer: Trainer, module: TrainingModule) -> None:
        self._eval_start(trainer, "test")

    def on_test_end(self, trainer: Trainer, module: TrainingModule) -> None:
        self._eval_end(trainer)

    def on_predict_start(self, trainer: Trainer, module: TrainingModule) -> None:
        self._eval_start(trainer, "predict")

    def on_predict_end(self, trainer: Trainer, module: TrainingModule) -> None:
        self._eval_end(trainer)

    def on_validation_batch_end(self, trainer: Trainer, module: TrainingModule, *args: Any, **kwargs: Any) -> None:
        if trainer.stage != "fit":
            self.profiler.step()

    on_test_batch_end = on_validation_batch_end
    on_predict_batch_end = on_validation_batch_end


def resolve_profiler(value: Any) -> Profiler | None:
    """A ``Trainer(profiler=...)`` value as a `Profiler`: None, "simple", "pytorch", a `ProfilerConfig`,
    a mapping of its fields (from YAML), or a `Profiler`."""
    if value is None or value is False:
        return None
    if isinstance(value, Profiler):
        return value
    if isinstance(value, ProfilerConfig):
        return Profiler(value)
    if isinstance(value, str):
        if value not in KINDS:
            raise ValueError(f"profiler={value!r}; choose 'simple', 'pytorch', a ProfilerConfig or None")
        return Profiler(ProfilerConfig(kind=value))
    if isinstance(value, dict):
        fields = ProfilerConfig.__dataclass_fields__
        unknown = [k for k in value if k not in fields]
        if unknown:
            raise ValueError(f"profiler: unknown option {unknown[0]!r}; ProfilerConfig takes: {', '.join(fields)}")
        return Profiler(ProfilerConfig(**value))
    raise TypeError(f"profiler must be 'simple', 'pytorch', a ProfilerConfig, a Profiler or None; got {value!r}")
