"""Soak test: training interrupted at random instants, resumed from ``last`` each time, checked each time.

Eight configurations: sync or async saves, ``save_top_k`` 1 or 2, one process or two (gloo). Each one
trains a small MLP (dropout, shuffled data) with ``ModelCheckpoint(every_n_train_steps=2)`` and
``fit(ckpt_path="last")``, and is interrupted again and again until it completes:

- SIGKILL at a random moment (both processes at once, as when a node dies);
- SIGTERM at a random moment (preemption: save ``last``, exit 75);
- ENOSPC injected into a random save (the run ends with a clean ``CheckpointWriteError``, exit 1).

After every interruption the harness checks, and counts:

- ``last`` unreadable: ``last`` must resolve to a complete checkpoint whose tensors load;
- lost work: ``last`` must be at least as new as the newest checkpoint the run reported complete;
- deleted kept checkpoints: the ``save_top_k`` newest complete checkpoints must all still be there (those
  reported complete, and complete ones newer than the report, which its logger thread may not have reached);
- deleted outside the run: a checkpoint of another run in the same root, and a bystander folder, must
  be untouched;
- executed payloads: a crafted checkpoint planted beside the real ones (its recorded config names
  ``os.system``) must never run, however the search for ``last`` goes;
- unexpected exits: anything but -9, 75, 1-with-CheckpointWriteError, or 0 (an abort, a traceback).

When a configuration completes, its final parameters must equal, bitwise, an uninterrupted run's.

Launches are forked from a "zygote" (`benchmarks/zygote.py`) that imported torch and ember once, so a
launch takes milliseconds to start; two-process launches are two forks joined by a gloo process group.

    python benchmarks/soak.py                  # 104 interruptions (13 per configuration)
    python benchmarks/soak.py --short          # 16 interruptions: CI (tests/reliability/test_soak.py)
"""

from __future__ import annotations

import argparse
import contextlib
import os
import random
import shutil
import signal
import sys
import tempfile
import textwrap
import time
from dataclasses import dataclass, field
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from zygote import Zygote

RUN_NAME = "soak"
STEPS_PER_EPOCH = 8

