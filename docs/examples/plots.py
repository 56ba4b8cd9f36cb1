"""The figures of the examples page, drawn from the runs' own files (``metrics.csv``, the TensorBoard images).

    python docs/examples/plots.py --runs runs --out docs/examples/img

reads ``runs/char_transformer``, ``runs/hf_lm``, ``runs/hf_lm_ctx39`` and ``runs/segmentation`` (the newest
version of each, as left by the commands in examples/README.md) and writes ``lm_bits_per_byte.png``,
``segmentation_metrics.png`` and ``segmentation_grid.png`` (the last validation's input / target / prediction
grid, read back from the TensorBoard event file). Needs matplotlib.
"""

from __future__ import annotations

import argparse
import csv
import math
import re
from pathlib import Path


def newest_version(root: Path) -> Path:
    versions = [(int(m.group(1)), p) for p in root.glob("version_*") if (m := re.fullmatch(r"version_(\d+)", p.name))]
    if not versions:
        raise FileNotFoundError(f"no runs under {root}; run the example first (examples/README.md)")
    return max(versions)[1]


def epoch_rows(run: Path, key: str) -> list[tuple[int, float]]:
    """(step, value) of every metrics.csv row that has `key`."""
    with open(run / "metrics.csv", newline="") as f:
        return [(int(row["step"]), float(row[key])) for row in csv.DictReader(f) if row.get(key)]


def plot_language_models(runs: Path, out: Path) -> None:
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6.4, 3.6), dpi=120)
    char = epoch_rows(newest_version(runs / "char_transformer"), "val/loss")
    ax.plot(
        [s for s, _ in char],
        [v / math.log(2) for _, v in char],
        "o-",
        label="char transformer (bytes, 128-byte context)",
    )
    for name, label in (("hf_lm", "GPT-2 + BPE, 128-token context"), ("hf_lm_ctx39", "GPT-2 + BPE, 39-token context")):
        if (runs / name).is_dir():
            rows = epoch_rows(newest_version(runs / name), "val/bpb")
            ax.plot([s for s, _ in rows], [v for _, v in rows], "o-", label=label)
    ax.set_xlabel("optimizer step (batches of 32 windows)")
    ax.set_ylabel("validation bits per byte")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(out / "lm_bits_per_byte.png")
    plt.close(fig)


def plot_segmentation(runs: Path, out: Path) -> None:
    import matplotlib.pyplot as plt
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    run = newest_version(runs / "segmentation")
    fig, ax = plt.subplots(figsize=(6.4, 3.2), dpi=120)
    for key in ("val/dice", "val/jaccard"):
        rows = epoch_rows(run, key)
        ax.plot([s for s, _ in rows], [v for _, v in rows], "o-", label=key)
    ax.set_xlabel("optimizer step")
    ax.set_ylim(0, 1)
    ax.grid(alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(out / "segmentation_metrics.png")
    plt.close(fig)
    events = EventAccumulator(str(run / "tensorboard"), size_guidance={"images": 0})
    events.Reload()
    (out / "segmentation_grid.png").write_bytes(events.Images("val/examples")[-1].encoded_image_string)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--runs", type=Path, default=Path("runs"))
    parser.add_argument("--out", type=Path, default=Path("docs/examples/img"))
    args = parser.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    plot_language_models(args.runs, args.out)
    plot_segmentation(args.runs, args.out)
    print(f"figures written to {args.out}")


if __name__ == "__main__":
    main()
