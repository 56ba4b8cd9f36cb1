"""Idioms of real LightningModules that must run on ember with only the imports changed (each found failing or
silently different when real public modules were ported), checked against Lightning itself where it runs here.

Each test writes the module once, on a base class it is given, and trains it with both frameworks where the
comparison is the point.
"""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

import pytest
import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

import ember

pl = pytest.importorskip("lightning", reason="compares ember with Lightning; install it (it is in the dev extra)")

QUIET_LIGHTNING: dict[str, Any] = {
    "accelerator": "cpu",
    "devices": 1,
    "logger": False,
    "enable_progress_bar": False,
    "enable_model_summary": False,
    "enable_checkpointing": False,
}
QUIET_EMBER: dict[str, Any] = {
    "logger": False,
    "enable_progress_bar": False,
    "enable_model_summary": False,
    "enable_checkpointing": False,
}


def _data(n: int = 32, batch_size: int = 8, seed: int = 0) -> DataLoader[Any]:
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, 4, generator=g)
    return DataLoader(TensorDataset(x, x.sum(1, keepdim=True)), batch_size=batch_size)


def _regressor(base: type, **methods: Any) -> Any:
    """A small regression module on `base`, with `methods` added or replacing the defaults; seeded parameters."""

    def __init__(self: Any) -> None:
        base.__init__(self)
        self.net = nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 1))

    def configure_optimizers(self: Any) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.parameters(), lr=0.05)

    namespace = {"__init__": __init__, "configure_optimizers": configure_optimizers, **methods}
    cls = type(f"Regressor{base.__name__}", (base,), namespace)
    torch.manual_seed(0)
    return cls()


def _loss(self: Any, batch: Any) -> torch.Tensor:
    x, y = batch
    return nn.functional.mse_loss(self.net(x), y)


# --- 1. training_step(self, batch): Lightning reads the signature -------------------------------------------
def test_steps_without_batch_idx_train_as_in_lightning() -> None:
    def training_step(self: Any, batch: Any) -> torch.Tensor:
        loss = _loss(self, batch)
        self.log("loss", loss)
        return loss

    def validation_step(self: Any, batch: Any) -> None:
        self.log("val_loss", _loss(self, batch))

    def test_step(self: Any, batch: Any) -> None:
        self.log("test_loss", _loss(self, batch))

    def predict_step(self: Any, batch: Any) -> torch.Tensor:
        return self.net(batch[0])

    steps = {"training_step": training_step, "validation_step": validation_step, "test_step": test_step}
    results = {}
    for base, trainer in (
        (pl.LightningModule, pl.Trainer(max_epochs=2, num_sanity_val_steps=0, **QUIET_LIGHTNING)),
        (ember.TrainingModule, ember.Trainer(max_epochs=2, num_sanity_val_steps=0, **QUIET_EMBER)),
    ):
        module = _regressor(base, **steps, predict_step=predict_step)
        trainer.fit(module, _data(), _data(seed=1))
        tested = trainer.test(module, _data(seed=2), verbose=False) if base is pl.LightningModule else None
        tested = tested or trainer.test(module, _data(seed=2))
        predicted = torch.cat(trainer.predict(module, _data(seed=3)))
        results[base] = (dict(module.named_parameters()), tested[0]["test_loss"], predicted)
    lightning, ours = results[pl.LightningModule], results[ember.TrainingModule]
    for name, value in lightning[0].items():
        assert torch.equal(value, ours[0][name]), name
    assert math.isclose(lightning[1], ours[1], rel_tol=1e-6)
    assert torch.equal(lightning[2], ours[2])


def test_a_step_may_still_call_another_step_with_or_without_batch_idx() -> None:
    def training_step(self: Any, batch: Any) -> torch.Tensor:
        return _loss(self, batch)

    def validation_step(self: Any, batch: Any, batch_idx: int) -> None:
        self.log("val_loss", self.training_step(batch, batch_idx) + self.training_step(batch))

    module = _regressor(ember.TrainingModule, training_step=training_step, validation_step=validation_step)
    trainer = ember.Trainer(max_epochs=1, **QUIET_EMBER)
    trainer.fit(module, _data(), _data(seed=1))
    assert "val_loss" in trainer.callback_metrics


# --- 2. self.on_gpu ---------------------------------------------------------------------------------------------
def test_on_gpu_says_whether_the_module_runs_on_cuda() -> None:
    module = _regressor(ember.TrainingModule)
    assert module.on_gpu is False
    seen = []

    def training_step(self: Any, batch: Any, batch_idx: int) -> torch.Tensor:
        seen.append(self.on_gpu)
        return _loss(self, batch)

    ember.Trainer(max_steps=1, **QUIET_EMBER).fit(
        _regressor(ember.TrainingModule, training_step=training_step), _data()
    )
    assert seen == [False]


# --- 3. the plain name of a metric logged on_step and on_epoch ----------------------------------------------------
def _forked_metrics(base: type) -> Any:
    def training_step(self: Any, batch: Any, batch_idx: int) -> torch.Tensor:
        loss = _loss(self, batch)
        self.log("train_loss", loss, on_step=True, on_epoch=True)
        return loss

    def validation_step(self: Any, batch: Any, batch_idx: int) -> None:
        self.log("val_loss", _loss(self, batch), on_step=True, on_epoch=True)

    return _regressor(base, training_step=training_step, validation_step=validation_step)


