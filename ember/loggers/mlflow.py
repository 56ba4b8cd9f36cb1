"""`MLflowLogger`: an MLflow run per ember run, tracked locally by default, continued on resume.

``mlflow`` is imported when the run first writes, so ``import ember`` stays light
(``pip install 'ember[mlflow]'``).
"""

from __future__ import annotations

import json
import os
import posixpath
import re
import threading
import time
import warnings
from collections.abc import Iterator, Mapping, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

from ember.loggers.csv import _plain
from ember.loggers.logger import Logger, public_params

if TYPE_CHECKING:
    from mlflow.entities import Metric
    from mlflow.tracking import MlflowClient

#: What MLflow accepts in one ``log_batch`` call (its own limits).
MAX_METRICS_PER_BATCH = 1000
MAX_PARAMS_PER_BATCH = 100
#: MLflow rejects parameter values longer than this; longer ones are cut and end in "...".
MAX_PARAM_LENGTH = 6000
#: ``finalize`` status -> MLflow run status.
RUN_STATUS = {"success": "FINISHED", "failed": "FAILED", "interrupted": "KILLED"}

_BAD_KEY_CHARS = re.compile(r"[^/\w.\- :]")


class MLflowLogger(Logger):
    """Logs the run's parameters, metrics and artifacts to an MLflow run.

    - **Where**: ``tracking_uri``, else the ``MLFLOW_TRACKING_URI`` environment
      variable, else a local SQLite store in the run directory:
      ``<run dir>/mlflow/mlflow.db`` with artifacts in ``<run dir>/mlflow/artifacts``
      (no server needed; browse it with ``mlflow ui --backend-store-uri
      sqlite:///runs/<name>/version_N/mlflow/mlflow.db``). A server works the
      same way: ``tracking_uri="http://127.0.0.1:5000"``.
    - **Experiment and run**: the experiment is ``experiment_name`` (default: the
      ember run name, ``runs/<name>/...``), the MLflow run is named ``run_name``
      (default: the version folder, ``version_N``).
    - **Parameters**: the resolved config of a YAML run (else the module's
      hyperparameters), flattened to dotted keys (``trainer.max_epochs``,
      ``module.lr``); names that look like credentials are left out. The same
      config is stored as the artifact ``config.yaml``.
    - **Metrics**: every logged value at its step (Lightning's axis: in fit, optimizer
      step N is logged at N - 1; docs/monitoring.md). They are queued and
      sent in one ``log_batch`` at the next `save` (epoch ends, before each
      checkpoint, at the end), so a training step never waits for the store.
    - **Checkpoints**: after each checkpoint the tag ``ember.last_checkpoint`` names
      it; when `ModelCheckpoint` has a best checkpoint, the tag
      ``ember.best_checkpoint`` and the artifact ``best_checkpoint.json`` (path and
      score) name it. ``log_checkpoints=True`` also copies each new best checkpoint
      into the run's artifacts (under ``checkpoints/``).
    - **Resume**: the run id (and the tracking URI) are saved in checkpoints; a
      resumed fit continues the same MLflow run. Values logged after the
      checkpoint and before the interruption stay in MLflow's history (MLflow
      cannot delete them); the resumed run logs those steps again, and the tag
      ``ember.resumed_at_step`` records where it picked up. MLflow parameters
      cannot change within a run: a resumed run whose config differs keeps the
      first values (with a warning naming the keys).
    """

    def __init__(
        self,
        experiment_name: str | None = None,
        run_name: str | None = None,
        *,
        tracking_uri: str | None = None,
        save_dir: str | os.PathLike[str] | None = None,
        tags: Mapping[str, Any] | None = None,
        run_id: str | None = None,
        artifact_location: str | None = None,
        log_checkpoints: bool = False,
    ) -> None:
        super().__init__(save_dir)
        self.experiment_name = experiment_name
        self.run_name = run_name
        self._tracking_uri = tracking_uri or os.environ.get("MLFLOW_TRACKING_URI") or None
        self._uri_given = self._tracking_uri is not None
        self.tags = {str(k): str(v) for k, v in (tags or {}).items()}
        self.artifact_location = artifact_location
        self.log_checkpoints = log_checkpoints
        self._run_id = run_id
        self._experiment_id: str | None = None
        self._client: MlflowClient | None = None
        self._started = False
        self._queued: list[Metric] = []
        self._resumed_at: int | None = None
        self._best: str | None = None
        self._run_dir: Path | None = None
        self._starting = threading.Lock()  # the trainer's logger thread and a hook's `experiment` start one run

    def attach(self, run_dir: Path) -> None:
        """Without ``save_dir``, the local store goes to ``<run_dir>/mlflow``; names default from `run_dir`."""
        self._run_dir = Path(run_dir)
        if self._save_dir is None:
            self._save_dir = Path(run_dir) / "mlflow"

    # --- where ---------------------------------------------------------------------------------------
    @property
    def tracking_uri(self) -> str:
        """The tracking URI in use (``sqlite:///<run dir>/mlflow/mlflow.db`` by default)."""
        if self._tracking_uri is None:
            self._tracking_uri = self._local_uri()
        return self._tracking_uri

    def _local_uri(self) -> str:
        return "sqlite:///" + str((self.log_dir / "mlflow.db").resolve())

    @property
    def run_id(self) -> str | None:
        """The MLflow run id (known once the run started, or after `load_state_dict`)."""
        return self._run_id

    @property
    def experiment_id(self) -> str | None:
        """The MLflow experiment id (known once the run started)."""
        return self._experiment_id

    @property
    def experiment(self) -> MlflowClient:
        """The ``MlflowClient`` of the tracking URI; the MLflow run exists once this returns."""
        with self._starting:
            if not self._started:
                self._start()
        assert self._client is not None
        return self._client

    def _start(self) -> None:
        from mlflow.tracking import MlflowClient

        local = self.tracking_uri == self._local_uri()  # the default store: in this run's directory
        if local:
            self.log_dir.mkdir(parents=True, exist_ok=True)
        client = MlflowClient(tracking_uri=self.tracking_uri)
        if self._run_id is not None:
            run = client.get_run(self._run_id)  # raises when the run is not in this store
            self._experiment_id = run.info.experiment_id
            client.update_run(self._run_id, status="RUNNING")
            if self._resumed_at is not None:
                client.set_tag(self._run_id, "ember.resumed_at_step", str(self._resumed_at))
        else:
            self._experiment_id = self._experiment(client, local)
            tags = {**self._default_tags(), **self.tags}
            run = client.create_run(self._experiment_id, run_name=self._default_run_name(), tags=tags)
            self._run_id = run.info.run_id
        self._client = client
        self._started = True

    def _experiment(self, client: MlflowClient, local: bool) -> str:
        name = self.experiment_name or (self._run_dir.parent.name if self._run_dir is not None else "ember")
        found = client.get_experiment_by_name(name)
        if found is not None:
            return str(found.experiment_id)
        location = self.artifact_location
        if location is None and local:
            location = (self.log_dir / "artifacts").resolve().as_uri()
        return str(client.create_experiment(name, artifact_location=location))

    def _default_run_name(self) -> str | None:
        if self.run_name is not None:
            return self.run_name
        return self._run_dir.name if self._run_dir is not None else None

    def _default_tags(self) -> dict[str, str]:
        return {"ember.run_dir": str(self._run_dir.resolve())} if self._run_dir is not None else {}

    # --- what ----------------------------------------------------------------------------------------
    def log_metrics(self, metrics: dict[str, float], step: int) -> None:
        """Queue the metrics at `step` (sent at the next `save`)."""
        from mlflow.entities import Metric

        stamp = int(time.time() * 1000)
        for name, value in metrics.items():
            self._queued.append(Metric(mlflow_key(name), float(value), stamp, int(step)))
        if len(self._queued) >= 10 * MAX_METRICS_PER_BATCH:  # bound the queue of a run that never saves
            self.save()

    def log_hyperparams(self, params: dict[str, Any]) -> None:
        """Log the flattened parameters (new keys only, on a resumed run) and ``config.yaml`` as an artifact."""
        from mlflow.entities import Param
        from omegaconf import OmegaConf

        public = public_params(params)
        flat = {mlflow_key(k): param_value(v) for k, v in flatten(public).items()}
        client, run_id = self.experiment, self._require_run()
        existing = client.get_run(run_id).data.params
        changed = sorted(k for k, v in flat.items() if k in existing and existing[k] != v)
        if changed:
            warnings.warn(
                f"MLflow run {run_id} keeps its first value of {', '.join(changed)}: MLflow parameters cannot "
                "change within a run (the resumed run's config differs)",
                RuntimeWarning,
                stacklevel=2,
            )
        new = [Param(k, v) for k, v in flat.items() if k not in existing]
        for chunk in chunks(new, MAX_PARAMS_PER_BATCH):
            client.log_batch(run_id, params=chunk)
        text = OmegaConf.to_yaml(OmegaConf.create(_plain(public)))
        client.log_text(run_id, text, "config.yaml")

    def after_save_checkpoint(self, checkpoint_path: Path) -> None:
        """Tag the checkpoint as the last; record (and with ``log_checkpoints``, copy) a new best one."""
        from ember import checkpoint as ckpt

        client, run_id = self.experiment, self._require_run()
        path = Path(checkpoint_path).resolve()
        client.set_tag(run_id, "ember.last_checkpoint", str(path))
        recorded = ckpt.recorded_best(path)
        if recorded is not None and recorded[1] != self._best:
            key, best, score = recorded
            self._record_best(Path(best).resolve(), score, key)

    def _record_best(self, best: Path, score: Any, key: str) -> None:
        client, run_id = self.experiment, self._require_run()
        self._best = str(best)
        client.set_tag(run_id, "ember.best_checkpoint", str(best))
        record = {"path": str(best), "score": score, "callback": key}
        client.log_text(run_id, json.dumps(record, indent=2) + "\n", "best_checkpoint.json")
        if self.log_checkpoints and best.is_dir():
            client.log_artifacts(run_id, str(best), f"checkpoints/{best.name}")

    def save(self) -> None:
        """Send the queued metrics (``log_batch``, in chunks of MLflow's batch limit)."""
        if not self._queued:
            return
        client, run_id = self.experiment, self._require_run()
        while self._queued:  # what a failed call did not send stays queued for the next save
            chunk = self._queued[:MAX_METRICS_PER_BATCH]
            client.log_batch(run_id, metrics=chunk)
            del self._queued[: len(chunk)]

    def finalize(self, status: str) -> None:
        """Send what is queued and end the MLflow run (FINISHED, FAILED or KILLED); a later run continues it."""
        if not self._started:
            return
        self.save()
        assert self._client is not None and self._run_id is not None
        self._client.set_terminated(self._run_id, RUN_STATUS.get(status, "FAILED"))
        self._started = False  # a later validate/test on the same trainer reopens the run

    def rebuild_kwargs(self) -> dict[str, Any] | None:
        """This logger's store and run (created by the replay when it was never created)."""
        return {
            "experiment_name": self.experiment_name or (self._run_dir.parent.name if self._run_dir else "ember"),
            "run_name": self._default_run_name(),
            "tracking_uri": self.tracking_uri,
            "save_dir": str(self.log_dir),
            "tags": {**self._default_tags(), **self.tags},
            "run_id": self._run_id,
            "artifact_location": self.artifact_location,
            "log_checkpoints": self.log_checkpoints,
        }

    def state_dict(self) -> dict[str, Any]:
        """The run id, experiment id and tracking URI, so a resumed fit continues the same run."""
        return {"run_id": self._run_id, "experiment_id": self._experiment_id, "tracking_uri": self._tracking_uri}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Continue the saved run; the saved tracking URI is used unless this logger was given one."""
        run_id = state.get("run_id")
        if run_id is None:
            return
        saved_uri = state.get("tracking_uri")
        if not self._uri_given and saved_uri and _store_exists(saved_uri):
            self._tracking_uri = saved_uri
        if self._started and run_id != self._run_id:  # a fresh run already started: end it, continue the saved one
            self.finalize("success")
        self._run_id = run_id
        self._resumed_at = int(state.get("step", 0))
        self._queued = [m for m in self._queued if m.step < self._resumed_at]  # step N is logged at N - 1

    def _require_run(self) -> str:
        assert self._run_id is not None  # `experiment` started it
        return self._run_id


def mlflow_key(name: str) -> str:
    """`name` as MLflow accepts it: characters other than letters, digits, ``_ - . / : space`` become ``_``,
    and the path is normalised (no leading ``/``, no ``//`` or ``..``)."""
    key = _BAD_KEY_CHARS.sub("_", str(name))
    key = posixpath.normpath(key).lstrip("/") if key else "_"
    key = "/".join("_" if part in (".", "..") else part for part in key.split("/"))
    return key[:250] or "_"


def param_value(value: Any) -> str:
    """A parameter as MLflow stores it: a string of at most `MAX_PARAM_LENGTH` characters."""
    text = json.dumps(value, default=str) if isinstance(value, (list, tuple)) else str(value)
    return text if len(text) <= MAX_PARAM_LENGTH else text[: MAX_PARAM_LENGTH - 3] + "..."


def flatten(params: Mapping[str, Any], prefix: str = "") -> dict[str, Any]:
    """Nested mappings become dotted keys: ``{"trainer": {"max_epochs": 3}}`` -> ``{"trainer.max_epochs": 3}``."""
    flat: dict[str, Any] = {}
    for key, value in params.items():
        name = f"{prefix}{key}"
        if isinstance(value, Mapping) and value:
            flat.update(flatten(value, prefix=f"{name}."))
        else:
            flat[name] = dict(value) if isinstance(value, Mapping) else value
    return flat


def chunks(items: Sequence[Any], size: int) -> Iterator[list[Any]]:
    """`items` in consecutive lists of at most `size`."""
    for start in range(0, len(items), size):
        yield list(items[start : start + size])


def _store_exists(uri: str) -> bool:
    """Whether a saved tracking URI can still be used: a local SQLite file must exist (the run dir may have moved)."""
    if uri.startswith("sqlite:///"):
        return Path(uri[len("sqlite:///") :]).is_file()
    return True
