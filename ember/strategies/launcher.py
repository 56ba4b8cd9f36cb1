"""Starting the processes ourselves: ``devices=N`` without torchrun re-runs the program under torch's
elastic launcher, N processes on this machine, then exits with their status.

This is what ``torchrun --standalone --nproc-per-node=N <your command>`` does; the
command is the one this process was started with (``sys.orig_argv``), so a YAML run
re-reads the same files and overrides in every process.

Preemption keeps its meaning through the launcher: when every worker saved a checkpoint and
exited with status 75 ("try again"), the launcher exits 75 too, with one line instead of the
elastic agent's traceback. A SIGTERM sent to the launcher itself is forwarded to the workers by
the agent; each worker that saved its checkpoint leaves a mark (`mark_preempted`), and the
launcher exits 75 when all of them did.
"""

from __future__ import annotations

import os
import shutil
import signal
import socket
import sys
import tempfile
import uuid
from collections.abc import MutableMapping
from pathlib import Path
from typing import NoReturn

#: Set in the workers' environment: the folder where each one marks a completed preemption save.
STATUS_DIR_VAR = "EMBER_LAUNCH_STATUS_DIR"
EXIT_PREEMPTED = 75


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def mark_preempted(rank: int) -> None:
    """In a worker started by `relaunch`: record that this rank saved its preemption checkpoint."""
    folder = os.environ.get(STATUS_DIR_VAR)
    if folder:
        Path(folder, f"preempted-{rank}").touch()


def _all_preempted(folder: Path, nprocs: int) -> bool:
    return all((folder / f"preempted-{rank}").exists() for rank in range(nprocs))


def set_worker_threads(nprocs: int, environ: MutableMapping[str, str]) -> None:
    """Give each of `nprocs` workers its share of this machine's cores (``OMP_NUM_THREADS``, at least 1), as
    torchrun does, unless the variable is set already: N processes each using every core slow each other down."""
    if "OMP_NUM_THREADS" in environ:
        return
    try:
        cores = len(os.sched_getaffinity(0))
    except (AttributeError, OSError):  # not Linux
        cores = os.cpu_count() or 1
    environ["OMP_NUM_THREADS"] = str(max(1, cores // nprocs))


def relaunch(nprocs: int, requeue_signal: int | None = None) -> NoReturn:
    """Run this program again in `nprocs` processes under the elastic agent; exit with their outcome.

    `requeue_signal` (e.g. SIGUSR1) is ignored by this launching process, so a signal meant for the
    workers (SLURM signals every process of the job) does not kill the launcher on the way.
    """
    from torch.distributed.elastic.multiprocessing.api import SignalException
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
    from torch.distributed.launcher.api import LaunchConfig, elastic_launch

    config = LaunchConfig(
        min_nodes=1,
        max_nodes=1,
        nproc_per_node=nprocs,
        run_id=str(uuid.uuid4()),
        rdzv_backend="c10d",
        rdzv_endpoint=f"127.0.0.1:{_free_port()}",
        max_restarts=0,
        monitor_interval=0.5,
    )
    set_worker_threads(nprocs, os.environ)
    argv = list(getattr(sys, "orig_argv", [sys.executable, *sys.argv]))[1:]
    print(f"ember: starting {nprocs} processes: {' '.join(argv)}", file=sys.stderr, flush=True)
    status = Path(tempfile.mkdtemp(prefix="ember-launch-"))
    os.environ[STATUS_DIR_VAR] = str(status)
    if requeue_signal is not None:
        signal.signal(requeue_signal, signal.SIG_IGN)  # the workers install their own handler
    try:
        elastic_launch(config, entrypoint=sys.executable)(*argv)
    except ChildFailedError as exc:
        codes = [failure.exitcode for failure in exc.failures.values()]
        if codes and all(code == EXIT_PREEMPTED for code in codes) and _all_preempted(status, nprocs):
            _exit_preempted(nprocs)
        print(f"ember: {exc.get_first_failure()[1].message or exc}", file=sys.stderr, flush=True)
        raise SystemExit(1) from None
    except SignalException as exc:
        if _all_preempted(status, nprocs):
            _exit_preempted(nprocs)
        name = signal.Signals(exc.sigval).name
        print(f"ember: stopped by {name} before every process saved a checkpoint", file=sys.stderr, flush=True)
        raise SystemExit(128 + int(exc.sigval)) from None
    finally:
        shutil.rmtree(status, ignore_errors=True)
    raise SystemExit(0)


def _exit_preempted(nprocs: int) -> NoReturn:
    print(
        f"ember: preempted: all {nprocs} processes saved a checkpoint; exiting {EXIT_PREEMPTED} "
        "(relaunch with ckpt_path='last' / --resume last to continue)",
        file=sys.stderr,
        flush=True,
    )
    raise SystemExit(EXIT_PREEMPTED)
