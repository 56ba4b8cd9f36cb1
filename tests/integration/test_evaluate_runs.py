"""Evaluating a checkpoint writes into the run it came from, and says which checkpoint it loaded (issue 21,
items 1 and 2): ``eval/<stage>-<checkpoint>.json``, the same TensorBoard run and metrics.csv, no new
version; ``best``/``last`` across several runs name the run they chose and ``--run version_N`` picks
another; advice for another subcommand's option names this one's; a finished run says there is nothing to do.
"""

from __future__ import annotations

import csv
import json
import shutil
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

from ember.cli import main

PROJECT = Path(__file__).resolve().parent / "cli_project" / "my_project"

CONFIG = """\
seed: 3
trainer:
  max_epochs: 4
  enable_model_summary: false
  enable_progress_bar: false
  num_sanity_val_steps: 0
  callbacks:
    - _target_: ember.callbacks.ModelCheckpoint
      monitor: val/acc
      mode: max
      save_top_k: 2
module:
  _target_: my_project.models.Net
  hidden: 8
data:
  _target_: my_project.models.Blobs
  n: 96
  batch_size: 16
optimizer:
  _target_: torch.optim.SGD
  lr: 0.2
"""


@pytest.fixture
def project(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[Path]:
    shutil.copytree(PROJECT, tmp_path / "my_project", ignore=shutil.ignore_patterns("__pycache__"))
    (tmp_path / "net.yaml").write_text(CONFIG)
    monkeypatch.setattr(sys, "path", list(sys.path))
    yield tmp_path
    for name in [m for m in sys.modules if m.startswith("my_project")]:
        del sys.modules[name]


def ember(capsys: pytest.CaptureFixture[str], *argv: str) -> tuple[int, str, str]:
    code = main(["-c" if a == "-C" else a for a in argv])
    out = capsys.readouterr()
    return code, out.out, out.err


def rows(run_dir: Path) -> list[dict[str, str]]:
    with open(run_dir / "metrics.csv", newline="") as f:
        return list(csv.DictReader(f))


def best_epoch(run_dir: Path) -> dict[str, str]:
    """The validation row with the highest val/acc (the first of equals, as ModelCheckpoint keeps it)."""
    val = [r for r in rows(run_dir) if r.get("val/acc")]
    return max(val, key=lambda r: float(r["val/acc"]))


def test_evaluation_writes_into_the_run_of_its_checkpoint(project: Path, capsys: pytest.CaptureFixture[str]) -> None:
    runs = project / "runs" / "net"
    assert ember(capsys, "fit", "-c", "net.yaml")[0] == 0  # version_0: the long run
    code, out, _ = ember(capsys, "fit", "-c", "net.yaml", "trainer.max_epochs=1")  # version_1: a short tweak
    assert code == 0 and "(1 epoch, 5 steps)" in out  # 72 training points / 16 -> 5 steps; "1 epoch", not "epochs"
    training_rows = rows(runs / "version_0")

    # `best` across runs: the newest run's best, and the message says so and how to choose another
    code, out, err = ember(capsys, "test", "-c", "net.yaml", "--ckpt-path", "best")
    assert code == 0, err
    best1 = best_epoch(runs / "version_1")
    (ckpt1,) = [p for p in (runs / "version_1" / "checkpoints").iterdir() if p.is_dir()]
    assert err.splitlines()[0] == (
        f"ember: test: loading the best checkpoint {Path('runs/net/version_1/checkpoints') / ckpt1.name} "
        f"(epoch {ckpt1.name.split('-')[0].removeprefix('epoch=')}, step 5, val/acc {float(best1['val/acc']):.4f}); "
        "'best' is taken from version_1, the newest of "
        f"the 2 runs under runs/net that has a checkpoint (choose another run with --run version_N)"
    )
    assert "resum" not in out + err
    assert sorted(p.name for p in runs.iterdir()) == ["version_0", "version_1"]  # no new version
    record = json.loads((runs / "version_1" / "eval" / f"test-{ckpt1.name}.json").read_text())
    assert record["metrics"]["test/acc"] == pytest.approx(float(best1["val/acc"]))  # test loader == val loader

    # --run version_0: that run's best, recorded in that run
    code, out, err = ember(capsys, "test", "-c", "net.yaml", "--ckpt-path", "best", "--run", "version_0")
    assert code == 0, err
    best0 = best_epoch(runs / "version_0")
    step = int(best0["step"]) + 1  # metrics.csv: optimizer step N's row is step N - 1 (Lightning's axis)
    name = f"epoch={int(best0['epoch'])}-step={step}"
    assert err.splitlines()[0] == (
        f"ember: test: loading {Path('runs/net/version_0/checkpoints') / name} "
        f"(epoch {int(best0['epoch'])}, step {step}, val/acc {float(best0['val/acc']):.4f})"
    )
    record = json.loads((runs / "version_0" / "eval" / f"test-{name}.json").read_text())
    assert record["checkpoint"] == str(Path("runs/net/version_0/checkpoints") / name)
    assert (record["epoch"], record["global_step"]) == (int(best0["epoch"]) + 1, step)
    assert record["monitored"] == {"val/acc": pytest.approx(float(best0["val/acc"]))}
    assert record["metrics"]["test/acc"] == pytest.approx(float(best0["val/acc"]))
    assert f"test/acc {record['metrics']['test/acc']:.4f}" in out and "run dir runs/net/version_0" in out

    # the run's own logs now hold the test metrics after every training row
    after = rows(runs / "version_0")
    assert [dict((k, v) for k, v in r.items() if v and k != "test/loss" and k != "test/acc") for r in after[:-1]] == [
        dict((k, v) for k, v in r.items() if v) for r in training_rows
    ]
    assert float(after[-1]["test/acc"]) == pytest.approx(record["metrics"]["test/acc"])
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    events = EventAccumulator(str(runs / "version_0" / "tensorboard"))
    events.Reload()
    assert {"val/acc", "test/acc"} <= set(events.Tags()["scalars"])  # one TensorBoard run: training and test
    assert events.Scalars("test/acc")[-1].value == pytest.approx(record["metrics"]["test/acc"])

    # validate and predict of `last` in a chosen run
    code, _, err = ember(capsys, "validate", "-c", "net.yaml", "--ckpt-path", "last", "--run", "version_0")
    assert code == 0 and err.startswith("ember: validate: loading runs/net/version_0/checkpoints/epoch=3-step=20 ")
    assert (runs / "version_0" / "eval" / "validate-epoch=3-step=20.json").is_file()
    code, out, _ = ember(capsys, "predict", "-c", "net.yaml", "--ckpt-path", "last", "--run", "version_0")
    saved = runs / "version_0" / "eval" / "predict-epoch=3-step=20.pt"
    assert code == 0 and out.strip().endswith(f"saved to {Path('runs/net/version_0/eval/predict-epoch=3-step=20.pt')}")
    assert [t.shape for t in torch.load(saved)] == [torch.Size([24, 3])]
    assert sorted(p.name for p in runs.iterdir()) == ["version_0", "version_1"]


def test_python_api_records_the_evaluation_too(project: Path) -> None:
    import warnings

    import ember

    sys.path.insert(0, str(project))
    from my_project.models import Blobs, Net  # type: ignore[import-not-found]

    def trainer() -> ember.Trainer:
        return ember.Trainer(max_epochs=2, enable_progress_bar=False, enable_model_summary=False, logger=False,
                             callbacks=[ember.callbacks.ModelCheckpoint(monitor="val/acc", mode="max")])  # fmt: skip

    module = Net(hidden=8)
    module.optimizer_config = {"optimizer": {"_target_": "torch.optim.SGD", "lr": 0.2}, "lr_scheduler": None}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        trainer().fit(module, datamodule=Blobs(n=64))
        (result,) = trainer().test(Net(hidden=8), datamodule=Blobs(n=64), ckpt_path="last")
    (record_path,) = (project / "runs" / "net" / "version_0" / "eval").iterdir()
    assert record_path.name == "test-epoch=1-step=6.json"
    assert json.loads(record_path.read_text())["metrics"] == pytest.approx(result)
    assert [p.name for p in (project / "runs" / "net").iterdir()] == ["version_0"]


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["test", "-C", "net.yaml", "--resume", "last"],
         "ember: error: ember test has no --resume option; --ckpt last (or best, or a checkpoint path) loads "
         "a checkpoint's weights"),
        (["predict", "-C", "net.yaml", "--resume=last"],
         "ember: error: ember predict has no --resume option; --ckpt last (or best, or a checkpoint path) "
         "loads a checkpoint's weights"),
        (["fit", "-C", "net.yaml", "--ckpt-path", "last"],
         "ember: error: ember fit has no --ckpt-path option; --ckpt last (or --resume last) continues "
         "training from a checkpoint"),
        (["fit", "-C", "net.yaml", "--run", "version_0"],
         "ember: error: ember fit has no --run option; --ckpt last continues the newest run; --ckpt PATH any "
         "checkpoint"),
        (["test", "-C", "net.yaml", "--run", "version_0"],
         "ember: error: --run: give --ckpt best or --ckpt last with it (a path names its run already)"),
        (["test", "-C", "net.yaml", "--ckpt-path", "last", "--run", "version_7"],
         "ember: error: --run version_7: no such run under runs/net (runs there: version_0)"),
    ],
)  # fmt: skip
def test_advice_names_the_option_the_subcommand_has(
    project: Path, capsys: pytest.CaptureFixture[str], argv: list[str], message: str
) -> None:
    (project / "runs" / "net" / "version_0").mkdir(parents=True)
    code, out, err = ember(capsys, *argv)
    assert (code, out, err.strip().splitlines()[-1]) == (2, "", message)
    assert "Traceback" not in err


