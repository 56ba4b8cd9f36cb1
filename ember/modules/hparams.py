"""Hyperparameter capture for `TrainingModule.save_hyperparameters`."""

from __future__ import annotations

import inspect
from types import FrameType
from typing import Any


class AttributeDict(dict[str, Any]):
    """A dict whose keys can also be read as attributes: ``hparams.lr``."""

    def __getattr__(self, name: str) -> Any:
        try:
            return self[name]
        except KeyError:
            raise AttributeError(f"no hyperparameter {name!r}; recorded: {sorted(self)}") from None

    def __setattr__(self, name: str, value: Any) -> None:
        self[name] = value


def collect_init_args(frame: FrameType) -> dict[str, Any]:
    """The named arguments (and ``**kwargs``) of the function running in `frame`, minus ``self``."""
    info = inspect.getargvalues(frame)
    args = {name: info.locals[name] for name in info.args if name != "self"}
    if info.varargs and info.locals.get(info.varargs):
        raise ValueError("save_hyperparameters() cannot record *args; give them names")
    if info.keywords:
        args.update(info.locals.get(info.keywords, {}))
    return args
