"""The three properties as plain checks, shared by the generated tests and the explicit regression tests.

Each raises AssertionError naming the configuration and every difference found.
"""

from __future__ import annotations

import multiprocessing
import random
import socket
from pathlib import Path
from typing import Any

import exact_workload
import torch
from exact_workload import Config, differences, ember_run, raw_run

CHILD_TIMEOUT_S = 180
#: 2 processes x batch B against 1 process x batch 2B: fp32 sums in another order. Absolute below 1, relative
#: above (a loss of 8.84 is 1 ulp of fp32 away from 8.84 + 9.5e-7).
DDP_TOLERANCE = 1e-6

_context: Any = None


def new_processes() -> Any:
    """A multiprocessing context whose processes are forked from a server that imported torch, ember and
    this suite's workload but never trained: each is a new process with nothing of the test's state."""
    global _context
    if _context is None:
        _context = multiprocessing.get_context("forkserver")
        _context.set_forkserver_preload(exact_workload.PRELOAD)
    return _context


def _own_streams() -> Any:
    class Own:
        def __enter__(self) -> None:
            self.python = random.getstate()
            self.fork = torch.random.fork_rng(devices=[])
            self.fork.__enter__()

        def __exit__(self, *exc: Any) -> None:
            self.fork.__exit__(*exc)
            random.setstate(self.python)

    return Own()


def check_parity(cfg: Config, root: Path) -> None:
    """(a) ember equals the raw loop bitwise."""
    with _own_streams():
        want = raw_run(cfg).to_dict()
        got = ember_run(cfg, root).to_dict()
    problems = differences(got, want)
    assert not problems, f"{cfg!r}: ember differs from the raw loop: " + "; ".join(problems)


def uninterrupted(cfg: Config, root: Path) -> dict[str, Any]:
    with _own_streams():
        return ember_run(cfg, root).to_dict()


def check_resume(cfg: Config, stop_at: int, root: Path, full: dict[str, Any] | None = None) -> None:
    """(b) stopped after `stop_at` steps, resumed in a new process: equal to the uninterrupted run bitwise."""
    full = full if full is not None else uninterrupted(cfg, root / "full")
    with _own_streams():
        first = ember_run(cfg, root / "split", stop_at=stop_at).to_dict()
    assert first["steps"] == stop_at, f"{cfg!r}: the first half stopped at step {first['steps']}, not {stop_at}"
    second = _in_new_processes(cfg, [(exact_workload.resume_in_child, root / "split", ())])[0]
    split = {**second, "losses": first["losses"] + second["losses"]}
    problems = differences(split, full)
    assert not problems, f"{cfg!r} stopped after step {stop_at}: the resumed run differs: " + "; ".join(problems)


def check_ddp(cfg: Config, root: Path) -> None:
    """(c) 2 gloo processes with batch B equal 1 process with batch 2B within `DDP_TOLERANCE`."""
    with _own_streams():
        single = ember_run(cfg, root / "single", batch_size=2 * cfg.batch_size).to_dict()
    port = _free_port()
    (root / "ddp").mkdir(parents=True, exist_ok=True)
    ranks = _in_new_processes(cfg, [(exact_workload.ddp_rank, root / "ddp", (rank, port)) for rank in range(2)])
    assert [r["world_size"] for r in ranks] == [2, 2] and single["world_size"] == 1
    assert ranks[0]["steps"] == ranks[1]["steps"] == single["steps"], (
        f"{cfg!r}: steps {ranks[0]['steps']}, {ranks[1]['steps']} vs one process {single['steps']}"
    )
    mean_losses = [(a + b) / 2 for a, b in zip(ranks[0]["losses"], ranks[1]["losses"], strict=True)]
    for rank, result in enumerate(ranks):
        merged = {**result, "losses": mean_losses}
        problems = differences(merged, single, exact=False, tol=DDP_TOLERANCE)
        assert not problems, f"{cfg!r}: rank {rank} (2 x batch B) differs from 1 x batch 2B: " + "; ".join(problems)


def _in_new_processes(cfg: Config, targets: list[tuple[Any, Path, tuple[Any, ...]]]) -> list[dict[str, Any]]:
    """Run each ``(function, root, extra)`` as ``function(cfg fields, root, out, *extra)`` in a new process,
    all at once; return what each saved to `out`."""
    context = new_processes()
    outs, processes = [], []
    for i, (function, root, extra) in enumerate(targets):
        out = root / f"result-{i}.pt"
        process = context.Process(target=function, args=(cfg.as_dict(), str(root), str(out), *extra))
        process.start()
        processes.append(process)
        outs.append(out)
    for process in processes:
        process.join(CHILD_TIMEOUT_S)
    hung = [p for p in processes if p.is_alive()]
    for process in hung:
        process.kill()
        process.join()
    assert not hung, f"{cfg!r}: a new process did not finish within {CHILD_TIMEOUT_S} s"
    codes = [p.exitcode for p in processes]
    assert codes == [0] * len(processes), f"{cfg!r}: a new process failed (exit codes {codes}); see its output"
    return [torch.load(out, weights_only=True) for out in outs]


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])
