"""ember against Lightning on the real-modules corpus: per-epoch time, training and validation timed apart.

    python benchmarks/vs_lightning.py                 # full: 1 warm-up round, then 10 rounds per module
    python benchmarks/vs_lightning.py --quick         # CI: one round, no warm-up (the figures mean nothing)
    python benchmarks/vs_lightning.py --markdown      # also print the table docs/benchmarks.md shows
    python benchmarks/vs_lightning.py --modules lit_gan,demos.BoringModel --rounds 20 --json figures.json
    python benchmarks/vs_lightning.py --only lit_backbone --rounds 30   # repeat one module whose ratio is near 1
    python benchmarks/vs_lightning.py --alternate epoch  # hand over at every epoch instead of every run

The modules are those tests/compat/real/test_real_modules.py trains: every ``lit_*.py`` corpus module and the
``lightning.pytorch.demos`` cases. Each is built as that test builds it (the Lightning file imported, the same
file ported by ``ember port`` and imported) and trained by its own ``main`` (or the test's demo driver) with
the harness's trainer options (deterministic, no progress bar, no model summary): Lightning's ``Trainer`` for
the one, ember's (otherwise its defaults) for the other. For three simple modules (``demos.BoringModel``,
``demos.DemoModel``, ``lit_backbone``) a hand-written PyTorch loop of the same computation runs beside them.

Each side runs in its own thread of one process and only one thread runs at a time. By default the sides
alternate run by run (Lightning's fit, ember's fit, the hand loop; the order rotating each round), so each
fit's epochs follow one another as they do in a real run; ``--alternate epoch`` hands the turn over at every
epoch start instead (Lightning epoch 0, ember epoch 0, raw epoch 0, Lightning epoch 1, ...). Epoch alternation
is not the default because work a side leaves running in the background crosses into the other side's turn:
ember finishes each checkpoint (fsyncs, rename, ``last``) on a background thread while its next epoch trains,
and under epoch alternation that thread also gets Lightning's whole epoch, so ember's next save rarely waits
for it and its CPU time is charged to Lightning's epoch (measured: ember's CPU-time ratio on the modules that
checkpoint every epoch went from x0.85-0.97 to x0.68-0.74). The global random streams are saved and restored
at each hand-over, so each run draws exactly what it would draw alone.

A callback of the framework's kind reads the clock at the epoch boundaries: an epoch runs from
``on_train_epoch_start`` to the next epoch's start (the last one to ``on_train_end``), so it holds every
per-epoch cost (epoch-end logging, checkpoint saves, early-stopping checks); ``val`` is ``on_validation_start``
to ``on_validation_end`` (not the sanity check), ``train`` the rest of the epoch. Fit set-up, the sanity check,
``test`` and ``predict`` are outside every epoch, and so is the wait for ember's last checkpoint at the end of
fit (each earlier save's background finish is inside the epoch whose save waits for it).

A ratio is the median over epoch pairs (epoch k of one round in both runs) of ember's time / the other's;
figures in parentheses use the process's CPU time instead of the wall clock. A module ember cannot run yet
(a gap the corpus test names) is reported with ember's error and no ratio.

Goal: ember <= 1.00x Lightning per epoch on every module.
"""

from __future__ import annotations

import argparse
import contextlib
import functools
import importlib
import io
import json
import logging
import math
import os
import random
import statistics
import sys
import tempfile
import threading
import time
import warnings
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
REAL = ROOT / "tests" / "compat" / "real"
sys.path[:0] = [str(ROOT), str(REAL)]

import numpy as np  # noqa: E402
import torch  # noqa: E402

GOAL = 1.00
PHASES = ("train", "val", "epoch")
SIDES = ("lightning", "ember", "raw")


# --- the clock and the turns ------------------------------------------------------------------------------


def clock() -> tuple[float, float]:
    """(wall seconds, CPU seconds of this process)."""
    return time.perf_counter(), time.process_time()


