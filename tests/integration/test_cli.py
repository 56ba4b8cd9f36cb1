"""The ``ember`` command end to end: subprocess runs from YAML, resume, test/predict, and every config error.

Subprocess runs use absolute config paths (tests run in a temporary cwd) and tiny limits. The table of
bad configs runs in-process through `ember.cli.main` (same code, no interpreter start-up); two rows also
run as real processes to check the exit code and that no traceback is printed.
"""

from __future__ import annotations

import csv
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest
import torch
import yaml

from ember.cli import main

REPO = Path(__file__).resolve().parents[2]
DIGITS = REPO / "configs" / "digits.yaml"
PROJECT = Path(__file__).resolve().parent / "cli_project"
CHECKPOINT = "ember.callbacks.model_checkpoint.ModelCheckpoint"

NET_YAML = f"""\
seed: 7
trainer:
  max_epochs: 4
  enable_model_summary: false
  num_sanity_val_steps: 0
  callbacks:
    - _target_: {CHECKPOINT}
      monitor: val/acc
      mode: max
  logger:
    - _target_: ember.loggers.CSVLogger
module:
  _target_: my_project.models.Net
  hidden: 16
data:
  _target_: my_project.models.Blobs
  batch_size: 16
optimizer:
  _target_: torch.optim.SGD
  lr: 0.5
lr_scheduler:
  _target_: torch.optim.lr_scheduler.StepLR
  step_size: 1
  gamma: 0.5
"""


def ember_command(*args: str | Path, cwd: Path, pythonpath: Path | None = REPO, module: bool = False) -> list[str]:
    script = shutil.which("ember")
    head = [sys.executable, "-m", "ember"] if module or script is None else [script]
    return [*head, *map(str, args)]


def env_with(pythonpath: Path | None) -> dict[str, str]:
    env = dict(os.environ, WANDB_MODE="offline")
    env.pop("PYTHONPATH", None)
    if pythonpath is not None:
        env["PYTHONPATH"] = str(pythonpath)
    return env


