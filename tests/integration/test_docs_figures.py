"""The figures the guides quote from running the digits example are what docs/figures.py produces (issue 33,
item 9): the learning rate the finder suggests, the steps of one 20-epoch run, the last checkpoint's name.
"""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path
from types import ModuleType

import pytest

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = ROOT / "docs" / "figures.py"


def figures_module() -> ModuleType:
    spec = importlib.util.spec_from_file_location("docs_figures", SCRIPT)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_every_place_a_figure_is_quoted_is_found() -> None:
    figures = figures_module()
    found = figures.stated()
    assert [(page, name) for page, name, _ in found] == [(page, name) for page, _, name in figures.PLACES]
    values = {name: {value for _, n, value in found if n == name} for name in ("lr_suggestion", "steps_per_run")}
    assert all(len(v) == 1 for v in values.values()), values  # each figure is quoted the same everywhere


@pytest.mark.slow  # the lr finder's 100 steps in a fresh process: about 10 s alone, 20 to 40 s on 2 busy cores
def test_the_pages_state_the_figures_the_script_produces(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    # ``python docs/figures.py`` in this process, where torch and ember are imported already; the `ember tune lr`
    # it quotes still runs as its own process. sys.path (the config loader extends it), argv and cwd are restored.
    monkeypatch.setattr(sys, "path", list(sys.path))
    monkeypatch.setattr(sys, "argv", [str(SCRIPT)])
    monkeypatch.chdir(tmp_path)
    code = figures_module().main()
    out = capsys.readouterr()
    lines = out.out.splitlines()
    assert code == 0, f"the pages differ from what `python docs/figures.py --write` puts there:\n{out}"
    assert len(lines) == len(figures_module().PLACES) and not any("(produced:" in line for line in lines), lines
    steps = next(line for line in lines if "steps_per_run" in line).split()[-1]
    assert f"docs/export.md: last_checkpoint epoch=19-step={steps}" in lines  # 20 epochs, numbered from 0
