"""A local save with today's ember against the same save with ember at an earlier commit, side by side.

The object-storage work (URLs wherever a path goes, the manifest commit protocol, the upload mirror) must leave
a local path as it was: same code path, same speed. This script exports ember's package at `--commit` (by
default a28049d, the commit just before that work began) into a temporary folder with ``git archive``, then
runs rounds of two fresh processes, today's tree and that one in alternating order, each importing its own
ember (``PYTHONPATH``; each checks which it got). Each process trains one step of the same model (so AdamW
has its state), then times ``trainer.save_checkpoint(path)`` to a local folder `--saves` times after one
unmeasured save, and reports its fastest (other work on the machine only adds time), its median, and its
least CPU time (the process's, all threads). The figure is the median over rounds of now / before, of the
fastest saves (the medians' and the CPU times' ratios are shown too).

    python benchmarks/local_save_against.py            # 3 x Linear(1024, 1024) with AdamW (~37 MiB), 9 rounds
    python benchmarks/local_save_against.py --dir /dev/shm   # in memory: no fsync, the code's own cost
    python benchmarks/local_save_against.py --short    # 3 x Linear(128, 128), 1 round: that it runs, no figure

Goal: now / before within 2% (0.98-1.02).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
BEFORE = "a28049d"  # the commit before "Checkpoints on object storage: URLs recognized, manifest commit protocol"

CHILD = """
import json, statistics, sys, tempfile, time
from pathlib import Path
import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset
import ember

width, depth, saves, folder = int(sys.argv[1]), int(sys.argv[2]), int(sys.argv[3]), sys.argv[4] or None
torch.set_num_threads(1)
torch.manual_seed(0)

class Stack(ember.TrainingModule):
    def __init__(self):
        super().__init__()
        self.model = nn.Sequential(*[nn.Linear(width, width) for _ in range(depth)])
        self.loss_fn = nn.MSELoss()
    def configure_optimizers(self):
        return torch.optim.AdamW(self.parameters(), lr=1e-4)

with tempfile.TemporaryDirectory(prefix="ember-local-save-", dir=folder) as tmp:
    root = Path(tmp)
    data = TensorDataset(torch.randn(8, width), torch.randn(8, width))
    trainer = ember.Trainer(max_steps=1, default_root_dir=root / "runs", logger=False, enable_progress_bar=False,
                            enable_model_summary=False, enable_checkpointing=False)
    trainer.fit(Stack(), DataLoader(data, batch_size=8))
    times, cpu = [], []
    for n in range(saves + 1):
        start, start_cpu = time.perf_counter(), time.process_time()
        path = trainer.save_checkpoint(root / f"save-{n}")
        times.append(time.perf_counter() - start)
        cpu.append(time.process_time() - start_cpu)
    size = sum(f.stat().st_size for f in Path(path).rglob("*") if f.is_file())
print(json.dumps({"ember": ember.__file__, "min_s": min(times[1:]), "median_s": statistics.median(times[1:]),
                  "cpu_s": min(cpu[1:]), "bytes": size}))
"""


def export(commit: str, into: Path) -> Path:
    """ember's package at `commit`, extracted under `into`; returns the folder to put on PYTHONPATH."""
    archive = subprocess.run(["git", "-C", str(REPO), "archive", commit, "ember"], capture_output=True, check=False)
    if archive.returncode != 0:
        sys.exit(f"local_save_against: git archive {commit} failed ({archive.stderr.decode().strip()[:200]}); "
                 "run it in a clone that has that commit (not a shallow one)")  # fmt: skip
    subprocess.run(["tar", "-x", "-C", str(into)], input=archive.stdout, check=True)
    return into


def measure(tree: Path, width: int, depth: int, saves: int, folder: str) -> dict[str, float]:
    env = dict(os.environ, PYTHONPATH=str(tree), OMP_NUM_THREADS="1")
    done = subprocess.run([sys.executable, "-c", CHILD, str(width), str(depth), str(saves), folder], env=env, cwd=tree,
                          capture_output=True, text=True, check=False)  # fmt: skip
    if done.returncode != 0:
        sys.exit(f"local_save_against: the save in {tree} failed:\n{done.stderr[-2000:]}")
    result: dict[str, float] = json.loads(done.stdout.strip().splitlines()[-1])
    if not str(result["ember"]).startswith(str(tree)):  # type: ignore[arg-type]
        sys.exit(f"local_save_against: the process meant for {tree} imported {result['ember']}")
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--short", action="store_true", help="a small model, one round: that it runs")
    parser.add_argument("--commit", default=BEFORE, help=f"the earlier ember (default {BEFORE})")
    parser.add_argument("--rounds", type=int, default=None, help="rounds of both (default 9; 1 with --short)")
    parser.add_argument("--saves", type=int, default=None, help="timed saves per process (default 15; 2 with --short)")
    parser.add_argument("--dir", default="", help="the folder saved into (default: the temporary folder; "
                        "/dev/shm leaves the disk's own variation out)")  # fmt: skip
    args = parser.parse_args()
    width, depth = (128, 3) if args.short else (1024, 3)
    rounds = args.rounds or (1 if args.short else 9)
    saves = args.saves or (2 if args.short else 15)
    with tempfile.TemporaryDirectory(prefix="ember-before-") as tmp:
        before = export(args.commit, Path(tmp))
        ratios, medians, cpus, now_s, before_s = [], [], [], [], []
        for r in range(rounds):
            order = [("now", REPO), ("before", before)]
            trees = order[:: 1 if r % 2 == 0 else -1]
            results = {name: measure(tree, width, depth, saves, args.dir) for name, tree in trees}
            now, then = results["now"], results["before"]
            now_s.append(now["min_s"])
            before_s.append(then["min_s"])
            ratios.append(now["min_s"] / then["min_s"])
            medians.append(now["median_s"] / then["median_s"])
            cpus.append(now["cpu_s"] / then["cpu_s"])
            print(f"round {r + 1}: fastest save now {now['min_s'] * 1e3:.1f} ms, before {then['min_s'] * 1e3:.1f} ms, "
                  f"now / before {ratios[-1]:.3f} (medians {now['median_s'] * 1e3:.1f} / "
                  f"{then['median_s'] * 1e3:.1f} ms: {medians[-1]:.3f}; CPU time {cpus[-1]:.3f})",
                  flush=True)  # fmt: skip
    size = results["now"]["bytes"] / 2**20
    print(f"model: {depth} x Linear({width}, {width}) with AdamW, a local checkpoint of {size:.1f} MiB; "
          f"ember now ({REPO.name}) against ember at {args.commit}")  # fmt: skip
    print(f"save_checkpoint, fastest of {saves} per process, median over rounds: now "
          f"{statistics.median(now_s) * 1e3:.1f} ms, before {statistics.median(before_s) * 1e3:.1f} ms; "
          f"now / before of the medians: {statistics.median(medians):.3f}, of the CPU times: "
          f"{statistics.median(cpus):.3f}")  # fmt: skip
    ratio = statistics.median(ratios)
    if args.short:
        print(f"now / before {ratio:.3f} (one round of a small model: no verdict)")
        return
    verdict = "meets" if 0.98 <= ratio <= 1.02 else ("faster than" if ratio < 0.98 else "misses")
    print(f"verdict: {verdict} the goal (now / before {ratio:.3f}, median of {rounds} alternating rounds, within 2%)")


if __name__ == "__main__":
    main()
