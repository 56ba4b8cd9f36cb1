"""Lightning's names and ember's counterparts: the tables `ember port` maps with, and `resolve`, which
finds the ember object for a Lightning dotted name in this installation (or the advice when there is none)."""

from __future__ import annotations

import importlib
from collections.abc import Sequence
from dataclasses import dataclass

ROOTS = ("lightning.pytorch", "pytorch_lightning", "lightning.fabric", "lightning")

#: Lower-case names of Lightning's subpackages and modules: in ``pl.callbacks.early_stopping.EarlyStopping``
#: every part up to the first name not in this set is a module, that name is the object.
# fmt: off
SUBMODULES = frozenset(
    [
        "accelerator", "accelerator_connector", "accelerators", "advanced", "amp", "argparse", "async_plugin",
        "automatic", "base", "batch_size_finder", "batch_size_scaling", "bitsandbytes", "boring_classes", "call",
        "callback", "callback_connector", "callbacks", "checkpoint", "checkpoint_connector", "checkpoint_plugin", "cli",
        "closure", "combined_loader", "comet", "compile", "configuration_validator", "connectors",
        "consolidate_checkpoint", "core", "cpu", "csv_logs", "cuda", "data", "data_connector", "datamodule", "ddp",
        "deepspeed", "demos", "device_stats_monitor", "distributed", "double", "early_stopping", "enums",
        "environments", "evaluation_loop", "exceptions", "fetchers", "finetuning", "fit_loop", "fsdp", "fx_validator",
        "gradient_accumulation_scheduler", "grads", "half", "hooks", "hparams_mixin", "hpu", "imports", "io",
        "lambda_function", "launcher", "launchers", "layer_sync", "litlogger", "logger", "logger_connector", "loggers",
        "loop", "loops", "lr_finder", "lr_monitor", "lstm", "manual", "memory", "migration", "mixins", "mlflow",
        "mnist_datamodule", "model_checkpoint", "model_helpers", "model_parallel", "model_registry", "model_summary",
        "model_summary_deepspeed", "module", "mps", "multiprocessing", "neptune", "on_exception_checkpoint",
        "optimization", "optimizer", "overrides", "parallel", "parameter_tying", "parsing", "plugins", "precision",
        "prediction_loop", "prediction_writer", "profiler", "profilers", "progress", "progress_bar", "pruning",
        "pytorch", "rank_zero", "result", "rich_model_summary", "rich_progress", "saving", "seed", "servable_module",
        "servable_module_validator", "serve", "setup", "signal_connector", "signature_utils", "simple", "single_device",
        "single_xla", "spike", "states", "stochastic_weight_avg", "strategies", "strategy", "subprocess_script",
        "tensorboard", "testing", "throughput_monitor", "timer", "torch_plugin", "tpu", "tqdm_progress", "trainer",
        "training_epoch_loop", "transformer", "transformer_engine", "tuner", "tuning", "types", "upgrade_checkpoint",
        "utilities", "utils", "wandb", "warnings", "weight_averaging", "wrapper", "xla", "xla_plugin", "fabric", "app",
        "store",
    ]
)
# fmt: on

#: Lightning subpackages whose ember counterpart has the same name.
PACKAGES = {"callbacks": "ember.callbacks", "loggers": "ember.loggers", "strategies": "ember.strategies"}

#: Lightning names ember has under another name: (Lightning package, name) -> ember name.
RENAMED = {
    ("", "LightningModule"): "TrainingModule",
    ("", "LightningDataModule"): "DataModule",
    ("callbacks", "TQDMProgressBar"): "ProgressLine",
    ("callbacks", "EMAWeightAveraging"): "EMA",
    ("loggers", "MLFlowLogger"): "MLflowLogger",
}

#: Names ember is growing: where they will live, tried in order at run time (mapped only once one exists).
PENDING = {
    "BaseFinetuning": ("ember.callbacks", "ember.utilities"),
    "rank_zero_only": ("ember.utilities",),
    "rank_zero_info": ("ember.utilities",),
    "rank_zero_warn": ("ember.utilities",),
    "rank_zero_debug": ("ember.utilities",),
    "cli_lightning_logo": ("ember.utilities",),
}

#: Lightning objects ember exports from a module other than the one `resolve` derives: name -> ember module.
ELSEWHERE = {"LightningOptimizer": "ember.modules"}