ZYGOTE = (
    textwrap.dedent(
        """
    import errno
    import json
    import os
    import socket
    import sys
    import time
    import traceback
    from pathlib import Path

    import torch

    torch.set_num_threads(1)  # before anything runs: the forked launches inherit one thread
    import torch.distributed.checkpoint  # noqa: F401
    from torch import nn
    from torch.nn import functional as F
    from torch.utils.data import DataLoader, TensorDataset

    import ember
    from ember import checkpoint as ckpt
    from ember.checkpoint import files, writing
    from ember.callbacks.model_checkpoint import ModelCheckpoint
    from ember.loggers.logger import Logger

    torch.optim.SGD(nn.Linear(1, 1).parameters(), lr=0.1)  # the first optimizer imports torch._dynamo


    class Net(ember.TrainingModule):
        def __init__(self):
            super().__init__()
            self.net = nn.Sequential(nn.Linear(64, 256), nn.Tanh(), nn.Dropout(0.1), nn.Linear(256, 64))

        def training_step(self, batch, batch_idx):
            time.sleep(0.004)  # the rest of a real step's compute: launches get interrupted mid-run
            x, y = batch
            return F.mse_loss(self.net(x), y)

        def configure_optimizers(self):
            return torch.optim.Adam(self.parameters(), lr=1e-3)


    class Report(Logger):
        # Rank 0's record of training, one line per event (O_APPEND: whole lines): each step, and each
        # checkpoint once it is complete (after_save_checkpoint runs when the write has finished).
        def __init__(self, path):
            super().__init__()
            self.fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_APPEND)

        def log_metrics(self, metrics, step):
            pass

        def after_save_checkpoint(self, path):
            os.write(self.fd, f"saved {Path(path).name}\\n".encode())


    class Steps(ember.Callback):
        def __init__(self, path):
            self.fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_APPEND)

        def on_train_batch_end(self, trainer, module, outputs, batch, batch_idx):
            if trainer.is_global_zero:
                os.write(self.fd, f"step {trainer.global_step}\\n".encode())


    class FullDisk:
        # A file that fails with ENOSPC after a few bytes: what a disk that just filled up does.
        def __init__(self, raw):
            self.raw, self.left = raw, 64

        def write(self, data):
            size = memoryview(data).nbytes
            if size > self.left:
                raise OSError(errno.ENOSPC, "No space left on device")
            self.left -= size
            return self.raw.write(data)

        def __getattr__(self, name):
            return getattr(self.raw, name)


    def inject_enospc(at_save, rank):
        # Make checkpoint write number `at_save` of this launch fail on rank 0 with ENOSPC.
        if at_save < 0 or rank != 0:
            return
        write_files, init = writing._write_files, files.GuardedFile.__init__
        count = {"n": 0, "armed": False}

        def counted(*args, **kwargs):
            count["armed"] = count["n"] == at_save
            count["n"] += 1
            try:
                return write_files(*args, **kwargs)
            finally:
                count["armed"] = False

        def guarded_init(self, raw):
            init(self, FullDisk(raw) if count["armed"] else raw)

        writing._write_files = counted
        files.GuardedFile.__init__ = guarded_init


    def train(root, out, progress, top_k, async_save, world_size, rank, port, enospc_at_save, epochs):
        if world_size > 1:
            os.environ.update(RANK=str(rank), WORLD_SIZE=str(world_size), LOCAL_RANK=str(rank),
                              LOCAL_WORLD_SIZE=str(world_size), MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
        inject_enospc(enospc_at_save, rank)
        torch.manual_seed(0)
        module = Net()
        g = torch.Generator().manual_seed(1)
        n = 8 * STEPS_PER_EPOCH * world_size
        x, y = torch.randn(n, 64, generator=g), torch.randn(n, 64, generator=g)
        loader = DataLoader(TensorDataset(x, y), batch_size=8, shuffle=True, generator=torch.Generator().manual_seed(2))
        torch.manual_seed(3 + rank)
        saver = ModelCheckpoint(every_n_train_steps=2, save_top_k=top_k, async_save=async_save,
                                filename="{step}")
        trainer = ember.Trainer(
            max_epochs=epochs, callbacks=[saver, Steps(progress)], default_root_dir=root, run_name=RUN_NAME,
            logger=[Report(progress)] if rank == 0 else False, enable_progress_bar=False,
            enable_model_summary=False, strategy="ddp" if world_size > 1 else "auto",
            devices=world_size, accelerator="cpu",
        )
        trainer.fit(module, loader, ckpt_path="last")
        if rank == 0:
            torch.save(module.state_dict(), out + ".tmp")
            os.replace(out + ".tmp", out)


    """
    )
    .replace("RUN_NAME", repr(RUN_NAME))
    .replace("STEPS_PER_EPOCH", str(STEPS_PER_EPOCH))
)


@dataclass(frozen=True)
class Config:
    async_save: bool
    top_k: int
    world_size: int

    @property
    def name(self) -> str:
        return f"{'async' if self.async_save else 'sync'}-top{self.top_k}-{self.world_size}proc"


CONFIGS = [Config(a, k, w) for w in (1, 2) for a in (False, True) for k in (1, 2)]


@dataclass
class Report:
    """Counts over every interruption; every one of the problem counts must be 0."""

    interruptions: dict[str, int] = field(default_factory=lambda: {"SIGKILL": 0, "SIGTERM": 0, "ENOSPC": 0})
    unreadable_last: int = 0
    lost_work: int = 0
    deleted_kept: int = 0
    deleted_outside: int = 0
    executed_payloads: int = 0
    unexpected_exits: int = 0
    kills_during_writes: int = 0  # SIGKILLs that left a half-written (temporary) checkpoint behind
    not_bitwise_equal: list[str] = field(default_factory=list)
    problems: list[str] = field(default_factory=list)
    completed: list[str] = field(default_factory=list)
    seconds: float = 0.0

    @property
    def total(self) -> int:
        return sum(self.interruptions.values())

    @property
    def ok(self) -> bool:
        counts = (self.unreadable_last, self.lost_work, self.deleted_kept, self.deleted_outside,
                  self.executed_payloads, self.unexpected_exits)  # fmt: skip
        return not any(counts) and not self.not_bitwise_equal

    def lines(self) -> list[str]:
        kinds = ", ".join(f"{n} {kind}" for kind, n in self.interruptions.items())
        return [
            f"interruptions:                         {self.total} ({kinds})",
            f"configurations completed:              {len(self.completed)} ({', '.join(self.completed)})",
            f"unreadable `last`:                     {self.unreadable_last}",
            f"runs that lost completed work:         {self.lost_work}",
            f"deleted checkpoints still kept:        {self.deleted_kept}",
            f"deleted outside the run:               {self.deleted_outside}",
            f"executed payloads:                     {self.executed_payloads}",
            f"unexpected exits:                      {self.unexpected_exits}",
            f"SIGKILLs during a checkpoint write:    {self.kills_during_writes}",
            f"final parameters bitwise equal:        {not self.not_bitwise_equal}"
            + (f" (differ: {', '.join(self.not_bitwise_equal)})" if self.not_bitwise_equal else ""),
            f"wall time:                             {self.seconds:.1f} s",
            *[f"  problem: {p}" for p in self.problems[:20]],
        ]


