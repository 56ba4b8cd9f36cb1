"""The `Trainer`'s options: one frozen, typed object, checked and normalised before any work.

`TrainerOptions` lists every keyword of `ember.Trainer` with its default; the YAML schema's
``trainer`` section (`ember.config.schema.TrainerConfig`) is derived from it, so the two cannot drift.
`build` checks each value (an error names the option and the fix) and normalises: ``fast_dev_run``
applied, ``max_epochs`` defaulted, ``gradient_clip_val=0`` read as no clipping, the requeue signal
resolved. Objects built from options (the strategy, the profiler) are the Trainer's.
"""

from __future__ import annotations

import dataclasses
import os
from dataclasses import dataclass
from datetime import timedelta
from typing import Any

import torch

from ember.callbacks.timer import parse_duration
from ember.checkpoint.store import check_url, is_url
from ember.hints import did_you_mean
from ember.strategies.precision import resolve_precision
from ember.strategies.strategy import Strategy
from ember.trainer.data import check_limit
from ember.trainer.signals import resolve_signal

_ACCELERATORS = ("auto", "cpu", "cuda")
#: Other names of an accelerator: Lightning's ``"gpu"`` is ember's ``"cuda"``.
_ACCELERATOR_ALIASES = {"gpu": "cuda"}


@dataclass(frozen=True)
class TrainerOptions:
    """Every `ember.Trainer` keyword (docs/trainer.md); fields typed ``Any`` take Python objects as well
    (callbacks, loggers, a strategy, a ``timedelta``)."""

    max_epochs: int | None = None
    min_epochs: int | None = None
    max_steps: int = -1
    min_steps: int | None = None
    max_time: Any = None  # seconds, "DD:HH:MM:SS", a timedelta or a dict of timedelta fields
    accelerator: str = "auto"
    devices: int | str = "auto"
    strategy: Any = "auto"  # a name or a Strategy
    num_nodes: int = 1
    precision: str | int = "32-true"
    accumulate_grad_batches: int = 1
    gradient_clip_val: float | None = None
    gradient_clip_algorithm: str = "norm"
    val_check_interval: float | int = 1.0
    check_val_every_n_epoch: int = 1
    num_sanity_val_steps: int = 2
    limit_train_batches: float | int = 1.0
    limit_val_batches: float | int = 1.0
    limit_test_batches: float | int = 1.0
    limit_predict_batches: float | int = 1.0
    overfit_batches: float | int = 0.0
    reload_dataloaders_every_n_epochs: int = 0
    log_every_n_steps: int = 50
    callbacks: Any = None  # a Callback or a list of them
    logger: Any = True  # True, False, a Logger or a list of them
    enable_progress_bar: bool = True
    enable_model_summary: bool = True
    enable_checkpointing: bool = True
    default_root_dir: str = "runs"
    run_name: str | None = None
    requeue_signal: str | int | None = "SIGUSR1"
    deterministic: bool = False
    benchmark: bool | None = None
    inference_mode: bool = False
    sync_batchnorm: bool = False
    fast_dev_run: bool | int = False
    detect_anomaly: bool = False
    use_distributed_sampler: bool = True
    nonfinite_loss: str | None = None
    compile: Any = False  # True, False, or a mapping of torch.compile keywords
    profiler: Any = None  # "simple", "pytorch", a ProfilerConfig, a Profiler, or a mapping
    tune_cpu_allocator: bool = True  # glibc mmap/trim thresholds when a run starts (ember/strategies/allocator.py)
    lightning_rng: bool = False  # validation in fit draws from the global RNG as Lightning's does (port checks)
    logger_timeout_s: float = 5.0  # the longest a logger call may take before ember stops waiting for it

    @property
    def max_time_s(self) -> float | None:
        """``max_time`` in seconds (None: no budget)."""
        return parse_max_time(self.max_time)

    @property
    def compile_options(self) -> dict[str, Any] | None:
        """``compile`` as torch.compile keywords; None when compiling is off."""
        return compile_options(self.compile)


#: The option names, in the order of the Trainer's signature.
NAMES = tuple(field.name for field in dataclasses.fields(TrainerOptions))


class OptionAttribute:
    """``trainer.<name>`` reads ``trainer.options.<name>``: a class attribute, so the read is one lookup and no
    failed one (hooks may read options every step). It only has ``__get__``, so an attribute the Trainer sets on
    itself under the same name wins."""

    def __init__(self, name: str) -> None:
        self.name = name

    def __get__(self, trainer: Any, owner: type | None = None) -> Any:
        if trainer is None:
            return self
        return getattr(trainer.options, self.name)


def expose(cls: type) -> None:
    """Give `cls` (the Trainer) an `OptionAttribute` for every option it does not define itself."""
    for name in NAMES:
        if name not in vars(cls):
            setattr(cls, name, OptionAttribute(name))


