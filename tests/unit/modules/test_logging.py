"""`self.log`: step/epoch defaults, weighted means, reduce_fx, Metric objects, loggers, suffixes."""

from __future__ import annotations

import csv
from collections.abc import Callable

import pytest
import torch
import torchmetrics
from torch import nn
from torch.nn import functional as F
from torch.utils.data import DataLoader, TensorDataset

import ember
from ember.loggers import CSVLogger

TRAINER_KW = dict(logger=False, enable_progress_bar=False, enable_model_summary=False, enable_checkpointing=False)

# 10 samples in batches of 4, 4, 2. Column 0 is 0..9, so the batch means of column 0 are 1.5, 5.5, 8.5:
# the batch-size weighted mean is 4.5, the plain mean of the batch means is 15.5 / 3.
N, BATCH = 10, 4
BATCH_MEANS = [1.5, 5.5, 8.5]
BATCH_SIZES = [4, 4, 2]
WEIGHTED_MEAN = 4.5


def make_xy(n: int = N, offset: float = 0.0) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(n)
    x = torch.randn(n, 3, generator=g)
    x[:, 0] = torch.arange(n, dtype=torch.float32) + offset
    y = torch.randn(n, generator=g)
    return x, y


def loader(n: int = N, offset: float = 0.0, batch_size: int = BATCH) -> DataLoader:
    return DataLoader(TensorDataset(*make_xy(n, offset)), batch_size=batch_size, shuffle=False)


LogFn = Callable[["Recorder", tuple, int, int], None]


class Recorder(ember.TrainingModule):
    """A regression module whose steps call the given functions to log things."""

    def __init__(self, train_log: LogFn | None = None, val_log: LogFn | None = None) -> None:
        super().__init__()
        self.model = nn.Linear(3, 1)
        self.train_log = train_log
        self.val_log = val_log

    def training_step(self, batch, batch_idx):
        x, y = batch
        loss = F.mse_loss(self.model(x).squeeze(-1), y)
        if self.train_log is not None:
            self.train_log(self, batch, batch_idx, loss)
        return loss

    def validation_step(self, batch, batch_idx, dataloader_idx=0):
        if self.val_log is not None:
            self.val_log(self, batch, batch_idx, dataloader_idx)

    test_step = validation_step

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.01)


def validate(val_log: LogFn, loaders=None) -> tuple[list[dict[str, float]], ember.Trainer]:
    trainer = ember.Trainer(**TRAINER_KW)
    result = trainer.validate(Recorder(val_log=val_log), loaders if loaders is not None else loader())
    return result, trainer


# --- epoch aggregation --------------------------------------------------------------------


def test_epoch_mean_is_weighted_by_batch_size():
    def val_log(m, batch, batch_idx, dl_idx):
        x, _ = batch
        m.log("val/x0", x[:, 0].mean())
        m.log("val/idx", float(batch_idx))  # a Python number

    (res,), trainer = validate(val_log)
    assert set(res) == {"val/x0", "val/idx"}
    assert res["val/x0"] == pytest.approx(WEIGHTED_MEAN)
    assert res["val/x0"] != pytest.approx(sum(BATCH_MEANS) / 3)
    assert res["val/idx"] == pytest.approx((0 * 4 + 1 * 4 + 2 * 2) / 10)
    assert trainer.callback_metrics["val/x0"] == pytest.approx(WEIGHTED_MEAN)
    assert isinstance(trainer.callback_metrics["val/x0"], float)


def test_epoch_mean_uses_explicit_batch_size():
    def val_log(m, batch, batch_idx, dl_idx):
        m.log("val/x0", batch[0][:, 0].mean(), batch_size=1)

    (res,), _ = validate(val_log)
    assert res["val/x0"] == pytest.approx(sum(BATCH_MEANS) / 3)


def test_test_stage_aggregates_the_same_way():
    def log(m, batch, batch_idx, dl_idx):
        m.log("test/x0", batch[0][:, 0].mean())

    trainer = ember.Trainer(**TRAINER_KW)
    (res,) = trainer.test(Recorder(val_log=log), loader())
    assert res == pytest.approx({"test/x0": WEIGHTED_MEAN})


