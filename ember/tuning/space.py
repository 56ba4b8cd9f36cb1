"""A sweep's search space file (``sweep.yaml``): the swept config keys, the metric, the sampler and the pruner.

::

    metric: val/acc              # a metric the module logs at validation
    direction: maximize          # or minimize
    sampler: tpe                 # tpe | random | grid, or {name: tpe, n_startup_trials: 5, ...}
    pruner: median               # median | hyperband | none, or {name: median, n_warmup_steps: 2, ...}
    seed: 0                      # seeds the sampler (optional)
    parameters:
      module.lr: {distribution: log_uniform, min: 1.0e-4, max: 1.0e-1}
      module.hidden: {distribution: int_uniform, min: 32, max: 512}
      module.dropout: {distribution: uniform, min: 0.0, max: 0.5}
      data.batch_size: {distribution: categorical, values: [32, 64, 128]}

The format follows W&B sweeps where it can: ``metric`` may also be ``{name:
val/acc, goal: maximize}``, a parameter with only ``values`` is categorical,
``log_uniform_values`` is accepted for ``log_uniform``, and ``int_log_uniform``
samples integers on a log scale. Unlike W&B's ``log_uniform``, whose bounds are
exponents, ember's ``min``/``max`` are always the values themselves. The tpe
and random samplers and the pruners are Optuna's (``TPESampler``,
``RandomSampler``; ``MedianPruner``, ``HyperbandPruner``, ``NopPruner``); their
options are passed through. The grid is ember's own: the workers share one list
of its points (`SweepSpace.grid_points`) and queue each point not yet finished or
running, so every point runs once. Everything that could only fail mid-run is
refused here: bounds must be finite, ``min < max`` (``min > 0`` on a log scale),
a categorical's values of one type (``null`` aside) and distinct. A trial
reports the metric after every validation; the pruner's step is the validation's
index (0, 1, ...), so trials with different batch sizes compare at the same point.
"""

from __future__ import annotations

import inspect
import itertools
import json
import math
import random
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from ember.config.errors import ConfigError
from ember.hints import did_you_mean

DISTRIBUTIONS = ("uniform", "log_uniform", "int_uniform", "int_log_uniform", "categorical")
_ALIASES = {"log_uniform_values": "log_uniform"}
SAMPLERS = ("tpe", "random", "grid")
PRUNERS = ("median", "hyperband", "none")
_TOP_KEYS = ("metric", "direction", "sampler", "pruner", "seed", "parameters", "method", "name")


@dataclass
class Parameter:
    """One swept config key and its distribution."""

    key: str
    distribution: str
    low: float | int | None = None
    high: float | int | None = None
    values: list[Any] = field(default_factory=list)

    def suggest(self, trial: Any) -> Any:
        """Draw this parameter's value for an Optuna trial."""
        if self.distribution == "categorical":
            return trial.suggest_categorical(self.key, self.values)
        assert self.low is not None and self.high is not None
        if self.distribution in ("int_uniform", "int_log_uniform"):
            return trial.suggest_int(
                self.key, int(self.low), int(self.high), log=self.distribution == "int_log_uniform"
            )
        return trial.suggest_float(self.key, float(self.low), float(self.high), log=self.distribution == "log_uniform")

    def grid(self) -> list[Any]:
        """The values a grid search visits: the categorical values, or every integer of an int range."""
        if self.distribution == "categorical":
            return list(self.values)
        if self.distribution == "int_uniform" and self.low is not None and self.high is not None:
            return list(range(int(self.low), int(self.high) + 1))
        raise ConfigError(
            f"parameters.{self.key}: the grid sampler needs a list of values; give `values: [...]` instead of "
            f"distribution {self.distribution}"
        )

    def example(self) -> Any:
        """A value inside the distribution (to check the config accepts the key before the sweep starts)."""
        if self.distribution == "categorical":
            return self.values[0]
        assert self.low is not None and self.high is not None
        return int(self.low) if self.distribution.startswith("int") else float(self.low)


