"""`ember.config`: the schema matches the Trainer, layers merge in order, interpolation, `_target_` building."""

from __future__ import annotations

import dataclasses
import inspect
import sys
from pathlib import Path

import pytest
import torch
from torch import nn

import ember
from ember import config
from ember.cli import main
from ember.config.schema import split_key
from ember.modules.optimizers import parse_optimizers


def write(path: Path, text: str) -> Path:
    path.write_text(text)
    return path


def test_trainer_config_fields_are_the_trainer_keywords() -> None:
    """Adding a Trainer keyword without adding it to TrainerConfig (or the reverse) fails here."""
    params = inspect.signature(ember.Trainer.__init__).parameters
    keywords = {name: p.default for name, p in params.items() if name != "self"}
    fields = {f.name: f.default for f in dataclasses.fields(config.TrainerConfig)}
    hint = "keep ember/config/schema.py TrainerConfig equal to the Trainer keywords"
    assert sorted(set(keywords) - set(fields)) == [], f"missing from TrainerConfig; {hint}"
    assert sorted(set(fields) - set(keywords)) == [], f"not Trainer keywords; {hint}"
    assert list(fields) == list(keywords), f"same order, for --print-config; {hint}"
    assert fields == keywords, f"same defaults; {hint}"
    assert all(p.kind is p.KEYWORD_ONLY for name, p in params.items() if name != "self")


def test_layers_merge_in_order_schema_then_files_then_command_line(tmp_path: Path) -> None:
    first = write(
        tmp_path / "first.yaml",
        "trainer:\n  max_epochs: 5\n  max_steps: 100\n  precision: 32\n"
        "module:\n  _target_: a.B\n  lr: 0.1\n  hidden: 8\n"
        "data:\n  _target_: a.D\n",
    )
    second = write(tmp_path / "second.yaml", "trainer:\n  max_epochs: 7\nmodule:\n  lr: 0.2\n")
    resolved = config.resolve(config.load([first, second], ["module.lr=0.3", "--trainer.max_steps=9"]))
    trainer = resolved["trainer"]
    assert trainer["log_every_n_steps"] == 50  # schema default, set nowhere
    assert trainer["precision"] == 32  # first file only (an int stays an int: str | int)
    assert resolved["module"]["hidden"] == 8  # first file only
    assert trainer["max_epochs"] == 7  # second file beats first
    assert resolved["module"]["lr"] == 0.3  # command line beats both files
    assert trainer["max_steps"] == 9  # --key=value spelling
    assert resolved["module"]["_target_"] == "a.B" and resolved["data"] == {"_target_": "a.D"}


def test_both_override_spellings_are_equal_and_the_last_one_wins(tmp_path: Path) -> None:
    base = write(tmp_path / "base.yaml", "module: {_target_: a.B}\ndata: {_target_: a.D}\n")
    plain = config.resolve(config.load([base], ["trainer.max_epochs=3", "module.lr=1e-3"]))
    dashed = config.resolve(config.load([base], ["--trainer.max_epochs=3", "--module.lr=1e-3"]))
    assert plain == dashed
    assert plain["trainer"]["max_epochs"] == 3 and plain["module"]["lr"] == 0.001
    later = config.resolve(config.load([base], ["trainer.max_epochs=3", "--trainer.max_epochs=4"]))
    assert later["trainer"]["max_epochs"] == 4


def test_union_fields_keep_the_type_given(tmp_path: Path) -> None:
    """limit_train_batches=2 is a batch count (int); 0.5 a fraction (float). A float schema would turn 2 into 2.0."""
    base = write(tmp_path / "base.yaml", "module: {_target_: a.B}\ndata: {_target_: a.D}\n")
    resolved = config.resolve(config.load([base], ["trainer.limit_train_batches=2", "trainer.limit_val_batches=0.5"]))
    assert resolved["trainer"]["limit_train_batches"] == 2 and type(resolved["trainer"]["limit_train_batches"]) is int
    assert resolved["trainer"]["limit_val_batches"] == 0.5


def test_a_new_target_keeps_only_the_keywords_it_accepts(tmp_path: Path) -> None:
    base = write(
        tmp_path / "base.yaml",
        "module: {_target_: a.B, lr: 0.1}\ndata: {_target_: a.D}\n"
        "optimizer: {_target_: torch.optim.AdamW, lr: 0.1, weight_decay: 0.2, amsgrad: true}\n"
        "lr_scheduler: {_target_: torch.optim.lr_scheduler.StepLR, step_size: 2, gamma: 0.5, interval: step}\n",
    )
    swap = ["optimizer._target_=torch.optim.SGD", "lr_scheduler={_target_: torch.optim.lr_scheduler.CosineAnnealingLR}"]
    resolved = config.resolve(config.load([base], [*swap, "lr_scheduler.T_max=5"]))
    assert resolved["optimizer"] == {"_target_": "torch.optim.SGD", "lr": 0.1, "weight_decay": 0.2}  # no amsgrad
    assert resolved["lr_scheduler"] == {
        "_target_": "torch.optim.lr_scheduler.CosineAnnealingLR",
        "interval": "step",  # when it steps is not a constructor keyword: kept
        "T_max": 5,
    }
    # the same target (or none named) merges as usual; an unknown module target keeps everything
    same = config.resolve(config.load([base], ["optimizer._target_=torch.optim.AdamW", "module._target_=x.Y"]))
    assert same["optimizer"]["amsgrad"] is True and same["module"] == {"_target_": "x.Y", "lr": 0.1}


