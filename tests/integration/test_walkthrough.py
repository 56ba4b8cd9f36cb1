"""A new user's path with their own data, end to end, from a folder that is not the repository (issue 33).

The user follows docs/your-data.md: their project gets a CSV file, a data module made of the page's own
code blocks (the Dataset classes and ``FilesData``, demo lines left out) and a config made of the page's
YAML block pointed at their module and CSV (``configs/your_data.yaml`` is the page as a config). Then, each
as a separate ``ember`` process the way a user types them:

1. ``ember fit``, stopped with Ctrl-C (SIGINT) once the first checkpoint exists: exit 130 and the line
   docs/cli.md quotes, naming the run and its checkpoint;
2. ``ember fit --resume last``: the same run continues; the summary and stop lines docs/cli.md quotes;
3. ``ember test --ckpt-path best``: the loading line (the epoch as in the checkpoint's name) and
   ``eval/test-<checkpoint>.json`` in that run, as docs/your-data.md says;
4. ``ember predict --ckpt-path best``: outputs saved in the run's ``eval/`` folder;
5. ``ember export --ckpt best``: a torch.export program that loads and runs;
6. ``ember runs``: the run, finished, with its evaluation under it.

ember and the repository's ``examples`` (the page imports ``TextLines`` and ``Classifier`` from it) are
importable from a folder that holds nothing else.
"""

from __future__ import annotations

import importlib.util
import json
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import forked_cli
import pytest
import torch
import yaml

_spec = importlib.util.spec_from_file_location("walkthrough_docs_blocks", Path(__file__).with_name("docs_blocks.py"))
assert _spec is not None and _spec.loader is not None
docs_blocks = importlib.util.module_from_spec(_spec)
sys.modules[_spec.name] = docs_blocks  # its dataclass looks its module up while it is made
try:
    _spec.loader.exec_module(docs_blocks)
finally:
    del sys.modules[_spec.name]
ROOT, blocks = docs_blocks.ROOT, docs_blocks.blocks
PAGE = "docs/your-data.md"

#: Lines of the page's Python blocks that show a class at work rather than define it.
DEMO = re.compile(r"^(table|images|text|root) = |^print\(|^from examples\.your_data import write_example_files")


RUN = "runs/your_data/version_0"

#: The lines the page quotes and the walkthrough prints, by name (the run directory filled in, figures left open).
LINES = {
    "interrupted": rf"ember: interrupted; `--resume last` continues {RUN} from its checkpoint epoch=(\d+)-step=(\d+)",
    # the monitored value is shown for a checkpoint ModelCheckpoint keeps (its top k); the checkpoint Ctrl-C left
    # as `last` may be one it did not keep (its val/acc was not better), which the line gives without one
    "resuming": rf"ember: resuming from {RUN}/checkpoints/epoch=(\d+)-step=(\d+) \(epoch (\d+), step (\d+)"
    r"(?:, val/acc \d\.\d{4})?\)",
    "fit done": r"fit done in [\d.]+ s \((\d+) epochs, (\d+) steps\): val/acc \d\.\d{4}  val/loss \d\.\d{4}; "
    rf"run dir {RUN}",
    "stopped": rf"stopped: max_epochs=(\d+) reached; best checkpoint {RUN}/checkpoints/(epoch=(\d+)-step=(\d+)) "
    r"\(val/acc (\d\.\d{4})\)",
    "loading": rf"ember: test: loading the best checkpoint {RUN}/checkpoints/(epoch=(\d+)-step=(\d+)) "
    r"\(epoch (\d+), step (\d+), val/acc (\d\.\d{4})\)",
    "test done": rf"test done in [\d.]+ s \(1 dataloader\): test/acc \d\.\d{{4}}  test/loss \d\.\d{{4}}; run dir {RUN}",
}


def match(name: str, line: str) -> re.Match[str]:
    found = re.fullmatch(LINES[name], line)
    assert found is not None, f"{name}: {line!r} is not of the form {LINES[name]!r}"
    return found