def test_a_forked_metric_is_in_callback_metrics_under_its_plain_name_as_in_lightning() -> None:
    lightning = pl.Trainer(max_epochs=2, num_sanity_val_steps=0, **QUIET_LIGHTNING)
    lightning.fit(_forked_metrics(pl.LightningModule), _data(), _data(seed=1))
    ours = ember.Trainer(max_epochs=2, num_sanity_val_steps=0, **QUIET_EMBER)
    ours.fit(_forked_metrics(ember.TrainingModule), _data(), _data(seed=1))
    theirs = {k: float(v) for k, v in lightning.callback_metrics.items()}
    assert set(ours.callback_metrics) == set(theirs)
    for name, value in theirs.items():
        assert math.isclose(ours.callback_metrics[name], value, rel_tol=1e-6), name
    assert ours.callback_metrics["val_loss"] == ours.callback_metrics["val_loss_epoch"]


def test_early_stopping_monitors_the_plain_name_of_a_forked_metric() -> None:
    stop = ember.callbacks.EarlyStopping(monitor="val_loss", patience=1, min_delta=1e9)
    trainer = ember.Trainer(max_epochs=5, num_sanity_val_steps=0, callbacks=[stop], **QUIET_EMBER)
    trainer.fit(_forked_metrics(ember.TrainingModule), _data(), _data(seed=1))
    assert trainer.current_epoch == 2, "no improvement of 1e9 after the first epoch: stops after the second"


# --- 4. trainer.logger exists before fit --------------------------------------------------------------------------
def test_the_default_loggers_exist_before_fit() -> None:
    trainer = ember.Trainer(enable_progress_bar=False)
    assert trainer.logger is not None and type(trainer.logger).__name__ == "TensorBoardLogger"
    assert [type(lg).__name__ for lg in trainer.loggers] == ["TensorBoardLogger", "CSVLogger"]
    assert ember.Trainer(logger=False).logger is None
    given = ember.loggers.CSVLogger()
    assert ember.Trainer(logger=given).loggers == [given]


# --- 5. logger.experiment on every logger ----------------------------------------------------------------------------
def test_every_logger_has_an_experiment() -> None:
    seen: list[tuple[Any, Any]] = []

    def on_train_start(self: Any) -> None:
        for logger in self.loggers:
            seen.append((logger, logger.experiment))

    module = _regressor(
        ember.TrainingModule, training_step=lambda self, b, i: _loss(self, b), on_train_start=on_train_start
    )
    ember.Trainer(max_steps=1, enable_progress_bar=False, enable_checkpointing=False).fit(module, _data())
    from torch.utils.tensorboard import SummaryWriter

    (_, writer), (csv, its_own) = seen
    assert isinstance(writer, SummaryWriter), "TensorBoard's: add_scalar, add_image, ..."
    assert its_own is csv and callable(csv.experiment.log_metrics), "a CSV logger is its own experiment"


# --- 7. validate / test / predict with no module after fit ------------------------------------------------------
def test_test_after_fit_without_a_module_uses_the_fitted_module_and_its_best_checkpoint(capsys: Any) -> None:
    def validation_step(self: Any, batch: Any, batch_idx: int) -> None:
        self.log("val_loss", _loss(self, batch))

    def test_step(self: Any, batch: Any, batch_idx: int) -> None:
        self.log("test_loss", _loss(self, batch))

    steps = {"training_step": lambda self, b, i: _loss(self, b), "validation_step": validation_step}
    module = _regressor(
        ember.TrainingModule, **steps, test_step=test_step, predict_step=lambda self, b, i: self.net(b[0])
    )
    saver = ember.callbacks.ModelCheckpoint(monitor="val_loss")
    trainer = ember.Trainer(max_epochs=3, callbacks=[saver], logger=False, enable_progress_bar=False)
    trainer.fit(module, _data(), _data(seed=1))
    capsys.readouterr()
    best = trainer.test(dataloaders=_data(seed=2))
    assert "best checkpoint" in capsys.readouterr().err
    assert (
        trainer.ckpt_path is not None
        and trainer.ckpt_path.name == __import__("pathlib").Path(saver.best_model_path).name
    )
    current = trainer.test(module, _data(seed=2))  # the module passed: its current weights
    assert best[0]["test_loss"] != current[0]["test_loss"] or saver.best_model_path.endswith("epoch=2-step=12")
    assert len(trainer.predict(dataloaders=_data(seed=3))) == 4
    assert set(trainer.validate(dataloaders=_data(seed=1))[0]) == {"val_loss"}


def test_evaluating_without_a_module_before_any_run_says_what_to_pass() -> None:
    with pytest.raises(ValueError, match=r"trainer.test\(module, dataloaders\)"):
        ember.Trainer(logger=False).test(dataloaders=_data())


# --- 9. Lightning's random streams, on request ------------------------------------------------------------------
def _dropout_module(base: type) -> Any:
    def __init__(self: Any) -> None:
        base.__init__(self)
        self.net = nn.Sequential(nn.Linear(4, 16), nn.Dropout(0.5), nn.Linear(16, 1))

    def training_step(self: Any, batch: Any, batch_idx: int) -> torch.Tensor:
        loss = _loss(self, batch)
        self.log("loss", loss)
        return loss

    def validation_step(self: Any, batch: Any, batch_idx: int) -> None:
        self.log("val_loss", _loss(self, batch))

    def configure_optimizers(self: Any) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.parameters(), lr=0.05)

    methods = {"__init__": __init__, "training_step": training_step, "validation_step": validation_step}
    cls = type("DropoutNet", (base,), {**methods, "configure_optimizers": configure_optimizers})
    torch.manual_seed(0)
    return cls()


