"""``ember export``'s side of checkpoints: which checkpoint ``--ckpt`` names, the module it was trained
as, and the example input to trace it on.

The module is rebuilt from the ``module`` section of the config saved in the checkpoint (``ember fit``
saves the resolved config in every checkpoint), falling back to the ``-c`` config, then to the
checkpoint's module class and hyperparameters. A checkpoint of another module than the config's, or
weights that do not fit the module built, is a `ConfigError`.
"""

from __future__ import annotations

import re
import sys
from pathlib import Path
from typing import TYPE_CHECKING, Any

from torch import Tensor

from ember import checkpoint
from ember.config import ConfigError, import_target, instantiate
from ember.trainer.setup import run_name

if TYPE_CHECKING:
    from ember.modules.module import TrainingModule

#: How many rows of a data batch become the example input.
EXAMPLE_ROWS = 4

_SETUP_STAGE = {"predict": "predict", "val": "validate", "test": "test", "train": "fit"}


def find_checkpoint(ckpt: str, config: dict[str, Any] | None) -> Path:
    """The checkpoint directory ``--ckpt`` names: a path (a checkpoint directory or a ``last`` file), or
    ``last``: the newest complete checkpoint of the config's run name."""
    from ember.trainer.checkpointing import CHECKPOINT_SUBDIR

    if ckpt == "last":
        if config is None:
            raise ConfigError(
                "--ckpt last: give the run's config with -c FILE (it names the run), or a checkpoint path"
            )
        trainer = config["trainer"]
        name = trainer["run_name"] or run_name(import_target(config["module"]["_target_"]))
        root = Path(trainer["default_root_dir"]) / name
        folders = [Path(spec["dirpath"]) for spec in trainer["callbacks"] or [] if _is_checkpoint_callback(spec)]
        folders += [v / CHECKPOINT_SUBDIR for v in _versions_newest_first(root)]
        for folder in folders:
            found = checkpoint.newest_valid(folder)
            if found is not None:
                return found
        raise ConfigError(f"--ckpt last: no complete checkpoint under {root}; train first (ember fit) or give a path")
    path = Path(ckpt)
    if path.is_file() and path.name == checkpoint.LAST_FILE:
        path = path.parent / path.read_text(encoding="utf-8").strip()
    try:
        checkpoint.check_complete(path)
    except checkpoint.CheckpointError as exc:
        raise ConfigError(f"--ckpt: {exc}") from exc
    return path


def _is_checkpoint_callback(spec: Any) -> bool:
    return isinstance(spec, dict) and bool(spec.get("dirpath")) and "ModelCheckpoint" in str(spec.get("_target_"))


def _versions_newest_first(root: Path) -> list[Path]:
    found = [(int(m.group(1)), p) for p in root.glob("version_*") if (m := re.fullmatch(r"version_(\d+)", p.name))]
    return [p for _, p in sorted(found, reverse=True)]


def rebuild_module(path: Path, config: dict[str, Any] | None) -> tuple[TrainingModule, dict[str, Any] | None]:
    """(the module trained in checkpoint `path` with its weights, in eval mode; the config saved in it)."""
    from ember.modules.module import TrainingModule

    try:
        meta, weights = checkpoint.read_module_state(path)
    except checkpoint.CheckpointError as exc:
        raise ConfigError(f"--ckpt: {exc}") from exc
    saved = meta.get("config") if isinstance(meta.get("config"), dict) else None
    saved_spec = saved.get("module") if saved else None
    given_spec = config["module"] if config else None
    trained = meta.get("module_class")
    if saved_spec and given_spec:
        _compare_specs(path, saved_spec, given_spec)
    spec = saved_spec or given_spec
    if spec is not None:
        module = instantiate(spec, "module")
    else:  # a checkpoint written outside `ember fit`, exported without -c
        cls = import_target(str(trained))
        module = cls(**meta.get("hparams", {}))
    if not isinstance(module, TrainingModule):
        raise ConfigError(f"module: built a {type(module).__qualname__}, not an ember.TrainingModule")
    built = f"{type(module).__module__}.{type(module).__qualname__}"
    if trained and not _same_class(str(trained), built):
        raise ConfigError(
            f"checkpoint {path} holds a {trained}, but the config builds a {built}; "
            "give a checkpoint of this config's module, or the config it was trained with"
        )
    try:
        checkpoint.load_weights_into(module, weights, path, trained)
    except checkpoint.CheckpointError as exc:
        raise ConfigError(
            f"{exc} (the checkpoint does not match the module the config builds; give the config it was trained with)"
        ) from exc
    return module.eval(), saved


def _same_class(trained: str, built: str) -> bool:
    """A module trained from ``python my_script.py`` is recorded as ``__main__.Class``."""
    return trained == built or (trained.startswith("__main__.") and built.endswith("." + trained.split(".", 1)[1]))


def _compare_specs(path: Path, saved: dict[str, Any], given: dict[str, Any]) -> None:
    """The checkpoint's module section wins; a different class is an error, other differences a note."""
    if saved.get("_target_") != given.get("_target_"):
        raise ConfigError(
            f"checkpoint {path} was trained as module._target_={saved.get('_target_')}, but the config says "
            f"{given.get('_target_')}; give a checkpoint of this config, or leave out -c to use the checkpoint's own"
        )
    for key in sorted(set(saved) | set(given)):
        if saved.get(key) != given.get(key):
            print(
                f"ember: note: module.{key}: the checkpoint was trained with {saved.get(key)!r}, the config says "
                f"{given.get(key)!r}; exporting the checkpoint's",
                file=sys.stderr,
            )


def example_input(module: TrainingModule, data_spec: dict[str, Any] | None) -> Any:
    """None when the module has ``example_input_array``; else the first ``EXAMPLE_ROWS`` inputs of the
    first batch of the data's predict (else val, test, train) dataloader."""
    from ember.modules.datamodule import DataModule

    if getattr(module, "example_input_array", None) is not None:
        return None
    name = type(module).__qualname__
    data = instantiate(data_spec, "data") if data_spec else None
    if not isinstance(data, DataModule):
        raise ConfigError(
            f"{name} has no example_input_array and there is no data section to take a batch from; "
            "set self.example_input_array in __init__ (e.g. torch.zeros(2, 64))"
        )
    for stage, setup_stage in _SETUP_STAGE.items():
        if data.has_dataloader(stage):
            data.setup(setup_stage)
            loader = getattr(data, f"{stage}_dataloader")()
            batch = next(iter(loader[0] if isinstance(loader, (list, tuple)) else loader))
            inputs = batch[0] if isinstance(batch, (tuple, list)) else batch
            return inputs[:EXAMPLE_ROWS] if isinstance(inputs, Tensor) and inputs.ndim else inputs
    raise ConfigError(
        f"{name} has no example_input_array and {type(data).__qualname__} defines no dataloader; "
        "set self.example_input_array in __init__"
    )
