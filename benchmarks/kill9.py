"""Kill -9 fault injection: a training process is SIGKILLed at random moments and relaunched.

A training process fits a ~0.5M-parameter MLP (Adam, dropout, data shuffled by
the global RNG) with ``ModelCheckpoint(every_n_train_steps=1)`` and
``fit(ckpt_path="last")``. Writing a checkpoint (weights + Adam state, about
6 MB, fsynced) takes most of a step, so most kills land in checkpoint I/O.
After each kill, the checkpoint that ``last`` names must load; after the last
kill the run is relaunched once more and runs to completion, and its final
parameters must be bitwise equal to those of an uninterrupted run.

Each launch is a fresh ``fork`` of a "zygote" process (`benchmarks/zygote.py`) that
has imported torch and ember once (importing them takes seconds, a launch then
takes milliseconds); nothing of a previous launch survives in it.

    python benchmarks/kill9.py              # 50 kills
    python benchmarks/kill9.py --kills 5

tests/integration/test_kill9.py runs the same harness with 5 kills.
"""

from __future__ import annotations

import argparse
import random
import sys
import tempfile
import textwrap
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))  # also when loaded by path (tests/integration/test_kill9.py)

from zygote import Zygote

RUN_NAME = "kill9"
BATCHES_PER_EPOCH = 10

ZYGOTE = textwrap.dedent(
    """
    import json
    import os
    import sys
    import traceback

    import torch

    torch.set_num_threads(1)  # before anything runs: the forked launches inherit one thread, no OpenMP pool
    import torch.distributed.checkpoint  # noqa: F401
    from torch import nn
    from torch.nn import functional as F
    from torch.utils.data import DataLoader, TensorDataset

    import ember
    from ember.callbacks.model_checkpoint import ModelCheckpoint

    torch.optim.SGD(nn.Linear(1, 1).parameters(), lr=0.1)  # an optimizer's first construction imports torch._dynamo

    WIDTH = 256


    class Net(ember.TrainingModule):
        def __init__(self):
            super().__init__()
            self.net = nn.Sequential(nn.Linear(WIDTH, 1024), nn.Tanh(), nn.Dropout(0.1), nn.Linear(1024, WIDTH))

        def training_step(self, batch, batch_idx):
            x, y = batch
            return F.mse_loss(self.net(x), y)

        def configure_optimizers(self):
            return torch.optim.Adam(self.parameters(), lr=1e-3)


    class ReportSteps(ember.Callback):
        # one line per optimizer step, so the parent knows that training runs (O_APPEND: whole lines)
        def __init__(self, path):
            self.path = path

        def on_train_start(self, trainer, module):
            self.fd = os.open(self.path, os.O_WRONLY | os.O_CREAT | os.O_APPEND)

        def on_train_batch_end(self, trainer, module, outputs, batch, batch_idx):
            os.write(self.fd, f"{trainer.global_step}\\n".encode())


    def train(root, out, progress, epochs, batches):
        torch.manual_seed(0)
        module = Net()
        g = torch.Generator().manual_seed(1)
        x, y = torch.randn(16 * batches, WIDTH, generator=g), torch.randn(16 * batches, WIDTH, generator=g)
        loader = DataLoader(TensorDataset(x, y), batch_size=16, shuffle=True)  # permutation from the global RNG
        torch.manual_seed(2)
        trainer = ember.Trainer(
            max_epochs=epochs,
            callbacks=[ModelCheckpoint(every_n_train_steps=1), ReportSteps(progress)],
            default_root_dir=root,
            run_name=RUN_NAME,
            logger=False,
            enable_progress_bar=False,
            enable_model_summary=False,
        )
        trainer.fit(module, loader, ckpt_path="last")
        torch.save(module.state_dict(), out + ".tmp")
        os.replace(out + ".tmp", out)


    """
).replace("RUN_NAME", repr(RUN_NAME))


@dataclass
class Report:
    kills: int = 0
    relaunches: int = 0
    kills_in_checkpoint_io: int = 0  # the kill left a temporary or superseded checkpoint file/dir behind
    kills_before_any_last: int = 0
    steps: int = 0
    last_always_readable: bool = True
    unreadable: list[str] = field(default_factory=list)
    bitwise_equal: bool = False
    seconds: float = 0.0


def _checkpoint_dirs(root: Path) -> list[Path]:
    return sorted((root / RUN_NAME).glob("version_*/checkpoints"))


def check_last(root: Path) -> tuple[int, list[str]]:
    """(how many ``last`` files exist, problems loading the checkpoints they name)."""
    from ember import checkpoint as ckpt

    found, problems = 0, []
    for directory in _checkpoint_dirs(root):
        pointer = directory / ckpt.LAST_FILE
        if not pointer.exists():
            continue
        found += 1
        named = directory / pointer.read_text(encoding="utf-8").strip()
        try:
            ckpt.check_complete(named)
            ckpt.read_tensors(named)
        except Exception as exc:
            problems.append(f"{named}: {type(exc).__name__}: {exc}")
    return found, problems