def _plant_hostile(folder: Path, marker: Path, template: Path) -> None:
    """A checkpoint directory beside the real ones, newer by step, whose recorded config runs a command."""
    import torch

    hostile = folder / "step=99999"
    if hostile.exists():
        return
    shutil.copytree(template, hostile)
    meta = torch.load(hostile / "ember.pt", weights_only=True)
    meta["config"] = {"module": {"_target_": "os.system", "command": f"touch {marker}"}}
    meta["module_class"] = "os.system"
    meta["hparams"] = {"command": f"touch {marker}"}
    meta["state"]["progress"]["global_step"] = 99999
    meta["state"]["callbacks"] = {"ModelCheckpoint{}": {"kept": {str(marker.parent): None}}}
    (hostile / "rank-0.pt").unlink()  # incomplete on purpose: never a valid candidate, but read while searching
    torch.save(meta, hostile / "ember.pt")


class Run:
    """One configuration: its folders, the reported events, and the checks after each interruption."""

    def __init__(self, workdir: Path, config: Config, report: Report, epochs: int) -> None:
        self.config, self.report, self.epochs = config, report, epochs
        self.dir = workdir / config.name
        self.root = self.dir / "runs"
        self.out = self.dir / "final.pt"
        self.progress = self.dir / "progress"
        self.marker = self.dir / "PAYLOAD-RAN"
        self.launches = 0
        self.bystander = self.dir / "bystander"
        self.bystander.mkdir(parents=True)
        (self.bystander / "ember.pt").write_text("not a checkpoint, not to be deleted")
        self.other = self.root / RUN_NAME / "version_other" / "checkpoints" / "other"

    def folder(self) -> Path:
        """The checkpoint folder of the run being resumed: the newest version with a `last` (a launch killed
        before its first checkpoint leaves a version without one, and the next launch starts a new one)."""
        from ember.checkpoint import versions_newest_first

        versions = versions_newest_first(self.root / RUN_NAME)
        for version in versions:
            if (version / "checkpoints" / "last").exists():
                return version / "checkpoints"
        return (versions[0] if versions else self.root / RUN_NAME / "version_0") / "checkpoints"

    def events(self) -> tuple[int, list[str]]:
        """(the newest step reported, checkpoint names reported complete, oldest first)."""
        if not self.progress.exists():
            return 0, []
        step, saved = 0, []
        for line in self.progress.read_text().splitlines():
            kind, _, value = line.partition(" ")
            if kind == "step" and value.isdigit():
                step = max(step, int(value))
            elif kind == "saved":
                saved.append(value)
        return step, saved

    def check(self, kind: str) -> None:
        from ember import checkpoint as ckpt

        problems = self.report.problems
        folder = self.folder()
        if (
            kind == "SIGKILL"
            and folder.is_dir()
            and any(".tmp-" in p.name and ".deleting." not in p.name for p in folder.iterdir())
        ):
            self.report.kills_during_writes += 1
        _, saved = self.events()
        named_step = -1
        if (folder / "last").exists():
            try:
                last = ckpt.read_pointer(folder / "last")
                ckpt.check_complete(last)
                ckpt.read_tensors(last)
                named_step = ckpt.read_meta(last)["state"]["progress"]["global_step"]
            except Exception as exc:
                self.report.unreadable_last += 1
                problems.append(f"{self.config.name} after {kind}: `last` unreadable: {exc}")
        elif saved:
            self.report.unreadable_last += 1
            problems.append(f"{self.config.name} after {kind}: no `last` although {saved[-1]} was complete")
        if saved:
            newest = saved_step(saved[-1])
            if named_step < newest:
                self.report.lost_work += 1
                problems.append(f"{self.config.name} after {kind}: `last` is step {named_step}, {saved[-1]} was done")
        for name in _newest_saved_name(_with_unreported(saved, folder), self.config.top_k):
            try:
                ckpt.check_complete(folder / name)
            except ckpt.CheckpointError as exc:
                self.report.deleted_kept += 1
                problems.append(f"{self.config.name} after {kind}: kept checkpoint {name} gone: {exc}")
        intact_other = self.other.is_dir() and (self.other / "ember.pt").exists()
        if not intact_other or not (self.bystander / "ember.pt").exists():
            self.report.deleted_outside += 1
            problems.append(f"{self.config.name} after {kind}: something outside the run was deleted")
        if self.marker.exists():
            self.report.executed_payloads += 1
            problems.append(f"{self.config.name} after {kind}: a payload ran")
            self.marker.unlink()


