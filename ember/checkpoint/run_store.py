"""A run directory on object storage: ``default_root_dir`` given as a URL (``s3://bucket/runs``).

A store has no folders to write into as a run goes, so a run whose root is a URL lives in a local staging
folder, `staging_dir` (``$EMBER_CACHE/runs/<hash of the URL>``, else ``~/.cache/ember/runs/<hash>``), laid out
as usual (``<run name>/version_N/``), and the store holds its copy at ``<URL>/<run name>/version_N/``:

- checkpoints go through `ember.checkpoint.mirror` (files, then the manifest, then ``last``; see
  docs/checkpoints.md): the default ``ModelCheckpoint`` uploads to ``<run URL>/checkpoints``;
- everything else in the run directory (``metrics.csv``, TensorBoard event files, ``hparams.yaml``,
  ``config.yaml``, ``status.json``, evaluation results) is copied by `LogSync` on a thread of its own every
  ``EMBER_SYNC_EVERY_S`` seconds (30 by default) and once more when the run ends, preempted or not.

Version numbers come from the store: `claim_version` takes one past the highest ``version_N`` the store
and the staging folder know, and claims it by creating ``version_N/claim.json`` with a conditional write
(S3's ``If-None-Match: *`` through s3fs, an exclusive create on ``memory://``): of two runs that pick the
same number at the same moment, one gets ``FileExistsError`` and takes the next. A store whose fsspec
client cannot write conditionally falls back to "check, then write": two runs starting within the same
instant could then share a version (docs/checkpoints.md says so).
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import sys
import threading
import time
from dataclasses import asdict
from pathlib import Path
from typing import Any

from ember.checkpoint import manifest, run_status
from ember.checkpoint.format import CheckpointError
from ember.checkpoint.locating import CHECKPOINT_SUBDIR, NewestRunHasNoCheckpoint
from ember.checkpoint.run_lock import Holder
from ember.checkpoint.store import join, open_store, redact

CACHE_ENV = "EMBER_CACHE"
SYNC_ENV = "EMBER_SYNC_EVERY_S"
DEFAULT_SYNC_EVERY_S = 30.0
CLAIM_FILE = "claim.json"
_VERSION = re.compile(r"version_(\d+)")


def staging_dir(url: str) -> Path:
    """The local folder that stages the runs of root `url`: ``$EMBER_CACHE/runs/<hash>`` (or
    ``~/.cache/ember/runs/<hash>``), the hash being the first 16 hex digits of the URL's SHA-256."""
    cache = os.environ.get(CACHE_ENV)
    base = Path(cache) if cache else Path.home() / ".cache" / "ember"
    return base / "runs" / hashlib.sha256(url.rstrip("/").encode("utf-8")).hexdigest()[:16]


def sync_every_s() -> float:
    """Seconds between two log syncs (``EMBER_SYNC_EVERY_S``, default 30); a bad value is an error that says so."""
    raw = os.environ.get(SYNC_ENV)
    if raw is None:
        return DEFAULT_SYNC_EVERY_S
    try:
        value = float(raw)
    except ValueError:
        value = -1.0
    if not value > 0:
        raise ValueError(f"{SYNC_ENV}={raw!r} must be a number of seconds > 0 (default {DEFAULT_SYNC_EVERY_S:g})")
    return value


def _numbers(names: list[str]) -> list[int]:
    return [int(m.group(1)) for name in names if (m := _VERSION.fullmatch(name))]


def store_versions(fs: Any, root: str) -> list[int]:
    """The ``version_N`` numbers under `root` on the store, highest first."""
    try:
        entries = fs.ls(root, detail=False, refresh=True) if _takes_refresh(fs) else fs.ls(root, detail=False)
    except FileNotFoundError:
        return []
    return sorted(_numbers([str(e).rstrip("/").rsplit("/", 1)[-1] for e in entries]), reverse=True)


def _takes_refresh(fs: Any) -> bool:
    return bool(getattr(fs, "async_impl", False))  # s3fs, gcsfs: listings are cached unless refreshed


def claim_version(url_root: str, local_root: Path) -> tuple[Path, str]:
    """Claim a new ``version_N`` of the run whose store folder is `url_root` (``<root URL>/<run name>``) and
    whose staging folder is `local_root`; returns (the local run directory, made; its URL)."""
    fs, root = open_store(url_root, "default_root_dir")
    local = _numbers(os.listdir(local_root)) if local_root.is_dir() else []
    number = max([*store_versions(fs, root), *local], default=-1) + 1
    claim = json.dumps({"holder": asdict(Holder.of_this_process()), "claimed": time.time()}).encode("utf-8")
    while True:
        try:
            fs.pipe_file(join(root, f"version_{number}", CLAIM_FILE), claim, mode="create")
            break
        except FileExistsError:  # another run claimed this number first
            number += 1
        except OSError as exc:
            raise CheckpointError(
                f"default_root_dir: cannot create a run on {redact(url_root)} ({type(exc).__name__}: {exc}); "
                "check the URL and the store's credentials"
            ) from None
    run_dir = local_root / f"version_{number}"
    run_dir.mkdir(parents=True, exist_ok=True)
    return run_dir, join(url_root, f"version_{number}")


