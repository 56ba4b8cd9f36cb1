"""TorchServe model archive (``.mar``): the weights, a generated handler applying ``predict_step``, and
the source of the module's package, packed by ``torch-model-archiver``.

The archive is checked before it is moved into place: it is unpacked, its handler is imported and
answers a request holding the example input, and the reply must equal ``predict_step`` on the same
input (under the same random seed, for a ``predict_step`` that samples).
"""

from __future__ import annotations

import importlib
import importlib.resources
import importlib.util
import inspect
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
import zipfile
from pathlib import Path
from types import ModuleType, SimpleNamespace
from typing import TYPE_CHECKING, Any

import torch

from ember.export.checks import DEFAULT_ATOL, Check, ExportError, ExportResult, require_installed
from ember.export.files import staged
from ember.export.inputs import Inputs, batch_size, evaluating, example_inputs

if TYPE_CHECKING:
    from ember.modules.module import TrainingModule

HANDLER_FILE = "ember_handler.py"
#: The handler's source in this package; `SETTINGS` is filled in when it is copied into an archive.
HANDLER_TEMPLATE = "torchserve_handler.py"
WEIGHTS_FILE = "model.pt"
_SETTINGS_LINE = "SETTINGS: dict[str, Any] = {}\n"
_MODEL_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9_\-.]*")


def export_torchserve(
    module: TrainingModule,
    path: str | os.PathLike[str],
    example_input: Any = None,
    *,
    version: str = "1.0",
    atol: float | None = None,
) -> ExportResult:
    """Write a TorchServe archive at `path` (``NAME.mar``; NAME is the model name TorchServe serves).

    The handler rebuilds the module from its class and hyperparameters (``save_hyperparameters()``),
    loads the weights and answers each request with ``predict_step(batch, 0)``. The example input
    (`example_input` or ``module.example_input_array``) is sent through the archive's handler and the
    reply compared with ``predict_step`` before the archive is moved into place.
    """
    require_installed("model_archiver", "TorchServe export", package="torch-model-archiver")
    target = Path(path)
    name = target.name.removesuffix(".mar")
    if target.suffix != ".mar" or not _MODEL_NAME.fullmatch(name):
        raise ExportError(
            f"TorchServe archive {target}: the file must be NAME.mar, NAME of letters, digits, '_', '-' and '.'"
        )
    inputs = example_inputs(module, example_input)
    settings = _settings(module, inputs)
    atol = DEFAULT_ATOL if atol is None else atol
    with tempfile.TemporaryDirectory(prefix="ember-torchserve-") as scratch, evaluating(module):
        folder = Path(scratch)
        _write_inputs(module, settings, folder)
        with staged(target) as tmp:
            _archive(folder, name, version, tmp.parent)
            check = _check_archive(module, target, tmp, inputs, atol)
    return ExportResult("torchserve", target, (check,))


def _settings(module: TrainingModule, inputs: Inputs) -> dict[str, Any]:
    """What the handler needs to rebuild the module; errors when it could not."""
    cls = type(module)
    where = f"{cls.__module__}.{cls.__qualname__}"
    if cls.__module__ == "__main__" or "<locals>" in cls.__qualname__:
        raise ExportError(
            f"TorchServe export: {where} is not importable by name; define the module class at the top level of "
            "an importable file so the server can import it"
        )
    init_args = dict(module.hparams)
    try:
        json.dumps(init_args)
    except (TypeError, ValueError) as exc:
        raise ExportError(
            f"TorchServe export: the hyperparameters of {where} are not JSON ({exc}); the handler rebuilds the "
            "module from them. Pass only plain values to __init__, or leave the others out with "
            "save_hyperparameters(ignore=[...]) and give them defaults"
        ) from None
    try:
        inspect.signature(cls).bind(**init_args)
    except TypeError as exc:
        raise ExportError(
            f"TorchServe export: {where} cannot be rebuilt from its hyperparameters {sorted(init_args)}: {exc}; "
            "call self.save_hyperparameters() in __init__"
        ) from None
    return {
        "module_class": f"{cls.__module__}:{cls.__qualname__}",
        "init_args": init_args,
        "weights_file": WEIGHTS_FILE,
        "input_dtypes": [str(t.dtype).removeprefix("torch.") for t in inputs],
    }


def _write_inputs(module: TrainingModule, settings: dict[str, Any], folder: Path) -> None:
    """The weights, the handler and the module's package source, as torch-model-archiver's inputs."""
    from ember import checkpoint

    checkpoint.save_weights(folder / WEIGHTS_FILE, module.state_dict())
    template = importlib.resources.files("ember.export").joinpath(HANDLER_TEMPLATE)
    text = template.read_text(encoding="utf-8")
    if text.count(_SETTINGS_LINE) != 1:
        raise ExportError("the TorchServe handler template has lost its SETTINGS line")
    filled = f"SETTINGS: dict[str, Any] = json.loads({json.dumps(settings)!r})\n"
    (folder / HANDLER_FILE).write_text(text.replace(_SETTINGS_LINE, filled), encoding="utf-8")
    code = folder / "code"
    code.mkdir()
    for source, relative in package_sources(type(module)):
        (code / relative).parent.mkdir(parents=True, exist_ok=True)
        shutil.copy2(source, code / relative)


