"""Loop counters: where the run is. Checkpointed as one `Stateful`."""

from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Any


@dataclass
class Progress:
    """Counters of the fit loop.

    - ``epoch``: index of the current training epoch (0-based).
    - ``global_step``: optimizer steps taken since the run began.
    - ``batch_idx``: micro-batches finished in the current epoch.
    - ``validated_after``: index of the batch after which validation last ran in
      this epoch (-1: not yet), so a resumed run neither repeats nor skips it.
    """

    epoch: int = 0
    global_step: int = 0
    batch_idx: int = 0
    validated_after: int = -1

    def state_dict(self) -> dict[str, Any]:
        return asdict(self)

    def load_state_dict(self, state: dict[str, Any]) -> None:
        for key, value in state.items():
            setattr(self, key, value)
