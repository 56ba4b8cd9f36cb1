"""Starting distributed jobs from the tests: torchrun commands, plain process groups, bounded waits.

Every job runs in its own session (process group), so a job that outlives its timeout is killed
with all its workers, never left behind. Workers exchange results through files: each rank writes
``<name>-rank<R>.pt`` (see `dist_workload.save_result`) and the tests read them with `results`.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

HERE = Path(__file__).resolve().parent
WORKLOAD = HERE / "dist_workload.py"
FORKRUN = HERE / "forkrun.py"

#: Variables of an enclosing launcher (a CI job under SLURM or torchrun) that must not leak into a job.
_LAUNCHER_VARS = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "GROUP_RANK", "NODE_RANK", "ROLE_RANK")
_LAUNCHER_PREFIXES = ("SLURM_", "TORCHELASTIC_", "MASTER_", "PMI_", "OMPI_")


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def clean_env(extra: Mapping[str, str] | None = None) -> dict[str, str]:
    """This environment without launcher variables, one thread per process (as torchrun sets), plus `extra`."""
    env = {
        k: v
        for k, v in os.environ.items()
        if k not in _LAUNCHER_VARS and not k.startswith(_LAUNCHER_PREFIXES) and k != "PYTEST_CURRENT_TEST"
    }
    env["OMP_NUM_THREADS"] = "1"
    env["PYTHONUNBUFFERED"] = "1"
    env.update(extra or {})
    return env


def write_script(directory: Path, body: str, name: str = "job.py") -> Path:
    """A small script in `directory` next to a copy of `dist_workload.py` (the script's `import` finds it)."""
    directory.mkdir(parents=True, exist_ok=True)
    shutil.copy(WORKLOAD, directory / WORKLOAD.name)
    script = directory / name
    script.write_text(body, encoding="utf-8")
    return script


def torchrun(
    script: Path,
    *args: str,
    nproc: int = 2,
    nnodes: int = 1,
    endpoint: str | None = None,
    node_rank: int | None = None,
    max_restarts: int = 0,
    run_id: str = "ember-test",
) -> list[str]:
    """``python -m torch.distributed.run`` (torchrun, same interpreter): standalone unless `endpoint` is given."""
    cmd = [sys.executable, "-m", "torch.distributed.run", f"--nproc-per-node={nproc}", "--monitor-interval=0.2"]
    if endpoint is None:
        cmd.append("--standalone")
    else:
        cmd += [f"--nnodes={nnodes}", "--rdzv-backend=c10d", f"--rdzv-endpoint={endpoint}", f"--rdzv-id={run_id}"]
        if node_rank is not None:
            cmd.append(f"--node-rank={node_rank}")
    if max_restarts:
        cmd.append(f"--max-restarts={max_restarts}")
    return [*cmd, str(script), *args]


def spawn(
    script: Path, *args: str, nproc: int = 2, preload: Sequence[str] = (), path: Sequence[Path] = ()
) -> list[str]:
    """A single-node job of `nproc` ranks forked from one launcher that imported what `script` imports (and
    `preload`, also looked up in `path`) once: `forkrun.py`. For jobs that test what ember does on several
    processes, not what torchrun does (restarts, rendezvous, its agent): those use `torchrun`."""
    cmd = [sys.executable, str(FORKRUN), f"--nproc-per-node={nproc}"]
    if preload:
        cmd.append(f"--preload={','.join(preload)}")
    if path:
        cmd.append(f"--path={os.pathsep.join(map(str, path))}")
    return [*cmd, str(script), *args]


@dataclass
class Finished:
    """How a process ended: exit status (None: killed at the timeout), output, seconds it ran, the wall-clock
    time it ended (``time.time()``), and whether processes of its session outlived it (by more than 5 s)."""

    returncode: int | None
    output: str
    seconds: float
    ended_at: float
    leftover: bool = False

    @property
    def timed_out(self) -> bool:
        return self.returncode is None

    def tail(self, lines: int = 60) -> str:
        return "\n".join(self.output.splitlines()[-lines:])


class Job:
    """A process started in its own session; `wait` bounds it and kills the whole session at the timeout."""

    def __init__(self, cmd: Sequence[str], cwd: Path, env: Mapping[str, str] | None = None) -> None:
        self.log = cwd / f".job-{time.monotonic_ns()}.log"
        self._file = open(self.log, "wb")  # noqa: SIM115  (closed in wait)
        self.start = time.monotonic()
        self.proc = subprocess.Popen(
            list(cmd),
            cwd=cwd,
            env=dict(env or clean_env()),
            stdout=self._file,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )

    def wait(self, timeout: float) -> Finished:
        try:
            returncode: int | None = self.proc.wait(timeout=max(timeout - (time.monotonic() - self.start), 0.1))
        except subprocess.TimeoutExpired:
            returncode = None
        seconds, ended_at = time.monotonic() - self.start, time.time()
        leftover = returncode is not None and self._session_outlives(grace_s=5.0)
        self.kill()
        self._file.close()
        output = self.log.read_text(encoding="utf-8", errors="replace")
        return Finished(returncode, output, seconds, ended_at, leftover)

    def _session_outlives(self, grace_s: float) -> bool:
        """Whether some process of the session is still there `grace_s` after the main one ended."""
        deadline = time.monotonic() + grace_s
        while True:
            try:
                os.killpg(self.proc.pid, 0)
            except ProcessLookupError:
                return False
            if time.monotonic() > deadline:
                return True
            time.sleep(0.1)

    def kill(self) -> None:
        """SIGKILL everything left in the job's session (workers a launcher failed to stop included)."""
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(self.proc.pid, signal.SIGKILL)
        with contextlib.suppress(subprocess.TimeoutExpired):
            self.proc.wait(timeout=10)


def run(cmd: Sequence[str], cwd: Path, timeout: float, env: Mapping[str, str] | None = None) -> Finished:
    return Job(cmd, cwd, env).wait(timeout)


def results(directory: Path, name: str, world_size: int, job: Finished | None = None) -> list[dict[str, Any]]:
    """The result every rank wrote for `name`, in rank order. An AssertionError carries the traceback a rank
    saved instead (`dist_workload.section`), or names the missing results (with the job's output tail)."""
    errors = sorted(directory.glob(f"{name}.error-rank*.pt"))
    if errors:
        traceback = torch.load(errors[0], weights_only=True)["traceback"]
        raise AssertionError(f"{name} raised on {errors[0].name}:\n{traceback}")
    files = [directory / f"{name}-rank{rank}.pt" for rank in range(world_size)]
    missing = [f.name for f in files if not f.exists()]
    if missing:
        found = sorted(p.name for p in directory.glob("*.pt")) if directory.is_dir() else []
        raise AssertionError(f"no result {missing} in {directory} (found {found}); {describe(job) if job else ''}")
    return [torch.load(f, weights_only=True) for f in files]


def describe(job: Finished) -> str:
    status = "timed out" if job.timed_out else f"exit {job.returncode}"
    return f"job {status} after {job.seconds:.1f} s; output tail:\n{job.tail()}"


def assert_params_equal(a: Mapping[str, torch.Tensor], b: Mapping[str, torch.Tensor], what: str) -> None:
    """Bitwise equality of two state dicts, with the largest difference in the message."""
    assert a.keys() == b.keys(), f"{what}: keys differ: {sorted(a)} vs {sorted(b)}"
    diff = {k: float((a[k].double() - b[k].double()).abs().max()) for k in a}
    assert all(torch.equal(a[k], b[k]) for k in a), f"{what}: not bitwise equal; max abs diff per tensor {diff}"


def assert_params_close(a: Mapping[str, torch.Tensor], b: Mapping[str, torch.Tensor], what: str) -> None:
    """``allclose(rtol=1e-5)`` per tensor (atol 1e-7 for entries near zero)."""
    assert a.keys() == b.keys(), f"{what}: keys differ: {sorted(a)} vs {sorted(b)}"
    for k in a:
        diff = float((a[k].double() - b[k].double()).abs().max())
        assert torch.allclose(a[k], b[k], rtol=1e-5, atol=1e-7), f"{what}: {k} differs by up to {diff:.3g}"
