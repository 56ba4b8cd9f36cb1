"""`TensorBoardLogger`: scalars, hyperparameters with their final metrics, and histograms.

Scalars and hyperparameters are written by `EventFile`, which needs only TensorBoard's protocol buffer
classes: ``torch.utils.tensorboard`` imports TensorBoard's filesystem layer, and with it fsspec and,
where installed, boto3, which costs a fresh process 0.2 to 1.5 s (docs/benchmarks.md, cold start).
``torch.utils.tensorboard.SummaryWriter`` is imported only for histograms and for `experiment`.
"""

from __future__ import annotations

import functools
import os
import socket
import struct
import time
from collections.abc import Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Any, BinaryIO

from ember.loggers.logger import Logger, public_params

if TYPE_CHECKING:
    from tensorboard.compat.proto.summary_pb2 import Summary
    from torch import Tensor
    from torch.utils.tensorboard import SummaryWriter


#: Logging calls queued at most before they are handed to TensorBoard (bounds the queue's memory).
MAX_QUEUED = 1000


class TensorBoardLogger(Logger):
    """Writes TensorBoard event files: one scalar per metric per logging step.

    Without ``save_dir`` the events go to ``<run dir>/tensorboard``, so
    ``tensorboard --logdir runs`` shows every run. Hyperparameters appear in
    TensorBoard's HPARAMS tab together with the final value of every logged
    metric (written when the run finishes). ``log_histograms_every_n_steps=N``
    also writes histograms of every weight and gradient (before clipping)
    every N optimizer steps.

    Scalars are queued and written in one batch at the next `save` (epoch
    ends, before checkpoints, at the end of the run), once ``flush_secs`` have
    passed since the last batch (as often as TensorBoard's own writer reaches
    the disk), or at `MAX_QUEUED` queued calls. A logging step costs one list
    append. The events file is written by `EventFile`, without importing
    TensorBoard's writer (a slow import); histograms and `experiment` use
    ``torch.utils.tensorboard.SummaryWriter``.

    On resume (`load_state_dict`) events after the checkpoint's step are purged,
    so the curves read as if the run had never stopped.
    """

    def __init__(
        self,
        save_dir: str | os.PathLike[str] | None = None,
        *,
        log_histograms_every_n_steps: int | None = None,
        flush_secs: float = 30.0,
    ) -> None:
        super().__init__(save_dir)
        if log_histograms_every_n_steps is not None and log_histograms_every_n_steps < 1:
            raise ValueError(f"log_histograms_every_n_steps={log_histograms_every_n_steps!r}: use a positive int")
        self.log_histograms_every_n_steps = log_histograms_every_n_steps
        self.flush_secs = flush_secs
        self._writer: SummaryWriter | None = None
        self._events: EventFile | None = None
        self._purge_step: int | None = None
        self._hparams: dict[str, Any] | None = None
        self._hparams_written = False
        self._metric_names: dict[str, None] = {}  # insertion-ordered set
        self._queued: list[tuple[int, float, dict[str, float]]] = []  # (step, wall time, metrics)
        self._next_write = time.monotonic() + flush_secs

    def attach(self, run_dir: Path) -> None:
        """Without ``save_dir``, write into ``<run_dir>/tensorboard``."""
        if self._save_dir is None:
            self._save_dir = Path(run_dir) / "tensorboard"

    @property
    def experiment(self) -> SummaryWriter:
        """This logger's ``torch.utils.tensorboard.SummaryWriter``, for anything else you want to write.

        Created on first use, which imports TensorBoard's writer (histogram logging creates it at the
        first histogram). It writes into the logger's own event file, so one file holds everything the
        run logs, and a file it starts after being closed is named like the logger's (sorting after
        every earlier file in the folder).
        """
        if self._writer is None:
            from ember.loggers.tensorboard_writer import summary_writer

            self._writer = summary_writer(self.log_dir, self._event_file)
        return self._writer

    def _event_file(self) -> EventFile:
        if self._events is None or self._events.closed:
            self._events = EventFile(self.log_dir, purge_step=self._purge_step)
            self._purge_step = None  # purge once, when the resumed run writes its first event
        return self._events

    def log_metrics(self, metrics: dict[str, float], step: int) -> None:
        """Queue one scalar per metric at `step`, stamped with the time of this call."""
        self._queued.append((step, time.time(), metrics))
        if len(self._queued) >= MAX_QUEUED or time.monotonic() >= self._next_write:
            self._write_queued()

    def _write_queued(self) -> None:
        self._next_write = time.monotonic() + self.flush_secs
        if not self._queued:
            return
        events = self._event_file()  # raises on a read-only folder: the scalars stay queued
        queued, self._queued = self._queued, []
        for step, wall_time, metrics in queued:
            events.add_scalars(metrics, step, wall_time)
            self._metric_names.update(dict.fromkeys(metrics))
        events.flush()  # on disk at most flush_secs after it was logged, as with TensorBoard's own writer

    def log_hyperparams(self, params: dict[str, Any]) -> None:
        """Remember the hyperparameters; they are written with the final metrics when the run finishes."""
        self._hparams = flatten_params(public_params(params))

    def log_histograms(self, values: dict[str, Tensor], step: int) -> None:
        """Add a histogram per tensor at `step` (copies each tensor to the CPU)."""
        writer = self.experiment
        for name, tensor in values.items():
            writer.add_histogram(name, tensor.detach().float().cpu(), step)

    def save(self) -> None:
        """Write the queued scalars and flush every event to disk."""
        self._write_queued()
        if self._events is not None:
            self._events.flush()
        if self._writer is not None:
            self._writer.flush()

    def finalize(self, status: str) -> None:
        """Write the queued scalars, the hyperparameters with the final metrics (once), and close the file."""
        self._write_queued()
        if self._hparams and not self._hparams_written:
            self._write_hparams(self._hparams)
        self._close()

    def _close(self) -> None:
        if self._writer is not None:
            self._writer.close()
            self._writer = None
        if self._events is not None:
            self._events.close()
            self._events = None

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Continue a run: events the checkpoint does not cover are purged when writing resumes. The run logs
        optimizer step N at step N - 1 (Lightning's axis), so a checkpoint at ``state["step"]`` covers the events
        before that step."""
        self._purge_step = int(state["step"])
        self._queued = [queued for queued in self._queued if queued[0] < self._purge_step]  # the rest is purged
        self._close()  # the next write opens a new file that starts with the purge marker

    def _write_hparams(self, params: dict[str, Any]) -> None:
        # The HPARAMS tab reads each metric's value from its scalar curve; the
        # experiment summary only has to name them.
        metrics = [name for name in self._metric_names if name != "epoch"]
        events = self._event_file()
        for summary in hparams_summaries(params, metrics):
            events.add_summary(summary, step=0, wall_time=time.time())
        self._hparams_written = True


def flatten_params(params: Mapping[str, Any], prefix: str = "") -> dict[str, Any]:
    """Nested dicts become ``a/b`` keys; values TensorBoard cannot show (lists, None, objects) become strings."""
    flat: dict[str, Any] = {}
    for key, value in params.items():
        name = f"{prefix}{key}"
        if isinstance(value, Mapping):
            flat.update(flatten_params(value, prefix=f"{name}/"))
        elif isinstance(value, (bool, int, float, str)):
            flat[name] = value
        else:
            flat[name] = str(value)
    return flat


# --- writing event files -------------------------------------------------------------------------------


class EventFile:
    """Appends TensorBoard events to a new ``events.out.tfevents.*`` file in `log_dir`.

    TensorBoard's record format: for each serialized ``Event``, its length (8 bytes, little-endian), the
    masked CRC-32C of those 8 bytes, the event, and its masked CRC-32C. The first event names the file
    format; with `purge_step`, a session start at that step follows, which makes TensorBoard drop the
    events of earlier files at that step and after (a resumed run's curves continue where the
    checkpoint was taken).
    """

    def __init__(self, log_dir: Path, purge_step: int | None = None) -> None:
        from tensorboard.compat.proto import event_pb2, summary_pb2

        self._event_pb2, self._summary_pb2 = event_pb2, summary_pb2
        log_dir.mkdir(parents=True, exist_ok=True)
        # TensorBoard reads a folder's files in name order: this one sorts after every file already there
        stamp = max(int(time.time()), _newest_stamp(log_dir) + 1)
        self.path = log_dir / f"events.out.tfevents.{stamp:010d}.{socket.gethostname()}.{os.getpid()}"
        self._file: BinaryIO = open(self.path, "wb")  # noqa: SIM115  (closed by close())
        self.add_event(event_pb2.Event(wall_time=time.time(), file_version="brain.Event:2"))
        if purge_step is not None:
            start = event_pb2.SessionLog(status=event_pb2.SessionLog.START)
            self.add_event(event_pb2.Event(wall_time=time.time(), step=purge_step, session_log=start))

    def add_scalars(self, metrics: Mapping[str, float], step: int, wall_time: float) -> None:
        """One scalar event per metric, as ``SummaryWriter.add_scalar`` writes them."""
        Summary = self._summary_pb2.Summary
        for name, value in metrics.items():
            summary = Summary(value=[Summary.Value(tag=name, simple_value=value)])
            self.add_event(self._event_pb2.Event(wall_time=wall_time, step=step, summary=summary))

    def add_summary(self, summary: Summary, step: int, wall_time: float) -> None:
        self.add_event(self._event_pb2.Event(wall_time=wall_time, step=step, summary=summary))

    def add_event(self, event: Any) -> None:
        """Append one ``Event`` record."""
        data = event.SerializeToString()
        header = struct.pack("<Q", len(data))
        self._file.write(
            header + struct.pack("<I", masked_crc32c(header)) + data + struct.pack("<I", masked_crc32c(data))
        )

    def flush(self) -> None:
        self._file.flush()

    def close(self) -> None:
        self._file.close()

    @property
    def closed(self) -> bool:
        return self._file.closed


def _newest_stamp(log_dir: Path) -> int:
    """The largest seconds field among the event files in `log_dir` (-1 if none): a new file's name must sort
    after them even when the clock stepped back or the host name changed since they were written."""
    stamps = [-1]
    for path in log_dir.glob("events.out.tfevents.*"):
        fields = path.name.split(".")
        if len(fields) > 3 and fields[3].isdigit():
            stamps.append(int(fields[3]))
    return max(stamps)


@functools.cache
def _crc32c_table() -> tuple[int, ...]:
    table = []
    for byte in range(256):
        crc = byte
        for _ in range(8):
            crc = (crc >> 1) ^ (0x82F63B78 if crc & 1 else 0)  # the Castagnoli polynomial, reflected
        table.append(crc)
    return tuple(table)


def masked_crc32c(data: bytes) -> int:
    """CRC-32C of `data`, masked as TFRecord files store it."""
    table, crc = _crc32c_table(), 0xFFFFFFFF
    for byte in data:
        crc = table[(crc ^ byte) & 0xFF] ^ (crc >> 8)
    crc ^= 0xFFFFFFFF
    return (((crc >> 15) | (crc << 17)) + 0xA282EAD8) & 0xFFFFFFFF


def hparams_summaries(params: Mapping[str, Any], metric_names: list[str]) -> list[Summary]:
    """The three summaries of TensorBoard's HPARAMS tab: the experiment (hyperparameter and metric names),
    the session start (the values), the session end (success), as ``torch.utils.tensorboard``'s
    ``hparams()`` makes them. Values are numbers (bools too), strings, or shown as strings."""
    from tensorboard.compat.proto.summary_pb2 import Summary, SummaryMetadata
    from tensorboard.plugins.hparams import api_pb2, plugin_data_pb2

    start = plugin_data_pb2.SessionStartInfo()
    infos = []
    for name, value in params.items():
        if value is None:
            continue
        if isinstance(value, (bool, int, float)):
            start.hparams[name].number_value = value
            kind = "DATA_TYPE_FLOAT64"
        else:
            start.hparams[name].string_value = str(value)
            kind = "DATA_TYPE_STRING"
        infos.append(api_pb2.HParamInfo(name=name, type=api_pb2.DataType.Value(kind)))
    experiment = api_pb2.Experiment(
        hparam_infos=infos, metric_infos=[api_pb2.MetricInfo(name=api_pb2.MetricName(tag=m)) for m in metric_names]
    )
    end = plugin_data_pb2.SessionEndInfo(status=api_pb2.Status.Value("STATUS_SUCCESS"))
    summaries = []
    for tag, content in (
        ("_hparams_/experiment", plugin_data_pb2.HParamsPluginData(experiment=experiment, version=0)),
        ("_hparams_/session_start_info", plugin_data_pb2.HParamsPluginData(session_start_info=start, version=0)),
        ("_hparams_/session_end_info", plugin_data_pb2.HParamsPluginData(session_end_info=end, version=0)),
    ):
        plugin = SummaryMetadata.PluginData(plugin_name="hparams", content=content.SerializeToString())
        summaries.append(Summary(value=[Summary.Value(tag=tag, metadata=SummaryMetadata(plugin_data=plugin))]))
    return summaries
