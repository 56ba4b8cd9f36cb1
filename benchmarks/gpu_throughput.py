"""Training throughput of the char transformer: ember's Trainer against a hand-written loop, tokens/s and MFU.

    python benchmarks/gpu_throughput.py                          # one GPU, bf16-mixed, torch.compile
    python benchmarks/gpu_throughput.py --device cpu --short     # the CPU dry run CI exercises (no verdict on speed)

Both train the same `CharTransformer` (examples/char_transformer.py, same initial weights) on the same
windows of the standard library's bytes with the same AdamW and schedule (the module's
``configure_optimizers``), in bf16 autocast, compiled. They alternate epochs of ``--steps`` steps in this
process (as benchmarks/compile.py does): each ember epoch is preceded by one raw epoch, run from ember's
epoch-start hook outside the ember epoch's clock, so machine noise hits both alike. The first epoch of
each (compilation) is warm-up and not timed; every clock starts and stops after a device synchronisation.

tokens/s counts input tokens (batch x seq_len per step). FLOPs per step are measured once with
`torch.utils.flop_counter` on the meta device (forward and backward); MFU is achieved FLOP/s over the
device's dense peak for the precision (`ember.callbacks.throughput.PEAK_FLOPS`), "n/a" where unknown.
The ratio is ember's step time over the raw loop's (the median of the per-epoch ratios). Goal: <= 1.03.
"""

from __future__ import annotations

import argparse
import contextlib
import itertools
import json
import statistics
import sys
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import torch
from torch.nn import functional as F
from torch.utils.data import DataLoader

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
import ember
from ember.callbacks.throughput import measure_flops, peak_flops_per_s
from examples.char_transformer import CharTransformer, StdlibText

GOAL = 1.03


@dataclass
class Config:
    """What one run trains: model size, batch, steps and how."""

    device: str = "cuda"
    precision: str = "bf16-mixed"
    compile: bool = True
    compile_backend: str = "inductor"
    d_model: int = 768
    n_heads: int = 12
    n_layers: int = 12
    seq_len: int = 512
    batch_size: int = 32
    steps: int = 40  # per epoch
    epochs: int = 4  # the first is warm-up
    max_bytes: int = 4_000_000

    @property
    def tokens_per_step(self) -> int:
        return self.batch_size * self.seq_len


SHORT = {"d_model": 32, "n_heads": 4, "n_layers": 2, "seq_len": 32, "batch_size": 8, "steps": 4, "epochs": 2}


@dataclass
class Result:
    """Seconds per timed epoch for each loop, and what they mean."""

    raw_s: list[float]
    ember_s: list[float]
    tokens_per_epoch: int
    flops_per_step: int
    peak_flops_per_s: float | None

    def tokens_per_s(self, which: str) -> float:
        times = self.raw_s if which == "raw" else self.ember_s
        return self.tokens_per_epoch * len(times) / sum(times)

    def mfu(self, which: str, steps_per_epoch: int) -> float | None:
        """Model FLOPs utilisation: FLOP/s achieved over the device's peak (None when the peak is unknown)."""
        if self.peak_flops_per_s is None:
            return None
        times = self.raw_s if which == "raw" else self.ember_s
        return self.flops_per_step * steps_per_epoch * len(times) / sum(times) / self.peak_flops_per_s

    @property
    def ratio(self) -> float:
        """ember's epoch time over the raw loop's: the median of the per-epoch ratios."""
        return statistics.median(e / r for e, r in zip(self.ember_s, self.raw_s, strict=True))


def build_module(config: Config) -> CharTransformer:
    torch.manual_seed(0)
    return CharTransformer(
        context=config.seq_len,
        d_model=config.d_model,
        n_heads=config.n_heads,
        n_layers=config.n_layers,
        warmup_steps=10,
        total_steps=config.steps * config.epochs * 2,
    )


def flops_per_step(config: Config) -> int:
    """Forward and backward FLOPs of one step, counted on the meta device (nothing is computed)."""
    with torch.device("meta"):
        module = build_module(config)
        tokens = torch.zeros(config.batch_size, config.seq_len, dtype=torch.long)

    def loss(logits: torch.Tensor) -> torch.Tensor:
        return F.cross_entropy(logits.flatten(0, 1), tokens.flatten())

    return measure_flops(lambda: module(tokens), loss)


def synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


class RawLoop:
    """The hand-written loop: autocast, compiled model, backward, AdamW step, scheduler step, zero_grad."""

    def __init__(self, config: Config, loader: DataLoader, device: torch.device) -> None:
        self.device, self.loader, self.steps = device, loader, config.steps
        self.model = build_module(config).to(device)
        optimizers = self.model.configure_optimizers()
        self.optimizer, self.scheduler = optimizers["optimizer"], optimizers["lr_scheduler"]["scheduler"]
        self.forward = torch.compile(self.model, backend=config.compile_backend) if config.compile else self.model
        dtype = {"bf16-mixed": torch.bfloat16, "16-mixed": torch.float16}.get(config.precision)
        self.autocast: Callable[[], contextlib.AbstractContextManager[Any]] = (
            (lambda: torch.autocast(device.type, dtype=dtype)) if dtype is not None else contextlib.nullcontext
        )
        self.scaler = torch.amp.GradScaler(device.type) if config.precision == "16-mixed" else None

    def epoch(self) -> float:
        synchronize(self.device)
        start = time.perf_counter()
        for inputs, targets in itertools.islice(self.loader, self.steps):
            inputs = inputs.to(self.device, non_blocking=True)
            targets = targets.to(self.device, non_blocking=True)
            with self.autocast():
                loss = F.cross_entropy(self.forward(inputs).flatten(0, 1), targets.flatten())
            if self.scaler is None:
                loss.backward()
                self.optimizer.step()
            else:  # 16-mixed: scaled loss, as ember's precision plugin does
                self.scaler.scale(loss).backward()
                self.scaler.step(self.optimizer)
                self.scaler.update()
            self.scheduler.step()
            self.optimizer.zero_grad(set_to_none=True)
        synchronize(self.device)
        return time.perf_counter() - start


