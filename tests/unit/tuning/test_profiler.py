"""``Trainer(profiler=...)``: the simple table adds up to the wall time, the torch trace holds ember's ranges,
a profiled run trains exactly like an unprofiled one, and without a profiler nothing is attached."""

from __future__ import annotations

import json
import time
from pathlib import Path
from typing import Any

import pytest
import torch

import ember
from ember.trainer.optimization import steps_are_plain
from ember.tuning.profiler import Profiler, ProfilerConfig, resolve_profiler

STEP_ACTIONS = ("train/forward", "train/backward", "train/optimizer_step")


class _Slow(ember.Callback):
    """Makes each step take a few milliseconds, so the table's figures are well above timer noise."""

    def on_train_batch_end(self, trainer: Any, module: Any, outputs: Any, batch: Any, batch_idx: int) -> None:
        time.sleep(0.002)


def _fit(tiny: Any, tmp_path: Path, profiler: Any, **options: Any) -> tuple[ember.Trainer, Any, float]:
    Net, Blobs, make = tiny
    trainer = make(default_root_dir=tmp_path, max_epochs=2, profiler=profiler, **options)
    module = Net()
    start = time.perf_counter()
    trainer.fit(module, datamodule=Blobs())
    return trainer, module, time.perf_counter() - start


@pytest.mark.slow  # 2 s of CPU on a 2-core machine, with the processes it starts
def test_simple_table_adds_up_to_the_fit_wall_time(tiny: Any, tmp_path: Path, capsys: Any) -> None:
    trainer, _, wall = _fit(tiny, tmp_path, "simple", callbacks=[_Slow()], logger=True, enable_checkpointing=True)
    (report,) = trainer.profiler.reports
    actions = {a.name: a for a in report.actions}
    steps = trainer.global_step
    assert steps == 24
    for name in STEP_ACTIONS:
        assert actions[name].calls == steps, name
    assert actions["train/data_fetch"].calls == steps + 2  # each epoch's last fetch finds the end
    assert actions["validation"].calls == 2 and actions["sanity_check"].calls == 1
    assert actions["checkpoint/write"].calls == 2 and actions["logging/epoch_end"].calls >= 2
    assert actions["hook/_Slow.on_train_batch_end"].calls == steps
    assert actions["hook/_Slow.on_train_batch_end"].self >= 0.002 * steps
    for phase in ("setup", "teardown"):
        assert actions[phase].calls == 1
    named = sum(a.self for a in report.actions if a.name != "fit (other)")
    assert named <= report.wall_s <= wall, (named, report.wall_s, wall)
    total = sum(a.self for a in report.actions)
    assert total == pytest.approx(report.wall_s, rel=1e-6)  # self times partition the run
    printed = capsys.readouterr().out
    assert "profile of fit" in printed and "train/backward" in printed
    text = (trainer.run_dir / "profiler" / "fit.txt").read_text(encoding="utf-8")
    assert text.startswith("profile of fit:")
    data = json.loads((trainer.run_dir / "profiler" / "fit.json").read_text(encoding="utf-8"))
    assert {a["name"] for a in data["actions"]} == set(actions)


@pytest.mark.perf
def test_the_named_actions_cover_nine_tenths_of_the_fit(tiny: Any, tmp_path: Path) -> None:
    """The named actions' self times add up to the fit's wall time measured outside it, within 10% (what is left,
    "fit (other)", is the loop's own time; a busy machine can stretch it past that)."""
    trainer, _, wall = _fit(tiny, tmp_path, "simple", callbacks=[_Slow()], logger=True, enable_checkpointing=True)
    (report,) = trainer.profiler.reports
    named = sum(a.self for a in report.actions if a.name != "fit (other)")
    assert 0.9 * wall <= named <= wall, (named, wall)


@pytest.mark.slow  # 2 s of CPU on a 2-core machine, with the processes it starts
def test_a_profiled_run_trains_exactly_like_an_unprofiled_one(tiny: Any, tmp_path: Path) -> None:
    results = []
    for profiler in (None, "simple"):
        ember.seed_everything(5)
        _, module, _ = _fit(tiny, tmp_path, profiler)
        results.append(module.state_dict())
    for key in results[0]:
        assert torch.equal(results[0][key], results[1][key]), key