def build(given: dict[str, Any]) -> TrainerOptions:
    """Check every option in `given` (the Trainer's keywords) and return them normalised."""
    options = TrainerOptions(**given)
    check(options)
    changes: dict[str, Any] = {
        "default_root_dir": os.fspath(options.default_root_dir),
        "gradient_clip_val": options.gradient_clip_val or None,  # 0: no clipping, as in Lightning
        "requeue_signal": resolve_signal(options.requeue_signal),
        "callbacks": _as_list(options.callbacks),
        "accelerator": _ACCELERATOR_ALIASES.get(options.accelerator, options.accelerator),
    }
    if options.overfit_batches:  # the same few training batches, unshuffled, for training and validation
        changes.update(limit_train_batches=options.overfit_batches, limit_val_batches=options.overfit_batches)
    if options.fast_dev_run:
        n = 1 if options.fast_dev_run is True else int(options.fast_dev_run)
        check_positive_int("fast_dev_run", n)
        changes.update(max_epochs=1, max_steps=n, num_sanity_val_steps=0, val_check_interval=1.0, logger=False,
                       enable_checkpointing=False, limit_train_batches=n, limit_val_batches=n,
                       limit_test_batches=n, limit_predict_batches=n)  # fmt: skip
    elif options.max_epochs is None and options.max_steps == -1:
        changes["max_epochs"] = 1000
    return dataclasses.replace(options, **changes)


def _as_list(callbacks: Any) -> list[Any]:
    from ember.callbacks.callback import Callback

    return [callbacks] if isinstance(callbacks, Callback) else list(callbacks or [])


def check(options: TrainerOptions) -> None:
    """Raise on the first bad value, with a message that names the option and the fix."""
    check_positive_int("accumulate_grad_batches", options.accumulate_grad_batches)
    check_positive_int("log_every_n_steps", options.log_every_n_steps)
    check_positive_int("check_val_every_n_epoch", options.check_val_every_n_epoch)
    for name in ("limit_train_batches", "limit_val_batches", "limit_test_batches", "limit_predict_batches"):
        check_limit(name, getattr(options, name))
    if options.gradient_clip_algorithm not in ("norm", "value"):
        raise ValueError(f"gradient_clip_algorithm={options.gradient_clip_algorithm!r}; choose 'norm' or 'value'")
    check_val_check_interval(options.val_check_interval)
    if not isinstance(options.tune_cpu_allocator, bool):
        raise TypeError(f"tune_cpu_allocator={options.tune_cpu_allocator!r} must be True or False")
    timeout = options.logger_timeout_s
    if isinstance(timeout, bool) or not isinstance(timeout, (int, float)) or not timeout > 0:
        raise ValueError(f"logger_timeout_s={timeout!r} must be a number of seconds > 0 (default 5)")
    if not isinstance(options.lightning_rng, bool):
        raise TypeError(f"lightning_rng={options.lightning_rng!r} must be True or False")
    clip = options.gradient_clip_val
    if clip is not None and (isinstance(clip, bool) or not isinstance(clip, (int, float)) or clip < 0):
        raise ValueError(f"gradient_clip_val={clip!r} must be a number >= 0 (0 or None: no clipping)")
    steps = options.num_sanity_val_steps
    if isinstance(steps, bool) or not isinstance(steps, int) or steps < -1:
        raise ValueError(f"num_sanity_val_steps={steps!r}: use a batch count >= 0, or -1 for all")
    parse_max_time(options.max_time)
    compile_options(options.compile)
    for name in ("min_epochs", "min_steps"):
        value = getattr(options, name)
        if value is not None and (isinstance(value, bool) or not isinstance(value, int) or value < 0):
            raise ValueError(f"{name}={value!r} must be an int >= 0 (or None)")
    check_limit("overfit_batches", options.overfit_batches)
    reload = options.reload_dataloaders_every_n_epochs
    if isinstance(reload, bool) or not isinstance(reload, int) or reload < 0:
        raise ValueError(f"reload_dataloaders_every_n_epochs={reload!r} must be an int >= 0 (0: never)")
    if is_url(options.default_root_dir):  # a run on a store (`ember.checkpoint.run_store`): no credentials in it
        check_url(str(options.default_root_dir), "default_root_dir")
    if options.benchmark and options.deterministic:
        raise ValueError(
            "benchmark=True lets cuDNN pick kernels by timing them, which deterministic=True forbids; drop one"
        )


def check_positive_int(name: str, value: Any) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ValueError(f"{name} must be a positive int; got {value!r}")


def check_val_check_interval(value: Any) -> None:
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise TypeError(
            f"val_check_interval must be a fraction of an epoch (float) or a batch count (int); got {value!r}"
        )
    if isinstance(value, float) and not 0.0 < value <= 1.0:
        raise ValueError(f"val_check_interval={value}: a fraction must lie in (0, 1]; use an int for a batch count")
    if isinstance(value, int) and value < 1:
        raise ValueError(f"val_check_interval={value}: a batch count must be at least 1")


def parse_max_time(value: float | str | timedelta | dict[str, int] | None) -> float | None:
    """``max_time`` in seconds (None: no budget); see `ember.callbacks.timer.parse_duration`."""
    return None if value is None else parse_duration(value, f"max_time={value!r}")