@dataclass
class SweepSpace:
    """A parsed ``sweep.yaml``; build it with `SweepSpace.load` or `SweepSpace.from_dict`."""

    parameters: dict[str, Parameter]
    metric: str
    direction: str = "maximize"
    sampler: str = "tpe"
    sampler_options: dict[str, Any] = field(default_factory=dict)
    pruner: str = "median"
    pruner_options: dict[str, Any] = field(default_factory=dict)
    seed: int | None = None
    source: str = "sweep.yaml"

    @classmethod
    def load(cls, path: str | Path) -> SweepSpace:
        """Read and check a sweep file; every mistake is a one-line `ConfigError` naming the key."""
        import yaml

        try:
            data = yaml.safe_load(Path(path).read_text(encoding="utf-8"))
        except OSError as exc:
            raise ConfigError(f"{path}: cannot read the sweep file: {exc.strerror or exc}") from exc
        except yaml.YAMLError as exc:
            mark = getattr(exc, "problem_mark", None)
            where = f"{path}:{mark.line + 1}" if mark is not None else str(path)
            raise ConfigError(f"{where}: YAML syntax error: {getattr(exc, 'problem', exc)}") from exc
        return cls.from_dict(data, str(path))

    @classmethod
    def from_dict(cls, data: Any, source: str = "sweep.yaml") -> SweepSpace:
        def error(key: str, problem: str) -> ConfigError:
            return ConfigError(f"{source}: {key}: {problem}")

        if not isinstance(data, dict):
            raise ConfigError(f"{source}: expected a mapping with metric, parameters, ...; got {data!r}")
        for key in data:
            if key not in _TOP_KEYS:
                hint = did_you_mean(str(key), _TOP_KEYS, f"valid keys: {', '.join(_TOP_KEYS)}", quote=False)
                raise error(str(key), f"no such key; {hint}")
        metric, direction = _metric(data, error)
        sampler, sampler_options = _named(data.get("sampler", data.get("method", "tpe")), "sampler", SAMPLERS, error)
        sampler = {"bayes": "tpe"}.get(sampler, sampler)
        pruner, pruner_options = _named(data.get("pruner", "median"), "pruner", PRUNERS, error)
        seed = data.get("seed")
        if seed is not None and (isinstance(seed, bool) or not isinstance(seed, int)):
            raise error("seed", f"expected an int, got {seed!r}")
        raw = data.get("parameters")
        if not isinstance(raw, dict) or not raw:
            raise error("parameters", "give at least one config key to sweep, e.g. module.lr: {distribution: ...}")
        parameters = {str(key): _parameter(str(key), spec, error) for key, spec in raw.items()}
        space = cls(parameters, metric, direction, sampler, sampler_options, pruner, pruner_options, seed, source)
        if sampler == "grid":
            _check_grid_options(sampler_options, error)
            for parameter in parameters.values():
                parameter.grid()
        space.make_sampler(0, 0)  # unknown sampler/pruner options fail now, not in the workers
        space.make_pruner()
        return space

    def to_dict(self) -> dict[str, Any]:
        """The space as plain data (saved with the sweep, compared when it is run again)."""
        return {
            "metric": self.metric,
            "direction": self.direction,
            "sampler": {"name": self.sampler, **self.sampler_options},
            "pruner": {"name": self.pruner, **self.pruner_options},
            "seed": self.seed,
            "parameters": {
                p.key: {"distribution": p.distribution, "min": p.low, "max": p.high, "values": p.values}
                for p in self.parameters.values()
            },
        }

    def grid_size(self) -> int | None:
        """Points of the grid (None unless the sampler is grid)."""
        if self.sampler != "grid":
            return None
        size = 1
        for parameter in self.parameters.values():
            size *= len(parameter.grid())
        return size

    def grid_points(self) -> list[dict[str, Any]]:
        """Every point of the grid once, in the order a sweep visits them: shuffled by the sampler's ``seed`` (else
        the space's, else 0), so a sweep of fewer trials than points spreads over the grid."""
        keys = list(self.parameters)
        values = [parameter.grid() for parameter in self.parameters.values()]
        points = [dict(zip(keys, combination, strict=True)) for combination in itertools.product(*values)]
        seed = self.sampler_options.get("seed", self.seed)
        random.Random(0 if seed is None else seed).shuffle(points)
        return points

    def make_sampler(self, worker: int, offset: int) -> Any:
        """The Optuna sampler of worker `worker`; its seed also depends on `offset` (trials already in the study),
        so workers, and the workers of a resumed sweep, do not draw the same points."""
        import optuna

        seed = None if self.seed is None else self.seed + 1_000_003 * worker + offset
        options = {"seed": seed, **self.sampler_options}
        if self.sampler == "grid":  # the worker queues each point as fixed values (`grid_points`): never asked
            return optuna.samplers.RandomSampler(seed=seed)
        kind = optuna.samplers.TPESampler if self.sampler == "tpe" else optuna.samplers.RandomSampler
        return _build(kind, "sampler", self.source, **options)

    def make_pruner(self) -> Any:
        import optuna

        if self.pruner == "median":
            return _build(optuna.pruners.MedianPruner, "pruner", self.source, **self.pruner_options)
        if self.pruner == "hyperband":
            options = {"min_resource": 1, "max_resource": "auto", "reduction_factor": 3, **self.pruner_options}
            return _build(optuna.pruners.HyperbandPruner, "pruner", self.source, **options)
        return _build(optuna.pruners.NopPruner, "pruner", self.source, **self.pruner_options)


