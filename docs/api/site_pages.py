"""Pages the documentation site generates when it builds (an MkDocs hook, see mkdocs.yml).

- ``index.md``: the repository's README.md; ``examples/index.md``: examples/README.md (commands and measured
  results). Links between them and docs/ are rewritten to the site's pages, in docs/ pages too; links to
  source files become their text, since the site does not serve the sources.
- ``api/index.md`` and one page per public package that exists (``api/ember.loggers.md``, ...): a
  mkdocstrings directive for every name in the package's ``__all__``. A package added later (``ember.tuning``)
  gets its page on the next build, without editing anything here.
"""

from __future__ import annotations

import importlib
import importlib.util
import inspect
import posixpath
import re
from pathlib import Path
from typing import Any

#: The public packages, in the order the API reference lists them (those that do not exist are left out).
API_PACKAGES = ("ember", "ember.callbacks", "ember.loggers", "ember.strategies", "ember.tuning", "ember.export")
#: Repository files shown as site pages: (source, page).
COPIED_PAGES = (("README.md", "index.md"), ("examples/README.md", "examples/index.md"))

_LINK = re.compile(r"(!?)\[([^\]]*)\]\(([^)\s]+)\)")
_SCHEME = re.compile(r"^[a-z][a-z0-9+.-]*:", re.IGNORECASE)


# --- API reference -------------------------------------------------------------------------------------------


def existing_packages() -> list[str]:
    """The packages of `API_PACKAGES` this checkout has: a subpackage counts only in the folder its top-level
    package is imported from (an editable install elsewhere can make ``find_spec`` see another checkout's)."""
    found = []
    for name in API_PACKAGES:
        top, *rest = name.split(".")
        try:
            spec = importlib.util.find_spec(top)
        except (ImportError, ValueError):
            continue
        if spec is None or spec.origin is None:
            continue
        folder = Path(spec.origin).parent.joinpath(*rest)
        if (folder / "__init__.py").is_file():
            found.append(name)
    return found


def public_names(package: str) -> list[str]:
    """The package's ``__all__``."""
    return list(importlib.import_module(package).__all__)


def object_path(package: str, name: str) -> str:
    """Where mkdocstrings finds ``package.name``: the defining module of a class or function (packages load
    some of them lazily, which static analysis cannot follow), else the package attribute itself."""
    value = getattr(importlib.import_module(package), name)
    if inspect.isclass(value) or inspect.isfunction(value):
        return f"{value.__module__}.{value.__qualname__}"
    return f"{package}.{name}"


def undocumented_inherited(cls: type, packages: list[str]) -> list[str]:
    """Public methods and properties `cls` inherits from ember classes that have no page of their own (mixins such
    as ``DataHooks`` and ``ManualOptimization``): shown on `cls`'s entry, since they are part of its API."""
    documented = {
        id(getattr(importlib.import_module(p), n)) for p in packages for n in public_names(p) if n != "__version__"
    }
    names: list[str] = []
    for base in cls.__mro__[1:]:
        if not base.__module__.startswith("ember.") or id(base) in documented:
            continue
        names += [n for n in vars(base) if not n.startswith("_") and n not in vars(cls) and n not in names]
    return names


def home_package(path: str, packages: list[str]) -> str:
    """The package whose page documents the object at `path`: the longest package prefix of its module."""
    owners = [p for p in packages if path == p or path.startswith(f"{p}.")]
    return max(owners, key=len)


def page_name(package: str) -> str:
    """The API page of `package`, relative to docs/."""
    return f"api/{package}.md"


def api_page(package: str, packages: list[str]) -> str:
    """Markdown of `package`'s reference page: its docstring, then every public name. A name another package
    documents (``ember.Callback`` is ``ember.callbacks.Callback``) gets a heading and a link there."""
    module = importlib.import_module(package)
    lines = [f"# `{package}`", "", inspect.cleandoc(module.__doc__ or ""), ""]
    for name in public_names(package):
        path = object_path(package, name)
        home = home_package(path, packages)
        if home != package and name in public_names(home):
            link = f"{posixpath.relpath(page_name(home), 'api')}#{path}"
            lines += [f"## `{package}.{name}`", "", f"The same object as [`{home}.{name}`]({link}).", ""]
            continue
        lines += [f"::: {path}", "    options:", f'      heading: "{package}.{name}"', f'      toc_label: "{name}"']
        value = getattr(module, name)
        inherited = undocumented_inherited(value, packages) if inspect.isclass(value) else []
        if inherited:
            lines.append(f"      inherited_members: [{', '.join(inherited)}]")
        lines.append("")
    return "\n".join(lines)


def api_index(packages: list[str]) -> str:
    """Markdown of the API reference's first page: one line per package."""
    lines = ["# API reference", "", "Generated from the docstrings of every name in each package's `__all__`.", ""]
    for package in packages:
        doc = inspect.cleandoc(importlib.import_module(package).__doc__ or "").split("\n\n")[0].replace("\n", " ")
        lines.append(f"- [`{package}`]({posixpath.relpath(page_name(package), 'api')}): {doc}")
    return "\n".join(lines) + "\n"


# --- pages copied from the repository ----------------------------------------------------------------------------


def rewrite_links(text: str, source: str, page: str) -> str:
    """`text` of repository file `source`, with its relative links made valid on the site page `page`."""
    source_dir, page_dir = posixpath.dirname(source), posixpath.dirname(page)
    on_site = {src: dst for src, dst in COPIED_PAGES}

    def replace(match: re.Match[str]) -> str:
        bang, label, target = match.groups()
        if _SCHEME.match(target) or target.startswith("#"):
            return match.group(0)
        path, _, anchor = target.partition("#")
        repo_path = posixpath.normpath(posixpath.join(source_dir, path))
        if repo_path in on_site:
            site_path = on_site[repo_path]
        elif repo_path.startswith("docs/"):
            site_path = repo_path[len("docs/") :]
        else:  # a source file or folder: the site does not serve it
            return label if not bang else f"`{label}`"
        link = posixpath.relpath(site_path, page_dir or ".") + (f"#{anchor}" if anchor else "")
        return f"{bang}[{label}]({link})"

    return _LINK.sub(replace, text)


# --- MkDocs events -------------------------------------------------------------------------------------------------


def on_files(files: Any, config: Any) -> Any:
    """Add the generated pages to the site's files."""
    from mkdocs.structure.files import File

    root = Path(config["config_file_path"]).parent
    for source, page in COPIED_PAGES:
        text = rewrite_links((root / source).read_text(encoding="utf-8"), source, page)
        files.append(File.generated(config, page, content=text))
    packages = existing_packages()
    files.append(File.generated(config, "api/index.md", content=api_index(packages)))
    for package in packages:
        files.append(File.generated(config, page_name(package), content=api_page(package, packages)))
    return files


def on_page_markdown(markdown: str, page: Any, config: Any, files: Any) -> str:
    """Links from a docs/ page to repository files (``../configs/README.md``) become site pages or text."""
    return rewrite_links(markdown, f"docs/{page.file.src_uri}", page.file.src_uri)


def on_config(config: Any) -> Any:
    """List every package page under "API reference" in the navigation (``api/index.md`` in mkdocs.yml)."""
    pages = ["api/index.md", *(page_name(p) for p in existing_packages())]
    for entry in config["nav"] or []:
        if isinstance(entry, dict) and entry.get("API reference") == "api/index.md":
            entry["API reference"] = pages
    return config
