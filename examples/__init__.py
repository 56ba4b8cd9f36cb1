"""Runnable ember examples (importable so configs can name them with ``_target_``)."""