class Alternate(ember.Callback):
    """Runs one raw epoch before each ember epoch; times both after a device synchronisation."""

    def __init__(self, raw: RawLoop, device: torch.device) -> None:
        self.raw, self.device = raw, device
        self.raw_s: list[float] = []
        self.ember_s: list[float] = []
        self.start = 0.0

    def on_train_epoch_start(self, trainer: Any, module: Any) -> None:
        self.raw_s.append(self.raw.epoch())
        synchronize(self.device)
        self.start = time.perf_counter()

    def on_train_epoch_end(self, trainer: Any, module: Any) -> None:
        synchronize(self.device)
        self.ember_s.append(time.perf_counter() - self.start)


def run(config: Config) -> Result:
    device = torch.device(config.device)
    data = StdlibText(seq_len=config.seq_len, batch_size=config.batch_size, max_bytes=config.max_bytes)
    data.setup("fit")
    if len(data.train_dataloader()) < config.steps:
        raise SystemExit(f"--max-bytes {config.max_bytes} holds fewer than --steps {config.steps} batches")
    clock = Alternate(RawLoop(config, data.train_dataloader(), device), device)
    trainer = ember.Trainer(
        max_epochs=config.epochs,
        limit_train_batches=config.steps,
        accelerator=config.device,
        precision=config.precision,
        compile={"backend": config.compile_backend} if config.compile else False,
        callbacks=[clock],
        logger=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        enable_checkpointing=False,
        num_sanity_val_steps=0,
    )
    trainer.fit(build_module(config), data.train_dataloader())
    peak = peak_flops_per_s(device, config.precision)
    tokens = config.tokens_per_step * config.steps
    return Result(clock.raw_s[1:], clock.ember_s[1:], tokens, flops_per_step(config), peak)


def parse_args(argv: list[str] | None = None) -> tuple[Config, argparse.Namespace]:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", choices=("cuda", "cpu"), default="cuda")
    parser.add_argument("--precision", choices=("bf16-mixed", "16-mixed", "32-true"), default="bf16-mixed")
    parser.add_argument("--no-compile", dest="compile", action="store_false", help="eager, both loops")
    parser.add_argument(
        "--compile-backend", default="inductor", help="torch.compile backend of both loops (aot_eager: trace only)"
    )
    parser.add_argument("--short", action="store_true", help="a tiny model, 2 epochs of 4 steps (CI, CPU)")
    for field in ("d_model", "n_heads", "n_layers", "seq_len", "batch_size", "steps", "epochs", "max_bytes"):
        parser.add_argument(f"--{field.replace('_', '-')}", type=int, default=None)
    parser.add_argument("--json", type=Path, help="also write the figures to this file")
    args = parser.parse_args(argv)
    values: dict[str, Any] = {
        "device": args.device,
        "precision": args.precision,
        "compile": args.compile,
        "compile_backend": args.compile_backend,
    }
    if args.short:
        values.update(SHORT)
    for field in ("d_model", "n_heads", "n_layers", "seq_len", "batch_size", "steps", "epochs", "max_bytes"):
        if getattr(args, field) is not None:
            values[field] = getattr(args, field)
    config = Config(**values)
    if config.epochs < 2:
        parser.error("--epochs must be at least 2 (the first is warm-up)")
    if config.device == "cuda" and not torch.cuda.is_available():
        parser.error("--device cuda, but torch sees no CUDA device; use --device cpu for a dry run")
    return config, args


def report(config: Config, result: Result) -> list[str]:
    """The lines the benchmark prints (a verdict on speed only where it means something: on a GPU)."""

    def mfu(which: str) -> str:
        value = result.mfu(which, config.steps)
        return "n/a" if value is None else f"{value:.1%}"

    params = f"d_model {config.d_model}, {config.n_layers} layers, seq {config.seq_len}, batch {config.batch_size}"
    lines = [
        f"char transformer ({params}), {config.precision}, "
        f"compile={config.compile_backend if config.compile else False}, {config.device}",
        f"{len(result.raw_s)} timed epochs of {config.steps} steps each, {result.flops_per_step / 1e9:.2f} GFLOP/step",
        f"raw loop: {result.tokens_per_s('raw'):,.0f} tokens/s, MFU {mfu('raw')}",
        f"ember:    {result.tokens_per_s('ember'):,.0f} tokens/s, MFU {mfu('ember')}",
        f"ember / raw step time: x{result.ratio:.3f}",
    ]
    if config.device == "cuda":
        ok = result.ratio <= GOAL
        lines.append(f"verdict: {'meets' if ok else 'misses'} the goal (ratio x{result.ratio:.3f} <= {GOAL})")
    else:
        lines.append("verdict: none on CPU (the GPU check times this on CUDA)")
    return lines


def main(argv: list[str] | None = None) -> None:
    config, args = parse_args(argv)
    torch.set_float32_matmul_precision("high")
    result = run(config)
    for line in report(config, result):
        print(line, flush=True)
    if args.json is not None:
        figures = {
            "config": asdict(config),
            **asdict(result),
            "tokens_per_s": {w: result.tokens_per_s(w) for w in ("raw", "ember")},
            "mfu": {w: result.mfu(w, config.steps) for w in ("raw", "ember")},
            "ratio": result.ratio,
        }
        args.json.write_text(json.dumps(figures, indent=2), encoding="utf-8")


if __name__ == "__main__":
    main()