@pytest.mark.parametrize(
    ("reduce_fx", "expected"),
    [
        ("sum", sum(BATCH_MEANS)),
        ("max", max(BATCH_MEANS)),
        ("min", min(BATCH_MEANS)),
        ("mean", WEIGHTED_MEAN),
    ],
)
def test_reduce_fx(reduce_fx, expected):
    def val_log(m, batch, batch_idx, dl_idx):
        m.log("val/x0", batch[0][:, 0].mean(), reduce_fx=reduce_fx)

    (res,), _ = validate(val_log)
    assert res["val/x0"] == pytest.approx(expected)


def test_reduce_fx_max_min_with_negative_values():
    # min/max must not start from 0: all values are negative (max) or positive (min)
    def val_log(m, batch, batch_idx, dl_idx):
        m.log("val/neg_max", -batch[0][:, 0].mean() - 1, reduce_fx="max")
        m.log("val/pos_min", batch[0][:, 0].mean() + 1, reduce_fx="min")

    (res,), _ = validate(val_log)
    assert res["val/neg_max"] == pytest.approx(-2.5)
    assert res["val/pos_min"] == pytest.approx(2.5)


def test_bad_reduce_fx_lists_valid_ones():
    def val_log(m, batch, batch_idx, dl_idx):
        m.log("val/x0", batch[0][:, 0].mean(), reduce_fx="median")

    with pytest.raises(ValueError, match="median") as info:
        validate(val_log)
    for name in ("mean", "sum", "max", "min"):
        assert name in str(info.value)


def test_non_scalar_tensor_raises():
    def val_log(m, batch, batch_idx, dl_idx):
        m.log("val/vec", batch[0][:, 0])

    with pytest.raises(ValueError, match=r"scalar.*\(4,\)"):
        validate(val_log)


def test_one_element_tensor_is_accepted():
    def val_log(m, batch, batch_idx, dl_idx):
        m.log("val/one", batch[0][:1, 0].reshape(1, 1))  # shape (1, 1): one element

    (res,), _ = validate(val_log)
    # first element of each batch: 0, 4, 8 weighted by 4, 4, 2
    assert res["val/one"] == pytest.approx((0 * 4 + 4 * 4 + 8 * 2) / 10)


def test_log_rejects_other_types():
    def val_log(m, batch, batch_idx, dl_idx):
        m.log("val/s", "text")

    with pytest.raises(TypeError, match="numbers, scalar tensors"):
        validate(val_log)


def test_log_dict_logs_every_item():
    def val_log(m, batch, batch_idx, dl_idx):
        m.log_dict({"val/a": batch[0][:, 0].mean(), "val/b": 2.0}, reduce_fx="max")

    (res,), _ = validate(val_log)
    assert res == pytest.approx({"val/a": 8.5, "val/b": 2.0})


def test_log_outside_trainer_warns_once():
    module = Recorder()
    with pytest.warns(RuntimeWarning, match="outside a Trainer"):
        module.log("x", 1.0)
    import warnings

    with warnings.catch_warnings():
        warnings.simplefilter("error")
        module.log("x", 1.0)  # no second warning


# --- on_step / on_epoch ---------------------------------------------------------------------


def test_train_logs_default_to_on_step():
    def train_log(m, batch, batch_idx, loss):
        m.log("train/x0", batch[0][:, 0].mean())

    trainer = ember.Trainer(max_epochs=2, **TRAINER_KW)
    trainer.fit(Recorder(train_log=train_log), loader())
    assert trainer.callback_metrics["train/x0"] == pytest.approx(BATCH_MEANS[-1])
    assert not any(k.startswith("train/x0_") for k in trainer.callback_metrics)


