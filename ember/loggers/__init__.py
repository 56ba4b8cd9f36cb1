"""Loggers: where metrics go. Heavy back ends (tensorboard, wandb, mlflow) are imported when a run first writes."""

from ember.loggers.csv import CSVLogger
from ember.loggers.logger import Logger
from ember.loggers.mlflow import MLflowLogger
from ember.loggers.tensorboard import TensorBoardLogger
from ember.loggers.wandb import WandbLogger

__all__ = ["CSVLogger", "Logger", "MLflowLogger", "TensorBoardLogger", "WandbLogger"]
