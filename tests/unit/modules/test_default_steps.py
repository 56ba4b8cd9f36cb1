"""The default steps of `TrainingModule` (model + loss_fn + metrics) and `save_hyperparameters`."""

from __future__ import annotations

import pytest
import torch
import torchmetrics
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

import ember

TRAINER_KW = dict(logger=False, enable_progress_bar=False, enable_model_summary=False, enable_checkpointing=False)

N_FEATURES, N_CLASSES = 5, 3
BATCH = 16


def make_data(n: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Learnable 3-class data: the label is the argmax of a fixed linear map plus noise."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, N_FEATURES, generator=g)
    w = torch.randn(N_FEATURES, N_CLASSES, generator=torch.Generator().manual_seed(1234))
    y = (x @ w + 0.3 * torch.randn(n, N_CLASSES, generator=g)).argmax(dim=1)
    return x, y


def loader(x: torch.Tensor, y: torch.Tensor, batch_size: int = BATCH) -> DataLoader:
    return DataLoader(TensorDataset(x, y), batch_size=batch_size, shuffle=False)


class Classifier(ember.TrainingModule):
    """Declares only model, loss_fn, metrics and configure_optimizers: every step is the default."""

    def __init__(self) -> None:
        super().__init__()
        self.model = nn.Sequential(nn.Linear(N_FEATURES, 16), nn.Tanh(), nn.Linear(16, N_CLASSES))
        self.loss_fn = nn.CrossEntropyLoss()
        self.metrics = {"acc": torchmetrics.Accuracy(task="multiclass", num_classes=N_CLASSES)}

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.5)


@torch.no_grad()
def hand_loss_and_acc(model: nn.Module, x: torch.Tensor, y: torch.Tensor, batch_size: int) -> tuple[float, float]:
    """Batch-size weighted mean of the per-batch CrossEntropy means, and accuracy over all samples."""
    total, count, correct = 0.0, 0, 0
    for start in range(0, len(x), batch_size):
        xb, yb = x[start : start + batch_size], y[start : start + batch_size]
        logits = model(xb)
        total += nn.functional.cross_entropy(logits, yb).double().item() * len(xb)
        count += len(xb)
        correct += int((logits.argmax(dim=1) == yb).sum())
    assert count == len(x)
    return total / count, correct / count


@pytest.fixture(scope="module")
def data():
    torch.manual_seed(0)
    train = make_data(96, seed=1)
    val = make_data(50, seed=2)  # batches of 16, 16, 16 and 2: an uneven last batch
    test = make_data(37, seed=3)  # 16, 16, 5
    return train, val, test


@pytest.fixture(scope="module")
def fitted(data):
    (xt, yt), (xv, yv), _ = data
    torch.manual_seed(0)
    module = Classifier()
    before = [p.detach().clone() for p in module.parameters()]
    loss_before, _ = hand_loss_and_acc(module.model, xv, yv, BATCH)
    losses = LossRecorder()
    trainer = ember.Trainer(max_epochs=4, callbacks=[losses], **TRAINER_KW)
    trainer.fit(module, loader(xt, yt), loader(xv, yv))
    trainer.step_losses = losses.losses  # for the tests below
    # as the fit left them: a later validate/test/predict on this trainer shows its own (as in Lightning)
    trainer.fit_metrics, trainer.fit_bar = dict(trainer.callback_metrics), dict(trainer.progress_bar_metrics)
    return module, trainer, before, loss_before


class LossRecorder(ember.Callback):
    def __init__(self) -> None:
        self.losses: list[float] = []

    def on_train_batch_end(self, trainer, module, outputs, batch, batch_idx) -> None:
        self.losses.append(float(outputs["loss"]))