def test_train_on_epoch_only():
    def train_log(m, batch, batch_idx, loss):
        m.log("train/x0", batch[0][:, 0].mean(), on_step=False, on_epoch=True)

    trainer = ember.Trainer(max_epochs=1, **TRAINER_KW)
    trainer.fit(Recorder(train_log=train_log), loader())
    assert trainer.callback_metrics["train/x0"] == pytest.approx(WEIGHTED_MEAN)
    assert not any(k.startswith("train/x0_") for k in trainer.callback_metrics)


def test_on_step_and_on_epoch_give_step_and_epoch_keys():
    def train_log(m, batch, batch_idx, loss):
        m.log("train/x0", batch[0][:, 0].mean(), on_step=True, on_epoch=True, prog_bar=True)

    trainer = ember.Trainer(max_epochs=1, **TRAINER_KW)
    trainer.fit(Recorder(train_log=train_log), loader())
    metrics = trainer.callback_metrics
    assert metrics["train/x0"] == metrics["train/x0_epoch"], "the plain name: the epoch value once it ended"
    assert metrics["train/x0_step"] == pytest.approx(BATCH_MEANS[-1])
    assert metrics["train/x0_epoch"] == pytest.approx(WEIGHTED_MEAN)
    bar = trainer.progress_bar_metrics
    assert bar["train/x0_step"] == pytest.approx(BATCH_MEANS[-1])
    assert bar["train/x0_epoch"] == pytest.approx(WEIGHTED_MEAN)


def test_on_step_and_on_epoch_in_validation():
    def val_log(m, batch, batch_idx, dl_idx):
        m.log("val/x0", batch[0][:, 0].mean(), on_step=True, on_epoch=True)

    (res,), trainer = validate(val_log)
    assert "val/x0" not in res
    assert res["val/x0_epoch"] == pytest.approx(WEIGHTED_MEAN)
    assert trainer.callback_metrics["val/x0_epoch"] == pytest.approx(WEIGHTED_MEAN)
    assert trainer.callback_metrics["val/x0"] == trainer.callback_metrics["val/x0_epoch"]


def test_val_logs_default_to_on_epoch_during_fit():
    def val_log(m, batch, batch_idx, dl_idx):
        m.log("val/x0", batch[0][:, 0].mean())

    trainer = ember.Trainer(max_epochs=1, num_sanity_val_steps=1, **TRAINER_KW)
    trainer.fit(Recorder(val_log=val_log), loader(), loader())
    # the sanity check's batch is discarded: the value is over the whole validation set
    assert trainer.callback_metrics["val/x0"] == pytest.approx(WEIGHTED_MEAN)


# --- torchmetrics objects ---------------------------------------------------------------------


class R2Module(Recorder):
    """Logs a torchmetrics R2Score of (column 1 of x, y): not decomposable into per-batch values."""

    def __init__(self) -> None:
        super().__init__()
        self.r2 = torchmetrics.R2Score()
        self.mean_metric = torchmetrics.MeanMetric()

    def validation_step(self, batch, batch_idx, dataloader_idx=0):
        x, y = batch
        self.r2.update(x[:, 1], y)
        self.log("val/r2", self.r2)
        self.mean_metric.update(x[:, 0])
        self.log("val/mean", self.mean_metric)


def hand_r2(preds: torch.Tensor, target: torch.Tensor) -> float:
    preds, target = preds.double(), target.double()
    ss_res = ((target - preds) ** 2).sum()
    ss_tot = ((target - target.mean()) ** 2).sum()
    return float(1 - ss_res / ss_tot)


