"""The rule SpikeGuard's detector documents, computed the plain way (`statistics.median`, no shortcut): the
reference the detector's tests compare it with."""

from __future__ import annotations

import math
import statistics


class Plain:
    """A loss is a spike when not finite, or above factor x `statistics.median` of the last `window` losses before
    it (a negative median: above it by factor - 1 times its magnitude), once it has losses before it and `warmup`
    steps before its own were checked; a check's losses one after another."""

    def __init__(self, factor: float, window: int, warmup: int) -> None:
        self.factor, self.window, self.warmup = factor, window, warmup
        self.history: list[float] = []
        self.checked = 0

    def check(self, values: list[float], steps: list[int]) -> tuple[int, float, float] | None:
        before = list(self.history)
        for i, (value, step) in enumerate(zip(values, steps, strict=True)):
            steps_before = self.checked + len(set(steps[:i]) - {step})
            judged = bool(before) and steps_before >= self.warmup
            median = statistics.median(before[-self.window :]) if judged else math.nan
            limit = median * (self.factor if median >= 0 else 2 - self.factor)
            if not math.isfinite(value) or value > limit:
                return step, value, median
            before.append(value)
        self.checked += len(set(steps))
        self.history = (self.history + values)[-self.window :]
        return None


def same(a: tuple[int, float, float] | None, b: tuple[int, float, float] | None) -> bool:
    """The same check result (NaN medians equal)."""
    if a is None or b is None:
        return a is b
    return a[0] == b[0] and all(x == y or (math.isnan(x) and math.isnan(y)) for x, y in zip(a[1:], b[1:], strict=True))