class Turns:
    """Threads that take turns: only the one whose turn it is runs; `pass_on` hands the turn to the next
    live member of the cycle and waits for it to come back."""

    def __init__(self, order: list[str]) -> None:
        self._cond = threading.Condition()
        self._order, self._live, self._turn = list(order), set(order), order[0]

    def _next(self, name: str) -> str:
        i = self._order.index(name)
        for k in range(1, len(self._order) + 1):
            candidate = self._order[(i + k) % len(self._order)]
            if candidate in self._live:
                return candidate
        return name

    def wait(self, name: str) -> None:
        with self._cond:
            self._cond.wait_for(lambda: self._turn == name)

    def pass_on(self, name: str) -> None:
        with self._cond:
            self._turn = self._next(name)
            self._cond.notify_all()
            self._cond.wait_for(lambda: self._turn == name)

    def leave(self, name: str) -> None:
        with self._cond:
            self._live.discard(name)
            if self._turn == name:
                self._turn = self._next(name)
            self._cond.notify_all()


def _global_state() -> tuple[Any, ...]:
    return torch.get_rng_state(), random.getstate(), np.random.get_state(), torch.are_deterministic_algorithms_enabled()


def _set_global_state(state: tuple[Any, ...]) -> None:
    torch.set_rng_state(state[0])
    random.setstate(state[1])
    np.random.set_state(state[2])
    torch.use_deterministic_algorithms(state[3])


class EpochClock:
    """One run's epochs: wall and CPU seconds of each epoch and of the validation inside it."""

    def __init__(self, turns: Turns, name: str, by_epoch: bool = True) -> None:
        self.turns, self.name, self.by_epoch = turns, name, by_epoch
        self.epochs: list[dict[str, float]] = []
        self._start: tuple[float, float] | None = None
        self._val_start: tuple[float, float] | None = None
        self._val = [0.0, 0.0]

    def epoch_start(self) -> None:
        """Close the open epoch, hand the turn on (the random streams kept aside), open the next epoch."""
        self.epoch_end()
        if self.by_epoch:
            state = _global_state()
            self.turns.pass_on(self.name)
            _set_global_state(state)
        self._val = [0.0, 0.0]
        self._start = clock()

    def validation_start(self, sanity_checking: bool) -> None:
        if self._start is not None and not sanity_checking:
            self._val_start = clock()

    def validation_end(self, sanity_checking: bool) -> None:
        if self._start is not None and self._val_start is not None and not sanity_checking:
            now = clock()
            self._val = [self._val[0] + now[0] - self._val_start[0], self._val[1] + now[1] - self._val_start[1]]
            self._val_start = None

    def epoch_end(self) -> None:
        if self._start is None:
            return
        now = clock()
        wall, cpu = now[0] - self._start[0], now[1] - self._start[1]
        self.epochs.append(
            {
                "epoch": wall,
                "val": self._val[0],
                "train": wall - self._val[0],
                "epoch_cpu": cpu,
                "val_cpu": self._val[1],
                "train_cpu": cpu - self._val[1],
            }
        )
        self._start = None


class ClockBody:
    """A callback body (mixed with the framework's ``Callback``) that drives an `EpochClock`."""

    def __init__(self, epoch_clock: EpochClock) -> None:
        self.clock = epoch_clock

    def on_train_epoch_start(self, trainer: Any, pl_module: Any) -> None:
        self.clock.epoch_start()

    def on_validation_start(self, trainer: Any, pl_module: Any) -> None:
        self.clock.validation_start(trainer.sanity_checking)

    def on_validation_end(self, trainer: Any, pl_module: Any) -> None:
        self.clock.validation_end(trainer.sanity_checking)

    def on_train_end(self, trainer: Any, pl_module: Any) -> None:
        self.clock.epoch_end()


# --- the hand-written loops -------------------------------------------------------------------------------


def _limited(loader: Any, n: int) -> Iterator[Any]:
    for i, batch in enumerate(loader):
        if i == n:
            return
        yield batch


