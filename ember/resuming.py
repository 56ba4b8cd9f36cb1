"""What the ``ember`` command says about continuing a fit: after Ctrl-C or a non-finite loss, what
``--resume last`` will do (`resume_hint`), and, when ``--resume last`` refuses because the newest run has no
checkpoint (`ember.checkpoint.NewestRunHasNoCheckpoint`), the exact command lines that continue the older run
or start over (`as_command`). docs/cli.md ("Exit codes") quotes the lines.
"""

from __future__ import annotations

import shlex
import sys
from collections.abc import Sequence
from typing import TYPE_CHECKING

from ember import checkpoint

if TYPE_CHECKING:
    from ember.trainer.trainer import Trainer

#: The options that name fit's checkpoint (`ember.cli`): the first is what a message suggests by default.
_FLAGS = ("--resume", "--ckpt")


class Interrupted(KeyboardInterrupt):
    """Ctrl-C during a fit, with what ``--resume last`` will do next (`resume_hint`) as its text."""


def resume_hint(trainer: Trainer) -> str | None:
    """What ``--resume last`` does after this fit stopped: continue its run from the checkpoint named, or,
    when the run has none yet, nothing (None when no run directory was claimed yet)."""
    run_dir = trainer.run_state.run_dir
    if run_dir is None:
        return None
    found = checkpoint.newest_valid(run_dir / checkpoint.CHECKPOINT_SUBDIR, resumable=True)
    if found is None:
        return (
            f"{run_dir} has no checkpoint yet, so there is nothing to resume; run the command again (without "
            "--resume) to start over"
        )
    return f"`--resume last` continues {run_dir} from its checkpoint {found.name}"


def hint_despite_ctrl_c(trainer: Trainer) -> str | None:
    """`resume_hint`, asked again when a further Ctrl-C (a second press, a held key) cuts the reading short."""
    for _ in range(5):
        try:
            return resume_hint(trainer)
        except KeyboardInterrupt:
            continue
    return None


def as_command(exc: Exception, argv: Sequence[str] | None) -> str:
    """An error's line for the command: for `NewestRunHasNoCheckpoint`, the exact commands that continue the
    older run or start over (this command line, `argv` or the process's, with ``--resume last`` replaced by
    the older run's directory, or dropped); any other error as it is."""
    if not isinstance(exc, checkpoint.NewestRunHasNoCheckpoint):
        return str(exc)
    words = list(sys.argv[1:] if argv is None else argv)
    flag, kept = _FLAGS[0], words
    for i, word in enumerate(words):
        name, equals, value = word.partition("=")
        if name in _FLAGS and (value == "last" if equals else words[i + 1 : i + 2] == ["last"]):
            flag, kept = name, words[:i] + words[i + (1 if equals else 2) :]
            break
    again = [*kept, flag, str(exc.older)]
    return (
        f"{flag} last: the newest run, {exc.newest} ({exc.how}), has no checkpoint; to continue {exc.older} from "
        f"{exc.checkpoint}: `ember {shlex.join(again)}`; to start over: `ember {shlex.join(kept)}`"
    )