#: What to do about Lightning names ember has no counterpart for: "package.Name" (or "package." for a whole
#: package, or "Name" for a top-level name) -> advice.
UNSUPPORTED = {
    "strategies.DeepSpeedStrategy": "not supported; use strategy='fsdp'",
    "strategies.XLAStrategy": "not supported: ember runs on CPUs and CUDA GPUs",
    "strategies.SingleDeviceXLAStrategy": "not supported: ember runs on CPUs and CUDA GPUs",
    "strategies.SingleDeviceStrategy": "use Trainer(strategy='single_device') (the default on one device)",
    "strategies.ParallelStrategy": "ember's multi-process strategies are DDPStrategy, FSDPStrategy and "
    "ModelParallelStrategy (ember.strategies); to ask whether a run is distributed, read trainer.world_size > 1",
    "strategies.FSDPStrategy": "use ember.strategies.FSDPStrategy (FSDP2) or strategy='fsdp'",
    "strategies.": "pick a strategy by name: Trainer(strategy='ddp'|'fsdp'|'model_parallel') (docs/distributed.md)",
    "callbacks.StochasticWeightAveraging": "not supported: write a Callback",
    "callbacks.WeightAveraging": "not supported: ember.callbacks.EMA for an exponential average, else a Callback",
    "callbacks.GradientAccumulationScheduler": "not supported: write a Callback",
    "callbacks.ModelPruning": "not supported: write a Callback (torch.nn.utils.prune)",
    "callbacks.SpikeDetection": "not supported: write a Callback",
    "callbacks.OnExceptionCheckpoint": "not needed: preemption checkpoints are built in (Trainer(requeue_signal=))",
    "callbacks.BasePredictionWriter": "not supported: save the outputs of trainer.predict(...), or write a Callback",
    "callbacks.LambdaCallback": "not supported: subclass ember.Callback",
    "callbacks.RichModelSummary": "use ember.callbacks.ModelSummary (rich when it is installed)",
    "callbacks.DeviceStatsMonitor": "not the same: ember.callbacks.GradientMonitor and ThroughputMonitor",
    "callbacks.LearningRateFinder": "use the function ember.tuning.lr_find(trainer, module, ...)",
    "callbacks.BatchSizeFinder": "use the function ember.tuning.scale_batch_size(trainer, module, ...)",
    "callbacks.ProgressBar": "subclass ember.Callback; ProgressLine and RichProgressBar are ember's bars",
    "callbacks.Checkpoint": "subclass ember.callbacks.ModelCheckpoint or ember.Callback",
    "loggers.CometLogger": "not supported: subclass ember.loggers.Logger",
    "loggers.NeptuneLogger": "not supported: subclass ember.loggers.Logger",
    "loggers.LitLogger": "not supported: subclass ember.loggers.Logger",
    "utilities.types.": "Lightning's type aliases: annotate with typing.Any, torch.Tensor or a dict",
    "utilities.imports.": "Lightning's private availability flags: try the import yourself",
    "utilities.model_helpers.get_torchvision_model": "call torchvision.models.get_model(name, weights=...)",
    "utilities.": "not in ember: keep a copy of what you use",
    "Fabric": "ember has no Fabric: use TrainingModule and Trainer, or plain PyTorch",
    "fabric.": "ember has no Fabric: use TrainingModule and Trainer, or plain PyTorch",
    "cli.LightningCLI": "use the ember command: `ember fit -c config.yaml` (docs/cli.md)",
    "cli.": "use the ember command: `ember fit -c config.yaml` (docs/cli.md)",
    "tuner.Tuner": "use ember.tuning.lr_find(trainer, module, ...) and ember.tuning.scale_batch_size",
    "tuner.": "use ember.tuning.lr_find(trainer, module, ...) and ember.tuning.scale_batch_size",
    "plugins.": "precision is Trainer(precision=...); cluster environments are detected (torchrun, SLURM)",
    "profilers.": "use Trainer(profiler='simple'|'pytorch') (docs/tuning.md)",
    "accelerators.": "use Trainer(accelerator='cpu'|'cuda')",
    "loops.": "ember's loops are not pluggable: use hooks or manual optimization",
    "demos.": "Lightning's demo code, not an API: copy what you use into your project (and port it)",
    "serve.": "not supported: see docs/export.md for inference artifacts",
    "app.": "not supported",
}

#: Lightning 1.x hooks (Lightning 2 refuses them too) a ported module should rename, with what to use.
REMOVED_METHODS = {
    "training_epoch_end": "Lightning 2 removed it: use on_train_epoch_end and keep the outputs yourself",
    "validation_epoch_end": "Lightning 2 removed it: use on_validation_epoch_end and keep the outputs yourself",
    "test_epoch_end": "Lightning 2 removed it: use on_test_epoch_end and keep the outputs yourself",
    "training_step_end": "Lightning 2 removed it: do the work in training_step",
    "validation_step_end": "Lightning 2 removed it: do the work in validation_step",
    "test_step_end": "Lightning 2 removed it: do the work in test_step",
}

#: Trainer keywords of Lightning that ember does not take, with what to do instead.
TRAINER_KEYWORDS = {
    "gpus": "use accelerator='cuda', devices=N",
    "tpu_cores": "not supported: ember runs on CPUs and CUDA GPUs",
    "auto_select_gpus": "use devices=N (or CUDA_VISIBLE_DEVICES)",
    "plugins": "precision is Trainer(precision=...); cluster environments are detected",
    "barebones": "not needed: ember skips hooks nobody implements (docs/trainer.md)",
    "enable_autolog_hparams": "hyperparameters always go to the loggers",
    "model_registry": "not supported",
}

