"""Checkpoints on object storage: the training stall of a save to the store against a synchronous one.

Starts moto's S3 server on 127.0.0.1 (``moto[server]``, dummy credentials in this process's environment), then
inside ``fit`` saves every ``--interval-s`` seconds of training with ``ModelCheckpoint(dirpath="s3://...",
async_save=True)``. The stall of a save is how much longer a boundary with a save takes than one without
(medians); the synchronous save is the time to write the same state locally and commit it on the store
(files, manifest, ``last``) before going on. Both share the machine's cores with the S3 server, which runs
here too.

The interval is longer than a synchronous save, so each save's background write is done when the next one
comes: a save asked for while the previous one is still being written waits for it (at most one write is in
flight), and then the boundary measures the disk, not the save. ``--every 8`` (a save every 8 steps, a few
milliseconds apart) shows that regime.

    python benchmarks/store_checkpoint.py            # 3 x Linear(2048, 2048) with AdamW (~150 MB)
    python benchmarks/store_checkpoint.py --short    # 3 x Linear(512, 512), 2 saves measured

Goal: stall / synchronous save <= 0.10.
"""

from __future__ import annotations

import argparse
import os
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

import ember
from ember.callbacks.model_checkpoint import ModelCheckpoint
from ember.checkpoint import manifest
from ember.checkpoint.store import open_store


class Stack(ember.TrainingModule):
    def __init__(self, width: int, depth: int) -> None:
        super().__init__()
        self.model = nn.Sequential(*[nn.Linear(width, width) for _ in range(depth)])
        self.loss_fn = nn.MSELoss()

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.AdamW(self.parameters(), lr=1e-4)


class Gaps(ember.Callback):
    """Time from the end of each batch (after every callback's hook) to the start of the next: the boundary,
    where a requested save is written, plus data loading; which boundaries saved; stops the fit `after`
    saves (and a few steps more)."""

    def __init__(self, saves: int) -> None:
        self.saves = saves
        self.ends: list[float] = []
        self.gaps: list[tuple[int, float]] = []  # (global step before the boundary, seconds)
        self.saved: list[int] = []  # global steps of the saves
        self.steps: list[float] = []  # seconds of each batch

    def on_train_batch_start(self, trainer: Any, module: Any, batch: Any, batch_idx: int) -> None:
        now = time.perf_counter()
        if self.ends:
            self.gaps.append((trainer.global_step, now - self.ends[-1]))
        self.start = now

    def on_train_batch_end(self, trainer: Any, module: Any, outputs: Any, batch: Any, batch_idx: int) -> None:
        self.ends.append(time.perf_counter())
        self.steps.append(self.ends[-1] - self.start)
        if len(self.saved) > self.saves and trainer.global_step >= self.saved[-1] + 8:
            trainer.should_stop = True

    def on_save_checkpoint(self, trainer: Any, module: Any, checkpoint: dict[str, Any]) -> None:
        if trainer.training:
            self.saved.append(trainer.global_step)


