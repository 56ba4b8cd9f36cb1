"""The `Logger` interface shared by every logger."""

from __future__ import annotations

import os
import re
from collections.abc import Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Any

from ember.checkpoint.store import is_url, redact

if TYPE_CHECKING:
    from torch import Tensor

#: Hyperparameter names that look like credentials; loggers never write their values.
_SECRET_NAME = re.compile(r"api[_-]?key|token|secret|password|passwd", re.IGNORECASE)


def public_params(params: Mapping[str, Any]) -> dict[str, Any]:
    """`params` without entries whose name looks like a credential (``api_key``, ``token``, ...), recursively.

    Every ember logger passes hyperparameters through this, so a key that found
    its way into a config never reaches a metrics file or a W&B run.
    """
    out: dict[str, Any] = {}
    for key, value in params.items():
        if _SECRET_NAME.search(str(key)):
            continue
        out[str(key)] = public_params(value) if isinstance(value, Mapping) else value
    return out


class Logger:
    """Receives metrics as floats and hyperparameters; writes them somewhere.

    The trainer calls loggers on the global-zero process only, every
    ``log_every_n_steps`` optimizer steps (batches under manual optimization) and at
    epoch ends, at Lightning's step (``Trainer.logs_this_batch``). Subclasses
    implement `log_metrics` and may implement the rest.

    A logger built without ``save_dir`` writes into the trainer's run
    directory (``runs/<name>/<version>/``), which the trainer hands over with
    `attach` before the first write.
    """

    #: Write histograms of weights and gradients every N optimizer steps (None: never). Loggers that
    #: can show histograms take it as a constructor argument; the trainer then adds the
    #: `ember.callbacks.ParameterHistograms` callback that collects them.
    log_histograms_every_n_steps: int | None = None
    #: Whether the logger holds values until `save` writes them (CSV, TensorBoard, MLflow) rather than sending each
    #: call at once (W&B). The trainer's logger guard (`ember.loggers.guard`) counts a value as delivered only once
    #: a `save` after it returned, and keeps it for a replay until then.
    holds_until_save: bool = True

    def __init__(self, save_dir: str | os.PathLike[str] | None = None) -> None:
        if is_url(save_dir):
            raise ValueError(
                f"{type(self).__name__}(save_dir={redact(str(save_dir))}): logs are written to a local folder; "
                "give a local save_dir (syncing logs to object storage is not supported yet)"
            )
        self._save_dir = Path(save_dir) if save_dir is not None else None

    def attach(self, run_dir: Path) -> None:
        """Called by the trainer with its run directory; used when no ``save_dir`` was given."""
        if self._save_dir is None:
            self._save_dir = Path(run_dir)

    @property
    def log_dir(self) -> Path:
        """Folder this logger writes into."""
        if self._save_dir is None:
            raise RuntimeError(f"{type(self).__name__} has no save_dir yet: pass one, or use it inside a Trainer")
        return self._save_dir

    @property
    def experiment(self) -> Any:
        """The back end's own object (TensorBoard's ``SummaryWriter``, the W&B run, the MLflow client); a logger
        without one (CSV) is its own: ``log_metrics``, ``log_hyperparams`` and ``save`` are its calls. So
        ``for lg in self.loggers: lg.experiment...`` works with every logger, as in Lightning."""
        return self

    def log_metrics(self, metrics: dict[str, float], step: int) -> None:
        """Write metrics logged at `step` (Lightning's axis: in fit, optimizer step N's row is step N - 1).

        The trainer calls a logger from a thread of its own (`ember.loggers.guard`), one call at a time and in
        order; a call that raises must leave what the logger was given before it still queued (a later `save`
        writes it), and must not have taken the values it was called with.
        """
        raise NotImplementedError

    def log_hyperparams(self, params: dict[str, Any]) -> None:
        """Write the run's hyperparameters (the resolved config, else the module's hparams)."""

    def log_histograms(self, values: dict[str, Tensor], step: int) -> None:
        """Write histograms of tensors (weights, gradients) at `step`; ignored by loggers without histograms."""

    def after_save_checkpoint(self, checkpoint_path: Path) -> None:
        """Called once a checkpoint at `checkpoint_path` is complete on disk (W&B can upload it)."""

    def save(self) -> None:
        """Flush buffered data to disk (called at epoch ends and before checkpoints)."""

    def finalize(self, status: str) -> None:
        """Close the run; `status` is "success", "failed" or "interrupted"."""

    def rebuild_kwargs(self) -> dict[str, Any] | None:
        """Keywords that build a logger of this class writing to the same place (the same run), so values it
        could not send during a run can be sent later (``python -m ember.loggers.replay``); None when the class
        cannot be rebuilt from keywords. The default passes ``save_dir``; override it when the constructor needs
        more (or other) arguments."""
        return {"save_dir": str(self._save_dir)} if self._save_dir is not None else None

    def state_dict(self) -> dict[str, Any]:
        """What a resumed run needs to continue this logger's run (e.g. a run id)."""
        return {}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Continue the run described by `state`; `state["step"]` is the resumed optimizer step."""
