"""Hugging Face transformers inside a TrainingModule: examples/hf_lm.py trains from its config, ``ember export
--format hf`` writes a ``save_pretrained`` directory, and ``AutoModelForCausalLM.from_pretrained`` of it gives the
ember module's logits; bits per byte against a direct computation; the export's refusals.

The runs are shrunk (a 1-layer model on 40 kB of text, a few steps): what is tested is the round trip, not
the language model (examples/README.md has the measured full runs).
"""

from __future__ import annotations

import math
import os
import subprocess
import sys
from collections import Counter
from pathlib import Path
from typing import Any

import pytest
import torch
from torch import nn

pytest.importorskip("transformers", reason="the hf tests need transformers: pip install 'ember[hf]'")

import transformers

import ember
from ember import config
from ember.cli import build
from ember.export import ExportError, export_hf
from examples import hf_lm

REPO = Path(__file__).resolve().parents[2]
CONFIG = REPO / "configs" / "hf_lm.yaml"
TINY = [
    "data.vocab_size=384",
    "data.max_bytes=40000",
    "data.seq_len=32",
    "module.n_embd=32",
    "module.n_head=2",
    "module.n_layer=1",
    "trainer.max_steps=3",
    "trainer.limit_val_batches=2",
    "trainer.num_sanity_val_steps=0",
    "trainer.precision=32-true",
    "trainer.logger=false",
    "trainer.enable_progress_bar=false",
    "trainer.enable_model_summary=false",
]


def ember_command(*args: str, cwd: Path) -> subprocess.CompletedProcess[str]:
    env = dict(os.environ, PYTHONPATH=str(REPO), WANDB_MODE="offline", HF_HUB_OFFLINE="1")
    return subprocess.run(
        [sys.executable, "-m", "ember", *args], cwd=cwd, env=env, capture_output=True, text=True, timeout=300
    )


@pytest.fixture(scope="module")
def trained(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, hf_lm.GPT2LM, Path]:
    """(working dir, the module after ``ember fit -c configs/hf_lm.yaml`` + TINY, its last checkpoint)."""
    cwd = tmp_path_factory.mktemp("hf_lm")
    loaded = config.load([CONFIG], [*TINY, f"trainer.default_root_dir={cwd / 'runs'}"])
    resolved = config.resolve(loaded)
    config.check(loaded, resolved, "fit")
    trainer, module, data = build(resolved)
    assert isinstance(module, hf_lm.GPT2LM)
    trainer.fit(module, datamodule=data)
    assert trainer.global_step == 3
    last = trainer.run_dir / "checkpoints" / (trainer.run_dir / "checkpoints" / "last").read_text().strip()
    return cwd, module.eval(), last


@pytest.mark.slow
def test_export_hf_round_trip_gives_the_ember_modules_logits(
    trained: tuple[Path, hf_lm.GPT2LM, Path], tmp_path: Path
) -> None:
    cwd, module, last = trained
    out = ember_command(
        "export", "--ckpt", str(last), "-c", str(CONFIG), *TINY, "--format", "hf", "--out", str(tmp_path), cwd=cwd
    )
    assert out.returncode == 0, out.stderr
    assert "export done in" in out.stdout and str(tmp_path / "hf_lm") in out.stdout
    directory = tmp_path / "hf_lm"
    assert {"config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json"} <= {
        p.name for p in directory.iterdir()
    }
    assert [p.name for p in tmp_path.iterdir()] == ["hf_lm"]  # no staging folder left behind

    hf_model = transformers.AutoModelForCausalLM.from_pretrained(directory, local_files_only=True).eval()
    assert type(hf_model).__name__ == "GPT2LMHeadModel"
    generator = torch.Generator().manual_seed(1)
    tokens = torch.randint(0, 384, (3, 32), generator=generator)
    with torch.no_grad():
        theirs = hf_model(input_ids=tokens).logits
        ours = module(tokens)  # the module fit just trained, in this process
    assert theirs.shape == (3, 32, 384)
    assert float((theirs - ours).abs().max()) <= 1e-6

    # The checkpoint's weights are the trained module's; the tokenizer is the one it was trained with.
    reloaded = hf_lm.GPT2LM.load_from_checkpoint(last)
    for key, value in module.state_dict().items():
        assert torch.equal(reloaded.state_dict()[key], value), key
    tokenizer = transformers.AutoTokenizer.from_pretrained(directory, local_files_only=True)
    text = "def f(x):\n    return x + 1\n"
    assert tokenizer(text)["input_ids"] == module.tokenizer(text)["input_ids"]
    assert tokenizer.decode(tokenizer(text)["input_ids"]) == text
    assert tokenizer.eos_token == hf_lm.EOT == tokenizer.pad_token