def _leftovers(root: Path) -> set[Path]:
    """Entries of the checkpoint folders other than ``last`` and the checkpoint it names."""
    found = set()
    for directory in _checkpoint_dirs(root):
        pointer = directory / "last"
        named = pointer.read_text(encoding="utf-8").strip() if pointer.exists() else None
        found |= {p for p in directory.iterdir() if p.name not in ("last", named)}
    return found


def _wait_for_first_step(zygote: Zygote, pid: int, progress: Path, timeout_s: float) -> bool:
    """True once the launch reported a step; False if it exited first."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if progress.exists() and progress.stat().st_size > 0:
            return True
        if zygote.poll(pid) is not None:
            return False
        time.sleep(0.005)
    raise TimeoutError(f"the training launch reported no step within {timeout_s:.0f} s")


def _expect_success(code: int, log: Path) -> None:
    if code != 0:
        raise RuntimeError(f"training launch exited with {code}:\n{log.read_text(errors='replace')[-3000:]}")


def params_equal(a: Path, b: Path) -> bool:
    import torch

    first, second = torch.load(a, weights_only=True), torch.load(b, weights_only=True)
    return first.keys() == second.keys() and all(torch.equal(first[k], second[k]) for k in first)


def run(workdir: Path, kills: int, seed: int = 0, max_delay_s: float = 0.3, timeout_s: float = 120.0) -> Report:
    """Kill a training run `kills` times, relaunch it to completion, compare with an uninterrupted run."""
    start = time.monotonic()
    report = Report()
    rng = random.Random(seed)
    epochs = max(6, (kills * 10 + 40) // BATCHES_PER_EPOCH)  # far more steps than the kills can leave undone
    report.steps = epochs * BATCHES_PER_EPOCH
    killed_root, out = workdir / "killed", workdir / "final.pt"

    def args(root: Path, out: Path, progress: Path) -> dict[str, Any]:
        return {"root": str(root), "out": str(out), "progress": str(progress), "epochs": epochs,
                "batches": BATCHES_PER_EPOCH}  # fmt: skip

    zygote = Zygote(workdir, ZYGOTE, timeout_s)
    try:
        reference_log = workdir / "reference.log"
        reference = zygote.spawn(
            reference_log, **args(workdir / "reference", workdir / "reference.pt", workdir / "reference.progress")
        )
        launch = 0
        known = set()
        while report.kills < kills:
            progress, log = workdir / f"launch-{launch}.progress", workdir / f"launch-{launch}.log"
            pid = zygote.spawn(log, **args(killed_root, out, progress))
            launch += 1
            if not _wait_for_first_step(zygote, pid, progress, timeout_s):
                _expect_success(zygote.wait(pid), log)  # finished before the kill
                break
            time.sleep(rng.uniform(0.0, max_delay_s))
            if zygote.poll(pid) is not None:
                _expect_success(zygote.wait(pid), log)
                break
            zygote.kill(pid)
            report.kills += 1
            found, problems = check_last(killed_root)
            report.kills_before_any_last += found == 0
            if problems:
                report.last_always_readable = False
                report.unreadable += problems
            leftovers = _leftovers(killed_root)
            report.kills_in_checkpoint_io += bool(leftovers - known)
            known = leftovers
        report.relaunches = launch - 1
        if not out.exists():
            report.relaunches += 1
            log = workdir / "final.log"
            _expect_success(zygote.wait(zygote.spawn(log, **args(killed_root, out, workdir / "final.progress"))), log)
        _expect_success(zygote.wait(reference), reference_log)
        report.bitwise_equal = params_equal(workdir / "reference.pt", out)
    finally:
        zygote.close()
    report.seconds = time.monotonic() - start
    return report


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--kills", type=int, default=50)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--max-delay", type=float, default=0.3, help="seconds after the first step of a launch")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory(prefix="ember-kill9-") as tmp:
        report = run(Path(tmp), args.kills, args.seed, args.max_delay)
    print(f"kills:                        {report.kills}")
    print(f"relaunches:                   {report.relaunches}")
    print(f"kills during checkpoint I/O:  {report.kills_in_checkpoint_io}")
    print(f"kills before any 'last':      {report.kills_before_any_last}")
    print(f"training steps:               {report.steps}")
    print(f"final params bitwise equal:   {report.bitwise_equal}")
    print(f"'last' always readable:       {report.last_always_readable}")
    for problem in report.unreadable:
        print(f"  unreadable: {problem}")
    print(f"wall time:                    {report.seconds:.1f} s")
    ok = report.bitwise_equal and report.last_always_readable and report.kills == args.kills
    sys.exit(0 if ok else 1)


if __name__ == "__main__":
    main()
