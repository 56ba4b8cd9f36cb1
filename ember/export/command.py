"""``ember export``: its options and its run. The command runs no trainer; what it loads and checks is in `rebuild`."""

from __future__ import annotations

import argparse
import sys
import time
import traceback
from pathlib import Path
from typing import Any

from ember.commands import add_command

EXPORT_EPILOG = """\
A checkpoint is data: nothing it names is imported or run. The module is built from the -c config (or
the --module class with the checkpoint's saved hyperparameters) and loads the checkpoint's weights;
differences from the config recorded in the checkpoint are reported. The example input is the module's
example_input_array, else the first rows of a batch of the data. The artifact is checked against the
PyTorch module before it is moved into place; a mismatch is an error (exit 1) and leaves no file.
Exit code 2: a config, checkpoint or command-line mistake. See docs/export.md.
"""


def add_export_parser(commands: Any) -> None:
    """``ember export``: its own options (no trainer run), overrides as for the other subcommands."""
    from ember.export import FORMATS

    text = "export a checkpoint's module to ONNX, TorchScript, torch.export, safetensors, TorchServe or hf"
    description = "ember export: write a checkpoint's module as an inference artifact and check it."
    sub = add_command(commands, "export", text, description, EXPORT_EPILOG, "the run's YAML config (builds the module)")
    sub.add_argument(
        "--ckpt",
        "--ckpt-path",
        dest="ckpt",
        required=True,
        metavar="last|best|PATH",
        help="a checkpoint; 'last': the run's newest; 'best': the best its ModelCheckpoint recorded",
    )
    sub.add_argument(
        "--module",
        metavar="CLASS",
        help="without -c: the TrainingModule class to load the checkpoint into (e.g. my_project.models.Net), "
        "built with the checkpoint's saved hyperparameters",
    )
    sub.add_argument(
        "--trust-checkpoint",
        action="store_true",
        help="without -c: rebuild the module (and data) from the config recorded in the checkpoint. This imports "
        "and runs the classes the file names: use it only for checkpoints you trust. Only TrainingModule and "
        "DataModule subclasses with plain-data arguments are built",
    )
    sub.add_argument("--format", required=True, choices=list(FORMATS), help="what to write")
    sub.add_argument("--out", required=True, metavar="DIR", help="folder for the artifact")
    sub.add_argument("--name", metavar="NAME", help="file name without suffix (default: the run name)")
    sub.add_argument("--method", choices=["script", "trace"], default="script", help="torchscript: how")
    sub.add_argument("--static-batch", action="store_true", help="onnx, torch-export: fix the batch size")
    sub.add_argument("--atol", type=float, metavar="X", help="check tolerance, absolute (default 1e-4)")
    sub.add_argument("--rtol", type=float, metavar="X", help="check tolerance, relative (default 1e-4)")


def run(args: argparse.Namespace, overrides: list[str]) -> int:
    """``ember export``: find the checkpoint, rebuild its module, export and check; returns the exit code.

    A failed export or check is one line on stderr and exit code 1; config mistakes raise `ConfigError`.
    """
    from ember import config
    from ember.checkpoint.store import is_url, redact
    from ember.export import FORMATS, ExportError
    from ember.export import export as export_module
    from ember.export.rebuild import example_input, find_checkpoint, rebuild_module
    from ember.trainer.setup import run_name

    config.add_import_roots(args.config)
    resolved = None
    if args.config:
        if args.module or args.trust_checkpoint:
            option = "--module" if args.module else "--trust-checkpoint"
            raise config.ConfigError(f"{option}: the -c config builds the module already; give one of them")
        loaded = config.load(args.config, overrides)
        resolved = config.resolve(loaded)
        config.check(loaded, resolved)
    elif overrides:
        raise config.ConfigError(f"command line: {overrides[0]!r}: overrides change a config; give one with -c FILE")
    if is_url(args.out):
        raise config.ConfigError(
            f"--out {redact(args.out)}: exports are written to a local folder; give one and copy "
            "the file to the store afterwards"
        )
    start = time.perf_counter()
    path = find_checkpoint(args.ckpt, resolved, args.module)
    module, data_config = rebuild_module(path, resolved, args.module, args.trust_checkpoint)
    example = example_input(module, (data_config or {}).get("data"))
    name = args.name or (resolved or {}).get("trainer", {}).get("run_name") or run_name(type(module))
    out = Path(args.out) / f"{name}{FORMATS[args.format]}"
    try:
        result = export_module(
            module,
            args.format,
            out,
            example,
            dynamic_batch=not args.static_batch,
            method=args.method,
            atol=args.atol,
            rtol=args.rtol,
        )
    except ExportError as exc:
        if args.debug:
            traceback.print_exc()
        print(f"ember: error: {exc}", file=sys.stderr)
        return 1
    elapsed = time.perf_counter() - start
    print(f"export done in {elapsed:.1f} s: {result.path} from {path} (checked: {result.describe_checks()})")
    return 0
