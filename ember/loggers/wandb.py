"""`WandbLogger`: Weights & Biases runs that never block and resume under the same run id.

``wandb`` is imported when the run starts, so ``import ember`` stays light.
"""

from __future__ import annotations

import configparser
import netrc
import os
import socket
import threading
import warnings
from pathlib import Path
from typing import TYPE_CHECKING, Any
from urllib.parse import urlsplit

from ember.loggers.logger import Logger, public_params

if TYPE_CHECKING:
    from torch import Tensor

#: W&B's name for the x axis of every ember metric: the optimizer step.
STEP_METRIC = "trainer/global_step"
_MODES = ("online", "offline", "disabled", "shared")
_DEFAULT_HOST = "https://api.wandb.ai"


class WandbLogger(Logger):
    """Logs metrics, the config and (optionally) checkpoints to a Weights & Biases run.

    - **Never blocks on a login**: with ``mode=None`` (the default) the mode is
      ``WANDB_MODE`` when set, else ``"online"`` when an API key is configured
      (``WANDB_API_KEY``, ``~/.netrc`` or wandb's settings file) and the server
      answers within ``connect_timeout_s``, else ``"offline"``: the run is
      written under ``<run dir>/wandb`` for a later ``wandb sync``. ember only
      checks whether a key exists; it never reads, logs or stores its value.
    - **Resume**: `state_dict` holds the run id (saved in checkpoints); a
      resumed fit calls `load_state_dict` and continues the same run
      (``wandb.init(id=..., resume="allow")``). A later test/predict on the same
      trainer continues it too.
    - Metrics are plotted against ``trainer/global_step`` (Lightning's axis: in fit,
      optimizer step N is logged at N - 1),
      so W&B's own step counter never rejects a resumed run's values.
    - The hyperparameters (the resolved config of a YAML run) go to
      ``wandb.config``; names that look like credentials are left out.
    - ``log_checkpoints=True`` uploads each complete checkpoint as a ``model``
      artifact; ``log_histograms_every_n_steps=N`` logs weight and gradient
      histograms.

    Extra keywords go to ``wandb.init`` unchanged (e.g. ``job_type``,
    ``settings``).
    """

    holds_until_save = False  # each call goes to wandb at once

    def __init__(
        self,
        project: str | None = None,
        name: str | None = None,
        *,
        entity: str | None = None,
        tags: list[str] | None = None,
        group: str | None = None,
        notes: str | None = None,
        mode: str | None = None,
        save_dir: str | os.PathLike[str] | None = None,
        id: str | None = None,
        log_checkpoints: bool = False,
        log_histograms_every_n_steps: int | None = None,
        connect_timeout_s: float = 5.0,
        **init_kwargs: Any,
    ) -> None:
        super().__init__(save_dir)
        if mode is not None and mode not in _MODES:
            raise ValueError(f"WandbLogger(mode={mode!r}): choose one of {', '.join(_MODES)}, or None for automatic")
        if "api_key" in init_kwargs:
            raise ValueError(
                "WandbLogger does not take an API key; set WANDB_API_KEY in the environment or run `wandb login`"
            )
        self.project = project
        self.name = name
        self.entity = entity
        self.tags = list(tags) if tags else None
        self.group = group
        self.notes = notes
        self.mode = mode
        self.log_checkpoints = log_checkpoints
        self.log_histograms_every_n_steps = log_histograms_every_n_steps
        self.connect_timeout_s = connect_timeout_s
        self.init_kwargs = init_kwargs
        self._run_id = id
        self._run: Any = None
        self._config: dict[str, Any] = {}
        self._resolved_mode: str | None = None
        self._starting = threading.Lock()  # the trainer's logger thread and a hook's `experiment` start one run

    @property
    def run_id(self) -> str | None:
        """The W&B run id (known once the run started, or after `load_state_dict`)."""
        return self._run_id

    @property
    def resolved_mode(self) -> str:
        """The mode the run uses: ``mode``, else ``WANDB_MODE``, else online with a key and a reachable server."""
        if self._resolved_mode is None:
            self._resolved_mode = self.mode or resolve_mode(self.connect_timeout_s)
        return self._resolved_mode

    @property
    def experiment(self) -> Any:
        """The ``wandb`` run (started on first use)."""
        with self._starting:
            if self._run is None:
                self._run = self._start()
        return self._run

    def _identity(self) -> dict[str, Any]:
        """What names the W&B run: project, name, entity, tags, group and notes."""
        return {
            "project": self.project,
            "name": self.name,
            "entity": self.entity,
            "tags": self.tags,
            "group": self.group,
            "notes": self.notes,
        }

    def _start(self) -> Any:
        import wandb

        self.log_dir.mkdir(parents=True, exist_ok=True)
        kwargs: dict[str, Any] = {
            **self._identity(),
            "dir": str(self.log_dir),
            "mode": self.resolved_mode,
            "config": self._config or None,
            "reinit": "create_new",
        }
        if self._run_id is not None:
            kwargs.update(id=self._run_id, resume="allow")
        kwargs.update(self.init_kwargs)
        run = wandb.init(**kwargs)
        self._run_id = run.id
        run.define_metric(STEP_METRIC)
        run.define_metric("*", step_metric=STEP_METRIC, step_sync=True)
        return run

    def log_metrics(self, metrics: dict[str, float], step: int) -> None:
        """Log one history row with the metrics and ``trainer/global_step = step``."""
        self.experiment.log({**metrics, STEP_METRIC: step})

    def log_hyperparams(self, params: dict[str, Any]) -> None:
        """Update ``wandb.config`` (entries named like credentials are left out)."""
        self._config.update(public_params(params))
        self.experiment.config.update(self._config, allow_val_change=True)

    def log_histograms(self, values: dict[str, Tensor], step: int) -> None:
        """Log a ``wandb.Histogram`` per tensor at `step`."""
        import torch
        import wandb

        rows: dict[str, Any] = {STEP_METRIC: step}
        for name, tensor in values.items():
            counts, edges = torch.histogram(tensor.detach().float().cpu().flatten(), bins=64)
            rows[name] = wandb.Histogram(np_histogram=(counts.numpy(), edges.numpy()))
        self.experiment.log(rows)

    def after_save_checkpoint(self, checkpoint_path: Path) -> None:
        """With ``log_checkpoints=True``, upload the checkpoint (file or folder) as a ``model`` artifact."""
        if not self.log_checkpoints or self._run is None:
            return
        import wandb

        path = Path(checkpoint_path)
        artifact = wandb.Artifact(f"model-{self._run.id}", type="model", metadata={"checkpoint": path.name})
        if path.is_dir():
            artifact.add_dir(str(path))
        else:
            artifact.add_file(str(path))
        self._run.log_artifact(artifact, aliases=["latest", path.name])

    def finalize(self, status: str) -> None:
        """Finish the run (exit code 0 on success); a later run on the same trainer continues it."""
        if self._run is not None:
            self._run.finish(exit_code=0 if status == "success" else 1)
            self._run = None

    def rebuild_kwargs(self) -> dict[str, Any] | None:
        """The same W&B run (its id), project and mode."""
        return {
            **self._identity(),
            "mode": self._resolved_mode or self.mode,
            "save_dir": str(self._save_dir) if self._save_dir is not None else None,
            "id": self._run_id,
        }

    def state_dict(self) -> dict[str, Any]:
        """The run id and project, so a resumed fit continues the same run; never credentials."""
        return {"run_id": self._run_id, "project": self.project}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Continue the run saved in `state` (``wandb.init(id=..., resume="allow")`` on first use)."""
        run_id = state.get("run_id")
        if run_id is None or run_id == self._run_id:
            return
        if self._run is not None:  # a fresh run already started: close it and continue the saved one
            self._run.finish()
            self._run = None
        self._run_id = run_id


def has_api_key(host: str | None = None) -> bool:
    """Whether a W&B API key is configured: ``WANDB_API_KEY``, an identity token, ``.netrc``, or the settings file.

    Never prompts, never contacts the server, and never returns the key.
    """
    if os.environ.get("WANDB_API_KEY") or os.environ.get("WANDB_IDENTITY_TOKEN_FILE"):
        return True
    netloc = urlsplit(host or os.environ.get("WANDB_BASE_URL") or _DEFAULT_HOST).netloc
    netrc_path = Path(os.environ.get("NETRC") or "~/.netrc").expanduser()
    try:
        if netrc.netrc(str(netrc_path)).authenticators(netloc):
            return True
    except (OSError, netrc.NetrcParseError):
        pass
    config_dir = Path(os.environ.get("WANDB_CONFIG_DIR") or "~/.config/wandb").expanduser()
    parser = configparser.ConfigParser()
    try:
        parser.read(config_dir / "settings")
    except configparser.Error:
        return False
    return bool(parser.has_option("default", "api_key") and parser.get("default", "api_key"))


def resolve_mode(timeout_s: float = 5.0) -> str:
    """``WANDB_MODE`` if set; else online when a key exists and the server answers; else offline (with a warning)."""
    env_mode = os.environ.get("WANDB_MODE")
    if env_mode:
        return "offline" if env_mode == "dryrun" else env_mode
    if os.environ.get("WANDB_DISABLED", "").lower() in ("1", "true", "yes"):
        return "disabled"
    host = os.environ.get("WANDB_BASE_URL") or _DEFAULT_HOST
    if not has_api_key(host):
        warnings.warn(
            "no W&B API key configured (WANDB_API_KEY, ~/.netrc or `wandb login`): logging offline; "
            "upload later with `wandb sync <run dir>/wandb/offline-run-*`",
            RuntimeWarning,
            stacklevel=3,
        )
        return "offline"
    if not _reachable(host, timeout_s):
        warnings.warn(
            f"W&B server {host} did not answer within {timeout_s:g} s: logging offline; "
            "upload later with `wandb sync <run dir>/wandb/offline-run-*`",
            RuntimeWarning,
            stacklevel=3,
        )
        return "offline"
    return "online"


def _reachable(url: str, timeout_s: float) -> bool:
    parts = urlsplit(url)
    port = parts.port or (443 if parts.scheme == "https" else 80)
    try:
        with socket.create_connection((parts.hostname or "", port), timeout=timeout_s):
            return True
    except OSError:
        return False
