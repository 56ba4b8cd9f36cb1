"""Hugging Face export: the transformers model inside a module, as a ``save_pretrained`` directory.

The directory holds ``config.json``, the weights as ``model.safetensors`` and, when the module has a
tokenizer, its files (``tokenizer.json``, ``tokenizer_config.json``, ...), so
``AutoModelForCausalLM.from_pretrained(dir)`` (or the Auto class of the model's kind) and
``AutoTokenizer.from_pretrained(dir)`` load it anywhere, without ember.

The model is the module's ``model`` attribute when it is a transformers ``PreTrainedModel``, else the one
such model among its submodules. The tokenizer is the ``tokenizer`` argument, else the module's
``tokenizer`` attribute (a transformers tokenizer, or a ``tokenizers.Tokenizer``, which is wrapped in a
``PreTrainedTokenizerFast``). Like every export, the directory is written beside the destination, loaded
back with ``from_pretrained`` and checked (weights bit for bit, outputs on the example input, the
tokenizer's ids on a sample text) before it is renamed into place.
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Iterator
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
from torch import Tensor, nn

from ember.export.checks import ExportError, ExportResult, compare_outputs, tolerances
from ember.export.files import staged_dir
from ember.export.inputs import evaluating

if TYPE_CHECKING:
    from ember.modules.module import TrainingModule

#: Text the exported tokenizer must encode to the same ids as the module's.
TOKENIZER_PROBE = 'def main(argv: list[str]) -> int:\n    """Entry point."""\n    return 0  # ok: ünïcode ✓\n'
#: Rows and length of the token ids an export checks on when the module has no example input.
PROBE_SHAPE = (2, 16)


def _transformers() -> Any:
    try:
        import transformers
    except ImportError as exc:
        raise ExportError(
            f"the Hugging Face export needs transformers, which is not installed ({exc}); "
            "run: pip install transformers tokenizers safetensors  (or: pip install 'ember[hf]')"
        ) from None
    return transformers


def find_pretrained(module: nn.Module) -> Any:
    """The transformers ``PreTrainedModel`` of `module`: its ``model`` attribute, else its only one.

    Raises an `ExportError` when there is none, or several not nested in one another.
    """
    base = _transformers().PreTrainedModel
    if isinstance(module, base):
        return module
    own = getattr(module, "model", None)
    if isinstance(own, base):
        return own
    found: list[tuple[str, nn.Module]] = []
    for name, sub in module.named_modules():
        if isinstance(sub, base) and not any(name.startswith(f"{outer}.") for outer, _ in found):
            found.append((name, sub))
    if len(found) == 1:
        return found[0][1]
    name = type(module).__qualname__
    if not found:
        raise ExportError(
            f"{name} holds no Hugging Face transformers model (a PreTrainedModel); the hf export writes one "
            "with save_pretrained. Set self.model = e.g. GPT2LMHeadModel(config), or use another format"
        )
    names = ", ".join(n for n, _ in found)
    raise ExportError(f"{name} holds several transformers models ({names}); set self.model to the one to export")


def as_pretrained_tokenizer(tokenizer: Any) -> Any:
    """A transformers tokenizer (has ``save_pretrained``) for `tokenizer`; a ``tokenizers.Tokenizer`` is wrapped."""
    if tokenizer is None or hasattr(tokenizer, "save_pretrained"):
        return tokenizer
    transformers = _transformers()
    from tokenizers import Tokenizer  # a dependency of transformers

    if isinstance(tokenizer, Tokenizer):
        return transformers.PreTrainedTokenizerFast(tokenizer_object=tokenizer)
    raise ExportError(
        f"tokenizer: expected a transformers tokenizer or a tokenizers.Tokenizer, got {type(tokenizer).__qualname__}"
    )


def export_hf(
    module: TrainingModule,
    path: str | os.PathLike[str],
    tokenizer: Any = None,
    example_input: Any = None,
    *,
    atol: float | None = None,
    rtol: float | None = None,
) -> ExportResult:
    """Write the module's transformers model (and tokenizer) to the directory `path` with ``save_pretrained``.

    Checked before the directory moves into place: ``from_pretrained`` of the written directory has the
    same weights bit for bit, its output (``logits``, else ``last_hidden_state``) on the example input
    equals the in-memory model's within `atol`/`rtol`, and so does the module's own forward when it
    returns a tensor of that shape; the written tokenizer encodes `TOKENIZER_PROBE` to the same ids.
    The example input is `example_input`, else ``module.example_input_array``, else token ids
    ``arange % vocab_size`` of shape `PROBE_SHAPE` (shorter if the model has fewer positions). An
    existing earlier export at `path` is replaced; any other existing path is an error.
    """
    transformers = _transformers()
    model = find_pretrained(module)
    tok = as_pretrained_tokenizer(tokenizer if tokenizer is not None else getattr(module, "tokenizer", None))
    target = Path(path)
    if target.exists() and not (target.is_dir() and (target / "config.json").is_file()):
        raise ExportError(f"{target} exists and is not a Hugging Face export directory; choose another path")
    inputs = _probe_input(module, model, example_input)
    atol, rtol = tolerances(atol, rtol)
    with evaluating(module), _quiet_progress(transformers), staged_dir(target) as tmp:
        model.save_pretrained(tmp)
        if tok is not None:
            tok.save_pretrained(tmp)
        loaded = type(model).from_pretrained(tmp, local_files_only=True).eval()
        _check_weights(target, model, loaded)
        expected = _main_output(_run(model, inputs))
        got = _main_output(_run(loaded, inputs))
        rows = int(inputs.shape[0])
        checks = [compare_outputs("hf", target, [got], [expected], rows, atol, rtol, on="the example token ids")]
        own = _run_module(module, inputs)
        if isinstance(own, Tensor) and own.shape == got.shape:
            on = "the example token ids (the module's forward)"
            checks.append(compare_outputs("hf", target, [got], [own], rows, atol, rtol, on=on))
        if tok is not None:
            _check_tokenizer(transformers, target, tok, tmp)
    return ExportResult("hf", target, tuple(checks))


@contextlib.contextmanager
def _quiet_progress(transformers: Any) -> Iterator[None]:
    """No transformers progress bars ("Loading weights ...") while exporting; restored after."""
    logging = transformers.utils.logging
    enabled = logging.is_progress_bar_enabled()
    logging.disable_progress_bar()
    try:
        yield
    finally:
        if enabled:
            logging.enable_progress_bar()


def _probe_input(module: TrainingModule, model: nn.Module, example_input: Any) -> Tensor:
    value = example_input if example_input is not None else getattr(module, "example_input_array", None)
    if isinstance(value, (tuple, list)) and len(value) == 1:
        value = value[0]
    if value is None:
        config = model.config
        vocab = int(getattr(config, "vocab_size", 2))
        positions = getattr(config, "n_positions", None) or getattr(config, "max_position_embeddings", None)
        rows, length = PROBE_SHAPE[0], min(PROBE_SHAPE[1], int(positions or PROBE_SHAPE[1]))
        value = torch.arange(rows * length).reshape(rows, length) % vocab
    if not isinstance(value, Tensor) or value.dtype not in (torch.int32, torch.int64):
        raise ExportError(
            f"{type(module).__qualname__}: the hf export checks the model on token ids; the example input must be "
            f"one integer tensor (batch, seq_len), got {type(value).__qualname__}"
        )
    param = next(model.parameters(), None)
    return value.to(param.device if param is not None else "cpu")


def _run(model: nn.Module, inputs: Tensor) -> Any:
    with torch.no_grad():
        return model(input_ids=inputs)


def _run_module(module: nn.Module, inputs: Tensor) -> Any:
    """The module's own forward on the token ids, or None when its forward takes something else."""
    try:
        with torch.no_grad():
            return module(inputs)
    except Exception:
        return None