def test_default_steps_train(fitted, data):
    module, trainer, before, loss_before = fitted
    _, (xv, yv), _ = data
    assert trainer.global_step == 4 * 6  # 96 / 16 batches per epoch
    assert trainer.current_epoch == 4
    after = list(module.parameters())
    assert any(not torch.equal(b, a) for b, a in zip(before, after, strict=True))
    # training actually learned something
    loss_after, acc_after = hand_loss_and_acc(module.model, xv, yv, BATCH)
    assert loss_after < loss_before
    assert acc_after > 0.6
    # the default training_step logs train/loss on step: the value of the last batch
    assert len(trainer.step_losses) == 24
    assert isinstance(trainer.fit_metrics["train/loss"], float)
    assert trainer.fit_metrics["train/loss"] == pytest.approx(trainer.step_losses[-1], abs=1e-7)
    assert trainer.step_losses[-1] < trainer.step_losses[0]
    assert "train/loss" in trainer.fit_bar
    # validation during fit reported val/loss and val/acc of the final epoch
    assert trainer.fit_metrics["val/loss"] == pytest.approx(loss_after, abs=1e-5)
    assert trainer.fit_metrics["val/acc"] == pytest.approx(acc_after, abs=1e-6)


def test_default_validation_matches_hand_computation(fitted, data):
    module, trainer, _, _ = fitted
    _, (xv, yv), _ = data
    expected_loss, expected_acc = hand_loss_and_acc(module.model, xv, yv, BATCH)
    # the weighting matters: the plain mean of batch means differs from the weighted one here
    with torch.no_grad():
        batch_means = [
            float(nn.functional.cross_entropy(module.model(xv[i : i + BATCH]), yv[i : i + BATCH]))
            for i in range(0, len(xv), BATCH)
        ]
    assert sum(batch_means) / len(batch_means) != pytest.approx(expected_loss, abs=1e-4)

    result = trainer.validate(module, loader(xv, yv))
    assert isinstance(result, list) and len(result) == 1
    assert set(result[0]) == {"val/loss", "val/acc"}
    assert all(isinstance(v, float) for v in result[0].values())
    assert result[0]["val/loss"] == pytest.approx(expected_loss, abs=1e-5)
    assert result[0]["val/acc"] == pytest.approx(expected_acc, abs=1e-6)
    assert trainer.callback_metrics["val/loss"] == pytest.approx(expected_loss, abs=1e-5)
    assert trainer.callback_metrics["val/acc"] == pytest.approx(expected_acc, abs=1e-6)

    # a second validate gives the same numbers: the metric was reset, not accumulated
    again = trainer.validate(module, loader(xv, yv))
    assert again[0]["val/loss"] == pytest.approx(expected_loss, abs=1e-5)
    assert again[0]["val/acc"] == pytest.approx(expected_acc, abs=1e-6)


def test_default_test_step_matches_hand_computation(fitted, data):
    module, trainer, _, _ = fitted
    _, (xv, yv), (xs, ys) = data
    expected_loss, expected_acc = hand_loss_and_acc(module.model, xs, ys, BATCH)
    # run a validation first so a leak of metric state from val into test would show
    trainer.validate(module, loader(xv, yv))
    result = trainer.test(module, loader(xs, ys))
    assert isinstance(result, list) and len(result) == 1
    assert set(result[0]) == {"test/loss", "test/acc"}
    assert result[0]["test/loss"] == pytest.approx(expected_loss, abs=1e-5)
    assert result[0]["test/acc"] == pytest.approx(expected_acc, abs=1e-6)
    assert trainer.callback_metrics["test/loss"] == pytest.approx(expected_loss, abs=1e-5)
    assert trainer.callback_metrics["test/acc"] == pytest.approx(expected_acc, abs=1e-6)


def test_default_steps_with_a_fresh_trainer_and_module():
    """validate/test work without fit (a fresh trainer, an untrained module)."""
    torch.manual_seed(3)
    module = Classifier()
    x, y = make_data(21, seed=9)  # 8, 8, 5
    expected_loss, expected_acc = hand_loss_and_acc(module.model, x, y, 8)
    trainer = ember.Trainer(**TRAINER_KW)
    (val,) = trainer.validate(module, loader(x, y, 8))
    (test,) = trainer.test(module, loader(x, y, 8))
    assert val == pytest.approx({"val/loss": expected_loss, "val/acc": expected_acc}, abs=1e-5)
    assert test == pytest.approx({"test/loss": expected_loss, "test/acc": expected_acc}, abs=1e-5)


