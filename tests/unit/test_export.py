"""`ember.export`: every format for the digits models and the char transformer, compared with PyTorch.

Each (model, format) is exported once per module (the `artifacts` fixture) and the tests load the
artifact themselves and compare it with the PyTorch module on fresh inputs, at batch sizes other than
the example's. Models are tiny so the whole file stays fast.
"""

from __future__ import annotations

import json
import subprocess
import sys
import zipfile
from collections.abc import Callable
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
import torch
from torch import Tensor, nn

import ember
from ember.export import FORMATS, ExportError, ExportResult, export, load_safetensors, read_manifest
from examples.char_transformer import CharTransformer
from examples.digits import Classifier, CNNClassifier

pytestmark = pytest.mark.filterwarnings(
    "ignore:`torch.jit.* is deprecated",  # torch 2.13 deprecates TorchScript; ember still offers it
    "ignore:`isinstance\\(treespec, LeafSpec\\)` is deprecated",  # inside the ONNX exporter
    "ignore:This property will be removed",  # torchmetrics, when TorchScript walks a Metric's attributes
    "ignore:Converting a tensor to a Python integer:torch.jit.TracerWarning",  # a constant split size
)

ort = pytest.importorskip("onnxruntime", reason="ONNX checks need onnxruntime: pip install 'ember[export]'")
pytest.importorskip("onnxscript", reason="ONNX export needs onnxscript: pip install 'ember[export]'")
pytest.importorskip("safetensors", reason="weights export needs safetensors: pip install 'ember[export]'")
pytest.importorskip("model_archiver", reason="the .mar needs torch-model-archiver: pip install 'ember[export]'")

MODELS = ["mlp", "cnn", "char"]


def build(name: str) -> ember.TrainingModule:
    """Tiny versions of the example models, seeded. The MLP has no example_input_array: it gets one."""
    torch.manual_seed(0)
    if name == "mlp":
        module: ember.TrainingModule = Classifier(hidden=16)
        module.example_input_array = torch.rand(3, 64)
        return module
    if name == "cnn":  # its own example input: zeros(1, 1, 8, 8), a batch of one
        module = CNNClassifier(width=4)
        module.train()  # one step's worth of BatchNorm statistics, so eval mode differs from train mode
        with torch.no_grad():
            module(torch.rand(16, 1, 8, 8))
        return module.eval()
    return CharTransformer(context=32, d_model=16, n_heads=2, n_layers=1, max_new_tokens=4)


def fresh_input(name: str, batch: int) -> Tensor:
    """New inputs, unlike the example's, for a model at `batch` rows."""
    g = torch.Generator().manual_seed(100 + batch)
    if name == "mlp":
        return torch.rand(batch, 64, generator=g)
    if name == "cnn":
        return torch.rand(batch, 1, 8, 8, generator=g)
    return torch.randint(0, 256, (batch, 32), generator=g)


class Artifacts:
    """Each (model, format, variant) exported once, on first request, through the TrainingModule methods."""

    def __init__(self, root: Path) -> None:
        self.root = root
        self.modules = {name: build(name) for name in MODELS}
        self.results: dict[tuple[str, str, str], ExportResult] = {}

    def get(self, name: str, fmt: str, variant: str = "") -> ExportResult:
        key = (name, fmt, variant)
        if key not in self.results:
            module = self.modules[name]
            path = self.root / f"{name}{variant}{FORMATS[fmt]}"
            makers: dict[str, Callable[[], ExportResult]] = {
                "onnx": lambda: module.to_onnx(path),
                "torchscript": lambda: module.to_torchscript(path, method=variant or "script"),
                "torch-export": lambda: module.export_program(path),
                "safetensors": lambda: module.to_safetensors(path),
                "torchserve": lambda: export(module, "torchserve", path),
            }
            self.results[key] = makers[fmt]()
        return self.results[key]


@pytest.fixture(scope="module")
def artifacts(tmp_path_factory: pytest.TempPathFactory) -> Artifacts:
    return Artifacts(tmp_path_factory.mktemp("exports"))


def expected(module: nn.Module, x: Tensor) -> Tensor:
    with torch.no_grad():
        out: Tensor = module.eval()(x)
    return out


def batch_sizes(result: ExportResult) -> list[int | None]:
    return [c.batch_size for c in result.checks]


# --- ONNX ------------------------------------------------------------------------------------------------


