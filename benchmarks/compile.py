"""`Trainer(compile=True)` against a hand-compiled raw loop: step time ratio and recompiles after warm-up.

    python benchmarks/compile.py [--short]

Both compile the same MLP with `nn.Module.compile()` and run the same steps in this process;
the first epoch is warm-up (compilation) and is not timed. Goals: ratio <= 1.03, 0 recompiles.
"""

from __future__ import annotations

import argparse
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


def raw(epochs: int) -> tuple[float, int]:
    model, loader, loss_fn = make_model(), make_loader(), nn.CrossEntropyLoss()
    model.compile()
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    timed, after_warmup = 0.0, 0
    for epoch in range(epochs):
        start = time.perf_counter()
        for x, y in loader:
            loss = loss_fn(model(x), y)
            loss.backward()
            opt.step()
            opt.zero_grad(set_to_none=True)
        if epoch == 0:
            after_warmup = graphs()
        else:
            timed += time.perf_counter() - start
    return timed, graphs() - after_warmup


class Net(ember.TrainingModule):
    def __init__(self) -> None:
        super().__init__()
        self.model = make_model()
        self.loss_fn = nn.CrossEntropyLoss()

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.parameters(), lr=0.01)


class EpochClock(ember.Callback):
    def __init__(self) -> None:
        self.start, self.timed, self.after_warmup = 0.0, 0.0, 0

    def on_train_epoch_start(self, trainer: Any, module: Any) -> None:
        self.start = time.perf_counter()

    def on_train_epoch_end(self, trainer: Any, module: Any) -> None:
        if trainer.current_epoch == 0:
            self.after_warmup = graphs()
        else:
            self.timed += time.perf_counter() - self.start


def with_ember(epochs: int) -> tuple[float, int]:
    clock = EpochClock()
    trainer = ember.Trainer(
        max_epochs=epochs, compile=True, callbacks=[clock], logger=False, enable_progress_bar=False,
        enable_model_summary=False, enable_checkpointing=False,
    )
    trainer.fit(Net(), make_loader())
    return clock.timed, graphs() - clock.after_warmup


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--short", action="store_true", help="2 epochs (1 timed) for CI")
    args = parser.parse_args()
    torch.set_num_threads(1)
    epochs = 2 if args.short else 4
    raw_s, raw_recompiles = raw(epochs)
    ember_s, ember_recompiles = with_ember(epochs)
    steps = (epochs - 1) * STEPS
    ratio = ember_s / raw_s
    print(f"{steps} timed steps after warm-up: raw compiled {raw_s / steps * 1e3:.3f} ms/step, "
          f"ember compile=True {ember_s / steps * 1e3:.3f} ms/step, ratio x{ratio:.3f}")
    print(f"graphs compiled after warm-up: raw {raw_recompiles}, ember {ember_recompiles}")
    ok = ratio <= 1.03 and ember_recompiles == 0
    print(
        f"verdict: {'meets' if ok else 'misses'} the goals (ratio x{ratio:.3f} <= 1.03, "
        f"{ember_recompiles} recompiles after warm-up, goal 0)"
    )


if __name__ == "__main__":
    main()
