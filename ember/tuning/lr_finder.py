"""The learning-rate range test: train a few steps with a growing learning rate, watch the loss.

`lr_find` trains the module for up to ``num_steps`` optimizer steps while the
learning rate grows from ``min_lr`` to ``max_lr`` (geometrically with
``mode="exponential"``, evenly with ``mode="linear"``). The loss of every step
is smoothed with an exponential moving average (weight ``1 - beta`` on the
newest step, bias-corrected as in Adam), and the test stops early once the
smoothed loss exceeds ``divergence_factor`` times its lowest value, or is not
finite.

**The suggestion rule.** The suggested learning rate is the one where the
smoothed loss falls fastest: the most negative slope ``d(smoothed loss) /
d(x)``, with ``x = log10(lr)`` in exponential mode and ``x = lr`` in linear mode
(the x axis of the plot), taken by central differences (`numpy.gradient`) over
the recorded steps without the first tenth (at least one step: the average is
still settling) and the last step (the one that diverged). With fewer than five
usable steps there is no suggestion.

The scratch run leaves no trace on the module or the trainer (see
`ember.tuning.scratch`): parameters, buffers, optimizer and scheduler state,
random streams and loop counters are bitwise those from before. Under DDP every
process runs the test on its share of each batch; the losses are averaged over
the processes every step, so all of them see the same curve, stop at the same
step and suggest the same learning rate.
"""

from __future__ import annotations

import math
import os
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from ember.callbacks.callback import Callback

if TYPE_CHECKING:
    from collections.abc import Sequence

    from matplotlib.figure import Figure
    from torch.optim import Optimizer

    from ember.loggers.logger import Logger
    from ember.modules.datamodule import DataModule
    from ember.modules.module import TrainingModule
    from ember.trainer.trainer import Trainer

_MODES = ("exponential", "linear")


@dataclass
class LRFinderResult:
    """What the range test recorded and what it suggests.

    ``lrs[i]`` is the learning rate of optimizer step ``i``; ``losses[i]`` the
    loss of that step's batch (averaged over the accumulation window and the
    processes) and ``smoothed[i]`` its moving average. ``suggestion`` is None when
    the test stopped before enough steps were recorded.
    """

    lrs: list[float]
    losses: list[float]
    smoothed: list[float]
    suggestion_index: int | None
    stopped_early: bool
    mode: str
    lr_key: str = "module.lr"
    run_dir: Path | None = None
    plot_path: Path | None = None

    @property
    def suggestion(self) -> float | None:
        """The suggested learning rate (see the module docstring for the rule)."""
        return None if self.suggestion_index is None else self.lrs[self.suggestion_index]

    @property
    def override(self) -> str | None:
        """The command-line override that uses the suggestion, e.g. ``module.lr=0.00316``."""
        return None if self.suggestion is None else f"{self.lr_key}={self.suggestion:.3g}"

    def plot(self, path: str | os.PathLike[str] | None = None) -> Figure:
        """The smoothed loss against the learning rate with the suggestion marked; saved as PNG at `path`."""
        figure = _figure(self)
        if path is not None:
            _save_png(figure, Path(path))
        return figure


def lr_schedule(min_lr: float, max_lr: float, num_steps: int, mode: str) -> list[float]:
    """The learning rate of each step: ``min_lr`` at step 0, ``max_lr`` at the last."""
    if num_steps == 1:
        return [min_lr]
    if mode == "exponential":
        ratio = max_lr / min_lr
        return [min_lr * ratio ** (i / (num_steps - 1)) for i in range(num_steps)]
    return [min_lr + (max_lr - min_lr) * i / (num_steps - 1) for i in range(num_steps)]


def smooth(losses: Sequence[float], beta: float) -> list[float]:
    """Bias-corrected exponential moving average: ``avg = beta * avg + (1 - beta) * loss``, over ``1 - beta**k``."""
    out, avg = [], 0.0
    for k, loss in enumerate(losses, start=1):
        avg = beta * avg + (1 - beta) * loss
        out.append(avg / (1 - beta**k))
    return out