def _shuffled(seed: int = 0) -> DataLoader[Any]:
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(32, 4, generator=g)
    return DataLoader(TensorDataset(x, x.sum(1, keepdim=True)), batch_size=8, shuffle=True)


@pytest.mark.parametrize("lightning_rng", [True, False])
def test_lightning_rng_reproduces_lightnings_stream_bit_for_bit(lightning_rng: bool) -> None:
    torch.manual_seed(1)
    lightning = _dropout_module(pl.LightningModule)
    torch.manual_seed(1)
    pl.Trainer(max_epochs=3, **QUIET_LIGHTNING).fit(lightning, _shuffled(), _data(seed=1))
    ours = _dropout_module(ember.TrainingModule)
    torch.manual_seed(1)
    ember.Trainer(max_epochs=3, lightning_rng=lightning_rng, **QUIET_EMBER).fit(ours, _shuffled(), _data(seed=1))
    same = all(torch.equal(p, q) for p, q in zip(lightning.parameters(), ours.parameters(), strict=True))
    assert same == lightning_rng, "only with lightning_rng=True does validation draw where Lightning's does"


# --- 10. callback_metrics after test() ---------------------------------------------------------------------------
def test_callback_metrics_after_test_hold_the_test_metrics_only_as_in_lightning() -> None:
    def training_step(self: Any, batch: Any, batch_idx: int) -> torch.Tensor:
        loss = _loss(self, batch)
        self.log("train_loss", loss)
        return loss

    def test_step(self: Any, batch: Any, batch_idx: int) -> None:
        self.log("test_loss", _loss(self, batch))

    names = {}
    for base, trainer in (
        (pl.LightningModule, pl.Trainer(max_epochs=1, **QUIET_LIGHTNING)),
        (ember.TrainingModule, ember.Trainer(max_epochs=1, **QUIET_EMBER)),
    ):
        module = _regressor(base, training_step=training_step, test_step=test_step)
        trainer.fit(module, _data())
        trainer.test(module, _data(seed=2), **({"verbose": False} if base is pl.LightningModule else {}))
        names[base] = set(trainer.callback_metrics)
    assert names[ember.TrainingModule] == names[pl.LightningModule] == {"test_loss"}


# --- 12. epoch schedulers step before the last batch's on_train_batch_end --------------------------------------------
def test_an_epoch_scheduler_steps_where_lightnings_does() -> None:
    def configure_optimizers(self: Any) -> Any:
        opt = torch.optim.SGD(self.parameters(), lr=0.1)
        return {"optimizer": opt, "lr_scheduler": torch.optim.lr_scheduler.StepLR(opt, step_size=1, gamma=0.5)}

    def record(self: Any, *args: Any) -> None:
        self.seen.append(self.optimizers().param_groups[0]["lr"] if not hasattr(self.optimizers(), "optimizer")
                         else self.optimizers().optimizer.param_groups[0]["lr"])  # fmt: skip

    seen = {}
    for base, trainer in (
        (pl.LightningModule, pl.Trainer(max_epochs=2, **QUIET_LIGHTNING)),
        (ember.TrainingModule, ember.Trainer(max_epochs=2, **QUIET_EMBER)),
    ):
        hooks = {"on_train_batch_end": record, "on_train_epoch_end": record}
        module = _regressor(
            base, training_step=lambda self, b, i: _loss(self, b), configure_optimizers=configure_optimizers, **hooks
        )
        module.seen = []
        trainer.fit(module, _data())
        seen[base] = module.seen
    assert seen[ember.TrainingModule] == seen[pl.LightningModule]
    assert seen[ember.TrainingModule][3:5] == [0.05, 0.05], "the last batch's on_train_batch_end sees the stepped lr"


# --- 6. save_hyperparameters with values that are not plain data, then load_from_checkpoint ------------------------
class WithClassArgs(ember.TrainingModule):
    """In the idiom of modules that take a loss class, an activation function and a backbone object."""

    def __init__(self, loss_cls: type = nn.MSELoss, act: Any = torch.tanh, sizes: tuple[int, ...] = (4, 8),
                 backbone: nn.Module | None = None) -> None:  # fmt: skip
        super().__init__()
        self.save_hyperparameters()
        self.backbone = backbone if backbone is not None else nn.Identity()
        self.net = nn.Linear(sizes[0], 1)
        self.loss_fn, self.act = loss_cls(), act

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        x, y = batch
        return self.loss_fn(self.net(self.act(self.backbone(x))), y)

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.parameters(), lr=0.05)


