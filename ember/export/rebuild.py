"""``ember export``'s side of checkpoints: which checkpoint ``--ckpt`` names, the module to load it into,
and the example input to trace it on.

A checkpoint is data: nothing it names is imported or called. The module is built from what the user
gives: the ``-c`` config, or a class named with ``--module`` (given the checkpoint's hyperparameters as
plain keyword arguments). The config recorded in the checkpoint is only compared with the given one, and
differences are reported. ``--trust-checkpoint`` opts in to rebuilding from the recorded config; even
then only `TrainingModule` / `DataModule` subclasses are built (checked before calling), with plain-data
arguments. A checkpoint of another module than the one built, or weights that do not fit it, is a
`ConfigError`.
"""

from __future__ import annotations

import sys
from pathlib import Path
from typing import TYPE_CHECKING, Any

from torch import Tensor

from ember import checkpoint, stages
from ember.checkpoint.hparams import for_checkpoint
from ember.config import ConfigError, import_target, instantiate
from ember.config.targets import nested_target, wrong_kind
from ember.trainer.setup import run_name

if TYPE_CHECKING:
    from ember.modules.module import TrainingModule

#: How many rows of a data batch become the example input.
EXAMPLE_ROWS = 4


def find_checkpoint(ckpt: str, config: dict[str, Any] | None, module_class: str | None = None) -> Path:
    """The checkpoint directory ``--ckpt`` names: a path (a checkpoint directory or a ``last`` file), or
    ``last``: the newest complete checkpoint of the run the config (or the ``--module`` class) names, or
    ``best``: the best checkpoint that run's ``ModelCheckpoint(monitor=...)`` recorded."""
    if ckpt in ("last", "best"):
        if config is not None:
            trainer = config["trainer"]
            name = trainer["run_name"] or run_name(import_target(config["module"]["_target_"]))
            if checkpoint.is_url(trainer["default_root_dir"]):  # the run lives on a store
                return _last_on_store(ckpt, f"{str(trainer['default_root_dir']).rstrip('/')}/{name}")
            root = Path(trainer["default_root_dir"]) / name
            folders = [
                Path(spec["dirpath"])
                for spec in trainer["callbacks"] or []
                if _is_checkpoint_callback(spec) and not checkpoint.is_url(spec["dirpath"])  # local copies first
            ]
        elif module_class is not None:
            root, folders = Path("runs") / run_name(_user_class(module_class)), []
        else:
            raise ConfigError(
                f"--ckpt {ckpt}: give the run's config with -c FILE (it names the run), or a checkpoint path"
            )
        if ckpt == "best":
            try:
                return checkpoint.find_best(folders, root)
            except checkpoint.CheckpointError as exc:
                raise ConfigError(f"--ckpt best: {exc}") from exc
        found = checkpoint.find_last(folders, checkpoint.versions_newest_first(root))
        if found is None:
            raise ConfigError(
                f"--ckpt last: no complete checkpoint under {root}; train first (ember fit) or give a path"
            )
        return found[0]
    try:
        if checkpoint.is_url(ckpt):  # on a store: downloaded and checked against its manifest
            return checkpoint.resolve_path(checkpoint.fetch_checkpoint(ckpt, "--ckpt"))
        return checkpoint.resolve_path(Path(ckpt))
    except checkpoint.CheckpointError as exc:
        raise ConfigError(f"--ckpt: {exc}") from exc


def _last_on_store(ckpt: str, url_root: str) -> Path:
    """``--ckpt last`` of a run whose ``default_root_dir`` is a URL: the store's newest committed checkpoint."""
    from ember.checkpoint import run_store
    from ember.checkpoint.store import redact

    shown = redact(url_root)
    if ckpt == "best":
        raise ConfigError(f"--ckpt best: the run is on a store ({shown}); give the checkpoint's URL with --ckpt")
    try:
        found = run_store.newest_on_store(url_root)
        if found is None:
            raise ConfigError(f"--ckpt last: no committed checkpoint under {shown}; train first (ember fit)")
        return checkpoint.resolve_path(checkpoint.fetch_checkpoint(found[1], "--ckpt"))
    except checkpoint.CheckpointError as exc:
        raise ConfigError(f"--ckpt: {exc}") from exc


def _is_checkpoint_callback(spec: Any) -> bool:
    return isinstance(spec, dict) and bool(spec.get("dirpath")) and "ModelCheckpoint" in str(spec.get("_target_"))


def rebuild_module(
    path: Path, config: dict[str, Any] | None, module_class: str | None = None, trust: bool = False
) -> tuple[TrainingModule, dict[str, Any] | None]:
    """(the module to export, with checkpoint `path`'s weights, in eval mode; the config to take data from).

    Built from `config` (the user's ``-c``), else from `module_class` (a class the user named) with the
    checkpoint's hyperparameters, else, with `trust`, from the config recorded in the checkpoint.
    """
    from ember.modules.module import TrainingModule

    try:
        meta, weights = checkpoint.read_module_state(path)
    except checkpoint.CheckpointError as exc:
        raise ConfigError(f"--ckpt: {exc}") from exc
    saved = meta.get("config") if isinstance(meta.get("config"), dict) else None
    trained = meta.get("module_class") if isinstance(meta.get("module_class"), str) else None
    data_config = config
    if config is not None:
        module = instantiate(config["module"], "module", base=TrainingModule)
    elif module_class is not None:
        module = _build_with_hparams(_user_class(module_class), module_class, meta.get("hparams"), path)
    elif trust:
        module, data_config = _rebuild_trusted(path, saved, trained, meta.get("hparams")), saved
        if data_config is not None and isinstance(data_config.get("data"), dict):
            check_plain_section(data_config["data"], "data", path)
    else:
        recorded = f" (it records {trained})" if trained else ""
        raise ConfigError(
            f"--ckpt {path}: say which module to load it into{recorded}: give the run's config with -c FILE, or "
            "name the class with --module pkg.module.Class; a checkpoint is data, so nothing it names is imported "
            "(--trust-checkpoint rebuilds from its recorded config, for checkpoints you trust)"
        )
    built = f"{type(module).__module__}.{type(module).__qualname__}"
    if trained and not _same_class(trained, built) and module_class is None:
        raise ConfigError(
            f"checkpoint {path} holds a {trained} module, but the config builds {built}; "
            "give a checkpoint of this config's module, or the config it was trained with"
        )
    if config is not None and saved is not None and isinstance(saved.get("module"), dict):
        report_differences(saved["module"], config["module"], "module", "using the config's")
    try:
        hint = checkpoint.mismatch_hint(meta, config, for_checkpoint(module.hparams))
        checkpoint.load_weights_into(module, weights, path, trained, hint=hint)
    except checkpoint.CheckpointError as exc:
        raise ConfigError(str(exc)) from exc
    return module.eval(), data_config


