"""Expected errors end the ``ember`` command with one line and a documented exit code, never a traceback
(docs/cli.md, "Exit codes"): a loss that turns NaN under ``nonfinite_loss="error"`` (exit 1), an empty
training dataloader (exit 2), Ctrl-C pressed twice or more during a fit (exit 130). The run's ``last``
checkpoint still loads afterwards.

Each case runs the real command in a subprocess: what the user sees is the process's stderr and status,
including what happens while the interpreter exits.
"""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from rel_helpers import assert_one_line_error

import ember
from ember import checkpoint as ckpt

#: Modules of the test project: a loss that turns NaN from optimizer step 5 (epoch 2 of 3 steps each), data
#: whose training loader is empty, and a slow step that says when training is under way.
MODULES = """\
import time
from pathlib import Path

import torch
from torch.utils.data import DataLoader, TensorDataset

from my_project.models import Blobs, Net


class NanNet(Net):
    def training_step(self, batch, batch_idx):
        loss = super().training_step(batch, batch_idx)
        return loss * float("nan") if self.global_step + 1 >= 5 else loss


class NoTrainData(Blobs):
    def train_dataloader(self):
        return DataLoader(TensorDataset(torch.zeros(0, 4), torch.zeros(0, dtype=torch.long)), batch_size=16)


class SlowNet(Net):
    def training_step(self, batch, batch_idx):
        if self.global_step == 4:
            Path("training").touch()
        time.sleep(0.05)
        return super().training_step(batch, batch_idx)
"""


def _ember(project: Path, *args: str) -> subprocess.Popen[str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("RANK", "WORLD_SIZE", "MASTER_", "LOCAL_"))}
    env.update(OMP_NUM_THREADS="1", PYTHONPATH=str(Path(ember.__file__).parents[1]))
    command = [sys.executable, "-m", "ember", *args]
    return subprocess.Popen(command, cwd=project, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True, start_new_session=True)  # fmt: skip


def _finish(proc: subprocess.Popen[str], timeout_s: float = 120) -> tuple[int, str]:
    try:
        _, err = proc.communicate(timeout=timeout_s)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
    return proc.returncode, err


def _interrupt_twice(proc: subprocess.Popen[str], project: Path) -> tuple[int, str]:
    """Ctrl-C as a terminal sends it (to the process group) once training is under way, again 10 ms later
    (during the cleanup the first one started), and again each time after the command has printed its line
    (while the interpreter exits)."""
    deadline = time.monotonic() + 120
    while not (project / "training").exists():
        assert proc.poll() is None and time.monotonic() < deadline, _finish(proc)
        time.sleep(0.01)
    os.killpg(proc.pid, signal.SIGINT)
    time.sleep(0.01)
    os.killpg(proc.pid, signal.SIGINT)
    assert proc.stderr is not None
    lines = []
    for line in proc.stderr:  # the command's own line is printed once it has stopped
        lines.append(line)
        if line.startswith("ember: interrupted"):
            break
    for _ in range(5):
        if proc.poll() is not None:
            break
        os.killpg(proc.pid, signal.SIGINT)
        time.sleep(0.05)
    code, rest = _finish(proc)
    return code, "".join(lines) + rest


def _assert_loads(project: Path) -> None:
    """Every run's ``last`` file names a complete checkpoint whose weights are finite."""
    pointers = list((project / "runs").rglob("checkpoints/last"))
    assert pointers
    for pointer in pointers:
        found = ckpt.newest_valid(pointer.parent)
        assert found is not None and found.name == pointer.read_text().strip()
        _, weights = ckpt.read_module_state(found)
        assert weights and all(bool(torch.isfinite(w).all()) for w in weights.values())


@pytest.mark.parametrize(
    ("case", "code", "line"),
    [
        ("nonfinite loss", 1, "the training loss was inf or NaN at optimizer step 5"),
        ("empty train loader", 2, "the train dataloader is empty (0 batches)"),
        # the run has epoch 0's checkpoint when Ctrl-C comes (at step 4 of 3-step epochs): the line names both
        (
            "Ctrl-C twice",
            130,
            r"ember: interrupted; `--resume last` continues runs/slow_net/version_0 from its "
            r"checkpoint epoch=\d+-step=\d+",
        ),
    ],
)
@pytest.mark.slow  # 3 s of CPU on a 2-core machine, with the processes it starts
def test_expected_errors_are_one_line_and_a_documented_exit_code(
    project: Path, case: str, code: int, line: str
) -> None:
    """`project` is a run trained for 2 epochs (3 steps each) with its ``last``."""
    (project / "my_project" / "liars.py").write_text(MODULES)
    if case == "nonfinite loss":
        proc = _ember(project, "fit", "-c", "net.yaml", "module._target_=my_project.liars.NanNet",
                      "trainer.nonfinite_loss=error")  # fmt: skip
        returncode, err = _finish(proc)
    elif case == "empty train loader":  # the trained run, resumed with data that yields no batches
        data = "data._target_=my_project.liars.NoTrainData"
        proc = _ember(project, "fit", "-c", "net.yaml", "trainer.max_epochs=3", data, "--resume", "last")
        returncode, err = _finish(proc)
    else:
        proc = _ember(project, "fit", "-c", "net.yaml", "module._target_=my_project.liars.SlowNet",
                      "trainer.max_epochs=1000")  # fmt: skip
        returncode, err = _interrupt_twice(proc, project)
    assert returncode == code, err
    assert "Traceback" not in err and "KeyboardInterrupt" not in err, err
    if code == 130:
        (said,) = [x for x in err.splitlines() if x.startswith("ember: interrupted")]
        assert re.fullmatch(line, said), err
        assert not any(x.startswith("ember: error") for x in err.splitlines()), err
    else:
        assert_one_line_error(err, line)
    _assert_loads(project)  # epoch 1's checkpoint: written before the failure, intact after it
