"""Preemption (issue 3, "must show" 3): SIGTERM / SIGUSR1 save ``last`` at a step boundary and exit 75.

Each scenario runs a small training script in a real subprocess. The script's callback writes a
``ready`` file at global step `READY_STEP` (in the middle of epoch 1) and then waits for a ``go`` file;
the test sends the signal, then creates ``go``. The signal is therefore handled while that step's
batch is ending, and ember must act at the very next boundary: save ``last`` at step `READY_STEP`,
run ``scontrol requeue`` under SLURM, close the loggers and exit with
`ember.trainer.signals.EXIT_PREEMPTED` (75). Relaunching the same command (``ckpt_path="last"``) must
end with parameters bitwise equal to an uninterrupted run's.

All scenarios are launched together, each forked from one process that imported torch and ember once
(`ZYGOTE`: importing them cost each launch seconds of CPU); a launch is still a process of its own, with
its own environment, signals and exit status, that runs the script from its first line. Every wait is
bounded and every process is killed on the way out.
"""

from __future__ import annotations

import csv
import json
import os
import signal
import subprocess
import sys
import textwrap
import time
from dataclasses import dataclass, field
from pathlib import Path

import pytest
import torch

from ember import checkpoint as ckpt
from ember.trainer.signals import EXIT_PREEMPTED

pytestmark = pytest.mark.slow  # real subprocesses, each importing torch

REPO = Path(__file__).resolve().parents[2]
RUN_NAME = "preempt"
BATCHES_PER_EPOCH, EPOCHS = 10, 3
READY_STEP = 13  # epoch 1, after its 4th batch
TIMEOUT_S = 240.0  # for all launches together; they take ~15 s on an idle 2-core machine

SCRIPT = textwrap.dedent(
    """
    import os
    import sys
    import time

    import torch

    torch.set_num_threads(1)
    from torch import nn
    from torch.nn import functional as F
    from torch.utils.data import DataLoader, TensorDataset

    import ember
    from ember.loggers.csv import CSVLogger

    root, out, handshake, ready_step = sys.argv[1], sys.argv[2], sys.argv[3], int(sys.argv[4])


    class Net(ember.TrainingModule):
        def __init__(self):
            super().__init__()
            self.net = nn.Sequential(nn.Linear(8, 32), nn.Tanh(), nn.Dropout(0.2), nn.Linear(32, 2))

        def training_step(self, batch, batch_idx):
            x, y = batch
            loss = F.mse_loss(self.net(x), y)
            self.log("train/loss", loss)
            return loss

        def configure_optimizers(self):
            return torch.optim.SGD(self.parameters(), lr=0.05, momentum=0.9)


    class Handshake(ember.Callback):
        def on_train_batch_end(self, trainer, module, outputs, batch, batch_idx):
            if trainer.global_step != ready_step:
                return
            with open(handshake + ".ready.tmp", "w") as f:
                f.write(str(os.getpid()))
            os.replace(handshake + ".ready.tmp", handshake + ".ready")
            deadline = time.monotonic() + 60
            while not os.path.exists(handshake + ".go"):
                if time.monotonic() > deadline:
                    sys.exit("test harness: no signal came")
                time.sleep(0.005)


    torch.manual_seed(0)
    module = Net()
    g = torch.Generator().manual_seed(1)
    n = 8 * BATCHES
    loader = DataLoader(
        TensorDataset(torch.randn(n, 8, generator=g), torch.randn(n, 2, generator=g)), batch_size=8, shuffle=True
    )
    torch.manual_seed(2)
    trainer = ember.Trainer(
        max_epochs=EPOCHS,
        callbacks=[Handshake()],  # checkpointing: the default ModelCheckpoint() (every epoch) and preemption
        default_root_dir=root,
        run_name="RUN",
        logger=CSVLogger(),
        log_every_n_steps=1,
        enable_progress_bar=False,
        enable_model_summary=False,
    )
    trainer.fit(module, loader, ckpt_path="last")
    torch.save(module.state_dict(), out + ".tmp")
    os.replace(out + ".tmp", out)
    """
)
SCRIPT = SCRIPT.replace("BATCHES", str(BATCHES_PER_EPOCH)).replace("EPOCHS", str(EPOCHS))
SCRIPT = SCRIPT.replace('"RUN"', repr(RUN_NAME))

