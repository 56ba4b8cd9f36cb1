"""``python -m ember ...`` for the tests, forked from a process that has already imported what a command imports.

A fresh ``python -m ember fit`` spends 4-5 CPU-seconds importing torch, torchmetrics (and, through it, scipy and
transformers), scikit-learn and ember before the command does anything. The tests that run many commands use
`run` instead: a server process per test process imports all that once, and each command is a fork of it that
takes the command's arguments, environment (``PYTHONPATH`` included: ``sys.path`` is rebuilt as the interpreter
builds it for ``-m``), working directory and standard streams, then runs ``ember`` as ``__main__`` and exits the
way the interpreter does (``SystemExit``'s code, 1 and a traceback for an uncaught exception, atexit handlers).

What a fork cannot show (the interpreter's start-up, the import of ember itself from ``PYTHONPATH``, import-time
settings such as ``PYTHONHASHSEED``) stays covered where it matters: each scenario's first command is a real
``python -m ember`` (`run(..., fresh=True)`), and tests/test_forked_cli.py checks that a fork and a real command
print and exit alike.
"""

from __future__ import annotations

import atexit
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import textwrap
import threading
from collections.abc import Mapping, Sequence
from pathlib import Path

#: What the server imports before it forks: what `ember fit` on the examples imports on its way.
PRELOAD = (
    "torch",
    "torch._dynamo",  # a torch optimizer imports it when it is built
    "torch.distributed.checkpoint",  # a checkpoint write
    "torchmetrics",
    "sklearn.datasets",  # the digits example's data
    "omegaconf",
    "ember",
    "ember.cli",
    "ember.config",
    "ember.loggers.csv",
    "ember.loggers.tensorboard",
)

SERVER = textwrap.dedent(
    """
    import atexit, importlib, json, os, runpy, sys, threading

    for name in json.loads(sys.argv[1]):
        try:
            importlib.import_module(name)
        except ImportError:
            pass  # an optional dependency that is not installed: a command that needs it imports it itself
    OWN = {os.path.abspath(p) for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p}
    BASE_PATH = [p for p in sys.path[1:] if p not in OWN]  # the interpreter's own entries, not PYTHONPATH's
    print("ready", flush=True)

    for line in sys.stdin:
        request = json.loads(line)
        if request["op"] == "wait":
            _, status = os.waitpid(request["pid"], 0)
            print(os.waitstatus_to_exitcode(status), flush=True)
            continue
        pid = os.fork()
        if pid:
            print(pid, flush=True)
            continue
        # the command: stdin from /dev/null, its own output files, environment, directory and sys.path
        for fd, path, flags in ((0, os.devnull, os.O_RDONLY), (1, request["out"], os.O_WRONLY | os.O_TRUNC),
                                (2, request["err"], os.O_WRONLY | os.O_TRUNC)):
            target = os.open(path, flags)
            os.dup2(target, fd)
            os.close(target)
        sys.stdin = open(0, closefd=False)
        os.environ.clear()
        os.environ.update(request["env"])
        os.chdir(request["cwd"])
        extra = [p for p in request["env"].get("PYTHONPATH", "").split(os.pathsep) if p]
        sys.path[:] = [os.getcwd(), *(os.path.abspath(p) for p in extra), *BASE_PATH]
        if "OMP_NUM_THREADS" in request["env"]:
            import torch

            torch.set_num_threads(int(request["env"]["OMP_NUM_THREADS"]))
        sys.argv = ["ember", *request["args"]]
        try:
            runpy.run_module("ember", run_name="__main__", alter_sys=True)
            code = 0
        except SystemExit as exc:  # as the interpreter reads it; any other exception ends the usual way
            code = exc.code if isinstance(exc.code, int) else (0 if exc.code is None else 1)
            if not isinstance(exc.code, int) and exc.code is not None:
                print(exc.code, file=sys.stderr)
        # the interpreter's end (threads joined, atexit handlers run, streams flushed) without the teardown of
        # every module and object after it: about a CPU-second per command in a process that imported torch
        threading._shutdown()
        atexit._run_exitfuncs()
        for stream in (sys.stdout, sys.stderr):
            try:
                stream.flush()
            except Exception:
                pass
        os._exit(code)
    """
)


class _Server:
    """One server per test process; requests from one thread at a time."""

    def __init__(self) -> None:
        folder = Path(tempfile.mkdtemp(prefix="ember-forks-"))
        self.folder = folder
        script = folder / "server.py"
        script.write_text(SERVER)
        env = {k: v for k, v in os.environ.items() if not k.startswith("PYTEST_")}  # ember from where the tests take it
        self.log = open(folder / "server.log", "wb")  # noqa: SIM115 - closed in close()
        self.proc = subprocess.Popen(
            [sys.executable, str(script), json.dumps(PRELOAD)], env=env, cwd=folder, stdin=subprocess.PIPE,
            stdout=subprocess.PIPE, stderr=self.log, text=True,
        )  # fmt: skip
        self.lock = threading.Lock()
        assert self._answer() == "ready", (folder / "server.log").read_text()
        self.count = 0

    def _answer(self) -> str:
        assert self.proc.stdout is not None
        answer = self.proc.stdout.readline().strip()
        if not answer:
            raise RuntimeError(f"the ember fork server exited: {(self.folder / 'server.log').read_text()[-3000:]}")
        return answer

    def ask(self, request: dict[str, object]) -> int:
        assert self.proc.stdin is not None
        with self.lock:
            self.proc.stdin.write(json.dumps(request) + "\n")
            self.proc.stdin.flush()
            return int(self._answer())

    def close(self) -> None:
        if self.proc.stdin is not None:
            self.proc.stdin.close()
        try:
            self.proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            self.proc.kill()
        self.log.close()
        shutil.rmtree(self.folder, ignore_errors=True)


_server: _Server | None = None


def _the_server() -> _Server:
    global _server
    if _server is None or _server.proc.poll() is not None:
        _server = _Server()
        atexit.register(_server.close)
    return _server


def run(
    args: Sequence[str],
    *,
    cwd: Path | str,
    env: Mapping[str, str],
    timeout: float = 300,
    fresh: bool = False,
) -> subprocess.CompletedProcess[str]:
    """``python -m ember *args`` in `cwd` with environment `env` (the whole environment, as `subprocess.run`'s
    `env`), its output captured as text. `fresh`: a real interpreter instead of a fork."""
    command = [sys.executable, "-m", "ember", *args]
    if fresh:
        return subprocess.run(command, cwd=cwd, env=dict(env), capture_output=True, text=True, timeout=timeout)
    server = _the_server()
    server.count += 1
    out, err = server.folder / f"{server.count}.out", server.folder / f"{server.count}.err"
    out.touch()
    err.touch()
    request = {"op": "run", "args": list(args), "env": dict(env), "cwd": str(cwd), "out": str(out), "err": str(err)}
    pid = server.ask(request)
    expired = threading.Event()

    def kill() -> None:
        expired.set()
        os.kill(pid, signal.SIGKILL)  # not reaped before the wait below: the pid is still the command's

    timer = threading.Timer(timeout, kill)
    timer.start()
    try:
        code = server.ask({"op": "wait", "pid": pid})
    finally:
        timer.cancel()
    try:
        stdout, stderr = out.read_text(), err.read_text()
    finally:
        out.unlink()
        err.unlink()
    if expired.is_set():
        raise subprocess.TimeoutExpired(command, timeout, stdout, stderr)
    return subprocess.CompletedProcess(command, code, stdout, stderr)
