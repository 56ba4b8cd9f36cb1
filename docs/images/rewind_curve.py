"""The figure of docs/rewind.md: the planted-poison run's training loss with and without `SpikeGuard`.

    python docs/images/rewind_curve.py --out docs/images/rewind_loss.png

Trains the workload of tests/integration/test_rewind.py (a small MLP regressor, one pass over 256 batches of 16,
inputs x 1e4 in batches 60 and 150) three times: on clean data, on the poisoned data without the guard, and with
it; plots every trained batch's loss in training order (log scale) and prints the held-out losses. Needs matplotlib.
"""

from __future__ import annotations

import argparse
import math
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "tests" / "exactness"))
sys.path.insert(0, str(ROOT))

from rewind_workload import PoisonData, Regressor, batch_ids, loader, val_loss  # noqa: E402

import ember  # noqa: E402
from ember.callbacks import SpikeGuard  # noqa: E402

N, BATCH, PLANTED = 4096, 16, (60, 150)


def train(data: PoisonData, guard: SpikeGuard | None, root: str) -> Regressor:
    module = Regressor(lr=0.1)
    module.record_losses = True
    trainer = ember.Trainer(
        max_epochs=1,
        default_root_dir=root,
        callbacks=[guard] if guard is not None else [],
        logger=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        enable_checkpointing=False,
    )
    trainer.fit(module, loader(data, BATCH))
    return module


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=ROOT / "docs" / "images" / "rewind_loss.png")
    args = parser.parse_args()
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    ids = batch_ids(N, BATCH)
    planted = frozenset(i for p in PLANTED for i in ids[p])
    guard = SpikeGuard(factor=10, window=16, check_every_n_steps=4, snapshot_every_n_steps=4, skip_after=1)
    held_out = PoisonData(1024, seed=1)
    with tempfile.TemporaryDirectory() as root:
        runs = {
            "clean data": train(PoisonData(N), None, root),
            "poisoned, SpikeGuard": train(PoisonData(N, planted), guard, root),
            "poisoned, no guard": train(PoisonData(N, planted), None, root),  # drawn last: on top
        }
    fig, ax = plt.subplots(figsize=(6.4, 3.2), dpi=80)
    styles = {
        "clean data": ("0.6", 3.0),
        "poisoned, no guard": ("tab:red", 1.2),
        "poisoned, SpikeGuard": ("tab:blue", 1.2),
    }
    for name, module in runs.items():
        color, width = styles[name]
        held = val_loss(module, held_out)
        ax.plot(module.losses, color=color, linewidth=width, label=f"{name} (held-out loss {held:.4g})")
        bad = next((i for i, v in enumerate(module.losses) if not math.isfinite(v)), None)
        if bad is not None:
            ax.axvline(bad, color=color, linestyle=":", linewidth=1.0)
            ax.annotate(
                f"NaN from batch {bad} on",
                (bad, 1e25),
                xytext=(6, 0),
                textcoords="offset points",
                color=color,
                fontsize=8,
            )
        print(f"{name}: held-out loss {held:.6g}, {len(module.losses)} batches trained")
    for rewind in guard.rewinds:
        print(
            f"rewind: spike at step {rewind['spike_step']}, back to step {rewind['restored_step']}, "
            f"left out batches {[b for _, b in rewind['skipped_batches']]}"
        )
    ax.set_yscale("log")
    ax.set_xlabel("batches trained, in order (rewound steps included)")
    ax.set_ylabel("training loss")
    ax.set_title("inputs x 1e4 in batches 60 and 150")
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(args.out)
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
