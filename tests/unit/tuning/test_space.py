"""The sweep file: what it accepts (W&B-like), every mistake as one line naming the key, and the samplers."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import optuna
import pytest
from hypothesis import given
from hypothesis import strategies as st

from ember.config import ConfigError
from ember.config.loading import parse_overrides
from ember.tuning.space import SweepSpace, override

SPACE = {
    "metric": "val/acc",
    "direction": "maximize",
    "sampler": {"name": "tpe", "n_startup_trials": 4},
    "pruner": {"name": "median", "n_warmup_steps": 2},
    "seed": 3,
    "parameters": {
        "module.lr": {"distribution": "log_uniform", "min": 1e-4, "max": 1e-1},
        "module.hidden": {"distribution": "int_uniform", "min": 16, "max": 64},
        "module.dropout": {"distribution": "uniform", "min": 0.0, "max": 0.5},
        "data.batch_size": {"values": [32, 64]},
    },
}


def test_a_space_samples_inside_its_distributions() -> None:
    space = SweepSpace.from_dict(SPACE)
    assert (space.metric, space.direction, space.sampler, space.pruner) == ("val/acc", "maximize", "tpe", "median")
    study = optuna.create_study(direction="maximize", sampler=space.make_sampler(0, 0))
    for _ in range(20):
        trial = study.ask()
        values = {key: p.suggest(trial) for key, p in space.parameters.items()}
        assert 1e-4 <= values["module.lr"] <= 1e-1 and isinstance(values["module.hidden"], int)
        assert 16 <= values["module.hidden"] <= 64 and 0 <= values["module.dropout"] <= 0.5
        assert values["data.batch_size"] in (32, 64)
        study.tell(trial, 0.5)
    dists = study.trials[0].distributions
    assert dists["module.lr"].log and not dists["module.dropout"].log
    assert isinstance(space.make_pruner(), optuna.pruners.MedianPruner)


def test_wandb_forms_are_accepted() -> None:
    space = SweepSpace.from_dict(
        {
            "metric": {"name": "val/loss", "goal": "minimize"},
            "method": "random",
            "parameters": {"module.lr": {"distribution": "log_uniform_values", "min": 1e-3, "max": 1.0}},
        }
    )
    assert (space.metric, space.direction, space.sampler) == ("val/loss", "minimize", "random")
    assert space.parameters["module.lr"].distribution == "log_uniform"


def test_workers_get_different_seeds() -> None:
    space = SweepSpace.from_dict({**SPACE, "sampler": "random"})
    draws = []
    for worker in (0, 1):
        study = optuna.create_study(sampler=space.make_sampler(worker, 0))
        draws.append(space.parameters["module.lr"].suggest(study.ask()))
    assert draws[0] != draws[1]
    again = optuna.create_study(sampler=space.make_sampler(0, 0))
    assert space.parameters["module.lr"].suggest(again.ask()) == draws[0]  # seeded: reproducible


def test_grid_needs_values_and_knows_its_size() -> None:
    grid = {
        "metric": "val/acc",
        "sampler": "grid",
        "parameters": {"a": {"values": [1, 2, 3]}, "b": {"values": ["x", "y"]}},
    }
    assert SweepSpace.from_dict(grid).grid_size() == 6
    bad = {**grid, "parameters": {"a": {"distribution": "uniform", "min": 0, "max": 1}}}
    with pytest.raises(ConfigError, match="the grid sampler needs a list of values"):
        SweepSpace.from_dict(bad)


def test_the_grid_lists_every_point_once_in_a_seeded_order() -> None:
    grid = {
        "metric": "val/acc",
        "sampler": "grid",
        "parameters": {
            "a": {"values": [1, 2, 3]},
            "b": {"values": ["x", "y"]},
            "c": {"min": 4, "max": 5, "distribution": "int_uniform"},
        },
    }
    points = SweepSpace.from_dict(grid).grid_points()
    every = [{"a": a, "b": b, "c": c} for a in (1, 2, 3) for b in ("x", "y") for c in (4, 5)]
    assert sorted(points, key=str) == sorted(every, key=str) and len(points) == 12
    assert SweepSpace.from_dict(grid).grid_points() == points  # the same for every worker and every run
    reseeded = SweepSpace.from_dict({**grid, "sampler": {"name": "grid", "seed": 5}}).grid_points()
    assert reseeded != points and sorted(reseeded, key=str) == sorted(every, key=str)
    assert SweepSpace.from_dict({**grid, "seed": 5}).grid_points() == reseeded  # the space's seed, if no other
    with pytest.raises(ConfigError, match=r"sampler\.shuffle: the grid sampler takes only seed"):
        SweepSpace.from_dict({**grid, "sampler": {"name": "grid", "shuffle": True}})


@pytest.mark.parametrize(
    ("change", "message"),
    [
        ({"metrc": "x"}, "metrc: no such key; did you mean metric?"),
        ({"metric": None}, "metric: name the metric"),
        ({"direction": "up"}, "direction: expected maximize or minimize"),
        ({"sampler": "bayesian"}, "sampler: expected one of tpe, random, grid"),
        ({"pruner": {"name": "median", "warmup": 2}}, "pruner.warmup: MedianPruner has no option 'warmup'"),
        ({"parameters": {}}, "parameters: give at least one config key"),
        ({"parameters": {"module.lr": 0.1}}, "parameters.module.lr: expected a mapping"),
        ({"parameters": {"module.lr": {"distribution": "normal", "min": 0, "max": 1}}}, "expected one of uniform"),
        ({"parameters": {"module.lr": {"distribution": "uniform", "min": 1, "max": 0}}}, "min (1) must be below"),
        ({"parameters": {"m.lr": {"distribution": "log_uniform", "min": 0, "max": 1}}}, "needs min > 0"),
        ({"parameters": {"m.n": {"distribution": "int_uniform", "min": 0.5, "max": 4}}}, "whole-number bounds"),
        ({"parameters": {"m.n": {"distribution": "uniform", "min": 0, "max": 1, "step": 2}}}, "m.n.step: no such key"),
        ({"parameters": {"m.n": {"values": [[1, 2]]}}}, "values must be numbers"),
        (
            {"parameters": {"m.n": {"distribution": "uniform", "min": 0, "max": float("inf")}}},
            "m.n.max: expected a fin",
        ),
        ({"parameters": {"m.n": {"values": [1, None, 2.0]}}}, "got int 1 and float 2.0 (write 1.0 for a float)"),
        ({"parameters": {"m.n": {"values": [0.5, 1]}}}, "got float 0.5 and int 1 (write 1.0 for a float)"),
        ({"parameters": {"m.n": {"values": ["a", "b", "a"]}}}, "m.n.values: 'a' is listed twice"),
        ({"parameters": {"m.n": {"values": [0.5, float("nan")]}}}, "m.n.values: .nan is not a finite number"),
        ({"seed": "zero"}, "seed: expected an int"),
    ],
)
def test_mistakes_are_one_line_naming_the_key(change: dict[str, Any], message: str) -> None:
    with pytest.raises(ConfigError) as info:
        SweepSpace.from_dict({**SPACE, **change}, "s.yaml")
    assert str(info.value).startswith("s.yaml: ") and message in str(info.value)
    assert "\n" not in str(info.value)


def test_load_reports_yaml_errors_with_the_line(tmp_path: Path) -> None:
    path = tmp_path / "s.yaml"
    path.write_text("metric: val/acc\nparameters:\n  a: {min: 1\n", encoding="utf-8")
    with pytest.raises(ConfigError, match=r"s.yaml:\d+: YAML syntax error"):
        SweepSpace.load(path)


def test_to_dict_round_trips() -> None:
    space = SweepSpace.from_dict(SPACE)
    again = SweepSpace.from_dict(space.to_dict())
    assert again.to_dict() == space.to_dict()


@given(
    st.one_of(
        st.floats(allow_nan=False, allow_infinity=False),
        st.integers(-(10**12), 10**12),
        st.booleans(),
        st.none(),
        st.text(st.characters(blacklist_categories=["Cs", "Cc"]), max_size=20).filter(lambda t: "${" not in t),
    )
)
def test_overrides_read_back_as_the_same_value(value: Any) -> None:
    layer = parse_overrides([override("module.x", value)])
    assert layer.values == {"module": {"x": value}}