#: Trainer accelerators of Lightning that ember names otherwise or lacks.
ACCELERATORS = {
    "mps": "not supported: use 'cpu'",
    "tpu": "not supported",
    "hpu": "not supported",
}

#: Base classes whose subclasses get their method names checked.
MODULE_BASES = {"TrainingModule", "DataModule"}
CALLBACK_BASES = {"Callback"}


UTILITIES_ADVICE = "lightning_utilities is installed with Lightning: keep it as a dependency or replace the helper"


def _exports(module: str) -> frozenset[str]:
    """The public names of an ember module in this installation (empty when it does not exist)."""
    try:
        mod = importlib.import_module(module)
    except ImportError:
        return frozenset()
    names = getattr(mod, "__all__", None)
    if names is None:
        names = [n for n in vars(mod) if not n.startswith("_")]
    return frozenset(names)


@dataclass(frozen=True)
class Target:
    """An ember object (``module`` and ``name``) or, with ``name`` None, an ember module."""

    module: str
    name: str | None = None

    @property
    def dotted(self) -> str:
        """``ember.callbacks.EarlyStopping``, or the module's name."""
        return self.module if self.name is None else f"{self.module}.{self.name}"


def split_lightning(qualname: str) -> list[str] | None:
    """The parts of a Lightning dotted name below ``lightning.pytorch`` (``["callbacks", "EarlyStopping"]``),
    with ``["fabric", ...]`` for ``lightning.fabric``; None when the name is not Lightning's."""
    for root in ROOTS:
        if qualname == root or qualname.startswith(root + "."):
            rest = qualname[len(root) + 1 :].split(".") if qualname != root else []
            if root == "lightning.fabric":
                return ["fabric", *rest]
            if root == "lightning" and rest[:1] == ["pytorch"]:
                return rest[1:]
            return rest
    return None


def _advice(parts: Sequence[str]) -> str:
    """The `UNSUPPORTED` entry for a Lightning name: the name itself, then a pending name, then its package."""
    for key in (".".join(parts), f"{parts[0]}.{parts[-1]}", parts[-1]):
        if key in UNSUPPORTED:
            return UNSUPPORTED[key]
    if parts and parts[-1] in PENDING:
        return f"not in ember yet (planned for {' or '.join(PENDING[parts[-1]])}); the Lightning import stays"
    for i in range(len(parts) - 1, 0, -1):
        key = ".".join(parts[:i]) + "."
        if key in UNSUPPORTED:
            return UNSUPPORTED[key]
    return "ember has no counterpart; the Lightning import stays: rewrite this part"


def resolve(parts: Sequence[str]) -> Target | str:
    """The ember target of a Lightning name given as `split_lightning` parts, or the advice when there is none.

    ``[]`` is the package itself (``ember``); a subpackage maps to ember's same-named one; an object maps when
    ember exports it here, under its own or its `RENAMED` name.
    """
    if parts[:1] == ["pytorch"]:  # ``import lightning as L; L.pytorch.X``
        parts = parts[1:]
    if not parts:
        return Target("ember")
    if is_module(parts):  # a module: only the packages ember has
        if len(parts) == 1 and parts[0] in PACKAGES:
            return Target(PACKAGES[parts[0]])
        if parts == ["utilities"] and _exports("ember.utilities"):
            return Target("ember.utilities")
        return _advice(parts)
    name = parts[-1]
    if name.startswith("__"):  # pl.__version__, pl.__file__: about Lightning's package itself
        return "an attribute of Lightning's own package: nothing of ember's corresponds"
    if name in ELSEWHERE and name in _exports(ELSEWHERE[name]):
        return Target(ELSEWHERE[name], name)
    if name in PENDING:
        for module in PENDING[name]:
            if name in _exports(module):
                return Target(module, name)
        return _advice(parts)
    package = parts[0] if parts[0] in (*PACKAGES, "utilities") else ""
    if package == "" and parts[0] not in ("core", "trainer") and len(parts) > 1:
        return _advice(parts)  # plugins, cli, demos, fabric, ...: no object of theirs maps
    ember_name = RENAMED.get((package, name), name)
    module = "ember.utilities" if package == "utilities" else PACKAGES.get(package, "ember")
    if ember_name in _exports(module):
        return Target(module, ember_name)
    return _advice(parts)


def qualified(parts: Sequence[str]) -> list[str]:
    """``["callbacks", "X"]`` -> ``["lightning", "pytorch", "callbacks", "X"]`` (the name as users write it)."""
    if parts[:1] == ["fabric"]:
        return ["lightning", *parts]
    return ["lightning", "pytorch", *parts]


def is_module(parts: Sequence[str]) -> bool:
    """Whether Lightning parts name a module (``[]``, ``["callbacks"]``, ``["callbacks", "early_stopping"]``)."""
    return all(p in SUBMODULES for p in parts)