def test_resuming_a_finished_run_says_there_is_nothing_to_do(project: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert ember(capsys, "fit", "-c", "net.yaml", "trainer.max_epochs=2")[0] == 0
    code, out, err = ember(capsys, "fit", "-c", "net.yaml", "trainer.max_epochs=2", "--resume", "last")
    assert code == 0, err
    assert "ember: this run already finished (2/2 epochs done); nothing to do" in err.splitlines()
    assert (
        out.strip()
        .splitlines()[-1]
        .endswith("(2 epochs, 10 steps): nothing to do, the run had finished already; run dir runs/net/version_0")
    )
    assert sorted(p.name for p in (project / "runs" / "net").iterdir()) == ["version_0"]
    code, _, err = ember(capsys, "fit", "-c", "net.yaml", "trainer.max_steps=10", "trainer.max_epochs=null",
                         "--resume", "last")  # fmt: skip
    assert code == 0 and "ember: this run already finished (step 10/10); nothing to do" in err.splitlines()


def test_version(capsys: pytest.CaptureFixture[str]) -> None:
    import ember as package

    with pytest.raises(SystemExit) as exit_info:
        main(["--version"])
    assert (exit_info.value.code, capsys.readouterr().out) == (0, f"ember {package.__version__}\n")


def test_one_checkpoint_option_everywhere(project: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """``--ckpt`` (last, best or a path) on every subcommand; ``--resume`` (fit) and ``--ckpt-path``
    (validate/test/predict, export) are other names of it and name the same checkpoint."""
    from ember.cli import build_parser

    parser = build_parser()
    for argv in (["fit", "--ckpt", "last"], ["fit", "--resume", "last"]):
        assert parser.parse_known_args(argv)[0].ckpt == "last"
    for command in ("validate", "test", "predict", "export"):
        required = ["--format", "onnx", "--out", "x"] if command == "export" else []
        for option in ("--ckpt", "--ckpt-path"):
            args, rest = parser.parse_known_args([command, option, "best", *required])
            assert (args.ckpt, rest) == ("best", [])
    assert ember(capsys, "fit", "-c", "net.yaml", "trainer.max_epochs=1")[0] == 0
    chosen = []
    for option in ("--ckpt", "--ckpt-path"):
        code, _, err = ember(capsys, "test", "-c", "net.yaml", option, "best")
        assert code == 0, err
        chosen.append([line for line in err.splitlines() if "loading the best checkpoint" in line])
    assert chosen[0] and chosen[0] == chosen[1]
