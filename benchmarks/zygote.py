"""A "zygote": a process that imports torch and ember once, then forks training launches on request.

Importing torch takes seconds; a fork of a process that has done it takes milliseconds, so the fault
injection benchmarks (`kill9.py`, `soak.py`) can start hundreds of launches. Nothing of a previous
launch survives in the zygote: each launch is a fresh fork.

The zygote runs ``<the caller's script> + SERVE``: the caller's script defines ``train(**args)``;
`SERVE` answers ``spawn`` and ``poll`` requests, one JSON line each on stdin/stdout. A launch writes
its output to its own log and exits with ``train``'s status (``SystemExit`` code, 1 for an exception).
"""

from __future__ import annotations

import contextlib
import json
import os
import select
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]

SERVE = """

def _launch_child(request):
    import traceback

    fd = os.open(request["log"], os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
    os.dup2(fd, 1)
    os.dup2(fd, 2)
    if request.get("pgid") is not None:  # launches that must be signalled together share a process group
        os.setpgid(0, request["pgid"] or 0)
    code = 0
    try:
        train(**request["args"])
    except SystemExit as exc:
        code = exc.code if isinstance(exc.code, int) else 1
    except BaseException:
        traceback.print_exc()
        code = 1
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


def _serve():
    import contextlib
    import json

    print("ready", flush=True)
    while True:
        line = sys.stdin.readline()
        if not line:
            break
        request = json.loads(line)
        if request["op"] == "spawn":
            pid = os.fork()
            if pid == 0:
                _launch_child(request)
            if request.get("pgid") is not None:
                with contextlib.suppress(PermissionError, ProcessLookupError):
                    os.setpgid(pid, request["pgid"] or pid)  # (the child does it too: whichever runs first)
            reply = {"pid": pid}
        else:  # "poll": exit code of a launch, or None while it runs
            done, status = os.waitpid(request["pid"], 0 if request["block"] else os.WNOHANG)
            reply = {"returncode": os.waitstatus_to_exitcode(status) if done else None}
        print(json.dumps(reply), flush=True)


_serve()
"""


class Zygote:
    """The zygote process of `script` (which defines ``train(**args)``), started in `workdir`."""

    def __init__(self, workdir: Path, script: str, timeout_s: float = 120.0) -> None:
        path = workdir / "zygote.py"
        path.write_text(script + SERVE)
        launcher_vars = ("RANK", "WORLD_SIZE", "LOCAL_", "MASTER_", "TORCHELASTIC_")
        env = {k: v for k, v in os.environ.items() if not k.startswith(launcher_vars)}
        env["PYTHONPATH"] = os.pathsep.join([str(REPO), *filter(None, [env.get("PYTHONPATH")])])
        env["OMP_NUM_THREADS"] = "1"
        self.timeout_s = timeout_s
        self.live: set[int] = set()
        self.exited: dict[int, int] = {}
        self._buffer = b""
        with open(workdir / "zygote.log", "wb") as log:
            self.proc = subprocess.Popen(
                [sys.executable, str(path)], stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=log, cwd=workdir,
                env=env,
            )  # fmt: skip
        try:
            started = self._readline() == b"ready"
        except (TimeoutError, RuntimeError):
            started = False
        if not started:
            self.close()
            raise RuntimeError(f"the zygote did not start; see {workdir / 'zygote.log'}")

    def _readline(self) -> bytes:
        assert self.proc.stdout is not None
        deadline = time.monotonic() + self.timeout_s
        fd = self.proc.stdout.fileno()
        while b"\n" not in self._buffer:
            left = deadline - time.monotonic()
            if left <= 0 or not select.select([fd], [], [], left)[0]:
                raise TimeoutError("the zygote did not answer")
            chunk = os.read(fd, 65536)
            if not chunk:
                raise RuntimeError("the zygote exited")
            self._buffer += chunk
        line, self._buffer = self._buffer.split(b"\n", 1)
        return line.strip()

    def _ask(self, request: dict[str, Any]) -> dict[str, Any]:
        assert self.proc.stdin is not None
        self.proc.stdin.write(json.dumps(request).encode() + b"\n")
        self.proc.stdin.flush()
        reply: dict[str, Any] = json.loads(self._readline())
        return reply

    def spawn(self, log: Path, pgid: int | None = None, **args: Any) -> int:
        """Fork a launch running ``train(**args)``; `pgid` (0: a new group) puts it in a process group."""
        pid = int(self._ask({"op": "spawn", "log": str(log), "pgid": pgid, "args": args})["pid"])
        self.live.add(pid)
        return pid

    def poll(self, pid: int) -> int | None:
        """The launch's exit status, or None while it runs (remembered: a process is reaped only once)."""
        if pid in self.exited:
            return self.exited[pid]
        code = self._ask({"op": "poll", "pid": pid, "block": False})["returncode"]
        if code is not None:
            self.live.discard(pid)
            self.exited[pid] = code
        return code

    def wait(self, pid: int, timeout_s: float | None = None) -> int:
        deadline = time.monotonic() + (timeout_s or self.timeout_s)
        while (code := self.poll(pid)) is None:
            if time.monotonic() > deadline:
                raise TimeoutError(f"launch {pid} did not finish")
            time.sleep(0.02)
        return code

    def kill(self, pid: int) -> int:
        os.kill(pid, signal.SIGKILL)
        return self.wait(pid)

    def close(self) -> None:
        for pid in list(self.live):
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
        self.live.clear()
        if self.proc.poll() is None:
            self.proc.kill()
        self.proc.wait()
        for stream in (self.proc.stdin, self.proc.stdout):
            if stream is not None:
                stream.close()
