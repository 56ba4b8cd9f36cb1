"""Error messages that name what the user probably meant: the one place ember asks difflib for a spelling."""

from __future__ import annotations

import difflib
from collections.abc import Iterable


def did_you_mean(name: str, valid: Iterable[str], otherwise: str, quote: bool = True) -> str:
    """``did you mean 'x'?`` for the valid name closest to `name`, or `otherwise` when none is close.

    `quote=False` writes the name bare, as config keys are written (``did you mean trainer.max_epochs?``).
    """
    close = difflib.get_close_matches(name, list(valid), n=1)
    if not close:
        return otherwise
    return f"did you mean {close[0]!r}?" if quote else f"did you mean {close[0]}?"
