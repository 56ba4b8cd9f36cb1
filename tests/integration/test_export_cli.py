"""``ember export`` end to end: a digits run trained by ``ember fit``, exported from its checkpoint.

One short fit (module fixture) provides the checkpoint; exports run in-process through
`ember.cli.main`, the code behind the console script (tests/integration/test_cli.py runs real
``ember`` processes), without an interpreter start-up per test.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

import ember
from ember import checkpoint as ckpt_files
from ember.cli import main
from examples.digits import Classifier, DigitsData

pytestmark = pytest.mark.filterwarnings(
    "ignore:`torch.jit.* is deprecated",
    "ignore:`isinstance\\(treespec, LeafSpec\\)` is deprecated",
    "ignore:This property will be removed",
)

pytest.importorskip("onnxruntime", reason="ONNX checks need onnxruntime: pip install 'ember[export]'")
pytest.importorskip("onnxscript", reason="ONNX export needs onnxscript: pip install 'ember[export]'")

REPO = Path(__file__).resolve().parents[2]
DIGITS = REPO / "configs" / "digits.yaml"
QUICK = [
    "trainer.max_epochs=1",
    "trainer.limit_train_batches=2",
    "trainer.limit_val_batches=1",
    "trainer.num_sanity_val_steps=0",
    "trainer.logger=false",
    "trainer.enable_progress_bar=false",
    "trainer.enable_model_summary=false",
]


@pytest.fixture(scope="module")
def run(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The runs folder of one ``ember fit -c configs/digits.yaml`` (1 epoch, 2 steps)."""
    root = tmp_path_factory.mktemp("digits")
    with pytest.MonkeyPatch.context() as mp:
        mp.chdir(root)
        assert main(["fit", "-c", str(DIGITS), *QUICK, f"trainer.default_root_dir={root / 'runs'}"]) == 0
    return root / "runs"


def checkpoint_of(runs: Path) -> Path:
    folder = runs / "classifier" / "version_0" / "checkpoints"
    return folder / (folder / "last").read_text().strip()


def digits_images(batch: int) -> torch.Tensor:
    data = DigitsData()
    data.setup("validate")
    images: torch.Tensor = next(iter(data.val_dataloader()))[0][:batch]
    return images


