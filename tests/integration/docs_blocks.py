"""The code blocks of the documentation, for tests/integration/test_docs_run.py.

Pages are discovered, not listed: README.md, configs/README.md, examples/README.md and every ``*.md`` under
docs/. A block whose first line is ``# not run: <reason>`` is shown to readers as it is and skipped; so is a
command line whose comment contains ``(not run``. Everything else runs.
"""

from __future__ import annotations

import re
import shlex
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
NOT_RUN = re.compile(r"^\s*#\s*not run:", re.IGNORECASE)
_FENCE = re.compile(r"^(\s*)(```|~~~)\s*([\w+-]*)")
_COMMAND = re.compile(r"^ember (fit|validate|test|predict|export|tune|sweep)(\s|$)")


@dataclass(frozen=True)
class Block:
    page: str  # relative to the repository root
    line: int  # of the first line of code (1-based)
    lang: str
    text: str

    @property
    def where(self) -> str:
        return f"{self.page}:{self.line}"

    @property
    def is_marked_not_run(self) -> bool:
        first = next((line for line in self.text.splitlines() if line.strip()), "")
        return bool(NOT_RUN.match(first))


def pages() -> list[str]:
    """Every documentation page, relative to the repository root."""
    found = [ROOT / "README.md", ROOT / "configs" / "README.md", ROOT / "examples" / "README.md"]
    found += sorted((ROOT / "docs").rglob("*.md"))
    return [str(p.relative_to(ROOT)) for p in found if p.is_file()]


def blocks(page: str) -> list[Block]:
    """The fenced code blocks of `page`, in order (indentation of an indented fence removed)."""
    lines = (ROOT / page).read_text(encoding="utf-8").splitlines()
    found, i = [], 0
    while i < len(lines):
        match = _FENCE.match(lines[i])
        if not match:
            i += 1
            continue
        indent, fence, lang = match.group(1), match.group(2), match.group(3)
        body, j = [], i + 1
        while j < len(lines) and not lines[j].strip().startswith(fence):
            body.append(lines[j][len(indent) :] if lines[j].startswith(indent) else lines[j])
            j += 1
        found.append(Block(page, i + 2, lang.lower(), "\n".join(body) + "\n"))
        i = j + 1
    return found


def python_blocks(page: str) -> list[Block]:
    return [b for b in blocks(page) if b.lang in ("python", "py")]


@dataclass(frozen=True)
class Command:
    where: str
    text: str  # as written (without a leading "$ ")
    argv: list[str]  # after "ember"
    marked_not_run: bool


def commands(page: str) -> list[Command]:
    """Every ``ember <subcommand> ...`` line of the non-Python blocks of `page` (one part of a ``&&`` chain
    counts as a line; a trailing backslash joins the next line)."""
    found = []
    for block in blocks(page):
        if block.lang in ("python", "py", "yaml", "yml", "json", "toml"):
            continue
        block_marked = block.is_marked_not_run
        joined: list[tuple[int, str]] = []
        for offset, line in enumerate(block.text.splitlines()):
            if joined and joined[-1][1].rstrip().endswith("\\"):
                joined[-1] = (joined[-1][0], joined[-1][1].rstrip()[:-1] + " " + line.strip())
            else:
                joined.append((offset, line))
        for offset, line in joined:
            for part in line.split("&&"):
                text = part.strip().removeprefix("$ ").strip()
                if not _COMMAND.match(text):
                    continue
                comment = text.split(" #", 1)[1] if " #" in text else ""
                argv = shlex.split(text, comments=True)[1:]
                found.append(
                    Command(f"{page}:{block.line + offset}", text, argv, block_marked or "(not run" in comment)
                )
    return found
