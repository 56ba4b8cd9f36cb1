"""LightningModules in the shape of real public ones, ported by `ember port` and trained by Lightning and ember.

Each corpus file (``lit_*.py`` beside this one) is Lightning code: its ``main`` trains as the public script it
follows does. The test trains it with ``lightning.Trainer``, ports the file with `ember.port.port_source`,
imports the port and trains it with ``ember.Trainer`` (same options; ``lightning_rng=True`` once ember has that
switch), then compares per-step losses and final parameters (bitwise), ``callback_metrics`` when each fit ends
and at the end (within `real_harness.METRICS_TOL`), test/validate results, predictions and reloaded checkpoints.
The modules that ship in the installed ``lightning.pytorch.demos`` are ported from their installed source
and trained the same way.

A module blocked by ember gaps is marked ``xfail(strict=True)`` with those gaps as the reason: it fails while a
gap is open and turns into a failure (XPASS) once they are all closed, so the lists below stay exact. Every
module's result goes to ``real_modules.json`` in pytest's base temporary folder (and to ``$EMBER_COMPAT_RESULTS``
when set); ``python tests/compat/real/real_harness.py real_modules.json`` prints the table the docs show.
"""

from __future__ import annotations

import functools
import os
import re
import types
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import torch
from real_harness import (
    Record,
    compare,
    ember_trainer_options,
    import_path,
    port_module,
    run_main,
    table,
    write_results,
)

import ember

pl = pytest.importorskip("lightning.pytorch", reason="tests/compat compares ember with Lightning; install it")

HERE = Path(__file__).resolve().parent

# Lightning's advice on workers and logging, and its own use of deprecated torch names.
pytestmark = [pytest.mark.filterwarnings("ignore::UserWarning"), pytest.mark.filterwarnings("ignore::FutureWarning")]

#: The ember gaps the corpus still runs into, by short name (the docs table shows the names). A gap closed in the
#: library leaves this table, and the modules it blocked lose their xfail (strict: a fixed gap fails here).
GAPS: dict[str, str] = {}


def _xfail(gaps: tuple[str, ...]) -> list[Any]:
    """``xfail(strict=True)`` naming the gaps, or nothing when there are none."""
    if not gaps:
        return []
    return [pytest.mark.xfail(strict=True, reason="; ".join(f"{g}: {GAPS[g]}" for g in gaps))]


@dataclass(frozen=True)
class Case:
    """A corpus module: its file stem, the public module whose idioms it follows, and the ember gaps it hits."""

    name: str
    follows: str
    gaps: tuple[str, ...] = ()
    left: tuple[str, ...] = ()  # Lightning names the port is expected to leave (ember has none by design)

    def param(self) -> Any:
        return pytest.param(self, id=self.name, marks=_xfail(self.gaps))


LIGHTNING_EXAMPLES = "Lightning-AI/pytorch-lightning examples/pytorch/"
CORPUS = [
    Case("lit_gan", LIGHTNING_EXAMPLES + "domain_templates/generative_adversarial_net.py", ()),
    Case(
        "lit_finetune",
        LIGHTNING_EXAMPLES + "domain_templates/computer_vision_fine_tuning.py",
        (),
    ),
    Case("lit_dqn", LIGHTNING_EXAMPLES + "domain_templates/reinforce_learn_Qnet.py", ()),
    Case(
        "lit_ppo",
        LIGHTNING_EXAMPLES + "domain_templates/reinforce_learn_ppo.py",
        (),
    ),
    Case(
        "lit_imagenet",
        LIGHTNING_EXAMPLES + "domain_templates/imagenet.py",
        (),
    ),
    Case(
        "lit_autoencoder",
        LIGHTNING_EXAMPLES + "basics/autoencoder.py",
        (),
    ),
    Case(
        "lit_backbone",
        LIGHTNING_EXAMPLES + "basics/backbone_image_classifier.py",
        (),
    ),
    Case(
        "lit_hydra_mnist",
        "ashleve/lightning-hydra-template src/models/mnist_module.py, src/data/mnist_datamodule.py, src/train.py",
        (),
    ),
    Case(
        "lit_simclr",
        "Lightning-Universe/lightning-bolts src/pl_bolts/models/self_supervised/simclr/simclr_module.py",
        (),
    ),
    Case(
        "lit_regression",
        "Lightning-Universe/lightning-bolts src/pl_bolts/models/regression/linear_regression.py",
        (),
    ),
    Case(
        "lit_vae",
        "Lightning-Universe/lightning-bolts src/pl_bolts/models/autoencoders/basic_vae/basic_vae_module.py",
        (),
    ),
    Case(
        "lit_glue",
        "Lightning-AI/tutorials lightning_examples/text-transformers/text-transformers.py",
        (),
    ),
]


