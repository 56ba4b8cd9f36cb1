"""`ModelSummary`: a table of the module's top-level children, printed when fit starts.

Each row has the child's type, its parameter and trainable parameter counts
and, when the module sets ``example_input_array``, its output shape. Totals
and the parameters' size in MB follow. In a terminal the table is drawn with
rich; elsewhere (CI, SLURM logs) it is plain text.
"""

from __future__ import annotations

import contextlib
import sys
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, TextIO

import torch
from torch import Tensor, nn

from ember.callbacks.callback import Callback

if TYPE_CHECKING:
    from rich.console import Console, RenderableType

    from ember.modules.module import TrainingModule
    from ember.trainer.trainer import Trainer


ForwardContext = contextlib.AbstractContextManager[Any]


def count_parameters(module: nn.Module) -> tuple[int, int]:
    """(all parameters, trainable parameters)."""
    total = trainable = 0
    for p in module.parameters():
        total += p.numel()
        trainable += p.numel() if p.requires_grad else 0
    return total, trainable


@dataclass
class Row:
    """One top-level child: name, type, parameter counts and output shape ("-" when not run)."""

    name: str
    type: str
    params: int
    trainable: int
    output_shape: str = "-"


@dataclass
class Summary:
    """Rows per child plus totals of the whole module."""

    rows: list[Row]
    module_type: str
    total: int
    trainable: int
    size_mb: float
    has_shapes: bool

    @property
    def non_trainable(self) -> int:
        """Parameters with ``requires_grad=False``."""
        return self.total - self.trainable


def describe(module: nn.Module, example_input: Any = None, forward_context: ForwardContext | None = None) -> Summary:
    """Measure `module`: counts per top-level child, totals, size, and output shapes when `example_input` is given.

    The example forward runs in eval mode under ``torch.no_grad`` with the
    random streams forked, so it changes neither the module nor the
    training's randomness. ``forward_context`` (e.g. autocast) wraps it.
    """
    shapes = output_shapes(module, example_input, forward_context) if example_input is not None else {}
    rows = []
    for name, child in module.named_children():
        total, trainable = count_parameters(child)
        rows.append(Row(name, type(child).__name__, total, trainable, shapes.get(name, "-")))
    total, trainable = count_parameters(module)
    size = sum(p.numel() * p.element_size() for p in module.parameters())
    return Summary(rows, type(module).__name__, total, trainable, size / 1e6, example_input is not None)


def output_shapes(
    module: nn.Module, example_input: Any, forward_context: ForwardContext | None = None
) -> dict[str, str]:
    """Output shape of each top-level child when `module` runs on `example_input` (children not called: absent)."""
    from ember.strategies.strategy import move_to_device

    shapes: dict[str, str] = {}

    def record(name: str) -> Callable[[nn.Module, Any, Any], None]:
        def hook(_: nn.Module, __: Any, output: Any) -> None:
            shapes[name] = format_shape(output)

        return hook

    handles = [child.register_forward_hook(record(name)) for name, child in module.named_children()]
    param = next(module.parameters(), None)
    device = param.device if param is not None else torch.device("cpu")
    inputs = move_to_device(example_input, device)
    modes = [(m, m.training) for m in module.modules()]
    devices = [device.index or 0] if device.type == "cuda" else []
    try:
        with torch.random.fork_rng(devices=devices), torch.no_grad(), forward_context or contextlib.nullcontext():
            module.eval()
            if isinstance(inputs, (tuple, list)):
                module(*inputs)
            elif isinstance(inputs, dict):
                module(**inputs)
            else:
                module(inputs)
    finally:
        for handle in handles:
            handle.remove()
        for m, training in modes:
            m.training = training
    return shapes


def format_shape(value: Any) -> str:
    """``[8, 10]`` for a tensor; nested lists for tuples/lists/dicts of tensors; ``?`` for anything else."""
    return repr(_shape(value)).replace("'", "")


def _shape(value: Any) -> Any:
    if isinstance(value, Tensor):
        return list(value.shape)
    if isinstance(value, (tuple, list)):
        return [_shape(v) for v in value]
    if isinstance(value, dict):
        return {k: _shape(v) for k, v in value.items()}
    return "?"


