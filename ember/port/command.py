"""``ember port``'s files and command line: read each file (PEP 263 encodings), port them all before writing
anything, then write in place (keeping ``.orig``), into ``--out DIR``, or print a diff."""

from __future__ import annotations

import argparse
import io
import sys
import tokenize
from collections.abc import Iterable, Sequence
from pathlib import Path
from typing import Any

from ember.port.rewrite import PortError, PortResult, port_source


def read_source(path: Path) -> tuple[str, str]:
    """A Python file's text and encoding (PEP 263); `PortError` when it is missing or not Python text."""
    if not path.exists():
        raise PortError(f"{path}: no such file")
    if path.is_dir():
        raise PortError(f"{path}: is a directory; give the Python files")
    data = path.read_bytes()
    try:
        encoding, _ = tokenize.detect_encoding(io.BytesIO(data).readline)
        text = data.decode(encoding)
    except (SyntaxError, UnicodeDecodeError, LookupError):
        raise PortError(f"{path}: not a Python file (not text in a Python source encoding)") from None
    if "\x00" in text:
        raise PortError(f"{path}: not a Python file (binary)")
    if encoding == "utf-8-sig":
        text = text.removeprefix("\ufeff")
    return text, encoding


def port_files(
    paths: Iterable[Path], *, out: Path | None = None, diff: bool = False, stdout: Any = None, stderr: Any = None
) -> int:
    """Port files as ``ember port`` does; returns the exit code (0 all mapped, 1 notes left, 2 a mistake).

    Every file is read and parsed before anything is written, so a mistake leaves every file as it was.
    """
    stdout = stdout if stdout is not None else sys.stdout
    stderr = stderr if stderr is not None else sys.stderr
    paths = list(paths)
    try:
        if out is None and not diff:
            for path in paths:
                backup = path.with_name(path.name + ".orig")
                if backup.exists():
                    raise PortError(f"{backup}: a backup exists already; remove it, or use --out DIR or --diff")
        if out is not None:
            seen: dict[str, Path] = {}
            for path in paths:
                if path.name in seen and seen[path.name] != path:
                    raise PortError(f"--out: {seen[path.name]} and {path} would both be written to {out / path.name}")
                seen[path.name] = path
            if out.exists() and not out.is_dir():
                raise PortError(f"--out: {out} is not a directory")
        ported: list[tuple[Path, str, PortResult]] = []
        for path in paths:
            text, encoding = read_source(path)
            ported.append((path, encoding, port_source(text, str(path))))
    except PortError as exc:
        print(f"ember port: error: {exc}", file=stderr)
        return 2
    left = 0
    for path, encoding, result in ported:
        for note in result.notes:
            print(note.format(str(path)), file=stderr)
        left += len(result.notes)
        if diff:
            stdout.write(result.diff(str(path)))
            where = "diff printed"
        elif out is not None:
            out.mkdir(parents=True, exist_ok=True)
            (out / path.name).write_bytes(result.source.encode(encoding))
            where = f"written to {out / path.name}"
        elif result.changed:
            path.with_name(path.name + ".orig").write_bytes(path.read_bytes())
            path.write_bytes(result.source.encode(encoding))
            where = f"rewritten (the original is {path.name}.orig)"
        else:
            where = "unchanged"
        todo = f"; {len(result.notes)} left to edit by hand (listed above)" if result.notes else ""
        mapped = f"{len(result.mapped)} Lightning name{'s' * (len(result.mapped) != 1)} mapped"
        print(f"ember port: {path}: {mapped}, {where}{todo}", file=stderr)
    return 1 if left else 0


def add_parser(commands: Any) -> None:
    """Add ``ember port`` to the ``ember`` command's subparsers."""
    sub: argparse.ArgumentParser = commands.add_parser(
        "port",
        help="rewrite a LightningModule's Lightning imports and names for ember",
        description="ember port: rewrite Lightning imports and base-class names in Python files for ember; "
        "list what it cannot map, with what to do. Strings and comments are left as they are.",
        epilog="exit code 0: everything mapped; 1: files written, some names listed for a hand edit; "
        "2: a mistake, nothing written. See docs/migrating-from-lightning.md.",
        allow_abbrev=False,
    )
    sub.add_argument("files", nargs="+", metavar="FILE", help="Python files to port")
    where = sub.add_mutually_exclusive_group()
    where.add_argument("--out", metavar="DIR", help="write the ported files into DIR (default: in place, FILE.orig)")
    where.add_argument("--diff", action="store_true", help="print a unified diff; write nothing")
    sub.set_defaults(debug=False)


def run(args: argparse.Namespace, extra: Sequence[str] = ()) -> int:
    """``ember port``: port the files the parsed arguments name; returns the exit code."""
    if extra:
        print(f"ember port: error: unknown argument {extra[0]!r}", file=sys.stderr)
        return 2
    out = Path(args.out) if args.out else None
    return port_files([Path(f) for f in args.files], out=out, diff=args.diff)