def test_where_the_schema_allows_either_a_list_replaces_a_mapping(tmp_path: Path) -> None:
    base = write(
        tmp_path / "base.yaml",
        "trainer:\n  logger: {_target_: ember.loggers.CSVLogger}\n  max_time: {hours: 2}\n"
        "module: {_target_: a.B, sizes: [1, 2]}\ndata: {_target_: a.D}\n",
    )
    overrides = ["trainer.logger=[{_target_: ember.loggers.CSVLogger}]", "trainer.max_time=60", "module.sizes={a: 1}"]
    resolved = config.resolve(config.load([base], overrides))
    assert resolved["trainer"]["logger"] == [{"_target_": "ember.loggers.CSVLogger"}]
    assert resolved["trainer"]["max_time"] == 60 and resolved["module"]["sizes"] == {"a": 1}
    with pytest.raises(config.ConfigError, match=r"^command line: trainer.callbacks: expected a list or null, got"):
        config.load([base], ["trainer.callbacks={_target_: x.Y}"])


def test_interpolation_and_environment_variables(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    path = write(
        tmp_path / "run.yaml",
        "seed: ${oc.env:EMBER_TEST_SEED,11}\n"
        "trainer:\n  max_epochs: 4\n  run_name: ${oc.env:EMBER_TEST_NAME,default-name}\n"
        "module:\n  _target_: a.B\n  lr: 0.25\n  epochs: ${trainer.max_epochs}\n"
        "data: {_target_: a.D}\n"
        "optimizer:\n  _target_: torch.optim.SGD\n  lr: ${module.lr}\n",
    )
    monkeypatch.delenv("EMBER_TEST_SEED", raising=False)
    monkeypatch.delenv("EMBER_TEST_NAME", raising=False)
    resolved = config.resolve(config.load([path], ["module.lr=0.5"]))
    assert resolved["seed"] == 11  # the default, converted to the schema's int
    assert resolved["trainer"]["run_name"] == "default-name"
    assert resolved["module"]["epochs"] == 4
    assert resolved["optimizer"]["lr"] == 0.5  # follows the overridden module.lr
    monkeypatch.setenv("EMBER_TEST_SEED", "3")
    monkeypatch.setenv("EMBER_TEST_NAME", "from-env")
    resolved = config.resolve(config.load([path], ["trainer.max_epochs=9"]))
    assert (resolved["seed"], resolved["trainer"]["run_name"], resolved["module"]["epochs"]) == (3, "from-env", 9)


def test_the_saved_yaml_loads_back_to_the_same_config(tmp_path: Path) -> None:
    path = write(
        tmp_path / "run.yaml",
        "seed: 1\ntrainer:\n  max_time: {hours: 2}\n  callbacks:\n    - {_target_: x.Y, monitor: val/acc}\n"
        "module: {_target_: a.B, lr: 1.0e-3, sizes: [1, 2], name: 'null'}\ndata: {_target_: a.D}\n",
    )
    resolved = config.resolve(config.load([path]))
    saved = write(tmp_path / "saved.yaml", config.to_yaml(resolved))
    assert config.resolve(config.load([saved])) == resolved
    assert resolved["module"]["name"] == "null" and resolved["trainer"]["max_time"] == {"hours": 2}


@pytest.mark.parametrize(
    ("key", "parts"),
    [("trainer", ["trainer"]), ("trainer.callbacks[0].monitor", ["trainer", "callbacks", 0, "monitor"])],
)
def test_split_key(key: str, parts: list[str | int]) -> None:
    assert split_key(key) == parts


def test_schema_types_in_words() -> None:
    assert config.schema_type("trainer.max_epochs") == "int or null"
    assert config.schema_type("trainer.limit_train_batches") == "float or int"
    assert config.schema_type("trainer.enable_progress_bar") == "bool"
    assert config.schema_type("trainer") == "a mapping of options"
    assert config.schema_type("trainer.max_time") is None  # Any: the schema does not say


def test_import_target_errors_name_what_failed(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    assert config.import_target("torch.optim.SGD") is torch.optim.SGD
    with pytest.raises(ImportError, match=r"torch.optim has no attribute 'SDG'; did you mean torch.optim.SGD\?"):
        config.import_target("torch.optim.SDG")
    with pytest.raises(ImportError, match="no module named 'no_such_pkg_xyz'"):
        config.import_target("no_such_pkg_xyz.models.Net")
    # a module that exists but fails to import reports its own error, not "no module named"
    write(tmp_path / "broken_user_mod.py", "import not_installed_dependency_xyz\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    with pytest.raises(ImportError, match="importing broken_user_mod failed: No module named 'not_installed_depend"):
        config.import_target("broken_user_mod.Net")
    monkeypatch.delitem(sys.modules, "broken_user_mod", raising=False)


class Plain(ember.TrainingModule):
    """No configure_optimizers: the config's optimizer sections decide."""

    def __init__(self) -> None:
        super().__init__()
        self.model = nn.Linear(3, 2)


def test_default_configure_optimizers_builds_the_config_sections() -> None:
    module = Plain()
    module.optimizer_config = {
        "optimizer": {"_target_": "torch.optim.AdamW", "lr": 0.01, "weight_decay": 0.5},
        "lr_scheduler": {
            "_target_": "torch.optim.lr_scheduler.StepLR",
            "step_size": 2,
            "gamma": 0.1,
            "interval": "step",
        },
    }
    setup = parse_optimizers(module.configure_optimizers())
    (opt,) = setup.optimizers
    assert type(opt) is torch.optim.AdamW
    assert opt.param_groups[0]["lr"] == 0.01 and opt.param_groups[0]["weight_decay"] == 0.5
    assert [p for g in opt.param_groups for p in g["params"]] == list(module.parameters())
    (sched,) = setup.schedulers
    assert type(sched.scheduler) is torch.optim.lr_scheduler.StepLR and sched.interval == "step"
    assert (sched.scheduler.step_size, sched.scheduler.gamma) == (2, 0.1)


def test_default_configure_optimizers_without_a_scheduler_returns_the_optimizer() -> None:
    module = Plain()
    module.optimizer_config = {"optimizer": {"_target_": "torch.optim.SGD", "lr": 0.3}, "lr_scheduler": None}
    opt = module.configure_optimizers()
    assert type(opt) is torch.optim.SGD and opt.param_groups[0]["lr"] == 0.3


def test_configure_optimizers_without_a_config_still_says_what_to_add() -> None:
    with pytest.raises(NotImplementedError, match=r"Plain does not define configure_optimizers\(\); add one"):
        Plain().configure_optimizers()


def test_instantiate_builds_nested_targets_and_names_the_key_on_failure() -> None:
    spec = {"_target_": "torch.optim.lr_scheduler.StepLR", "optimizer": _sgd_spec(), "step_size": 3}
    built = config.instantiate(spec, "lr_scheduler")
    assert type(built) is torch.optim.lr_scheduler.StepLR and type(built.optimizer) is torch.optim.SGD
    with pytest.raises(config.ConfigError, match=r"^module: torch.nn.Linear\(...\) raised TypeError"):
        config.instantiate({"_target_": "torch.nn.Linear", "in_features": "x", "out_features": 2}, "module")


def _sgd_spec() -> dict[str, object]:
    return {"_target_": "torch.optim.SGD", "params": [{"params": [nn.Parameter(torch.zeros(1))]}], "lr": 0.1}


def test_print_config_in_process_prints_the_resolved_yaml(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    path = write(
        tmp_path / "run.yaml",
        "trainer: {max_epochs: 2}\nmodule: {_target_: torch.nn.Linear, in_features: 2, out_features: 1}\n"
        "data: {_target_: ember.DataModule}\n",
    )
    # torch.nn.Linear is not a TrainingModule: --print-config checks before printing
    assert main(["fit", "-c", str(path), "--print-config"]) == 2
    assert "module._target_: torch.nn.Linear is not a subclass of ember.TrainingModule" in capsys.readouterr().err


def test_every_shipped_config_writes_its_own_runs() -> None:
    """Two shipped configs sharing a run directory let `--ckpt-path best` of one load the other's checkpoint
    (digits.yaml and your_data.yaml both wrote runs/classifier). Overlays (configs used only with another,
    without a module section of their own) name their own run too."""
    import yaml

    from ember.trainer.setup import run_name

    configs = sorted((Path(__file__).resolve().parents[2] / "configs").glob("*.yaml"))
    assert len(configs) >= 10
    names: dict[str, str] = {}
    for path in configs:
        data = yaml.safe_load(path.read_text())
        named = (data.get("trainer") or {}).get("run_name")
        target = (data.get("module") or {}).get("_target_")
        assert named or target, f"{path.name} names neither a run nor a module"
        name = named or run_name(type(target.rsplit(".", 1)[1], (), {}))
        assert name not in names, f"{path.name} and {names[name]} both write runs/{name}"
        names[name] = path.name
    assert names["classifier"] == "digits.yaml" and names["your_data"] == "your_data.yaml"