def test_a_checkpoint_with_class_and_object_hyperparameters_loads_back(tmp_path: Any) -> None:
    with pytest.warns(UserWarning, match=r"'backbone' is a torch.nn.modules.linear.Linear.*backbone=\.\.\."):
        module = WithClassArgs(loss_cls=nn.L1Loss, act=torch.relu, backbone=nn.Linear(4, 4))
    trainer = ember.Trainer(max_epochs=1, default_root_dir=tmp_path, logger=False, enable_progress_bar=False)
    trainer.fit(module, _data())
    best = trainer.checkpoint_callback.best_model_path  # type: ignore[union-attr]
    with pytest.raises(TypeError, match=r"'backbone' \(a torch.nn.modules.linear.Linear\).*backbone=\.\.\."):
        WithClassArgs.load_from_checkpoint(best)
    loaded = WithClassArgs.load_from_checkpoint(best, backbone=nn.Linear(4, 4))
    assert loaded.hparams.loss_cls is nn.L1Loss and loaded.hparams.act is torch.relu
    assert loaded.hparams.sizes == (4, 8) and isinstance(loaded.loss_fn, nn.L1Loss)
    for name, value in module.state_dict().items():
        assert torch.equal(loaded.state_dict()[name], value), name


def test_a_reference_to_a_module_not_imported_is_never_imported(tmp_path: Any) -> None:
    from ember.checkpoint.hparams import REFERENCE, from_checkpoint

    saved = {"cls": {REFERENCE: "a_module_nobody_imported:Thing"}}
    with pytest.raises(TypeError, match=r"has not imported .* never imports code"):
        from_checkpoint(saved, {}, "M")
    assert "a_module_nobody_imported" not in __import__("sys").modules


# --- found by the corpus (tests/compat/real) ------------------------------------------------------------------
@pytest.mark.parametrize(
    ("options", "accumulate"), [({"max_epochs": 3}, 1), ({"max_epochs": 2}, 3), ({"max_steps": 5, "max_epochs": 9}, 2)]
)
def test_estimated_stepping_batches_is_lightnings(options: dict[str, Any], accumulate: int) -> None:
    seen = {}
    for base, trainer in (
        (pl.LightningModule, pl.Trainer(accumulate_grad_batches=accumulate, **options, **QUIET_LIGHTNING)),
        (ember.TrainingModule, ember.Trainer(accumulate_grad_batches=accumulate, **options, **QUIET_EMBER)),
    ):

        def configure_optimizers(self: Any, base: type = base) -> Any:
            seen[base] = self.trainer.estimated_stepping_batches
            return torch.optim.SGD(self.parameters(), lr=0.01)

        steps = {"training_step": lambda self, b, i: _loss(self, b), "configure_optimizers": configure_optimizers}
        trainer.fit(_regressor(base, **steps), _data(n=40, batch_size=8))
    assert seen[ember.TrainingModule] == seen[pl.LightningModule]


def test_parallel_strategy_is_exported_for_isinstance_checks() -> None:
    from ember.strategies import DDPStrategy, ParallelStrategy, Strategy

    assert issubclass(DDPStrategy, ParallelStrategy) and not isinstance(
        ember.Trainer(logger=False).strategy, ParallelStrategy
    )
    assert issubclass(ParallelStrategy, Strategy)


def test_a_datamodule_saves_its_hyperparameters() -> None:
    class Data(ember.DataModule):
        def __init__(self, batch_size: int = 8, data_dir: str = "data", workers: int = 0) -> None:
            super().__init__()
            self.save_hyperparameters(ignore=["workers"], logger=False)

    data = Data(batch_size=16)
    assert dict(data.hparams) == {"batch_size": 16, "data_dir": "data"} and data.hparams.batch_size == 16


@pytest.mark.parametrize("to_loggers", [True, False])
def test_save_hyperparameters_logger_false_keeps_them_from_the_loggers(to_loggers: bool) -> None:
    class Recording(ember.loggers.CSVLogger):
        def __init__(self) -> None:
            super().__init__()
            self.params: list[dict[str, Any]] = []

        def log_hyperparams(self, params: dict[str, Any]) -> None:
            self.params.append(dict(params))

    class Module(ember.TrainingModule):
        def __init__(self, lr: float = 0.05) -> None:
            super().__init__()
            self.save_hyperparameters(logger=to_loggers)
            self.net = nn.Linear(4, 1)

        def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
            return _loss(self, batch)

        def configure_optimizers(self) -> torch.optim.Optimizer:
            return torch.optim.SGD(self.parameters(), lr=self.hparams.lr)

    logger = Recording()
    trainer = ember.Trainer(max_steps=1, logger=logger, enable_progress_bar=False, enable_checkpointing=False)
    module = Module()
    trainer.fit(module, _data())
    assert logger.params == ([{"lr": 0.05}] if to_loggers else []) and module.hparams.lr == 0.05


# --- the corpus's last gaps (tests/compat/real) ----------------------------------------------------------------
def _val_logging(base: type, **methods: Any) -> Any:
    def validation_step(self: Any, batch: Any, batch_idx: int) -> None:
        self.log("val_loss", _loss(self, batch))

    steps = {"training_step": lambda self, b, i: _loss(self, b), "validation_step": validation_step}
    return _regressor(base, **steps, **methods)


