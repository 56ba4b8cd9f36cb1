"""Object storage: telling a URL from a local path, and opening the store a URL names.

Wherever ember takes a path (``default_root_dir``, ``ModelCheckpoint(dirpath=...)``, ``ckpt_path``, the
``ember`` command's ``--resume`` / ``--ckpt``), a value with a scheme (``s3://``, ``gs://``, ``memory://``,
``file://``, any fsspec protocol) is a URL. ``pathlib.Path`` would fold ``s3://bucket/x`` into the local
folder ``s3:/bucket/x``; `is_url` is checked first, so that never happens. The check is a regular
expression: a local path never imports fsspec.

Credentials come only from where the store's client library looks (environment variables such as
``AWS_ACCESS_KEY_ID``, its config files, instance roles). A URL that carries them (``s3://key:secret@bucket``)
is refused, and every URL ember prints goes through `redact` first.

How a checkpoint is committed on a store (no rename there) is `ember.checkpoint.manifest`; the
background upload of a run's checkpoints is `ember.checkpoint.mirror`.
"""

from __future__ import annotations

import os
import re
from typing import Any

from ember.checkpoint.format import CheckpointError

_SCHEME = re.compile(r"^([A-Za-z][A-Za-z0-9+.-]*)://")
_USERINFO = re.compile(r"^([A-Za-z][A-Za-z0-9+.-]*://)[^/@]*@")

#: The packages that provide the common protocols, for the error that says what to install.
_PACKAGES = {"s3": "s3fs", "s3a": "s3fs", "gs": "gcsfs", "gcs": "gcsfs", "az": "adlfs", "abfs": "adlfs"}


def is_url(value: object) -> bool:
    """Whether `value` is a URL (``scheme://...``) rather than a local path; cheap, imports nothing."""
    if isinstance(value, os.PathLike):
        return False  # a Path has already lost its '//'
    return isinstance(value, str) and _SCHEME.match(value) is not None


def redact(url: str) -> str:
    """`url` without user info and query (``s3://key:secret@b/x?token=..`` -> ``s3://***@b/x``)."""
    return _USERINFO.sub(r"\1***@", url).split("?", 1)[0]


def join(url: str, *names: str) -> str:
    """`url` with `names` appended, one ``/`` between each."""
    return "/".join([url.rstrip("/"), *(n.strip("/") for n in names)])


def parent(url: str) -> str:
    """The folder `url` is in (``s3://b/ckpts/step=4`` -> ``s3://b/ckpts``)."""
    return url.rstrip("/").rsplit("/", 1)[0]


def basename(url: str) -> str:
    """The last part of `url` (``s3://b/ckpts/step=4`` -> ``step=4``)."""
    return url.rstrip("/").rsplit("/", 1)[-1]


def check_url(url: str, what: str) -> None:
    """Refuse a URL that carries credentials or a query: they would end up in checkpoints and logs."""
    if _USERINFO.match(url) or "?" in url:
        raise CheckpointError(
            f"{what}={redact(url)}: credentials or query parameters in a URL are not accepted (they would be "
            "saved in checkpoints and logs); give the URL alone and put credentials in the environment or the "
            "store client's config (e.g. AWS_ACCESS_KEY_ID / AWS_SECRET_ACCESS_KEY for s3://)"
        )


def open_store(url: str, what: str = "URL") -> tuple[Any, str]:
    """(the fsspec filesystem of `url`, the path inside it); a missing package or unknown protocol is a
    `CheckpointError` that names what to install."""
    check_url(url, what)
    match = _SCHEME.match(url)
    assert match is not None, url
    protocol = match.group(1)
    try:
        import fsspec
    except ImportError:
        raise CheckpointError(f"{what}={redact(url)}: URLs need fsspec; pip install fsspec") from None
    try:
        # A local folder, unlike an object store, needs its parent folders made before a file is written.
        fs, path = fsspec.core.url_to_fs(url, **({"auto_mkdir": True} if protocol in ("file", "local") else {}))
    except (ImportError, ValueError) as exc:
        package = _PACKAGES.get(protocol)
        install = f"pip install {package}" if package else f"install the fsspec package for {protocol}://"
        reason = _first_line(exc)
        raise CheckpointError(f"{what}={redact(url)}: cannot open {protocol}:// ({reason}); {install}") from None
    # fsspec hands out one cached filesystem per store, with the listings it has seen: what other processes
    # wrote since would be missing from them, so each opening starts from the store as it is now.
    fs.invalidate_cache()
    return fs, str(path)


def _first_line(exc: BaseException) -> str:
    return (str(exc).splitlines() or [type(exc).__name__])[0][:200]