def test_metric_object_is_computed_on_all_data_and_reset():
    x, y = make_xy()
    expected = hand_r2(x[:, 1], y)
    # the mean of per-batch R2 values is something else
    per_batch = [hand_r2(x[i : i + BATCH, 1], y[i : i + BATCH]) for i in range(0, N, BATCH)]
    weighted = sum(v * s for v, s in zip(per_batch, BATCH_SIZES, strict=True)) / N
    assert weighted != pytest.approx(expected, abs=1e-3)

    module = R2Module()
    trainer = ember.Trainer(**TRAINER_KW)
    (first,) = trainer.validate(module, loader())
    assert first["val/r2"] == pytest.approx(expected, abs=1e-5)
    assert first["val/mean"] == pytest.approx(WEIGHTED_MEAN)
    assert trainer.callback_metrics["val/r2"] == pytest.approx(expected, abs=1e-5)
    # a second epoch gives the same value: the metric was reset, not accumulated
    (second,) = trainer.validate(module, loader())
    assert second["val/r2"] == pytest.approx(expected, abs=1e-5)
    # and on other data, the value of that data alone
    x2, y2 = make_xy(7, offset=3.0)
    (third,) = trainer.validate(module, DataLoader(TensorDataset(x2, y2), batch_size=3))
    assert third["val/r2"] == pytest.approx(hand_r2(x2[:, 1], y2), abs=1e-5)
    assert third["val/mean"] == pytest.approx(float(x2[:, 0].mean()))


def test_metric_object_reset_between_fit_epochs():
    x, y = make_xy()
    expected = hand_r2(x[:, 1], y)
    trainer = ember.Trainer(max_epochs=3, num_sanity_val_steps=2, **TRAINER_KW)
    trainer.fit(R2Module(), loader(), loader())
    # sanity check + 3 validation epochs over the same data: still the value of one epoch
    assert trainer.callback_metrics["val/r2"] == pytest.approx(expected, abs=1e-5)
    assert trainer.callback_metrics["val/mean"] == pytest.approx(WEIGHTED_MEAN)


# --- multiple dataloaders ---------------------------------------------------------------------


def test_multiple_val_dataloaders_suffix_keys():
    seen: list[int] = []

    def val_log(m, batch, batch_idx, dl_idx):
        seen.append(dl_idx)
        m.log("val/x0", batch[0][:, 0].mean())
        m.log("val/both", batch[0][:, 0].mean(), on_step=True, on_epoch=True)

    # loader 1: column 0 is 100..106 in batches of 4, 3 -> mean 103
    results, trainer = validate(val_log, [loader(), loader(7, offset=100.0)])
    assert seen == [0, 0, 0, 1, 1]
    assert len(results) == 2
    assert results[0] == pytest.approx(
        {"val/x0/dataloader_idx_0": WEIGHTED_MEAN, "val/both_epoch/dataloader_idx_0": WEIGHTED_MEAN}
    )
    assert results[1] == pytest.approx({"val/x0/dataloader_idx_1": 103.0, "val/both_epoch/dataloader_idx_1": 103.0})
    metrics = trainer.callback_metrics
    assert metrics["val/x0/dataloader_idx_0"] == pytest.approx(WEIGHTED_MEAN)
    assert metrics["val/x0/dataloader_idx_1"] == pytest.approx(103.0)
    assert "val/x0" not in metrics


def test_single_dataloader_has_no_suffix_and_no_dataloader_idx():
    seen: list[tuple[int, ...]] = []

    class Strict(Recorder):
        def validation_step(self, batch, batch_idx, *rest):
            seen.append(rest)
            self.log("val/x0", batch[0][:, 0].mean())

    trainer = ember.Trainer(**TRAINER_KW)
    (res,) = trainer.validate(Strict(), loader())
    assert seen == [(), (), ()]
    assert list(res) == ["val/x0"]


# --- loggers and log_every_n_steps ------------------------------------------------------------


def read_csv(path) -> list[dict[str, str]]:
    with open(path, newline="") as f:
        return list(csv.DictReader(f))