def _user_class(dotted: str) -> type[TrainingModule]:
    """The `TrainingModule` subclass the user named on the command line (their code, so it may be imported)."""
    from ember.modules.module import TrainingModule

    try:
        cls = import_target(dotted)
    except ImportError as exc:
        raise ConfigError(f"--module: cannot import {dotted}: {exc}") from exc
    problem = wrong_kind(cls, dotted, TrainingModule)
    if problem is not None:
        raise ConfigError(f"--module: {problem}")
    return cls


def _build_with_hparams(cls: type[TrainingModule], name: str, hparams: Any, path: Path) -> TrainingModule:
    """``cls(**hparams)``: the checkpoint's hyperparameters are plain keyword arguments, never built."""
    from ember.checkpoint.hparams import from_checkpoint

    if not isinstance(hparams, dict):
        hparams = {}
    try:
        return cls(**from_checkpoint(hparams, {}, name))
    except TypeError as exc:
        raise ConfigError(
            f"cannot build {name} from the hyperparameters saved in {path} ({exc}); give the run's config with -c"
        ) from exc


def _rebuild_trusted(path: Path, saved: dict[str, Any] | None, trained: str | None, hparams: Any) -> TrainingModule:
    """``--trust-checkpoint``: the recorded module section (or class and hparams), checked before calling."""
    from ember.modules.module import TrainingModule

    spec = saved.get("module") if saved is not None else None
    if isinstance(spec, dict) and "_target_" in spec:
        check_plain_section(spec, "module", path)
        built: TrainingModule = instantiate(spec, "module", base=TrainingModule)
        return built
    if trained is None:
        raise ConfigError(f"--ckpt {path}: the checkpoint records no module to rebuild; give -c or --module")
    return _build_with_hparams(_user_class(trained), trained, hparams, path)


def check_plain_section(spec: dict[str, Any], key: str, path: Path) -> None:
    """A recorded section may be rebuilt only with plain-data arguments: no nested ``_target_``."""
    nested = nested_target(spec, key)
    if nested is not None:
        raise ConfigError(
            f"checkpoint {path}: {nested} holds a _target_ section; a recorded config is rebuilt only with "
            "plain-data arguments (give the run's config with -c instead)"
        )


def _same_class(trained: str, built: str) -> bool:
    """A module trained from ``python my_script.py`` is recorded as ``__main__.Class``."""
    return trained == built or (trained.startswith("__main__.") and built.endswith("." + trained.split(".", 1)[1]))


def report_differences(saved: Any, given: Any, key: str, outcome: str) -> list[str]:
    """Print one note per leaf where the recorded `saved` section differs from the `given` one; returns the keys.

    The recorded values are shown (repr), never built or imported.
    """
    found = checkpoint.differences(saved, given, key)
    for name, old, new in found:
        print(
            f"ember: note: {name}: the checkpoint was trained with {old!r}, the config says {new!r}; {outcome} "
            "(the checkpoint's is not used)",
            file=sys.stderr,
        )
    return [name for name, _, _ in found]


def example_input(module: TrainingModule, data_spec: dict[str, Any] | None) -> Any:
    """None when the module has ``example_input_array``; else the first ``EXAMPLE_ROWS`` inputs of the
    first batch of the data's predict (else val, test, train) dataloader."""
    from ember.modules.datamodule import DataModule

    if getattr(module, "example_input_array", None) is not None:
        return None
    name = type(module).__qualname__
    data = instantiate(data_spec, "data", base=DataModule) if data_spec else None
    if not isinstance(data, DataModule):
        raise ConfigError(
            f"{name} has no example_input_array and there is no data section to take a batch from; "
            "set self.example_input_array in __init__ (e.g. torch.zeros(2, 64)), or give the run's config with -c"
        )
    for stage in (stages.PREDICT, stages.VALIDATE, stages.TEST, stages.FIT):  # the data an export is likeliest fed
        if data.has_dataloader(stage.loader):
            data.setup(stage.name)
            loader = getattr(data, f"{stage.loader}_dataloader")()
            batch = next(iter(loader[0] if isinstance(loader, (list, tuple)) else loader))
            inputs = batch[0] if isinstance(batch, (tuple, list)) else batch
            return inputs[:EXAMPLE_ROWS] if isinstance(inputs, Tensor) and inputs.ndim else inputs
    raise ConfigError(
        f"{name} has no example_input_array and {type(data).__qualname__} defines no dataloader; "
        "set self.example_input_array in __init__"
    )
