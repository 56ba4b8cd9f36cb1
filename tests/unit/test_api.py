"""The public surface: `ember.__all__`, and what `import ember` pulls in."""

from __future__ import annotations

import json
import subprocess
import sys

import ember


def test_public_api_is_explicit() -> None:
    assert sorted(ember.__all__) == sorted(
        ["Callback", "DataModule", "Trainer", "TrainingModule", "__version__", "seed_everything"]
    )
    for name in ember.__all__:
        assert getattr(ember, name) is not None
    assert isinstance(ember.__version__, str) and ember.__version__.count(".") == 2


def test_import_ember_leaves_heavy_optional_modules_alone() -> None:
    code = (
        "import sys, json, ember; "
        "print(json.dumps([m for m in ('tensorboard', 'wandb', 'rich', 'torchmetrics', 'omegaconf', 'sklearn') "
        "if m in sys.modules]))"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert json.loads(out.stdout) == []


def test_seed_everything_makes_draws_repeat() -> None:
    import random

    import numpy as np
    import torch

    assert ember.seed_everything(7) == 7
    first = (random.random(), float(np.random.rand()), torch.rand(3))
    ember.seed_everything(7)
    second = (random.random(), float(np.random.rand()), torch.rand(3))
    assert first[0] == second[0] and first[1] == second[1]
    assert torch.equal(first[2], second[2])
