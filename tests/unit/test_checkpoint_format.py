"""The checkpoint format: bad checkpoints fail with one clear error, nothing runs, nothing is overwritten.

A checkpoint is a directory (``.metadata`` + ``__0_0.distcp`` from
torch.distributed.checkpoint, ``ember.pt`` and ``rank-0.pt`` from
``torch.save``). Every way ember reads one is tried on each kind of damage:
``fit(ckpt_path=...)``, ``validate(ckpt_path=...)``,
``TrainingModule.load_from_checkpoint`` and the ``last`` finder
(`ember.checkpoint.newest_valid`). Each must raise
`ember.checkpoint.CheckpointError` naming the directory and the problem
(the finder instead skips the checkpoint with a warning), leave every file
as it was and the module's weights untouched.

The crafted-pickle tests plant an object whose unpickling creates a marker
file into every file ember unpickles; a control first shows the payload does
create the marker when unpickled the ordinary way, so the test is not vacuous.
"""

from __future__ import annotations

import contextlib
import os
import pickle
import re
import warnings
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed.checkpoint as dcp
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from ember import Callback, Trainer, TrainingModule
from ember import checkpoint as ckpt
from ember.callbacks.model_checkpoint import ModelCheckpoint
from ember.checkpoint import CheckpointError, dcp_writer

QUIET: dict[str, Any] = dict(logger=False, enable_progress_bar=False, enable_model_summary=False)
SHARD = "__0_0.distcp"


def loader() -> DataLoader:
    g = torch.Generator().manual_seed(0)
    x, y = torch.randn(16, 4, generator=g), torch.randn(16, 1, generator=g)
    return DataLoader(TensorDataset(x, y), batch_size=4)  # 4 steps per epoch


class Net(TrainingModule):
    def __init__(self, hidden: int = 8, dropout: float = 0.0) -> None:
        super().__init__()
        self.save_hyperparameters()
        self.model = nn.Sequential(nn.Linear(4, hidden), nn.ReLU(), nn.Dropout(dropout), nn.Linear(hidden, 1))
        self.loss_fn = nn.MSELoss()

    def configure_optimizers(self) -> Any:
        return torch.optim.AdamW(self.parameters(), lr=0.01)


class Other(TrainingModule):
    """Same hyperparameters as `Net`, different parameter names."""

    def __init__(self, hidden: int = 8, dropout: float = 0.0) -> None:
        super().__init__()
        self.save_hyperparameters()
        self.encoder = nn.Linear(4, hidden)
        self.head = nn.Linear(hidden, 1)
        self.loss_fn = nn.MSELoss()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(torch.relu(self.encoder(x)))

    def configure_optimizers(self) -> Any:
        return torch.optim.AdamW(self.parameters(), lr=0.01)


class StartStep(Callback):
    """Records the global step at which training (re)starts."""

    def __init__(self) -> None:
        self.start_step: int | None = None

    def on_train_start(self, trainer: Any, module: Any) -> None:
        self.start_step = trainer.global_step


@pytest.fixture
def ckpt_dir(tmp_path: Path) -> Path:
    """Two epochs of `Net`, a checkpoint after each: ``epoch=0-step=4``, ``epoch=1-step=8`` (``last``)."""
    torch.manual_seed(0)
    trainer = Trainer(max_epochs=2, callbacks=[ModelCheckpoint(tmp_path / "ckpts", save_top_k=-1)], **QUIET)
    trainer.fit(Net(), loader(), loader())
    directory = tmp_path / "ckpts"
    assert sorted(p.name for p in directory.iterdir()) == ["epoch=0-step=4", "epoch=1-step=8", "last"]
    return directory


def newest(directory: Path) -> Path:
    return directory / "epoch=1-step=8"


def tree(root: Path) -> dict[str, bytes]:
    """Every file under `root` (hidden ones included) with its bytes."""
    return {str(p.relative_to(root)): p.read_bytes() for p in sorted(root.rglob("*")) if p.is_file()}


def params(module: nn.Module) -> list[torch.Tensor]:
    return [p.detach().clone() for p in module.parameters()]


def same(a: list[torch.Tensor], b: list[torch.Tensor]) -> bool:
    return len(a) == len(b) and all(torch.equal(x, y) for x, y in zip(a, b, strict=True))


# --- every way ember reads a checkpoint -------------------------------------------------------------