def test_onnx_export_prints_no_torch_internal_future_warning(tmp_path: Path) -> None:
    """torch 2.13's exporter triggers a FutureWarning about ``LeafSpec`` inside torch on every export; ember
    filters that one message (issue 21), and only it: a warning from the user's model still shows."""
    import warnings

    class Warns(nn.Module):
        def forward(self, x: Tensor) -> Tensor:
            warnings.warn("the model's own warning", UserWarning, stacklevel=2)
            return x * 2

    module = build("mlp")
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        module.to_onnx(tmp_path / "mlp.onnx")
    assert [str(w.message) for w in caught if "LeafSpec" in str(w.message)] == []
    own = build("mlp")
    own.model = nn.Sequential(own.model, Warns())
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        own.to_onnx(tmp_path / "warns.onnx")
    assert "the model's own warning" in [str(w.message) for w in caught]


@pytest.mark.parametrize("name", MODELS)
def test_onnx_matches_the_module_at_other_batch_sizes(artifacts: Artifacts, name: str) -> None:
    result = artifacts.get(name, "onnx")
    module = artifacts.modules[name]
    example_batch = module.example_input_array.shape[0]
    assert result.format == "onnx" and result.path.is_file()
    assert batch_sizes(result) == [example_batch, 2 * example_batch]  # self-check: example, then twice the batch
    assert all(c.max_abs_diff < 1e-5 for c in result.checks)
    session = ort.InferenceSession(str(result.path), providers=["CPUExecutionProvider"])
    (onnx_input,) = session.get_inputs()
    assert onnx_input.name == "input" and isinstance(onnx_input.shape[0], str)  # a symbolic batch dimension
    assert [o.name for o in session.get_outputs()] == ["output"]
    for batch in (1, 5):
        x = fresh_input(name, batch)
        (got,) = session.run(None, {"input": x.numpy()})
        torch.testing.assert_close(torch.from_numpy(got), expected(module, x), atol=1e-5, rtol=1e-4)


def test_onnx_with_a_static_batch_takes_only_the_example_batch(tmp_path: Path) -> None:
    module = build("mlp")
    result = module.to_onnx(tmp_path / "static.onnx", dynamic_batch=False)
    assert batch_sizes(result) == [3]
    session = ort.InferenceSession(str(result.path), providers=["CPUExecutionProvider"])
    assert session.get_inputs()[0].shape == [3, 64]
    (got,) = session.run(None, {"input": fresh_input("mlp", 3).numpy()})
    torch.testing.assert_close(torch.from_numpy(got), expected(module, fresh_input("mlp", 3)), atol=1e-5, rtol=1e-4)
    with pytest.raises(Exception, match=r"(?i)dimension|shape"):
        session.run(None, {"input": fresh_input("mlp", 5).numpy()})


# --- TorchScript ----------------------------------------------------------------------------------------------


@pytest.mark.parametrize("method", ["script", "trace"])
@pytest.mark.parametrize("name", MODELS)
def test_torchscript_matches_the_module(artifacts: Artifacts, name: str, method: str) -> None:
    result = artifacts.get(name, "torchscript", method)
    module = artifacts.modules[name]
    assert result.format == "torchscript" and batch_sizes(result) == [module.example_input_array.shape[0]]
    assert result.checks[0].max_abs_diff == 0.0
    loaded = torch.jit.load(str(result.path))
    if method == "script":  # the MLP keeps the default forward (self.model(x)): its model is what gets scripted
        assert loaded.original_name == {"mlp": "Sequential", "cnn": "CNNClassifier", "char": "CharTransformer"}[name]
    for batch in (1, 5):
        x = fresh_input(name, batch)
        torch.testing.assert_close(loaded(x), expected(module, x), atol=1e-6, rtol=1e-5)


def test_an_export_leaves_the_module_in_its_mode_and_its_class(tmp_path: Path) -> None:
    module = build("char").train()
    module.to_torchscript(tmp_path / "m.pt", method="trace")
    assert module.training and type(module) is CharTransformer
    with pytest.raises(RuntimeError, match="not attached to a Trainer"):
        _ = module.trainer


# --- torch.export ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize("name", MODELS)
def test_exported_program_matches_the_module_at_other_batch_sizes(artifacts: Artifacts, name: str) -> None:
    result = artifacts.get(name, "torch-export")
    module = artifacts.modules[name]
    example_batch = module.example_input_array.shape[0]
    assert result.path.suffix == ".pt2" and batch_sizes(result) == [example_batch, 2 * example_batch]
    program = torch.export.load(str(result.path)).module()
    for batch in (1, 7):
        x = fresh_input(name, batch)
        torch.testing.assert_close(program(x), expected(module, x), atol=1e-6, rtol=1e-5)