ZYGOTE = textwrap.dedent(
    """
    # Imports what every launch imports, then forks one launch per "run" line on stdin (a JSON list: script,
    # arguments, environment, working directory, log file); "poll PID" reaps a launch that has exited and
    # prints its exit status ("running" if it has not).
    import json, os, sys
    import torch
    import torch._dynamo, torch.distributed.checkpoint  # what a fit imports on first use
    import ember
    from ember.loggers.csv import CSVLogger

    for line in sys.stdin:
        command, _, rest = line.rstrip("\\n").partition("\\t")
        if command == "run":
            script, args, env, cwd, log = json.loads(rest)
            pid = os.fork()
            if pid == 0:  # the launch: its own environment, arguments and output, then the script as __main__
                os.environ.clear()
                os.environ.update(env)
                os.chdir(cwd)
                out = os.open(log, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
                os.dup2(out, 1)
                os.dup2(out, 2)
                os.close(out)
                sys.stdin.close()
                sys.argv = [script, *args]
                with open(script) as f:
                    code = compile(f.read(), script, "exec")
                exec(code, {"__name__": "__main__", "__file__": script})
                sys.exit(0)  # a normal end: the interpreter shuts down as after any script
            print(pid, flush=True)
        elif command == "poll":
            done, status = os.waitpid(int(rest), os.WNOHANG)
            print(os.waitstatus_to_exitcode(status) if done else "running", flush=True)
    """
)


class Zygote:
    """The process that forks the launches (see `ZYGOTE`)."""

    def __init__(self, script: Path, log: Path) -> None:
        self.log = open(log, "wb")  # noqa: SIM115 - closed in close()
        self.proc = subprocess.Popen(
            [sys.executable, str(script)], env=_base_env(), stdin=subprocess.PIPE, stdout=subprocess.PIPE,
            stderr=self.log, text=True,
        )  # fmt: skip

    def ask(self, *words: str) -> str:
        assert self.proc.stdin is not None and self.proc.stdout is not None
        self.proc.stdin.write("\t".join(words) + "\n")
        self.proc.stdin.flush()
        answer = self.proc.stdout.readline().strip()
        assert answer, f"the zygote exited: {self.proc.wait()}"
        return answer

    def close(self) -> None:
        assert self.proc.stdin is not None
        self.proc.stdin.close()
        self.proc.wait(timeout=30)
        self.log.close()


class Forked:
    """A launch forked by the zygote, with the part of `subprocess.Popen` that `drive` uses."""

    def __init__(self, zygote: Zygote, script: Path, args: list[str], env: dict[str, str], cwd: Path, log: Path):
        self.zygote = zygote
        self.pid = int(zygote.ask("run", json.dumps([str(script), args, env, str(cwd), str(log)])))
        self.returncode: int | None = None

    def poll(self) -> int | None:
        if self.returncode is None:
            answer = self.zygote.ask("poll", str(self.pid))
            self.returncode = None if answer == "running" else int(answer)
        return self.returncode

    def send_signal(self, signum: int) -> None:
        os.kill(self.pid, signum)  # not reaped until `poll` says it exited: the pid is still this launch's

    def kill(self) -> None:
        self.send_signal(signal.SIGKILL)

    def wait(self) -> int:
        deadline = time.monotonic() + 30
        while self.poll() is None:
            assert time.monotonic() < deadline, f"launch {self.pid} did not exit"
            time.sleep(0.01)
        assert self.returncode is not None
        return self.returncode


FAKE_SCONTROL = '#!/bin/sh\nprintf "%s\\n" "$@" > "$FAKE_SCONTROL_LOG"\n'