def test_default_metrics_per_val_dataloader():
    """With two val dataloaders each loader gets its own loss and metric value."""
    torch.manual_seed(4)
    module = Classifier()
    (xa, ya), (xb, yb) = make_data(21, seed=10), make_data(13, seed=11)
    loss_a, acc_a = hand_loss_and_acc(module.model, xa, ya, 8)
    loss_b, acc_b = hand_loss_and_acc(module.model, xb, yb, 8)
    trainer = ember.Trainer(**TRAINER_KW)
    res_a, res_b = trainer.validate(module, [loader(xa, ya, 8), loader(xb, yb, 8)])
    assert res_a == pytest.approx({"val/loss/dataloader_idx_0": loss_a, "val/acc/dataloader_idx_0": acc_a}, abs=1e-5)
    assert res_b == pytest.approx({"val/loss/dataloader_idx_1": loss_b, "val/acc/dataloader_idx_1": acc_b}, abs=1e-5)


def test_default_predict_returns_forward_per_batch(fitted, data):
    module, trainer, _, _ = fitted
    _, _, (xs, ys) = data
    out = trainer.predict(module, loader(xs, ys))
    assert isinstance(out, list) and len(out) == 3
    with torch.no_grad():
        for i, pred in enumerate(out):
            xb = xs[i * BATCH : (i + 1) * BATCH]
            assert isinstance(pred, torch.Tensor)
            assert pred.shape == (len(xb), N_CLASSES)
            torch.testing.assert_close(pred, module.model(xb))
            torch.testing.assert_close(pred, module(xb))
    # a batch that is a bare tensor is passed to forward as it is
    bare = trainer.predict(module, DataLoader(xs, batch_size=BATCH))
    assert len(bare) == 3
    for a, b in zip(out, bare, strict=True):
        torch.testing.assert_close(a, b)


class _Triples(torch.utils.data.Dataset):
    def __init__(self, n: int) -> None:
        self.x, self.y = make_data(n, seed=5)

    def __len__(self) -> int:
        return len(self.x)

    def __getitem__(self, i: int):
        return self.x[i], self.y[i], torch.tensor(1.0)


class _Dicts(_Triples):
    def __getitem__(self, i: int):
        return {"x": self.x[i], "y": self.y[i]}


@pytest.mark.parametrize("dataset", [_Triples(8), _Dicts(8)], ids=["triple", "dict"])
def test_default_step_rejects_other_batches(dataset):
    trainer = ember.Trainer(max_epochs=1, **TRAINER_KW)
    with pytest.raises(TypeError, match=r"default training_step expects \(inputs, target\)"):
        trainer.fit(Classifier(), DataLoader(dataset, batch_size=4))
    with pytest.raises(TypeError, match=r"default validation_step expects \(inputs, target\)"):
        trainer.validate(Classifier(), DataLoader(dataset, batch_size=4))
    with pytest.raises(TypeError, match=r"default test_step expects \(inputs, target\)"):
        trainer.test(Classifier(), DataLoader(dataset, batch_size=4))


def test_default_step_type_error_describes_the_batch():
    trainer = ember.Trainer(max_epochs=1, **TRAINER_KW)
    with pytest.raises(TypeError, match="of length 3") as info:
        trainer.fit(Classifier(), DataLoader(_Triples(8), batch_size=4))
    assert "Override training_step()" in str(info.value)


class NoModel(ember.TrainingModule):
    """Neither model/loss_fn nor training_step."""

    def __init__(self) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.zeros(N_FEATURES, N_CLASSES))

    def forward(self, x):
        return x @ self.weight

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.1)


class ModelNoLoss(ember.TrainingModule):
    def __init__(self) -> None:
        super().__init__()
        self.model = nn.Linear(N_FEATURES, N_CLASSES)

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.1)


class LossNoModel(NoModel):
    def __init__(self) -> None:
        super().__init__()
        self.loss_fn = nn.CrossEntropyLoss()


@pytest.mark.parametrize("cls", [NoModel, ModelNoLoss, LossNoModel])
def test_missing_model_or_loss_fn_without_steps(cls):
    x, y = make_data(8, seed=6)
    trainer = ember.Trainer(max_epochs=1, **TRAINER_KW)
    with pytest.raises(NotImplementedError, match="does not define training_step"):
        trainer.fit(cls(), loader(x, y, 4))
    with pytest.raises(NotImplementedError, match="does not define validation_step"):
        trainer.validate(cls(), loader(x, y, 4))
    with pytest.raises(NotImplementedError, match="does not define test_step"):
        trainer.test(cls(), loader(x, y, 4))


