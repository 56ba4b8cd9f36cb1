"""Files that lie about their size are refused before anything is allocated or read (docs/checkpoints.md,
"Sizes are checked first").

Hypothesis generates the lies against a trained checkpoint: which tensor, the shape or dtype ``.metadata``
claims for it, a shard cut short, a shard extended into a sparse hole that a chunk is moved into, and
``ember.pt``, ``rank-0.pt`` or ``.metadata`` extended to gigabytes. Every reader (the Python functions, and
``ember test --ckpt-path``, ``ember fit --resume``, ``ember export --ckpt``) must answer with a
`CheckpointError` (the command: one line, exit 2) that names the file and what to do, within a fraction
of a second and without the process's peak memory growing. The extensions are sparse (`truncate`), so
nothing is written to disk.
"""

from __future__ import annotations

import dataclasses
import itertools
import pickle
import shutil
import time
from pathlib import Path
from typing import Any

import pytest
import torch
from hypothesis import HealthCheck, assume, given, settings
from hypothesis import strategies as st
from rel_helpers import assert_one_line_error, last_checkpoint, run_cli

from ember import checkpoint as ckpt
from ember.checkpoint import CheckpointError
from ember.checkpoint.dcp_metadata import unpickle_metadata

pytestmark = pytest.mark.usefixtures("clean_imports")

GIB = 2**30
EXAMPLES = itertools.count()
LIES = ["shape", "dtype", "shard cut", "chunk in a sparse hole", "ember.pt extended", "rank-0.pt extended",
        ".metadata extended"]  # fmt: skip
READERS = ["read_tensors", "read_module_state", "check_complete", "test --ckpt-path", "fit --resume", "export"]


def _edit_metadata(checkpoint: Path, key: str, **changes: Any) -> None:
    """Rewrite ``.metadata`` with `key`'s entry changed as a consistent lie: ``size`` (one chunk of that size,
    its storage entry re-keyed to match), ``dtype``, and where its bytes are (``offset``, ``length``)."""
    metadata = unpickle_metadata((checkpoint / ".metadata").read_bytes())
    item = metadata.state_dict_metadata[key]
    (index,) = [i for i in metadata.storage_data if i.fqn == key]
    info = metadata.storage_data.pop(index)
    if "size" in changes:
        size = torch.Size(changes["size"])
        offsets = torch.Size([0] * len(size))
        chunk = dataclasses.replace(item.chunks[0], offsets=offsets, sizes=size)
        item = dataclasses.replace(item, size=size, chunks=[chunk])
        index = dataclasses.replace(index, offset=offsets)
    if "dtype" in changes:
        item = dataclasses.replace(item, properties=dataclasses.replace(item.properties, dtype=changes["dtype"]))
    if "offset" in changes:
        info = dataclasses.replace(info, offset=changes["offset"], length=changes["length"])
    metadata.state_dict_metadata[key] = item
    metadata.storage_data[index] = info
    (checkpoint / ".metadata").write_bytes(pickle.dumps(metadata))


def _lie(checkpoint: Path, lie: str, key: str, shape: tuple[int, ...], data: st.DataObject) -> str:
    """Apply `lie` to `key`'s entry of `checkpoint`; returns the file the error must name."""
    shard = checkpoint / "__0_0.distcp"
    if lie == "shape":
        _edit_metadata(checkpoint, key, size=shape)
        return ".metadata"
    if lie == "dtype":
        _edit_metadata(checkpoint, key, dtype=data.draw(st.sampled_from([torch.float64, torch.complex128])))
        return ".metadata"
    if lie == "shard cut":
        with open(shard, "r+b") as f:
            f.truncate(data.draw(st.integers(0, shard.stat().st_size - 1)))
        return "__0_0.distcp"
    if lie == "chunk in a sparse hole":
        with open(shard, "r+b") as f:
            f.truncate(3 * GIB)
        claimed = 4 * max(1, torch.Size(shape).numel())
        _edit_metadata(checkpoint, key, size=shape, offset=2 * GIB, length=min(claimed, GIB))
        return "__0_0.distcp"
    name = lie.split(" ")[0]
    with open(checkpoint / name, "r+b") as f:
        f.truncate(data.draw(st.sampled_from([3 * GIB, 100 * GIB])))
    return name