def entry_points(path: Path, fresh_root: Path, module_cls: type[TrainingModule] = Net) -> dict[str, Callable[[], Any]]:
    """Loaders of `path`; each one checks that the module it was given kept its weights."""

    def run_fit() -> None:
        module = module_cls()
        before = params(module)
        trainer = Trainer(max_epochs=3, enable_checkpointing=False, default_root_dir=fresh_root, **QUIET)
        try:
            trainer.fit(module, loader(), ckpt_path=path)
        finally:
            assert same(before, params(module)), "the module's weights changed although the checkpoint was rejected"

    def run_validate() -> None:
        module = module_cls()
        before = params(module)
        trainer = Trainer(enable_checkpointing=False, default_root_dir=fresh_root, **QUIET)
        try:
            trainer.validate(module, loader(), ckpt_path=path)
        finally:
            assert same(before, params(module)), "the module's weights changed although the checkpoint was rejected"

    return {
        "fit(ckpt_path)": run_fit,
        "validate(ckpt_path)": run_validate,
        "load_from_checkpoint": lambda: module_cls.load_from_checkpoint(path),
    }


def outcome(load: Callable[[], Any], pattern: str) -> str | None:
    """None when `load` raised a CheckpointError matching `pattern`, else what happened instead."""
    try:
        load()
    except CheckpointError as exc:
        return None if re.search(pattern, str(exc)) else f"CheckpointError without {pattern!r}: {exc}"
    except (KeyboardInterrupt, SystemExit):
        raise
    except BaseException as exc:  # torch's CheckpointException derives from BaseException
        first = str(exc).strip().splitlines()[0] if str(exc).strip() else ""
        return f"{type(exc).__module__}.{type(exc).__qualname__} ({type(exc).__mro__[1].__name__}): {first}"
    return "no error"


def assert_rejected(path: Path, problem: str, tmp_path: Path, module_cls: type[TrainingModule] = Net) -> None:
    """Every entry point raises one CheckpointError naming `path` and `problem`; no file changes."""
    before = tree(path.parent)
    pattern = re.escape(str(path)) + r".*" + problem
    fresh_root = tmp_path / "fresh-runs"
    failures = {}
    for name, load in entry_points(path, fresh_root, module_cls).items():
        result = outcome(load, pattern)
        if result is not None:
            failures[name] = result
    assert not failures, f"expected CheckpointError matching {pattern!r}; got {failures}"
    assert tree(path.parent) == before, "a rejected checkpoint (or its siblings) changed on disk"


# --- damaged files --------------------------------------------------------------------------------------