def test_dynamic_shapes_make_more_than_the_batch_dynamic(tmp_path: Path) -> None:
    module = build("char")
    seq = torch.export.Dim("seq", min=2, max=32)
    shapes = {"tokens": {0: torch.export.Dim("batch", min=1), 1: seq}}
    result = module.export_program(tmp_path / "char.pt2", dynamic_shapes=shapes)
    example_batch = module.example_input_array.shape[0]
    assert batch_sizes(result) == [example_batch, 2 * example_batch]
    program = torch.export.load(str(result.path)).module()
    x = fresh_input("char", 3)[:, :20]  # 20 tokens; the example had 32
    torch.testing.assert_close(program(x), expected(module, x), atol=1e-6, rtol=1e-5)


def test_an_artifact_that_cannot_take_the_checked_batch_is_an_error(tmp_path: Path) -> None:
    # dynamic_shapes that keep the batch static, while dynamic_batch=True asks for a check at twice the batch
    with pytest.raises(ExportError) as info:
        build("mlp").export_program(tmp_path / "mlp.pt2", dynamic_shapes={"args": (None,)})
    assert str(info.value).startswith(
        f"torch-export export check failed: {tmp_path / 'mlp.pt2'} cannot run on the example input twice over "
        "(batch size 6): "
    )
    assert list(tmp_path.iterdir()) == []


# --- safetensors -------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("name", MODELS)
def test_safetensors_weights_load_into_a_new_module(artifacts: Artifacts, name: str) -> None:
    from safetensors import safe_open

    result = artifacts.get(name, "safetensors")
    module = artifacts.modules[name]
    state = load_safetensors(result.path)
    assert sorted(state) == sorted(module.state_dict())  # safetensors stores names sorted
    assert all(torch.equal(state[k], v) for k, v in module.state_dict().items())
    with safe_open(str(result.path), framework="pt") as f:
        meta = f.metadata()
    assert meta["ember.module_class"] == f"{type(module).__module__}:{type(module).__qualname__}"
    assert json.loads(meta["ember.hparams"]) == dict(module.hparams)
    fresh = type(module)(**json.loads(meta["ember.hparams"])).eval()
    fresh.load_state_dict(state)
    x = fresh_input(name, 5)
    torch.testing.assert_close(expected(fresh, x), expected(module, x), atol=0, rtol=0)


class Tied(ember.TrainingModule):
    """An embedding and an output layer sharing one weight."""

    def __init__(self) -> None:
        super().__init__()
        self.save_hyperparameters()
        self.embed = nn.Embedding(10, 4)
        self.head = nn.Linear(4, 10, bias=False)
        self.head.weight = self.embed.weight

    def forward(self, tokens: Tensor) -> Tensor:
        return self.head(self.embed(tokens))


def test_safetensors_stores_tied_weights_once_and_restores_both_names(tmp_path: Path) -> None:
    from safetensors.torch import load_file

    module = Tied()
    result = module.to_safetensors(tmp_path / "tied.safetensors", torch.tensor([[1, 2, 3]]))
    assert sorted(load_file(str(result.path))) == ["embed.weight"]
    state = load_safetensors(result.path)
    assert sorted(state) == ["embed.weight", "head.weight"]
    fresh = Tied()
    fresh.load_state_dict(state)
    assert torch.equal(fresh.head.weight, module.embed.weight)
    assert result.checks[0].max_abs_diff == 0.0


def test_safetensors_without_an_example_input_checks_the_weights_only(tmp_path: Path) -> None:
    module = Classifier(hidden=8)
    result = module.to_safetensors(tmp_path / "w.safetensors")
    assert result.checks == () and "weights compared" in result.describe_checks()
    assert torch.equal(load_safetensors(result.path)["model.1.weight"], module.model[1].weight)


# --- TorchServe ------------------------------------------------------------------------------------------------------


def run_handler(archive: Path, root: Path, body: Any) -> Any:
    """Unpack `archive` and answer one request with its handler, as a TorchServe worker would."""
    import importlib.util

    unpacked = root / archive.stem
    with zipfile.ZipFile(archive) as z:
        z.extractall(unpacked)
    spec = importlib.util.spec_from_file_location(f"handler_{archive.stem}", unpacked / "ember_handler.py")
    assert spec is not None and spec.loader is not None
    handler = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(handler)
    context = SimpleNamespace(system_properties={"model_dir": str(unpacked), "gpu_id": None})
    try:
        assert handler.handle(None, context) is None
        torch.manual_seed(1)
        (reply,) = handler.handle([{"body": json.dumps(body).encode()}], context)
    finally:
        sys.path.remove(str(unpacked))
    return handler.SETTINGS, reply


