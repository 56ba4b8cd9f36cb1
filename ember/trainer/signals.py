"""Preemption: SIGTERM and a requeue signal only raise a flag; the loop acts at the next step boundary.

At that boundary ember finishes any in-flight checkpoint write, saves ``last``,
closes the loggers and exits with `EXIT_PREEMPTED`. Under SLURM the
global-zero process first asks ``scontrol requeue`` to put the job back in the
queue (for an array job, the task).
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
from types import FrameType
from typing import Any

from ember.strategies import launcher

#: Exit status after a preemption that saved a checkpoint (EX_TEMPFAIL: "try again").
EXIT_PREEMPTED = launcher.EXIT_PREEMPTED


class Preempted(SystemExit):
    """Raised at the step boundary after a preemption signal; exits with `EXIT_PREEMPTED`."""

    def __init__(self, signum: int) -> None:
        super().__init__(EXIT_PREEMPTED)
        self.signum = signum


def resolve_signal(value: str | int | None) -> signal.Signals | None:
    """``"SIGUSR1"``, ``"USR1"``, 10 or None (no requeue signal)."""
    if value is None:
        return None
    if isinstance(value, int):
        return signal.Signals(value)
    name = value.upper() if value.upper().startswith("SIG") else "SIG" + value.upper()
    try:
        return signal.Signals[name]
    except KeyError:
        valid = ", ".join(s.name for s in (signal.SIGUSR1, signal.SIGUSR2, signal.SIGHUP))
        raise ValueError(f"requeue_signal={value!r} is not a signal name; e.g. {valid}") from None


def signal_name(signum: int) -> str:
    """``SIGTERM`` for 15, and so on."""
    try:
        return signal.Signals(signum).name
    except ValueError:
        return f"signal {signum}"


class PreemptionFlag:
    """Installs handlers that only record the signal; `restore` puts the previous handlers back."""

    def __init__(self, signals: list[signal.Signals]) -> None:
        self.signals = signals
        self.received: int | None = None
        self._previous: dict[signal.Signals, Any] = {}

    def _handle(self, signum: int, frame: FrameType | None) -> None:
        self.received = signum

    def install(self) -> None:
        if threading.current_thread() is not threading.main_thread():
            return  # Python delivers signals to the main thread only
        for sig in self.signals:
            self._previous[sig] = signal.signal(sig, self._handle)

    def restore(self) -> None:
        for sig, handler in self._previous.items():
            signal.signal(sig, handler)
        self._previous.clear()


def slurm_job_to_requeue() -> str | None:
    """The SLURM job id to requeue (``<array job>_<task>`` for an array task), or None outside SLURM."""
    array_job, task = os.environ.get("SLURM_ARRAY_JOB_ID"), os.environ.get("SLURM_ARRAY_TASK_ID")
    if array_job and task:
        return f"{array_job}_{task}"
    return os.environ.get("SLURM_JOB_ID")


def requeue_slurm_job(job_id: str) -> bool:
    """Run ``scontrol requeue <job_id>``; a failure is reported on stderr, never raised."""
    try:
        result = subprocess.run(["scontrol", "requeue", job_id], capture_output=True, text=True, timeout=60)
    except FileNotFoundError:
        print(f"ember: cannot requeue SLURM job {job_id}: scontrol is not on PATH", file=sys.stderr, flush=True)
        return False
    except subprocess.TimeoutExpired:
        print(f"ember: scontrol requeue {job_id} timed out", file=sys.stderr, flush=True)
        return False
    if result.returncode != 0:
        print(f"ember: scontrol requeue {job_id} failed: {result.stderr.strip()}", file=sys.stderr, flush=True)
        return False
    print(f"ember: requeued SLURM job {job_id}", file=sys.stderr, flush=True)
    return True