def saved_step(name: str) -> int:
    """The step of a checkpoint named ``step=N`` (the configurations' `filename`), or ``step=N-vK`` when a
    launch re-saved step N beside a complete one that a kill kept out of `last`."""
    return int(name.split("=", 1)[1].split("-v", 1)[0])


def _with_unreported(saved: list[str], folder: Path) -> list[str]:
    """`saved`, then the complete checkpoints newer than all of it that the report has not reached yet.

    Rank 0's loggers hear of a finished save on a thread of their own (they never hold up training), while the
    eviction that save makes starts at once: a SIGKILL in between leaves an older checkpoint half deleted and
    the newer one complete but unreported. A complete checkpoint directory is proof enough that its save ended."""
    from ember import checkpoint as ckpt

    newest = saved_step(saved[-1]) if saved else -1
    later = []
    for path in folder.glob("step=*") if folder.is_dir() else ():
        try:
            step = saved_step(path.name)
            if step > newest:
                ckpt.check_complete(path)
                later.append((step, path.name))
        except (ValueError, ckpt.CheckpointError):
            continue  # not this run's name, or incomplete: never reported, never kept
    return saved + [name for _, name in sorted(later)]


def _newest_saved_name(saved: list[str], k: int) -> list[str]:
    return list(dict.fromkeys(reversed(saved)))[:k]


def launch(zygote: Zygote, run: Run, enospc_at_save: int = -1, out: Path | None = None,
           root: Path | None = None, progress: Path | None = None) -> list[int]:  # fmt: skip
    """Start one launch of `run` (one fork per process); returns the pids (rank 0 first)."""
    port = _free_port()
    pids: list[int] = []
    for rank in range(run.config.world_size):
        args = {
            "root": str(root or run.root), "out": str(out or run.out), "progress": str(progress or run.progress),
            "top_k": run.config.top_k, "async_save": run.config.async_save, "world_size": run.config.world_size,
            "rank": rank, "port": port, "enospc_at_save": enospc_at_save, "epochs": run.epochs,
        }  # fmt: skip
        log = run.dir / f"launch-{run.launches}-rank{rank}.log"
        pids.append(zygote.spawn(log, pgid=pids[0] if pids else 0, **args))
    run.launches += 1
    return pids


def _free_port() -> int:
    import socket

    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def wait_all(zygote: Zygote, pids: list[int], timeout_s: float) -> list[int]:
    deadline = time.monotonic() + timeout_s
    codes: dict[int, int] = {}
    while len(codes) < len(pids):
        for pid in pids:
            if pid not in codes and (code := zygote.poll(pid)) is not None:
                codes[pid] = code
        if time.monotonic() > deadline:
            for pid in pids:
                with contextlib.suppress(ProcessLookupError):
                    os.kill(pid, signal.SIGKILL)
            raise TimeoutError(f"launch {pids} did not finish within {timeout_s:.0f} s")
        time.sleep(0.01)
    return [codes[pid] for pid in pids]


def _wait_for_steps(zygote: Zygote, run: Run, pids: list[int], steps: int, timeout_s: float) -> bool:
    """True once the launch reported `steps` more steps; False if it exited first."""
    start, _ = run.events()
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if run.events()[0] >= start + steps:
            return True
        if any(zygote.poll(pid) is not None for pid in pids):
            return False
        time.sleep(0.005)
    raise TimeoutError("the launch reported no step in time")


def _logs(run: Run) -> str:
    logs = sorted(run.dir.glob(f"launch-{run.launches - 1}-*"))
    return "\n".join(p.read_text(errors="replace")[-2000:] for p in logs)


