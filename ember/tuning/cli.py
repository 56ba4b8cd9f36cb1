"""``ember tune lr|batch-size`` and ``ember sweep``: their options, and the glue from a YAML config to the finders.

::

    ember tune lr -c configs/digits.yaml                       # prints the suggestion and module.lr=...
    ember tune batch-size -c configs/digits.yaml --memory-budget 2GB
    ember sweep -c configs/digits.yaml --space configs/sweeps/digits.yaml --trials 12 --workers 2

`ember.cli` adds these parsers and hands the parsed arguments to `run`; the options every subcommand has
and building a run from a config come from `ember.commands`. Mistakes are `ConfigError`s (one
line on stderr, exit code 2).
"""

from __future__ import annotations

import argparse
import sys
from typing import Any

from ember.commands import add_command, add_seed, build
from ember.config.errors import ConfigError

TUNE_EPILOG = """\
overrides: key=value or --key=value, as for `ember fit`. The finders train on the config's training
data with its trainer options (precision, accumulation, clipping, strategy), then put everything back;
nothing they run touches a checkpoint. See docs/tuning.md.
"""

SWEEP_EPILOG = """\
overrides: key=value or --key=value, applied to every trial before its own values. Run the same
command again to continue a sweep that was stopped (a trial cut off is retried). Exit code 2: a config,
space or command-line mistake; 1: the sweep stopped before N trials finished (too many trials raised).
"""


def add_parsers(commands: Any) -> None:
    """Add ``tune`` (with ``lr`` and ``batch-size``) and ``sweep`` to the ``ember`` command's subparsers."""
    tune = commands.add_parser(
        "tune", help="find a learning rate or the largest batch size", description="ember tune: run a finder."
    )
    finders = tune.add_subparsers(dest="finder", metavar="FINDER", required=True)
    lr = _add(finders, "lr", "learning-rate range test; prints the suggested lr and its override")
    lr.add_argument("--min-lr", type=float, default=1e-8, metavar="X", help="first learning rate (1e-8)")
    lr.add_argument("--max-lr", type=float, default=1.0, metavar="X", help="last learning rate (1)")
    lr.add_argument("--num-steps", type=int, default=100, metavar="N", help="optimizer steps at most (100)")
    lr.add_argument("--mode", choices=["exponential", "linear"], default="exponential", help="how lr grows")
    lr.add_argument("--key", default="module.lr", metavar="KEY", help="config key of the lr (module.lr)")
    lr.add_argument("--no-plot", action="store_true", help="do not write lr_find.png (no matplotlib needed)")
    batch = _add(finders, "batch-size", "the largest batch size that fits; prints its override")
    batch.add_argument("--init-size", type=int, default=2, metavar="N", help="first size tried (2)")
    batch.add_argument("--max-size", type=int, metavar="N", help="largest size to try (default: the data set)")
    batch.add_argument("--mode", choices=["binsearch", "power"], default="binsearch", help="bisect after doubling")
    batch.add_argument("--steps-per-trial", type=int, default=3, metavar="N", help="optimizer steps per size (3)")
    batch.add_argument("--memory-budget", metavar="BYTES", help="e.g. 2GB or 512MiB (required on the CPU)")
    batch.add_argument("--attr", default="batch_size", metavar="NAME", help="the datamodule's batch size attribute")
    text = "hyperparameter sweep on Optuna (SQLite study, worker processes, pruning)"
    description = "ember sweep: run trials of a config with values from a search space."
    sweep = add_command(commands, "sweep", text, description, SWEEP_EPILOG, "the base config(s)")
    sweep.add_argument("--space", required=True, metavar="FILE", help="the search space (sweep.yaml)")
    sweep.add_argument("--trials", type=int, required=True, metavar="N", help="finished trials to reach")
    sweep.add_argument("--workers", type=int, default=1, metavar="K", help="worker processes (1)")
    sweep.add_argument("--dir", metavar="DIR", help="sweep directory (default <default_root_dir>/sweeps/<space>)")
    sweep.add_argument("--max-failures", type=int, default=3, metavar="N", help="stop after N trials raise (3)")


