"""docs/migrating-from-lightning.md: the ember side of its complete port runs as written, and does what it says."""

from __future__ import annotations

import csv
import re
from pathlib import Path
from typing import Any

import pytest

GUIDE = Path(__file__).resolve().parents[2] / "docs" / "migrating-from-lightning.md"


def port_source(side: str) -> str:
    """The code block that follows ``<!-- port: {side} -->`` in the guide."""
    match = re.search(rf"<!-- port: {side} -->\n```python\n(.*?)```", GUIDE.read_text(), re.DOTALL)
    assert match is not None, f"no '<!-- port: {side} -->' code block in {GUIDE}"
    return match.group(1)


@pytest.mark.slow  # 4 s of CPU on a 2-core machine, with the processes it starts
def test_the_ember_side_of_the_port_runs_and_trains() -> None:
    namespace: dict[str, Any] = {"__name__": "port"}
    exec(compile(port_source("ember"), str(GUIDE), "exec"), namespace)
    trainer, results = namespace["trainer"], namespace["results"]
    assert results[0]["test/acc"] > 0.85  # four well-separated blobs
    best = trainer.checkpoint_callback.best_model_path
    assert Path(best).is_dir() and trainer.ckpt_path == Path(best)  # test ran on the best checkpoint's weights
    assert Path("data/blobs.pt").is_file()  # written by prepare_data
    rows = list(csv.DictReader((trainer.run_dir / "metrics.csv").open()))
    assert any(row.get("val/acc") for row in rows) and any(row.get("lr-Adam") for row in rows)
    assert trainer.optimizers[0].param_groups[0]["lr"] <= 1e-2


def test_the_two_sides_differ_only_where_the_guide_says() -> None:
    lightning, ember_side = port_source("lightning").splitlines(), port_source("ember").splitlines()
    changed = [(a, b) for a, b in zip(lightning, ember_side, strict=True) if a != b]
    assert [b for _, b in changed] == [
        "import ember",
        "from ember.callbacks import EarlyStopping, LearningRateMonitor, ModelCheckpoint",
        "from ember.loggers import CSVLogger",
        "class BlobsData(ember.DataModule):",
        "class LitClassifier(ember.TrainingModule):",
        "ember.seed_everything(42, workers=True)",
        "trainer = ember.Trainer(",
        "    logger=CSVLogger(),",
    ]
