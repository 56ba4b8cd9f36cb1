"""``python -m ember.loggers.replay FILE...``: send the values a logger could not send during a run.

Each FILE is an unsent-values file (``<run dir>/unsent/*.jsonl``, `ember.loggers.unsent`); its logger is rebuilt
from the file and receives the calls in order. One line per file; exit status 0 when every file was sent, 1 when
one failed (its file is kept, to retry), 2 for a usage mistake.
"""

from __future__ import annotations

import sys
from pathlib import Path


def main(argv: list[str] | None = None) -> int:
    """Replay every file named in `argv`; print one line per file."""
    args = sys.argv[1:] if argv is None else argv
    if not args or any(a.startswith("-") for a in args):
        print("usage: python -m ember.loggers.replay FILE... (the files under <run dir>/unsent/)", file=sys.stderr)
        return 2
    from ember.loggers.unsent import replay

    status = 0
    for arg in args:
        path = Path(arg)
        if not path.is_file():
            print(f"{arg}: no such file; the run's unsent values are in <run dir>/unsent/*.jsonl", file=sys.stderr)
            status = max(status, 2)
            continue
        try:
            sent = replay(path)
        except Exception as exc:  # one line per file: the next file may still go through
            print(f"{arg}: not sent ({type(exc).__name__}: {exc}); the file is kept, run this again", file=sys.stderr)
            status = max(status, 1)
        else:
            print(f"{arg}: sent {sent} calls; the file is now {path.name}.sent")
    return status


if __name__ == "__main__":
    sys.exit(main())
