"""Starting the processes ourselves: ``devices=N`` without torchrun re-runs the program under torch's
elastic launcher, N processes on this machine, then exits with their status.

This is what ``torchrun --standalone --nproc-per-node=N <your command>`` does; the
command is the one this process was started with (``sys.orig_argv``), so a YAML run
re-reads the same files and overrides in every process.
"""

from __future__ import annotations

import socket
import sys
import uuid
from typing import NoReturn


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def relaunch(nprocs: int) -> NoReturn:
    """Run this program again in `nprocs` processes under the elastic agent; exit with their outcome."""
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
    argv = list(getattr(sys, "orig_argv", [sys.executable, *sys.argv]))[1:]
    print(f"ember: starting {nprocs} processes: {' '.join(argv)}", file=sys.stderr, flush=True)
    try:
        elastic_launch(config, entrypoint=sys.executable)(*argv)
    except ChildFailedError as exc:
        print(f"ember: {exc.get_first_failure()[1].message or exc}", file=sys.stderr, flush=True)
        raise SystemExit(1) from None
    raise SystemExit(0)