# --- the modules that ship in lightning.pytorch.demos -------------------------------------------------------------
def _demos_dir() -> Path:
    import lightning.pytorch.demos

    return Path(lightning.pytorch.demos.__file__).parent


def _trainer(fw: Any, root_dir: str, callbacks: Any, options: dict[str, Any], **own: Any) -> Any:
    return fw.Trainer(
        accelerator="cpu", devices=1, default_root_dir=root_dir, logger=False, enable_checkpointing=False,
        callbacks=list(callbacks), **own, **options,
    )  # fmt: skip


def demo_boring(mod: Any, fw: Any, root_dir: str, callbacks: Any = (), **options: Any) -> dict[str, Any]:
    """BoringModel with its own dataloaders: fit, test, predict (as Lightning's bug-report template does)."""
    fw.seed_everything(42)
    model = mod.BoringModel()
    trainer = _trainer(fw, root_dir, callbacks, options, max_epochs=2, limit_train_batches=8, limit_val_batches=4)
    trainer.fit(model)
    results = trainer.test(model)
    return {"trainer": trainer, "model": model, "test": results, "predict": trainer.predict(model)}


def demo_boring_datamodule(mod: Any, fw: Any, root_dir: str, callbacks: Any = (), **options: Any) -> dict[str, Any]:
    """BoringModel on BoringDataModule (setup(stage) makes the splits)."""
    fw.seed_everything(42)
    model, dm = mod.BoringModel(), mod.BoringDataModule()
    trainer = _trainer(fw, root_dir, callbacks, options, max_epochs=2, limit_train_batches=8, limit_val_batches=4)
    trainer.fit(model, datamodule=dm)
    return {"trainer": trainer, "model": model}


def demo_manual(mod: Any, fw: Any, root_dir: str, callbacks: Any = (), **options: Any) -> dict[str, Any]:
    """ManualOptimBoringModel: one optimizer stepped by hand."""
    fw.seed_everything(42)
    model = mod.ManualOptimBoringModel()
    trainer = _trainer(fw, root_dir, callbacks, options, max_epochs=1, limit_train_batches=8, limit_val_batches=0)
    trainer.fit(model)
    return {"trainer": trainer, "model": model}


def demo_model(mod: Any, fw: Any, root_dir: str, callbacks: Any = (), **options: Any) -> dict[str, Any]:
    """DemoModel (``training_step(batch, batch_nb)``) on RandomDataset batches."""
    fw.seed_everything(42)
    model = mod.DemoModel()
    loader = torch.utils.data.DataLoader(mod.RandomDataset(32, 64), batch_size=8)
    trainer = _trainer(fw, root_dir, callbacks, options, max_epochs=2)
    trainer.fit(model, loader)
    return {"trainer": trainer, "model": model}


def _wikitext(root_dir: str) -> None:
    """A small text in ./data/wikitext-2.txt: WikiText2 finds it there and downloads nothing."""
    words = [f"w{i}" for i in range(40)]
    g = torch.Generator().manual_seed(0)
    lines = [" ".join(words[int(i)] for i in torch.randint(0, len(words), (12,), generator=g)) for _ in range(120)]
    Path("data").mkdir(exist_ok=True)
    Path("data/wikitext-2.txt").write_text("\n".join(lines) + "\n")