@pytest.mark.parametrize("name", MODELS)
def test_torchserve_archive_holds_manifest_handler_weights_and_code(
    artifacts: Artifacts, name: str, tmp_path: Path
) -> None:
    result = artifacts.get(name, "torchserve")
    module = artifacts.modules[name]
    assert result.path.name == f"{name}.mar" and result.checks[0].max_abs_diff == 0.0
    manifest = read_manifest(result.path)
    assert manifest["runtime"] == "python"
    assert manifest["model"] == {
        "modelName": name,
        "serializedFile": "model.pt",
        "handler": "ember_handler.py",
        "modelVersion": "1.0",
    }
    with zipfile.ZipFile(result.path) as z:
        files = set(z.namelist())
        state = torch.load(z.open("model.pt"), weights_only=True)
    source = "examples/char_transformer.py" if name == "char" else "examples/digits.py"
    assert {"ember_handler.py", "model.pt", "examples/__init__.py", source} <= files
    assert all(torch.equal(state[k], v) for k, v in module.state_dict().items())

    x = fresh_input(name, 3)
    settings, reply = run_handler(result.path, tmp_path, {"inputs": x.tolist()})
    assert settings == {
        "module_class": f"examples.{'char_transformer' if name == 'char' else 'digits'}:{type(module).__name__}",
        "init_args": dict(module.hparams),
        "weights_file": "model.pt",
        "input_dtypes": ["int64" if name == "char" else "float32"],
    }
    torch.manual_seed(1)
    with torch.no_grad():
        prediction = module.predict_step(x, 0)
    if name == "char":  # predict_step samples text: the same seed gives the same text
        assert reply == prediction and len(reply) == 3 and all(isinstance(text, str) for text in reply)
    else:
        torch.testing.assert_close(torch.tensor(reply), prediction, atol=1e-6, rtol=1e-5)


def test_torchserve_needs_a_module_the_server_can_rebuild(tmp_path: Path) -> None:
    class Local(ember.TrainingModule):
        def __init__(self) -> None:
            super().__init__()
            self.model = nn.Linear(2, 2)

    with pytest.raises(ExportError, match=r"not importable by name; define the module class at the top level"):
        export(Local(), "torchserve", tmp_path / "local.mar", torch.zeros(1, 2))
    with pytest.raises(ExportError, match=r"the file must be NAME.mar"):
        export(build("mlp"), "torchserve", tmp_path / "model.zip")
    assert list(tmp_path.iterdir()) == []


# --- the self-check, and bad input ----------------------------------------------------------------------------


class Noisy(ember.TrainingModule):
    """Adds fresh noise on every call: no artifact can reproduce its outputs."""

    def __init__(self) -> None:
        super().__init__()
        self.model = nn.Linear(4, 2)
        self.example_input_array = torch.ones(3, 4)

    def forward(self, x: Tensor) -> Tensor:
        return self.model(x) + torch.rand(x.shape[0], 2)


@pytest.mark.parametrize(("fmt", "file"), [("torchscript", "noisy.torchscript.pt"), ("torch-export", "noisy.pt2")])
def test_a_mismatch_is_an_error_naming_format_file_and_difference_and_leaves_no_file(
    tmp_path: Path, fmt: str, file: str
) -> None:
    (tmp_path / "old.txt").write_text("an unrelated file")
    with pytest.raises(ExportError) as info:
        export(Noisy(), fmt, tmp_path / file, method="trace")
    message = str(info.value)
    assert message.startswith(f"{fmt} export check failed: {tmp_path / file} output 0 differs from the PyTorch module")
    diff = float(message.split("by up to ")[1].split()[0])
    assert 0 < diff <= 2
    assert "batch size 3" in message and message.endswith("the file was not written")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["old.txt"]  # no artifact, no temporary folder


def test_a_failed_check_keeps_the_previous_artifact(tmp_path: Path) -> None:
    path = tmp_path / "noisy.pt2"
    path.write_bytes(b"the previous export")
    with pytest.raises(ExportError, match="check failed"):
        Noisy().export_program(path)
    assert path.read_bytes() == b"the previous export"


@pytest.mark.parametrize("fmt", ["onnx", "torchscript", "torch-export", "torchserve"])
def test_a_module_without_an_example_input_is_one_clear_error(tmp_path: Path, fmt: str) -> None:
    with pytest.raises(ExportError) as info:
        export(Classifier(hidden=8), fmt, tmp_path / f"m{FORMATS[fmt]}")
    assert str(info.value) == (
        "Classifier has no example input: pass example_input=... or set self.example_input_array in __init__ "
        "(e.g. torch.zeros(2, 64)); exports trace the module on it and check the artifact against it"
    )
    assert list(tmp_path.iterdir()) == []