def raw_boring(epoch_clock: EpochClock, root_dir: Path) -> None:
    """demos.BoringModel as a plain loop: Linear(32, 2), MSE to ones, SGD(0.1), StepLR per epoch; 2 epochs of
    8 training and 4 validation batches of one sample (the test's driver)."""
    from lightning.pytorch.demos.boring_classes import RandomDataset
    from torch.nn import functional as F
    from torch.utils.data import DataLoader

    torch.manual_seed(42)
    layer = torch.nn.Linear(32, 2)
    opt = torch.optim.SGD(layer.parameters(), lr=0.1)
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=1)
    train, val = DataLoader(RandomDataset(32, 64)), DataLoader(RandomDataset(32, 64))
    for _ in range(2):
        epoch_clock.epoch_start()
        layer.train()
        for x in _limited(train, 8):
            out = layer(x)
            loss = F.mse_loss(out, torch.ones_like(out))
            loss.backward()
            opt.step()
            opt.zero_grad()
        epoch_clock.validation_start(False)
        layer.eval()
        with torch.no_grad():
            for x in _limited(val, 4):
                out = layer(x)
                F.mse_loss(out, torch.ones_like(out))
        layer.train()
        epoch_clock.validation_end(False)
        sched.step()
    epoch_clock.epoch_end()


def raw_demo_model(epoch_clock: EpochClock, root_dir: Path) -> None:
    """demos.DemoModel as a plain loop: Linear(32, 10) and ReLU, the output's sum as the loss, Adam(0.02);
    2 epochs of 8 batches of 8, no validation."""
    from lightning.pytorch.demos.boring_classes import RandomDataset
    from torch.utils.data import DataLoader

    torch.manual_seed(42)
    l1 = torch.nn.Linear(32, 10)
    opt = torch.optim.Adam(l1.parameters(), lr=0.02)
    loader = DataLoader(RandomDataset(32, 64), batch_size=8)
    for _ in range(2):
        epoch_clock.epoch_start()
        for x in loader:
            loss = torch.relu(l1(x.view(x.size(0), -1))).sum()
            loss.backward()
            opt.step()
            opt.zero_grad()
    epoch_clock.epoch_end()


def raw_backbone(epoch_clock: EpochClock, root_dir: Path) -> None:
    """lit_backbone as a plain loop: its Backbone, Adam(5e-3), cross-entropy; validation loss averaged over the
    epoch, model and optimizer state saved with ``torch.save`` when it improves (the module's ModelCheckpoint),
    a stop after the first epoch without improvement (its EarlyStopping(patience=1)); at most 4 epochs."""
    from lit_backbone import Backbone, prototypes
    from torch.nn import functional as F
    from torch.utils.data import DataLoader

    torch.manual_seed(1234)
    train, val = DataLoader(prototypes(64, 0), batch_size=16), DataLoader(prototypes(32, 1), batch_size=16)
    model = Backbone(hidden_dim=32)
    opt = torch.optim.Adam(model.parameters(), lr=5e-3)
    best = math.inf
    for _ in range(4):
        epoch_clock.epoch_start()
        model.train()
        for x, y in train:
            loss = F.cross_entropy(model(x), y)
            loss.backward()
            opt.step()
            opt.zero_grad()
        epoch_clock.validation_start(False)
        model.eval()
        with torch.no_grad():
            total, count = torch.zeros((), dtype=torch.float64), 0
            for x, y in val:
                total += F.cross_entropy(model(x), y).double() * len(y)
                count += len(y)
            val_loss = float(total / count)
        model.train()
        epoch_clock.validation_end(False)
        if val_loss < best:
            best = val_loss
            torch.save({"model": model.state_dict(), "optimizer": opt.state_dict()}, root_dir / "best.pt")
        else:
            break
    epoch_clock.epoch_end()


RAW_LOOPS: dict[str, Callable[[EpochClock, Path], None]] = {
    "demos.BoringModel": raw_boring,
    "demos.DemoModel": raw_demo_model,
    "lit_backbone": raw_backbone,
}


# --- the modules, as tests/compat/real builds them --------------------------------------------------------


@dataclass
class Module:
    """One corpus module: how each side trains it (``main(root_dir, callbacks=..., **options)``)."""

    name: str
    gaps: tuple[str, ...]
    mains: dict[str, Callable[..., Any]] = field(default_factory=dict)