def test_truncated_shard(ckpt_dir: Path, tmp_path: Path) -> None:
    shard = newest(ckpt_dir) / SHARD
    shard.write_bytes(shard.read_bytes()[: shard.stat().st_size // 2])
    assert_rejected(newest(ckpt_dir), f"shard {SHARD} is truncated", tmp_path)
    assert not (tmp_path / "fresh-runs").exists(), "a rejected run created a run directory"


@pytest.mark.parametrize(
    ("name", "problem"),
    [
        (".metadata", r"incomplete: \.metadata is missing"),
        (SHARD, f"incomplete: shard {SHARD} is missing"),
        ("ember.pt", r"incomplete: ember\.pt is missing"),
        ("rank-0.pt", r"incomplete: rank-0\.pt is missing"),
    ],
)
def test_missing_file(ckpt_dir: Path, tmp_path: Path, name: str, problem: str) -> None:
    (newest(ckpt_dir) / name).unlink()
    path = newest(ckpt_dir)
    if name == "rank-0.pt":  # load_from_checkpoint needs weights only, which are all there
        fresh = tmp_path / "fresh-runs"
        for entry, load in entry_points(path, fresh).items():
            if entry != "load_from_checkpoint":
                assert outcome(load, re.escape(str(path)) + ".*" + problem) is None, entry
        return
    assert_rejected(path, problem, tmp_path)


def test_different_module_lists_first_missing_and_unexpected_keys(ckpt_dir: Path, tmp_path: Path) -> None:
    problem = (
        r"holds a different module \(.*Net\) than Other: "
        r"missing keys \['encoder\.weight', 'encoder\.bias', 'head\.weight', 'head\.bias'\]; "
        r"unexpected keys \['model\.0\.weight', 'model\.0\.bias', 'model\.3\.weight', 'model\.3\.bias'\]"
    )
    assert_rejected(newest(ckpt_dir), problem, tmp_path, module_cls=Other)


def test_different_shape_names_the_key(ckpt_dir: Path, tmp_path: Path) -> None:
    class Wider(Net):
        def __init__(self, hidden: int = 16, dropout: float = 0.0) -> None:
            super().__init__(hidden, dropout)

    before = tree(ckpt_dir)
    path = newest(ckpt_dir)
    problem = r"model\.0\.weight has shape \(8, 4\), the module expects \(16, 4\)"
    for name, load in entry_points(path, tmp_path / "fresh-runs", Wider).items():
        if name != "load_from_checkpoint":  # that one rebuilds from the saved hidden=8 and succeeds
            assert outcome(load, re.escape(str(path)) + ".*" + problem) is None, name
    assert outcome(lambda: Net.load_from_checkpoint(path, hidden=16), problem) is None
    assert tree(ckpt_dir) == before


def test_newer_format_version(ckpt_dir: Path, tmp_path: Path) -> None:
    meta_file = newest(ckpt_dir) / "ember.pt"
    meta = torch.load(meta_file, weights_only=True)
    torch.save({**meta, "format_version": 999}, meta_file)
    assert_rejected(newest(ckpt_dir), r"format version 999, newer than this ember understands \(1\)", tmp_path)
    with pytest.warns(RuntimeWarning, match="format version 999"):
        assert ckpt.newest_valid(ckpt_dir) == ckpt_dir / "epoch=0-step=4"


def test_weights_only_checkpoint_cannot_resume(tmp_path: Path) -> None:
    torch.manual_seed(0)
    saver = ModelCheckpoint(tmp_path / "ckpts", save_weights_only=True)
    trainer = Trainer(max_epochs=1, callbacks=[saver], **QUIET)
    trained = Net()
    trainer.fit(trained, loader())
    from_callback = Path(saver.last_model_path)
    from_trainer = trainer.save_checkpoint(tmp_path / "manual", weights_only=True)
    for path in (from_callback, from_trainer):
        before = tree(path)
        module = Net()
        start = params(module)
        fit = Trainer(max_epochs=2, enable_checkpointing=False, default_root_dir=tmp_path / "fresh", **QUIET)
        with pytest.raises(CheckpointError, match=re.escape(str(path)) + r" holds weights only .*cannot resume"):
            fit.fit(module, loader(), ckpt_path=path)
        assert same(start, params(module))
        assert tree(path) == before
        # ... but it is fine for inference and evaluation:
        loaded = Net.load_from_checkpoint(path)
        assert same(params(trained), params(loaded))
        evaluated = Net()
        Trainer(enable_checkpointing=False, **QUIET).validate(evaluated, loader(), ckpt_path=path)
        assert same(params(trained), params(evaluated))


# --- crafted pickles: nothing in a checkpoint is ever executed ----------------------------------------


class CreatesFile:
    """Unpickling this opens (creates) `marker` for writing."""

    def __init__(self, marker: Path) -> None:
        self.marker = str(marker)

    def __reduce__(self) -> tuple[Any, ...]:
        return (open, (self.marker, "w"))


class RunsShell:
    """Unpickling this runs ``touch marker`` through os.system."""

    def __init__(self, marker: Path) -> None:
        self.marker = str(marker)

    def __reduce__(self) -> tuple[Any, ...]:
        return (os.system, (f"touch '{self.marker}'",))


PAYLOADS = {"open": CreatesFile, "os.system": RunsShell}


def plant(path: Path, name: str, payload: Any) -> Callable[[], Any]:
    """Put `payload` into file `name` of checkpoint `path`; returns a plain (unsafe) load of it, the control."""
    file = path / name
    if name == ".metadata":
        metadata = ckpt.read_metadata(path)
        metadata.planner_data["innocent"] = payload  # a real Metadata object with a payload inside
        file.write_bytes(pickle.dumps(metadata))
        return lambda: dcp.FileSystemReader(path).read_metadata()  # DCP's own reader: plain pickle.load
    if name in ("ember.pt", "rank-0.pt"):
        content = torch.load(file, weights_only=True)
        content["innocent"] = payload
        torch.save(content, file)
        return lambda: torch.load(file, weights_only=False)
    assert name == SHARD
    blob = pickle.dumps(payload, protocol=2)
    data = bytearray(file.read_bytes())
    for info in ckpt.read_metadata(path).storage_data.values():  # every tensor's bytes start with the payload
        assert info.length > len(blob)
        data[info.offset : info.offset + len(blob)] = blob
    file.write_bytes(bytes(data))
    return lambda: pickle.loads(blob)


@pytest.mark.parametrize("kind", sorted(PAYLOADS))
@pytest.mark.parametrize("name", [".metadata", "ember.pt", "rank-0.pt", SHARD])
def test_crafted_pickle_is_never_executed(ckpt_dir: Path, tmp_path: Path, name: str, kind: str) -> None:
    marker = tmp_path / "PWNED"
    path = newest(ckpt_dir)
    unsafe_load = plant(path, name, PAYLOADS[kind](marker))
    with warnings.catch_warnings(), contextlib.suppress(BaseException):  # the control needs the side effect only
        warnings.simplefilter("ignore")
        unsafe_load()
    assert marker.exists(), "control: the payload does not work, the test would prove nothing"
    marker.unlink()
    before = tree(ckpt_dir)

    failures = {}
    for entry, load in entry_points(path, tmp_path / "fresh-runs").items():
        if entry == "load_from_checkpoint" and name == "rank-0.pt":
            load()  # needs only the weights: never opens rank-0.pt, so it may succeed
        else:
            result = outcome(load, re.escape(str(path)))
            if result is not None:
                failures[entry] = result
        assert not marker.exists(), f"{entry} executed code from {name}"

    # The `last` finder skips the crafted checkpoint, or (a shard is not read by its cheap check) names it,
    # in which case resuming from "last" must fail with a CheckpointError.
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        found = ckpt.newest_valid(ckpt_dir)
    assert not marker.exists(), f"newest_valid executed code from {name}"
    if found == path:
        assert name == SHARD, f"newest_valid accepted a checkpoint with a crafted {name}"
        last = StartStep()
        resume = Trainer(max_epochs=3, callbacks=[ModelCheckpoint(ckpt_dir), last], **QUIET)
        result = outcome(lambda: resume.fit(Net(), loader(), ckpt_path="last"), re.escape(str(path)))
        if result is not None:
            failures['fit(ckpt_path="last")'] = result
        assert last.start_step is None
    else:
        assert found == ckpt_dir / "epoch=0-step=4"
        assert any(str(path) in str(w.message) for w in caught), [str(w.message) for w in caught]
    assert not marker.exists()
    assert tree(ckpt_dir) == before, "loading a crafted checkpoint changed files"
    assert not failures, f"expected one CheckpointError naming {path}; got {failures}"


# --- `last` and its fallback ----------------------------------------------------------------------------


@pytest.mark.parametrize(
    "damage",
    ["truncated shard", "corrupt .metadata", "ember.pt missing", "last names a deleted checkpoint"],
)
def test_last_skips_a_damaged_newest_checkpoint(ckpt_dir: Path, tmp_path: Path, damage: str) -> None:
    path = newest(ckpt_dir)
    if damage == "truncated shard":
        (path / SHARD).write_bytes((path / SHARD).read_bytes()[:100])
    elif damage == "corrupt .metadata":
        (path / ".metadata").write_bytes(b"\x80\x04garbage")
    elif damage == "ember.pt missing":
        (path / "ember.pt").unlink()
    else:
        for file in path.iterdir():
            file.unlink()
        path.rmdir()
    (ckpt_dir / ".epoch=2-step=12.tmp-4242").mkdir()  # a write interrupted by a crash: never a candidate
    ((ckpt_dir / ".epoch=2-step=12.tmp-4242") / "ember.pt").write_bytes(b"")
    assert (ckpt_dir / "last").read_text().strip() == path.name

    if damage != "last names a deleted checkpoint":
        with pytest.warns(RuntimeWarning, match=re.escape(str(path))):
            assert ckpt.newest_valid(ckpt_dir) == ckpt_dir / "epoch=0-step=4"
    else:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            assert ckpt.newest_valid(ckpt_dir) == ckpt_dir / "epoch=0-step=4"

    start = StartStep()
    trainer = Trainer(max_epochs=3, callbacks=[ModelCheckpoint(ckpt_dir, save_top_k=-1), start], **QUIET)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", RuntimeWarning)
        trainer.fit(Net(), loader(), ckpt_path="last")
    assert start.start_step == 4, "resumed from somewhere other than the previous good checkpoint"
    assert trainer.global_step == 12
    assert (ckpt_dir / "last").read_text().strip().startswith("epoch=2-step=12")
    ckpt.check_complete(ckpt_dir / (ckpt_dir / "last").read_text().strip())


def test_last_with_no_checkpoint_starts_fresh(tmp_path: Path, capfd: pytest.CaptureFixture[str]) -> None:
    start = StartStep()
    trainer = Trainer(max_epochs=1, callbacks=[start], default_root_dir=tmp_path / "runs", **QUIET)
    trainer.fit(Net(), loader(), ckpt_path="last")
    assert start.start_step == 0
    assert "starting a new run" in capfd.readouterr().err


# --- writing: atomic, never overwriting, errors surfaced ------------------------------------------------


def fail_in_dcp_writer(monkeypatch: pytest.MonkeyPatch, when: Callable[[], bool]) -> None:
    """The DCP writer (used for several processes and large states; forced here) leaves a partial shard,
    then hits a full disk."""
    original = dcp.FileSystemWriter.write_data
    monkeypatch.setattr(dcp_writer, "can_write", lambda tensors: False)

    def write_data(self: Any, plan: Any, planner: Any) -> Any:
        if not when():
            return original(self, plan, planner)
        (Path(self.path) / SHARD).write_bytes(b"partial")
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(dcp.FileSystemWriter, "write_data", write_data)


def fail_in_torch_save_of(suffix: str) -> Callable[[pytest.MonkeyPatch, Callable[[], bool]], None]:
    """An injection: ``torch.save`` into the file named ``*suffix`` writes a few bytes, then hits a full disk."""

    def inject(monkeypatch: pytest.MonkeyPatch, when: Callable[[], bool]) -> None:
        original = torch.save

        def save(obj: Any, f: Any, *args: Any, **kwargs: Any) -> Any:
            if when() and str(getattr(f, "name", f)).endswith(suffix):
                f.write(b"PK\x03\x04partial")
                raise OSError(28, "No space left on device")
            return original(obj, f, *args, **kwargs)

        monkeypatch.setattr(torch, "save", save)

    return inject


def fail_in_tensor_writer(monkeypatch: pytest.MonkeyPatch, when: Callable[[], bool]) -> None:
    """ember's one-process writer writes a few bytes of a tensor into the shard, then hits a full disk."""
    original = dcp_writer.save_tensor

    def save_tensor(tensor: torch.Tensor, f: Any) -> None:
        if not when():
            return original(tensor, f)
        f.write(b"PK\x03\x04partial")
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(dcp_writer, "save_tensor", save_tensor)


INJECT = {
    "dcp writer": fail_in_dcp_writer,
    "one-process tensor writer": fail_in_tensor_writer,
    "torch.save of ember.pt": fail_in_torch_save_of("ember.pt"),
}


def visible_dirs(directory: Path) -> list[str]:
    return sorted(p.name for p in directory.iterdir() if p.is_dir())


@pytest.mark.parametrize("where", sorted(INJECT))
def test_write_failure_keeps_previous_checkpoint(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, where: str) -> None:
    """The second epoch's save fails: fit raises it, epoch 0's checkpoint stays valid and `last` names it."""
    directory = tmp_path / "ckpts"
    saver = ModelCheckpoint(directory, save_top_k=-1)
    INJECT[where](monkeypatch, lambda: saver.last_model_path.endswith("step=8"))
    trainer = Trainer(max_epochs=2, callbacks=[saver], **QUIET)
    with pytest.raises((OSError, CheckpointError), match="No space left on device"):
        trainer.fit(Net(), loader())
    assert visible_dirs(directory) == ["epoch=0-step=4"], "a half-written checkpoint is visible"
    assert [p.name for p in directory.iterdir() if p.name.startswith(".")] == [], "temporary files were left"
    assert (directory / "last").read_text().strip() == "epoch=0-step=4"
    ckpt.check_complete(directory / "epoch=0-step=4")
    assert ckpt.newest_valid(directory) == directory / "epoch=0-step=4"


@pytest.mark.parametrize("where", sorted(INJECT))
def test_failed_manual_save_leaves_nothing(
    ckpt_dir: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, where: str
) -> None:
    trainer = Trainer(max_epochs=1, enable_checkpointing=False, **QUIET)
    trainer.fit(Net(), loader())
    before = tree(ckpt_dir)
    INJECT[where](monkeypatch, lambda: True)
    with pytest.raises((OSError, CheckpointError), match="No space left on device"):
        trainer.save_checkpoint(ckpt_dir / "manual", set_last=True)
    assert tree(ckpt_dir) == before
    assert visible_dirs(ckpt_dir) == ["epoch=0-step=4", "epoch=1-step=8"]


def test_save_checkpoint_never_overwrites(ckpt_dir: Path, tmp_path: Path) -> None:
    trainer = Trainer(max_epochs=1, enable_checkpointing=False, **QUIET)
    trainer.fit(Net(), loader())
    (ckpt_dir / "a-file").write_text("keep me")
    (ckpt_dir / "empty-dir").mkdir()
    before = tree(ckpt_dir)
    for name in ("epoch=1-step=8", "a-file", "empty-dir"):
        with pytest.raises(FileExistsError, match=re.escape(str(ckpt_dir / name))):
            trainer.save_checkpoint(ckpt_dir / name)
        with pytest.raises(FileExistsError):
            trainer.save_checkpoint(ckpt_dir / name, async_save=True)
    with pytest.raises(FileExistsError):
        ckpt.write_checkpoint(newest(ckpt_dir), {}, {}, {})
    assert tree(ckpt_dir) == before
    assert (ckpt_dir / "empty-dir").is_dir()


# --- pieces ------------------------------------------------------------------------------------------------


def test_split_and_join_round_trip() -> None:
    a, b, c, d = torch.arange(3.0), torch.ones(2, 2), torch.tensor(7), torch.zeros(0)
    state = {
        "module": {"w": a, "nested": {"b": b}},
        "optimizers": [{"state": {0: {"step": c, "exp_avg": d}}, "param_groups": [{"lr": 0.1, "params": [0]}]}],
        "pair": (a, "text", None, 3),
        "empty": {},
        "plain": [1, 2.5, "x", (None,)],
    }
    skeleton, tensors = ckpt.split_tensors(state)
    assert set(tensors) == {
        "/module/w",
        "/module/nested/b",
        "/optimizers/0/state/0/step",
        "/optimizers/0/state/0/exp_avg",
        "/pair/0",
    }
    assert not any(isinstance(t, torch.Tensor) for t in ckpt.split_tensors(skeleton)[1].values())
    pickle.dumps(skeleton)  # the skeleton is plain data
    joined = ckpt.join_tensors(skeleton, tensors)
    assert joined["module"]["w"] is a and joined["module"]["nested"]["b"] is b
    assert joined["optimizers"][0]["state"][0]["step"] is c
    assert isinstance(joined["pair"], tuple) and joined["pair"][0] is a and joined["pair"][1:] == ("text", None, 3)
    assert joined["empty"] == {} and joined["plain"] == [1, 2.5, "x", (None,)]
    assert joined["optimizers"][0]["param_groups"] == [{"lr": 0.1, "params": [0]}]


def test_load_from_checkpoint_rebuilds_with_overrides(tmp_path: Path) -> None:
    torch.manual_seed(0)
    trained = Net(hidden=6, dropout=0.0)
    trainer = Trainer(max_epochs=2, enable_checkpointing=False, **QUIET)
    trainer.fit(trained, loader())
    path = trainer.save_checkpoint(tmp_path / "final")

    loaded = Net.load_from_checkpoint(path, dropout=0.25)
    assert type(loaded) is Net
    assert dict(loaded.hparams) == {"hidden": 6, "dropout": 0.25}
    assert loaded.model[2].p == 0.25
    assert not loaded.training
    assert loaded.state_dict().keys() == trained.state_dict().keys()
    for key, value in trained.state_dict().items():
        assert torch.equal(loaded.state_dict()[key], value), key
    assert all(p.device.type == "cpu" for p in loaded.parameters())
    plain = Net.load_from_checkpoint(path)
    assert dict(plain.hparams) == {"hidden": 6, "dropout": 0.0}


def test_save_weights_is_a_plain_state_dict(tmp_path: Path) -> None:
    torch.manual_seed(0)
    module = Net()
    Trainer(max_epochs=1, enable_checkpointing=False, **QUIET).fit(module, loader())
    file = tmp_path / "export" / "weights.pt"
    module.save_weights(file)
    loaded = torch.load(file, weights_only=True)
    expected = module.state_dict()
    assert list(loaded) == list(expected)
    for key, value in expected.items():
        assert torch.equal(loaded[key], value), key
    assert sorted(p.name for p in file.parent.iterdir()) == ["weights.pt"]  # no temporary file left
    fresh = Net()
    fresh.load_state_dict(loaded)
    assert same(params(fresh), params(module))


def test_a_failed_save_weights_keeps_the_old_file_and_leaves_no_temporary(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    module = Net()
    file = tmp_path / "weights.pt"
    module.save_weights(file)
    before = file.read_bytes()

    def full_disk(*args: Any, **kwargs: Any) -> None:
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(torch, "save", full_disk)
    with pytest.raises(OSError, match="No space left"):
        module.save_weights(file)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["weights.pt"]
    assert file.read_bytes() == before
