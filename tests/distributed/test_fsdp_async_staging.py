"""Async FSDP2 saves stage each DTensor's local shard in a host buffer reused save after save (issue 34 item 5).

The job (2 processes over gloo) runs `dist_workload.fit_shuffled` (AdamW, dropout, shuffled data) uninterrupted
with a synchronous save at step 18, then with an async checkpoint every step, stopped at step 18 (in its second
epoch), then resumed from ``last``. Around every async snapshot each rank records, per checkpoint key, what was
staged: its kind (a `HostShard` for a DTensor), device, the identities of the staged object and its buffer and
the buffer's address, whether the manager's staging keeps that object, whether it shares memory with the live
state, and whether it holds the live shard's values. On CPU "host" is where everything is; what shows that a
GPU run keeps no device copy is that the staged object is not a DTensor clone but a host buffer of the
manager's, the same one every save.
"""

from __future__ import annotations

from pathlib import Path

import dist_harness as harness
import pytest

from ember import checkpoint as ckpt

pytestmark = pytest.mark.distributed

SCRIPT = """\
import sys
from pathlib import Path

import torch

import dist_workload as W
from ember import checkpoint as ckpt
from ember.checkpoint import registry
from ember.checkpoint.staging import HostShard

out = Path(sys.argv[1])
saves = []
original = registry.gather


def _local(tensor):
    return tensor.to_local() if hasattr(tensor, "to_local") else tensor


def recording_gather(trainer, module, weights_only, copy, staging=None):
    snapshot = original(trainer, module, weights_only, copy, staging)
    if not copy:
        return snapshot
    entries = registry.registry(trainer, module)
    live = {}
    for name in ("module", "optimizers"):
        live.update(ckpt.split_tensors({name: entries[name].state_dict()})[1])
    live_ptrs = {_local(t).untyped_storage().data_ptr() for t in live.values()}
    record = {}
    for key, value in snapshot.tensors.items():
        shard = isinstance(value, HostShard)
        buffer = value.buffer if shard else _local(value)
        record[key] = {
            "live_is_dtensor": hasattr(live[key], "to_local"),
            "host_shard": shard,
            "device": buffer.device.type,
            "buffer_id": id(buffer),
            "ptr": buffer.data_ptr(),
            "kept_in_staging": staging is not None and staging.get(key) is value,
            "staged_id": id(value),
            "shares_live_memory": buffer.untyped_storage().data_ptr() in live_ptrs,
            "equals_live": torch.equal(buffer, _local(live[key])),
            "chunks": [(tuple(c.offsets), tuple(c.sizes)) for c in value.__create_chunk_list__()] if shard else None,
        }
    saves.append(record)
    return snapshot


def job():
    root = out / "runs-staged"
    # A synchronous save of the live DTensors at step 18, for the async one to be compared with.
    full = W.summary(*W.fit_shuffled(W.fsdp(), out / "runs-full", ckpt_every=18, max_epochs=2))
    sync_ckpt = W._last_checkpoint(out / "runs-full" / "shuffled")
    registry.gather = recording_gather
    try:
        # Stopped in the middle of the second epoch (12 steps per epoch), then resumed from `last`.
        stopped = W.summary(
            *W.fit_shuffled(W.fsdp(), root, ckpt_every=1, stop_at=18, keep=-1, async_save=True, max_epochs=2)
        )
        stopped_saves = len(saves)
        torch.distributed.barrier()
        async_ckpt = W._last_checkpoint(root / "shuffled")
        resumed = W.summary(
            *W.fit_shuffled(W.fsdp(), root, ckpt_every=1, ckpt_path="last", keep=-1, async_save=True, max_epochs=2)
        )
    finally:
        registry.gather = original
    return {
        "full": full,
        "stopped": stopped,
        "resumed": resumed,
        "sync_ckpt": str(sync_ckpt),
        "async_ckpt": str(async_ckpt),
        "saves": saves[:stopped_saves],
        "resumed_saves": saves[stopped_saves:],
    }


def placements():
    # DTensors as tensor parallelism and HSDP replicas leave them (replicated, sharded by columns): each staged,
    # saved by DCP, compared with a save of the DTensors themselves and loaded back.
    import os

    import torch.distributed.checkpoint as dcp
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Replicate, Shard, distribute_tensor

    from ember.checkpoint.staging import copy_into

    mesh = init_device_mesh("cpu", (2,))
    torch.manual_seed(0)
    live = {
        "/replicated": distribute_tensor(torch.randn(5, 6), mesh, [Replicate()]),
        "/columns": distribute_tensor(torch.randn(7, 3), mesh, [Shard(1)]),
    }
    staging = {}
    staged = {key: copy_into(staging, key, value) for key, value in live.items()}
    dcp.save(live, checkpoint_id=out / "direct")
    dcp.save(staged, checkpoint_id=out / "staged")
    loaded = {key: torch.zeros_like(value) for key, value in live.items()}
    dcp.load(loaded, checkpoint_id=out / "staged")
    metadata = {
        name: dcp.FileSystemReader(out / name).read_metadata().state_dict_metadata for name in ("direct", "staged")
    }
    return {
        "host_shards": [isinstance(value, HostShard) for value in staged.values()],
        "same_metadata": metadata["direct"] == metadata["staged"],
        "chunks": {key: len(item.chunks) for key, item in metadata["staged"].items()},
        "file_sizes": {name: sorted(os.path.getsize(f) for f in (out / name).glob("*.distcp")) for name in metadata},
        "loaded": all(torch.equal(loaded[key].full_tensor(), live[key].full_tensor()) for key in live),
    }


W.section(out, "async_staging", job)
W.section(out, "placements", placements)
"""


