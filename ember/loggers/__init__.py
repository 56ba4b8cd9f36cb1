"""Loggers: where metrics go. Heavy back ends are imported inside their modules."""

from ember.loggers.csv import CSVLogger
from ember.loggers.logger import Logger

__all__ = ["CSVLogger", "Logger"]
