"""The commit protocol on object storage, where there is no rename: a checkpoint exists once its manifest does.

A checkpoint ``<folder>/<name>`` on a store is committed in this order (docs/checkpoints.md):

1. every file of the checkpoint is uploaded (each PUT is atomic per object, in any order);
2. ``<name>/manifest.json`` is written last: every file's name, size and SHA-256;
3. ``<folder>/last``, a small pointer object holding ``<name>``, is written after the manifest.

A reader trusts only a checkpoint whose manifest parses and whose every listed file is there with the
listed size (`committed`); a download checks each file's checksum against the manifest (`download`).
A writer killed at any byte therefore leaves either no manifest (the upload is ignored and removed by the
next eviction or by hand) or a complete checkpoint; ``last`` names the previous committed one until the
new manifest exists. Eviction removes the manifest first (`remove`), so a kill in the middle of a delete
leaves files that no reader takes for a checkpoint.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import re
import shutil
import warnings
from pathlib import Path
from typing import Any

try:
    import fcntl
except ImportError:  # not POSIX: folders of killed processes are not swept
    fcntl = None  # type: ignore[assignment]

from ember.checkpoint.format import DAMAGED, LAST_FILE, CheckpointError
from ember.checkpoint.store import basename, join, redact

MANIFEST_FILE = "manifest.json"
_MANIFEST_VERSION = 1
#: The largest manifest or pointer read (a manifest lists a few files per process).
_MANIFEST_BYTES = 1 << 20
_POINTER_BYTES = 4096
_CHUNK = 1 << 20
_NAME = re.compile(r"[A-Za-z0-9_.=+-]+")


def _check_name(name: object, what: str) -> str:
    """A file name a manifest may list: relative, plain parts, no ``..``; else the manifest is damaged."""
    parts = name.split("/") if isinstance(name, str) else [""]
    if not all(_NAME.fullmatch(p) and p not in (".", "..") for p in parts) or name == MANIFEST_FILE:
        raise CheckpointError(f"{what}: manifest lists {str(name)[:80]!r}, not a file of the checkpoint; {DAMAGED}")
    return str(name)


def _sha256_of(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(_CHUNK):
            digest.update(chunk)
    return digest.hexdigest()


def local_files(directory: Path) -> list[str]:
    """The files under `directory`, as sorted ``/``-separated relative names."""
    return sorted(p.relative_to(directory).as_posix() for p in directory.rglob("*") if p.is_file())


def upload(fs: Any, local: Path, remote: str, global_step: int | None) -> dict[str, Any]:
    """Commit the checkpoint directory `local` at `remote` on `fs`: every file, then the manifest; returns
    the manifest. Until the manifest is written, nothing at `remote` counts as a checkpoint; a manifest
    already there (a checkpoint of the same name, written again after a resume) is removed first, so no
    reader trusts the old manifest while its files are replaced."""
    names = local_files(local)
    if not names:
        raise FileNotFoundError(f"checkpoint {local} has no files to upload (it was deleted before its upload)")
    return write_manifest(fs, remote, upload_files(fs, local, remote, names), global_step)


def upload_files(fs: Any, local: Path, remote: str, names: list[str]) -> list[dict[str, Any]]:
    """Upload the files `names` of checkpoint directory `local` to `remote`, after removing a manifest already
    there (no reader may trust it while its files are replaced); returns their manifest entries (name, size,
    SHA-256). Nothing at `remote` is committed by this: `write_manifest` does that."""
    with contextlib.suppress(FileNotFoundError):
        fs.rm_file(join(remote, MANIFEST_FILE))
    files = []
    for name in names:
        source = local / name
        files.append({"name": name, "size": source.stat().st_size, "sha256": _sha256_of(source)})
        fs.put_file(str(source), join(remote, name))
    return files


def write_manifest(fs: Any, remote: str, files: list[dict[str, Any]], global_step: int | None) -> dict[str, Any]:
    """Commit checkpoint `remote`: write its manifest listing `files` (every file already uploaded); returns it."""
    entries = sorted(files, key=lambda entry: str(entry["name"]))
    manifest = {"ember_manifest": _MANIFEST_VERSION, "global_step": global_step, "files": entries}
    fs.pipe_file(join(remote, MANIFEST_FILE), json.dumps(manifest, indent=1).encode("utf-8"))
    return manifest


_RANK_FILE = re.compile(r"(?:__(\d+)_\d+\.distcp|rank-(\d+)\.pt)")


def writer_rank(name: str) -> int:
    """The process that writes file `name` of a checkpoint: N for DCP's ``__N_<i>.distcp`` shards and ember's
    ``rank-N.pt``; 0 for everything else (``ember.pt``, DCP's ``.metadata``)."""
    match = _RANK_FILE.fullmatch(name)
    return int(match.group(1) or match.group(2)) if match else 0


def _read_small(fs: Any, path: str, limit: int, what: str) -> bytes | None:
    """The bytes of object `path` (None when absent), refused above `limit` bytes before reading."""
    try:
        size = fs.size(path)
    except FileNotFoundError:
        return None
    if size is None or size > limit:
        raise CheckpointError(
            f"{what}: {basename(path)} is {size} bytes, more than it can justify ({limit}); {DAMAGED}"
        )
    try:
        data: bytes = fs.cat_file(path)
    except FileNotFoundError:
        return None
    return data


def read_manifest(fs: Any, remote: str, url: str) -> dict[str, Any] | None:
    """The manifest of checkpoint `remote` (None when there is none yet: not a checkpoint), checked: every
    entry a plain relative name, an int size and a hex SHA-256. `url` names it in errors."""
    data = _read_small(fs, join(remote, MANIFEST_FILE), _MANIFEST_BYTES, f"checkpoint {url}")
    if data is None:
        return None
    try:
        manifest = json.loads(data.decode("utf-8"))
    except (UnicodeDecodeError, ValueError):
        raise CheckpointError(f"checkpoint {url}: {MANIFEST_FILE} is not JSON; {DAMAGED}") from None
    if not isinstance(manifest, dict) or manifest.get("ember_manifest") != _MANIFEST_VERSION:
        raise CheckpointError(f"checkpoint {url}: {MANIFEST_FILE} is not an ember manifest (version 1)")
    files = manifest.get("files")
    if not isinstance(files, list) or not files:
        raise CheckpointError(f"checkpoint {url}: {MANIFEST_FILE} lists no files; {DAMAGED}")
    for entry in files:
        if not isinstance(entry, dict):
            raise CheckpointError(f"checkpoint {url}: {MANIFEST_FILE} has an entry that is not an object; {DAMAGED}")
        _check_name(entry.get("name"), f"checkpoint {url}")
        size, digest = entry.get("size"), entry.get("sha256")
        if isinstance(size, bool) or not isinstance(size, int) or size < 0:
            raise CheckpointError(f"checkpoint {url}: manifest size of {entry['name']} is {size!r}; {DAMAGED}")
        if not isinstance(digest, str) or not re.fullmatch(r"[0-9a-f]{64}", digest):
            raise CheckpointError(f"checkpoint {url}: manifest checksum of {entry['name']} is malformed; {DAMAGED}")
    return manifest


def committed(fs: Any, remote: str, url: str) -> dict[str, Any] | None:
    """The manifest of `remote` when it is a committed checkpoint (a valid manifest that lists every file of the
    folder, each present with its listed size); None when there is no manifest; a `CheckpointError` saying what is wrong
    when the files do not match it."""
    manifest = read_manifest(fs, remote, url)
    if manifest is None:
        return None
    present = {}
    for info in fs.find(remote, detail=True).values():
        name = str(info["name"])[len(remote.rstrip("/")) + 1 :]
        present[name] = info.get("size")
    listed = {entry["name"] for entry in manifest["files"]}
    unlisted = sorted(name for name in present if name not in listed and name != MANIFEST_FILE)
    if unlisted:  # the manifest is written last and names every file: one that leaves a file out is not ember's
        raise CheckpointError(
            f"checkpoint {url}: {unlisted[0]} is not in its {MANIFEST_FILE} ({len(unlisted)} file(s) unlisted); "
            f"{DAMAGED}"
        )
    for entry in manifest["files"]:
        if entry["name"] not in present:
            raise CheckpointError(f"checkpoint {url} is incomplete: {entry['name']} is missing")
        if present[entry["name"]] != entry["size"]:
            raise CheckpointError(
                f"checkpoint {url}: {entry['name']} is {present[entry['name']]} bytes, its manifest says "
                f"{entry['size']}; {DAMAGED}"
            )
    return manifest


def download(fs: Any, remote: str, url: str, manifest: dict[str, Any], local: Path) -> None:
    """Copy committed checkpoint `remote` into the new directory `local`, each file checked against its
    manifest size and checksum; a mismatch is a `CheckpointError` and leaves no `local`."""
    tmp = local.with_name(f".{local.name}.download")
    try:
        tmp.mkdir(parents=True)
        for entry in manifest["files"]:
            target = tmp / entry["name"]
            target.parent.mkdir(parents=True, exist_ok=True)
            fs.get_file(join(remote, entry["name"]), str(target))
            if target.stat().st_size != entry["size"] or _sha256_of(target) != entry["sha256"]:
                raise CheckpointError(
                    f"checkpoint {url}: {entry['name']} does not match its manifest's size and checksum; {DAMAGED}"
                )
        tmp.rename(local)
    finally:
        if tmp.exists():
            shutil.rmtree(tmp, ignore_errors=True)


def point_last(fs: Any, folder: str, name: str) -> None:
    """Write ``<folder>/last`` naming checkpoint `name` (call only once its manifest is written)."""
    fs.pipe_file(join(folder, LAST_FILE), (name + "\n").encode("utf-8"))


def read_last(fs: Any, folder: str, url: str) -> str | None:
    """The checkpoint name ``<folder>/last`` holds (None when there is no pointer)."""
    data = _read_small(fs, join(folder, LAST_FILE), _POINTER_BYTES, f"checkpoint folder {url}")
    if data is None:
        return None
    try:
        name = data.decode("utf-8").strip()
    except UnicodeDecodeError:
        raise CheckpointError(f"checkpoint pointer {url}/{LAST_FILE} is not text; {DAMAGED}") from None
    if not _NAME.fullmatch(name) or name in (".", ".."):
        raise CheckpointError(f"checkpoint pointer {url}/{LAST_FILE} names {name[:80]!r}; {DAMAGED}")
    return name


def remove(fs: Any, remote: str) -> None:
    """Delete checkpoint `remote`: its manifest first (from then on no reader trusts it), then its files."""
    with contextlib.suppress(FileNotFoundError):
        fs.rm_file(join(remote, MANIFEST_FILE))
    with contextlib.suppress(FileNotFoundError):
        fs.rm(remote, recursive=True)


def newest(fs: Any, folder: str, url: str) -> tuple[str, dict[str, Any]] | None:
    """(name, manifest) of the checkpoint ``<folder>/last`` names when it is committed, else of the committed
    checkpoint in `folder` with the highest step; None when there is none. Each one passed over is named
    in a warning."""
    try:
        named = read_last(fs, folder, url)
    except CheckpointError as exc:
        warnings.warn(f"skipping checkpoint: {exc}", RuntimeWarning, stacklevel=2)
        named = None
    if named is not None:
        found = _committed_or_warn(fs, join(folder, named), join(url, named))
        if found is not None:
            return named, found
        warnings.warn(
            f"skipping checkpoint {join(url, named)}: {LAST_FILE} names it but it is not committed (no manifest)",
            RuntimeWarning,
            stacklevel=2,
        )
    by_step = []
    try:
        entries = fs.ls(folder, detail=True)
    except FileNotFoundError:
        entries = []
    for info in entries:
        name = basename(str(info["name"]))
        if info.get("type") != "directory" or name == named or not _NAME.fullmatch(name):
            continue
        found = _committed_or_warn(fs, join(folder, name), join(url, name))
        if found is not None:
            step = found.get("global_step")
            by_step.append((step if isinstance(step, int) else -1, name, found))
    if not by_step:
        return None
    _, name, found = max(by_step, key=lambda entry: (entry[0], entry[1]))
    return name, found


def _committed_or_warn(fs: Any, remote: str, url: str) -> dict[str, Any] | None:
    try:
        return committed(fs, remote, url)
    except CheckpointError as exc:
        warnings.warn(f"skipping checkpoint: {exc}", RuntimeWarning, stacklevel=3)
        return None


def fetch(url: str, fs: Any, remote: str, cache: Path) -> Path:
    """Download the checkpoint `url` names into `cache`; returns the local checkpoint directory.

    `url` is a committed checkpoint (it has a manifest), a ``last`` pointer object, or a folder of
    checkpoints (its newest committed one, `newest`). Anything else is a `CheckpointError`.
    """
    shown = redact(url)
    if basename(remote) == LAST_FILE:  # the checkpoint it names, else (warning) the folder's newest
        remote, shown = remote.rstrip("/").rsplit("/", 1)[0], shown.rstrip("/").rsplit("/", 1)[0]
    manifest = committed(fs, remote, shown)
    if manifest is None:
        found = newest(fs, remote, shown)
        if found is None:
            raise CheckpointError(
                f"no committed checkpoint at {shown} (a checkpoint on a store counts once its {MANIFEST_FILE} is "
                "written); give a checkpoint's URL, its folder's 'last', or a folder of checkpoints"
            )
        remote, shown, manifest = join(remote, found[0]), join(shown, found[0]), found[1]
    local = cache / basename(remote)
    download(fs, remote, shown, manifest, local)
    return local


#: The folders this process downloaded checkpoints into, with the descriptor of each one's held `_HELD` file.
_fetched: list[tuple[Path, int]] = []
#: A fetched checkpoint's folder in the temporary directory is ``ember-ckpt-<random>``, and holds `_HELD`.
_PREFIX = "ember-ckpt-"
#: Locked (``flock``) by the process that fetched into the folder for as long as it lives: the kernel lets go of
#: a dead process's locks, so a folder whose `_HELD` can be locked was left by a process killed before its exit
#: hook removed it.
_HELD = ".held"


def fetch_checkpoint(url: str, what: str = "ckpt_path") -> Path:
    """The checkpoint `url` names (see `fetch`), downloaded into a temporary folder of this process that is
    removed at exit; returns its local directory. The folders of processes that were killed before they could
    remove theirs (SIGKILL, an OOM kill) are removed first."""
    import tempfile

    from ember.checkpoint.store import open_store

    fs, remote = open_store(url, what)
    _remove_abandoned(Path(tempfile.gettempdir()))
    cache = _held_folder(Path(tempfile.mkdtemp(prefix=_PREFIX)))
    try:
        return fetch(url, fs, remote, cache)
    except CheckpointError:
        raise
    except OSError as exc:  # the store could not be reached or refused access
        raise CheckpointError(f"{what}={redact(url)}: cannot read it ({type(exc).__name__}: {exc})") from None


def _held_folder(cache: Path) -> Path:
    """Hold `cache` for this process (its `_HELD` file locked until the process ends); removed at exit."""
    import atexit

    if not _fetched:
        atexit.register(_remove_fetched)
    staging = cache / f"{_HELD}.tmp"
    descriptor = os.open(staging, os.O_RDWR | os.O_CREAT, 0o600)
    _fetched.append((cache, descriptor))
    if fcntl is not None:
        fcntl.flock(descriptor, fcntl.LOCK_EX)
    os.rename(staging, cache / _HELD)  # in view only once locked: a sweep never takes a lock about to be held
    return cache


def _remove_abandoned(root: Path) -> None:
    """Remove the fetched-checkpoint folders in `root` whose process is gone. A folder without `_HELD` (being set
    up) or that this process may not open (another user's) is left alone."""
    if fcntl is None:
        return
    for folder in root.glob(f"{_PREFIX}*"):
        try:
            descriptor = os.open(folder / _HELD, os.O_RDWR)
        except OSError:
            continue
        try:
            fcntl.flock(descriptor, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError:  # held: its process is alive
            os.close(descriptor)
            continue
        try:
            shutil.rmtree(folder, ignore_errors=True)
        finally:
            os.close(descriptor)


def _remove_fetched() -> None:
    for cache, descriptor in _fetched:
        shutil.rmtree(cache, ignore_errors=True)
        os.close(descriptor)
    _fetched.clear()
