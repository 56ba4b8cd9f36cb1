"""A new user's first mistakes at the ``ember`` command: each is one line, exit 2, before anything is built."""

from __future__ import annotations

from pathlib import Path

import pytest

from ember.cli import main
from ember.trainer import options

REPO = Path(__file__).resolve().parents[2]


@pytest.mark.parametrize("command", ["fit", "validate", "test", "predict"])
def test_no_config_says_so_with_a_usage_example(
    command: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.chdir(tmp_path)
    assert main([command]) == 2
    err = capsys.readouterr().err.strip()
    assert err == (
        f"ember: error: no config given; name one with -c, e.g. `ember {command} -c configs/digits.yaml` "
        "(docs/your-data.md writes one for your data)"
    )
    assert list(tmp_path.iterdir()) == []  # nothing built, no run directory


def test_a_module_given_by_overrides_alone_is_still_a_config(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.chdir(tmp_path)
    assert main(["fit", "module._target_=examples.digits.Classifier", "--print-config"]) == 2
    err = capsys.readouterr().err
    assert "no config given" not in err and "data: missing required value" in err  # the next thing missing


@pytest.mark.parametrize(("given", "normalised"), [("gpu", "cuda"), ("cuda", "cuda"), ("cpu", "cpu"), ("auto", "auto")])
def test_lightnings_gpu_is_an_accelerator_name(given: str, normalised: str) -> None:
    assert options.build({"accelerator": given}).accelerator == normalised


def test_an_unknown_accelerator_lists_the_names(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    config = tmp_path / "c.yaml"
    config.write_text((REPO / "configs" / "digits.yaml").read_text())
    assert main(["fit", "-c", str(config), "trainer.accelerator=tpu", f"trainer.default_root_dir={tmp_path}"]) == 2
    err = capsys.readouterr().err.strip()
    assert err.endswith("accelerator='tpu' is not valid; choose one of: auto, cpu, cuda ('gpu' is 'cuda')"), err