@pytest.mark.slow  # 3 s of CPU on a 2-core machine, with the processes it starts
def test_export_last_to_onnx_matches_the_checkpoint(
    run: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    import onnxruntime as ort

    out = tmp_path / "exports"
    code = main(["export", "--ckpt", "last", "-c", str(DIGITS), f"trainer.default_root_dir={run}", "--format", "onnx",
                 "--out", str(out)])  # fmt: skip
    captured = capsys.readouterr()
    assert code == 0, captured.err
    ckpt = checkpoint_of(run)
    line = captured.out.strip().splitlines()[-1]
    assert line.startswith("export done in ") and f"{out / 'classifier.onnx'} from {ckpt}" in line
    # Classifier has no example_input_array: 4 images of DigitsData's predict batch, then twice that
    assert line.endswith("at batch 4, " + line.split(", ")[-1]) and "at batch 8)" in line
    # the module is built from the -c config; the recorded config (epochs=1) is data, compared and reported
    assert (
        "module.epochs: the checkpoint was trained with 1, the config says 20; using the config's "
        "(the checkpoint's is not used)"
    ) in captured.err
    assert sorted(p.name for p in out.iterdir()) == ["classifier.onnx"]

    trained = Classifier.load_from_checkpoint(ckpt)
    session = ort.InferenceSession(str(out / "classifier.onnx"), providers=["CPUExecutionProvider"])
    for batch in (1, 7):
        x = digits_images(batch)
        (got,) = session.run(None, {"input": x.numpy()})
        with torch.no_grad():
            torch.testing.assert_close(torch.from_numpy(got), trained(x), atol=1e-5, rtol=1e-4)


def test_export_a_checkpoint_path_without_a_config(
    run: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """Without -c, only --trust-checkpoint rebuilds the module and the data from the config saved in it."""
    ckpt = checkpoint_of(run)
    argv = ["export", "--ckpt", str(ckpt), "--format", "torchscript", "--method", "trace",
            "--out", str(tmp_path / "out"), "--name", "digits"]  # fmt: skip
    assert main(argv) == 2  # a checkpoint is data: without the opt-in nothing it names is imported
    assert "--trust-checkpoint" in capsys.readouterr().err
    assert not (tmp_path / "out").exists()
    code = main([*argv, "--trust-checkpoint"])
    captured = capsys.readouterr()
    assert code == 0, captured.err
    assert "ember: note" not in captured.err
    assert captured.out.strip().splitlines()[-1].endswith("(checked: max abs diff 0 at batch 4)")
    loaded = torch.jit.load(str(tmp_path / "out" / "digits.torchscript.pt"))
    trained = Classifier.load_from_checkpoint(ckpt)
    x = digits_images(9)
    with torch.no_grad():
        torch.testing.assert_close(loaded(x), trained(x), atol=1e-6, rtol=1e-5)


def test_export_to_torchserve_names_the_archive_after_the_run(run: Path, tmp_path: Path) -> None:
    from ember.export import read_manifest

    pytest.importorskip("model_archiver", reason="TorchServe export needs torch-model-archiver")
    code = main(["export", "--ckpt", str(run / "classifier" / "version_0" / "checkpoints" / "last"),
                 "--trust-checkpoint", "--format", "torchserve", "--out", str(tmp_path)])  # fmt: skip
    assert code == 0
    assert read_manifest(tmp_path / "classifier.mar")["model"]["modelName"] == "classifier"


# --- bad input: one line, exit code 2, nothing written ---------------------------------------------------------


def test_an_unsupported_format_is_a_usage_error(run: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as info:
        main(["export", "--ckpt", "last", "-c", str(DIGITS), "--format", "tflite", "--out", str(tmp_path / "x")])
    assert info.value.code == 2
    err = capsys.readouterr().err.strip().splitlines()[-1]
    # argparse quotes the choices on some Python versions and not on others
    assert err.replace("'", "") == (
        "ember export: error: argument --format: invalid choice: tflite "
        "(choose from onnx, torchscript, torch-export, safetensors, torchserve, hf)"
    )
    assert not (tmp_path / "x").exists()


def test_a_checkpoint_of_another_module_than_the_config_is_one_error(
    run: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    code = main(["export", "--ckpt", "last", "-c", str(DIGITS), f"trainer.default_root_dir={run}",
                 "module._target_=examples.digits.CNNClassifier", "trainer.run_name=classifier",
                 "--format", "onnx", "--out", str(tmp_path / "x")])  # fmt: skip
    assert code == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1
    assert err[0] == (
        f"ember: error: checkpoint {checkpoint_of(run)} holds a examples.digits.Classifier module, but the config "
        "builds examples.digits.CNNClassifier; give a checkpoint of this config's module, or the config it was "
        "trained with"
    )
    assert not (tmp_path / "x").exists()


@pytest.fixture
def python_api_checkpoint(tmp_path: Path) -> Path:
    """A checkpoint written by `Trainer.fit` from Python: no saved config, a Classifier(hidden=8)."""
    data = DigitsData()
    trainer = ember.Trainer(max_epochs=1, limit_train_batches=1, limit_val_batches=1, num_sanity_val_steps=0,
                            logger=False, enable_progress_bar=False, enable_model_summary=False,
                            default_root_dir=str(tmp_path / "runs"))  # fmt: skip
    trainer.fit(Classifier(hidden=8), datamodule=data)
    return checkpoint_of(tmp_path / "runs")


def test_weights_that_do_not_fit_the_config_are_one_error(
    python_api_checkpoint: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    code = main(["export", "--ckpt", str(python_api_checkpoint), "-c", str(DIGITS), "--format", "safetensors",
                 "--out", str(tmp_path / "x")])  # fmt: skip
    assert code == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1
    assert err[0] == (
        f"ember: error: checkpoint {python_api_checkpoint}: model.1.weight has shape (8, 64), the module expects "
        "(128, 64); it was trained with other module settings: add the override(s) module.hidden=8"
    )
    assert not (tmp_path / "x").exists()


def test_a_module_without_an_example_input_and_no_data_is_one_error(
    python_api_checkpoint: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    # no -c: built from the class named with --module and the checkpoint's hparams, with no data to take a batch from
    code = main(["export", "--ckpt", str(python_api_checkpoint), "--module", "examples.digits.Classifier",
                 "--format", "onnx", "--out", str(tmp_path / "x")])  # fmt: skip
    assert code == 2
    assert capsys.readouterr().err.strip().splitlines() == [
        "ember: error: Classifier has no example_input_array and there is no data section to take a batch from; "
        "set self.example_input_array in __init__ (e.g. torch.zeros(2, 64)), or give the run's config with -c"
    ]
    assert not (tmp_path / "x").exists()


def test_last_without_a_run_or_without_a_config_is_one_error(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    code = main(["export", "--ckpt", "last", "-c", str(DIGITS), f"trainer.default_root_dir={tmp_path / 'none'}",
                 "--format", "onnx", "--out", str(tmp_path / "x")])  # fmt: skip
    assert code == 2
    assert capsys.readouterr().err.strip() == (
        f"ember: error: --ckpt last: no complete checkpoint under {tmp_path / 'none' / 'classifier'}; "
        "train first (ember fit) or give a path"
    )
    assert main(["export", "--ckpt", "last", "--format", "onnx", "--out", str(tmp_path / "x")]) == 2
    assert capsys.readouterr().err.strip() == (
        "ember: error: --ckpt last: give the run's config with -c FILE (it names the run), or a checkpoint path"
    )


def test_export_best_names_the_checkpoint_its_model_checkpoint_recorded(
    run: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """``--ckpt best`` (or its other name ``--ckpt-path``), as for test/predict: what ModelCheckpoint recorded."""
    best = ckpt_files.find_best([], run / "classifier")
    for option in ("--ckpt", "--ckpt-path"):
        code = main(["export", option, "best", "-c", str(DIGITS), f"trainer.default_root_dir={run}",
                     "--format", "safetensors", "--out", str(tmp_path / option)])  # fmt: skip
        captured = capsys.readouterr()
        assert code == 0, captured.err
        assert f" from {best} (checked" in captured.out.strip().splitlines()[-1]