def _main_output(output: Any) -> Tensor:
    for name in ("logits", "last_hidden_state"):
        value = getattr(output, name, None)
        if isinstance(value, Tensor):
            return value
    if isinstance(output, Tensor):
        return output
    raise ExportError(f"the transformers model returned {type(output).__qualname__} without logits to compare")


def _check_weights(target: Path, model: nn.Module, loaded: nn.Module) -> None:
    ours, theirs = model.state_dict(), loaded.state_dict()
    missing = sorted(set(ours) - set(theirs))
    if missing:
        raise ExportError(f"hf export check failed: {target} lacks {missing[:5]} after from_pretrained")
    for key, value in ours.items():
        if not torch.equal(value.detach().cpu(), theirs[key].detach().cpu()):
            diff = float((value.detach().cpu().double() - theirs[key].detach().cpu().double()).abs().max())
            raise ExportError(
                f"hf export check failed: {target}: {key} differs after from_pretrained (max abs diff {diff:.3g}); "
                "the directory was not written"
            )


def _check_tokenizer(transformers: Any, target: Path, tokenizer: Any, written: Path) -> None:
    reloaded = transformers.AutoTokenizer.from_pretrained(written, local_files_only=True)
    ours, theirs = tokenizer(TOKENIZER_PROBE)["input_ids"], reloaded(TOKENIZER_PROBE)["input_ids"]
    if list(ours) != list(theirs):
        raise ExportError(
            f"hf export check failed: {target}: AutoTokenizer.from_pretrained encodes a sample text to other ids "
            f"({list(theirs)[:8]}... instead of {list(ours)[:8]}...); the directory was not written"
        )
