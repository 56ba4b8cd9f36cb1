"""Cold start: a 1-epoch fit in a fresh process, with the default logger and progress display and without.

    python benchmarks/cold_start.py                 # 9 processes of each, alternated
    python benchmarks/cold_start.py --repeats 1     # CI

Each process imports torch and ember, takes one raw optimizer step on a throwaway layer (torch's own
first-use costs, the same for any loop), then fits a tiny MLP for one epoch (64 batches, a validation at
the end; no checkpoint or summary in either variant). The defaults add TensorBoard and CSV logging
and the progress line. Reported as medians over the processes: the time from ``fit()`` to the first
training batch, and the whole ``fit()``; the difference between the variants is what the defaults
cost a short run. Each defaults process then imports ``torch.utils.tensorboard``, which TensorBoard
logging used to import at the first epoch end: the cost ember's own event writer avoids.

Goals: defaults - off <= 10 ms until the first batch, <= 60 ms for the whole 1-epoch fit.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]

CHILD = r"""
import time
start = time.perf_counter()
import json, sys, tempfile
import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset
import ember
imported = time.perf_counter()
torch.set_num_threads(1)
g = torch.Generator().manual_seed(0)
data = TensorDataset(torch.randn(2048, 32, generator=g), torch.randint(0, 2, (2048,), generator=g))
train = DataLoader(data, batch_size=32, shuffle=True, generator=g)
val = DataLoader(data, batch_size=256)

class Tiny(ember.TrainingModule):
    def __init__(self, lr: float = 0.01):
        super().__init__()
        self.save_hyperparameters()
        self.model = nn.Sequential(nn.Linear(32, 64), nn.ReLU(), nn.Linear(64, 2))
        self.loss_fn = nn.CrossEntropyLoss()
    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=self.hparams.lr)

# torch's own first-use costs, which any loop pays (the first optimizer imports torch._dynamo: ~1 s), out of the timing
warm = nn.Linear(2, 1)
torch.optim.SGD(warm.parameters(), lr=0.1).step()
warm(torch.ones(1, 2)).sum().backward()

marks = {}
class FirstBatch(ember.Callback):
    def on_train_batch_start(self, trainer, module, batch, batch_idx):
        marks.setdefault("first_batch", time.perf_counter())

defaults = sys.argv[1] == "defaults"
options = dict(enable_checkpointing=False, enable_model_summary=False, num_sanity_val_steps=0)
if not defaults:
    options.update(logger=False, enable_progress_bar=False)
trainer = ember.Trainer(max_epochs=1, default_root_dir=tempfile.mkdtemp(), callbacks=[FirstBatch()], **options)
module = Tiny()
fit_start = time.perf_counter()
trainer.fit(module, train, val)
fit_end = time.perf_counter()
out = {"import": imported - start, "to_first_batch": marks["first_batch"] - fit_start, "fit": fit_end - fit_start}
out["tensorboard_loaded"] = "torch.utils.tensorboard" in sys.modules
if defaults:
    before = time.perf_counter()
    import torch.utils.tensorboard
    out["tensorboard_import"] = time.perf_counter() - before
print(json.dumps(out))
"""


def run(mode: str) -> dict[str, float]:
    env = dict(os.environ, PYTHONPATH=f"{ROOT}{os.pathsep}{os.environ.get('PYTHONPATH', '')}")
    out = subprocess.run(
        [sys.executable, "-c", CHILD, mode], capture_output=True, text=True, env=env, cwd=ROOT, timeout=300
    )
    if out.returncode != 0:
        raise SystemExit(f"the {mode} process failed:\n{out.stderr[-3000:]}")
    result: dict[str, float] = json.loads(out.stdout.strip().splitlines()[-1])
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=9, help="processes of each variant")
    args = parser.parse_args()
    runs: dict[str, list[dict[str, float]]] = {"off": [], "defaults": []}
    for i in range(args.repeats):
        for mode in ("off", "defaults") if i % 2 == 0 else ("defaults", "off"):
            runs[mode].append(run(mode))

    def median(mode: str, key: str) -> float:
        return statistics.median(r[key] for r in runs[mode]) * 1e3

    print(f"{args.repeats} fresh processes of each variant, alternated; medians in ms")
    print(f"  {'':10s} {'import torch, ember':>20s} {'fit() to 1st batch':>19s} {'whole fit()':>12s}")
    for mode in runs:
        cells = [median(mode, k) for k in ("import", "to_first_batch", "fit")]
        print(f"  {mode:10s} {cells[0]:20.0f} {cells[1]:19.1f} {cells[2]:12.1f}")
    # Paired differences: process i of one variant against process i of the other (same moment, same load).
    first = statistics.median(
        (d["to_first_batch"] - o["to_first_batch"]) * 1e3 for d, o in zip(runs["defaults"], runs["off"], strict=True)
    )
    whole = statistics.median((d["fit"] - o["fit"]) * 1e3 for d, o in zip(runs["defaults"], runs["off"], strict=True))
    loaded = any(r["tensorboard_loaded"] for r in runs["defaults"])
    print(f"defaults - off (median of paired differences): first batch {first:+.1f} ms, whole fit {whole:+.1f} ms")
    print(
        f"torch.utils.tensorboard: {'imported' if loaded else 'not imported'} by the default fit; importing it "
        f"afterwards took {median('defaults', 'tensorboard_import'):.0f} ms (median)"
    )
    ok = first <= 10 and whole <= 60
    goals = f"first batch {first:+.1f} ms <= 10 ms, fit {whole:+.1f} ms <= 60 ms"
    print(f"verdict: {'meets' if ok else 'misses'} the goals ({goals})")


if __name__ == "__main__":
    main()
