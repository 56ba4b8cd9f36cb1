"""benchmarks/vs_lightning.py in its quick mode: every corpus module timed under both frameworks, the report's shape.

Times and ratios are not asserted (a shared machine makes them noise), and neither is the x1.00 goal. What is
asserted: every module tests/compat/real trains is in the figures; each module both frameworks ran has finite
positive ratios for every phase it has (validation only where it validates); a module without figures is one
whose corpus case names an ember gap, and its error is reported; at least two modules are also compared with a
hand-written loop; the printed report, its verdict and the Markdown table name every module; and the table in
docs/benchmarks.md has a row for every module.
"""

from __future__ import annotations

import importlib.util
import json
import math
import re
import sys
from pathlib import Path
from typing import Any

import pytest

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = ROOT / "benchmarks" / "vs_lightning.py"
PHASES = ("train", "val", "epoch")

pytest.importorskip("lightning.pytorch", reason="benchmarks/vs_lightning.py compares ember with Lightning")


def corpus_names(monkeypatch: pytest.MonkeyPatch) -> list[str]:
    """The modules tests/compat/real/test_real_modules.py trains, named as the benchmark names them."""
    monkeypatch.syspath_prepend(str(ROOT / "tests" / "compat" / "real"))
    import test_real_modules as corpus

    return [c.name for c in corpus.CORPUS] + [f"demos.{d.name}" for d in corpus.DEMOS]


def load_script(monkeypatch: pytest.MonkeyPatch) -> Any:
    """The script as a module of this process (where Lightning and the corpus are imported already: a new
    interpreter would import them again); sys.path and the modules its runs import are restored afterwards."""
    monkeypatch.setattr(sys, "path", list(sys.path))  # the script puts the repository and the corpus first
    for name in [n for n in sys.modules if n.startswith(("ported_", "lightning_lit_"))]:
        monkeypatch.delitem(sys.modules, name)
    spec = importlib.util.spec_from_file_location("vs_lightning_under_test", SCRIPT)
    assert spec is not None and spec.loader is not None
    script = importlib.util.module_from_spec(spec)
    monkeypatch.setitem(sys.modules, spec.name, script)  # its dataclasses look their module up
    spec.loader.exec_module(script)
    return script


def run_here(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str], tmp_path: Path, *args: str
) -> tuple[str, dict[str, Any]]:
    """``python benchmarks/vs_lightning.py --json FILE ARGS``, in this process: the printed report and the figures."""
    out = tmp_path / "figures.json"
    before = set(sys.modules)
    try:
        assert load_script(monkeypatch).main(["--json", str(out), *args]) == 0
    finally:  # the modules the runs imported by file (the ported copies, Lightning's originals)
        for name in set(sys.modules) - before:
            if name.startswith(("ported_", "lightning_lit_")):
                del sys.modules[name]
    return capsys.readouterr().out, json.loads(out.read_text())


def positive(value: float | None) -> bool:
    return value is not None and math.isfinite(value) and value > 0


def check_module(name: str, module: dict[str, Any]) -> None:
    assert module["timed"], (name, module["errors"])
    ms = module["ms"]
    assert all(n > 0 for n in module["epochs"]["ember"] + module["epochs"]["lightning"]), (name, module["epochs"])
    validates = positive(ms["lightning"]["val"]) and positive(ms["ember"]["val"])
    for phase in PHASES:
        for key in (phase, f"{phase}_cpu"):
            ratio = module["ratio"][key]
            if phase == "val" and not validates:
                assert ratio is None, (name, key, ratio)
            else:
                assert positive(ratio), (name, key, ratio)


@pytest.mark.slow
def test_quick_mode_times_every_corpus_module(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    names = corpus_names(monkeypatch)
    text, figures = run_here(monkeypatch, capsys, tmp_path, "--quick", "--markdown")
    assert (figures["quick"], figures["rounds"], figures["warmup"], figures["alternate"]) == (True, 1, 0, "run")
    assert list(figures["modules"]) == names
    timed = {n: m for n, m in figures["modules"].items() if m["timed"]}
    for name, module in figures["modules"].items():
        if module["timed"]:
            check_module(name, module)
        else:  # only a module whose corpus case names a gap ember has not closed yet, with ember's error
            assert module["gaps"] and set(module["errors"]) == {"ember"}, (name, module)
    assert len(timed) >= len(names) - 4, sorted(set(names) - set(timed))
    raw = {n: m["raw_ratio"] for n, m in timed.items() if m["raw_ratio"] is not None}
    assert len(raw) >= 2 and all(positive(r["train"]) and positive(r["epoch"]) for r in raw.values()), raw
    # The report: a line per module, and one verdict that states no verdict for a single round but names the
    # figure of every timed module beside the goal.
    for name in names:
        assert re.search(rf"^  {re.escape(name)} ", text, re.MULTILINE), name
        assert f"| `{name}` |" in text, name
    verdicts = re.findall(r"^verdict: (none \(.+\) for) the goal \(epoch, wall clock: (.+)\)$", text, re.MULTILINE)
    assert len(verdicts) == 1 and verdicts[0][0].startswith("none (one round"), text
    assert {n for n, _ in re.findall(r"([\w.]+) x(\d+\.\d+) <= 1\.00", verdicts[0][1])} == set(timed)


@pytest.mark.slow
def test_epoch_alternation_and_a_module_subset(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    args = ("--quick", "--alternate", "epoch", "--modules", "demos.BoringModel,lit_regression")
    stdout, figures = run_here(monkeypatch, capsys, tmp_path, *args)
    assert figures["alternate"] == "epoch"
    assert list(figures["modules"]) == ["demos.BoringModel", "lit_regression"]
    for name, module in figures["modules"].items():
        check_module(name, module)
    assert positive(figures["modules"]["demos.BoringModel"]["raw_ratio"]["train"])
    assert "alternated by epoch" in stdout


def test_an_unknown_module_is_one_line_and_exit_2(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """Run in this process: main() exits with status 2 after one error line (argparse's usage above it) and raises
    nothing else, so the command line shows no traceback; the corpus and Lightning are not imported again."""
    script = load_script(monkeypatch)
    with pytest.raises(SystemExit) as exit_:
        script.main(["--only", "lit_nope"])
    assert exit_.value.code == 2
    err = capsys.readouterr().err
    (error,) = [line for line in err.splitlines() if "error:" in line]  # one error line below the usage
    assert "error: unknown module(s) lit_nope; choose from lit_gan," in error, err


def test_the_docs_table_has_a_row_for_every_corpus_module(monkeypatch: pytest.MonkeyPatch) -> None:
    docs = (ROOT / "docs" / "benchmarks.md").read_text()
    section = docs.split("## ember against Lightning on real modules", 1)[1].split("\n## ", 1)[0]
    rows = re.findall(r"^\| `([\w.]+)` \|", section, re.MULTILINE)
    assert rows == corpus_names(monkeypatch)
