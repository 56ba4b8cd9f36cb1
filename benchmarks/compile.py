"""`Trainer(compile=True)` against a hand-compiled raw loop: step time ratio and recompiles after warm-up.

    python benchmarks/compile.py [--short]

Both compile the same MLP and run the same steps in this process, in
alternating epochs: each ember epoch is preceded by one raw epoch (run from the ember epoch-start
hook, outside the ember epoch's timing), so machine noise hits both alike. The first epoch of each is
warm-up (compilation) and is not timed; the ratio is the median of the per-epoch ratios.
Goals: ratio <= 1.03, 0 recompiles.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
import ember

BATCH, STEPS = 64, 128


def make_loader() -> DataLoader:
    g = torch.Generator().manual_seed(0)
    x, y = torch.randn(BATCH * STEPS, 256, generator=g), torch.randint(0, 10, (BATCH * STEPS,), generator=g)
    return DataLoader(TensorDataset(x, y), batch_size=BATCH, shuffle=True, generator=g)


def make_model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(256, 512), nn.GELU(), nn.Linear(512, 512), nn.GELU(), nn.Linear(512, 10))


def graphs() -> int:
    from torch._dynamo.utils import counters

    return int(counters["stats"]["unique_graphs"])


class RawLoop:
    """The hand-compiled raw loop, one epoch per call."""

    def __init__(self) -> None:
        self.model, self.loader, self.loss_fn = make_model(), make_loader(), nn.CrossEntropyLoss()
        self.opt = torch.optim.SGD(self.model.parameters(), lr=0.01)
        # torch.compile(model), as a raw loop writes it: `model.compile()` on a torch.nn container is a no-op in
        # torch 2.13 (dynamo skips frames inside torch.nn), so it would time an eager model.
        self.compiled = torch.compile(self.model)

    def epoch(self) -> float:
        start = time.perf_counter()
        for x, y in self.loader:
            loss = self.loss_fn(self.compiled(x), y)
            loss.backward()
            self.opt.step()
            self.opt.zero_grad(set_to_none=True)
        return time.perf_counter() - start


class Net(ember.TrainingModule):
    def __init__(self) -> None:
        super().__init__()
        self.model = make_model()
        self.loss_fn = nn.CrossEntropyLoss()

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.parameters(), lr=0.01)


class Alternate(ember.Callback):
    """Runs one raw epoch before each ember epoch and times both; counts graphs after the warm-up epoch."""

    def __init__(self, raw: RawLoop) -> None:
        self.raw, self.start = raw, 0.0
        self.raw_times: list[float] = []
        self.ember_times: list[float] = []
        self.after_warmup = 0

    def on_train_epoch_start(self, trainer: Any, module: Any) -> None:
        self.raw_times.append(self.raw.epoch())
        self.start = time.perf_counter()

    def on_train_epoch_end(self, trainer: Any, module: Any) -> None:
        self.ember_times.append(time.perf_counter() - self.start)
        if trainer.current_epoch == 0:
            self.after_warmup = graphs()


def run(epochs: int) -> tuple[list[float], list[float], int, int]:
    """(raw epoch times, ember epoch times) after warm-up; graphs compiled in and after the warm-up."""
    clock = Alternate(RawLoop())
    trainer = ember.Trainer(
        max_epochs=epochs,
        compile=True,
        callbacks=[clock],
        logger=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        enable_checkpointing=False,
    )
    trainer.fit(Net(), make_loader())
    return clock.raw_times[1:], clock.ember_times[1:], clock.after_warmup, graphs() - clock.after_warmup


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--short", action="store_true", help="2 epochs (1 timed) for CI")
    args = parser.parse_args()
    torch.set_num_threads(1)
    epochs = 2 if args.short else 8
    raw_times, ember_times, warmup_graphs, recompiles = run(epochs)
    steps = (epochs - 1) * STEPS
    ratio = statistics.median(e / r for e, r in zip(ember_times, raw_times, strict=True))
    print(
        f"{steps} timed steps each after warm-up: raw compiled {sum(raw_times) / steps * 1e3:.3f} ms/step, "
        f"ember compile=True {sum(ember_times) / steps * 1e3:.3f} ms/step, median epoch ratio x{ratio:.3f}"
    )
    print(f"graphs compiled by raw and ember together: {warmup_graphs} in the warm-up, {recompiles} after it")
    ember_recompiles = recompiles
    ok = ratio <= 1.03 and ember_recompiles == 0 and warmup_graphs >= 2  # both really compiled
    print(
        f"verdict: {'meets' if ok else 'misses'} the goals (ratio x{ratio:.3f} <= 1.03, "
        f"{ember_recompiles} recompiles after warm-up, goal 0)"
    )


if __name__ == "__main__":
    main()