@pytest.mark.parametrize(
    ("filename", "auto_insert"), [("{epoch}-{val_loss:.2f}", True), ("e{epoch:02d}_l{val_loss:.3f}", False)]
)
def test_checkpoint_names_are_lightnings(tmp_path: Any, filename: str, auto_insert: bool) -> None:
    names = {}
    for base, fw, options in ((pl.LightningModule, pl, QUIET_LIGHTNING), (ember.TrainingModule, ember, QUIET_EMBER)):
        saver = (pl.pytorch if fw is pl else ember).callbacks.ModelCheckpoint(
            dirpath=tmp_path / base.__name__, filename=filename, monitor="val_loss", save_top_k=-1,
            auto_insert_metric_name=auto_insert,
        )  # fmt: skip
        options = {**options, "enable_checkpointing": True, "default_root_dir": tmp_path}
        fw.Trainer(max_epochs=3, callbacks=[saver], **options).fit(_val_logging(base), _data(), _data(seed=1))
        kept = saver.best_k_models if base is pl.LightningModule else saver.kept
        names[base] = (sorted(Path(p).name.removesuffix(".ckpt") for p in kept), Path(saver.best_model_path).name)
    lightning, ours = names[pl.LightningModule], names[ember.TrainingModule]
    assert ours[0] == lightning[0] and len(ours[0]) == 3
    assert ours[1] == lightning[1].removesuffix(".ckpt")
    assert ours[0][0].startswith("epoch=0-val_loss=" if auto_insert else "e00_l")


def test_a_checkpoint_name_is_one_directory() -> None:
    with pytest.raises(ValueError, match="one directory"):
        ember.callbacks.ModelCheckpoint(filename="sub/{epoch}", auto_insert_metric_name=False)


@pytest.mark.parametrize(
    "options",
    [{"name": "exp", "prefix": "p"}, {"name": "exp"}, {"name": None}, {"version": "run_a"}, {"name": "", "version": 3}],
)
def test_csv_logger_name_version_and_prefix_lay_out_files_as_lightnings(tmp_path: Any, options: dict[str, Any]) -> None:
    import csv

    from lightning.pytorch.loggers import CSVLogger as LightningCSVLogger

    found = {}
    for base, fw, logger_cls in (
        (pl.LightningModule, pl, LightningCSVLogger),
        (ember.TrainingModule, ember, ember.loggers.CSVLogger),
    ):
        root = tmp_path / base.__name__
        (root / (options.get("name", "lightning_logs") or "") / "version_0").mkdir(parents=True)  # an earlier run
        quiet = {k: v for k, v in (QUIET_LIGHTNING if fw is pl else QUIET_EMBER).items() if k != "logger"}
        # ember's default name is its own layout (save_dir itself); Lightning's is "lightning_logs"
        given = options if fw is pl else {"name": "lightning_logs", **options}
        trainer = fw.Trainer(
            max_epochs=1, log_every_n_steps=1, logger=logger_cls(root, **given), default_root_dir=tmp_path, **quiet
        )
        trainer.fit(_forked_metrics(base), _data())
        (path,) = root.rglob("metrics.csv")
        with open(path, newline="") as f:
            found[base] = (path.relative_to(root).as_posix(), set(next(csv.reader(f))))
    assert found[ember.TrainingModule] == found[pl.LightningModule]
    if options.get("prefix"):
        assert "p-train_loss_step" in found[ember.TrainingModule][1]


def test_csv_logger_without_name_or_version_writes_into_save_dir(tmp_path: Any) -> None:
    logger = ember.loggers.CSVLogger(tmp_path)
    assert logger.log_dir == tmp_path and logger.version is None and logger.name == ""
    logger.log_metrics({"a": 1.0}, step=1)
    logger.save()
    assert (tmp_path / "metrics.csv").exists()
    with pytest.raises(TypeError, match="version="):
        ember.loggers.CSVLogger(tmp_path, version=1.5)  # type: ignore[arg-type]


def test_entry_points_take_lightnings_model_keyword() -> None:
    def test_step(self: Any, batch: Any, batch_idx: int) -> None:
        self.log("test_loss", _loss(self, batch))

    def predict_step(self: Any, batch: Any, batch_idx: int) -> torch.Tensor:
        return self.net(batch[0])

    results = {}
    for base, trainer, quiet in (
        (pl.LightningModule, pl.Trainer(max_epochs=1, **QUIET_LIGHTNING), {"verbose": False}),
        (ember.TrainingModule, ember.Trainer(max_epochs=1, **QUIET_EMBER), {}),
    ):
        module = _val_logging(base, test_step=test_step, predict_step=predict_step)
        trainer.fit(model=module, train_dataloaders=_data(), val_dataloaders=_data(seed=1))
        validated = trainer.validate(model=module, dataloaders=_data(seed=1), **quiet)
        tested = trainer.test(model=module, dataloaders=_data(seed=2), **quiet)
        predicted = torch.cat(trainer.predict(model=module, dataloaders=_data(seed=3)))
        results[base] = (validated[0]["val_loss"], tested[0]["test_loss"], predicted)
    lightning, ours = results[pl.LightningModule], results[ember.TrainingModule]
    assert math.isclose(ours[0], lightning[0], rel_tol=1e-6) and math.isclose(ours[1], lightning[1], rel_tol=1e-6)
    assert torch.equal(ours[2], lightning[2])
    module = _val_logging(ember.TrainingModule)
    with pytest.raises(TypeError, match="both module and model="):
        ember.Trainer(**QUIET_EMBER).fit(module, _data(), model=module)
    with pytest.raises(TypeError, match="no module given"):
        ember.Trainer(**QUIET_EMBER).fit(train_dataloaders=_data())