def test_log_every_n_steps_controls_csv_rows(tmp_path):
    def train_log(m, batch, batch_idx, loss):
        # a value that identifies the step: 100 * epoch + batch_idx
        m.log("train/v", float(100 * m.current_epoch + batch_idx))
        m.log("train/e", batch[0][:, 0].mean(), on_step=False, on_epoch=True)

    data = loader(20, batch_size=4)  # 5 batches per epoch
    logger = CSVLogger(save_dir=tmp_path / "x")
    trainer = ember.Trainer(
        max_epochs=2,
        log_every_n_steps=2,
        logger=logger,
        enable_progress_bar=False,
        enable_model_summary=False,
        enable_checkpointing=False,
    )
    trainer.fit(Recorder(train_log=train_log), data)
    path = tmp_path / "x" / "metrics.csv"
    assert logger.metrics_path == path
    rows = read_csv(path)

    # Step rows after optimizer steps 2, 4, 6, 8, 10, at Lightning's steps (the steps before: 1, 3, ...), carrying
    # the value logged in the step that made it; epoch rows at the end of each epoch (its last step's row, 4 and 9).
    step_rows = [r for r in rows if r["train/v"] != ""]
    epoch_rows = [r for r in rows if r["train/e"] != ""]
    assert len(rows) == len(step_rows) + len(epoch_rows)
    assert [(int(r["step"]), int(r["epoch"]), float(r["train/v"])) for r in step_rows] == [
        (1, 0, 1.0),
        (3, 0, 3.0),
        (5, 1, 100.0),
        (7, 1, 102.0),
        (9, 1, 104.0),
    ]
    # column 0 is 0..19: its weighted mean over the epoch is 9.5
    assert [(int(r["step"]), int(r["epoch"]), float(r["train/e"])) for r in epoch_rows] == [
        (4, 0, 9.5),
        (9, 1, 9.5),
    ]
    assert trainer.logged_metrics["train/v"] == 104.0
    assert trainer.logged_metrics["train/e"] == pytest.approx(9.5)


@pytest.mark.parametrize(("every", "steps"), [(1, [1, 2, 3, 4, 5, 6]), (3, [3, 6]), (4, [4]), (7, [])])
def test_log_every_n_steps_row_steps(tmp_path, every, steps):
    def train_log(m, batch, batch_idx, loss):
        m.log("train/step_seen", float(m.global_step))  # global_step before this step

    logger = CSVLogger(save_dir=tmp_path / "x")
    trainer = ember.Trainer(
        max_epochs=2,
        log_every_n_steps=every,
        logger=logger,
        enable_progress_bar=False,
        enable_model_summary=False,
        enable_checkpointing=False,
    )
    trainer.fit(Recorder(train_log=train_log), loader())  # 3 batches per epoch
    if not steps:
        assert not logger.metrics_path.exists() or read_csv(logger.metrics_path) == []
        return
    rows = read_csv(logger.metrics_path)
    assert [int(r["step"]) for r in rows] == [s - 1 for s in steps]  # optimizer step s: row s - 1, as in Lightning
    assert [float(r["train/step_seen"]) for r in rows] == [s - 1 for s in steps]  # the row's step: global_step then


def test_val_metrics_go_to_the_logger(tmp_path):
    def val_log(m, batch, batch_idx, dl_idx):
        m.log("val/x0", batch[0][:, 0].mean())

    logger = CSVLogger(save_dir=tmp_path / "x")
    trainer = ember.Trainer(
        max_epochs=2,
        log_every_n_steps=100,
        logger=logger,
        enable_progress_bar=False,
        enable_model_summary=False,
        enable_checkpointing=False,
    )
    trainer.fit(Recorder(val_log=val_log), loader(), loader())
    rows = read_csv(logger.metrics_path)
    assert [(int(r["step"]), int(r["epoch"]), float(r["val/x0"])) for r in rows] == [
        (2, 0, WEIGHTED_MEAN),  # after optimizer step 3: its row
        (5, 1, WEIGHTED_MEAN),
    ]


# --- no host sync in the hot path -------------------------------------------------------------


class Batches:
    """An iterable of batches with a length (a list would be read as several dataloaders).

    Used instead of a DataLoader, whose iterator draws its base seed with Tensor.item().
    """

    def __init__(self, batches: list) -> None:
        self.batches = batches

    def __len__(self) -> int:
        return len(self.batches)

    def __iter__(self):
        return iter(self.batches)


