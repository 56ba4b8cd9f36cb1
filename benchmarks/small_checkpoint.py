"""What a checkpoint of a small state costs the training loop: ember's save against dcp.save and torch.save.

Frequent checkpoints of small models (a save every epoch of a short epoch, or
every N steps) pay a fixed cost per save and per tensor, not per byte. Two
states, each with its SGD-momentum or AdamW state after one step:

- tiny: the overhead benchmark's MLP (32 -> 64 -> 2), 6 tensors;
- many: 100 x Linear(64, 64) with AdamW, 600 tensors.

For each, side by side in one process, interleaved in rotating order and repeated (medians):

- ``ember``: ``trainer.save_checkpoint(path)`` outside fit, complete (every file
  fsynced, renamed into place) when it returns;
- ``ember in fit``: the part of a sync save inside fit that the loop waits for
  (gather + files; the fsyncs and rename run on a background thread);
- ``dcp.save``: torch.distributed.checkpoint alone on the same tensors (the
  tensor files only, fsynced), which ember used for every state before;
- ``torch.save``: one ``torch.save`` of the same tensors plus fsync.

    python benchmarks/small_checkpoint.py            # 30 repeats
    python benchmarks/small_checkpoint.py --short    # CI: 3 repeats

Goal: ember's complete save of the many-tensor state (every file fsynced, in place) at most 0.75 x the time
of dcp.save writing its tensors alone, which is what ember's save cost before on top of its other files.
One torch.save of all the tensors is shown beside: writing each tensor as its own torch.save record, as the
DCP format does, costs a few times more than that.
"""

from __future__ import annotations

import argparse
import os
import shutil
import statistics
import sys
import tempfile
import time
import warnings
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
import ember
from ember import checkpoint as ckpt
from ember.checkpoint import registry as state


class Model(ember.TrainingModule):
    def __init__(self, layers: int, width: int, adamw: bool) -> None:
        super().__init__()
        torch.manual_seed(0)
        if layers:
            self.model: nn.Module = nn.Sequential(*(nn.Linear(width, width) for _ in range(layers)))
        else:
            self.model = nn.Sequential(nn.Linear(32, 64), nn.ReLU(), nn.Linear(64, 2))
        self.loss_fn = nn.MSELoss()
        self.adamw = adamw

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        x, _ = batch
        loss: torch.Tensor = self.model(x).square().mean()
        return loss

    def configure_optimizers(self) -> torch.optim.Optimizer:
        if self.adamw:
            return torch.optim.AdamW(self.parameters(), lr=1e-3)
        return torch.optim.SGD(self.parameters(), lr=0.01, momentum=0.9)


def fitted(layers: int, width: int, adamw: bool) -> tuple[ember.Trainer, Model]:
    module = Model(layers, width, adamw)
    inputs = torch.randn(4, width if layers else 32)
    trainer = ember.Trainer(
        max_steps=1, logger=False, enable_progress_bar=False, enable_model_summary=False, enable_checkpointing=False
    )
    trainer.fit(module, DataLoader(TensorDataset(inputs, inputs), batch_size=4))
    return trainer, module


def tensors_of(trainer: ember.Trainer, module: Model) -> dict[str, torch.Tensor]:
    return state.gather(trainer, module, weights_only=False, copy=False).tensors


def dcp_save(tensors: dict[str, torch.Tensor], path: Path) -> None:
    import torch.distributed.checkpoint as dcp

    path.mkdir()
    writer = dcp.FileSystemWriter(path, sync_files=True, single_file_per_rank=True, thread_count=1)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        dcp.save(tensors, storage_writer=writer, no_dist=True)


def torch_save(tensors: dict[str, torch.Tensor], path: Path) -> None:
    with open(path, "wb") as f:
        torch.save(tensors, f)
        f.flush()
        os.fsync(f.fileno())


def in_fit_part(trainer: ember.Trainer, module: Model, path: Path) -> ckpt.StagedCheckpoint:
    return state.stage(path, state.gather(trainer, module, weights_only=False, copy=False))


def measure(trainer: ember.Trainer, module: Model, root: Path, repeats: int) -> dict[str, float]:
    tensors = tensors_of(trainer, module)
    staged: list[ckpt.StagedCheckpoint] = []
    variants: dict[str, Callable[[Path], Any]] = {
        "ember": lambda p: trainer.save_checkpoint(p),
        "ember in fit": lambda p: staged.append(in_fit_part(trainer, module, p)),
        "dcp.save": lambda p: dcp_save(tensors, p),
        "torch.save": lambda p: torch_save(tensors, p),
    }
    times: dict[str, list[float]] = {name: [] for name in variants}
    names = list(variants)
    for rep in range(repeats + 1):  # the first round warms up (imports, allocator)
        # The order rotates: deleting a variant's files leaves the file system work that the next one meets.
        for name in names[rep % len(names) :] + names[: rep % len(names)]:
            save = variants[name]
            path = root / f"{name.replace(' ', '-')}-{rep}"
            start = time.perf_counter()
            save(path)
            elapsed = time.perf_counter() - start
            for done in staged:  # not timed: the background part of a save inside fit
                done.finish()
            staged.clear()
            if rep:
                times[name].append(elapsed)
            shutil.rmtree(path) if path.is_dir() else path.unlink()
    return {name: statistics.median(values) for name, values in times.items()}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--short", action="store_true", help="3 repeats (for CI)")
    args = parser.parse_args()
    torch.set_num_threads(1)
    repeats = 3 if args.short else 30
    cases = {"tiny (6 tensors, SGD momentum)": (0, 0, False), "many (600 tensors, AdamW)": (100, 64, True)}
    ratios: dict[str, float] = {}
    with tempfile.TemporaryDirectory(prefix="ember-small-ckpt-") as tmp:
        for label, (layers, width, adamw) in cases.items():
            trainer, module = fitted(layers, width, adamw)
            medians = measure(trainer, module, Path(tmp), repeats)
            base = medians["torch.save"]
            print(f"{label}: median of {repeats}")
            for name, value in medians.items():
                print(f"  {name:13s} {value * 1e3:8.2f} ms   x{value / base:.2f} torch.save")
            ratios[label] = medians["ember"] / medians["dcp.save"]
            print(f"  ember / dcp.save = x{ratios[label]:.2f}")
    many = ratios["many (600 tensors, AdamW)"]
    verdict = "meets" if many <= 0.75 else "misses"
    print(f"verdict: {verdict} the goal (ember / dcp.save, many tensors: x{many:.2f} <= 0.75)")


if __name__ == "__main__":
    main()