def package_sources(cls: type) -> list[tuple[Path, str]]:
    """(file, path in the archive) of every ``.py`` file of the top-level package defining `cls`
    (just the module file for a top-level module; nothing for ember's own classes)."""
    top = cls.__module__.split(".")[0]
    if top == "ember":
        return []
    package = sys.modules.get(top) or importlib.import_module(top)
    roots = list(getattr(package, "__path__", []))
    if roots:
        root = Path(roots[0])
        files = sorted(
            p
            for p in root.rglob("*.py")
            if not any(part.startswith(".") or part == "__pycache__" for part in p.relative_to(root).parts)
        )
        return [(p, str(Path(top) / p.relative_to(root))) for p in files]
    file = getattr(package, "__file__", None)
    return [(Path(file), f"{top}.py")] if file else []


def _archive(folder: Path, name: str, version: str, export_path: Path) -> None:
    """Run torch-model-archiver in its own process (it logs through the root logger and works in
    ``$TMPDIR/<name>``, which would collide with another archiver of the same name)."""
    work = folder / "archiver-tmp"
    work.mkdir()
    command = [
        sys.executable, "-m", "model_archiver.model_packaging",
        "--model-name", name, "--version", version,
        "--serialized-file", str(folder / WEIGHTS_FILE), "--handler", str(folder / HANDLER_FILE),
        "--export-path", str(export_path), "--force",
    ]  # fmt: skip
    if any((folder / "code").iterdir()):
        command += ["--extra-files", str(folder / "code")]
    env = {**os.environ, "TMPDIR": str(work), "TEMP": str(work), "TMP": str(work)}
    result = subprocess.run(command, env=env, capture_output=True, text=True, timeout=300, check=False)
    if result.returncode != 0:
        lines = [line for line in (result.stderr + result.stdout).splitlines() if line.strip()]
        raise ExportError(f"torch-model-archiver failed (exit {result.returncode}): {lines[-1] if lines else ''}")


def read_manifest(archive: str | os.PathLike[str]) -> dict[str, Any]:
    """The ``MAR-INF/MANIFEST.json`` of a TorchServe archive."""
    with zipfile.ZipFile(archive) as z:
        manifest: dict[str, Any] = json.loads(z.read("MAR-INF/MANIFEST.json"))
    return manifest


def _check_archive(module: TrainingModule, target: Path, archive: Path, inputs: Inputs, atol: float) -> Check:
    manifest = read_manifest(archive)
    model = manifest.get("model", {})
    if model.get("handler") != HANDLER_FILE or model.get("serializedFile") != WEIGHTS_FILE:
        raise ExportError(f"torchserve export check failed: {target} has an unexpected manifest {model}")
    batch = inputs[0] if len(inputs) == 1 else inputs
    with tempfile.TemporaryDirectory(prefix="ember-torchserve-check-") as unpacked:
        with zipfile.ZipFile(archive) as z:
            z.extractall(unpacked)
        handler = _import_handler(Path(unpacked) / HANDLER_FILE)
        context = SimpleNamespace(system_properties={"model_dir": unpacked, "gpu_id": None}, manifest=manifest)
        body = json.dumps({"inputs": handler.encode(list(inputs) if len(inputs) > 1 else inputs[0])}).encode()
        try:
            handler.handle(None, context)  # loads the module, whose initialisation draws random numbers
            with torch.random.fork_rng(devices=[]):
                torch.manual_seed(0)
                replies = handler.handle([{"body": body}], context)
        except Exception as exc:
            raise ExportError(
                f"torchserve export check failed: the handler in {target} raised {type(exc).__name__}: {exc}; "
                "the file was not written"
            ) from exc
        finally:
            if unpacked in sys.path:
                sys.path.remove(unpacked)
    with torch.random.fork_rng(devices=[]), torch.no_grad():
        torch.manual_seed(0)
        expected = handler.encode(module.predict_step(batch, 0))
    diff = _difference(replies[0] if replies else None, expected)
    if diff > atol:
        raise ExportError(
            f"torchserve export check failed: the handler in {target} answers the example input differently from "
            f"predict_step (max abs diff {diff:.3g}); the file was not written"
        )
    return Check(batch_size(inputs), diff)


def _import_handler(path: Path) -> ModuleType:
    spec = importlib.util.spec_from_file_location(f"_ember_torchserve_check_{os.getpid()}_{id(path)}", path)
    if spec is None or spec.loader is None:
        raise ExportError(f"cannot import the TorchServe handler {path}")
    handler = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(handler)
    return handler


def _difference(got: Any, expected: Any) -> float:
    """Largest absolute difference between two JSON values (inf where their structure or text differs)."""
    if isinstance(expected, bool) or not isinstance(expected, (int, float, list, dict)):
        return 0.0 if got == expected else float("inf")
    if isinstance(expected, (int, float)):
        return abs(float(got) - float(expected)) if isinstance(got, (int, float)) else float("inf")
    if isinstance(expected, list):
        if not isinstance(got, list) or len(got) != len(expected):
            return float("inf")
        return max((_difference(g, e) for g, e in zip(got, expected, strict=True)), default=0.0)
    if not isinstance(got, dict) or set(got) != set(expected):
        return float("inf")
    return max((_difference(got[k], v) for k, v in expected.items()), default=0.0)