def release_if_unused(run_url: str) -> bool:
    """Remove the version at `run_url` from the store when it holds nothing but its claim and a ``status.json``
    (a run that claimed a version and left nothing in it, whose local folder was released); returns whether it did."""
    fs, root = open_store(run_url, "default_root_dir")
    names = [str(name)[len(root.rstrip("/")) + 1 :] for name in fs.find(root)]
    if not set(names) <= {CLAIM_FILE, "status.json"}:
        return False
    fs.rm(root, recursive=True)  # the folder too, where the store keeps folders (memory://, file://)
    return True


def newest_on_store(url_root: str) -> tuple[str, str] | None:
    """(``version_N``, the URL of its newest committed checkpoint) of the store's runs under `url_root`, or None
    when none has one. Versions are looked at newest first; the first with a committed checkpoint in its
    ``checkpoints/`` wins."""
    fs, root = open_store(url_root, "default_root_dir")
    for number in store_versions(fs, root):
        version = f"version_{number}"
        folder_url = join(url_root, version, CHECKPOINT_SUBDIR)
        found = manifest.newest(fs, join(root, version, CHECKPOINT_SUBDIR), redact(folder_url))
        if found is not None:
            return version, join(folder_url, found[0])
    return None


def find_last(url_root: str, local_root: Path, stage: str) -> tuple[Path, Path, str] | None:
    """(the newest committed checkpoint of the store's runs under `url_root`, downloaded; the local run directory
    that continues its run, its logs brought back (`restore_logs`); a line to print), or None when no run there
    has one.

    As for local runs (`ember.checkpoint.resolve_ckpt_path`): other stages take the newest run with a committed
    checkpoint (`newest_on_store`); fit looks at the newest fit run alone (its ``status.json`` on the store
    names the command), and when that run has no checkpoint while an older one has, raises
    `NewestRunHasNoCheckpoint` naming both runs' URLs: continuing the older run silently would extend the
    wrong one, and its URL continues it (`find_run`)."""
    fs, root = open_store(url_root, "default_root_dir")
    found = _last_of_fit_on_store(fs, root, url_root) if stage == "fit" else newest_on_store(url_root)
    if found is None:
        return None
    version, checkpoint_url = found
    what = "resuming from" if stage == "fit" else f"{stage}: loading"
    line = f"{what} {redact(checkpoint_url)}, the newest checkpoint on the store"
    return _download_run(fs, root, version, checkpoint_url, local_root, line)


def find_run(run_url: str, local_root: Path, stage: str) -> tuple[Path, Path, str]:
    """``ckpt_path=<root URL>/<run name>/version_N`` (a run on the store, not one checkpoint): (its newest committed
    checkpoint, downloaded; the local run directory that continues it, its logs brought back; a line to print).
    A run without a committed checkpoint is a `CheckpointError`."""
    url_root, version = run_url.rstrip("/").rsplit("/", 1)
    fs, root = open_store(url_root, "ckpt_path")
    folder_url = join(url_root, version, CHECKPOINT_SUBDIR)
    found = manifest.newest(fs, join(root, version, CHECKPOINT_SUBDIR), redact(folder_url))
    if found is None:
        raise CheckpointError(f"ckpt_path={redact(run_url)}: this run has no committed checkpoint on the store")
    checkpoint_url = join(folder_url, found[0])
    what = f"resuming run {redact(run_url)} from" if stage == "fit" else f"{stage}: loading"
    return _download_run(fs, root, version, checkpoint_url, local_root, f"{what} {redact(checkpoint_url)}")


def is_run_url(url: str, url_root: str) -> bool:
    """Whether `url` names a run ``version_N`` directly under `url_root` (``<root URL>/<run name>``)."""
    head, _, version = url.rstrip("/").rpartition("/")
    return head == url_root.rstrip("/") and _VERSION.fullmatch(version) is not None


def _download_run(
    fs: Any, root: str, version: str, checkpoint_url: str, local_root: Path, line: str
) -> tuple[Path, Path, str]:
    path = manifest.fetch_checkpoint(checkpoint_url, "ckpt_path")
    run_dir = local_root / version
    restore_logs(fs, join(root, version), run_dir)
    return path, run_dir, line


def _last_of_fit_on_store(fs: Any, root: str, url_root: str) -> tuple[str, str] | None:
    """(``version_N``, its newest committed checkpoint's URL) of the newest fit run under `url_root`; None when
    it has none and neither has any older run; `NewestRunHasNoCheckpoint` when it has none but an older run has."""
    versions = [f"version_{n}" for n in store_versions(fs, root)]
    fits = [v for v in versions if _status(fs, join(root, v)).get("command", "fit") in ("fit", "sweep trial")]
    for version in fits:
        folder_url = join(url_root, version, CHECKPOINT_SUBDIR)
        found = manifest.newest(fs, join(root, version, CHECKPOINT_SUBDIR), redact(folder_url))
        if found is None:
            continue
        if version == fits[0]:
            return version, join(folder_url, found[0])
        newest = fits[0]
        record = _status(fs, join(root, newest))
        status, reason = record.get("status", "no status record"), record.get("reason")
        how = f"{status}: {reason}" if isinstance(reason, str) and reason else str(status)
        raise NewestRunHasNoCheckpoint(
            redact(join(url_root, newest)), how, redact(join(url_root, version)), redact(join(folder_url, found[0]))
        )
    return None