def ember(
    *args: str | Path, cwd: Path, pythonpath: Path | None = REPO, module: bool = False
) -> subprocess.CompletedProcess[str]:
    """Run ``ember ARGS`` (or ``python -m ember ARGS``) in `cwd`; fails the test with its output if rc != 0."""
    cmd = ember_command(*args, cwd=cwd, module=module)
    result = subprocess.run(cmd, cwd=cwd, env=env_with(pythonpath), capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, f"{cmd} -> {result.returncode}\n{result.stdout}\n{result.stderr}"
    return result


def read_csv(path: Path) -> list[dict[str, str]]:
    with open(path, newline="") as f:
        return list(csv.DictReader(f))


def val_rows(run_dir: Path) -> list[dict[str, str]]:
    return [r for r in read_csv(run_dir / "metrics.csv") if r.get("val/acc")]


def make_project(root: Path, config: str = NET_YAML) -> Path:
    """`root`/my_project (a copy of tests/integration/cli_project) with `root`/net.yaml beside it."""
    shutil.copytree(PROJECT / "my_project", root / "my_project", ignore=shutil.ignore_patterns("__pycache__"))
    (root / "net.yaml").write_text(config)
    return root / "net.yaml"


# --- fit from YAML ----------------------------------------------------------------------------------


@pytest.mark.slow
def test_fit_digits_with_overrides_saves_config_and_metrics_and_the_saved_config_reproduces(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    limits = [
        "trainer.max_epochs=2",
        "trainer.limit_train_batches=3",
        "trainer.callbacks=[]",
        "trainer.enable_checkpointing=false",
    ]
    out = ember("fit", "-c", DIGITS, *limits, "module.hidden=32", "--data.batch_size=32", cwd=tmp_path).stdout
    run_dir = tmp_path / "runs" / "classifier" / "version_0"
    saved = yaml.safe_load((run_dir / "config.yaml").read_text())
    assert saved["seed"] == 42
    assert (saved["trainer"]["max_epochs"], saved["trainer"]["limit_train_batches"]) == (2, 3)
    assert saved["module"] == {"_target_": "examples.digits.Classifier", "lr": 0.003, "hidden": 32, "epochs": 2}
    assert saved["data"] == {"_target_": "examples.digits.DigitsData", "batch_size": 32}
    assert saved["trainer"]["log_every_n_steps"] == 50  # every schema default is written out
    rows = val_rows(run_dir)
    assert [(int(r["epoch"]), int(r["step"])) for r in rows] == [(0, 2), (1, 5)]  # after steps 3 and 6: rows 2, 5
    last, stop = out.strip().splitlines()[-2:]  # the summary, then why the fit stopped
    assert last.startswith("fit done in ") and "(2 epochs, 6 steps)" in last
    assert stop.startswith("stopped: max_epochs=2 reached")
    assert f"val/acc {float(rows[-1]['val/acc']):.4f}" in last and str(Path("runs/classifier/version_0")) in last

    # the saved config alone repeats the run: same metrics, bit for bit, in the next version (in-process:
    # the same code path without a second interpreter start-up; the cwd is tmp_path, as above)
    monkeypatch.setattr(sys, "path", [str(REPO), *sys.path])
    assert main(["fit", "-c", str(run_dir / "config.yaml")]) == 0
    again = val_rows(tmp_path / "runs" / "classifier" / "version_1")
    assert [(r["val/loss"], r["val/acc"]) for r in again] == [(r["val/loss"], r["val/acc"]) for r in rows]


@pytest.mark.slow  # imports the digits example (torchmetrics, scikit-learn) into the test process
def test_print_config_output_parses_back_to_the_same_config(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    """In-process (the same code without an interpreter start-up; ``python -m ember`` as a process is what
    test_first_hour.py runs), from an empty folder."""
    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(sys, "path", list(sys.path))
    capsys.readouterr()
    assert main(["fit", "-c", str(DIGITS), "--print-config", "module.lr=0.01", "--seed", "3"]) == 0
    out = capsys.readouterr().out
    printed = yaml.safe_load(out)
    assert printed["seed"] == 3 and printed["module"]["lr"] == 0.01 and printed["module"]["epochs"] == 20
    assert printed["trainer"]["max_epochs"] == 20 and printed["optimizer"] is None
    assert not (tmp_path / "runs").exists()
    # feeding the printed config back prints the same text
    (tmp_path / "printed.yaml").write_text(out)
    assert main(["fit", "-c", str(tmp_path / "printed.yaml"), "--print-config"]) == 0
    assert capsys.readouterr().out == out


# --- a user project outside the package, optimizers from YAML, test/predict from the best checkpoint ---


@pytest.fixture(scope="module")
def fitted(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path, str]:
    """`ember fit` of my_project.models.Net, config next to the package, run from another folder."""
    root = tmp_path_factory.mktemp("cli_fit")
    config = make_project(root / "project")
    (root / "work").mkdir()
    out = ember("fit", "-c", config, cwd=root / "work", pythonpath=None).stdout
    return config, root / "work", out


@pytest.mark.slow  # a fit through the ember command in a fresh process (module fixture `fitted`)
def test_user_module_next_to_the_config_trains_with_the_yaml_optimizer(fitted: tuple[Path, Path, str]) -> None:
    _, cwd, out = fitted
    run_dir = cwd / "runs" / "net" / "version_0"
    rows = read_csv(run_dir / "metrics.csv")
    # SGD(lr=0.5) under StepLR(step_size=1, gamma=0.5), epoch by epoch
    assert [float(r["lr"]) for r in rows if r.get("lr")] == [0.5, 0.25, 0.125, 0.0625]
    assert len(val_rows(run_dir)) == 4 and "(4 epochs, 24 steps)" in out  # 96 training points / 16
    saved = yaml.safe_load((run_dir / "config.yaml").read_text())
    assert saved["optimizer"] == {"_target_": "torch.optim.SGD", "lr": 0.5}


@pytest.mark.slow  # a fit through the ember command in a fresh process (module fixture `fitted`)
@pytest.mark.usefixtures("clean_imports")
def test_test_and_predict_from_the_best_checkpoint(
    fitted: tuple[Path, Path, str], monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """`ember test` and `ember predict` in this process (the same code without two interpreter start-ups; the
    commands as processes are in test_first_hour.py and test_walkthrough.py), from the fitted run's folder."""
    config, cwd, _ = fitted
    monkeypatch.chdir(cwd)
    best = max(val_rows(cwd / "runs" / "net" / "version_0"), key=lambda r: float(r["val/acc"]))
    capsys.readouterr()
    assert main(["test", "-c", str(config), "--ckpt-path", "best"]) == 0
    tested = capsys.readouterr().out
    # the test loader is the validation loader: testing the best weights repeats the best epoch's numbers
    assert f"test/acc {float(best['val/acc']):.4f}" in tested.splitlines()[-1]
    assert f"test/loss {float(best['val/loss']):.4f}" in tested.splitlines()[-1]

    assert main(["predict", "-c", str(config), "--ckpt-path", "best"]) == 0
    predicted = capsys.readouterr().out
    last = predicted.strip().splitlines()[-1]
    assert last.startswith("predict done in ") and "1 batch of outputs saved to " in last
    path = cwd / last.split(" saved to ")[1]
    (logits,) = torch.load(path)
    assert logits.shape == (32, 3)
    sys.path.insert(0, str(config.parent))
    try:
        from my_project.models import Blobs

        data = Blobs(batch_size=16)
        data.setup("predict")
        labels = data.val_set.tensors[1]
    finally:
        sys.path.remove(str(config.parent))
        for name in [m for m in sys.modules if m.startswith("my_project")]:
            del sys.modules[name]
    assert (logits.argmax(-1) == labels).float().mean().item() == pytest.approx(float(best["val/acc"]))


# --- kill and resume -----------------------------------------------------------------------------------


@pytest.mark.slow
@pytest.mark.usefixtures("clean_imports")
def test_killed_run_resumes_with_resume_last_and_ends_like_an_uninterrupted_run(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The killed run and its resume are ``ember`` processes; the uninterrupted run they are compared with runs
    in this process (the same code without an interpreter start-up)."""
    # my_project on PYTHONPATH this time; the config lives elsewhere
    shutil.copytree(PROJECT / "my_project", tmp_path / "lib" / "my_project")
    (tmp_path / "configs").mkdir()
    config = tmp_path / "configs" / "net.yaml"
    config.write_text(NET_YAML)
    marker = tmp_path / "hanging"
    hang = ["module.hang_at_epoch=2", f"module.marker={marker}"]
    with open(tmp_path / "killed.log", "w") as log:
        proc = subprocess.Popen(
            ember_command("fit", "-c", config, *hang, cwd=tmp_path),
            cwd=tmp_path,
            env=env_with(tmp_path / "lib"),
            stdout=log,
            stderr=subprocess.STDOUT,
        )
        run_dir = tmp_path / "runs" / "net" / "version_0"
        pointer = run_dir / "checkpoints" / "last"
        # The epoch's checkpoint is made durable (fsync, rename, `last`) on a background thread while the next
        # epoch runs, so the process is killed once `last` names epoch 1's checkpoint, during the hang.
        deadline = time.monotonic() + 60
        while proc.poll() is None and time.monotonic() < deadline:
            if marker.exists() and pointer.exists() and pointer.read_text().strip() == "epoch=1-step=12":
                break
            time.sleep(0.05)
        proc.kill()
        proc.wait()
    assert marker.read_text() == "12", (tmp_path / "killed.log").read_text()  # killed at the start of epoch 2
    assert pointer.read_text().strip() == "epoch=1-step=12", (tmp_path / "killed.log").read_text()

    out = ember("fit", "-c", config, "--resume", "last", cwd=tmp_path, pythonpath=tmp_path / "lib")
    assert "(4 epochs, 24 steps)" in out.stdout and "version_0" in out.stdout.splitlines()[-1]
    assert sorted(p.name for p in (tmp_path / "runs" / "net").iterdir()) == ["version_0"]  # continued in place
    resumed = val_rows(run_dir)
    assert [int(r["epoch"]) for r in resumed] == [0, 1, 2, 3]

    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(sys, "path", [str(tmp_path / "lib"), *sys.path])
    assert main(["fit", "-c", str(config), "trainer.default_root_dir=straight"]) == 0
    straight = val_rows(tmp_path / "straight" / "net" / "version_0")
    assert [(r["step"], r["val/loss"], r["val/acc"]) for r in resumed] == [
        (r["step"], r["val/loss"], r["val/acc"]) for r in straight
    ]


# --- bad configs and command lines -------------------------------------------------------------------

# Extra config files the rows refer to as {name}; {net} is the working net.yaml.
FILES = {
    "typo": "trainer:\n  enable_progress_bar: false\n  max_epoch: 3\n",
    "wrong_type": "trainer:\n  enable_progress_bar: maybe\n",
    "only_data": "data:\n  _target_: my_project.models.Blobs\n",
    "todo": "data:\n  seed: ???\n",
    "broken": "trainer:\n  max_epochs: [1, 2\nmodule: {}\n",
    "own_optimizer": "module:\n  _target_: examples.digits.Classifier\n",
    "extra_kwarg": "module:\n  hidden: 4\n  dropout: 0.1\n",
}
NET = ["fit", "-c", "{net}"]

BAD: list[tuple[str, list[str], list[str]]] = [
    # (id, argv, fragments of the one-line message: where it was set, the key path, the suggestion)
    (
        "unknown key in a file",
        [*NET, "-c", "{typo}"],
        ["typo.yaml:3: trainer.max_epoch: no such key", "did you mean trainer.max_epochs?"],
    ),
    ("unknown section", [*NET, "trainr.max_epochs=1"], ["command line: trainr: no such key; did you mean trainer?"]),
    (
        "wrong type",
        [*NET, "trainer.max_epochs=ten"],
        ["command line: trainer.max_epochs: expected int or null, got 'ten'"],
    ),
    (
        "wrong type in a file",
        [*NET, "-c", "{wrong_type}"],
        ["wrong_type.yaml:2: trainer.enable_progress_bar:", "expected bool, got 'maybe'"],
    ),
    (
        "wrong type, --key=value",
        [*NET, "--trainer.enable_progress_bar=maybe"],
        ["command line: trainer.enable_progress_bar: expected bool"],
    ),
    (
        "missing required section",
        ["fit", "-c", "{only_data}"],
        ["module: missing required value; add a module section"],
    ),
    ("??? left in a file", [*NET, "-c", "{todo}"], ["todo.yaml:2: data.seed: missing required value"]),
    (
        "missing constructor argument",
        [*NET, "lr_scheduler._target_=torch.optim.lr_scheduler.MultiStepLR"],  # step_size goes, gamma stays
        [
            "command line: lr_scheduler.milestones: missing required value:",
            "MultiStepLR needs the argument 'milestones'",
        ],
    ),
    (
        "module not importable",
        [*NET, "module._target_=my_projekt.models.Net"],
        ["command line: module._target_: cannot import my_projekt.models.Net:", "no module named 'my_projekt'"],
    ),
    (
        "class not in module",
        [*NET, "module._target_=my_project.models.Nett"],
        ["module._target_: cannot import my_project.models.Nett:", "did you mean my_project.models.Net?"],
    ),
    (
        "kwarg not accepted",
        [*NET, "module.hiden=8"],
        ["command line: module.hiden: my_project.models.Net takes no argument 'hiden'", "did you mean module.hidden?"],
    ),
    (
        "kwarg not accepted, in a file",
        [*NET, "-c", "{extra_kwarg}"],
        [
            "extra_kwarg.yaml:3: module.dropout: my_project.models.Net takes no argument",
            "it takes: hidden, hang_at_epoch, marker",
        ],
    ),
    (
        "optimizer kwarg not accepted",
        [*NET, "optimizer.lrr=0.1"],
        ["optimizer.lrr: torch.optim.SGD takes no argument 'lrr'; did you mean optimizer.lr?"],
    ),
    (
        "kwarg of the wrong type",
        [*NET, "module.hidden=wide"],
        ["command line: module.hidden: expected int, got 'wide'"],
    ),
    (
        "YAML syntax error",
        [*NET, "-c", "{broken}"],
        ["broken.yaml:3:7: YAML syntax error: did not find expected ',' or ']'"],
    ),
    (
        "bad interpolation",
        [*NET, "trainer.max_steps=${trainer.max_epoch}"],
        ["command line: trainer.max_steps: cannot resolve", "did you mean trainer.max_epochs?"],
    ),
    (
        "callback of the wrong kind",
        [*NET, "trainer.callbacks=[{_target_: my_project.models.Blobs}]"],
        ["trainer.callbacks[0]._target_: my_project.models.Blobs is not a subclass of", "Callback"],
    ),
    (
        "callback kwarg not accepted",
        [*NET, "trainer.callbacks=[{_target_: " + CHECKPOINT + ", monitr: val/acc}]"],
        ["trainer.callbacks[0].monitr: ", "did you mean trainer.callbacks[0].monitor?"],
    ),
    (
        "logger of the wrong type",
        [*NET, "trainer.logger=3"],
        ["trainer.logger: expected true, false or a list of _target_ sections, got 3"],
    ),
    ("trainer option out of range", [*NET, "trainer.limit_train_batches=1.5"], ["trainer: limit_train_batches=1.5"]),
    (
        "scheduler without optimizer",
        [*NET, "optimizer=null"],
        ["lr_scheduler: a scheduler needs an optimizer section too"],
    ),
    (
        "optimizer section ignored by the module",
        [*NET, "-c", "{own_optimizer}"],
        ["net.yaml:18: optimizer: examples.digits.Classifier defines its own configure_optimizers()"],
    ),
    (
        "data without the stage's dataloader",
        ["validate", *NET[1:], "data._target_=ember.DataModule"],
        ["command line: data._target_: ember.DataModule has no val_dataloader(), which `validate` needs"],
    ),
    (
        "a mapping where a list belongs",
        [*NET, "trainer.callbacks={_target_: " + CHECKPOINT + "}"],
        ["command line: trainer.callbacks: expected a list or null, got {'_target_': "],
    ),
    ("a number for a section", [*NET, "trainer=3"], ["command line: trainer: expected a mapping of options, got 3"]),
    (
        "override without a value",
        [*NET, "trainer.max_epochs"],
        ["command line: 'trainer.max_epochs' is not an option or an override"],
    ),
    ("no such checkpoint", [*NET, "--resume", "nowhere/ckpt"], ["--ckpt: no checkpoint at nowhere/ckpt"]),
    ("no such config file", ["fit", "-c", "missing.yaml"], ["missing.yaml: cannot read config file"]),
]


def bad_argv(root: Path, argv: list[str]) -> list[str]:
    """Write net.yaml, my_project and FILES under `root`; fill in the {name} placeholders of `argv`."""
    paths = {"net": str(make_project(root))}
    for name, text in FILES.items():
        (root / f"{name}.yaml").write_text(text)
        paths[name] = str(root / f"{name}.yaml")
    return [arg.format(**paths) if arg.startswith("{") and arg.endswith("}") else arg for arg in argv]


@pytest.fixture
def clean_imports(monkeypatch: pytest.MonkeyPatch) -> Any:
    monkeypatch.setattr(sys, "path", list(sys.path))
    yield
    for name in [m for m in sys.modules if m.startswith("my_project")]:
        del sys.modules[name]


@pytest.mark.parametrize(("argv", "expected"), [row[1:] for row in BAD], ids=[row[0] for row in BAD])
@pytest.mark.usefixtures("clean_imports")
def test_bad_config_exits_2_with_one_line_naming_the_key_and_creates_nothing(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], argv: list[str], expected: list[str]
) -> None:
    argv = bad_argv(tmp_path / "project", argv)
    before = sorted(p.relative_to(tmp_path) for p in tmp_path.rglob("*") if "__pycache__" not in p.parts)
    assert main(argv) == 2
    captured = capsys.readouterr()
    lines = captured.err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("ember: error: "), captured.err
    assert expected and all(text in lines[0] for text in expected), lines[0]
    assert "Traceback" not in captured.err and captured.out == ""
    after = sorted(p.relative_to(tmp_path) for p in tmp_path.rglob("*") if "__pycache__" not in p.parts)
    assert after == before  # no run directory (nor anything else) was created


def test_bad_config_table_has_at_least_12_rows() -> None:
    assert len(BAD) >= 12 and len({row[0] for row in BAD}) == len(BAD)


@pytest.mark.slow  # 4 s of CPU on a 2-core machine, with the processes it starts
def test_real_process_exit_code_2_without_traceback_and_debug_shows_it(tmp_path: Path) -> None:
    config = make_project(tmp_path / "project")
    base = ember_command("fit", "-c", config, "module.hiden=8", cwd=tmp_path)
    procs = [
        subprocess.Popen(
            cmd, cwd=tmp_path, env=env_with(None), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True
        )
        for cmd in (base, [*base, "--debug"])
    ]
    (_, err), (_, debug_err) = (p.communicate(timeout=120) for p in procs)
    assert [p.returncode for p in procs] == [2, 2]
    assert err.splitlines() == [
        "ember: error: command line: module.hiden: my_project.models.Net takes no argument 'hiden'; "
        "did you mean module.hidden?"
    ]
    assert "Traceback" in debug_err and debug_err.strip().splitlines()[-1] == err.strip()
    assert not (tmp_path / "runs").exists()