def test_a_datamodule_knows_its_trainer_as_in_lightning() -> None:
    seen = {}
    for base, dm_base, trainer in (
        (pl.LightningModule, pl.LightningDataModule, pl.Trainer(max_steps=2, **QUIET_LIGHTNING)),
        (ember.TrainingModule, ember.DataModule, ember.Trainer(max_steps=2, **QUIET_EMBER)),
    ):
        record: list[Any] = []

        def setup(self: Any, stage: str, record: list[Any] = record) -> None:
            record.append(self.trainer)

        data = type("Data", (dm_base,), {"setup": setup, "train_dataloader": lambda self: _data()})()
        record.append(data.trainer)
        trainer.fit(_regressor(base, training_step=lambda self, b, i: _loss(self, b)), datamodule=data)
        record.append(data.trainer)
        seen[base] = [None if t is None else t is trainer for t in record]
    assert seen[ember.TrainingModule] == seen[pl.LightningModule] == [None, True, True]


def test_weights_only_is_accepted_as_in_lightning(tmp_path: Any) -> None:
    def test_step(self: Any, batch: Any, batch_idx: int) -> None:
        self.log("test_loss", _loss(self, batch))

    results = {}
    for base, fw, options, quiet in (
        (pl.LightningModule, pl, QUIET_LIGHTNING, {"verbose": False}),
        (ember.TrainingModule, ember, QUIET_EMBER, {}),
    ):
        checkpoints = (pl.pytorch if fw is pl else ember).callbacks
        saver = checkpoints.ModelCheckpoint(dirpath=tmp_path / base.__name__, monitor="val_loss")
        options = {**options, "enable_checkpointing": True, "default_root_dir": tmp_path}
        trainer = fw.Trainer(max_epochs=2, callbacks=[saver], **options)
        module = _val_logging(base, test_step=test_step)
        trainer.fit(module, _data(), _data(seed=1), weights_only=None)
        best = saver.best_model_path
        results[base] = [
            trainer.test(module, _data(seed=2), ckpt_path=best, weights_only=w, **quiet)[0]["test_loss"]
            for w in (None, True, False)
        ]
    lightning, ours = results[pl.LightningModule], results[ember.TrainingModule]
    assert ours[0] == ours[1] == ours[2] and math.isclose(ours[0], lightning[0], rel_tol=1e-6)
    assert lightning[0] == lightning[1] == lightning[2]
    with pytest.raises(TypeError, match="weights_only='no'"):
        ember.Trainer(**QUIET_EMBER).test(_val_logging(ember.TrainingModule), _data(), weights_only="no")


def test_a_metric_logged_at_validation_epoch_end_keeps_its_plain_name_with_several_loaders() -> None:
    def validation_step(self: Any, batch: Any, batch_idx: int, dataloader_idx: int = 0) -> None:
        self.log("val_loss", _loss(self, batch))

    def on_validation_epoch_end(self: Any) -> None:
        self.log("val_epoch_end", torch.tensor(2.0))

    methods = {"validation_step": validation_step, "on_validation_epoch_end": on_validation_epoch_end}
    seen = {}
    for base, trainer, quiet in (
        (pl.LightningModule, pl.Trainer(max_epochs=1, **QUIET_LIGHTNING), {"verbose": False}),
        (ember.TrainingModule, ember.Trainer(max_epochs=1, **QUIET_EMBER), {}),
    ):
        module = _regressor(base, training_step=lambda self, b, i: _loss(self, b), **methods)
        trainer.fit(module, _data(), [_data(seed=1), _data(seed=2)])
        fitted = sorted(trainer.callback_metrics)
        validated = trainer.validate(module, [_data(seed=1), _data(seed=2)], **quiet)
        seen[base] = (fitted, [sorted(r) for r in validated], [r["val_epoch_end"] for r in validated])
    assert seen[ember.TrainingModule] == seen[pl.LightningModule]
    assert "val_epoch_end" in seen[ember.TrainingModule][0]


def test_optimizer_step_under_manual_optimization_is_never_called_as_in_lightning() -> None:
    def training_step(self: Any, batch: Any, batch_idx: int) -> None:
        opt = self.optimizers()
        opt.zero_grad()
        self.manual_backward(_loss(self, batch))
        opt.step()

    def optimizer_step(self: Any, *args: Any, **kwargs: Any) -> None:
        self.calls += 1

    params, calls = {}, {}
    for base, trainer in (
        (pl.LightningModule, pl.Trainer(max_epochs=2, **QUIET_LIGHTNING)),
        (ember.TrainingModule, ember.Trainer(max_epochs=2, **QUIET_EMBER)),
    ):

        def __init__(self: Any, base: type = base) -> None:
            base.__init__(self)
            self.net = nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 1))
            self.automatic_optimization = False  # in __init__, as modules set it
            self.calls = 0

        module = _regressor(base, __init__=__init__, training_step=training_step, optimizer_step=optimizer_step)
        trainer.fit(module, _data())
        params[base], calls[base] = dict(module.named_parameters()), module.calls
    assert calls[ember.TrainingModule] == calls[pl.LightningModule] == 0
    for name, value in params[pl.LightningModule].items():
        assert torch.equal(params[ember.TrainingModule][name], value), name


