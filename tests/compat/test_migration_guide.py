"""docs/migrating-from-lightning.md: both sides of the complete port, run on the same (unshuffled) batches,
end alike; the guide's recipe for carrying a Lightning checkpoint's weights over works."""

from __future__ import annotations

import math
import re
from pathlib import Path
from typing import Any

import pytest
import torch
from compat_harness import pl  # noqa: F401  (skips this file when Lightning is not installed)

GUIDE = Path(__file__).resolve().parents[2] / "docs" / "migrating-from-lightning.md"

pytestmark = [pytest.mark.filterwarnings("ignore::UserWarning"), pytest.mark.filterwarnings("ignore::FutureWarning")]


def run_side(side: str) -> dict[str, Any]:
    match = re.search(rf"<!-- port: {side} -->\n```python\n(.*?)```", GUIDE.read_text(), re.DOTALL)
    assert match is not None
    source = match.group(1)
    assert source.count("shuffle=True") == 1
    # The frameworks shuffle alike in the first epoch only (Lightning's loop leaves the sampler's last draw
    # undone); unshuffled, both see the same batches in every epoch.
    namespace: dict[str, Any] = {"__name__": f"port_{side}"}
    exec(compile(source.replace("shuffle=True", "shuffle=False"), f"{GUIDE}:{side}", "exec"), namespace)
    return namespace


def best_epoch(path: str) -> int:
    found = re.search(r"epoch=(\d+)", Path(path).name)
    assert found is not None, path
    return int(found.group(1))


def test_both_sides_of_the_port_end_alike() -> None:
    theirs, mine = run_side("lightning"), run_side("ember")
    their_trainer, my_trainer = theirs["trainer"], mine["trainer"]
    assert my_trainer.current_epoch == their_trainer.current_epoch  # early stopping stopped at the same epoch
    their_best, my_best = their_trainer.checkpoint_callback, my_trainer.checkpoint_callback
    assert best_epoch(my_best.best_model_path) == best_epoch(their_best.best_model_path)
    assert math.isclose(float(my_best.best_model_score), float(their_best.best_model_score), abs_tol=1e-6)
    assert math.isclose(mine["results"][0]["test/acc"], theirs["results"][0]["test/acc"], abs_tol=1e-6)
    assert my_trainer.optimizers[0].param_groups[0]["lr"] == their_trainer.optimizers[0].param_groups[0]["lr"]

    # The guide's recipe: a Lightning checkpoint's weights into the ported module.
    state = torch.load(their_best.best_model_path, map_location="cpu", weights_only=True)["state_dict"]
    ported = mine["LitClassifier"]()
    ported.load_state_dict(state)
    (again,) = mine["ember"].Trainer(logger=False, enable_progress_bar=False).test(ported, mine["dm"])
    assert math.isclose(again["test/acc"], theirs["results"][0]["test/acc"], abs_tol=1e-6)
