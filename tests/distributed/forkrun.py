"""A torchrun stand-in for the tests' single-node jobs: import once, fork every rank.

``python forkrun.py --nproc-per-node=N [--preload=MOD,...] [--path=DIRS] script.py args...`` imports torch, ember,
what a rank imports during a fit (`RANK_IMPORTS`, unless the script imports only the standard library), the
modules ``script.py`` imports at its top level and the `--preload` modules once, then forks N ranks. Each
rank gets the variables torchrun gives its workers (``RANK``, ``LOCAL_RANK``, ``WORLD_SIZE``,
``LOCAL_WORLD_SIZE``, ``GROUP_RANK``, ``MASTER_ADDR``, ``MASTER_PORT``, ``TORCHELASTIC_RUN_ID``) and runs
``script.py`` as ``__main__`` with ``sys.argv`` set, as ``python script.py args...`` would. Under torchrun
each worker pays over a second of CPU importing torch and its dependencies (four with torchmetrics), and the
agent as much again; on the 2-core test machine that was a large part of a distributed test's cost.

What it does as torchrun does: when a rank fails (non-zero exit or a signal), the others get SIGTERM, then
SIGKILL after `GRACE_S`, and the launcher exits 1; SIGTERM, SIGINT and SIGUSR1 sent to the launcher are passed
to every rank. What it does not do: restarts, multi-node rendezvous, the agent's store (rank 0 hosts the
store), error files. Tests of those use real torchrun (`dist_harness.torchrun`).

A rank whose script returns ends as the interpreter would (threads joined, atexit handlers run, streams
flushed) but skips the teardown of its modules and objects, which took 1.5-2 s of CPU per rank (`_end`); the
launcher ends the same way.

The launcher imports modules but runs nothing before it forks, so no thread pool or process group is
inherited: each rank starts as a fresh interpreter that happens to have its imports done.
"""

from __future__ import annotations

import argparse
import ast
import atexit
import contextlib
import importlib
import os
import runpy
import signal
import sys
import threading
import time
import uuid

from dist_harness import free_port  # this file's folder: first on sys.path when run as a script

#: Seconds a rank has to end after SIGTERM before it is killed (torchrun's agent waits 30 s; tests are shorter).
GRACE_S = 10.0
#: Signals the launcher passes on to every rank.
FORWARDED = (signal.SIGTERM, signal.SIGINT, signal.SIGUSR1)
#: What almost every rank imports on its way through a fit, imported once here instead when the script imports
#: more than the standard library: DDP's constructor imports torch._dynamo (with inductor's tracing rules, about
#: 1 s of CPU), and checkpoints, FSDP and tensor parallelism import torch.distributed.checkpoint (with DTensor,
#: about 0.6 s).
RANK_IMPORTS = ("torch._dynamo", "torch.distributed.checkpoint")


def _imports_of(script: str) -> list[str]:
    """The modules `script` imports at its top level (what every rank would import first)."""
    with open(script, encoding="utf-8") as file:
        tree = ast.parse(file.read(), script)
    names: list[str] = []
    for node in tree.body:
        if isinstance(node, ast.Import):
            names += [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom) and node.module and not node.level and node.module != "__future__":
            names.append(node.module)
    return names


def _run_rank(rank: int, nproc: int, port: int, run_id: str, script: str, args: list[str]) -> None:
    """In the forked child: become rank `rank` and run the script as ``python script args`` would."""
    for sig in FORWARDED:
        signal.signal(sig, signal.SIG_DFL if sig != signal.SIGINT else signal.default_int_handler)
    os.environ.update(
        {
            "RANK": str(rank),
            "LOCAL_RANK": str(rank),
            "WORLD_SIZE": str(nproc),
            "LOCAL_WORLD_SIZE": str(nproc),
            "GROUP_RANK": "0",
            "ROLE_RANK": str(rank),
            "MASTER_ADDR": "127.0.0.1",
            "MASTER_PORT": str(port),
            "TORCHELASTIC_RUN_ID": run_id,
            "TORCHELASTIC_RESTART_COUNT": "0",
        }
    )
    sys.argv = [script, *args]
    runpy.run_path(script, run_name="__main__")


def _end(code: int) -> None:
    """End this process as the interpreter ends one whose script returned: join the threads that are not daemons,
    run the atexit handlers (multiprocessing's, tempfile's and ember's among them), flush the standard streams;
    then exit without the teardown of every module and object that follows. That teardown freed the heap of a
    rank that ran several fits in 1.5-2 s of CPU, per rank and job; nothing a test reads happens in it."""
    threading._shutdown()  # type: ignore[attr-defined]  # what the interpreter calls first at its end
    atexit._run_exitfuncs()
    for stream in (sys.stdout, sys.stderr):
        with contextlib.suppress(Exception):
            stream.flush()
    os._exit(code)


def _supervise(pids: list[int]) -> int:
    """Wait for every rank; on the first failure stop the others. 0 if every rank exited 0, else 1."""
    received: list[int] = []

    def forward(signum: int, _frame: object) -> None:
        received.append(signum)
        for pid in pids:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signum)

    for sig in FORWARDED:
        signal.signal(sig, forward)
    running, failed, deadline = set(pids), False, None
    while running:
        try:
            pid, status = os.waitpid(-1, os.WNOHANG)
        except ChildProcessError:
            break
        if pid == 0:
            if deadline is not None and time.monotonic() > deadline:
                for other in running:
                    with contextlib.suppress(ProcessLookupError):
                        os.kill(other, signal.SIGKILL)
                deadline = None
            time.sleep(0.02)
            continue
        if pid not in running:
            continue
        running.discard(pid)
        code = os.waitstatus_to_exitcode(status)
        if code != 0:
            rank = pids.index(pid)
            print(f"forkrun: rank {rank} (pid {pid}) ended with {code}", file=sys.stderr, flush=True)
            if not failed:
                failed, deadline = True, time.monotonic() + GRACE_S
                for other in running:
                    with contextlib.suppress(ProcessLookupError):
                        os.kill(other, signal.SIGTERM)
    return 1 if failed or received else 0


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--nproc-per-node", type=int, default=2)
    parser.add_argument("--preload", default="", help="comma-separated modules to import before forking")
    parser.add_argument("--path", default="", help="os.pathsep-separated folders to import --preload modules from")
    parser.add_argument("script")
    parser.add_argument("args", nargs=argparse.REMAINDER)
    options = parser.parse_args()
    script = os.path.abspath(options.script)
    sys.path[0] = os.path.dirname(script)  # as `python script.py` would have it
    sys.path[1:1] = [folder for folder in options.path.split(os.pathsep) if folder]
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    imports = _imports_of(script)
    fits = any(name.partition(".")[0] not in sys.stdlib_module_names for name in imports)
    for name in [
        "torch",
        "ember",
        *(RANK_IMPORTS if fits else ()),
        *imports,
        *filter(None, options.preload.split(",")),
    ]:
        with contextlib.suppress(ImportError):  # the rank meets the same error and reports it
            importlib.import_module(name)
    port, run_id = free_port(), uuid.uuid4().hex[:8]
    sys.stdout.flush()
    sys.stderr.flush()
    pids: list[int] = []
    for rank in range(options.nproc_per_node):
        pid = os.fork()
        if pid == 0:
            # a script that raises (SystemExit included) ends as `python script.py` would; one that returns: `_end`
            _run_rank(rank, options.nproc_per_node, port, run_id, script, options.args)
            _end(0)
        pids.append(pid)
    _end(_supervise(pids))


if __name__ == "__main__":
    main()