def build_modules(names: list[str], ported_dir: Path) -> list[Module]:
    """Each named module built as test_real_modules.py builds it: the Lightning file (or installed demo)
    imported, the same file ported with `ember port` and imported."""
    import lightning.pytorch as pl
    import test_real_modules as corpus
    from real_harness import import_path, port_module

    import ember

    modules = []
    for case in corpus.CORPUS:
        if case.name in names:
            source = REAL / f"{case.name}.py"
            original = import_path(source, f"lightning_{case.name}")
            ported, _ = port_module(source, ported_dir, f"ported_{case.name}")
            modules.append(Module(case.name, case.gaps, {"lightning": original.main, "ember": ported.main}))
    for demo in corpus.DEMOS:
        name = f"demos.{demo.name}"
        if name in names:
            source = corpus._demos_dir() / demo.file
            original = importlib.import_module(f"lightning.pytorch.demos.{source.stem}")
            ported, _ = port_module(source, ported_dir, f"ported_{demo.name}")
            mains = {
                "lightning": functools.partial(demo.driver, original, pl),
                "ember": functools.partial(demo.driver, ported, ember),
            }
            modules.append(Module(name, demo.gaps, mains))
    return modules


def all_names() -> list[str]:
    import test_real_modules as corpus

    return [c.name for c in corpus.CORPUS] + [f"demos.{d.name}" for d in corpus.DEMOS]


# --- one round of one module ------------------------------------------------------------------------------


def run_round(module: Module, order: list[str], root_dir: Path, by_epoch: bool = True) -> dict[str, Any]:
    """Every side of `module` once, in `order`, alternating epoch by epoch (or run by run): per side its epochs
    and its error."""
    import lightning.pytorch as pl
    from real_harness import TRAINER_OPTIONS

    import ember

    bases = {"lightning": pl.Callback, "ember": ember.Callback}
    turns = Turns(order)
    clocks = {side: EpochClock(turns, side, by_epoch) for side in order}
    errors: dict[str, str | None] = dict.fromkeys(order)

    def body(side: str) -> None:
        turns.wait(side)
        try:
            side_dir = root_dir / side
            side_dir.mkdir(parents=True)
            if side == "raw":
                RAW_LOOPS[module.name](clocks[side], side_dir)
            else:
                timer = type("EpochTimer", (ClockBody, bases[side]), {})(clocks[side])
                module.mains[side](str(side_dir), callbacks=[timer], **TRAINER_OPTIONS)
        except Exception as exc:  # a run's failure is a result
            errors[side] = f"{type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''}"
        finally:
            turns.leave(side)

    threads = [threading.Thread(target=body, args=(side,), name=f"vs_lightning-{side}") for side in order]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    return {side: {"epochs": clocks[side].epochs, "error": errors[side]} for side in order}


@contextlib.contextmanager
def quiet() -> Iterator[None]:
    """The runs' own printing (Lightning's and ember's info lines, warnings) kept out of the report."""
    loggers = [logging.getLogger(n) for n in ("lightning", "lightning.pytorch", "lightning.fabric")]
    levels = [lg.level for lg in loggers]
    for lg in loggers:
        lg.setLevel(logging.ERROR)
    try:
        out, err = contextlib.redirect_stdout(io.StringIO()), contextlib.redirect_stderr(io.StringIO())
        with warnings.catch_warnings(), out, err:
            warnings.simplefilter("ignore")
            yield
    finally:
        for lg, level in zip(loggers, levels, strict=True):
            lg.setLevel(level)


def measure(
    names: list[str], rounds: int, warmup: int, work_dir: Path, by_epoch: bool = True
) -> dict[str, list[dict[str, Any]]]:
    """Per module, the counted rounds (after `warmup` rounds that are thrown away)."""
    results: dict[str, list[dict[str, Any]]] = {}
    with quiet():
        modules = build_modules(names, work_dir / "ported")
        for module in modules:
            sides = ["lightning", "ember", *(["raw"] if module.name in RAW_LOOPS else [])]
            kept = []
            for r in range(warmup + rounds):
                order = sides[r % len(sides) :] + sides[: r % len(sides)]
                outcome = run_round(module, order, work_dir / "runs" / module.name / str(r), by_epoch)
                if r >= warmup:
                    kept.append(outcome)
            results[module.name] = kept
    return results