_STRATEGIES = ("auto", "single_device", "ddp", "fsdp", "model_parallel")


def resolve_strategy(options: TrainerOptions) -> Strategy:
    """Build the strategy the options describe; ``"auto"`` is DDP when more than one process runs.

    ``"model_parallel"`` is `ModelParallelStrategy` with both sizes ``"auto"`` (tensor parallel within each
    node, data parallel across nodes); pass an instance (or a ``_target_`` section) for other sizes.
    """
    return _strategy(
        options.strategy, options.accelerator, options.devices, options.num_nodes, options.precision,
        options.use_distributed_sampler,
    )  # fmt: skip


def _strategy(
    strategy: str | Strategy,
    accelerator: str,
    devices: int | str,
    num_nodes: int,
    precision: str | int,
    use_distributed_sampler: bool,
) -> Strategy:
    from ember.strategies.ddp import DDPStrategy
    from ember.strategies.environment import detect
    from ember.strategies.fsdp import FSDPStrategy
    from ember.strategies.parallel import ParallelStrategy

    if accelerator not in _ACCELERATORS:
        raise ValueError(
            f"accelerator={accelerator!r} is not valid; choose one of: {', '.join(_ACCELERATORS)} ('gpu' is 'cuda')"
        )
    if accelerator == "cuda" and not torch.cuda.is_available():
        raise RuntimeError("accelerator='cuda' but CUDA is not available here; use accelerator='cpu' or 'auto'")
    check_positive_int("num_nodes", num_nodes)
    use_cuda = accelerator == "cuda" or (accelerator == "auto" and torch.cuda.is_available())
    if devices == "auto":
        cluster = detect()
        # The launcher's processes per node; a num_nodes that disagrees is reported in setup_environment.
        count = max(cluster.world_size // max(cluster.num_nodes, 1), 1) if cluster.kind != "single" else 1
    elif isinstance(devices, int) and not isinstance(devices, bool) and devices >= 1:
        count = devices
    elif isinstance(devices, str) and devices.isdigit() and int(devices) >= 1:
        count = int(devices)
    else:
        raise ValueError(f"devices={devices!r}: use a positive number of processes (devices=1 is one device) or 'auto'")
    launched = detect().kind != "single"
    # ember starts `count` processes on this machine, one GPU each. Under a launcher each process may see only
    # the GPU bound to it (SLURM --gpus-per-task=1): setup_environment checks this process's own device.
    if use_cuda and not launched and count > torch.cuda.device_count():
        raise ValueError(f"devices={count} but this machine has {torch.cuda.device_count()} CUDA device(s)")
    plugin = resolve_precision(precision)
    if isinstance(strategy, str) and strategy not in _STRATEGIES:
        raise ValueError(
            f"strategy={strategy!r} is not valid; choose one of: {', '.join(_STRATEGIES)} or a Strategy instance"
        )
    if strategy == "auto":
        strategy = "ddp" if count * num_nodes > 1 or launched else "single_device"
    if strategy == "single_device":
        if count * num_nodes > 1:
            raise ValueError(f"strategy='single_device' runs one process; devices={devices}, num_nodes={num_nodes}")
        return Strategy("cuda:0" if use_cuda else "cpu", plugin)
    if strategy == "model_parallel":
        from ember.strategies.model_parallel import ModelParallelStrategy

        strategy = ModelParallelStrategy()  # one TP group per node; a Strategy instance sets the sizes
    elif isinstance(strategy, str):
        strategy = DDPStrategy() if strategy == "ddp" else FSDPStrategy()
    if isinstance(strategy, ParallelStrategy):
        strategy.configure(
            plugin,
            devices=count,
            num_nodes=num_nodes,
            accelerator=accelerator,
            use_distributed_sampler=use_distributed_sampler,
        )
    else:
        strategy.configure(plugin, accelerator=accelerator)  # a device it was built with must agree
    return strategy


_COMPILE_KEYS = ("mode", "fullgraph", "dynamic", "backend", "options")
_COMPILE_MODES = ("default", "reduce-overhead", "max-autotune", "max-autotune-no-cudagraphs")


def compile_options(value: bool | dict[str, Any]) -> dict[str, Any] | None:
    """``compile=True`` -> {} (torch.compile defaults); a dict is checked key by key; False -> None."""
    if value is False or value is None:
        return None
    if value is True:
        return {}
    if not isinstance(value, dict):
        raise TypeError(f"compile must be True, False or a dict of torch.compile options; got {value!r}")
    for key in value:
        if key not in _COMPILE_KEYS:
            hint = did_you_mean(str(key), _COMPILE_KEYS, f"valid: {', '.join(_COMPILE_KEYS)}")
            raise ValueError(f"compile: unknown option {key!r}; {hint}")
    if value.get("mode", "default") not in _COMPILE_MODES:
        raise ValueError(f"compile: mode={value['mode']!r}; choose one of: {', '.join(_COMPILE_MODES)}")
    return dict(value)