def test_logging_does_not_call_item(monkeypatch):
    x, y = make_xy(12)
    batches = Batches([(x[i : i + 5], y[i : i + 5]) for i in range(0, 12, 5)])  # 5, 5, 2

    class Busy(Recorder):
        def __init__(self) -> None:
            super().__init__()
            self.metric = torchmetrics.MeanMetric()

        def training_step(self, batch, batch_idx):
            x, y = batch
            loss = F.mse_loss(self.model(x).squeeze(-1), y)
            self.log("train/loss", loss, on_step=True, on_epoch=True, prog_bar=True)
            self.log("train/x0", x[:, 0].mean(), on_step=True, on_epoch=True, reduce_fx="max")
            self.log("train/n", 3)
            return loss

        def validation_step(self, batch, batch_idx, dataloader_idx=0):
            x, y = batch
            self.log("val/loss", F.mse_loss(self.model(x).squeeze(-1), y), on_step=True, on_epoch=True)
            self.log("val/sum", x[:, 0].sum(), reduce_fx="sum")
            self.metric.update(x[:, 0])
            self.log("val/mean", self.metric)

    calls: list[int] = []

    def no_item(self, *args, **kwargs):
        calls.append(1)
        raise AssertionError("Tensor.item() called: a host sync in the logging hot path")

    trainer = ember.Trainer(max_epochs=2, num_sanity_val_steps=1, **TRAINER_KW)
    module = Busy()
    monkeypatch.setattr(torch.Tensor, "item", no_item)
    with pytest.raises(AssertionError, match="host sync"):  # the patch is in force
        torch.zeros(()).item()
    calls.clear()
    trainer.fit(module, batches, batches)
    monkeypatch.undo()
    assert calls == []
    assert trainer.global_step == 6
    assert trainer.callback_metrics["train/x0_epoch"] == pytest.approx(10.5)  # max of batch means
    assert trainer.callback_metrics["val/mean"] == pytest.approx(5.5)


class _HostCopies(torch.Tensor):
    """A tensor that counts the calls that copy it to the host (each one a sync on a GPU)."""

    copies = 0

    @classmethod
    def __torch_function__(cls, func, types, args=(), kwargs=None):  # type: ignore[no-untyped-def]
        if getattr(func, "__name__", "") in ("cpu", "tolist", "item", "numpy", "__float__"):
            cls.copies += 1
        return super().__torch_function__(func, types, args, kwargs or {})


def test_to_floats_copies_to_the_host_once_for_a_whole_dict() -> None:
    from ember.modules.logging import to_floats

    _HostCopies.copies = 0
    values = {f"m{i}": torch.tensor(float(i) / 4).as_subclass(_HostCopies) for i in range(5)}
    floats = to_floats({**values, "epoch": 3, "half": torch.tensor(0.5, dtype=torch.float16).as_subclass(_HostCopies)})
    assert _HostCopies.copies == 1
    assert floats == {"m0": 0.0, "m1": 0.25, "m2": 0.5, "m3": 0.75, "m4": 1.0, "epoch": 3.0, "half": 0.5}
    assert list(floats) == ["m0", "m1", "m2", "m3", "m4", "epoch", "half"]


def test_logged_metrics_hold_the_latest_values_meant_for_loggers_even_unsent(tmp_path):
    """As in Lightning: a value logged between two ``log_every_n_steps`` (or with ``logger=False`` on the trainer)
    is in ``trainer.logged_metrics``; one logged with ``self.log(..., logger=False)`` never is."""

    def train_log(m, batch, batch_idx, loss):
        m.log("train/seen", float(m.global_step))
        m.log("train/hidden", 1.0, logger=False)

    for logger in (False, CSVLogger(save_dir=tmp_path / "x")):
        trainer = ember.Trainer(
            max_epochs=1,
            log_every_n_steps=50,  # 3 steps: nothing is sent
            logger=logger,
            enable_progress_bar=False,
            enable_model_summary=False,
            enable_checkpointing=False,
        )
        trainer.fit(Recorder(train_log=train_log), loader())
        assert trainer.logged_metrics == {"train/seen": 2.0}, logger  # the last step's value (global_step 2 then)
        assert trainer.callback_metrics["train/hidden"] == 1.0
    assert not (tmp_path / "x" / "metrics.csv").exists() or read_csv(tmp_path / "x" / "metrics.csv") == []
