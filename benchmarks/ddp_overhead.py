"""Per-step time of ember's DDP strategy over a raw DistributedDataParallel loop, on the same processes.

Every rank runs both, interleaved (raw, ember, raw, ember, ...), so machine noise hits both alike:
a raw loop (DDP-wrapped MLP 32 -> 64 -> 2, batch 32 per rank, SGD, a DataLoader with a shuffling
DistributedSampler and ``set_epoch``) and ``ember.Trainer(strategy="ddp")`` with the same model, data and
optimizer (no logger, progress bar, summary or checkpoints; the step logs ``train/loss`` as usual).
Only the training loop is timed: from the first batch to the last optimizer step (ember: ``on_train_start``
to ``on_train_end``), not process start-up or DDP wrapping. The ratio uses the best repeat per variant
(noise only adds time), taking the slower rank of each repeat; the median is shown beside it.

    python benchmarks/ddp_overhead.py              # starts itself under torchrun: 2 CPU processes (gloo)
    python benchmarks/ddp_overhead.py --short      # CI: 2 repeats of 1 epoch of 64 steps
    torchrun --nproc-per-node=1 benchmarks/ddp_overhead.py --accelerator cuda   # one GPU (NCCL)

Goal: ember DDP / raw DDP <= 1.05.
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import time
from datetime import timedelta
from pathlib import Path
from typing import Any


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    parser.add_argument("--short", action="store_true", help="2 repeats of 1 epoch of 64 steps (for CI)")
    parser.add_argument("--repeats", type=int, default=None, help="timed repeats per variant (default 7)")
    parser.add_argument("--nproc", type=int, default=2, help="processes when not started by torchrun (default 2)")
    parser.add_argument("--accelerator", choices=("cpu", "cuda"), default="cpu")
    return parser.parse_args()


def relaunch(args: list[str], nproc: int) -> None:
    """Not under torchrun: run this file again under it, `nproc` processes. The child gets the other
    arguments: torchrun's own parser reads ``--nproc`` after the script name as an abbreviation of its
    ``--nproc-per-node`` and rejects it."""
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={nproc}", __file__]
    cmd += without_nproc(args)
    env = {**os.environ, "OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS", "1")}
    raise SystemExit(subprocess.call(cmd, env=env))


def without_nproc(args: list[str]) -> list[str]:
    """`args` without ``--nproc N`` / ``--nproc=N`` (what the relaunch already applied)."""
    kept, skip = [], False
    for arg in args:
        if skip:
            skip = False
        elif arg == "--nproc":
            skip = True
        elif not arg.startswith("--nproc="):
            kept.append(arg)
    return kept


if __name__ == "__main__" and "LOCAL_RANK" not in os.environ:  # the launcher: torchrun, before importing torch
    relaunch(sys.argv[1:], parse_args().nproc)

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
from torch import nn  # noqa: E402
from torch.nn.parallel import DistributedDataParallel  # noqa: E402
from torch.utils.data import DataLoader, TensorDataset  # noqa: E402
from torch.utils.data.distributed import DistributedSampler  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
import ember  # noqa: E402

# the same tiny MLP and module as the single-process benchmark
from benchmarks.overhead import Tiny, make_model  # noqa: E402

BATCH, STEPS_PER_EPOCH, SHORT_STEPS_PER_EPOCH, GOAL = 32, 256, 64, 1.05


def make_data(world_size: int, steps_per_epoch: int) -> TensorDataset:
    g = torch.Generator().manual_seed(0)
    n = BATCH * steps_per_epoch * world_size
    return TensorDataset(torch.randn(n, 32, generator=g), torch.randint(0, 2, (n,), generator=g))


class LoopTimer(ember.Callback):
    def on_train_start(self, trainer: Any, module: Any) -> None:
        self.start = time.perf_counter()

    def on_train_end(self, trainer: Any, module: Any) -> None:
        _sync(trainer.strategy.root_device)
        self.seconds = time.perf_counter() - self.start


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def run_raw(data: TensorDataset, epochs: int, device: torch.device) -> float:
    model = make_model().to(device)
    device_ids = [device.index] if device.type == "cuda" else None
    # DDP configured as ember's DDPStrategy does by default: the loop, not DDP's options, is what is compared.
    ddp = DistributedDataParallel(model, device_ids=device_ids, gradient_as_bucket_view=True)
    sampler = DistributedSampler(data, shuffle=True, seed=0)
    loader = DataLoader(data, batch_size=BATCH, sampler=sampler)
    loss_fn, opt = nn.CrossEntropyLoss(), torch.optim.SGD(ddp.parameters(), lr=0.01)
    dist.barrier()
    start = time.perf_counter()
    for epoch in range(epochs):
        sampler.set_epoch(epoch)
        for x, y in loader:
            if device.type == "cuda":
                x, y = x.to(device, non_blocking=True), y.to(device, non_blocking=True)
            loss = loss_fn(ddp(x), y)
            loss.backward()
            opt.step()
            opt.zero_grad(set_to_none=True)
    _sync(device)
    return time.perf_counter() - start


def run_ember(data: TensorDataset, epochs: int, accelerator: str) -> float:
    timer = LoopTimer()
    trainer = ember.Trainer(
        max_epochs=epochs,
        strategy="ddp",
        accelerator=accelerator,
        callbacks=[timer],
        logger=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        enable_checkpointing=False,
    )
    dist.barrier()
    trainer.fit(Tiny(), DataLoader(data, batch_size=BATCH, shuffle=True))
    return timer.seconds


def main() -> None:
    args = parse_args()
    if "LOCAL_RANK" not in os.environ:
        relaunch(sys.argv[1:], args.nproc)
    epochs, repeats = (1, 2) if args.short else (2, args.repeats or 7)
    steps_per_epoch = SHORT_STEPS_PER_EPOCH if args.short else STEPS_PER_EPOCH
    torch.set_num_threads(1)
    if args.accelerator == "cuda":
        device = torch.device("cuda", int(os.environ["LOCAL_RANK"]))
        torch.cuda.set_device(device)
    else:
        device = torch.device("cpu")
    # ember joins this group (it only creates one when none exists), so both variants share it.
    dist.init_process_group("nccl" if device.type == "cuda" else "gloo", timeout=timedelta(seconds=120))
    world, rank = dist.get_world_size(), dist.get_rank()
    data = make_data(world, steps_per_epoch)
    run_raw(data, 1, device)  # warm-up: first-call costs (allocator, DDP buckets, imports) out of the timing
    run_ember(data, 1, args.accelerator)
    times: dict[str, list[float]] = {"raw DDP": [], "ember DDP": []}
    for _ in range(repeats):
        for name, seconds in (
            ("raw DDP", run_raw(data, epochs, device)),
            ("ember DDP", run_ember(data, epochs, args.accelerator)),
        ):
            slowest = [0.0] * world
            dist.all_gather_object(slowest, seconds)
            times[name].append(max(slowest))
    dist.barrier()
    if rank == 0:
        steps = epochs * steps_per_epoch
        best = {name: min(values) for name, values in times.items()}
        backend = dist.get_backend()
        print(
            f"{world} processes ({backend}, {device.type}), {steps} steps per run, {repeats} runs each, batch {BATCH}"
        )
        print("per-step time: best, median, best / raw")
        for name, values in times.items():
            per_step, median = best[name] / steps * 1e6, statistics.median(values) / steps * 1e6
            print(f"  {name:10s} {per_step:8.1f} us {median:8.1f} us   x{best[name] / best['raw DDP']:.3f}")
        ratio = best["ember DDP"] / best["raw DDP"]
        verdict = "meets" if ratio <= GOAL else "misses"
        print(f"ratio ember/raw: {ratio:.3f}")
        print(f"verdict: {verdict} the goal (ember DDP / raw DDP x{ratio:.3f} <= {GOAL})")
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