@dataclass
class Launch:
    name: str
    root: Path
    out: Path
    handshake: Path
    signum: int | None
    env: dict[str, str]
    after: Launch | None = None  # started once that launch has exited
    proc: Forked | None = None
    signalled: bool = False
    returncode: int | None = None
    log: Path = field(init=False)
    # taken when the process exits (a relaunch changes the run directory afterwards)
    last_name: str | None = None
    last_progress: dict[str, int] | None = None
    last_error: str | None = None
    logged_steps: list[int] | None = None

    def __post_init__(self) -> None:
        self.log = self.root.with_suffix(".log")

    def start(self, zygote: Zygote, script: Path) -> None:
        ready_step = READY_STEP if self.signum is not None else -1
        args = [str(self.root), str(self.out), str(self.handshake), str(ready_step)]
        self.proc = Forked(zygote, script, args, self.env, self.root.parent, self.log)

    def snapshot(self) -> None:
        """Record what `last` names (and whether it loads) and the steps in metrics.csv."""
        pointer = self.checkpoints / ckpt.LAST_FILE
        if pointer.exists():
            self.last_name = pointer.read_text().strip()
            named = self.checkpoints / self.last_name
            try:
                self.last_progress = ckpt.check_complete(named)["state"]["progress"]
                ckpt.read_tensors(named)
            except Exception as exc:
                self.last_error = f"{type(exc).__name__}: {exc}"
        metrics = self.root / RUN_NAME / "version_0" / "metrics.csv"
        if metrics.exists():
            with open(metrics, newline="") as f:
                self.logged_steps = [int(row["step"]) for row in csv.DictReader(f) if row.get("train/loss")]

    @property
    def output(self) -> str:
        return self.log.read_text(errors="replace")

    @property
    def checkpoints(self) -> Path:
        return self.root / RUN_NAME / "version_0" / "checkpoints"


def _base_env(path: str | None = None) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("SLURM_")}
    env["PYTHONPATH"] = os.pathsep.join([str(REPO), *filter(None, [env.get("PYTHONPATH")])])
    env["OMP_NUM_THREADS"] = "1"
    if path is not None:
        env["PATH"] = path
    return env


def drive(launches: list[Launch], script: Path, zygote: Zygote) -> None:
    """Start every launch; signal each when it is ready; wait for all (bounded); kill leftovers."""
    try:
        deadline = time.monotonic() + TIMEOUT_S
        pending = list(launches)
        while pending:
            if time.monotonic() > deadline:
                raise TimeoutError("launches still running: " + ", ".join(launch.name for launch in pending))
            for launch in list(pending):
                if launch.proc is None:
                    if launch.after is not None and launch.after.returncode is None:
                        continue
                    launch.start(zygote, script)
                assert launch.proc is not None
                ready = Path(f"{launch.handshake}.ready")
                if launch.signum is not None and not launch.signalled and ready.exists():
                    launch.proc.send_signal(launch.signum)
                    launch.signalled = True
                    Path(f"{launch.handshake}.go").touch()
                if launch.proc.poll() is not None:
                    launch.snapshot()
                    launch.returncode = launch.proc.returncode
                    pending.remove(launch)
            time.sleep(0.01)
    finally:
        for launch in launches:
            if launch.proc is not None and launch.proc.poll() is None:
                launch.proc.kill()
                launch.proc.wait()


def _launch(base: Path, name: str, signum: int | None, env: dict[str, str]) -> Launch:
    root = base / name
    root.mkdir()
    return Launch(name, root, base / f"{name}.pt", base / f"{name}.handshake", signum, env)


def _relaunch(first: Launch) -> Launch:
    """The same command again (``ckpt_path="last"``), without a signal, once `first` has exited."""
    name = f"{first.name}_relaunch"
    relaunch = Launch(
        name, first.root, first.out.with_name(f"{name}.pt"), Path(f"{first.handshake}-2"), None, first.env
    )
    relaunch.log = first.root.with_name(f"{relaunch.name}.log")
    relaunch.after = first
    return relaunch


@pytest.fixture(scope="module")
def scenarios(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Launch]:
    base = tmp_path_factory.mktemp("preemption")
    script = base / "train.py"
    script.write_text(SCRIPT)
    fake_bin = base / "fake-bin"
    fake_bin.mkdir()
    (fake_bin / "scontrol").write_text(FAKE_SCONTROL)
    (fake_bin / "scontrol").chmod(0o755)
    empty_bin = base / "empty-bin"  # a PATH without scontrol
    empty_bin.mkdir()
    with_fake = f"{fake_bin}{os.pathsep}{os.environ.get('PATH', '')}"

    def slurm_env(path: str, log_name: str, **ids: str) -> dict[str, str]:
        return {**_base_env(path), **ids, "FAKE_SCONTROL_LOG": str(base / log_name)}

    launches = [
        _launch(base, "reference", None, _base_env()),
        _launch(base, "sigterm", signal.SIGTERM, _base_env()),
        _launch(base, "slurm", signal.SIGUSR1, slurm_env(with_fake, "slurm.argv", SLURM_JOB_ID="1234")),
        _launch(
            base,
            "slurm_array",
            signal.SIGUSR1,
            slurm_env(
                with_fake, "slurm_array.argv", SLURM_JOB_ID="1240", SLURM_ARRAY_JOB_ID="77", SLURM_ARRAY_TASK_ID="3"
            ),
        ),
        _launch(base, "slurm_no_scontrol", signal.SIGUSR1, slurm_env(str(empty_bin), "none.argv", SLURM_JOB_ID="55")),
    ]
    launches.append(_relaunch(launches[1]))
    (base / "zygote.py").write_text(ZYGOTE)
    zygote = Zygote(base / "zygote.py", base / "zygote.log")
    try:
        drive(launches, script, zygote)
    finally:
        zygote.close()
    assert not (base / "zygote.log").read_text(), (base / "zygote.log").read_text()
    return {launch.name: launch for launch in launches}


