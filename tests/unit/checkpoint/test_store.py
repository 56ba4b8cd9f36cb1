"""The store side of checkpoints (ember/checkpoint/store.py, manifest.py): URLs told from paths, and the commit
protocol without rename: a checkpoint counts once its manifest is written, and only while it matches."""

from __future__ import annotations

import json
import subprocess
import sys
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import fsspec
import pytest

from ember.checkpoint import CheckpointError, manifest
from ember.checkpoint.store import check_url, is_url, open_store, redact


@pytest.fixture
def store() -> Iterator[tuple[Any, str, str]]:
    """(memory filesystem, root path, URL) of a folder of this test's own, removed afterwards."""
    url = f"memory://ember-test-{uuid.uuid4().hex}"
    fs, root = open_store(url)
    yield fs, root, url
    if fs.exists(root):
        fs.rm(root, recursive=True)


def _checkpoint(tmp: Path, name: str, payload: bytes = b"tensors") -> Path:
    local = tmp / name
    (local / "sub").mkdir(parents=True)
    (local / "ember.pt").write_bytes(b"meta-" + payload)
    (local / "sub" / "__0_0.distcp").write_bytes(payload * 100)
    return local


@pytest.mark.parametrize(
    ("value", "expected"),
    [
        ("s3://bucket/runs", True),
        ("memory://x", True),
        ("gs://b", True),
        ("file:///tmp/x", True),
        ("runs", False),
        ("/abs/s3:/x", False),
        ("s3:/bucket", False),  # what Path() leaves of a URL: a local path
        (Path("s3://bucket"), False),
        (None, False),
    ],
)
def test_is_url_tells_urls_from_paths(value: Any, expected: bool) -> None:
    assert is_url(value) is expected


def test_is_url_imports_no_fsspec() -> None:
    code = "import sys, ember.checkpoint.store as s; s.is_url('runs'); print('fsspec' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip() == "False"


def test_credentials_in_a_url_are_refused_and_never_shown() -> None:
    with pytest.raises(CheckpointError) as info:
        check_url("s3://AKIDEXAMPLE:s3cr3tKEY@bucket/ckpts", "ModelCheckpoint(dirpath)")
    assert "s3cr3tKEY" not in str(info.value) and "AKIDEXAMPLE" not in str(info.value)
    assert "environment" in str(info.value)
    assert redact("s3://k:s@b/x?X-Amz-Signature=abc") == "s3://***@b/x"


def test_an_unknown_protocol_says_what_to_install() -> None:
    with pytest.raises(CheckpointError, match="nosuchproto://"):
        open_store("nosuchproto://bucket/x")


def test_upload_writes_files_then_a_manifest_that_matches(tmp_path: Path, store: tuple[Any, str, str]) -> None:
    fs, root, url = store
    local = _checkpoint(tmp_path, "step=3")
    written = manifest.upload(fs, local, f"{root}/step=3", global_step=3)
    listed = {e["name"]: e["size"] for e in written["files"]}
    assert listed == {"ember.pt": 12, "sub/__0_0.distcp": 700}
    assert json.loads(fs.cat_file(f"{root}/step=3/manifest.json"))["global_step"] == 3
    assert manifest.committed(fs, f"{root}/step=3", url) == written
    manifest.download(fs, f"{root}/step=3", url, written, tmp_path / "back")
    assert (tmp_path / "back" / "sub" / "__0_0.distcp").read_bytes() == b"tensors" * 100


@pytest.mark.parametrize(
    ("name", "rank"),
    [("ember.pt", 0), (".metadata", 0), ("__0_0.distcp", 0), ("__1_0.distcp", 1), ("__12_3.distcp", 12),
     ("rank-0.pt", 0), ("rank-7.pt", 7), ("sub/rank-1.pt", 0), ("__1_x.distcp", 0)],
)  # fmt: skip
def test_each_file_of_a_checkpoint_has_one_writing_process(name: str, rank: int) -> None:
    assert manifest.writer_rank(name) == rank