def test_an_example_input_that_is_not_tensors_is_an_error(tmp_path: Path) -> None:
    with pytest.raises(ExportError, match=r"must be a tensor or a tuple of tensors .* got str"):
        Classifier(hidden=8).to_torchscript(tmp_path / "m.pt", example_input="eight by eight")


def test_an_example_input_the_module_cannot_take_is_one_clear_error(tmp_path: Path) -> None:
    with pytest.raises(ExportError) as info:
        build("mlp").to_onnx(tmp_path / "m.onnx", example_input=torch.zeros(2, 10))
    assert str(info.value).startswith(
        "Classifier.forward fails on the example input ((2, 10) float32): RuntimeError: mat1 and mat2 shapes "
    )
    assert list(tmp_path.iterdir()) == []


class _BranchOnValues(ember.TrainingModule):
    """A forward whose control flow depends on tensor values: torch.export cannot trace it."""

    def __init__(self) -> None:
        super().__init__()
        self.model = nn.Linear(4, 2)
        self.example_input_array = torch.ones(3, 4)

    def forward(self, x: Tensor) -> Tensor:
        y = self.model(x)
        if y.sum() > 0:
            return y
        return -y


@pytest.mark.parametrize(("fmt", "what"), [("torch-export", "torch.export"), ("onnx", "onnx export")])
@pytest.mark.parametrize("dynamic_batch", [True, False])
def test_a_module_the_exporter_cannot_trace_is_one_line_naming_it_and_leaves_no_file(
    tmp_path: Path, fmt: str, what: str, dynamic_batch: bool
) -> None:
    with pytest.raises(ExportError) as info:
        export(_BranchOnValues(), fmt, tmp_path / "m.bin", dynamic_batch=dynamic_batch)
    message = str(info.value)
    assert message.startswith(f"{what} of _BranchOnValues failed") and "\n" not in message
    assert ("(dynamic_batch=False, or --static-batch, exports a fixed batch size)" in message) == dynamic_batch
    # torch.export's own reason, also when the ONNX exporter wraps it, without terminal colour codes
    assert "GuardOnDataDependentSymNode: Could not guard on data-dependent expression" in message
    assert "\x1b" not in message
    assert list(tmp_path.iterdir()) == []


def test_an_unsupported_format_or_method_is_one_clear_error(tmp_path: Path) -> None:
    module = build("mlp")
    with pytest.raises(ExportError) as info:
        export(module, "tflite", tmp_path / "m.tflite")
    assert str(info.value) == (
        "unsupported export format 'tflite'; choose one of onnx, torchscript, torch-export, safetensors, torchserve, hf"
    )
    with pytest.raises(ExportError, match=r"torchscript method 'compile': choose 'script' or 'trace'"):
        module.to_torchscript(tmp_path / "m.pt", method="compile")
    assert list(tmp_path.iterdir()) == []


def test_a_missing_optional_package_says_what_to_install(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(sys.modules, "onnxruntime", None)  # `import onnxruntime` raises ImportError
    with pytest.raises(ExportError) as info:
        build("mlp").to_onnx(tmp_path / "m.onnx")
    message = str(info.value)
    assert message.startswith("checking an ONNX export needs the onnxruntime package, which is not installed")
    assert message.endswith(
        "run: pip install onnx onnxscript onnxruntime safetensors torch-model-archiver  "
        "(or: pip install 'ember[export]')"
    )


def test_a_script_failure_suggests_trace(tmp_path: Path) -> None:
    class Untyped(ember.TrainingModule):
        def __init__(self) -> None:
            super().__init__()
            self.model = nn.Linear(2, 2)

        def forward(self, x: Tensor, *rest: Tensor) -> Tensor:
            return self.model(x)

    with pytest.raises(ExportError, match=r"torch.jit.script of .*Untyped failed: .*; try method='trace'"):
        Untyped().to_torchscript(tmp_path / "m.pt", example_input=torch.zeros(1, 2))


def test_import_ember_and_ember_export_leave_the_export_packages_alone() -> None:
    heavy = ("onnx", "onnxruntime", "onnxscript", "safetensors", "model_archiver", "torch.onnx")
    code = f"import sys, json, ember, ember.export; print(json.dumps([m for m in {heavy!r} if m in sys.modules]))"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert json.loads(out.stdout) == []