def _add(finders: Any, name: str, text: str) -> argparse.ArgumentParser:
    sub = add_command(finders, name, text, f"ember tune {name}: {text}.", TUNE_EPILOG)
    add_seed(sub)
    return sub


def run(args: argparse.Namespace, overrides: list[str]) -> int:
    """Run ``ember tune ...`` or ``ember sweep ...``; returns the exit code."""
    _require("optuna" if args.command == "sweep" else None)
    if args.command == "sweep":
        return sweep(args, overrides)
    from ember import config

    if not args.config:
        raise ConfigError(f"ember tune {args.finder}: give the run's config with -c FILE")
    config.add_import_roots(args.config)
    if args.seed is not None:
        overrides = [*overrides, f"seed={args.seed}"]
    loaded = config.load(args.config, overrides)
    resolved = config.resolve(loaded)
    config.check(loaded, resolved, "fit")
    if args.finder == "lr":
        return find_lr(args, resolved, build)
    return find_batch_size(args, resolved, build)


def _require(package: str | None) -> None:
    if package is None:
        return
    import importlib.util

    if importlib.util.find_spec(package) is None:
        raise ConfigError(f"this command needs {package}: pip install 'ember[tune]'")


def find_lr(args: argparse.Namespace, resolved: dict[str, Any], build: Any) -> int:
    from ember.config import instantiate
    from ember.tuning.lr_finder import check_options, lr_find

    try:
        check_options(args.min_lr, args.max_lr, args.num_steps, args.mode, 0.98, 4.0)
    except ValueError as exc:
        raise ConfigError(str(exc)) from exc
    if not args.no_plot:
        _require("matplotlib")
    trainer, module, data = build(resolved)
    logger = instantiate(resolved["trainer"]["logger"], "trainer.logger")  # fresh ones: this run's own
    result = lr_find(
        trainer,
        module,
        datamodule=data,
        min_lr=args.min_lr,
        max_lr=args.max_lr,
        num_steps=args.num_steps,
        mode=args.mode,
        lr_key=args.key,
        logger=logger,
        plot=not args.no_plot,
    )
    if result.run_dir is not None and trainer.is_global_zero:
        print(f"lr_find: run dir {result.run_dir}")
    return 0 if result.suggestion is not None else 1


def find_batch_size(args: argparse.Namespace, resolved: dict[str, Any], build: Any) -> int:
    from ember.tuning.batch_size import BatchSizeError, parse_bytes, scale_batch_size

    if args.memory_budget is not None:
        try:
            parse_bytes(args.memory_budget)
        except ValueError as exc:
            raise ConfigError(f"--memory-budget: {exc}") from exc
    for name in ("init_size", "steps_per_trial", "max_size"):
        value = getattr(args, name)
        if value is not None and value < 1:
            raise ConfigError(f"--{name.replace('_', '-')} must be a positive int; got {value}")
    trainer, module, data = build(resolved)
    try:
        scale_batch_size(
            trainer,
            module,
            datamodule=data,
            init_size=args.init_size,
            max_size=args.max_size,
            mode=args.mode,
            steps_per_trial=args.steps_per_trial,
            memory_budget=args.memory_budget,
            batch_arg_name=args.attr,
            key=f"data.{args.attr}",
        )
    except ValueError as exc:
        raise ConfigError(str(exc)) from exc
    except BatchSizeError as exc:
        print(f"ember: error: {exc}", file=sys.stderr)
        return 1
    return 0


def sweep(args: argparse.Namespace, overrides: list[str]) -> int:
    from ember.tuning.sweep import run_sweep

    if not args.config:
        raise ConfigError("ember sweep: give the base config with -c FILE")
    try:
        result = run_sweep(
            args.config,
            overrides,
            args.space,
            trials=args.trials,
            workers=args.workers,
            directory=args.dir,
            max_failures=args.max_failures,
        )
    except KeyboardInterrupt:
        print("ember: interrupted; run the same command to continue the sweep", file=sys.stderr)
        return 130
    return 0 if result.complete + result.pruned >= args.trials else 1