def _randomly_built(base: type, order: list[str]) -> Any:
    """A module whose dataloaders build random datasets from the global generator (as Lightning's RandomDataset)."""

    def loader(name: str) -> Any:
        def make(self: Any) -> DataLoader[Any]:
            order.append(name)
            x = torch.randn(16, 4)
            return DataLoader(TensorDataset(x, x.sum(1, keepdim=True)), batch_size=4)

        return make

    def validation_step(self: Any, batch: Any, batch_idx: int) -> None:
        self.log("val_loss", _loss(self, batch))

    return _regressor(
        base, training_step=lambda self, b, i: _loss(self, b), validation_step=validation_step,
        train_dataloader=loader("train"), val_dataloader=loader("val"),
    )  # fmt: skip


@pytest.mark.parametrize("lightning_rng", [True, False])
def test_dataloaders_are_asked_in_lightnings_order_and_random_state(lightning_rng: bool) -> None:
    params, orders = {}, {}
    for base, make_trainer in (
        (pl.LightningModule, lambda: pl.Trainer(max_epochs=2, **QUIET_LIGHTNING)),
        (ember.TrainingModule, lambda: ember.Trainer(max_epochs=2, lightning_rng=lightning_rng, **QUIET_EMBER)),
    ):
        order: list[str] = []
        module = _randomly_built(base, order)
        torch.manual_seed(3)
        make_trainer().fit(module)
        params[base], orders[base] = dict(module.named_parameters()), order
    assert orders[ember.TrainingModule] == orders[pl.LightningModule] == ["val", "train"]
    for name, value in params[pl.LightningModule].items():  # the training data drawn where Lightning draws it
        assert torch.equal(params[ember.TrainingModule][name], value), name


def test_lightning_optimizer_is_what_optimizers_returns_and_port_maps_its_import() -> None:
    from lightning.pytorch.core.optimizer import LightningOptimizer

    from ember.port import port_source

    ported = port_source("from lightning.pytorch.core.optimizer import LightningOptimizer\n")
    assert ported.source == "from ember.modules import LightningOptimizer\n" and not ported.notes
    from ember.modules import LightningOptimizer as EmberLightningOptimizer

    seen = {}
    for base, trainer, wrapper in (
        (pl.LightningModule, pl.Trainer(max_steps=1, **QUIET_LIGHTNING), LightningOptimizer),
        (ember.TrainingModule, ember.Trainer(max_steps=1, **QUIET_EMBER), EmberLightningOptimizer),
    ):
        found: list[bool] = []

        def training_step(self: Any, batch: Any, batch_idx: int, found: list[bool] = found, wrapper: Any = wrapper):
            opt = self.optimizers()
            found.append(isinstance(opt, wrapper) and isinstance(opt.optimizer, torch.optim.SGD))
            self.manual_backward(_loss(self, batch))
            opt.step()

        module = _regressor(base, training_step=training_step)
        module.automatic_optimization = False
        trainer.fit(module, _data())
        seen[base] = found
    assert seen[ember.TrainingModule] == seen[pl.LightningModule] == [True]


@pytest.mark.parametrize(("every", "steps"), [(50, 20), (2, 5)])
def test_logged_metrics_and_logger_steps_are_lightnings(every: int, steps: int) -> None:
    from lightning.pytorch.loggers import Logger as LightningLogger

    def training_step(self: Any, batch: Any, batch_idx: int) -> torch.Tensor:
        loss = _loss(self, batch)
        self.log("loss", loss)
        return loss

    class Recording(LightningLogger):
        name, version = "r", 0

        def __init__(self) -> None:
            super().__init__()
            self.steps: list[int] = []

        def log_hyperparams(self, params: Any, *args: Any, **kwargs: Any) -> None:
            pass

        def log_metrics(self, metrics: dict[str, float], step: int | None = None) -> None:
            self.steps.append(int(step or 0))

    class EmberRecording(ember.loggers.Logger):
        def __init__(self) -> None:
            super().__init__()
            self.steps: list[int] = []

        def log_metrics(self, metrics: dict[str, float], step: int) -> None:
            self.steps.append(step)

    seen = {}
    quiet = {"enable_progress_bar": False, "enable_model_summary": False, "enable_checkpointing": False}
    for base, fw, logger in ((pl.LightningModule, pl, Recording()), (ember.TrainingModule, ember, EmberRecording())):
        options = {"accelerator": "cpu", "devices": 1} if fw is pl else {}
        trainer = fw.Trainer(max_steps=steps, log_every_n_steps=every, logger=logger, **quiet, **options)
        trainer.fit(_regressor(base, training_step=training_step), _data(n=80, batch_size=4))
        seen[base] = (logger.steps, {k: float(v) for k, v in trainer.logged_metrics.items()})
    assert seen[ember.TrainingModule] == seen[pl.LightningModule]


def _rows_of(base: type) -> type:
    """A logger class on `base` (Lightning's ``Logger`` or ember's) that records every row: (step, sorted names)."""

    class Rows(base):  # type: ignore[valid-type, misc]
        name, version = "r", 0

        def __init__(self) -> None:
            super().__init__()
            self.rows: list[tuple[int, list[str]]] = []

        def log_hyperparams(self, params: Any, *args: Any, **kwargs: Any) -> None:
            pass

        def log_metrics(self, metrics: dict[str, float], step: int | None = None) -> None:
            self.rows.append((int(step or 0), sorted(k for k in metrics if k != "epoch")))

    return Rows


