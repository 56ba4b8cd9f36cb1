"""`ConfigError`: a config or command-line mistake, raised by loading, checking and building a config."""

from ember.errors import UsageError


class ConfigError(UsageError):
    """A config or command-line mistake found before any work starts; ``str()`` is one line."""
