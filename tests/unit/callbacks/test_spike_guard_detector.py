"""SpikeGuard's detector against the rule it documents, computed the plain way: a loss is a spike when it is not
finite or above factor x the median (`statistics.median`) of the last `window` losses before it, once it has losses
before it and `warmup_steps` steps before its own were checked; the losses of one check are judged one after
another, as if each were checked alone. The guard skips the median when a floor under the kept losses shows that no
value can be above it; its decisions, medians and kept losses must be those of the plain rule."""

from __future__ import annotations

import math
import sys
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from ember.callbacks import SpikeGuard

sys.path.insert(0, str(Path(__file__).resolve().parent))
from spike_rule import Plain, same

TRAINER: Any = SimpleNamespace(world_size=1)

loss = st.one_of(
    st.floats(min_value=-5.0, max_value=5.0, allow_nan=False),
    st.floats(min_value=0.5, max_value=2.0),  # the usual case: the floor decides alone
    st.floats(min_value=1e3, max_value=1e30),  # spikes
    st.sampled_from([math.inf, -math.inf, math.nan, 1e308]),
)


def check(guard: SpikeGuard) -> tuple[int, float, float] | None:
    """The guard's check of the losses it kept, as its hook runs it."""
    return guard._check(TRAINER)


@settings(deadline=None)
@given(
    factor=st.sampled_from([1.5, 4.0, 10.0]),
    window=st.integers(1, 12),
    warmup=st.integers(0, 6),
    checks=st.lists(st.tuples(st.lists(loss, min_size=1, max_size=6), st.booleans()), min_size=1, max_size=25),
    accumulate=st.integers(1, 3),
)
def test_the_detector_decides_as_the_plain_median_rule(
    factor: float, window: int, warmup: int, checks: list[tuple[list[float], bool]], accumulate: int
) -> None:
    """Each check holds whole steps of `accumulate` batch losses (its last may be shorter, as an epoch's end is)."""
    guard, plain = (
        SpikeGuard(factor=factor, window=window, warmup_steps=warmup, check_every_n_steps=1),
        Plain(factor, window, warmup),
    )
    step, saved = 0, ([], 0)
    for values, go_back in checks:
        steps = [step + 1 + i // accumulate for i in range(len(values))]
        step = steps[-1]
        guard._losses.extend(torch.tensor(v, dtype=torch.float64) for v in values)
        guard._steps.extend(steps)
        found, expected = check(guard), plain.check(values, steps)
        assert same(found, expected), (found, expected)
        assert guard._history == plain.history and guard._checked == plain.checked
        if go_back:  # a rewind: the detector goes back to what it held at an earlier point
            plain.history, plain.checked = list(saved[0]), saved[1]
            guard._keep_history(list(saved[0]))
            guard._checked = saved[1]
        saved = (list(plain.history), plain.checked)


def test_a_clean_check_needs_no_median_and_a_rise_above_the_floor_takes_the_exact_one() -> None:
    guard = SpikeGuard(factor=4.0, window=4, warmup_steps=0, check_every_n_steps=1)
    for step, value in enumerate([1.0, 0.8, 0.9, 1.1], start=1):
        guard._losses.append(torch.tensor(value, dtype=torch.float64))
        guard._steps.append(step)
        assert check(guard) is None
    assert guard._history == [1.0, 0.8, 0.9, 1.1] and guard._floor == 0.8
    # above 4 x 0.8 but not above 4 x the median (0.95): clean
    guard._losses.append(torch.tensor(3.5, dtype=torch.float64))
    guard._steps.append(5)
    assert check(guard) is None
    assert guard._history == [0.8, 0.9, 1.1, 3.5]
    # above 4 x the median of [0.8, 0.9, 1.1, 3.5] (1.0): a spike
    guard._losses.append(torch.tensor(4.1, dtype=torch.float64))
    guard._steps.append(6)
    assert check(guard) == (6, 4.1, 1.0)


def test_a_resumed_detector_judges_its_first_losses_against_the_checkpointed_ones() -> None:
    guard = SpikeGuard(factor=4.0, window=3, warmup_steps=0, check_every_n_steps=1)
    guard.load_state_dict({"history": [1.0, 2.0, 1.5], "checked": 3})
    guard._losses.append(torch.tensor(6.5, dtype=torch.float64))  # above 4 x the median 1.5
    guard._steps.append(4)
    assert check(guard) == (4, 6.5, 1.5)
    guard._losses.append(torch.tensor(5.5, dtype=torch.float64))  # below 4 x 1.5, above 4 x the least (1.0)
    guard._steps.append(4)
    assert check(guard) is None and guard._history == [2.0, 1.5, 5.5]
