"""The documentation site: ``mkdocs build --strict`` passes, every public name (each package's ``__all__``) is in
the API reference it builds, links from the repository's Markdown files are made valid on the site, a package
added later gets its page, and CI builds the site."""

from __future__ import annotations

import importlib
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO / "docs" / "api"))

import site_pages  # noqa: E402

pytest.importorskip("mkdocs", reason="the docs site needs mkdocs: pip install 'ember[docs]'")
pytest.importorskip("mkdocstrings_handlers.python", reason="the docs site needs mkdocstrings[python]")


@pytest.fixture(scope="module")
def site(tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("site")
    env = dict(os.environ, PYTHONPATH=str(REPO), NO_MKDOCS_2_WARNING="1")
    build = subprocess.run(
        [sys.executable, "-m", "mkdocs", "build", "--strict", "-d", str(out)],
        cwd=REPO,
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert build.returncode == 0, build.stderr[-4000:]
    return out


def headings(html: str) -> set[str]:
    """The first word of every h1-h4 heading's text."""
    found = re.findall(r"<h[1-4][^>]*>(.*?)</h[1-4]>", html, re.S)
    return {re.sub(r"<[^>]+>|&para;|\s+", " ", h).split()[0] for h in found}


@pytest.mark.slow  # 6 s of CPU on a 2-core machine, with the processes it starts
def test_every_public_name_is_in_the_api_reference(site: Path) -> None:
    packages = site_pages.existing_packages()
    assert {"ember", "ember.callbacks", "ember.loggers", "ember.strategies", "ember.export"} <= set(packages)
    pages = {p: (site / "api" / p / "index.html").read_text(encoding="utf-8") for p in packages}
    checked = 0
    for package in packages:
        titles = headings(pages[package])
        for name in importlib.import_module(package).__all__:
            assert f"{package}.{name}" in titles, f"{package}.{name}: no heading on api/{package}/"
            path = site_pages.object_path(package, name)
            home = site_pages.home_package(path, packages)
            documented_on = pages[home] if home != package else pages[package]
            assert f'id="{path}"' in documented_on, f"{package}.{name}: {path} is not documented on api/{home}/"
            if home != package:  # a link to where it is documented
                assert f'href="../{home}/#{path}"' in pages[package], f"{package}.{name}: no link to api/{home}/"
            checked += 1
    assert checked >= 40
    # Methods from base classes without a page of their own (mixins) are documented on the classes that use them.
    for member in ("transfer_batch_to_device", "manual_backward", "toggle_optimizer"):
        assert f'id="ember.modules.module.TrainingModule.{member}"' in pages["ember"], member
    assert 'id="ember.modules.datamodule.DataModule.prepare_data"' in pages["ember"]
    # A public base class documents its own methods: ParallelStrategy's barrier is on its entry, not DDPStrategy's.
    assert 'id="ember.strategies.parallel.ParallelStrategy.barrier"' in pages["ember.strategies"]
    # The documentation is the docstrings': e.g. MLflowLogger's own words appear on its page.
    assert "local SQLite store" in pages["ember.loggers"]
    index = (site / "api" / "index.html").read_text(encoding="utf-8")
    for package in packages:
        assert f'href="{package}/"' in index


@pytest.mark.slow  # builds the site with the test above (module fixture)
def test_readme_and_examples_readme_are_site_pages_with_working_links(site: Path) -> None:
    home = (site / "index.html").read_text(encoding="utf-8")
    assert 'href="module/"' in home and 'href="examples/"' in home  # docs/module.md, examples/README.md
    examples = (site / "examples" / "index.html").read_text(encoding="utf-8")
    assert "Measured" in examples and 'href="../finetuning/"' in examples
    finetuning = (site / "finetuning" / "index.html").read_text(encoding="utf-8")
    assert 'href="../examples/#transfer-learning-and-fine-tuning"' in finetuning  # was ../examples/README.md#...


def test_links_are_rewritten_for_the_site() -> None:
    text = (
        "[guide](docs/module.md) [ex](examples/README.md#gan) [src](ember/cli.py) ![plot](docs/examples/img/a.png) "
        "[web](https://pytorch.org) [here](#usage)"
    )
    assert site_pages.rewrite_links(text, "README.md", "index.md") == (
        "[guide](module.md) [ex](examples/index.md#gan) src ![plot](examples/img/a.png) "
        "[web](https://pytorch.org) [here](#usage)"
    )
    from_examples = "[ft](../docs/finetuning.md) [d](digits.py) ![p](../docs/examples/img/a.png) [r](../README.md)"
    assert site_pages.rewrite_links(from_examples, "examples/README.md", "examples/index.md") == (
        "[ft](../finetuning.md) d ![p](img/a.png) [r](../index.md)"
    )
    assert site_pages.rewrite_links("[c](../configs/README.md)", "docs/cli.md", "cli.md") == "c"


def test_a_package_added_later_gets_its_page(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    package = tmp_path / "fresh_pkg"
    package.mkdir()
    (package / "__init__.py").write_text(
        '"""A package that did not exist when the site was set up."""\n'
        "from fresh_pkg.core import Tuner, tune\n\n"
        '__all__ = ["Tuner", "tune"]\n'
    )
    (package / "core.py").write_text(
        'class Tuner:\n    """Tunes."""\n\n\ndef tune() -> None:\n    """Runs a tuner."""\n'
    )
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.setattr(site_pages, "API_PACKAGES", ("ember", "fresh_pkg", "not_there_pkg"))
    assert site_pages.existing_packages() == ["ember", "fresh_pkg"]
    page = site_pages.api_page("fresh_pkg", ["ember", "fresh_pkg"])
    assert "::: fresh_pkg.core.Tuner" in page and 'heading: "fresh_pkg.Tuner"' in page
    assert "::: fresh_pkg.core.tune" in page
    assert "[`fresh_pkg`](fresh_pkg.md)" in site_pages.api_index(["fresh_pkg"])


def test_ci_builds_the_site_strictly_after_installing() -> None:
    lines = [line.strip() for line in (REPO / ".ci" / "run").read_text().splitlines()]
    install = next(i for i, line in enumerate(lines) if 'pip install -q -e ".[dev]"' in line)
    build = next(
        i
        for i, line in enumerate(lines)
        if line.startswith("mkdocs build --strict") or " mkdocs build --strict" in line
    )
    assert build > install
    assert "mkdocs" in (REPO / "README.md").read_text() and "mkdocs serve" in (REPO / "README.md").read_text()


def test_ci_runs_the_readmes_test_command() -> None:
    """The checks after the README's install line are CI's last line, in the same order."""
    readme = (REPO / "README.md").read_text().splitlines()
    comment = next(i for i, line in enumerate(readme) if line.startswith("# install and pass the tests (lint, "))
    install = readme[comment + 1]
    ci = [line for line in (REPO / ".ci" / "run").read_text().splitlines() if line.strip()][-1]
    readme_checks = [step.strip() for step in install.split(" && ") if not step.strip().startswith("pip install")]
    ci_checks = [step.strip().replace("python3 ", "python ") for step in ci.split(" && ")]
    assert readme_checks == ci_checks == ["ruff check .", "ruff format --check .", "mypy", "python -m pytest"]
