"""Cold start: with the default logger and progress display, a fit's first batch waits for no slow import.

The loggers write their files later (TensorBoard's protocol buffers at the first flush, ``hparams.yaml``
with the first CSV rows), so a fresh process reaches its first training batch without importing
omegaconf or TensorBoard (and a fit from Python never imports omegaconf); the files are complete when the
fit returns. (benchmarks/cold_start.py
measures the time; this checks the order.)
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]

CHILD = r"""
import json, sys
import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset
import ember

class Tiny(ember.TrainingModule):
    def __init__(self, lr: float = 0.1):
        super().__init__()
        self.save_hyperparameters()
        self.model, self.loss_fn = nn.Linear(4, 2), nn.CrossEntropyLoss()
    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=self.hparams.lr)

SLOW = ("omegaconf", "tensorboard", "torch.utils.tensorboard", "google.protobuf")
seen = {}
class FirstBatch(ember.Callback):
    def on_train_batch_start(self, trainer, module, batch, batch_idx):
        if not seen:
            seen.update({name: name in sys.modules for name in SLOW})

data = DataLoader(TensorDataset(torch.randn(16, 4), torch.randint(0, 2, (16,))), batch_size=4)
trainer = ember.Trainer(
    max_epochs=1, default_root_dir=sys.argv[1], callbacks=[FirstBatch()], enable_checkpointing=False
)
trainer.fit(Tiny(), data, data)
print(json.dumps({"at_first_batch": seen, "omegaconf_at_end": "omegaconf" in sys.modules,
                  "run_dir": str(trainer.run_dir)}))
"""


@pytest.mark.slow  # 3 s of CPU on a 2-core machine, with the processes it starts
def test_the_first_batch_waits_for_no_logger_import(tmp_path: Path) -> None:
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    out = subprocess.run(
        [sys.executable, "-c", CHILD, str(tmp_path)], capture_output=True, text=True, env=env, timeout=120
    )
    assert out.returncode == 0, out.stderr[-3000:]
    result = json.loads(out.stdout.strip().splitlines()[-1])
    assert result["at_first_batch"] == {
        "omegaconf": False,
        "tensorboard": False,
        "torch.utils.tensorboard": False,
        "google.protobuf": False,
    }
    assert result["omegaconf_at_end"] is False  # hparams.yaml is written with PyYAML alone (about 40 ms less)
    run_dir = Path(result["run_dir"])
    assert (run_dir / "hparams.yaml").read_text() == "lr: 0.1\n"
    assert (run_dir / "metrics.csv").read_text().startswith("step,")
    assert list((run_dir / "tensorboard").glob("events.out.tfevents.*"))
