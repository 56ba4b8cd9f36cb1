"""The ``ember`` command: parse the command line, load and check the config, build the objects, run.

::

    ember fit -c configs/digits.yaml trainer.max_epochs=3 --module.lr=3e-4
    ember fit -c configs/digits.yaml --resume last
    ember test -c configs/digits.yaml --ckpt-path best
    ember fit -c configs/digits.yaml --print-config
    ember export --ckpt last -c configs/digits.yaml --format onnx --out exports
    ember tune lr -c configs/digits.yaml
    ember sweep -c configs/digits.yaml --space configs/sweeps/digits.yaml --trials 12 --workers 2
    ember port model.py
    ember runs

Every config mistake is found before anything is built: one line on stderr, exit code 2, no run
directory (``--debug`` adds the traceback). The schema and the checks live in `ember.config`.
"""

from __future__ import annotations

import argparse
import atexit
import signal
import sys
import threading
import time
import traceback
from collections.abc import Sequence
from pathlib import Path
from types import CodeType, FrameType
from typing import TYPE_CHECKING, Any

from ember import resuming
from ember.commands import add_command, add_seed, build

if TYPE_CHECKING:
    from ember.modules.datamodule import DataModule
    from ember.modules.module import TrainingModule
    from ember.trainer.trainer import Trainer

COMMANDS = {
    "fit": "train the module (and validate it as configured)",
    "validate": "run one validation epoch",
    "test": "run one test epoch",
    "predict": "run predict_step on the predict data; saves the outputs to <run dir>/predictions.pt",
}

EPILOG = """\
overrides: key=value or --key=value, with the value read as YAML, e.g. trainer.max_epochs=3
module.lr=3e-4 --data.batch_size=32 'trainer.callbacks=[]'. Layers, later wins: schema defaults <
each -c file in order < overrides. Exit code 2: a config or command-line mistake (nothing was run).
"""


def build_parser() -> argparse.ArgumentParser:
    """The argument parser of the ``ember`` command (overrides are the arguments it does not know)."""
    parser = argparse.ArgumentParser(
        prog="ember", description="Run an ember TrainingModule from YAML configs.", allow_abbrev=False
    )
    from ember.version import __version__

    parser.add_argument("--version", action="version", version=f"ember {__version__}")
    commands = parser.add_subparsers(dest="command", metavar="COMMAND", required=True)
    for name, text in COMMANDS.items():
        sub = add_command(commands, name, text, f"ember {name}: {text}.", EPILOG)
        add_seed(sub)
        sub.add_argument("--print-config", action="store_true", help="print the resolved config as YAML and exit")
        # One name for a checkpoint everywhere: --ckpt (last, best or a path); fit's --resume and the
        # evaluations' --ckpt-path are other names for it.
        if name == "fit":
            sub.add_argument(
                "--ckpt",
                "--resume",
                dest="ckpt",
                metavar="last|best|PATH",
                help="continue from a checkpoint; 'last': the newest complete one of this run name (its run "
                "continues); 'best' or a path: its state, in a new run",
            )
        else:
            sub.add_argument(
                "--ckpt",
                "--ckpt-path",
                dest="ckpt",
                metavar="last|best|PATH",
                help="load these weights first; 'best'/'last': from the newest run of this run name that has "
                "checkpoints (--run picks another). Results are written into the checkpoint's run (eval/)",
            )
            sub.add_argument(
                "--run",
                metavar="version_N",
                help="with --ckpt best|last: take the checkpoint from this run (runs/<name>/version_N)",
            )
    from ember.export.command import add_export_parser

    add_export_parser(commands)
    from ember.tuning.cli import add_parsers  # `ember tune` and `ember sweep` live in ember/tuning/

    add_parsers(commands)
    from ember.port import add_parser as add_port_parser  # `ember port` lives in ember/port/

    add_port_parser(commands)
    from ember.runs import add_parser as add_runs_parser  # `ember runs` lives in ember/runs.py

    add_runs_parser(commands)
    return parser


