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


def init_args_to_record(
    owner: object, frame: FrameType | None, names: tuple[str, ...], ignore: list[str] | tuple[str, ...]
) -> dict[str, Any]:
    """What ``save_hyperparameters(*names, ignore=...)`` records: the arguments of the ``__init__`` running in
    `frame` (all, or `names`), less `ignore`; a name that is no argument is an error that lists them."""
    if frame is None:
        raise RuntimeError("save_hyperparameters() must be called from __init__")
    args = collect_init_args(frame)
    unknown = [n for n in (*names, *ignore) if n not in args]
    if unknown:
        raise ValueError(
            f"save_hyperparameters: {unknown} are not arguments of {type(owner).__qualname__}.__init__; "
            f"its arguments are {sorted(args)}"
        )
    return {k: args[k] for k in (names or tuple(args)) if k not in ignore}