def summarize(module: nn.Module, example_input: Any = None) -> str:
    """A plain-text table: one row per top-level child, then totals and size.

    `example_input` defaults to ``module.example_input_array``; when there is
    one, an ``output shape`` column is added.
    """
    if example_input is None:
        example_input = getattr(module, "example_input_array", None)
    return format_plain(describe(module, example_input))


def format_plain(summary: Summary) -> str:
    """`Summary` as aligned plain text (name and type left, numbers right)."""
    head = ["name", "type", "params", "trainable"] + (["output shape"] if summary.has_shapes else [])
    rows = [head]
    for r in summary.rows:
        rows.append(
            [r.name, r.type, f"{r.params:,}", f"{r.trainable:,}"] + ([r.output_shape] if summary.has_shapes else [])
        )
    rows.append(["total", summary.module_type, f"{summary.total:,}", f"{summary.trainable:,}"])
    rows[-1] += [""] if summary.has_shapes else []
    widths = [max(len(row[i]) for row in rows) for i in range(len(head))]
    lines = []
    for row in rows:
        cells = [row[0].ljust(widths[0]), row[1].ljust(widths[1]), row[2].rjust(widths[2]), row[3].rjust(widths[3])]
        cells += [c.ljust(w) for c, w in zip(row[4:], widths[4:], strict=True)]
        lines.append("  ".join(cells).rstrip())
    return "\n".join([*lines, f"{summary.size_mb:.2f} MB of parameters"])


def format_rich(summary: Summary) -> RenderableType:
    """`Summary` as a ``rich`` table, followed by the totals and the size."""
    from rich.console import Group
    from rich.table import Table
    from rich.text import Text

    table = Table(title=f"{summary.module_type} summary", header_style="bold")
    table.add_column("", justify="right", style="dim")
    table.add_column("Name")
    table.add_column("Type")
    table.add_column("Params", justify="right")
    table.add_column("Trainable", justify="right")
    if summary.has_shapes:
        table.add_column("Output shape")
    for i, r in enumerate(summary.rows):
        cells = [str(i), r.name, r.type, human(r.params), human(r.trainable)]
        table.add_row(*cells, *([r.output_shape] if summary.has_shapes else []))
    totals = Text(
        f"Trainable params: {summary.trainable:,}\n"
        f"Non-trainable params: {summary.non_trainable:,}\n"
        f"Total params: {summary.total:,}\n"
        f"Size: {summary.size_mb:.2f} MB"
    )
    return Group(table, totals)


def human(n: int) -> str:
    """``950``, ``1.2 K``, ``3.4 M``, ``7.0 B``."""
    for unit, scale in (("B", 1e9), ("M", 1e6), ("K", 1e3)):
        if n >= scale:
            return f"{n / scale:.1f} {unit}"
    return str(n)


class ModelSummary(Callback):
    """Prints the module's summary when fit starts (global zero only).

    Enabled by ``Trainer(enable_model_summary=True)`` (the default). With a
    rich ``console``, or when ``stream`` (default ``sys.stdout``) is a
    terminal, the summary is a rich table; otherwise plain text
    (`summarize`). ``use_rich`` forces either.
    """

    def __init__(
        self, stream: TextIO | None = None, *, console: Console | None = None, use_rich: bool | None = None
    ) -> None:
        self.stream = stream
        self.console = console
        self.use_rich = use_rich

    def _wants_rich(self, stream: TextIO) -> bool:
        if self.use_rich is not None:
            return self.use_rich
        if self.console is not None:
            return True
        isatty = getattr(stream, "isatty", None)
        return bool(isatty and isatty())

    def on_fit_start(self, trainer: Trainer, module: TrainingModule) -> None:
        """Measure the module (running ``example_input_array`` when set) and print the summary on global zero.

        Every rank runs the example forward: a sharded module (FSDP) needs all of them for it.
        """
        summary = describe(module, module.example_input_array, trainer.strategy.forward_context())
        if not trainer.is_global_zero:
            return
        stream = self.stream or sys.stdout
        if self._wants_rich(stream):
            from rich.console import Console

            console = self.console or Console(file=stream)
            console.print(format_rich(summary))
        else:
            print(format_plain(summary), file=stream, flush=True)