def soak(workdir: Path, per_config: int, seed: int = 0, timeout_s: float = 600.0) -> Report:
    """Interrupt each configuration `per_config` times, then let it complete; compare with a reference."""
    start = time.monotonic()
    report = Report()
    rng = random.Random(seed)
    zygote = Zygote(workdir, ZYGOTE, timeout_s)
    try:
        for config in CONFIGS:
            # far more steps than the interruptions can undo: each launch trains a few steps before it is stopped
            run = Run(workdir, config, report, epochs=max(8, 4 * per_config))
            reference_out = run.dir / "reference.pt"
            reference = launch(zygote, run, out=reference_out, root=run.dir / "reference",
                               progress=run.dir / "reference.progress")  # fmt: skip
            codes = wait_all(zygote, reference, timeout_s)
            if codes != [0] * config.world_size:
                raise RuntimeError(f"{config.name}: the reference run failed {codes}:\n{_logs(run)}")
            finished = next((run.dir / "reference").glob(f"{RUN_NAME}/version_0/checkpoints"))
            shutil.copytree(ckpt_dir_of_folder(finished), run.other)  # another run's checkpoint, in the same root
            interrupted = 0
            while interrupted < per_config and not run.out.exists():
                kind = rng.choice(["SIGKILL", "SIGKILL", "SIGTERM", "ENOSPC"])
                pids = launch(zygote, run, enospc_at_save=rng.randrange(0, 4) if kind == "ENOSPC" else -1)
                # The instant is drawn in steps, not seconds, so that no launch can run to the end first on a
                # fast machine (every configuration is interrupted exactly per_config times), then jittered
                # within a few steps so that kills land in all parts of a step and of a checkpoint write.
                if kind != "ENOSPC" and _wait_for_steps(zygote, run, pids, rng.randint(1, 12), timeout_s):
                    time.sleep(rng.uniform(0.0, 0.02))
                    with contextlib.suppress(ProcessLookupError):
                        os.killpg(pids[0], signal.SIGKILL if kind == "SIGKILL" else signal.SIGTERM)
                codes = wait_all(zygote, pids, timeout_s)
                if all(code == 0 for code in codes):
                    break  # it completed before the interruption
                expected = {"SIGKILL": (-9,), "SIGTERM": (75, -15), "ENOSPC": (1,)}[kind]
                if any(code not in (*expected, 0) for code in codes) or (
                    kind == "ENOSPC" and "CheckpointWriteError" not in _logs(run)
                ):
                    report.unexpected_exits += 1
                    report.problems.append(f"{config.name}: {kind} launch exited {codes}:\n{_logs(run)[-1500:]}")
                report.interruptions[kind] += 1
                interrupted += 1
                run.check(kind)
                if run.folder().is_dir() and (run.folder() / "last").exists():
                    _plant_hostile(run.folder(), run.marker, ckpt_dir_of(run))
            for _ in range(3):  # then let it finish (an injected ENOSPC does not come back)
                if run.out.exists():
                    break
                codes = wait_all(zygote, launch(zygote, run), timeout_s)
                if codes != [0] * config.world_size:
                    raise RuntimeError(f"{config.name}: the final launch failed {codes}:\n{_logs(run)}")
            run.check("completion")
            if params_equal(reference_out, run.out):
                report.completed.append(config.name)
            else:
                report.not_bitwise_equal.append(config.name)
    finally:
        zygote.close()
    report.seconds = time.monotonic() - start
    return report


def ckpt_dir_of(run: Run) -> Path:
    """A complete checkpoint of `run` to copy the hostile one from."""
    return ckpt_dir_of_folder(run.folder())


def ckpt_dir_of_folder(folder: Path) -> Path:
    from ember import checkpoint as ckpt

    return ckpt.read_pointer(folder / "last")


def params_equal(a: Path, b: Path) -> bool:
    import torch

    first, second = torch.load(a, weights_only=True), torch.load(b, weights_only=True)
    return first.keys() == second.keys() and all(torch.equal(first[k], second[k]) for k in first)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--per-config", type=int, default=13, help="interruptions per configuration (8 of them)")
    parser.add_argument("--short", action="store_true", help="2 interruptions per configuration (CI)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--keep", metavar="DIR", help="work in DIR and keep it (logs of every launch)")
    args = parser.parse_args(argv)
    per_config = 2 if args.short else args.per_config
    if args.keep:
        shutil.rmtree(args.keep, ignore_errors=True)
        Path(args.keep).mkdir(parents=True)
        report = soak(Path(args.keep), per_config, args.seed)
    else:
        with tempfile.TemporaryDirectory(prefix="ember-soak-") as tmp:
            report = soak(Path(tmp), per_config, args.seed)
    print("\n".join(report.lines()))
    print("verdict: " + ("every promise held" if report.ok else "FAILED"))
    return 0 if report.ok else 1


if __name__ == "__main__":
    sys.exit(main())