def _build(kind: Any, what: str, source: str, *args: Any, **options: Any) -> Any:
    accepted = inspect.signature(kind).parameters
    for name in options:
        if name not in accepted:
            hint = did_you_mean(name, accepted, f"{kind.__name__} takes: {', '.join(accepted)}", quote=False)
            raise ConfigError(f"{source}: {what}.{name}: {kind.__name__} has no option {name!r}; {hint}")
    try:
        return kind(*args, **options)
    except (TypeError, ValueError) as exc:
        raise ConfigError(f"{source}: {what}: {kind.__name__}(...) raised {type(exc).__name__}: {exc}") from exc


def _metric(data: dict[str, Any], error: Any) -> tuple[str, str]:
    metric, direction = data.get("metric"), data.get("direction")
    if isinstance(metric, dict):  # W&B: {name: val/acc, goal: maximize}
        extra = set(metric) - {"name", "goal"}
        if extra:
            raise error(f"metric.{sorted(extra)[0]}", "no such key; a metric has name and goal")
        direction = direction or metric.get("goal")
        metric = metric.get("name")
    if not isinstance(metric, str) or not metric:
        raise error("metric", "name the metric to optimise, e.g. metric: val/acc (a value the module logs)")
    direction = direction or "maximize"
    if direction not in ("maximize", "minimize"):
        raise error("direction", f"expected maximize or minimize, got {direction!r}")
    return metric, direction


def _named(value: Any, what: str, names: tuple[str, ...], error: Any) -> tuple[str, dict[str, Any]]:
    options: dict[str, Any] = {}
    if isinstance(value, dict):
        options = {k: v for k, v in value.items() if k != "name"}
        value = value.get("name")
    if value is None and what == "pruner":
        value = "none"
    value = {"bayes": "tpe", "nop": "none"}.get(str(value), value)
    if value not in names:
        raise error(what, f"expected one of {', '.join(names)}, got {value!r}")
    return str(value), options