def start_server() -> tuple[subprocess.Popen[bytes], str]:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    server = Path(sys.executable).parent / "moto_server"
    proc = subprocess.Popen([str(server), "-H", "127.0.0.1", "-p", str(port)], stdout=subprocess.DEVNULL,
                            stderr=subprocess.DEVNULL, start_new_session=True)  # fmt: skip
    for _ in range(300):
        try:
            socket.create_connection(("127.0.0.1", port), timeout=0.5).close()
            break
        except OSError:
            time.sleep(0.1)
    return proc, f"http://127.0.0.1:{port}"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--short", action="store_true", help="a small model")
    parser.add_argument("--interval-s", type=float, default=None, help="seconds of training between saves "
                        "(default: 1 with --short, 6 without: longer than a synchronous save)")  # fmt: skip
    parser.add_argument("--every", type=int, default=None, help="save every N steps instead (no interval)")
    parser.add_argument("--saves", type=int, default=None, help="saves measured (the first, which allocates, is "
                        "not; default: 2 with --short, 8 without)")  # fmt: skip
    parser.add_argument("--threads", type=int, default=1, help="torch's intra-op threads (default 1)")
    args = parser.parse_args()
    # One thread by default: on a machine whose cores are shared (the S3 server, the upload, other work), a
    # parallel region waits for its descheduled threads, and every tensor operation of a step or of the
    # snapshot copy pays a time slice.
    torch.set_num_threads(args.threads)
    width, depth = (512, 3) if args.short else (2048, 3)
    interval_s = args.interval_s if args.interval_s is not None else (1.0 if args.short else 6.0)
    saves = args.saves if args.saves is not None else (2 if args.short else 8)
    load_before = " ".join(f"{x:.2f}" for x in os.getloadavg())
    proc, endpoint = start_server()
    os.environ.update(AWS_ACCESS_KEY_ID="bench", AWS_SECRET_ACCESS_KEY="bench", AWS_DEFAULT_REGION="us-east-1",
                      AWS_ENDPOINT_URL=endpoint)  # fmt: skip
    try:
        fs, _ = open_store("s3://bench")
        fs.mkdir("bench")
        with tempfile.TemporaryDirectory(prefix="ember-store-bench-") as tmp:
            root = Path(tmp)
            torch.manual_seed(0)
            data = TensorDataset(torch.randn(64, width), torch.randn(64, width))
            loader = DataLoader(data, batch_size=8)
            gaps = Gaps(saves)
            when: dict[str, Any] = {"train_time_interval": interval_s}
            if args.every is not None:
                when = {"every_n_train_steps": args.every}
            saver = ModelCheckpoint(dirpath="s3://bench/ckpts", save_top_k=2, async_save=True, **when)
            trainer = ember.Trainer(max_steps=10**6, max_epochs=10**6, default_root_dir=root / "runs",
                                    callbacks=[saver, gaps], logger=False, enable_progress_bar=False,
                                    enable_model_summary=False)  # fmt: skip
            module = Stack(width, depth)
            trainer.fit(module, loader)
            # the first save (fresh snapshot buffers) is left out
            save_gaps = [g for step, g in gaps.gaps if step in gaps.saved[1:]]
            plain = [g for step, g in gaps.gaps[1:] if step not in gaps.saved]
            stall = statistics.median(save_gaps) - statistics.median(plain)
            # The synchronous save of the same state: written locally, then committed on the store.
            sync = []
            for n in range(3):
                start = time.perf_counter()
                path = trainer.save_checkpoint(root / f"sync-{n}")
                manifest.upload(fs, path, f"bench/sync/sync-{n}", trainer.global_step)
                manifest.point_last(fs, "bench/sync", f"sync-{n}")
                sync.append(time.perf_counter() - start)
            n_bytes = sum(f.stat().st_size for f in (root / "sync-0").rglob("*") if f.is_file())
    finally:
        os.killpg(proc.pid, signal.SIGTERM)
        proc.wait()
    best_sync = min(sync)
    print(f"torch threads: {torch.get_num_threads()}; load average before: {load_before}")
    cadence = f"{args.every} steps" if args.every else f"{interval_s:g} s"
    step_ms = statistics.median(gaps.steps) * 1e3
    print(f"model: {depth} x Linear({width}, {width}) with AdamW: a checkpoint of {n_bytes / 2**20:.1f} MiB; "
          f"a save every {cadence} ({len(gaps.steps)} steps, median {step_ms:.1f} ms each)")  # fmt: skip
    print(f"boundary without a save: median {statistics.median(plain) * 1e3:.1f} ms; with a save to the store: "
          f"{', '.join(f'{g * 1e3:.1f}' for g in save_gaps)} ms")  # fmt: skip
    print(f"synchronous save + commit on the store: {', '.join(f'{s:.3f}' for s in sync)} s (best {best_sync:.3f} s)")
    ratio = stall / best_sync
    print(f"stall / synchronous save = {stall * 1e3:.1f} ms / {best_sync * 1e3:.0f} ms")
    verdict = "meets" if ratio <= 0.10 else "misses"
    print(f"verdict: {verdict} the goal (stall / synchronous save {ratio:.3f} <= 0.10)")


if __name__ == "__main__":
    main()