def test_to_hf_checks_and_replaces_an_earlier_export(trained: tuple[Path, hf_lm.GPT2LM, Path], tmp_path: Path) -> None:
    _, module, _ = trained
    target = tmp_path / "lm"
    result = module.to_hf(target)
    assert result.format == "hf" and result.path == target
    assert [c.max_abs_diff for c in result.checks] == [0.0, 0.0]  # the model, and the module's own forward
    (target / "stale.txt").write_text("from an earlier export")
    module.to_hf(target)
    assert not (target / "stale.txt").exists()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["lm"]
    weights = transformers.GPT2LMHeadModel.from_pretrained(target, local_files_only=True).state_dict()
    assert torch.equal(weights["transformer.h.0.mlp.c_fc.weight"], module.model.transformer.h[0].mlp.c_fc.weight)


def test_a_failed_check_leaves_nothing_behind(
    trained: tuple[Path, hf_lm.GPT2LM, Path], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    _, module, _ = trained
    original = transformers.GPT2LMHeadModel.from_pretrained

    def perturbed(*args: Any, **kwargs: Any) -> Any:
        model = original(*args, **kwargs)
        with torch.no_grad():
            model.transformer.ln_f.bias.add_(1e-3)
        return model

    monkeypatch.setattr(transformers.GPT2LMHeadModel, "from_pretrained", perturbed)
    with pytest.raises(ExportError, match=r"hf export check failed: .*transformer\.ln_f\.bias differs"):
        module.to_hf(tmp_path / "lm")
    assert list(tmp_path.iterdir()) == []


def test_modules_without_one_transformers_model_are_refused(tmp_path: Path) -> None:
    class Plain(ember.TrainingModule):
        def __init__(self) -> None:
            super().__init__()
            self.model = nn.Linear(2, 2)

    with pytest.raises(ExportError, match="holds no Hugging Face transformers model"):
        export_hf(Plain(), tmp_path / "x")

    config = transformers.GPT2Config(
        vocab_size=16, n_embd=8, n_layer=1, n_head=2, n_positions=8, bos_token_id=0, eos_token_id=0
    )

    class Two(ember.TrainingModule):
        def __init__(self) -> None:
            super().__init__()
            self.a = transformers.GPT2LMHeadModel(config)
            self.b = transformers.GPT2LMHeadModel(config)

    with pytest.raises(ExportError, match=r"several transformers models \(a, b\)"):
        export_hf(Two(), tmp_path / "x")

    class Wrapped(ember.TrainingModule):
        def __init__(self) -> None:
            super().__init__()
            self.inner = nn.ModuleDict({"lm": transformers.GPT2LMHeadModel(config)})

    (tmp_path / "file").write_text("not an export")
    with pytest.raises(ExportError, match="exists and is not a Hugging Face export directory"):
        export_hf(Wrapped(), tmp_path / "file")
    result = export_hf(Wrapped(), tmp_path / "found")  # the one model, found below the top level
    assert result.checks[0].max_abs_diff == 0.0 and (tmp_path / "found" / "model.safetensors").is_file()
    assert not (tmp_path / "found" / "tokenizer.json").exists()  # no tokenizer to write


def test_bits_per_byte_is_summed_nats_over_summed_bytes() -> None:
    generator = torch.Generator().manual_seed(0)
    token_bytes = torch.tensor([0, 1, 2, 3, 4])
    metric = hf_lm.BitsPerByte()
    total_nats, total_bytes = 0.0, 0
    for rows in (2, 5):  # unequal batches: a mean of per-batch ratios would differ
        logits = torch.randn(rows, 6, 5, generator=generator)
        targets = torch.randint(0, 5, (rows, 6), generator=generator)
        metric.update(logits, targets, token_bytes)
        log_probs = torch.log_softmax(logits.double(), dim=-1)
        total_nats -= float(log_probs.gather(-1, targets.unsqueeze(-1)).sum())
        total_bytes += int(token_bytes[targets].sum())
    assert float(metric.compute()) == pytest.approx(total_nats / total_bytes / math.log(2), rel=1e-6)


def test_token_byte_lengths_add_up_to_the_text(trained: tuple[Path, hf_lm.GPT2LM, Path]) -> None:
    _, module, _ = trained
    text = 'class A:\n    """Dœc ✓."""\n    x = {"k": [1, 2]}\n'
    ids = module.tokenizer(text)["input_ids"]
    assert int(module.token_bytes[ids].sum()) == len(text.encode("utf-8"))
    assert int(module.token_bytes[module.tokenizer.convert_tokens_to_ids(hf_lm.EOT)]) == 0


def test_weights_of_another_tokenizer_are_refused(trained: tuple[Path, hf_lm.GPT2LM, Path]) -> None:
    _, module, last = trained
    module.check_tokenizer()  # its own: fine
    other = hf_lm.GPT2LM.load_from_checkpoint(last)
    other.tokenizer_sha256.zero_()
    with pytest.raises(RuntimeError, match="trained with another tokenizer"):
        other.check_tokenizer()


# --- examples/hf_classify.py: fine-tuning from the exported directory -------------------------------------------

CLASSIFY = REPO / "configs" / "hf_classify.yaml"


def classify_from_config(model_dir: Path, root: Path, *extra: str) -> tuple[ember.Trainer, Any, Any]:
    overrides = [
        f"module.model_dir={model_dir}",
        "data.train_per_class=8",
        "data.val_per_class=16",
        "data.max_tokens=16",
        "data.batch_size=16",
        "trainer.max_epochs=1",
        "trainer.num_sanity_val_steps=0",
        "trainer.logger=false",
        "trainer.enable_progress_bar=false",
        "trainer.enable_model_summary=false",
        f"trainer.default_root_dir={root}",
        *extra,
    ]
    files = [CLASSIFY, REPO / "configs" / "hf_classify_scratch.yaml"] if "scratch" in extra else [CLASSIFY]
    loaded = config.load(files, [o for o in overrides if o != "scratch"])
    resolved = config.resolve(loaded)
    config.check(loaded, resolved, "fit")
    return build(resolved)


def test_fine_tuning_starts_from_the_exported_weights_and_logs_macro_f1(
    trained: tuple[Path, hf_lm.GPT2LM, Path], tmp_path: Path
) -> None:
    from sklearn.metrics import f1_score

    _, lm, _ = trained
    lm.to_hf(tmp_path / "pretrained")
    trainer, module, data = classify_from_config(tmp_path / "pretrained", tmp_path / "runs")
    _, scratch, _ = classify_from_config(tmp_path / "pretrained", tmp_path / "runs", "scratch")
    key = "transformer.h.0.attn.c_attn.weight"
    assert torch.equal(module.model.state_dict()[key], lm.model.state_dict()[key])  # from_pretrained
    assert not torch.equal(scratch.model.state_dict()[key], lm.model.state_dict()[key])  # random weights
    assert scratch.model.config.n_embd == module.model.config.n_embd == 32  # ... of the same network

    trainer.fit(module, datamodule=data)
    assert trainer.global_step == 4  # 8 modules x 8 lines in batches of 16
    input_ids, attention_mask, labels = data.val_set.tensors
    with torch.no_grad():
        predicted = module.eval()(input_ids, attention_mask).argmax(-1)
    expected = f1_score(labels.numpy(), predicted.numpy(), average="macro", labels=list(range(8)), zero_division=0)
    assert trainer.callback_metrics["val/f1"] == pytest.approx(expected, abs=1e-6)
    assert trainer.callback_metrics["val/acc"] == pytest.approx(float((predicted == labels).float().mean()), abs=1e-6)


def test_lines_are_labelled_by_one_module_and_split_the_same_way_every_time() -> None:
    from examples import hf_classify

    per_module = hf_classify.labelled_lines(hf_classify.DEFAULT_MODULES)
    seen: dict[str, int] = {}
    for label, lines in enumerate(per_module):
        assert len(lines) >= 192 and len(set(lines)) == len(lines)
        for line in lines:
            assert len(line) >= 12 and line == line.strip()
            assert seen.setdefault(line, label) == label  # no line in two modules
    train, val = hf_classify.split_lines(per_module, 64, 128, seed=0)
    assert hf_classify.split_lines(per_module, 64, 128, seed=0) == (train, val)
    assert Counter(label for _, label in train) == {label: 64 for label in range(8)}
    assert Counter(label for _, label in val) == {label: 128 for label in range(8)}
    assert not {line for line, _ in train} & {line for line, _ in val}


def test_classifier_mistakes_say_what_to_do(tmp_path: Path) -> None:
    from examples import hf_classify

    with pytest.raises(FileNotFoundError, match=r"ember export --ckpt last -c configs/hf_lm.yaml --format hf"):
        hf_classify.LineClassifier(model_dir=str(tmp_path / "missing"))
    with pytest.raises(FileNotFoundError, match="no standard-library module"):
        hf_classify.labelled_lines(["no_such_module_here"])


@pytest.mark.slow  # 3 s of CPU on a 2-core machine, with the processes it starts
def test_the_seed_sweep_prints_both_runs_per_seed_and_their_means(
    trained: tuple[Path, hf_lm.GPT2LM, Path], tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    from examples import hf_classify

    _, lm, _ = trained
    lm.to_hf(tmp_path / "pretrained")
    args = ["--seeds", "0", "1", "--model-dir", str(tmp_path / "pretrained"), "--epochs", "1"]
    hf_classify.main([*args, "--train-per-class", "4", "--modules", "tarfile", "typing"])
    lines = capsys.readouterr().out.splitlines()
    assert lines[0] == "| seed (val/f1) | pretrained, lr 0.001 | from scratch, lr 0.001 |"
    rows = {line.split("|")[1].strip(): [float(v) for v in line.split("|")[2:-1]] for line in lines[2:5]}
    assert set(rows) == {"0", "1", "mean"}
    for column in range(2):
        assert 0.0 <= rows["0"][column] <= 1.0
        assert rows["mean"][column] == pytest.approx((rows["0"][column] + rows["1"][column]) / 2, abs=1e-4)
    assert lines[5].startswith("4 fits in ")