def _parameter(key: str, spec: Any, error: Any) -> Parameter:
    where = f"parameters.{key}"
    if not isinstance(spec, dict):
        raise error(where, f"expected a mapping like {{distribution: log_uniform, min: 1e-4, max: 1e-1}}, got {spec!r}")
    extra = set(spec) - {"distribution", "min", "max", "values"}
    if extra:
        raise error(f"{where}.{sorted(extra)[0]}", "no such key; use distribution, min, max or values")
    distribution = spec.get("distribution", "categorical" if "values" in spec else None)
    distribution = _ALIASES.get(str(distribution), distribution)
    if distribution not in DISTRIBUTIONS:
        raise error(
            f"{where}.distribution", f"expected one of {', '.join(DISTRIBUTIONS)}, got {spec.get('distribution')!r}"
        )
    if distribution == "categorical":
        values = spec.get("values")
        if not isinstance(values, list) or not values:
            raise error(f"{where}.values", "a categorical parameter needs a non-empty list of values")
        _check_values(values, f"{where}.values", error)
        return Parameter(key, distribution, values=values)
    low, high = spec.get("min"), spec.get("max")
    for name, bound in (("min", low), ("max", high)):
        if isinstance(bound, bool) or not isinstance(bound, (int, float)) or not math.isfinite(bound):
            raise error(f"{where}.{name}", f"expected a finite number, got {_yaml(bound)}")
    assert low is not None and high is not None
    if not low < high:
        raise error(where, f"min ({low}) must be below max ({high})")
    if distribution in ("log_uniform", "int_log_uniform") and low <= 0:
        raise error(f"{where}.min", f"a log distribution needs min > 0, got {low}")
    if distribution.startswith("int") and (low != int(low) or high != int(high)):
        raise error(where, f"an int distribution needs whole-number bounds, got {low} and {high}")
    return Parameter(key, distribution, low, high)


def _check_grid_options(options: dict[str, Any], error: Any) -> None:
    for name, value in options.items():
        if name != "seed":
            raise error(f"sampler.{name}", "the grid sampler takes only seed (it orders the points)")
        if isinstance(value, bool) or not isinstance(value, int):
            raise error("sampler.seed", f"expected an int, got {value!r}")


def _check_values(values: list[Any], where: str, error: Any) -> None:
    """A categorical's values: plain, finite, all of one type (null aside: it may stand beside any type), and
    each listed once, so every value a trial may draw is as valid as the first one the config check tried."""
    first: Any = None
    seen: list[Any] = []
    for value in values:
        if value is not None and not isinstance(value, (bool, int, float, str)):
            raise error(where, f"values must be numbers, strings, booleans or null; got {value!r}")
        if isinstance(value, float) and not math.isfinite(value):
            raise error(where, f"{_yaml(value)} is not a finite number")
        if value is not None and first is not None and type(value) is not type(first):
            whole = first if type(first) is int else value
            hint = f" (write {float(whole)!r} for a float)" if {type(first), type(value)} == {int, float} else ""
            raise error(
                where,
                f"values of one type expected (null aside); got {type(first).__name__} {first!r} and "
                f"{type(value).__name__} {value!r}{hint}",
            )
        if any(type(value) is type(other) and value == other for other in seen):
            raise error(where, f"{_yaml(value)} is listed twice")
        first = value if first is None else first
        seen.append(value)


def _yaml(value: Any) -> str:
    """`value` as the space file spells it (``.inf``, ``.nan``, ``null``)."""
    if isinstance(value, float) and not math.isfinite(value):
        return ".nan" if value != value else (".inf" if value > 0 else "-.inf")
    return "null" if value is None else repr(value)


def trial_values(trial: Any) -> dict[str, Any]:
    """The values a trial runs with: those it was queued with (a grid point, a retry), else those it drew."""
    fixed = trial.system_attrs.get("fixed_params")
    return dict(fixed) if fixed else dict(trial.params)


def point_key(values: dict[str, Any]) -> str:
    """One text per set of values (a grid point), the same whether the values came from the space or the study."""
    return json.dumps(values, sort_keys=True)


def override(key: str, value: Any) -> str:
    """``key=value`` as a command-line override that reads back as the same value (JSON is YAML). A string
    holding ``${...}`` stays an interpolation, as it would in a config file."""
    return f"{key}={json.dumps(value, ensure_ascii=False)}"