def _status(fs: Any, remote: str) -> dict[str, Any]:
    """The run's ``status.json`` on the store ({} when it has none or it is unreadable)."""
    try:
        data = fs.cat_file(join(remote, run_status.STATUS_FILE))
        record = json.loads(data.decode("utf-8")) if len(data) < 1 << 20 else {}
    except (FileNotFoundError, UnicodeDecodeError, ValueError):
        return {}
    return record if isinstance(record, dict) else {}


def restore_logs(fs: Any, remote: str, run_dir: Path) -> list[str]:
    """Download the run's files from `remote` (all but its checkpoints and claim) that `run_dir` lacks, so a
    run continued on another machine appends to its ``metrics.csv`` and keeps its ``config.yaml`` rather than
    replacing them on the store at the next sync; returns the names downloaded."""
    run_dir.mkdir(parents=True, exist_ok=True)
    done = []
    for name in sorted(fs.find(remote)):
        relative = str(name)[len(remote.rstrip("/")) + 1 :]
        parts = relative.split("/")
        if parts[0] in (CHECKPOINT_SUBDIR, CLAIM_FILE) or any(p in ("", ".", "..") or p.startswith(".") for p in parts):
            continue
        target = run_dir.joinpath(*parts)
        if not target.exists():
            target.parent.mkdir(parents=True, exist_ok=True)
            fs.get_file(name, str(target))
            done.append(relative)
    return done


def upload_file(run_dir: Path, run_url: str, path: Path) -> str:
    """Copy `path`, a file inside `run_dir`, to the same place under `run_url` now (a file written after the run
    ended, such as ``ember predict``'s outputs); returns its URL."""
    fs, root = open_store(run_url, "default_root_dir")
    name = path.relative_to(run_dir).as_posix()
    fs.put_file(str(path), join(root, name))
    return join(run_url, name)


class LogSync:
    """Copies the files of a local run directory (all but ``checkpoints/`` and hidden files such as the run
    lock) to its URL: every `every_s` seconds on a thread of its own, and once more at `close`. A file is
    uploaded again only when its size or modification time changed. A failing store costs the loop nothing:
    the thread warns once (one line on stderr) and tries again at the next period."""

    def __init__(self, run_dir: Path, url: str, every_s: float) -> None:
        self.run_dir, self.url, self.every_s = run_dir, url, every_s
        self.fs, self.root = open_store(url, "default_root_dir")
        self._seen: dict[str, tuple[int, int]] = {}
        self._stop = threading.Event()
        self._lock = threading.Lock()  # one sync at a time: the thread's or close's
        self._warned = False
        self._thread = threading.Thread(target=self._work, name="ember-log-sync", daemon=True)
        self._thread.start()

    def _work(self) -> None:
        while not self._stop.wait(self.every_s):
            try:
                self.sync()
            except Exception as exc:  # the store is down or refuses: say so once, keep training
                if not self._warned:
                    self._warned = True
                    _warn(
                        f"syncing logs to {redact(self.url)} failed ({_short(exc)}); retrying every {self.every_s:g} s"
                    )

    def changed(self) -> list[str]:
        """The files (relative ``/``-separated names) that differ from what was last uploaded."""
        names = []
        for path in sorted(self.run_dir.rglob("*")):
            relative = path.relative_to(self.run_dir)
            if relative.parts[0] == CHECKPOINT_SUBDIR or any(p.startswith(".") for p in relative.parts):
                continue
            try:
                stat = path.stat()
            except FileNotFoundError:  # replaced or removed meanwhile: the next sync sees it
                continue
            if path.is_file() and self._seen.get(relative.as_posix()) != (stat.st_size, stat.st_mtime_ns):
                names.append(relative.as_posix())
        return names

    def sync(self) -> list[str]:
        """Upload every changed file now; returns their names."""
        with self._lock:
            done = []
            for name in self.changed():
                source = self.run_dir / name
                try:
                    stat = source.stat()
                    self.fs.put_file(str(source), join(self.root, name))
                except FileNotFoundError:
                    continue
                self._seen[name] = (stat.st_size, stat.st_mtime_ns)
                done.append(name)
            return done

    def close(self) -> None:
        """Stop the thread, then sync once more; a failure is one line on stderr saying where the logs are."""
        self._stop.set()
        self._thread.join()
        try:
            self.sync()
        except Exception as exc:
            where = f"they are complete in {self.run_dir} (copy them to the store by hand)"
            _warn(f"the last sync of the logs to {redact(self.url)} failed ({_short(exc)}); {where}")


def _warn(message: str) -> None:
    print(f"ember: warning: {message}", file=sys.stderr, flush=True)


def _short(exc: BaseException) -> str:
    return f"{type(exc).__name__}: {(str(exc).splitlines() or [''])[0][:200]}"