def _assert_preempted_at_the_boundary(launch: Launch) -> None:
    assert launch.returncode == EXIT_PREEMPTED, launch.output
    assert not launch.out.exists()  # fit did not return
    assert launch.last_name is not None, f"no `last` checkpoint:\n{launch.output}"
    assert launch.last_error is None, launch.last_error
    assert launch.last_progress is not None
    # the boundary right after the step during which the signal came, in the middle of epoch 1
    assert launch.last_progress["global_step"] == READY_STEP
    assert (launch.last_progress["epoch"], launch.last_progress["batch_idx"]) == divmod(READY_STEP, BATCHES_PER_EPOCH)


def test_uninterrupted_reference_run_finishes(scenarios: dict[str, Launch]) -> None:
    reference = scenarios["reference"]
    assert reference.returncode == 0, reference.output
    assert reference.out.exists()


def test_sigterm_mid_epoch_saves_last_at_the_step_boundary_and_exits_75(scenarios: dict[str, Launch]) -> None:
    launch = scenarios["sigterm"]
    _assert_preempted_at_the_boundary(launch)
    assert "received SIGTERM" in launch.output
    assert "requeue" not in launch.output  # not under SLURM
    # the loggers were closed: metrics.csv holds every step up to the preempted one
    assert launch.logged_steps == list(range(READY_STEP))  # steps 1..READY_STEP at rows 0..READY_STEP - 1


def test_resuming_after_sigterm_is_bitwise_exact(scenarios: dict[str, Launch]) -> None:
    first, relaunch, reference = scenarios["sigterm"], scenarios["sigterm_relaunch"], scenarios["reference"]
    assert first.returncode == EXIT_PREEMPTED, first.output
    assert reference.returncode == 0, reference.output
    assert relaunch.returncode == 0, relaunch.output
    assert "resuming from" in relaunch.output and f"step={READY_STEP}" in relaunch.output
    assert not (first.root / RUN_NAME / "version_1").exists()  # the relaunch continued the run directory
    resumed = torch.load(relaunch.out, weights_only=True)
    expected = torch.load(reference.out, weights_only=True)
    assert resumed.keys() == expected.keys()
    for name, value in expected.items():
        assert torch.equal(resumed[name], value), f"{name} differs after the preempted run was resumed"


@pytest.mark.parametrize(("name", "job"), [("slurm", "1234"), ("slurm_array", "77_3")])
def test_sigusr1_under_slurm_requeues_the_job(scenarios: dict[str, Launch], name: str, job: str) -> None:
    launch = scenarios[name]
    _assert_preempted_at_the_boundary(launch)
    assert "received SIGUSR1" in launch.output
    argv_file = Path(launch.env["FAKE_SCONTROL_LOG"])
    assert argv_file.exists(), f"the fake scontrol was not run:\n{launch.output}"
    assert argv_file.read_text().splitlines() == ["requeue", job]
    assert f"requeued SLURM job {job}" in launch.output


def test_missing_scontrol_is_an_error_message_and_still_exits_75(scenarios: dict[str, Launch]) -> None:
    launch = scenarios["slurm_no_scontrol"]
    _assert_preempted_at_the_boundary(launch)  # the checkpoint was saved before the requeue was tried
    assert "cannot requeue SLURM job 55: scontrol is not on PATH" in launch.output
    assert "Traceback" not in launch.output
