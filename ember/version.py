"""ember's version: ``ember.__version__``, ``ember --version``, the build's version and the one checkpoints record."""

__version__ = "0.1.0"