@pytest.fixture(scope="module")
def staging_job(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, harness.Finished]:
    """The job, run once for the tests of this module: (its output folder, how it ended)."""
    directory = tmp_path_factory.mktemp("staging_job")
    script = harness.write_script(directory, SCRIPT)
    job = harness.run(harness.spawn(script, str(directory / "out")), directory, timeout=240)
    return directory / "out", job


@pytest.mark.slow  # two processes, three short FSDP fits with an async save every step: about 25 s on 2 cores
def test_async_fsdp_saves_stage_dtensor_shards_in_reused_host_buffers(
    staging_job: tuple[Path, harness.Finished],
) -> None:
    out, job = staging_job
    results = harness.results(out, "async_staging", 2, job)
    chunks_by_rank = []
    for rank, result in enumerate(results):
        saves = result["saves"]
        assert len(saves) == result["stopped"]["steps"] == 18, f"rank {rank}: one async save per step"
        first = saves[0]
        sharded = [key for key, item in first.items() if item["live_is_dtensor"]]
        # The module's 4 Linear layers (weight and bias) and AdamW's two moments of each: all DTensors.
        assert len([k for k in sharded if k.startswith("/module/")]) == 8, sorted(first)
        assert len([k for k in sharded if k.startswith("/optimizers/")]) == 16, sorted(first)
        for key, item in first.items():
            assert item["host_shard"] == item["live_is_dtensor"], f"rank {rank} {key}: {item}"
            assert item["device"] == "cpu" and item["kept_in_staging"], f"rank {rank} {key}: {item}"
            assert not item["shares_live_memory"], f"rank {rank} {key}: the staged copy aliases the live state"
            assert item["equals_live"], f"rank {rank} {key}: the staged copy differs from the live state"
        for step, save in enumerate(saves[1:], start=2):
            assert save.keys() == first.keys()
            for key, item in save.items():
                # The same staged object and buffer (object and memory) save after save, refilled with the state
                # of this step.
                same = ("staged_id", "buffer_id", "ptr")
                assert [item[k] for k in same] == [first[key][k] for k in same], f"rank {rank} save {step} {key}"
                assert item["kept_in_staging"] and item["equals_live"], f"rank {rank} save {step} {key}: {item}"
        chunks_by_rank.append({key: item["chunks"] for key, item in first.items() if item["host_shard"]})
        assert len(result["resumed_saves"]) == 6 and all(
            item["host_shard"] == item["live_is_dtensor"] for save in result["resumed_saves"] for item in save.values()
        )
        full, resumed = result["full"], result["resumed"]
        assert (result["stopped"]["steps"], resumed["steps"], full["steps"]) == (18, 24, 24)
        harness.assert_params_equal(resumed["params"], full["params"], f"rank {rank}: resumed vs uninterrupted")
        assert resumed["losses"] == full["losses"][18:], f"rank {rank}: the steps after the resume differ"
    # Each rank staged its own half of every sharded tensor (row 0 and the rows after rank 0's).
    for key, chunks in chunks_by_rank[0].items():
        (offset0, sizes0), (offset1, sizes1) = chunks[0], chunks_by_rank[1][key][0]
        assert offset0[0] == 0 and offset1[0] == sizes0[0] and sizes0[1:] == sizes1[1:], (
            f"{key}: {chunks} / {chunks_by_rank[1][key]}"
        )
    # The files are those of a save of the live DTensors: the same entries (global sizes, one chunk per rank
    # at the same offsets, the same properties) as the synchronous save of step 18.
    sync_path, async_path = Path(results[0]["sync_ckpt"]), Path(results[0]["async_ckpt"])
    assert sync_path.name == async_path.name == "epoch=1-step=18"
    staged = ckpt.read_metadata(async_path).state_dict_metadata
    direct = ckpt.read_metadata(sync_path).state_dict_metadata
    tensors = [key for key in direct if key.startswith(("/module/", "/optimizers/"))]
    assert len(tensors) > 24 and {key: staged.get(key) for key in tensors} == {key: direct[key] for key in tensors}
    module = [direct[key] for key in tensors if key.startswith("/module/")]
    assert len(module) == 8 and all(len(item.chunks) == 2 for item in module), module
    assert job.returncode == 0, harness.describe(job)


@pytest.mark.slow  # the job above (its last second)
def test_replicated_and_column_sharded_dtensors_stage_into_the_files_dcp_writes_for_them(
    staging_job: tuple[Path, harness.Finished],
) -> None:
    out, job = staging_job
    for rank, result in enumerate(harness.results(out, "placements", 2, job)):
        assert result["host_shards"] == [True, True], f"rank {rank}"
        assert result["same_metadata"] and result["loaded"], f"rank {rank}: {result}"
        # A replicated tensor is one chunk written once (by rank 0); the column shards are two chunks.
        assert result["chunks"] == {"/replicated": 1, "/columns": 2}, f"rank {rank}"
        assert result["file_sizes"]["staged"] == result["file_sizes"]["direct"], f"rank {rank}: {result}"