def test_the_page_quotes_the_lines_the_walkthrough_checks() -> None:
    (session,) = [b for b in blocks(PAGE) if b.lang == "text" and "ember: interrupted" in b.text]
    lines = session.text.splitlines()
    quoted = {name: [m for line in lines if (m := re.fullmatch(pattern, line))] for name, pattern in LINES.items()}
    assert all(len(found) == 1 for found in quoted.values()), {k: len(v) for k, v in quoted.items()}
    (interrupted,), (resuming,), (loading,) = quoted["interrupted"], quoted["resuming"], quoted["loading"]
    assert interrupted.groups() == resuming.groups()[:2] and resuming.group(1) == resuming.group(3)  # epoch labels
    assert loading.group(2) == loading.group(4) and loading.group(1) == quoted["stopped"][0].group(2)


def data_module_from_the_page() -> str:
    """The page's Python blocks that define the data (the Dataset classes, ``FilesData``), as one module."""
    parts = []
    for block in blocks(PAGE):
        if block.lang != "python" or "trainer.fit" in block.text:
            continue
        parts.append("\n".join(line for line in block.text.splitlines() if not DEMO.match(line)))
    module = "\n\n".join(parts)
    assert "class CSVDataset(Dataset)" in module and "class FilesData(ember.DataModule)" in module
    return module


def config_from_the_page() -> str:
    """configs/your_data.yaml (the page as a config) with the page's data section pointed at the user's module
    and CSV file, as the page's comments say (``your_project.data.FilesData``; no ``write_example_files``)."""
    (section,) = [b.text for b in blocks(PAGE) if b.lang == "yaml"]
    data = yaml.safe_load(section)["data"]
    assert data.pop("write_example_files") is True
    data.update(_target_="my_project.data.FilesData", path="data/table.csv", kind="csv")
    config = yaml.safe_load((ROOT / "configs" / "your_data.yaml").read_text())
    config["module"].update(kind="csv", num_classes=3)
    config["data"] = data
    config["trainer"].update(enable_progress_bar=False, enable_model_summary=False)
    return yaml.safe_dump(config, sort_keys=False)


def write_csv(path: Path, rows: int = 240) -> None:
    """f0,f1,f2,f3,label (the page's table): the label is the largest of the first three features."""
    g = torch.Generator().manual_seed(0)
    x = torch.randn(rows, 4, generator=g)
    y = x[:, :3].argmax(-1)
    rows_text = [",".join(f"{v:.4f}" for v in row.tolist()) + f",{int(c)}" for row, c in zip(x, y, strict=True)]
    lines = ["f0,f1,f2,f3,label", *rows_text]
    path.parent.mkdir(parents=True)
    path.write_text("\n".join(lines) + "\n")


def env_with(site: Path) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("RANK", "WORLD_SIZE", "LOCAL_", "MASTER_"))}
    env.update(PYTHONPATH=str(site), OMP_NUM_THREADS="1", WANDB_MODE="offline")
    return env


def ember(project: Path, site: Path, *args: str, expect: int = 0) -> subprocess.CompletedProcess[str]:
    """``python -m ember ARGS``, forked from a process that imported torch and ember already (tests/forked_cli.py;
    the page's first command, `fit_until_ctrl_c`, is a real interpreter)."""
    done = forked_cli.run(args, cwd=project, env=env_with(site), timeout=300)
    assert done.returncode == expect, f"ember {' '.join(args)} -> {done.returncode}\n{done.stdout}\n{done.stderr}"
    return done


def fit_until_ctrl_c(project: Path, site: Path, *args: str) -> tuple[int, str, str]:
    """``ember fit`` in its own process group, sent SIGINT (as a terminal's Ctrl-C) once ``last`` exists; returns
    its exit code, stderr and stdout."""
    command = [sys.executable, "-m", "ember", "fit", *args]
    proc = subprocess.Popen(command, cwd=project, env=env_with(site), stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, start_new_session=True)  # fmt: skip
    pointer = project / "runs" / "your_data" / "version_0" / "checkpoints" / "last"
    try:
        deadline = time.monotonic() + 240
        while not pointer.exists():
            assert proc.poll() is None and time.monotonic() < deadline, proc.communicate()
            time.sleep(0.01)
        os.killpg(proc.pid, signal.SIGINT)
        out, err = proc.communicate(timeout=120)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
    return proc.returncode, err, out