@pytest.mark.parametrize("every", [1, 3])
def test_logger_rows_of_validation_epoch_ends_and_test_are_at_lightnings_steps(every: int) -> None:
    """Every row a logger gets (its step and the names in it): step rows, validation inside fit every 2 batches,
    epoch ends with ``on_epoch`` values, and ``test()`` after fit, which logs at the steps taken."""

    def training_step(self: Any, batch: Any, batch_idx: int) -> torch.Tensor:
        loss = _loss(self, batch)
        self.log("loss", loss, on_step=True, on_epoch=True)
        return loss

    def validation_step(self: Any, batch: Any, batch_idx: int) -> None:
        self.log("val_loss", _loss(self, batch))

    def test_step(self: Any, batch: Any, batch_idx: int) -> None:
        self.log("test_loss", _loss(self, batch))

    steps = {"training_step": training_step, "validation_step": validation_step, "test_step": test_step}
    seen, _ = _logged_rows_under_both(steps, every=every, val_check_interval=2, train_samples=16)
    ember_rows = seen[ember.TrainingModule]
    assert ember_rows == seen[pl.LightningModule]
    first_step_row = next(step for step, names in ember_rows if names == ["loss_step"])
    assert first_step_row == every - 1  # optimizer step N's row is step N - 1: with every=1, step 0
    assert ember_rows[-1] == (8, ["test_loss"])  # 2 epochs x 4 batches, then test


@pytest.mark.parametrize("every", [1, 3])
def test_logger_rows_of_manual_optimization_with_several_steps_per_batch_are_lightnings(every: int) -> None:
    """A GAN-like module under manual optimization: two optimizers, stepped 2, 1 or 0 times per batch. The
    loggers get Lightning's rows (step and names): one per batch that logs, at the batches taken before it,
    every `every` batches, epoch ends and validation at the same steps, and ``test()`` at the batches taken;
    ``global_step`` counts every optimizer step, as in Lightning."""

    def configure_optimizers(self: Any) -> list[torch.optim.Optimizer]:
        return [torch.optim.SGD(self.net[0].parameters(), lr=0.05), torch.optim.SGD(self.net[2].parameters(), lr=0.05)]

    def training_step(self: Any, batch: Any, batch_idx: int) -> None:
        first, second = self.optimizers()
        loss = _loss(self, batch)
        self.manual_backward(loss)
        if batch_idx % 3 != 2:  # per epoch of 6 batches: 2, 1, 1, 1, 2 and 0 steps
            first.step()
        if batch_idx % 2 == 0:
            second.step()
        first.zero_grad()
        second.zero_grad()
        self.log("loss", loss, on_step=True, on_epoch=True)

    def validation_step(self: Any, batch: Any, batch_idx: int) -> None:
        self.log("val_loss", _loss(self, batch))

    def test_step(self: Any, batch: Any, batch_idx: int) -> None:
        self.log("test_loss", _loss(self, batch))

    methods = {
        "configure_optimizers": configure_optimizers,
        "training_step": training_step,
        "validation_step": validation_step,
        "test_step": test_step,
    }
    seen, steps = _logged_rows_under_both(methods, every=every, val_check_interval=3, train_samples=24, manual=True)
    ember_rows = seen[ember.TrainingModule]
    assert ember_rows == seen[pl.LightningModule]
    assert steps[ember.TrainingModule] == steps[pl.LightningModule] == 2 * (2 + 1 + 1 + 1 + 2 + 0)  # 2 x 6 batches
    step_rows = [step for step, names in ember_rows if names == ["loss_step"]]
    assert step_rows == list(range(every - 1, 12, every))  # a row every `every` batches, whatever stepped
    assert ember_rows[-1] == (12, ["test_loss"])  # 2 epochs x 6 batches, then test


def _logged_rows_under_both(
    methods: dict[str, Any], every: int, val_check_interval: int, train_samples: int, manual: bool = False
) -> tuple[dict[type, list[Any]], dict[type, int]]:
    """The same small module (`methods` on `_regressor`) fit for 2 epochs then tested, under Lightning and under
    ember: each framework's logged (step, names) rows and its ``global_step`` after fit, by module base class."""
    from lightning.pytorch.loggers import Logger as LightningLogger

    seen, steps = {}, {}
    quiet = {"enable_progress_bar": False, "enable_model_summary": False, "enable_checkpointing": False}
    for base, fw, logger_base in (
        (pl.LightningModule, pl, LightningLogger),
        (ember.TrainingModule, ember, ember.loggers.Logger),
    ):
        logger = _rows_of(logger_base)()
        options = {"accelerator": "cpu", "devices": 1} if fw is pl else {}
        trainer = fw.Trainer(
            max_epochs=2,
            log_every_n_steps=every,
            val_check_interval=val_check_interval,
            logger=logger,
            **quiet,
            **options,
        )
        module = _regressor(base, **methods)
        module.automatic_optimization = not manual
        trainer.fit(module, _data(n=train_samples, batch_size=4), _data(n=8, batch_size=4, seed=1))
        steps[base] = trainer.global_step
        trainer.test(module, _data(n=8, batch_size=4, seed=2))
        seen[base] = logger.rows
    return seen, steps
