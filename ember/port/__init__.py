"""``ember port FILE...``: the migration guide's recipe, applied to Python files.

It rewrites what ties a file to Lightning and nothing else: import statements of ``lightning``,
``lightning.pytorch`` and ``pytorch_lightning``, and every reference to a name they bind
(``pl.LightningModule`` -> ``ember.TrainingModule``, ``LightningDataModule`` -> ``DataModule``,
``pl.callbacks.TQDMProgressBar`` -> ``ember.callbacks.ProgressLine``, ...). The file is read with `ast` and
edited at the positions of those nodes only, so strings, comments, docstrings and layout stay as they were.

A name is mapped only when ember exports its counterpart in this installation (``ember.__all__``,
``ember.callbacks``, ``ember.loggers``, ``ember.strategies``, ``ember.utilities``). Everything else is
listed with its line and what to do instead (`UNSUPPORTED`); its import is kept, so the file still runs
where Lightning is installed. The port also lists, without changing them, Trainer keywords ember does not
take and module methods ember does not call.

::

    ember port model.py              # in place; the original is kept as model.py.orig
    ember port src/*.py --out ported # writes ported/<name>.py
    ember port model.py --diff       # prints a unified diff, writes nothing

Exit code 0: every Lightning name was mapped; 1: the files were written but some names are listed for
a hand edit; 2: a mistake (a missing file, a file that is not Python, a syntax error), nothing written.
"""

from ember.port.command import add_parser, port_files, read_source, run
from ember.port.names import Target, resolve, split_lightning
from ember.port.rewrite import Note, PortError, PortResult, port_source

__all__ = [
    "Note",
    "PortError",
    "PortResult",
    "Target",
    "add_parser",
    "port_files",
    "port_source",
    "read_source",
    "resolve",
    "run",
    "split_lightning",
]