def test_parts_uploaded_by_several_processes_are_committed_by_one_manifest_listing_all(
    tmp_path: Path, store: tuple[Any, str, str]
) -> None:
    fs, root, url = store
    remote = f"{root}/step=4"
    fs.pipe_file(f"{remote}/manifest.json", b"{}")  # an older checkpoint of the same name, being replaced
    parts = []
    by_rank = {1: ["__1_0.distcp", "rank-1.pt"], 0: ["ember.pt", ".metadata", "__0_0.distcp", "rank-0.pt"]}
    for rank, files in by_rank.items():
        local = tmp_path / f"machine-{rank}" / "step=4"  # no shared folder: each process has its own
        local.mkdir(parents=True)
        for name in files:
            (local / name).write_bytes(name.encode() * (rank + 2))
        parts += manifest.upload_files(fs, local, remote, files)
        assert not fs.exists(f"{remote}/manifest.json")  # the old manifest went before the first file
        assert manifest.committed(fs, remote, url) is None  # files alone commit nothing
    written = manifest.write_manifest(fs, remote, parts, global_step=4)
    assert [e["name"] for e in written["files"]] == sorted(e["name"] for e in parts)
    assert manifest.committed(fs, remote, url) == written
    assert {e["name"]: e["size"] for e in written["files"]}["__1_0.distcp"] == len(b"__1_0.distcp") * 3
    local = manifest.fetch(url, fs, root, tmp_path / "cache")
    assert sorted(p.name for p in local.iterdir()) == sorted(e["name"] for e in parts)


def test_files_without_a_manifest_are_not_a_checkpoint(tmp_path: Path, store: tuple[Any, str, str]) -> None:
    fs, root, url = store
    # A writer killed after the files, before the manifest:
    fs.put(str(_checkpoint(tmp_path, "step=5")), f"{root}/step=5", recursive=True)
    assert manifest.committed(fs, f"{root}/step=5", url) is None
    assert manifest.newest(fs, root, url) is None
    with pytest.raises(CheckpointError, match="no committed checkpoint"):
        manifest.fetch(url, fs, root, tmp_path / "cache")


def test_a_missing_or_resized_file_makes_the_checkpoint_untrusted(tmp_path: Path, store: tuple[Any, str, str]) -> None:
    fs, root, url = store
    manifest.upload(fs, _checkpoint(tmp_path, "a"), f"{root}/a", 1)
    fs.rm_file(f"{root}/a/sub/__0_0.distcp")
    with pytest.raises(CheckpointError, match=r"incomplete: sub/__0_0\.distcp is missing"):
        manifest.committed(fs, f"{root}/a", url)
    manifest.upload(fs, _checkpoint(tmp_path, "b"), f"{root}/b", 2)
    fs.pipe_file(f"{root}/b/ember.pt", b"short")
    with pytest.raises(CheckpointError, match=r"ember\.pt is 5 bytes, its manifest says 12"):
        manifest.committed(fs, f"{root}/b", url)


def test_a_changed_byte_fails_the_checksum_on_download(tmp_path: Path, store: tuple[Any, str, str]) -> None:
    fs, root, url = store
    written = manifest.upload(fs, _checkpoint(tmp_path, "a"), f"{root}/a", 1)
    fs.pipe_file(f"{root}/a/ember.pt", b"meta-tensorz")  # same size, other bytes
    with pytest.raises(CheckpointError, match="does not match its manifest"):
        manifest.download(fs, f"{root}/a", url, written, tmp_path / "back")
    assert not (tmp_path / "back").exists() and not list(tmp_path.glob(".back*"))


@pytest.mark.parametrize("name", ["../escape", "/abs", "a/../../b", "manifest.json", ""])
def test_a_manifest_naming_files_outside_is_refused(name: str, store: tuple[Any, str, str]) -> None:
    fs, root, url = store
    body = {"ember_manifest": 1, "global_step": 1, "files": [{"name": name, "size": 1, "sha256": "0" * 64}]}
    fs.pipe_file(f"{root}/x/manifest.json", json.dumps(body).encode())
    with pytest.raises(CheckpointError, match="not a file of the checkpoint"):
        manifest.read_manifest(fs, f"{root}/x", url)