def test_forward_without_model_is_not_implemented():
    class Bare(ember.TrainingModule):
        pass

    with pytest.raises(NotImplementedError, match="no forward"):
        Bare()(torch.zeros(1, 2))


def test_loss_fn_may_be_a_plain_function():
    class FnLoss(Classifier):
        def __init__(self) -> None:
            super().__init__()
            del self.loss_fn
            self.loss_fn = nn.functional.cross_entropy

    torch.manual_seed(5)
    module = FnLoss()
    x, y = make_data(20, seed=7)
    expected_loss, expected_acc = hand_loss_and_acc(module.model, x, y, 8)
    (res,) = ember.Trainer(**TRAINER_KW).validate(module, loader(x, y, 8))
    assert res == pytest.approx({"val/loss": expected_loss, "val/acc": expected_acc}, abs=1e-5)


def test_metrics_dict_becomes_module_dict():
    module = Classifier()
    assert isinstance(module.metrics, nn.ModuleDict)
    assert isinstance(module.metrics["acc"], torchmetrics.Metric)


# --- save_hyperparameters ---------------------------------------------------------------


class HParams(ember.TrainingModule):
    def __init__(self, lr: float = 0.1, hidden: int = 8, backbone: nn.Module | None = None, **kwargs) -> None:
        super().__init__()
        self.save_hyperparameters(ignore=["backbone"])
        self.model = backbone


class HParamsAll(ember.TrainingModule):
    def __init__(self, lr: float = 0.1, hidden: int = 8, name: str = "m") -> None:
        super().__init__()
        self.save_hyperparameters()


class HParamsSubset(ember.TrainingModule):
    def __init__(self, lr: float = 0.1, hidden: int = 8, name: str = "m") -> None:
        super().__init__()
        self.save_hyperparameters("lr", "name")


def test_save_hyperparameters_records_all_init_args():
    m = HParamsAll(lr=0.01, name="x")
    assert dict(m.hparams) == {"lr": 0.01, "hidden": 8, "name": "x"}  # defaults recorded too
    assert m.hparams.lr == 0.01
    assert m.hparams.hidden == 8
    assert m.hparams["name"] == "x"


def test_save_hyperparameters_positional_args():
    m = HParamsAll(0.5, 3, "pos")
    assert dict(m.hparams) == {"lr": 0.5, "hidden": 3, "name": "pos"}


def test_save_hyperparameters_ignore_and_kwargs():
    backbone = nn.Linear(2, 2)
    m = HParams(lr=0.02, backbone=backbone, extra=3)
    assert dict(m.hparams) == {"lr": 0.02, "hidden": 8, "extra": 3}
    assert "backbone" not in m.hparams
    assert m.hparams.extra == 3
    assert m.model is backbone


def test_save_hyperparameters_named_subset():
    m = HParamsSubset(lr=0.3, hidden=99, name="sub")
    assert dict(m.hparams) == {"lr": 0.3, "name": "sub"}
    with pytest.raises(AttributeError, match="hidden"):
        _ = m.hparams.hidden


def test_hparams_missing_attribute_is_attribute_error():
    m = HParamsAll()
    with pytest.raises(AttributeError, match="no hyperparameter 'nope'"):
        _ = m.hparams.nope
    assert not hasattr(m.hparams, "nope")


def test_hparams_empty_without_save():
    assert dict(Classifier().hparams) == {}


def test_save_hyperparameters_unknown_name():
    class Bad(ember.TrainingModule):
        def __init__(self, lr: float = 0.1) -> None:
            super().__init__()
            self.save_hyperparameters("lr", "missing")

    with pytest.raises(ValueError, match="missing"):
        Bad()

    class BadIgnore(ember.TrainingModule):
        def __init__(self, lr: float = 0.1) -> None:
            super().__init__()
            self.save_hyperparameters(ignore=["typo"])

    with pytest.raises(ValueError, match="typo"):
        BadIgnore()


def test_save_hyperparameters_rejects_star_args():
    class Star(ember.TrainingModule):
        def __init__(self, *args) -> None:
            super().__init__()
            self.save_hyperparameters()

    with pytest.raises(ValueError, match=r"\*args"):
        Star(1, 2)