def _read(reader: str, checkpoint: Path, capsys: pytest.CaptureFixture[str]) -> str:
    """Run `reader` on `checkpoint`; returns the error line."""
    if reader in ("read_tensors", "read_module_state", "check_complete"):
        with pytest.raises(CheckpointError) as info:
            getattr(ckpt, reader)(checkpoint)
        return str(info.value)
    argv = {
        "test --ckpt-path": ["test", "-c", "net.yaml", "--ckpt-path"],
        "fit --resume": ["fit", "-c", "net.yaml", "trainer.max_epochs=3", "--resume"],
        "export": ["export", "-c", "net.yaml", "--format", "safetensors", "--out", "exported", "--ckpt"],
    }[reader]
    code, _, err = run_cli([*argv, str(checkpoint)], capsys)
    assert code == 2, err
    return assert_one_line_error(err, "checkpoint")


def _peak_rss_bytes() -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmHWM:"):
            return int(line.split()[1]) * 1024
    raise AssertionError("no VmHWM in /proc/self/status")


def _reset_peak_rss() -> None:
    Path("/proc/self/clear_refs").write_text("5")  # Linux: VmHWM starts again from the current RSS


@settings(max_examples=30, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(
    lie=st.sampled_from(LIES),
    reader=st.sampled_from(READERS),
    which=st.integers(0, 10**6),
    shape=st.one_of(
        st.just((10**6, 10**6)),
        st.lists(st.integers(1, 5000), min_size=1, max_size=3).map(tuple),
    ),
    data=st.data(),
)
def test_a_file_that_lies_about_a_size_is_refused_at_once(
    project: Path,
    capsys: pytest.CaptureFixture[str],
    lie: str,
    reader: str,
    which: int,
    shape: tuple[int, ...],
    data: st.DataObject,
) -> None:
    # a reader only answers for the files it reads: read_tensors reads no ember.pt, only check_complete and
    # the commands (which check a checkpoint whole first) read rank-0.pt
    assume(not (lie in ("ember.pt extended", "rank-0.pt extended") and reader == "read_tensors"))
    assume(not (lie == "rank-0.pt extended" and reader == "read_module_state"))
    trained = last_checkpoint(project)
    checkpoint = project / "lies" / f"example-{next(EXAMPLES)}"
    shutil.copytree(trained, checkpoint)
    metadata = unpickle_metadata((checkpoint / ".metadata").read_bytes())
    keys = sorted(k for k, item in metadata.state_dict_metadata.items() if hasattr(item, "chunks"))
    key = keys[which % len(keys)]
    true_shape = tuple(metadata.state_dict_metadata[key].size)
    if lie in ("shape", "chunk in a sparse hole") and (shape == true_shape or torch.Size(shape).numel() == 0):
        shape = (*true_shape, 2)  # a claim that differs from the truth
    named = _lie(checkpoint, lie, key, shape, data)
    _reset_peak_rss()
    before, start = _peak_rss_bytes(), time.perf_counter()
    line = _read(reader, checkpoint, capsys)
    elapsed, grown = time.perf_counter() - start, _peak_rss_bytes() - before
    assert named in line and "checkpoint" in line, line
    assert "load another checkpoint" in line, line
    assert grown < 64 * 2**20, f"peak memory grew by {grown / 2**20:.0f} MiB: {line}"
    assert elapsed < (0.5 if reader in ("read_tensors", "read_module_state", "check_complete") else 3.0), elapsed
    shutil.rmtree(checkpoint)
