"""What the loops report: step and epoch metrics to the loggers, and the values callbacks read.

`Reporter` is the one path from a logged value to the loggers (``log_metrics`` at a step,
``log_epoch_metrics`` at an epoch end, ``finish_eval`` after validate/test) and keeps what
``trainer.callback_metrics``, ``logged_metrics`` and ``progress_bar_metrics`` show. Values stay tensors
until a logger writes them; the non-finite guard is checked where the loggers sync anyway.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import torch

from ember.modules.logging import MetricCollector, to_floats

if TYPE_CHECKING:
    from ember.trainer.trainer import Trainer


class Reporter:
    """The metrics of a trainer's runs: the collectors (train, eval), the epoch aggregates, what was logged."""

    def __init__(self, trainer: Trainer) -> None:
        self.trainer = trainer
        device = self.device
        self.train_collector = MetricCollector(reduce=trainer.strategy.reduce, device=device)
        self.eval_collector = MetricCollector(reduce=trainer.strategy.reduce, device=device)
        #: The collector ``self.log`` writes to now: the eval one while an evaluation runs.
        self.collector = self.train_collector
        self.epoch_metrics: dict[str, Any] = {}
        self.logged: dict[str, float] = {}
        #: Every epoch metric of the most recent validation/test run, as floats.
        self.last_eval_metrics: dict[str, float] = {}
        #: The names the most recent sanity check logged (``callbacks.monitored`` checks monitors against them).
        self.sanity_names: frozenset[str] = frozenset()

    def device(self) -> torch.device:
        """The module's device, where the collectors keep their running totals."""
        return self.trainer.strategy.root_device

    def use(self, collector: MetricCollector) -> None:
        """Make `collector` the one ``self.log`` writes to (an evaluation's while it runs)."""
        self.collector = collector

    def step_metrics(self) -> dict[str, Any]:
        """The latest step values: what the module logged plus the precision plugin's (skipped steps)."""
        return {**self.train_collector.step_values, **self.trainer.strategy.precision.step_metrics()}

    def callback_metrics(self) -> dict[str, float]:
        """Epoch aggregates and the latest step values; a name logged with both ``on_step`` and ``on_epoch`` is
        also there under its plain name, as in Lightning: its epoch value once an epoch (or an evaluation) ended,
        its step value before that."""
        values = {**self.epoch_metrics, **self.step_metrics()}
        for collector in (self.train_collector, self.eval_collector):
            for plain, (step_name, epoch_name) in collector.forked.items():
                if epoch_name in values:
                    values[plain] = values[epoch_name]
                elif step_name in values and collector is self.train_collector:
                    values[plain] = values[step_name]
        return to_floats(values)

    def start_run(self) -> None:
        """A new fit/validate/test/predict: ``callback_metrics`` and ``logged_metrics`` show only its values
        (as in Lightning, where ``trainer.test()`` after fit shows the test metrics alone)."""
        self.epoch_metrics, self.logged, self.last_eval_metrics = {}, {}, {}
        self.sanity_names = frozenset()
        self.train_collector.start_epoch("train")
        self.eval_collector.start_epoch("validation")

    def progress_bar_metrics(self) -> dict[str, float]:
        names = self.train_collector.prog_bar_names | self.eval_collector.prog_bar_names
        merged = {**self.epoch_metrics, **self.train_collector.step_values}
        return to_floats({k: v for k, v in merged.items() if k in names})

    def logger_step(self) -> int:
        """The step the loggers get, Lightning's axis (``FitState.batches_that_stepped``: optimizer steps under
        automatic optimization, batches under manual optimization, however many ``step()`` calls each made):
        inside fit, those taken *before* the batch that logged (the first batch's row is step 0, an epoch end's is
        its last batch's); outside fit (validate, test after fit), those taken."""
        steps = self.trainer.progress.batches_that_stepped
        return max(steps - 1, 0) if self.trainer.stage == "fit" else steps

    def logged_metrics(self) -> dict[str, float]:
        """What ``trainer.logged_metrics`` shows, as in Lightning: the values sent to the loggers, updated with the
        latest values meant for them that were not sent yet (a step between two ``log_every_n_steps``, a run with
        ``logger=False``)."""
        hidden = self.train_collector.not_for_loggers | self.eval_collector.not_for_loggers
        latest = {k: v for k, v in {**self.epoch_metrics, **self.step_metrics()}.items() if k not in hidden}
        return {**self.logged, **to_floats(latest)}

    def log_metrics(self, metrics: dict[str, Any]) -> None:
        """Send `metrics` to every logger at `logger_step` (process 0 only)."""
        trainer = self.trainer
        trainer.finite_guard.check()  # the loggers are about to sync anyway
        if not metrics or not trainer.loggers or not trainer.is_global_zero:
            return
        if self.train_collector.not_for_loggers or self.eval_collector.not_for_loggers:  # logged with logger=False
            hidden = self.train_collector.not_for_loggers | self.eval_collector.not_for_loggers
            metrics = {k: v for k, v in metrics.items() if k not in hidden}
            if not metrics:
                return
        floats = to_floats(metrics)
        self.logged.update(floats)
        floats["epoch"] = trainer.progress.epoch
        trainer.run_state.logger_guard.log_metrics(floats, self.logger_step())  # never waits

    def log_epoch_metrics(self, metrics: dict[str, Any]) -> None:
        """Keep `metrics` as the latest epoch aggregates, log them, and let the loggers save."""
        self.epoch_metrics.update(metrics)
        self.log_metrics(metrics)
        self.trainer.run_state.logger_guard.save()

    def finish_eval(self, metrics: dict[str, Any], num_loaders: int) -> list[dict[str, float]]:
        """Store an evaluation's epoch metrics; split them per dataloader (none for the sanity check): with several
        dataloaders, a name ending in ``/dataloader_idx_N`` goes to dataloader N's dict, and a plain name (logged in
        ``on_validation_epoch_end``, say) to every dict, as in Lightning."""
        if self.trainer.sanity_checking:
            self.sanity_names = frozenset(metrics)
            return []
        self.log_epoch_metrics(metrics)
        floats = self.last_eval_metrics = to_floats(metrics)
        if num_loaders == 1:
            return [floats]
        return [
            {k: v for k, v in floats.items() if k.endswith(f"/dataloader_idx_{i}") or "/dataloader_idx_" not in k}
            for i in range(num_loaders)
        ]