def demo_transformer(mod: Any, fw: Any, root_dir: str, callbacks: Any = (), **options: Any) -> dict[str, Any]:
    """LightningTransformer on WikiText2 (a local text), its Transformer made tiny."""
    _wikitext(root_dir)
    fw.seed_everything(42)
    vocab = mod.WikiText2().vocab_size
    model = mod.LightningTransformer(vocab_size=vocab)
    model.model = mod.Transformer(vocab_size=vocab, ninp=32, nhead=2, nhid=32, nlayers=1)  # tiny, for CPU time
    trainer = _trainer(fw, root_dir, callbacks, options, max_epochs=1, limit_train_batches=4)
    trainer.fit(model)
    return {"trainer": trainer, "model": model}


def demo_lstm(mod: Any, fw: Any, root_dir: str, callbacks: Any = (), **options: Any) -> dict[str, Any]:
    """LightningLSTM on WikiText2 (a local text), its hidden state carried across batches; its LSTM made tiny."""
    _wikitext(root_dir)
    fw.seed_everything(42)
    vocab = mod.WikiText2().vocab_size
    model = mod.LightningLSTM(vocab_size=vocab)
    model.model = mod.SimpleLSTM(vocab_size=vocab, ninp=32, nhid=32, nlayers=2)  # tiny, for CPU time
    trainer = _trainer(fw, root_dir, callbacks, options, max_epochs=2, limit_train_batches=3)
    trainer.fit(model)
    return {"trainer": trainer, "model": model}


@dataclass(frozen=True)
class DemoCase:
    """A module of ``lightning.pytorch.demos``: the file, the class trained, how, and the gaps it hits."""

    name: str
    file: str
    driver: Callable[..., dict[str, Any]]
    gaps: tuple[str, ...] = ()
    left: tuple[str, ...] = ()  # Lightning names the port is expected to leave (Lightning's own helpers)

    def param(self) -> Any:
        return pytest.param(self, id=self.name, marks=_xfail(self.gaps))


#: What boring_classes.py imports from Lightning's own helpers (a type alias, lightning_utilities).
BORING_LEFT = ("lightning_utilities.apply_to_collection", "lightning.pytorch.utilities.types.STEP_OUTPUT")
DEMOS = [
    DemoCase("BoringModel", "boring_classes.py", demo_boring, (), BORING_LEFT),
    DemoCase("BoringDataModule", "boring_classes.py", demo_boring_datamodule, (), BORING_LEFT),
    DemoCase("ManualOptimBoringModel", "boring_classes.py", demo_manual, (), BORING_LEFT),
    DemoCase("DemoModel", "boring_classes.py", demo_model, (), BORING_LEFT),
    DemoCase(
        "LightningTransformer",
        "transformer.py",
        demo_transformer,
        (),
        ("lightning_utilities.core.imports.RequirementCache",),
    ),
    DemoCase("LightningLSTM", "lstm.py", demo_lstm, (), ("lightning.pytorch.demos.transformer.WikiText2",)),
]

#: Every demo file is ported; these are not trained here (and why).
DEMO_FILES_NOT_TRAINED = {"mnist_datamodule.py": "MNISTDataModule downloads MNIST"}


# --- the records ----------------------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def records(tmp_path_factory: pytest.TempPathFactory) -> Iterator[list[Record]]:
    """Every module's `Record`, written to real_modules.json when the module's tests end."""
    collected: list[Record] = []
    yield collected
    targets = [tmp_path_factory.getbasetemp() / "real_modules.json"]
    if os.environ.get("EMBER_COMPAT_RESULTS"):
        targets.append(Path(os.environ["EMBER_COMPAT_RESULTS"]))
    for target in targets:
        write_results(collected, target)


def _both(name: str, follows: str, gaps: tuple[str, ...], lightning_mod: Any, source: Path, tmp_path: Path,
          main: Callable[[Any, Any], Any] | None = None) -> Record:  # fmt: skip
    """Train the Lightning module, port `source`, train the port; the comparison's record."""
    ported, unmapped = port_module(source, tmp_path / "ported", f"ported_{name}")
    if main is not None:  # a demo: the driver gets the module namespace and the framework
        lightning_mod = types.SimpleNamespace(main=functools.partial(main, lightning_mod, pl))
        ported = types.SimpleNamespace(main=functools.partial(main, ported, ember))
    theirs = run_main(lightning_mod, "lightning", pl.Callback, tmp_path / "lightning")
    mine = run_main(ported, "ember", ember.Callback, tmp_path / "ember", **ember_trainer_options())
    return compare(name, follows, unmapped, gaps, mine, theirs)


