"""`UsageError`: a mistake in what the user asked for, which the ``ember`` command prints as one line (exit 2).

A leaf module (it imports nothing of ember), so any package may raise it: `ember.config.ConfigError` is one,
and so is a callback's misspelt ``monitor`` found after the sanity check (`ember.callbacks.monitored`).
"""


class UsageError(Exception):
    """A mistake in what the user asked for, found before it spoils any work; ``str()`` is one line."""
