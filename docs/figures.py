"""The figures the guides quote from running ember on the digits example, produced by running it.

    python docs/figures.py            # print each figure and whether the pages state it
    python docs/figures.py --write    # put the figures into the pages (and refresh the lr_find plot)

The figures: the learning rate ``ember tune lr -c configs/digits.yaml`` suggests (run here, in a scratch
folder), the optimizer steps of one 20-epoch run of that config and the name of its last checkpoint
(counted from the data, no training needed). Each is quoted at fixed places in docs/tuning.md and
docs/export.md (`PLACES`); tests/integration/test_docs_figures.py checks that the pages say what this
script produces. Figures that record an experiment (the seed grid and sweep tables of docs/tuning.md, the
benchmarks) say which script measured them and are not produced here.
"""

from __future__ import annotations

import argparse
import os
import re
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
CONFIG = ROOT / "configs" / "digits.yaml"

#: (page, pattern with one group: where a figure is quoted, figure name). Every pattern must match.
PLACES = [
    ("docs/tuning.md", r"lr_find: suggested lr (\S+) \(steepest", "lr_suggestion"),
    ("docs/tuning.md", r"lr_find: use it with module\.lr=(\S+)\n", "lr_suggestion"),
    ("docs/tuning.md", r"ember fit -c configs/digits\.yaml module\.lr=(\S+)\n", "lr_suggestion"),
    ("docs/tuning.md", r"the smoothed curve falls fastest at (\d\.\d+)\.", "lr_suggestion"),
    ("docs/tuning.md", r"against the (\d+) of one 20-epoch training run", "steps_per_run"),
    ("docs/export.md", r"runs/classifier/version_0/checkpoints/(epoch=\d+-step=\d+)\n", "last_checkpoint"),
]


def _env() -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("RANK", "WORLD_SIZE", "LOCAL_", "MASTER_"))}
    env.update(PYTHONPATH=os.pathsep.join([str(ROOT), env.get("PYTHONPATH", "")]), OMP_NUM_THREADS="1")
    return env


def lr_suggestion(workdir: Path, plot: bool = False) -> str:
    """The rate ``ember tune lr -c configs/digits.yaml`` prints, run in `workdir` (its run is left there)."""
    command = [sys.executable, "-m", "ember", "tune", "lr", "-c", str(CONFIG), *([] if plot else ["--no-plot"])]
    done = subprocess.run(command, cwd=workdir, env=_env(), capture_output=True, text=True, timeout=600)
    found = re.search(r"^lr_find: use it with module\.lr=(\S+)$", done.stdout, re.MULTILINE)
    if done.returncode != 0 or found is None:
        raise RuntimeError(f"ember tune lr failed ({done.returncode}):\n{done.stdout}\n{done.stderr}")
    return found.group(1)


def run_length() -> tuple[int, int]:
    """(epochs, optimizer steps) of one ``ember fit -c configs/digits.yaml``, from the config and its data."""
    from ember import config
    from ember.commands import build

    config.add_import_roots([str(CONFIG)])
    resolved = config.resolve(config.load([str(CONFIG)], []))
    trainer, _, data = build(resolved)
    data.setup("fit")
    epochs = trainer.max_epochs
    assert epochs is not None
    return epochs, epochs * len(data.train_dataloader())


def produce(workdir: Path, plot: bool = False) -> dict[str, str]:
    """Every figure of `PLACES`, by name, as the pages write it."""
    epochs, steps = run_length()
    return {
        "lr_suggestion": lr_suggestion(workdir, plot),
        "steps_per_run": str(steps),
        "last_checkpoint": f"epoch={epochs - 1}-step={steps}",  # 0-based epochs, as ModelCheckpoint names them
    }


def stated() -> list[tuple[str, str, str]]:
    """(page, figure name, the value the page states) for each of `PLACES`; a place not found is an error."""
    found = []
    for page, pattern, name in PLACES:
        match = re.search(pattern, (ROOT / page).read_text(encoding="utf-8"))
        if match is None:
            raise LookupError(f"{page}: no place matching {pattern!r}; keep PLACES in docs/figures.py in step")
        found.append((page, name, match.group(1)))
    return found


def write(figures: dict[str, str]) -> None:
    """Put `figures` into the pages at `PLACES`."""
    for page, pattern, name in PLACES:
        path = ROOT / page
        text = path.read_text(encoding="utf-8")
        match = re.search(pattern, text)
        assert match is not None, (page, pattern)
        path.write_text(text[: match.start(1)] + figures[name] + text[match.end(1) :], encoding="utf-8")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--write", action="store_true", help="write the figures into the pages and the plot")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as scratch:
        figures = produce(Path(scratch), plot=args.write)
        if args.write:
            write(figures)
            plot = next(Path(scratch).rglob("lr_find.png"))
            shutil.copy(plot, ROOT / "docs" / "images" / "lr_find_digits.png")
    wrong = 0
    for page, name, value in stated():
        same = value == figures[name]
        wrong += not same
        print(f"{page}: {name} {value}" + ("" if same else f" (produced: {figures[name]})"))
    return 1 if wrong else 0


if __name__ == "__main__":
    sys.exit(main())