# --- figures and the report -------------------------------------------------------------------------------


def paired_ratio(rounds: list[dict[str, Any]], side: str, base: str, phase: str) -> float | None:
    """Median over epoch pairs (epoch k of a round on both sides) of side / base; None without a pair."""
    ratios = [
        mine[phase] / theirs[phase]
        for outcome in rounds
        if side in outcome and base in outcome
        for mine, theirs in zip(outcome[side]["epochs"], outcome[base]["epochs"], strict=False)
        if theirs[phase] > 0 and mine[phase] > 0
    ]
    return statistics.median(ratios) if ratios else None


def median_ms(rounds: list[dict[str, Any]], side: str, phase: str) -> float | None:
    values = [e[phase] * 1e3 for outcome in rounds if side in outcome for e in outcome[side]["epochs"]]
    return statistics.median(values) if values else None


def summarize(name: str, gaps: tuple[str, ...], rounds: list[dict[str, Any]]) -> dict[str, Any]:
    """One module's figures: ratios to Lightning (and to the hand loop), ms per epoch, epochs, errors."""
    errors = {side: o[side]["error"] for o in rounds for side in SIDES if side in o and o[side]["error"]}
    has_raw = any("raw" in o for o in rounds)
    timed = not errors
    phases_cpu = [*PHASES, *(f"{p}_cpu" for p in PHASES)]
    return {
        "gaps": list(gaps),
        "timed": timed,
        "errors": errors,
        "epochs": {side: [len(o[side]["epochs"]) for o in rounds if side in o] for side in SIDES},
        "ratio": {p: paired_ratio(rounds, "ember", "lightning", p) for p in phases_cpu} if timed else None,
        "raw_ratio": {p: paired_ratio(rounds, "ember", "raw", p) for p in phases_cpu} if timed and has_raw else None,
        "ms": {side: {p: median_ms(rounds, side, p) for p in PHASES} for side in SIDES},
    }


def _x(value: float | None) -> str:
    return "-" if value is None else f"x{value:.3f}"


def _ms(value: float | None) -> str:
    return "-" if value is None else f"{value:.1f}"


def report(figures: dict[str, Any], out: Callable[[str], Any] = print) -> None:
    """The printed report: per module the ratios (wall, CPU), ms per epoch, the hand loop's ratios; a verdict."""
    modules = figures["modules"]
    out(
        f"{len(modules)} modules, {figures['threads']} thread(s); per module {figures['rounds']} rounds alternated "
        f"by {figures['alternate']} after {figures['warmup']} warm-up round(s); {figures['seconds']:.0f} s in all"
    )
    out("ratios: median over epoch pairs of ember / Lightning (and / the hand-written loop); wall clock (CPU time)")
    out(
        f"  {'module':28s} {'train':>17s} {'val':>17s} {'epoch':>17s}   ms per epoch (ember, Lightning)"
        "   ember / hand loop: train, val"
    )
    for name, m in modules.items():
        if not m["timed"]:
            out(f"  {name:28s} not timed: " + "; ".join(f"{side} raised {e}" for side, e in m["errors"].items()))
            continue
        cells = " ".join(f"{_x(m['ratio'][p]) + ' (' + _x(m['ratio'][p + '_cpu']) + ')':>17s}" for p in PHASES)
        ms = f"{_ms(m['ms']['ember']['epoch']):>7s} {_ms(m['ms']['lightning']['epoch']):>7s}"
        raw = f"{_x(m['raw_ratio']['train'])}, {_x(m['raw_ratio']['val'])}" if m["raw_ratio"] else ""
        out(f"  {name:28s} {cells}   {ms}   {raw}")
    timed = {n: m["ratio"]["epoch"] for n, m in modules.items() if m["timed"]}
    goals = ", ".join(f"{n} x{v:.3f} <= {GOAL:.2f}" for n, v in timed.items())
    untimed = [n for n, m in modules.items() if not m["timed"]]
    if untimed:
        goals += f"; not timed: {', '.join(untimed)}"
    if figures["rounds"] < 2:
        out(f"verdict: none (one round measures noise, not ember) for the goal (epoch, wall clock: {goals})")
    else:
        ok = all(v <= GOAL for v in timed.values()) and not untimed
        out(f"verdict: {'meets' if ok else 'misses'} the goal (epoch, wall clock: {goals})")


