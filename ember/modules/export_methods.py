"""`ExportMethod`: how `TrainingModule.to_onnx` and its siblings reach ``ember.export`` without importing it early."""

from __future__ import annotations

import functools
from typing import Any


class ExportMethod:
    """A `TrainingModule` method that is ``ember.export.<function>`` with the module as its first argument.

    ``module.to_onnx(path, ...)`` is ``ember.export.export_onnx(module, path, ...)``: the signature and the
    docstring are the export function's (``help(module.to_onnx)`` shows them), and ``ember.export`` is
    imported only when an export is called.
    """

    def __init__(self, function: str) -> None:
        self.function = function
        self.__doc__ = f"``ember.export.{function}`` with this module as its first argument."

    def __get__(self, module: Any, owner: type | None = None) -> Any:
        if module is None:
            return self
        import ember.export

        function = getattr(ember.export, self.function)
        bound = functools.partial(function, module)
        functools.update_wrapper(bound, function)
        return bound