def test_last_names_the_newest_committed_and_falls_back_when_it_is_gone(
    tmp_path: Path, store: tuple[Any, str, str]
) -> None:
    fs, root, url = store
    for step in (1, 2):
        manifest.upload(fs, _checkpoint(tmp_path, f"s{step}", bytes([step]) * 3), f"{root}/s{step}", step)
    manifest.point_last(fs, root, "s1")
    assert manifest.newest(fs, root, url)[0] == "s1"  # type: ignore[index]
    local = manifest.fetch(f"{url}/last", fs, f"{root}/last", tmp_path / "c1")
    assert local.name == "s1" and (local / "ember.pt").read_bytes() == b"meta-\x01\x01\x01"
    manifest.remove(fs, f"{root}/s1")
    with pytest.warns(RuntimeWarning, match="s1"):
        assert manifest.newest(fs, root, url)[0] == "s2"  # type: ignore[index]


def test_remove_deletes_the_manifest_first(tmp_path: Path, store: tuple[Any, str, str]) -> None:
    fs, root, url = store
    manifest.upload(fs, _checkpoint(tmp_path, "a"), f"{root}/a", 1)
    calls: list[str] = []

    class Recording:
        def rm_file(self, path: str) -> None:
            calls.append(f"rm_file {path.rsplit('/', 1)[-1]}")
            raise KeyboardInterrupt  # killed right after the first delete

        def rm(self, path: str, recursive: bool) -> None:  # pragma: no cover - never reached
            calls.append("rm")

    with pytest.raises(KeyboardInterrupt):
        manifest.remove(Recording(), f"{root}/a")
    assert calls == ["rm_file manifest.json"]
    fs.rm_file(f"{root}/a/manifest.json")  # what that first delete did: the rest no longer counts
    assert manifest.committed(fs, f"{root}/a", url) is None


def test_an_oversized_manifest_is_refused_before_reading(store: tuple[Any, str, str]) -> None:
    fs, root, url = store
    fs.pipe_file(f"{root}/x/manifest.json", b" " * ((1 << 20) + 1))
    with pytest.raises(CheckpointError, match="more than it can justify"):
        manifest.read_manifest(fs, f"{root}/x", url)


def test_fsspec_memory_store_is_the_one_under_test() -> None:
    assert isinstance(open_store("memory://x")[0], fsspec.implementations.memory.MemoryFileSystem)


def test_the_mirror_uploads_in_order_then_evicts_then_runs_the_local_cleanup(
    tmp_path: Path, store: tuple[Any, str, str]
) -> None:
    from ember.checkpoint.mirror import StoreMirror

    fs, root, url = store
    mirror = StoreMirror(url)
    events: list[str] = []
    for step in (1, 2, 3):
        local = _checkpoint(tmp_path, f"s{step}")
        keep = {f"s{step - 1}", f"s{step}"}  # top-2
        mirror.submit(local, step, True, keep, after=lambda step=step: events.append(f"after s{step}"))
    mirror.close()
    assert events == ["after s1", "after s2", "after s3"]
    assert sorted(n.rsplit("/", 1)[-1] for n in fs.ls(root, detail=False)) == ["last", "s2", "s3"]
    assert manifest.newest(fs, root, url)[0] == "s3"  # type: ignore[index]


def test_a_failed_upload_is_raised_at_the_end_and_later_cleanups_do_not_run(
    tmp_path: Path, store: tuple[Any, str, str]
) -> None:
    from ember.checkpoint import CheckpointWriteError
    from ember.checkpoint.mirror import StoreMirror

    _, _, url = store
    mirror = StoreMirror(url)
    ran: list[str] = []
    mirror.submit(tmp_path / "gone", 1, True, {"gone"}, after=lambda: ran.append("gone"))  # nothing to upload
    mirror.submit(_checkpoint(tmp_path, "s2"), 2, True, {"s2"}, after=lambda: ran.append("s2"))
    with pytest.raises(CheckpointWriteError, match=r"uploading checkpoints to memory://.*local checkpoints"):
        mirror.close()
    assert ran == []  # the local checkpoints stay: they are the only copies
