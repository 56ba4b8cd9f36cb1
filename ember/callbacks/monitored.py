"""A monitored metric's name, checked as soon as the sanity check has shown what validation logs.

A typo in ``monitor`` (``EarlyStopping(monitor="val/los")``) would otherwise surface at the first validation
of the fit, after an epoch of training. When the sanity check logged a name close to the monitored one but not
the name itself, the name is taken for a typo and the fit stops before its first step (a `UsageError`: one
line from the ``ember`` command, exit 2). A name with no close match is left alone: it may be a training metric,
which no sanity check logs (the callback's own check at its first use still applies).
"""

from __future__ import annotations

import difflib
from typing import TYPE_CHECKING

from ember.errors import UsageError

if TYPE_CHECKING:
    from ember.trainer.trainer import Trainer


def check_after_sanity(trainer: Trainer, owner: str, monitor: str | None) -> None:
    """Raise `UsageError` when `monitor` looks like a misspelling of a metric the sanity check logged."""
    logged = trainer.reporter.sanity_names
    if monitor is None or monitor in logged:
        return
    close = difflib.get_close_matches(monitor, sorted(logged), n=1, cutoff=0.8)
    if close:
        raise UsageError(
            f"{owner}(monitor={monitor!r}): the validation logs no such metric; did you mean {close[0]!r}? "
            f"(it logs: {', '.join(sorted(logged))})"
        )