def test_without_a_profiler_nothing_is_attached(tiny: Any, tmp_path: Path) -> None:
    trainer, _, _ = _fit(tiny, tmp_path, None)
    assert trainer.profiler is None
    assert steps_are_plain(trainer.fit_loop)  # the loop keeps its plain path
    for name in ("training_step", "backward", "optimizer_step", "batch_to_device"):
        assert name not in vars(trainer.strategy)


def test_the_wrappers_are_removed_after_the_run(tiny: Any, tmp_path: Path) -> None:
    trainer, _, _ = _fit(tiny, tmp_path, "simple")
    assert not steps_are_plain(trainer.fit_loop)  # a profiled run takes the general path (it times its parts)
    for obj in (trainer.strategy, trainer.reporter, trainer.checkpoints):
        wrapped = [k for k, v in vars(obj).items() if callable(v) and hasattr(v, "__wrapped__")]
        assert wrapped == [], (type(obj).__name__, wrapped)


def test_validate_and_test_are_profiled_too(tiny: Any, tmp_path: Path) -> None:
    Net, Blobs, make = tiny
    trainer = make(default_root_dir=tmp_path, profiler=ProfilerConfig(print_table=False))
    trainer.validate(Net(), datamodule=Blobs())
    report = trainer.profiler.reports[-1]
    actions = {a.name: a for a in report.actions}
    assert report.stage == "validate" and actions["validation"].calls == 1
    assert "train/forward" not in actions
    assert (trainer.run_dir / "profiler" / "validate.txt").exists()


def test_pytorch_trace_holds_ember_ranges(tiny: Any, tmp_path: Path) -> None:
    config = ProfilerConfig(kind="pytorch", wait=1, warmup=1, active=2, print_table=False)
    trainer, _, _ = _fit(tiny, tmp_path, config)
    (report,) = trainer.profiler.reports
    assert len(report.traces) == 1 and report.traces[0].parent == trainer.run_dir / "profiler"
    events = json.loads(report.traces[0].read_text(encoding="utf-8"))["traceEvents"]
    names = [e["name"] for e in events if e.get("ph") == "X" and e.get("name", "").startswith("ember/")]
    for action in (*STEP_ACTIONS, "train/data_fetch"):
        assert names.count(f"ember/{action}") == 2, action  # the two active steps
    assert any(n == "aten::addmm" for n in (e.get("name") for e in events))  # torch's own ops are in it too


@pytest.mark.parametrize(
    ("value", "error"),
    [
        ("fancy", "profiler='fancy'"),
        ({"kind": "pytorch", "activ": 2}, "unknown option 'activ'"),
        (3, "profiler must be"),
    ],
)
def test_profiler_option_errors(value: Any, error: str) -> None:
    with pytest.raises((ValueError, TypeError), match=error):
        resolve_profiler(value)


def test_profiler_option_forms() -> None:
    assert resolve_profiler(None) is None
    assert resolve_profiler("simple").config.kind == "simple"  # type: ignore[union-attr]
    custom = resolve_profiler({"kind": "pytorch", "active": 2})
    assert custom is not None and (custom.config.kind, custom.config.active) == ("pytorch", 2)
    same = Profiler()
    assert resolve_profiler(same) is same
    with pytest.raises(ValueError, match="active=0"):
        ProfilerConfig(active=0)


def test_a_run_rejected_before_it_starts_leaves_the_next_report_whole(tiny: Any, tmp_path: Path) -> None:
    Net, Blobs, make = tiny

    class Misspelt(ember.Callback):
        def on_train_epoch_ends(self, trainer: Any, module: Any) -> None:
            pass

    trainer = make(default_root_dir=tmp_path, max_epochs=1, profiler=ProfilerConfig(print_table=False))
    trainer.user_callbacks.append(Misspelt())
    with pytest.raises(AttributeError, match="on_train_epoch_ends"):
        trainer.fit(Net(), datamodule=Blobs())
    trainer.user_callbacks.pop()
    trainer.fit(Net(), datamodule=Blobs())
    report = trainer.profiler.reports[-1]
    names = [a.name for a in report.actions]
    assert names.count("fit (other)") == 1 and "setup" in names and "train/forward" in names
    assert sum(a.self for a in report.actions) == pytest.approx(report.wall_s, rel=1e-6)