@pytest.mark.slow  # six ember commands, five of them forked (tests/forked_cli.py)
def test_the_walkthrough_of_your_data(tmp_path: Path) -> None:
    site = tmp_path / "site"  # what is installed: ember (and the repository's examples, which the page imports)
    site.mkdir()
    for name in ("ember", "examples"):
        (site / name).symlink_to(ROOT / name, target_is_directory=True)
    project = tmp_path / "project"
    (project / "my_project").mkdir(parents=True)
    (project / "pyproject.toml").write_text('[project]\nname = "my_project"\n')
    (project / "my_project" / "__init__.py").write_text("")
    (project / "my_project" / "data.py").write_text(data_module_from_the_page())
    (project / "configs").mkdir()
    (project / "configs" / "my_data.yaml").write_text(config_from_the_page())
    write_csv(project / "data" / "table.csv")
    run = RUN
    config = ["-c", "configs/my_data.yaml"]

    # 1. fit, stopped with Ctrl-C after the first checkpoint
    code, err, out = fit_until_ctrl_c(project, site, *config, "trainer.max_epochs=1000")
    assert code == 130, f"{err}\n{out}\nSIGINT: {signal.getsignal(signal.SIGINT)}"
    stopped_at = match("interrupted", err.splitlines()[-1])
    assert "Traceback" not in err
    epochs = int(stopped_at.group(1)) + 3  # resume for 2 more epochs than the checkpoint's (numbered from 0)

    # 2. resume: the same run continues to its end
    resumed = ember(project, site, "fit", *config, f"trainer.max_epochs={epochs}", "--resume", "last")
    # (a warning also says max_epochs differs from the checkpoint's: the test set 1000 to have time for Ctrl-C)
    (resuming,) = [match("resuming", x) for x in resumed.stderr.splitlines() if x.startswith("ember: resuming")]
    assert resuming.groups()[:2] == stopped_at.groups() and resuming.group(1) == resuming.group(3)
    done, stop = resumed.stdout.strip().splitlines()[-2:]
    steps_per_epoch = 168 // 32 + 1  # 70% of 240 rows in batches of 32
    assert match("fit done", done).groups() == (str(epochs), str(epochs * steps_per_epoch))
    best = match("stopped", stop)
    assert best.group(1) == str(epochs)
    name, best_epoch, best_step, best_acc = best.groups()[1:]

    # 3. test the best checkpoint: the loading line names it with its epoch as in its name; eval/ in its run
    tested = ember(project, site, "test", *config, "--ckpt-path", "best")
    loading = match("loading", tested.stderr.splitlines()[0])
    assert loading.groups() == (name, best_epoch, best_step, best_epoch, best_step, best_acc)
    match("test done", tested.stdout.strip().splitlines()[-1])
    record = json.loads((project / run / "eval" / f"test-{name}.json").read_text())
    assert 0.0 <= record["metrics"]["test/acc"] <= 1.0

    # 4. predict with the best checkpoint: one tensor of logits per batch, saved in the run's eval/ folder
    predicted = ember(project, site, "predict", *config, "--ckpt-path", "best")
    saved = f"{run}/eval/predict-{name}.pt"
    assert re.fullmatch(rf"predict done in [\d.]+ s: 1 batch of outputs saved to {saved}",
                        predicted.stdout.strip().splitlines()[-1]), predicted.stdout  # fmt: skip
    outputs = torch.load(project / saved)
    assert [tuple(o.shape) for o in outputs] == [(36, 3)]  # 15% of 240 rows, 3 classes

    # 5. export the best checkpoint
    exported = ember(project, site, "export", "--ckpt", "best", *config, "--format", "torch-export",
                     "--out", "exports")  # fmt: skip
    assert re.match(rf"export done in [\d.]+ s: exports/\S+\.pt2 from {run}/checkpoints/{name}\b", exported.stdout)
    (artifact,) = (project / "exports").glob("*.pt2")
    program = torch.export.load(artifact).module()
    assert program(torch.zeros(5, 4)).shape == (5, 3)

    # 6. the runs: one, finished, with the test of its best checkpoint under it
    listed = ember(project, site, "runs").stdout.splitlines()
    assert listed[0].split()[:4] == ["RUN", "COMMAND", "STATUS", "STARTED"]
    row, evaluation = listed[1].split(), listed[2].split()
    assert row[:3] == ["your_data/version_0", "fit", "finished"] and row[5:7] == [str(epochs), str(
        epochs * steps_per_epoch)], listed  # fmt: skip
    assert evaluation[:3] == ["eval", "test", name], listed
    assert len(listed) == 3, listed