#: Exit codes of the ``ember`` command (docs/cli.md, "Exit codes").
EXIT_FAILED = 1  # the run failed: a non-finite loss, a checkpoint that could not be written, a bug (traceback)
EXIT_MISTAKE = 2  # a config, command line, checkpoint or data mistake; nothing was trained
EXIT_INTERRUPTED = 130  # Ctrl-C (128 + SIGINT)


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of ``ember`` and ``python -m ember``; returns the exit code.

    Expected failures are one ``ember: error:`` line on stderr and a documented exit code, never a
    traceback (``--debug`` adds it): `EXIT_MISTAKE` for what the user gave (config, command line, a
    checkpoint that cannot be used, an empty dataloader), `EXIT_FAILED` for a run that failed on its own
    (a non-finite loss, a checkpoint that could not be written), `EXIT_INTERRUPTED` for Ctrl-C, however
    many times it is pressed. Without `argv` (the process's own command line) a Ctrl-C once the command
    has ended is ignored, so the interpreter's exit cannot print a traceback either.
    """
    interrupts = _Interrupts({main.__code__, _run_reporting.__code__}, at_exit=argv is None)
    try:
        return _run_reporting(argv)
    finally:
        interrupts.end()


def _run_reporting(argv: Sequence[str] | None) -> int:
    """Parse, run, and turn each expected failure into its line and exit code (see `main`)."""
    from ember.checkpoint import CheckpointError, CheckpointWriteError
    from ember.errors import UsageError
    from ember.trainer.data import EmptyDataError
    from ember.trainer.numerics import NonFiniteLoss

    debug = False
    try:
        args, overrides = build_parser().parse_known_args(argv)
        debug = args.debug
        return _main(args, overrides)
    except (UsageError, CheckpointError, EmptyDataError, NonFiniteLoss) as exc:
        # A config, checkpoint or data the user gave that cannot be used: exit 2. A checkpoint that could not
        # be written (a full disk) or a loss that became inf/NaN: exit 1. Either way one line; the previous
        # checkpoint and `last` are intact (a flagged step is never saved).
        if debug:
            traceback.print_exc()
        failed = isinstance(exc, (CheckpointWriteError, NonFiniteLoss))
        print(f"ember: error: {resuming.as_command(exc, argv)}", file=sys.stderr)
        return EXIT_FAILED if failed else EXIT_MISTAKE
    except FileNotFoundError as exc:  # a data file the config names (relative paths: docs/your-data.md)
        if debug:
            traceback.print_exc()
        print(f"ember: error: no such file: {exc.filename or exc} (from {Path.cwd()}, and beside the config file)",
              file=sys.stderr)  # fmt: skip
        return EXIT_MISTAKE
    except KeyboardInterrupt as exc:
        print(f"ember: {exc if isinstance(exc, resuming.Interrupted) else 'interrupted'}", file=sys.stderr)
        return EXIT_INTERRUPTED


class _Interrupts:
    """Ctrl-C while the ``ember`` command runs.

    A first Ctrl-C raises `KeyboardInterrupt` where the run is (it stops; the loggers close; a checkpoint
    write in flight completes), and so does a second one during that cleanup (it is cut short; a checkpoint
    is complete or absent, never half-written, and ``last`` names a complete one). Either ends in `main`:
    one line, exit 130. A Ctrl-C that arrives while `main` itself is printing that line or returning is
    ignored (`owners`: the code of `main` and of what reports), and, for the command (`at_exit`), so is
    every Ctrl-C after it, through the interpreter's exit, where Python would otherwise print a
    `KeyboardInterrupt` traceback from an exit hook or die of the signal instead of exiting 130. Called
    in a process that has other uses for Ctrl-C (a test, a notebook), the previous handler is put back
    when `main` returns; a process that ignores Ctrl-C (a background job) keeps ignoring it.
    """

    def __init__(self, owners: set[CodeType], at_exit: bool) -> None:
        # `end` itself too: a Ctrl-C arriving as `main`'s `finally` enters it (before `ended` is set) is one
        # more press during the command's own exit
        self.owners, self.at_exit, self.ended = {*owners, _Interrupts.end.__code__}, at_exit, False
        self.previous: Any = None  # None after installing: a handler set outside Python (it has no Python name)
        self.installed = False
        # Signals reach the main thread only; a handler is only installed where Ctrl-C is not ignored.
        if threading.current_thread() is threading.main_thread() and signal.getsignal(signal.SIGINT) != signal.SIG_IGN:
            self.previous = signal.signal(signal.SIGINT, self._handle)
            self.installed = True

    def _handle(self, signum: int, frame: FrameType | None) -> None:
        if self.ended or (frame is not None and frame.f_code in self.owners):
            return  # the command is already on its way out
        raise KeyboardInterrupt

    def end(self) -> None:
        self.ended = True
        if not self.installed:
            return
        if self.at_exit:  # ignored from here on: a Python handler would be reset to the default at exit
            atexit.register(signal.signal, signal.SIGINT, signal.SIG_IGN)
        else:  # a handler set outside Python cannot be named to put it back: Python's own takes its place
            signal.signal(signal.SIGINT, signal.default_int_handler if self.previous is None else self.previous)


def _main(args: argparse.Namespace, overrides: list[str]) -> int:
    from ember import config

    if args.command == "export":
        from ember.export.command import run as run_export

        return run_export(args, overrides)
    if args.command == "port":
        from ember.port import run as run_port

        return run_port(args, overrides)
    if args.command == "runs":
        from ember.runs import run as run_runs

        return run_runs(args, overrides)
    if args.command in ("tune", "sweep"):
        from ember.tuning.cli import run as run_tuning

        return run_tuning(args, overrides)
    check_options(args.command, overrides)
    if not args.config and not any(o.lstrip("-").startswith("module") for o in overrides):
        raise config.ConfigError(
            f"no config given; name one with -c, e.g. `ember {args.command} -c configs/digits.yaml` "
            "(docs/your-data.md writes one for your data)"
        )
    config.add_import_roots(args.config)
    if args.seed is not None:
        overrides = [*overrides, f"seed={args.seed}"]
    loaded = config.load(args.config, overrides)
    resolved = config.resolve_paths(config.resolve(loaded), args.config)
    config.check(loaded, resolved, args.command)
    ckpt_path = _checkpoint_option(args)
    if args.print_config:
        sys.stdout.write(config.to_yaml(resolved))
        return 0
    trainer, module, data = build(resolved)
    if getattr(args, "run", None) is not None:
        ckpt_path = _checkpoint_of_run(trainer, module, args.command, ckpt_path, args.run)
    from ember.trainer.numerics import NonFiniteLoss

    try:
        run(args.command, trainer, module, data, ckpt_path)
    except KeyboardInterrupt:
        if args.command != "fit":
            raise
        hint = resuming.hint_despite_ctrl_c(trainer)
        raise resuming.Interrupted(f"interrupted; {hint}" if hint else "interrupted before the run started") from None
    except NonFiniteLoss as exc:
        hint = resuming.hint_despite_ctrl_c(trainer)
        raise NonFiniteLoss(f"{exc}; {hint}" if hint else str(exc)) from exc
    return 0


#: Options one subcommand has and another lacks: what to write instead, by subcommand kind.
_OTHER_OPTIONS = {
    "--resume": "--ckpt last (or best, or a checkpoint path) loads a checkpoint's weights",
    "--ckpt-path": "--ckpt last (or --resume last) continues training from a checkpoint",
    "--run": "--ckpt last continues the newest run; --ckpt PATH any checkpoint",
}


def check_options(command: str, overrides: list[str]) -> None:
    """An option of another subcommand (``ember test --resume``, ``ember fit --ckpt-path``) is a mistake whose
    advice names the option this subcommand has, not an override form that would fail next."""
    from ember.config import ConfigError

    has = {"--resume"} if command == "fit" else {"--ckpt-path", "--run"}  # --ckpt: every subcommand
    for item in overrides:
        name = item.split("=", 1)[0]
        if name in _OTHER_OPTIONS and name not in has:
            raise ConfigError(f"ember {command} has no {name} option; {_OTHER_OPTIONS[name]}")


def _checkpoint_of_run(trainer: Trainer, module: TrainingModule, command: str, which: str | None, run: str) -> str:
    """``--run version_N``: the checkpoint ``--ckpt best|last`` names inside that run, as a path."""
    from ember import checkpoint
    from ember.config import ConfigError
    from ember.trainer.setup import run_name

    if which not in ("best", "last"):
        raise ConfigError("--run: give --ckpt best or --ckpt last with it (a path names its run already)")
    name = trainer.options.run_name or run_name(module)
    if checkpoint.is_url(trainer.options.default_root_dir):  # the run is on a store: its checkpoints folder's newest
        from ember.checkpoint.store import join

        if which == "best":
            raise ConfigError("--run with a default_root_dir on a store takes --ckpt last (or the checkpoint's URL)")
        return join(str(trainer.options.default_root_dir), name, run, checkpoint.CHECKPOINT_SUBDIR)
    root = Path(trainer.options.default_root_dir) / name
    path, _, _ = checkpoint.resolve_ckpt_path(which, root, command, [], run=run)
    assert path is not None  # only fit's 'last' finds nothing without an error
    return str(path)


def describe_hardware(trainer: Trainer) -> str | None:
    """One line saying what fit runs on (device, process count, strategy, precision), or None in a process
    that does not print it (a launcher about to start the workers, a rank other than 0)."""
    import torch

    from ember.strategies.parallel import ParallelStrategy

    strategy = trainer.strategy
    if isinstance(strategy, ParallelStrategy):
        if strategy.global_rank != 0 or (strategy.cluster.kind == "single" and strategy.world_size_requested > 1):
            return None  # not rank 0, or the launcher: the workers' rank 0 prints it
        cuda = strategy.accelerator == "cuda" or (strategy.accelerator == "auto" and torch.cuda.is_available())
        count, nodes = strategy.devices, strategy.num_nodes
    else:
        cuda, count, nodes = strategy.root_device.type == "cuda", 1, 1
    device = f"cuda ({torch.cuda.get_device_name(0)})" if cuda else "cpu"
    processes = _count(count * nodes, "process") + (f" on {nodes} nodes" if nodes > 1 else "")
    kind = _STRATEGY_NAMES.get(type(strategy).__name__, type(strategy).__name__)
    return f"fit on {device}: {processes}, strategy {kind}, precision {strategy.precision.name}"


_STRATEGY_NAMES = {
    "Strategy": "single_device",
    "DDPStrategy": "ddp",
    "FSDPStrategy": "fsdp",
    "ModelParallelStrategy": "model_parallel",
}


def _checkpoint_option(args: argparse.Namespace) -> str | None:
    from ember.checkpoint.store import is_url
    from ember.config import ConfigError

    value = args.ckpt
    if value is not None and value not in ("last", "best") and not is_url(value) and not Path(value).exists():
        raise ConfigError(f"--ckpt: no checkpoint at {value}; give a checkpoint path, 'last' or 'best'")
    if value is None and args.command != "fit" and not args.print_config:
        print(
            f"ember: note: no --ckpt given; {args.command} uses the weights the module is built with",
            file=sys.stderr,
        )
    return value


def run(command: str, trainer: Trainer, module: TrainingModule, data: DataModule, ckpt_path: str | None) -> None:
    """Call ``trainer.<command>`` and print a one-line summary from process 0.

    ``predict`` saves its outputs with `torch.save` to ``<run dir>/predictions.pt`` (one file per
    process, ``predictions-rank<N>.pt``, when several processes predict their shares of the data); for a
    run on a store (``default_root_dir`` a URL) the file is copied to the same place under the run's URL.
    """
    kwargs: dict[str, Any] = {"datamodule": data}
    if ckpt_path is not None:
        kwargs["ckpt_path"] = ckpt_path
    start = time.perf_counter()
    if command == "fit":
        line = describe_hardware(trainer)
        if line is not None:
            print(f"ember: {line}", file=sys.stderr, flush=True)
        trainer.fit(module, **kwargs)
        metrics = {k: v for k, v in trainer.callback_metrics.items() if k.startswith("val/")}
        where = f"{_count(trainer.current_epoch, 'epoch')}, {_count(trainer.global_step, 'step')}"
    elif command == "predict":
        import torch

        predictions = trainer.predict(module, **kwargs)
        loaded = trainer.ckpt_path
        stem = f"eval/predict-{loaded.name}" if loaded is not None else "predictions"
        name = f"{stem}.pt" if trainer.world_size == 1 else f"{stem}-rank{trainer.global_rank}.pt"
        path = trainer.run_dir / name
        path.parent.mkdir(parents=True, exist_ok=True)
        torch.save(predictions, path)
        saved = str(path) if trainer.world_size == 1 else str(path.with_name(path.name.replace("rank0", "rank*")))
        if trainer.run_url is not None:  # the run lives on a store: the outputs go beside its logs there
            from ember.checkpoint.run_store import upload_file
            from ember.checkpoint.store import join, redact

            try:
                upload_file(trainer.run_dir, trainer.run_url, path)
                shown_name = Path(saved).relative_to(trainer.run_dir).as_posix()
                saved = f"{redact(join(trainer.run_url, shown_name))} (staged in {saved})"
            except OSError as exc:
                print(f"ember: warning: could not copy {path} to the store ({exc}); copy it by hand", file=sys.stderr)
        n = len(predictions)
        elapsed = time.perf_counter() - start
        if trainer.is_global_zero:
            print(f"predict done in {elapsed:.1f} s: {_count(n, 'batch')} of outputs saved to {saved}")
        return
    else:
        results = trainer.validate(module, **kwargs) if command == "validate" else trainer.test(module, **kwargs)
        metrics = {k: v for result in results for k, v in result.items()}
        where = _count(len(results), "dataloader")
    shown = "  ".join(f"{k} {v:.4f}" for k, v in sorted(metrics.items()))
    if not shown:
        finished = command == "fit" and trainer.progress.resumed_finished
        shown = _NOTHING_TO_DO if finished else "no metrics"
    elapsed = time.perf_counter() - start
    if trainer.is_global_zero:
        print(f"{command} done in {elapsed:.1f} s ({where}): {shown}; {run_location(trainer)}")
        if command == "fit" and shown != _NOTHING_TO_DO:
            print(describe_stop(trainer))


#: The summary of a fit that resumed a finished run (no stop line follows it).
_NOTHING_TO_DO = "nothing to do, the run had finished already"


def describe_stop(trainer: Trainer) -> str:
    """Why the fit ended and which checkpoint is best, in one line: ``stopped: EarlyStopping: val/loss did not
    improve in 3 checks (best 0.1234); best checkpoint runs/x/version_0/checkpoints/epoch=4-step=95 (val/loss
    0.1234)``."""
    reason = trainer.stop_reason
    if reason == "should_stop":
        reasons = ((type(cb).__name__, getattr(cb, "stopping_reason", None)) for cb in trainer.callbacks)
        asked = [f"{name}: {reason}" for name, reason in reasons if isinstance(reason, str)]
        why = "; ".join(asked) or "a hook set trainer.should_stop"
    elif reason == "max_epochs":
        why = f"max_epochs={trainer.max_epochs} reached"
    elif reason == "max_steps":
        why = f"max_steps={trainer.max_steps} reached"
    elif reason == "max_time":
        why = f"max_time ({trainer.options.max_time_s:g} s) reached"
    else:
        why = "the fit has not run"
    best = next((cb for cb in trainer.checkpoint_callbacks if cb.monitor and cb.best_model_path), None)
    if best is None:
        return f"stopped: {why}"
    score = f" ({best.monitor} {best.best_model_score:.4f})" if best.best_model_score is not None else ""
    path = best.best_model_path
    if best.store_url is not None:  # written locally first, kept on the store: that copy is the one that lasts
        from ember.checkpoint.store import join, redact

        path = f"{redact(join(best.store_url, Path(path).name))} (staged in {path})"
    return f"stopped: {why}; best checkpoint {path}{score}"


def run_location(trainer: Trainer) -> str:
    """Where the run is, for the line that ends a command: ``run dir runs/x/version_0``, or for a run on a store
    ``run s3://bucket/runs/x/version_0 (staged in ~/.cache/ember/runs/<hash>/x/version_0)``."""
    if trainer.run_url is None:
        return f"run dir {trainer.run_dir}"
    from ember.checkpoint.store import redact

    return f"run {redact(trainer.run_url)} (staged in {trainer.run_dir})"


def _count(n: int, noun: str) -> str:
    """``"1 epoch"``, ``"2 epochs"``, ``"3 batches"``."""
    return f"{n} {noun}{('es' if noun in ('batch', 'process') else 's') * (n != 1)}"