def markdown(figures: dict[str, Any]) -> str:
    """The table docs/benchmarks.md shows: a row per module."""
    lines = [
        "| module | ember / Lightning: train | val | epoch | epoch, CPU time | ember ms per epoch: train, val "
        "| Lightning ms per epoch: train, val | ember / hand-written loop: train, val |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for name, m in figures["modules"].items():
        if not m["timed"]:
            why = "; ".join(f"{side} raised {e.split(':')[0]}" for side, e in m["errors"].items())
            gaps = ", ".join(f"`{g}`" for g in m["gaps"])
            lines.append(f"| `{name}` | not timed: {why}" + (f" ({gaps})" if gaps else "") + " | | | | | | |")
            continue
        r, ms = m["ratio"], m["ms"]
        raw = f"{_x(m['raw_ratio']['train'])}, {_x(m['raw_ratio']['val'])}" if m["raw_ratio"] else "-"
        cells = [
            f"`{name}`",
            _x(r["train"]),
            _x(r["val"]),
            f"**{_x(r['epoch'])}**",
            _x(r["epoch_cpu"]),
            f"{_ms(ms['ember']['train'])}, {_ms(ms['ember']['val'])}",
            f"{_ms(ms['lightning']['train'])}, {_ms(ms['lightning']['val'])}",
            raw,
        ]
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    parser.add_argument("--quick", "--short", action="store_true", help="one round, no warm-up (for CI)")
    parser.add_argument("--rounds", type=int, default=None, help="counted rounds per module (default 10; quick 1)")
    parser.add_argument("--warmup", type=int, default=None, help="rounds thrown away first (default 1; quick 0)")
    parser.add_argument(
        "--modules", "--only", default=None, help="comma-separated module names (default: all; --only lit_gan)"
    )
    parser.add_argument(
        "--alternate", choices=("run", "epoch"), default="run", help="hand over after every run (default) or epoch"
    )
    parser.add_argument("--threads", type=int, default=1, help="torch.set_num_threads (default 1)")
    parser.add_argument("--markdown", action="store_true", help="also print the table docs/benchmarks.md shows")
    parser.add_argument("--json", help="also write the figures to this file")
    args = parser.parse_args(argv)
    known = all_names()
    names = known if args.modules is None else [n.strip() for n in args.modules.split(",") if n.strip()]
    unknown = [n for n in names if n not in known]
    if unknown:
        parser.error(f"unknown module(s) {', '.join(unknown)}; choose from {', '.join(known)}")
    rounds = args.rounds if args.rounds is not None else (1 if args.quick else 10)
    warmup = args.warmup if args.warmup is not None else (0 if args.quick else 1)
    if rounds < 1 or warmup < 0:
        parser.error(f"--rounds {rounds} / --warmup {warmup}: need at least 1 round and no negative warm-up")
    torch.set_num_threads(args.threads)
    started, cwd = time.perf_counter(), os.getcwd()
    with tempfile.TemporaryDirectory(prefix="vs-lightning-") as work:
        os.chdir(work)  # the demo drivers write ./data/wikitext-2.txt
        try:
            measured = measure(names, rounds, warmup, Path(work), by_epoch=args.alternate == "epoch")
        finally:
            os.chdir(cwd)
    import test_real_modules as corpus

    gaps = {c.name: c.gaps for c in corpus.CORPUS} | {f"demos.{d.name}": d.gaps for d in corpus.DEMOS}
    figures = {
        "quick": args.quick,
        "rounds": rounds,
        "warmup": warmup,
        "threads": args.threads,
        "alternate": args.alternate,
        "seconds": time.perf_counter() - started,
        "modules": {n: summarize(n, gaps[n], measured[n]) for n in names},
    }
    report(figures)
    if args.markdown:
        print("\n" + markdown(figures), end="")
    if args.json:
        Path(args.json).write_text(json.dumps(figures, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
