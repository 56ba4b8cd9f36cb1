"""`TrainingModule`: the model, its loss, its optimizers and its step hooks.

A module that declares ``self.model`` and ``self.loss_fn`` (and optionally a
``self.metrics`` dict of torchmetrics) trains on ``(inputs, target)`` batches
without writing any step: the default steps compute
``loss_fn(self(inputs), target)`` and log ``train/loss``, ``val/loss``,
``test/loss`` and ``val/<metric>``/``test/<metric>``. Override any step to do
something else.

A module may also define any hook of `ember.Callback`, without the
``trainer, module`` arguments (``def on_train_epoch_end(self): ...``).
"""

from __future__ import annotations

import functools
import inspect
import os
import warnings
from collections.abc import Callable, Mapping
from typing import TYPE_CHECKING, Any

import torch
from torch import Tensor, nn
from typing_extensions import Self

from ember.modules.data_hooks import DataHooks
from ember.modules.export_methods import ExportMethod
from ember.modules.freezing import freeze, unfreeze
from ember.modules.hparams import AttributeDict, init_args_to_record
from ember.modules.manual import ManualOptimization

if TYPE_CHECKING:
    from ember.trainer.trainer import Trainer


class TrainingModule(DataHooks, ManualOptimization):
    """Base class for everything ember trains. See the module docstring for the defaults."""

    #: Set to False to drive optimizers yourself in `training_step` (GANs and friends).
    automatic_optimization: bool = True
    #: An example input (e.g. ``torch.zeros(1, 64)``) used by summaries and exports.
    example_input_array: Any = None
    #: ``{"optimizer": {_target_, kwargs}, "lr_scheduler": {...} | None}`` from a YAML config (set by
    #: ``ember fit``); the default `configure_optimizers` builds it.
    optimizer_config: dict[str, Any] | None = None

    def __init__(self) -> None:
        super().__init__()
        self._trainer: Trainer | None = None
        self._hparams = AttributeDict()
        self._hparams_to_loggers = True
        self._warned_no_trainer = False

    def __init_subclass__(cls, **kwargs: Any) -> None:
        """A step defined with fewer parameters than ember passes (``training_step(self, batch)``, as in
        Lightning's own examples) gets only those: ember, like Lightning, reads the step's signature."""
        super().__init_subclass__(**kwargs)
        for name in _STEPS:
            step = cls.__dict__.get(name)
            if inspect.isfunction(step):
                adapted = _fitted_to_signature(step)
                if adapted is not step:
                    setattr(cls, name, adapted)

    def __setattr__(self, name: str, value: Any) -> None:
        # `self.metrics = {"acc": Accuracy(...)}` becomes a ModuleDict so the
        # metrics move with the module to its device.
        if name == "metrics" and isinstance(value, Mapping) and not isinstance(value, nn.ModuleDict):
            value = nn.ModuleDict(dict(value))
        super().__setattr__(name, value)

    # --- attachment -----------------------------------------------------------
    @property
    def trainer(self) -> Trainer:
        """The `Trainer` running this module; an error outside fit/validate/test/predict."""
        if self._trainer is None:
            raise RuntimeError(
                f"{type(self).__qualname__} is not attached to a Trainer; "
                "pass it to trainer.fit/validate/test/predict first."
            )
        return self._trainer

    @trainer.setter
    def trainer(self, trainer: Trainer | None) -> None:
        """Attach the module to `trainer` (each run does; None detaches it), as Lightning's ``module.trainer``."""
        self._trainer = trainer

    @property
    def has_trainer(self) -> bool:
        """Whether a `Trainer` has run (or runs) this module."""
        return self._trainer is not None

    @property
    def hparams_to_loggers(self) -> bool:
        """Whether the loggers get `hparams` (``save_hyperparameters(logger=False)`` says no)."""
        return self._hparams_to_loggers

    @property
    def on_gpu(self) -> bool:
        """Whether the module runs on a CUDA device (Lightning's ``self.on_gpu``)."""
        return self.device.type == "cuda"

    @property
    def device(self) -> torch.device:
        """The device the module's parameters live on."""
        if self._trainer is not None:
            return self._trainer.strategy.root_device
        param = next(self.parameters(), None)
        return param.device if param is not None else torch.device("cpu")

    @property
    def logger(self) -> Any:
        """The trainer's first logger (``self.logger.experiment`` is the back end's own object), or None."""
        return self._trainer.logger if self._trainer is not None else None

    @property
    def loggers(self) -> list[Any]:
        """The trainer's loggers (empty outside a trainer, and on processes other than 0)."""
        return list(self._trainer.loggers) if self._trainer is not None else []

    def print(self, *args: Any, **kwargs: Any) -> None:
        """``print`` on process 0 only (every process prints outside a trainer)."""
        if self._trainer is None or self._trainer.is_global_zero:
            print(*args, **kwargs)

    @property
    def global_step(self) -> int:
        """Number of optimizer steps taken so far (0 outside a trainer)."""
        return self._trainer.global_step if self._trainer is not None else 0

    @property
    def current_epoch(self) -> int:
        """Index of the current training epoch, starting at 0 (0 outside a trainer)."""
        return self._trainer.current_epoch if self._trainer is not None else 0

    # --- checkpoints ---------------------------------------------------------------
    @classmethod
    def load_from_checkpoint(cls, path: str | os.PathLike[str], **overrides: Any) -> Self:
        """Rebuild the module from a checkpoint's saved hyperparameters and load its weights.

        `path` is a checkpoint directory or a run's ``checkpoints/last`` file (the checkpoint it names).

        ``overrides`` replace saved hyperparameters (or supply ones that were
        not saved, e.g. a backbone passed with ``ignore=``). The module is
        returned in eval mode, on the CPU. Nothing in the checkpoint is executed:
        it is read with ``weights_only`` semantics.
        """
        from pathlib import Path

        from ember import checkpoint
        from ember.checkpoint.hparams import from_checkpoint

        where = Path(path)
        if where.name == checkpoint.LAST_FILE:  # a run's ``checkpoints/last`` file: the checkpoint it names
            where = checkpoint.resolve_path(where)
        meta, weights = checkpoint.read_module_state(where)
        kwargs = from_checkpoint(meta.get("hparams", {}), overrides, cls.__qualname__)
        try:
            module = cls(**kwargs)
        except TypeError as exc:
            raise TypeError(
                f"cannot rebuild {cls.__qualname__} from checkpoint {where} (saved from {meta.get('module_class')}): "
                f"{exc}. Pass the missing arguments to load_from_checkpoint(path, name=value)"
            ) from None
        checkpoint.load_weights_into(module, weights, where, meta.get("module_class"))
        return module.eval()

    def save_weights(self, path: str | os.PathLike[str]) -> None:
        """One-file export of the weights (a ``torch.save``d state dict), written atomically."""
        from pathlib import Path

        from ember import checkpoint

        checkpoint.save_weights(Path(path), self.state_dict())

    # --- freezing ----------------------------------------------------------------
    def freeze(self) -> Self:
        """Stop training every parameter (``requires_grad=False``) and switch to eval mode.

        Eval mode matters for BatchNorm and Dropout: a frozen backbone should
        neither update its running statistics nor drop activations. Returns the
        module, so ``backbone.freeze()`` chains.
        """
        freeze(self)
        return self

    def unfreeze(self) -> Self:
        """Undo `freeze`: every parameter trains again and the module is in train mode."""
        unfreeze(self)
        return self

    # --- hyperparameters --------------------------------------------------------
    @property
    def hparams(self) -> AttributeDict:
        """Hyperparameters recorded by `save_hyperparameters`."""
        return self._hparams

    def save_hyperparameters(self, *names: str, ignore: list[str] | tuple[str, ...] = (), logger: bool = True) -> None:
        """Record the arguments of the calling ``__init__`` in `self.hparams`.

        ``self.save_hyperparameters()`` records all of them; pass names to keep
        only those, or ``ignore=[...]`` to drop some (e.g. a backbone module).
        The hyperparameters go into checkpoints and to the loggers. Checkpoints hold plain data: a class or a
        function is held by its import path (found again when the checkpoint is loaded in a process that has
        imported it); any other object (a module, an optimizer...) is not held, with a warning, and
        `load_from_checkpoint` asks for it as a keyword. ``logger=False`` keeps them from the loggers (they still go
        into checkpoints), as in Lightning.
        """
        frame = inspect.currentframe()
        recorded = init_args_to_record(self, frame.f_back if frame is not None else None, names, ignore)
        self._hparams.update(recorded)
        self._hparams_to_loggers = logger
        from ember.checkpoint.hparams import not_saved

        for key, kind in not_saved(recorded).items():
            warnings.warn(
                f"save_hyperparameters: {key!r} is a {kind}, not plain data: it stays in self.hparams but checkpoints "
                f"do not hold it, so load_from_checkpoint needs it again (load_from_checkpoint(path, {key}=...)); "
                f"pass ignore=[{key!r}] to leave it out",
                UserWarning,
                stacklevel=2,
            )

    # --- logging ------------------------------------------------------------------
    def log(
        self,
        name: str,
        value: Any,
        prog_bar: bool = False,
        logger: bool | None = None,
        on_step: bool | None = None,
        on_epoch: bool | None = None,
        reduce_fx: str | Callable[..., Any] = "mean",
        enable_graph: bool = False,
        sync_dist: bool = False,
        sync_dist_group: Any = None,
        add_dataloader_idx: bool = True,
        batch_size: int | None = None,
        metric_attribute: str | None = None,
        rank_zero_only: bool = False,
    ) -> None:
        """Record a value: a number, a scalar tensor or a torchmetrics `Metric`.

        The parameters are Lightning's, in Lightning's order. Training steps default to
        ``on_step=True, on_epoch=False``; validation and test steps to ``on_step=False, on_epoch=True``.
        Epoch values are means weighted by batch size (taken from the batch, or ``batch_size``) unless
        ``reduce_fx`` is "sum", "max" or "min" (or ``torch.sum``, ``torch.max``, ``torch.min``). A `Metric`
        is computed and reset at epoch end. When both ``on_step`` and ``on_epoch`` are set the values appear
        as ``name_step`` and ``name_epoch``. ``prog_bar`` shows the value in the progress bar;
        ``logger=False`` keeps it out of the loggers (it stays in ``trainer.callback_metrics``).
        ``sync_dist`` reduces epoch values over all processes. ``enable_graph`` keeps the step value attached
        to the autograd graph. ``add_dataloader_idx=False`` drops the ``/dataloader_idx_N`` suffix of
        evaluation with several dataloaders (names must then differ). ``rank_zero_only=True`` says the call
        happens on process 0 only: other processes ignore it (it cannot be synced). ``metric_attribute`` is
        accepted for Lightning code and not needed: a `Metric` logged here is found without it.
        ``sync_dist_group`` is not supported (ember syncs over every process). Values stay tensors;
        nothing here waits for the device.
        """
        trainer = self._trainer
        if trainer is None:
            if not self._warned_no_trainer:
                warnings.warn(f"self.log({name!r}) outside a Trainer is ignored", RuntimeWarning, stacklevel=2)
                self._warned_no_trainer = True
            return
        if sync_dist_group is not None or rank_zero_only:
            if sync_dist_group is not None:
                raise ValueError(
                    f"self.log({name!r}, sync_dist_group=...): ember syncs logged values over every process; "
                    "drop sync_dist_group, or log a torchmetrics.Metric built with process_group=..."
                )
            if sync_dist:
                raise ValueError(
                    f"self.log({name!r}, rank_zero_only=True, sync_dist=True): a value logged on process 0 only "
                    "cannot be synced across processes; drop one of them"
                )
            if not trainer.is_global_zero:
                return
        trainer.reporter.collector.log(
            name, value, prog_bar, logger, on_step, on_epoch, reduce_fx, enable_graph, sync_dist, add_dataloader_idx,
            batch_size,
        )  # fmt: skip

    def log_dict(self, values: Mapping[str, Any], *args: Any, **kwargs: Any) -> None:
        """Call `log` for every item of `values` with the same options (positional ones in `log`'s order)."""
        for name, value in values.items():
            self.log(name, value, *args, **kwargs)

    # --- the model ----------------------------------------------------------------
    def forward(self, *args: Any, **kwargs: Any) -> Any:
        """Defaults to ``self.model(*args)``; override for anything else."""
        model = self.__dict__.get("_modules", {}).get("model")
        if model is None:
            raise NotImplementedError(f"{type(self).__qualname__} has no forward: define forward(), or set self.model")
        return model(*args, **kwargs)

    def configure_optimizers(self) -> Any:
        """Return an optimizer, a list of them, or ``{"optimizer", "lr_scheduler"}`` dicts.

        See `ember.modules.optimizers` for every accepted form. Without an override, the optimizer
        and scheduler of `optimizer_config` (a YAML config's ``optimizer`` and ``lr_scheduler``
        sections) are built over ``self.parameters()``.
        """
        if self.optimizer_config is not None:
            from ember.config import build_optimizers

            return build_optimizers(self.parameters(), self.optimizer_config)
        raise NotImplementedError(
            f"{type(self).__qualname__} does not define configure_optimizers(); add one, e.g. "
            "`def configure_optimizers(self): return torch.optim.AdamW(self.parameters(), lr=1e-3)`"
        )

    # --- default steps --------------------------------------------------------------
    def training_step(self, batch: Any, batch_idx: int) -> Any:
        """Default: ``loss_fn(self(inputs), target)``, logged as ``train/loss``.

        Return a scalar loss tensor, a dict with a ``"loss"`` entry, or None to
        skip the optimizer step for this batch.
        """
        loss, _, _ = self._default_forward(batch, "training_step")
        self.log("train/loss", loss, prog_bar=True)
        return loss

    def validation_step(self, batch: Any, batch_idx: int, dataloader_idx: int = 0) -> Any:
        """Default: logs ``val/loss`` and every metric in ``self.metrics`` as ``val/<name>``."""
        return self._default_eval_step("val", batch, dataloader_idx)

    def test_step(self, batch: Any, batch_idx: int, dataloader_idx: int = 0) -> Any:
        """Default: logs ``test/loss`` and every metric in ``self.metrics`` as ``test/<name>``."""
        return self._default_eval_step("test", batch, dataloader_idx)

    def predict_step(self, batch: Any, batch_idx: int, dataloader_idx: int = 0) -> Any:
        """Default: ``self(inputs)`` where inputs is the batch or its first element."""
        inputs = batch[0] if isinstance(batch, (tuple, list)) else batch
        return self(inputs)

    def _default_eval_step(self, stage: str, batch: Any, dataloader_idx: int = 0) -> Tensor:
        loss, preds, target = self._default_forward(batch, f"{'validation' if stage == 'val' else stage}_step")
        self.log(f"{stage}/loss", loss, prog_bar=True, sync_dist=True)  # synced at epoch end only
        metrics = self.__dict__.get("_modules", {}).get("metrics")
        if metrics is not None:
            for name, metric in metrics.items():
                if dataloader_idx:  # each dataloader needs its own metric state
                    metric = self._metric_for_dataloader(name, metric, dataloader_idx, preds.device)
                metric.update(preds, target)
                self.log(f"{stage}/{name}", metric, prog_bar=True)
        return loss

    def _metric_for_dataloader(self, name: str, metric: Any, dataloader_idx: int, device: torch.device) -> Any:
        """A reset copy of `metric` for dataloader `dataloader_idx` (> 0), made on first use."""
        copies: dict[tuple[str, int], Any] = self.__dict__.setdefault("_dataloader_metrics", {})
        copy = copies.get((name, dataloader_idx))
        if copy is None:
            copy = copies[(name, dataloader_idx)] = metric.clone()
            copy.reset()
        if copy.device != device:
            copy.to(device)
        return copy

    def _default_forward(self, batch: Any, step: str) -> tuple[Tensor, Tensor, Any]:
        modules = self.__dict__.get("_modules", {})
        if modules.get("model") is None or not callable(getattr(self, "loss_fn", None)):
            raise NotImplementedError(
                f"{type(self).__qualname__} does not define {step}(); define it, or set self.model "
                "and self.loss_fn to use the default step on (inputs, target) batches"
            )
        if not isinstance(batch, (tuple, list)) or len(batch) != 2:
            kind = f"a {type(batch).__qualname__}" + (f" of length {len(batch)}" if hasattr(batch, "__len__") else "")
            raise TypeError(
                f"the default {step} expects (inputs, target) batches; got {kind}. "
                f"Override {step}() for other batch formats."
            )
        inputs, target = batch
        preds = self(inputs)
        loss: Tensor = self.loss_fn(preds, target)  # type: ignore[operator]
        return loss, preds, target

    # --- evaluation mode (Lightning's hooks) ------------------------------------------------------
    def on_validation_model_eval(self) -> None:
        """Put the module in eval mode before validation (override to keep, e.g., dropout on)."""
        self.eval()

    def on_validation_model_train(self) -> None:
        """After validation; when overridden it replaces ember's restoring of every submodule's mode."""
        self.train()

    def on_test_model_eval(self) -> None:
        """Put the module in eval mode before testing."""
        self.eval()

    def on_test_model_train(self) -> None:
        """After testing; when overridden it replaces ember's restoring of every submodule's mode."""
        self.train()

    def on_predict_model_eval(self) -> None:
        """Put the module in eval mode before predicting."""
        self.eval()

    # --- export ---------------------------------------------------------------------------
    # Each is an `ember.export` function with this module as its first argument (one signature, kept
    # there): it runs in eval mode on an example input (the argument, else `example_input_array`),
    # checks the artifact it wrote against this module, and only then moves it into place (docs/export.md).
    to_onnx = ExportMethod("export_onnx")
    to_torchscript = ExportMethod("export_torchscript")
    export_program = ExportMethod("export_program")
    to_safetensors = ExportMethod("export_safetensors")
    to_hf = ExportMethod("export_hf")


#: The step hooks whose signature ember reads (`TrainingModule.__init_subclass__`).
_STEPS = ("training_step", "validation_step", "test_step", "predict_step")


def _fitted_to_signature(step: Callable[..., Any]) -> Callable[..., Any]:
    """`step` if it takes ``(self, batch, batch_idx[, dataloader_idx])`` or ``*args``; else a wrapper that passes
    only as many positional arguments as it declares (``step(self, batch)`` gets the batch alone)."""
    parameters = list(inspect.signature(step).parameters.values())
    if any(p.kind is inspect.Parameter.VAR_POSITIONAL for p in parameters):
        return step
    positional = [p for p in parameters if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)]
    accepted = len(positional)  # self included
    if accepted >= 4:
        return step

    @functools.wraps(step)
    def fitted(self: Any, *args: Any, **kwargs: Any) -> Any:
        return step(self, *args[: accepted - 1], **kwargs)

    return fitted