def suggest(lrs: Sequence[float], smoothed: Sequence[float], mode: str = "exponential") -> int | None:
    """Index of the steepest descent of `smoothed` (the rule in the module docstring), or None."""
    import numpy as np

    n = len(smoothed)
    begin, end = max(1, n // 10), n - 1
    if end - begin < 5:
        return None
    x = np.log10(np.asarray(lrs[begin:end])) if mode == "exponential" else np.asarray(lrs[begin:end])
    y = np.asarray(smoothed[begin:end])
    if not np.all(np.isfinite(y)):
        return None
    slope = np.gradient(y, x)
    return begin + int(np.argmin(slope))


class _RangeTest(Callback):
    """Sets each step's learning rate, records its loss, stops on divergence."""

    def __init__(self, lrs: list[float], beta: float, divergence_factor: float) -> None:
        self.lrs, self.beta, self.divergence_factor = lrs, beta, divergence_factor
        self.losses: list[float] = []
        self.smoothed: list[float] = []
        self.stopped_early = False
        self._ratios: dict[int, list[float]] = {}
        self._window: list[torch.Tensor] = []
        self._avg = 0.0
        self._best = math.inf
        self._step_seen = 0

    def on_fit_start(self, trainer: Trainer, module: TrainingModule) -> None:
        # Several parameter groups keep their learning-rate ratios to the first one.
        for optimizer in trainer.optimizers:
            base = [float(group["lr"]) for group in optimizer.param_groups]
            first = base[0] if base[0] > 0 else 1.0
            self._ratios[id(optimizer)] = [b / first if base[0] > 0 else 1.0 for b in base]

    def on_before_optimizer_step(self, trainer: Trainer, module: TrainingModule, optimizer: Optimizer) -> None:
        lr = self.lrs[min(trainer.global_step, len(self.lrs) - 1)]
        ratios = self._ratios.get(id(optimizer)) or [1.0] * len(optimizer.param_groups)
        for group, ratio in zip(optimizer.param_groups, ratios, strict=True):
            group["lr"] = lr * ratio

    def on_train_batch_end(
        self, trainer: Trainer, module: TrainingModule, outputs: Any, batch: Any, batch_idx: int
    ) -> None:
        loss = outputs.get("loss") if isinstance(outputs, dict) else outputs
        if not isinstance(loss, torch.Tensor):
            raise TypeError("lr_find needs training_step to return the loss (a tensor or a dict with 'loss')")
        self._window.append(loss.detach().float())
        if trainer.global_step == self._step_seen:
            return  # inside an accumulation window
        self._step_seen = trainer.global_step
        mean = torch.stack(self._window).mean()
        self._window = []
        value = float(trainer.strategy.reduce(mean, "mean"))  # every process gets the same number
        self.losses.append(value)
        k = len(self.losses)
        self._avg = self.beta * self._avg + (1 - self.beta) * value
        smoothed = self._avg / (1 - self.beta**k)
        self.smoothed.append(smoothed)
        self._best = min(self._best, smoothed)
        if not math.isfinite(smoothed) or (k > 1 and smoothed > self.divergence_factor * self._best):
            self.stopped_early = True
            trainer.should_stop = True


def lr_find(
    trainer: Trainer,
    module: TrainingModule,
    train_dataloaders: Any = None,
    datamodule: DataModule | None = None,
    *,
    min_lr: float = 1e-8,
    max_lr: float = 1.0,
    num_steps: int = 100,
    mode: str = "exponential",
    beta: float = 0.98,
    divergence_factor: float = 4.0,
    lr_key: str = "module.lr",
    logger: bool | Logger | list[Logger] | None = None,
    plot: bool = True,
    verbose: bool = True,
) -> LRFinderResult:
    """Run the learning-rate range test on `module` with `trainer`'s options; suggest a learning rate.

    The test is a run of its own in ``<default_root_dir>/<run name>/version_N``
    (like a fit of `trainer`): its loggers get the curve as ``lr_find/lr``,
    ``lr_find/loss`` and ``lr_find/loss_smoothed`` against the step, and the
    plot as an image (TensorBoard, W&B); ``lr_find.csv`` and ``lr_find.png`` (with
    ``plot=True``, needs matplotlib: ``pip install 'ember[tune]'``) are written
    beside them. `logger` picks the loggers (default: `trainer`'s ``logger`` option
    when it is a bool, else TensorBoard and CSV; logger objects given to `trainer`
    belong to its training run and are not used). Process 0 prints the suggestion
    and the override (``lr_key=<lr>``) unless ``verbose=False``.

    The suggestion rule, early stopping and what is restored are in the module
    docstring. Use the result with ``module.hparams.lr = result.suggestion`` (or
    however the module reads its learning rate) before `trainer.fit`.
    """
    from ember.trainer.run import label_command
    from ember.tuning.scratch import (
        CaptureInitialised,
        KeepLoaderGenerators,
        Snapshot,
        check_supported,
        release,
        scratch_trainer,
    )

    check_options(min_lr, max_lr, num_steps, mode, beta, divergence_factor)
    check_supported(trainer, "lr_find")
    lrs = lr_schedule(min_lr, max_lr, num_steps, mode)
    test = _RangeTest(lrs, beta, divergence_factor)
    if logger is None:
        option = trainer.options.logger
        logger = option if isinstance(option, bool) or option is None else True
    snapshot = Snapshot.take(module, datamodule, train_dataloaders)
    callbacks: list[Callback] = [CaptureInitialised(snapshot), test, KeepLoaderGenerators(snapshot)]
    scratch = scratch_trainer(trainer, max_steps=num_steps, callbacks=callbacks, logger=logger)
    label_command(scratch, "tune lr")  # its run directory's status.json says what made it
    scratch.run_config = trainer.run_config
    try:
        scratch.fit(module, train_dataloaders, datamodule=datamodule)
        run_dir = scratch.run_dir
        index = suggest(lrs[: len(test.smoothed)], test.smoothed, mode)
        index = scratch.strategy.broadcast(index)  # the same curve everywhere; process 0's word is final
        result = LRFinderResult(
            lrs=lrs[: len(test.losses)],
            losses=test.losses,
            smoothed=test.smoothed,
            suggestion_index=index,
            stopped_early=test.stopped_early,
            mode=mode,
            lr_key=lr_key,
            run_dir=run_dir,
        )
        if scratch.is_global_zero:
            _write_outputs(result, run_dir, scratch.loggers, plot)
    finally:
        release(scratch)
        snapshot.restore()
    if verbose and trainer.is_global_zero:
        print(describe(result, min_lr, max_lr, num_steps), flush=True)
    return result


def check_options(min_lr: float, max_lr: float, num_steps: int, mode: str, beta: float, factor: float) -> None:
    """Raise `ValueError` for options `lr_find` cannot run with (before anything is built)."""
    if mode not in _MODES:
        raise ValueError(f"lr_find: mode={mode!r}; choose 'exponential' or 'linear'")
    numbers = all(isinstance(x, (int, float)) and not isinstance(x, bool) for x in (min_lr, max_lr))
    if not (numbers and math.isfinite(max_lr) and 0 < min_lr < max_lr):
        raise ValueError(f"lr_find: need finite 0 < min_lr < max_lr; got min_lr={min_lr!r}, max_lr={max_lr!r}")
    if isinstance(num_steps, bool) or not isinstance(num_steps, int) or num_steps < 2:
        raise ValueError(f"lr_find: num_steps must be an int >= 2; got {num_steps!r}")
    if not 0 <= beta < 1:
        raise ValueError(f"lr_find: beta={beta!r} must lie in [0, 1) (0: no smoothing)")
    if not factor > 1:
        raise ValueError(f"lr_find: divergence_factor={factor!r} must be > 1")


def describe(result: LRFinderResult, min_lr: float, max_lr: float, num_steps: int) -> str:
    """The lines `lr_find` prints: what ran, the suggestion, the plot and the override."""
    steps = len(result.losses)
    head = f"lr_find: {steps} of {num_steps} steps, lr {min_lr:.3g} -> {max_lr:.3g} ({result.mode})"
    if result.stopped_early:
        head += f"; stopped at step {steps}: the smoothed loss diverged"
    lines = [head]
    if result.suggestion is None:
        lines.append("lr_find: no suggestion: too few steps before the loss diverged; lower max_lr or raise num_steps")
    else:
        lines.append(f"lr_find: suggested lr {result.suggestion:.3g} (steepest descent of the smoothed loss)")
    if result.plot_path is not None:
        lines.append(f"lr_find: plot {result.plot_path}")
    if result.override is not None:
        lines.append(f"lr_find: use it with {result.override}")
    return "\n".join(lines)


def _write_outputs(result: LRFinderResult, run_dir: Path, loggers: list[Logger], plot: bool) -> None:
    from ember.checkpoint.files import atomic_write

    run_dir.mkdir(parents=True, exist_ok=True)
    rows = ["step,lr,loss,loss_smoothed"]
    rows += [
        f"{i},{lr!r},{loss!r},{s!r}"
        for i, (lr, loss, s) in enumerate(zip(result.lrs, result.losses, result.smoothed, strict=True))
    ]
    atomic_write(run_dir / "lr_find.csv", "\n".join(rows) + "\n")
    for i, (lr, loss, s) in enumerate(zip(result.lrs, result.losses, result.smoothed, strict=True)):
        for logger in loggers:
            logger.log_metrics({"lr_find/lr": lr, "lr_find/loss": loss, "lr_find/loss_smoothed": s}, i)
    figure = None
    if plot:
        figure = _figure(result)
        result.plot_path = run_dir / "lr_find.png"
        _save_png(figure, result.plot_path)
    for logger in loggers:
        if figure is not None:
            log_figure(logger, "lr_find/plot", figure, result.plot_path)
        if result.suggestion is not None:
            logger.log_metrics({"lr_find/suggestion": result.suggestion}, len(result.lrs))
        logger.save()


def log_figure(logger: Logger, name: str, figure: Figure, png: Path | None) -> None:
    """Send a matplotlib figure to loggers that show images (TensorBoard, W&B); others have the PNG file."""
    from ember.loggers.tensorboard import TensorBoardLogger

    if isinstance(logger, TensorBoardLogger):
        logger.experiment.add_figure(name, figure, close=False)
        return
    wandb_logger = sys.modules.get("ember.loggers.wandb")
    if wandb_logger is not None and isinstance(logger, wandb_logger.WandbLogger) and png is not None:
        import wandb

        logger.experiment.log({name: wandb.Image(str(png))})


def _figure(result: LRFinderResult) -> Figure:
    try:
        from matplotlib.backends.backend_agg import FigureCanvasAgg
        from matplotlib.figure import Figure
    except ImportError as exc:
        raise ImportError("the lr_find plot needs matplotlib: pip install 'ember[tune]'") from exc

    figure = Figure(figsize=(6.4, 4.2), dpi=100, layout="constrained")
    FigureCanvasAgg(figure)
    ax = figure.add_subplot()
    ax.plot(result.lrs, result.losses, color="0.75", linewidth=0.8, label="loss")
    ax.plot(result.lrs, result.smoothed, color="tab:blue", label="smoothed loss")
    if result.mode == "exponential":
        ax.set_xscale("log")
    if result.suggestion_index is not None:
        i = result.suggestion_index
        ax.plot([result.lrs[i]], [result.smoothed[i]], "o", color="tab:red", markersize=8, label="suggestion")
        ax.annotate(
            f"{result.lr_key}={result.lrs[i]:.3g}",
            (result.lrs[i], result.smoothed[i]),
            textcoords="offset points",
            xytext=(10, 10),
            color="tab:red",
        )
    start = result.smoothed[0] if result.smoothed and math.isfinite(result.smoothed[0]) else None
    finite = [v for v in (*result.losses, *result.smoothed) if math.isfinite(v)]
    if finite and start is not None:  # from the lowest loss to twice the start: the divergence does not squash it
        low, high = min(finite), 2 * start if start > 0 else max(finite)
        pad = 0.05 * (high - low) if high > low else 1.0
        ax.set_ylim(low - pad, high + pad)
    ax.set_xlabel("learning rate")
    ax.set_ylabel("training loss")
    ax.set_title("learning-rate range test")
    ax.legend(loc="upper left")
    ax.grid(True, which="major", alpha=0.3)
    return figure


def _save_png(figure: Figure, path: Path) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    partial = path.with_name(f".{path.name}.partial")
    figure.savefig(partial, format="png")
    os.replace(partial, path)
