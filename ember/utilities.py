"""Lightning's utility names, for ports: what ``lightning.pytorch.utilities`` gives a LightningModule.

A port replaces ``from lightning.pytorch.utilities import rank_zero_only, rank_zero_info`` with
``from ember.utilities import ...`` and nothing else changes:

- `rank_zero_only`: a decorator that runs the function on global rank 0 only (elsewhere it returns
  ``default``). The rank is ``rank_zero_only.rank`` when set, else read from the environment at each
  call, in Lightning's order: ``RANK``, ``LOCAL_RANK``, ``SLURM_PROCID``, ``JSM_NAMESPACE_RANK``, else 0.
  (Lightning reads the environment once, at import, and its strategies set the attribute; ember's
  launcher and torchrun set ``RANK`` in every process, so reading it when called gives the same rank.)
- `rank_zero_warn`, `rank_zero_deprecation`: ``warnings.warn`` on rank 0 only, once per call.
- `rank_zero_info`, `rank_zero_debug`: log to the ``ember.utilities`` logger on rank 0 only. When
  logging is not configured, an info message is printed to stderr, as Lightning's default handler does.
- `cli_lightning_logo`: does nothing and prints nothing (Lightning prints its logo).
"""

from __future__ import annotations

import functools
import logging
import os
import sys
import warnings
from collections.abc import Callable
from typing import Any, ParamSpec, TypeVar, overload

__all__ = [
    "cli_lightning_logo",
    "rank_zero_debug",
    "rank_zero_deprecation",
    "rank_zero_info",
    "rank_zero_only",
    "rank_zero_warn",
]

P = ParamSpec("P")
T = TypeVar("T")

#: Environment variables that hold the global rank, in the order Lightning reads them.
RANK_VARIABLES = ("RANK", "LOCAL_RANK", "SLURM_PROCID", "JSM_NAMESPACE_RANK")

_log = logging.getLogger(__name__)


def rank_from_environment() -> int:
    """This process's global rank from the first of `RANK_VARIABLES` that is set; 0 when none is."""
    for name in RANK_VARIABLES:
        value = os.environ.get(name)
        if value is not None:
            return int(value)
    return 0


class _RankZeroOnly:
    """The `rank_zero_only` decorator: a callable with a settable ``rank``."""

    def __init__(self) -> None:
        #: The global rank to use; None (the default) reads it from the environment at each call.
        self.rank: int | None = None

    def current_rank(self) -> int:
        """``rank`` when set, else `rank_from_environment`."""
        return self.rank if self.rank is not None else rank_from_environment()

    @overload
    def __call__(self, fn: Callable[P, T]) -> Callable[P, T | None]: ...

    @overload
    def __call__(self, fn: Callable[P, T], default: T) -> Callable[P, T]: ...

    def __call__(self, fn: Callable[P, T], default: T | None = None) -> Callable[P, T | None]:
        """Wrap `fn` so that it runs on global rank 0 only; other ranks get `default`."""

        @functools.wraps(fn)
        def wrapped_fn(*args: P.args, **kwargs: P.kwargs) -> T | None:
            if self.current_rank() == 0:
                return fn(*args, **kwargs)
            return default

        return wrapped_fn


#: Decorator: ``@rank_zero_only`` runs the function on global rank 0 only and returns None elsewhere;
#: ``rank_zero_only(fn, default)`` returns `default` elsewhere. Set ``rank_zero_only.rank`` to fix the rank.
rank_zero_only = _RankZeroOnly()


def _debug(*args: Any, stacklevel: int = 2, **kwargs: Any) -> None:
    _log.debug(*args, stacklevel=stacklevel, **kwargs)


def _info(*args: Any, stacklevel: int = 2, **kwargs: Any) -> None:
    if _log.hasHandlers():
        _log.info(*args, stacklevel=stacklevel, **kwargs)
    elif args:  # logging is not configured: print it, as Lightning's stderr handler would
        message, *rest = args
        print(str(message) % tuple(rest) if rest else message, file=sys.stderr)


def _warn(message: str | Warning, stacklevel: int = 2, **kwargs: Any) -> None:
    warnings.warn(message, stacklevel=stacklevel, **kwargs)


@rank_zero_only
def rank_zero_debug(*args: Any, stacklevel: int = 4, **kwargs: Any) -> None:
    """Log a debug message (``logging.debug`` arguments) on global rank 0 only."""
    _debug(*args, stacklevel=stacklevel, **kwargs)


@rank_zero_only
def rank_zero_info(*args: Any, stacklevel: int = 4, **kwargs: Any) -> None:
    """Log an info message (``logging.info`` arguments) on global rank 0 only; printed to stderr when logging
    is not configured."""
    _info(*args, stacklevel=stacklevel, **kwargs)


@rank_zero_only
def rank_zero_warn(message: str | Warning, stacklevel: int = 4, **kwargs: Any) -> None:
    """``warnings.warn(message, **kwargs)`` on global rank 0 only; `stacklevel` 4 names the caller's line."""
    _warn(message, stacklevel=stacklevel, **kwargs)


def rank_zero_deprecation(message: str | Warning, stacklevel: int = 5, **kwargs: Any) -> None:
    """A `rank_zero_warn` whose category defaults to ``DeprecationWarning``."""
    category = kwargs.pop("category", DeprecationWarning)
    rank_zero_warn(message, stacklevel=stacklevel, category=category, **kwargs)


def cli_lightning_logo() -> None:
    """Does nothing: a script ported from Lightning may call it; ember prints no logo."""
