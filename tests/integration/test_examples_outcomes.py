"""The examples reach their outcomes: each is built from its YAML config (shortened by overrides) and fitted.

The configs in configs/ are the 1-2 minute runs of examples/README.md; these tests shrink them
(fewer epochs or steps, a smaller model) to what still reaches the asserted outcome reliably with
the config's fixed seed. The runs go through the same code as ``ember fit`` (`ember.config` then
`ember.cli.build`), in this process.
"""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

import pytest
import torch

import ember
import examples.char_transformer
import examples.digits
import examples.gan
import examples.transfer
from ember import config
from ember.callbacks import BackboneFinetuning
from ember.cli import build

CONFIGS = Path(__file__).resolve().parents[2] / "configs"
QUIET = ["trainer.logger=false", "trainer.enable_progress_bar=false", "trainer.enable_model_summary=false"]


def from_config(
    root: Path, *names: str, overrides: tuple[str, ...] = ()
) -> tuple[ember.Trainer, ember.TrainingModule, Any]:
    """Trainer, module and data of ``ember fit -c configs/<name>.yaml ... <overrides>``, runs under `root`."""
    files = [CONFIGS / f"{name}.yaml" for name in names]
    loaded = config.load(files, [*overrides, *QUIET, f"trainer.default_root_dir={root}"])
    resolved = config.resolve(loaded)
    config.check(loaded, resolved, "fit")
    return build(resolved)


@pytest.mark.slow
def test_digits_cnn_reaches_97_percent(tmp_path: Path) -> None:
    trainer, module, data = from_config(
        tmp_path, "digits_cnn", overrides=("trainer.max_epochs=5", "module.width=16", "trainer.callbacks=[]")
    )
    assert isinstance(module, examples.digits.CNNClassifier)
    trainer.fit(module, datamodule=data)
    assert trainer.global_step == 5 * 19  # 1,169 training images in batches of 64 (the test split is held out)
    assert trainer.callback_metrics["val/acc"] >= 0.97


@pytest.mark.slow
def test_char_transformer_beats_the_unigram_entropy_by_half_a_nat(tmp_path: Path) -> None:
    trainer, module, data = from_config(
        tmp_path,
        "char_transformer",
        overrides=(
            "trainer.max_steps=120",
            "trainer.enable_checkpointing=false",
            "data.max_bytes=200000",
            "data.seq_len=64",
            "module.d_model=64",
            "module.n_layers=2",
            "module.lr=1e-2",
            "module.warmup_steps=20",
        ),
    )
    assert isinstance(data, examples.char_transformer.StdlibText)
    trainer.fit(module, datamodule=data)
    entropy = data.unigram_entropy("val")
    assert 2.0 < entropy < 4.0  # Python source: about 3 nats per byte
    val_loss = trainer.callback_metrics["val/loss"]
    assert val_loss <= entropy - 0.5, f"val/loss {val_loss:.3f}, unigram entropy {entropy:.3f}"
    assert trainer.callback_metrics["val/ppl"] == pytest.approx(math.exp(val_loss), rel=1e-4)

    # Sampling continues a prompt with the requested number of bytes.
    assert isinstance(module, examples.char_transformer.CharTransformer)
    prompt = examples.char_transformer.encode("def ")
    out = module.eval().generate(prompt[None], 20, generator=torch.Generator().manual_seed(0))
    assert out.shape == (1, 24) and torch.equal(out[0, :4], prompt)


@pytest.mark.slow
def test_finetuning_beats_training_from_scratch_on_the_small_target_set(tmp_path: Path) -> None:
    trainer, module, data = from_config(tmp_path, "transfer_pretrain", overrides=("trainer.max_epochs=15",))
    trainer.fit(module, datamodule=data)
    assert trainer.callback_metrics["val/acc"] >= 0.98  # digits 0-4
    assert (tmp_path / "transfer_pretrain" / "backbone.pt").is_file()

    trainer, module, data = from_config(tmp_path, "transfer_finetune")
    trainer.fit(module, datamodule=data)
    assert len(data.train_set) == 25  # 5 images of each digit 5-9
    finetuned = trainer.callback_metrics["val/acc"]
    (callback,) = [cb for cb in trainer.callbacks if isinstance(cb, BackboneFinetuning)]
    assert callback.unfrozen_at_epoch == 17
    head_lr, backbone_lr = (g["lr"] for g in trainer.optimizers[0].param_groups)
    assert backbone_lr == pytest.approx(0.3 * head_lr)  # the cosine schedule kept the ratio

    trainer, module, data = from_config(tmp_path, "transfer_finetune", "transfer_scratch")
    trainer.fit(module, datamodule=data)
    scratch = trainer.callback_metrics["val/acc"]
    assert len(trainer.optimizers[0].param_groups) == 1
    assert finetuned >= scratch + 0.01, f"fine-tuned {finetuned:.3f}, from scratch {scratch:.3f}"


@pytest.mark.slow
def test_gan_samples_move_toward_the_target(tmp_path: Path) -> None:
    trainer, module, data = from_config(
        tmp_path, "gan", overrides=("trainer.max_epochs=10", "trainer.enable_checkpointing=false")
    )
    assert isinstance(module, examples.gan.GAN)
    data.setup("fit")
    (real,) = data.val_set.tensors
    noise = torch.randn(len(real), module.hparams.latent_dim, generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        before = float(examples.gan.sliced_wasserstein(module(noise), real, module.directions))
    trainer.fit(module, datamodule=data)
    after = trainer.callback_metrics["val/swd"]  # validation uses the same noise
    assert trainer.global_step == 10 * 64 * 2  # 8,192 points in batches of 128, two optimizer steps each
    assert after < 0.3 * before, f"sliced Wasserstein distance {before:.3f} -> {after:.3f}"
    assert {"train/d_loss", "train/g_loss"} <= trainer.callback_metrics.keys()
