"""ember/resuming.py: the command lines a refused ``--resume last`` prints, whichever way the option was given."""

from __future__ import annotations

from pathlib import Path

import pytest

from ember.checkpoint import CheckpointError, NewestRunHasNoCheckpoint
from ember.resuming import as_command

REFUSED = NewestRunHasNoCheckpoint(
    Path("runs/net/version_1"), "stopped: interrupted", Path("runs/net/version_0"),
    Path("runs/net/version_0/checkpoints/epoch=0-step=3"),
)  # fmt: skip


@pytest.mark.parametrize(
    ("argv", "flag", "rest"),
    [
        (["fit", "-c", "net.yaml", "--resume", "last", "seed=1"], "--resume", "fit -c net.yaml seed=1"),
        (["fit", "--resume=last", "-c", "net.yaml"], "--resume", "fit -c net.yaml"),
        (["fit", "-c", "my net.yaml", "--ckpt", "last"], "--ckpt", "fit -c 'my net.yaml'"),
    ],
)
def test_the_commands_replace_or_drop_resume_last(argv: list[str], flag: str, rest: str) -> None:
    assert as_command(REFUSED, argv) == (
        f"{flag} last: the newest run, runs/net/version_1 (stopped: interrupted), has no checkpoint; to continue "
        "runs/net/version_0 from runs/net/version_0/checkpoints/epoch=0-step=3: "
        f"`ember {rest} {flag} runs/net/version_0`; to start over: `ember {rest}`"
    )


def test_other_errors_are_their_own_line() -> None:
    assert as_command(CheckpointError("checkpoint x is damaged"), ["fit"]) == "checkpoint x is damaged"
