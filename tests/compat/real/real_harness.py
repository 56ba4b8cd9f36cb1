"""Run one corpus module under Lightning and, ported by `ember port`, under ember; compare what came out.

Every corpus file (and every module of ``lightning.pytorch.demos`` the tests drive) exposes
``main(root_dir, callbacks=(), **trainer_options) -> dict`` in Lightning's idiom: it seeds, builds its data,
module and ``Trainer`` (adding ``callbacks`` and ``trainer_options``), fits, and evaluates as the public
script it follows does. The returned dict holds at least ``trainer`` and ``model``; optionally ``test``,
``validate`` (lists of result dicts), ``predict`` (a list of tensors), ``reloaded`` (a module rebuilt with
``load_from_checkpoint``) and ``extra`` (plain values: floats compared within `METRICS_TOL`, the rest with
``==``).

`port_module` ports a file with `ember.port.port_source` into a folder and imports the result. `run_main`
runs ``main`` with a `Recorder` callback of the framework's kind and returns a `Run`; an exception is kept in
the `Run` (the innermost traceback line inside ``ember/`` names where ember refused). `compare` returns a
`Record`: what was ported, whether both ran, whether losses and parameters are bitwise equal, and each
difference found. `write_results` / `table` turn records into the JSON the tests write and the Markdown
table the docs show (``python tests/compat/real/real_harness.py RESULTS.json``).
"""

from __future__ import annotations

import dataclasses
import importlib.util
import inspect
import json
import math
import sys
import traceback
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

EMBER_DIR = Path(__file__).resolve().parents[3] / "ember"

#: Options both frameworks get from the harness: deterministic kernels, no progress output, no summary.
TRAINER_OPTIONS: dict[str, Any] = {"deterministic": True, "enable_progress_bar": False, "enable_model_summary": False}

#: Relative and absolute tolerance for epoch metrics and evaluation results: ember adds up a batch-weighted
#: epoch mean in float64, Lightning in float32, so the two agree to float32 rounding, not bitwise.
METRICS_TOL = 1e-6


@dataclass
class Run:
    """What one framework's run of a corpus module produced (``error`` set when it raised)."""

    framework: str
    losses: list[torch.Tensor | None] = field(default_factory=list)
    params: dict[str, torch.Tensor] = field(default_factory=dict)
    callback_metrics: dict[str, float] = field(default_factory=dict)
    fit_metrics: list[dict[str, float]] = field(default_factory=list)  # callback_metrics as each fit ended
    global_step: int = -1
    current_epoch: int = -1
    test: list[dict[str, float]] | None = None
    validate: list[dict[str, float]] | None = None
    predict: list[torch.Tensor] | None = None
    reloaded: dict[str, torch.Tensor] | None = None
    extra: dict[str, Any] = field(default_factory=dict)  # other plain values a module reports
    error: str | None = None
    where: str | None = None  # the innermost traceback line inside ember/ (or the last one)


@dataclass
class Record:
    """One corpus module's result, as the results JSON and the docs table show it."""

    name: str
    follows: str
    unmapped: list[str]
    ran: bool
    bitwise: bool
    differences: list[str]
    gaps: list[str]
    error: str | None = None
    where: str | None = None

    @property
    def ported_clean(self) -> bool:
        """Whether `ember port` mapped every Lightning name (no edit left by hand)."""
        return not self.unmapped

    @property
    def ok(self) -> bool:
        """Ported cleanly, ran, and matched Lightning."""
        return self.ported_clean and self.ran and not self.differences

    def describe(self) -> str:
        """The record in a few lines, for an assertion message."""
        lines = [f"{self.name} (follows {self.follows})"]
        lines += [f"  not mapped: {u}" for u in self.unmapped]
        if self.error:
            lines.append(f"  ember raised: {self.error}")
            lines.append(f"    at {self.where}")
        lines += [f"  differs: {d}" for d in self.differences]
        return "\n".join(lines)