def assert_as_expected(record: Record, left: tuple[str, ...]) -> None:
    """Ran, matched Lightning, and the port left exactly the names `left` (with advice) for a hand edit."""
    assert [u.split(": ")[1] for u in record.unmapped] == list(left), record.describe()
    assert record.ran and not record.differences, record.describe()


@pytest.mark.slow
@pytest.mark.parametrize("case", [c.param() for c in CORPUS])
def test_corpus_module_ports_and_trains_like_lightning(case: Case, tmp_path: Path, records: list[Record]) -> None:
    source = HERE / f"{case.name}.py"
    original = import_path(source, f"lightning_{case.name}")
    record = _both(case.name, case.follows, case.gaps, original, source, tmp_path)
    records.append(record)
    assert_as_expected(record, case.left)


@pytest.mark.slow
@pytest.mark.parametrize("case", [c.param() for c in DEMOS])
def test_installed_demo_ports_and_trains_like_lightning(case: DemoCase, tmp_path: Path, records: list[Record]) -> None:
    import importlib

    source = _demos_dir() / case.file
    original = importlib.import_module(f"lightning.pytorch.demos.{source.stem}")
    follows = f"installed lightning.pytorch.demos/{case.file} ({case.name})"
    record = _both(f"demos.{case.name}", follows, case.gaps, original, source, tmp_path, main=case.driver)
    records.append(record)
    assert_as_expected(record, case.left)


@pytest.mark.slow
@pytest.mark.parametrize("file", sorted(DEMO_FILES_NOT_TRAINED))
def test_installed_demo_that_downloads_ports_and_imports(file: str, tmp_path: Path) -> None:
    ported, unmapped = port_module(_demos_dir() / file, tmp_path, f"ported_{Path(file).stem}")
    assert issubclass(ported.MNISTDataModule, ember.DataModule)
    assert all("lightning" in note for note in unmapped), unmapped  # only Lightning's own helpers stay imported


# --- fast checks of the corpus itself ------------------------------------------------------------------------------
def test_every_corpus_file_is_a_case_and_names_the_module_it_follows() -> None:
    files = sorted(p.stem for p in HERE.glob("lit_*.py"))
    assert files == sorted(c.name for c in CORPUS)
    assert len(files) >= 12
    for case in CORPUS:
        header = (HERE / f"{case.name}.py").read_text().split('"""')[1]
        assert "Follows the idioms of" in header, case.name
        repo, path = case.follows.split(" ", 1)
        assert repo in " ".join(header.split()), (case.name, repo)
        first_path = re.split(r"[ ,]", path)[0]
        assert first_path.split("/")[-1] in header, (case.name, first_path)


def test_the_corpus_imports_lightning_only() -> None:
    """The corpus is Lightning code: ember comes in through `ember port`, never by hand."""
    for path in HERE.glob("lit_*.py"):
        assert not re.search(r"^\s*(import|from)\s+ember\b", path.read_text(), re.MULTILINE), path.name


def test_every_gap_named_is_defined_and_every_gap_defined_is_hit() -> None:
    named = {g for case in [*CORPUS, *DEMOS] for g in case.gaps}
    assert named == set(GAPS)


def test_the_results_table_lists_each_record_and_its_gaps() -> None:
    legend = {"some_gap": "what ember lacks", "unused_gap": "not hit by any record"}
    record = Record("lit_x", "a/b c.py", ["12: lightning.pytorch.X: advice"], True, False, ["loss of batch 3"],
                    ["some_gap"])  # fmt: skip
    rows = [{**record.__dict__, "ported_clean": record.ported_clean, "ok": record.ok}]
    text = table(rows, legend)
    assert "| `lit_x` | a/b c.py | no (1 name) | yes | no | `some_gap`; loss of batch 3 |" in text
    assert "- `some_gap`: what ember lacks" in text and "unused_gap" not in text