def import_path(path: Path, name: str) -> Any:
    """Import a file as a module called `name` (registered in sys.modules, so pickling finds its classes)."""
    spec = importlib.util.spec_from_file_location(name, path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    spec.loader.exec_module(module)
    return module


def port_module(source_path: Path, out_dir: Path, name: str) -> tuple[Any, list[str]]:
    """Port `source_path` with `ember port`'s function, write it to `out_dir`, import it; the module and the
    names the port could not map (``line: name: advice``)."""
    from ember.port import port_source

    result = port_source(source_path.read_text(), str(source_path))
    out_dir.mkdir(parents=True, exist_ok=True)
    target = out_dir / f"{name}.py"
    target.write_text(result.source)
    notes = [f"{n.line}: {n.name}: {n.advice}" for n in result.notes]
    return import_path(target, name), notes


class RecorderBody:
    """A callback body (mixed with the framework's ``Callback``): the loss of every training batch, and
    ``trainer.callback_metrics`` when each fit ends."""

    def __init__(self) -> None:
        self.losses: list[torch.Tensor | None] = []
        self.fit_metrics: list[dict[str, float]] = []

    def on_fit_end(self, trainer: Any, pl_module: Any) -> None:
        self.fit_metrics.append({k: float(v) for k, v in trainer.callback_metrics.items()})

    def on_train_batch_end(self, trainer: Any, pl_module: Any, outputs: Any, batch: Any, batch_idx: int) -> None:
        loss = outputs.get("loss") if isinstance(outputs, Mapping) else outputs
        self.losses.append(loss.detach().clone() if isinstance(loss, torch.Tensor) else None)


def _floats(results: Any) -> list[dict[str, float]] | None:
    if results is None:
        return None
    return [{k: float(v) for k, v in r.items()} for r in results]


def _tensors(outputs: Any) -> list[torch.Tensor] | None:
    if outputs is None:
        return None
    return [o.detach().clone() if isinstance(o, torch.Tensor) else torch.as_tensor(o) for o in outputs]


def _where(exc: BaseException) -> str:
    frames = traceback.extract_tb(exc.__traceback__)
    inside = [f for f in frames if Path(f.filename).resolve().is_relative_to(EMBER_DIR)]
    frame = (inside or frames)[-1] if frames else None
    if frame is None:
        return "?"
    path = Path(frame.filename)
    shown = path.resolve().relative_to(EMBER_DIR.parent) if path.resolve().is_relative_to(EMBER_DIR) else path.name
    return f"{shown}:{frame.lineno}: {frame.line}"


def run_main(
    module: Any, framework: str, callback_base: type, root_dir: Path, main: str = "main", **options: Any
) -> Run:
    """Run ``module.<main>(root_dir, callbacks=[recorder], **TRAINER_OPTIONS, **options)``; never raises."""
    recorder = type("Recorder", (RecorderBody, callback_base), {})()
    run = Run(framework)
    deterministic = torch.are_deterministic_algorithms_enabled()
    try:
        out = getattr(module, main)(str(root_dir), callbacks=[recorder], **TRAINER_OPTIONS, **options)
    except Exception as exc:  # the run's failure is a result
        run.error = f"{type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''}"
        run.where = _where(exc)
        run.losses, run.fit_metrics = recorder.losses, recorder.fit_metrics
        return run
    finally:
        torch.use_deterministic_algorithms(deterministic)
    trainer, model = out["trainer"], out["model"]
    run.losses, run.fit_metrics = recorder.losses, recorder.fit_metrics
    run.params = {k: v.detach().clone() for k, v in model.state_dict().items()}
    run.callback_metrics = {k: float(v) for k, v in trainer.callback_metrics.items()}
    run.global_step, run.current_epoch = trainer.global_step, trainer.current_epoch
    run.test, run.validate = _floats(out.get("test")), _floats(out.get("validate"))
    run.predict = _tensors(out.get("predict"))
    run.extra = dict(out.get("extra", {}))
    reloaded = out.get("reloaded")
    if reloaded is not None:
        run.reloaded = {k: v.detach().clone() for k, v in reloaded.state_dict().items()}
    return run


def ember_trainer_options() -> dict[str, Any]:
    """``lightning_rng=True`` once ember's Trainer has the switch that reproduces Lightning's random stream."""
    import ember

    return {"lightning_rng": True} if "lightning_rng" in inspect.signature(ember.Trainer).parameters else {}


def _close(a: float, b: float) -> bool:
    return math.isclose(a, b, rel_tol=METRICS_TOL, abs_tol=METRICS_TOL) or (math.isnan(a) and math.isnan(b))


def _compare_tensors(kind: str, mine: Mapping[str, torch.Tensor], theirs: Mapping[str, torch.Tensor]) -> list[str]:
    if mine.keys() != theirs.keys():
        return [
            f"{kind}: ember has {sorted(mine.keys() - theirs.keys())}, Lightning {sorted(theirs.keys() - mine.keys())}"
        ]
    out = []
    for name, value in theirs.items():
        other = mine[name]
        if other.shape != value.shape or not torch.equal(other, value):
            diff = (other.double() - value.double()).abs().max().item() if other.shape == value.shape else math.inf
            out.append(f"{kind} {name}: not bitwise equal (largest difference {diff:.3g})")
    if len(out) > 3:  # the first ones say enough
        out[3:] = [f"{kind}: {len(out) - 3} more differ"]
    return out


def _compare_results(
    kind: str, mine: list[dict[str, float]] | None, theirs: list[dict[str, float]] | None
) -> list[str]:
    if (mine is None) != (theirs is None):
        return [f"{kind}: ember {mine!r}, Lightning {theirs!r}"]
    if mine is None or theirs is None:
        return []
    if len(mine) != len(theirs):
        return [f"{kind}: {len(mine)} result dicts, Lightning {len(theirs)}"]
    out = []
    for m, t in zip(mine, theirs, strict=True):
        if m.keys() != t.keys():
            out.append(f"{kind} keys: ember {sorted(m)}, Lightning {sorted(t)}")
        out += [f"{kind} {k}: ember {m[k]!r}, Lightning {v!r}" for k, v in t.items() if k in m and not _close(m[k], v)]
    return out


def _compare_metrics(kind: str, mine: Mapping[str, float], theirs: Mapping[str, float]) -> list[str]:
    out = []
    if mine.keys() != theirs.keys():
        lacks, extra = sorted(theirs.keys() - mine.keys()), sorted(mine.keys() - theirs.keys())
        out.append(f"{kind}: ember lacks {lacks}, has extra {extra}")
    out += [
        f"{kind}[{k!r}]: ember {mine[k]!r}, Lightning {v!r}"
        for k, v in theirs.items()
        if k in mine and not _close(mine[k], v)
    ]
    return out


def compare(name: str, follows: str, unmapped: list[str], gaps: Sequence[str], mine: Run, theirs: Run) -> Record:
    """The `Record` of a module: per-step losses, final parameters, checkpoint reloads and predictions bitwise;
    callback metrics and test/validate results within `METRICS_TOL`; step and epoch counts equal."""
    assert theirs.error is None, f"{name}: Lightning itself failed: {theirs.error} at {theirs.where}"
    record = Record(name, follows, unmapped, mine.error is None, False, [], list(gaps), mine.error, mine.where)
    if mine.error is not None:
        return record
    diffs = record.differences
    if len(mine.losses) != len(theirs.losses):
        diffs.append(f"training batches: ember {len(mine.losses)}, Lightning {len(theirs.losses)}")
    for i, (a, b) in enumerate(zip(mine.losses, theirs.losses, strict=False)):
        if (a is None) != (b is None) or (a is not None and b is not None and not torch.equal(a, b)):
            diffs.append(f"loss of batch {i}: ember {a!r}, Lightning {b!r}")
            break  # the first one says where the runs part
    diffs += _compare_tensors("parameter", mine.params, theirs.params)
    if (mine.global_step, mine.current_epoch) != (theirs.global_step, theirs.current_epoch):
        diffs.append(
            f"global_step/current_epoch: ember {mine.global_step}/{mine.current_epoch}, "
            f"Lightning {theirs.global_step}/{theirs.current_epoch}"
        )
    if len(mine.fit_metrics) != len(theirs.fit_metrics):
        diffs.append(f"fits ended: ember {len(mine.fit_metrics)}, Lightning {len(theirs.fit_metrics)}")
    at_fit_end = [
        (f"callback_metrics at fit end {i}", m, t)
        for i, (m, t) in enumerate(zip(mine.fit_metrics, theirs.fit_metrics, strict=False))
    ]
    for kind, m, t in [*at_fit_end, ("callback_metrics at the end", mine.callback_metrics, theirs.callback_metrics)]:
        diffs += _compare_metrics(kind, m, t)
    diffs += _compare_results("test", mine.test, theirs.test)
    diffs += _compare_results("validate", mine.validate, theirs.validate)
    if (mine.predict is None) != (theirs.predict is None):
        diffs.append(f"predict: ember {'none' if mine.predict is None else 'some'}, Lightning the other")
    elif mine.predict is not None and theirs.predict is not None:
        mine_p = {f"batch {i}": p for i, p in enumerate(mine.predict)}
        diffs += _compare_tensors("prediction", mine_p, {f"batch {i}": p for i, p in enumerate(theirs.predict)})
    if (mine.reloaded is None) != (theirs.reloaded is None):
        diffs.append("load_from_checkpoint: only one framework reloaded a module")
    elif mine.reloaded is not None and theirs.reloaded is not None:
        diffs += _compare_tensors("reloaded parameter", mine.reloaded, theirs.reloaded)
    for key, value in theirs.extra.items():
        other = mine.extra.get(key)
        numbers = isinstance(value, float) and isinstance(other, float)
        if not (_close(other, value) if numbers else other == value):
            diffs.append(f"{key}: ember {mine.extra.get(key)!r}, Lightning {value!r}")
    loss_or_param = [d for d in diffs if d.startswith(("loss", "parameter", "training batches"))]
    record.bitwise = not loss_or_param
    return record


def write_results(records: Sequence[Record], path: Path) -> None:
    """The records as JSON (one object per module; ``ported_clean`` and ``ok`` included)."""
    rows = [{**dataclasses.asdict(r), "ported_clean": r.ported_clean, "ok": r.ok} for r in records]
    path.write_text(json.dumps(rows, indent=2) + "\n")


def table(rows: Sequence[Mapping[str, Any]], legend: Mapping[str, str] | None = None) -> str:
    """The Markdown table of results (rows as `write_results` writes them): per module whether the port left
    names to edit, whether ember ran it, whether losses and parameters were bitwise equal, and the gaps it hits
    (by name) with the first difference or ember's error. `legend` (gap name -> text) adds a list of the gaps."""
    lines = [
        "| module | follows | ported with 0 edits | runs | bitwise | gaps; first difference |",
        "|---|---|---|---|---|---|",
    ]
    used: list[str] = []
    for row in sorted(rows, key=lambda r: r["name"]):
        yes = {True: "yes", False: "no"}
        what = [f"`{g}`" for g in row["gaps"]]
        used += [g for g in row["gaps"] if g not in used]
        if not row["ran"] and row["error"]:
            what.append(f"ember: {row['error'].split(': ')[0]}")
        elif row["differences"]:
            what.append(row["differences"][0])
        n = len(row["unmapped"])
        edits = "yes" if row["ported_clean"] else f"no ({n} name{'s' * (n != 1)})"
        bitwise = yes[row["bitwise"]] if row["ran"] else "-"
        cells = [f"`{row['name']}`", row["follows"], edits, yes[row["ran"]], bitwise, "; ".join(what) or "-"]
        lines.append("| " + " | ".join(cell.replace("|", "\\|") for cell in cells) + " |")
    text = "\n".join(lines) + "\n"
    if legend:
        text += "\n" + "".join(f"- `{g}`: {text_}\n" for g, text_ in legend.items() if g in used)
    return text


def main(argv: Sequence[str] | None = None, out: Callable[[str], Any] = print) -> int:
    """``python real_harness.py RESULTS.json``: print the Markdown table of a results file, with the legend of
    the gaps (`test_real_modules.GAPS`)."""
    args = list(sys.argv[1:] if argv is None else argv)
    if len(args) != 1:
        out("usage: real_harness.py RESULTS.json")
        return 2
    sys.path.insert(0, str(Path(__file__).resolve().parent))
    from test_real_modules import GAPS

    out(table(json.loads(Path(args[0]).read_text()), GAPS))
    return 0


if __name__ == "__main__":
    sys.exit(main())
