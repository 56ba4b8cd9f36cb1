"""Checkpoints of a 2-process job (DDP over gloo) on a real S3 API server (moto on 127.0.0.1), with no shared
local folder: each process stages in a folder of its own (its own ``EMBER_CACHE``, as on separate machines),
uploads its own DCP shard and rank files, and process 0 writes the manifest, covering every process's files,
only once both reported their uploads. Resumed on 2 processes (each with a new, empty local folder) the run
ends bitwise equal to an uninterrupted one; resumed on 1 process it loads exactly the 2-process weights. A
process whose upload fails keeps the checkpoint uncommitted (``last`` stays) and the fit reports it."""

from __future__ import annotations

import json
import uuid
from pathlib import Path
from typing import Any

import dist_harness as harness
import dist_workload as workload
import pytest
import torch
from torch.utils.data import DataLoader

import ember
from ember.checkpoint import manifest
from ember.checkpoint.store import open_store

pytestmark = [pytest.mark.distributed, pytest.mark.slow]  # one 2-process launch, about 30-50 s on 2 cores

SCRIPT = """\
import os
import sys
from pathlib import Path

import torch.distributed as dist

import dist_workload as w
from ember.checkpoint import manifest

out, machines, url = Path(sys.argv[1]), Path(sys.argv[2]), sys.argv[3]
rank = int(os.environ["RANK"])


def machine(name):  # what this process stages locally: its own folder, shared with no other process
    os.environ["EMBER_CACHE"] = str(machines / f"{name}-rank{rank}")


def fit(root, **kwargs):
    return w.summary(*w.fit_shuffled(w.ddp(), root, max_epochs=2, **kwargs))


machine("a")
w.section(out, "full", lambda: fit(url + "/full"))
w.section(out, "stopped", lambda: fit(url + "/run", ckpt_every=5, stop_at=15, keep=2))
dist.barrier()
machine("b")  # new machines: empty local folders; the run continues from the store alone
w.section(out, "resumed", lambda: fit(url + "/run", ckpt_every=5, keep=2, ckpt_path="last", async_save=True))

real_upload = manifest.upload_files


def refused_on_rank_1(fs, local, remote, names):
    if rank == 1 and local.name.endswith("step=10"):
        raise PermissionError("AccessDenied: the store refused the upload")
    return real_upload(fs, local, remote, names)


def failing():
    manifest.upload_files = refused_on_rank_1
    try:
        fit(url + "/failing", ckpt_every=5, max_steps=12)
    except Exception as exc:
        return {"error": f"{type(exc).__name__}: {exc}"}
    finally:
        manifest.upload_files = real_upload
    return {"error": None}


machine("c")
w.section(out, "failing", failing)


def fsdp(root, **kwargs):
    return w.summary(*w.fit_shuffled(w.fsdp(), root, max_epochs=2, **kwargs))


machine("d")
w.section(out, "fsdp_full", lambda: fsdp(url + "/fsdp-full"))
w.section(out, "fsdp_stopped", lambda: fsdp(url + "/fsdp", ckpt_every=5, stop_at=15, async_save=True))
dist.barrier()
machine("e")
w.section(out, "fsdp_resumed", lambda: fsdp(url + "/fsdp", ckpt_every=5, ckpt_path="last", async_save=True))


class KillAfterUpload(w.ember.Callback):  # rank 1, step 12: its files of step 10 on the store, then SIGKILL

    def on_train_batch_end(self, trainer, module, outputs, batch, batch_idx):
        if rank == 1 and trainer.global_step == 12:
            import signal, time
            from ember.checkpoint.store import open_store

            fs, root = open_store(trainer.run_url + "/checkpoints/epoch=0-step=10/__1_0.distcp")
            deadline = time.monotonic() + 60
            while not fs.exists(root) and time.monotonic() < deadline:
                time.sleep(0.05)
                fs.invalidate_cache()
            os.kill(os.getpid(), signal.SIGKILL)


os.environ["EMBER_CACHE"] = str(machines / "shared")  # both processes on one machine: one staging folder
w.section(out, "shared", lambda: fit(url + "/shared", ckpt_every=5, max_steps=12, keep=2))

def preempted():  # rank 1 alone gets SIGTERM: both save at the boundary they agree on, then commit and exit
    try:
        w.fit_shuffled(w.ddp(), url + "/preempted", ckpt_every=1000, max_epochs=None, max_steps=3000,
                       callbacks=[w.SignalAt(1, 5)])
    except SystemExit as exc:
        return {"code": exc.code}
    return {"code": None}


machine("g")
w.section(out, "preempted", preempted)

machine("f")
fit(url + "/killed", ckpt_every=5, callbacks=[KillAfterUpload()])  # the job ends here: the launcher stops rank 0
"""


def _bucket() -> str:
    import fsspec
    import s3fs

    fsspec.AbstractFileSystem.clear_instance_cache()
    name = f"ember-{uuid.uuid4().hex[:12]}"
    s3fs.S3FileSystem().mkdir(name)
    return name


@pytest.fixture(scope="module")
def job(tmp_path_factory: pytest.TempPathFactory, s3_server_env: dict[str, str]) -> dict[str, Any]:
    """The 2-process job (see SCRIPT): its results by section, the store's URL and the job's output."""
    directory = tmp_path_factory.mktemp("store_ranks")
    with pytest.MonkeyPatch.context() as patch:
        for key, value in s3_server_env.items():
            patch.setenv(key, value)
        url = f"s3://{_bucket()}/runs"
    script = harness.write_script(directory, SCRIPT)
    out, machines = directory / "out", directory / "machines"
    cmd = harness.spawn(script, str(out), str(machines), url)
    finished = harness.run(cmd, cwd=directory, timeout=300, env=harness.clean_env(s3_server_env))
    results = {}
    sections = ["full", "stopped", "resumed", "failing", "shared", "preempted"]
    for name in [*sections, "fsdp_full", "fsdp_stopped", "fsdp_resumed"]:
        try:
            results[name] = harness.results(out, name, 2, finished)
        except AssertionError as exc:
            pytest.fail(str(exc), pytrace=False)
    return {"url": url, "results": results, "job": finished, "machines": machines}


def _checkpoints(fs: Any, folder: str) -> dict[str, bool]:
    """The checkpoint folders in `folder` on the store, each with whether it has a manifest."""
    fs.invalidate_cache()
    return {
        info["name"].rsplit("/", 1)[-1]: fs.exists(f"{info['name']}/{manifest.MANIFEST_FILE}")
        for info in fs.ls(folder, detail=True)
        if info["type"] == "directory"
    }


def test_each_process_uploads_its_own_files_and_process_0_commits_them_all(job: dict[str, Any], s3_env) -> None:
    fs, root = open_store(f"{job['url']}/run/shuffled/version_0/checkpoints")
    # keep=2 through the resume: step 20 evicted step 10 from the store, manifest first
    assert _checkpoints(fs, root) == {"epoch=1-step=15": True, "epoch=1-step=20": True}
    assert manifest.read_last(fs, root, "last") == "epoch=1-step=20"
    listed = json.loads(fs.cat_file(f"{root}/epoch=1-step=15/{manifest.MANIFEST_FILE}"))
    names = sorted(entry["name"] for entry in listed["files"])
    assert names == [".metadata", "__0_0.distcp", "__1_0.distcp", "ember.pt", "rank-0.pt", "rank-1.pt"]
    assert listed["global_step"] == 15
    for entry in listed["files"]:  # sizes as uploaded (the checksums are checked by every download)
        assert fs.size(f"{root}/epoch=1-step=15/{entry['name']}") == entry["size"]
    # No shared local folder: rank 1 staged only its own files, and dropped them once they were on the store.
    rank1 = list((job["machines"] / "a-rank1").rglob("*.distcp"))
    assert rank1 == [], rank1
    assert list((job["machines"] / "a-rank0").rglob("epoch=1-step=15/__1_0.distcp")) == []


def test_a_2_process_checkpoint_on_the_store_resumes_on_2_new_machines_bitwise(job: dict[str, Any]) -> None:
    results = job["results"]
    for rank in (0, 1):
        full, stopped, resumed = (results[name][rank] for name in ("full", "stopped", "resumed"))
        assert stopped["steps"] == 15 and resumed["steps"] == full["steps"] == 24
        assert resumed["losses"] == full["losses"][15:], f"rank {rank}: the resumed steps differ"
        harness.assert_params_equal(resumed["params"], full["params"], f"rank {rank}: resumed vs uninterrupted")


def test_an_fsdp_checkpoint_on_the_store_resumes_on_2_new_machines_bitwise(job: dict[str, Any]) -> None:
    results = job["results"]
    for rank in (0, 1):
        full, stopped, resumed = (results[f"fsdp_{name}"][rank] for name in ("full", "stopped", "resumed"))
        assert stopped["steps"] == 15 and resumed["steps"] == full["steps"] == 24
        harness.assert_params_equal(resumed["params"], full["params"], f"FSDP rank {rank}: resumed vs uninterrupted")
    fs, root = open_store(f"{job['url']}/fsdp/shuffled/version_0/checkpoints")
    assert _checkpoints(fs, root) == {"epoch=1-step=20": True}  # keep=1: step 15 evicted once 20 was committed
    listed = json.loads(fs.cat_file(f"{root}/epoch=1-step=20/{manifest.MANIFEST_FILE}"))
    assert {"__0_0.distcp", "__1_0.distcp", "rank-0.pt", "rank-1.pt"} <= {entry["name"] for entry in listed["files"]}


def test_processes_that_share_their_staging_folder_commit_the_same_way_and_keep_it_complete(
    job: dict[str, Any], s3_env
) -> None:
    fs, root = open_store(f"{job['url']}/shared/shuffled/version_0/checkpoints")
    assert _checkpoints(fs, root) == {"epoch=0-step=5": True, "epoch=0-step=10": True}
    listed = json.loads(fs.cat_file(f"{root}/epoch=0-step=10/{manifest.MANIFEST_FILE}"))
    names = sorted(entry["name"] for entry in listed["files"])
    assert names == [".metadata", "__0_0.distcp", "__1_0.distcp", "ember.pt", "rank-0.pt", "rank-1.pt"]
    local = next((job["machines"] / "shared").rglob("checkpoints"))
    assert sorted(p.name for p in (local / "epoch=0-step=10").iterdir()) == names  # rank 1 left its files there
    assert (local / "last").read_text().strip() == "epoch=0-step=10"


def test_a_preempted_job_commits_its_preemption_checkpoint_before_it_exits(job: dict[str, Any], s3_env) -> None:
    assert [r["code"] for r in job["results"]["preempted"]] == [75, 75]  # both processes stopped for it
    url = f"{job['url']}/preempted/shuffled/version_0/checkpoints"
    fs, root = open_store(url)
    name = manifest.read_last(fs, root, url)
    assert name is not None and _checkpoints(fs, root) == {name: True}
    listed = json.loads(fs.cat_file(f"{root}/{name}/{manifest.MANIFEST_FILE}"))
    assert listed["global_step"] >= 5 and name.endswith(f"step={listed['global_step']}")
    assert {"__0_0.distcp", "__1_0.distcp", "rank-0.pt", "rank-1.pt"} <= {e["name"] for e in listed["files"]}


def test_a_process_killed_after_its_upload_leaves_that_checkpoint_uncommitted(job: dict[str, Any], s3_env) -> None:
    assert job["job"].returncode != 0  # rank 1 was killed, and the launcher stopped rank 0
    url = f"{job['url']}/killed/shuffled/version_0/checkpoints"
    fs, root = open_store(url)
    found = _checkpoints(fs, root)
    assert found.get("epoch=0-step=10") is False, found  # files on the store, no manifest: not a checkpoint
    assert fs.exists(f"{root}/epoch=0-step=10/__1_0.distcp")
    assert set(found) <= {"epoch=0-step=5", "epoch=0-step=10"}
    newest = manifest.newest(fs, root, url)
    if newest is not None:  # step 5 was committed at the save of step 10: it is what a reader takes
        assert newest[0] == "epoch=0-step=5" and manifest.read_last(fs, root, url) == "epoch=0-step=5"
        local = manifest.fetch(url + "/last", fs, root + "/last", Path(job["machines"]) / "reader")
        assert sorted(p.name for p in local.iterdir()) == sorted(e["name"] for e in newest[1]["files"])


class _LoadedWeights(ember.Callback):
    def on_fit_start(self, trainer: Any, module: Any) -> None:
        self.weights = {k: v.detach().clone() for k, v in module.state_dict().items()}


def test_a_2_process_checkpoint_on_the_store_resumes_on_1_process(
    job: dict[str, Any], s3_env: dict[str, str], tmp_path: Path, own_random_state: None
) -> None:
    stopped = job["results"]["stopped"][0]
    url = f"{job['url']}/run/shuffled/version_0/checkpoints/epoch=1-step=15"
    module, loaded = workload.Net(dropout=0.2, adamw=True), _LoadedWeights()
    trainer = ember.Trainer(
        max_steps=17,
        strategy="single_device",
        accelerator="cpu",
        callbacks=[loaded],
        enable_checkpointing=False,
        default_root_dir=tmp_path / "one-machine",
        **workload.QUIET,
    )
    loader = DataLoader(workload.train_set(workload.N_SHUFFLED), batch_size=4, shuffle=True)
    with pytest.warns(RuntimeWarning, match=r"written by 2 process\(es\) and resumes on 1"):
        trainer.fit(module, loader, ckpt_path=url)
    harness.assert_params_equal(loaded.weights, stopped["params"], "loaded vs the 2-process run at step 15")
    assert trainer.global_step == 17  # continued from step 15
    assert all(torch.isfinite(p).all() for p in module.parameters())


def test_a_process_whose_upload_fails_keeps_the_checkpoint_uncommitted_and_the_fit_says_so(
    job: dict[str, Any], s3_env
) -> None:
    errors = [result["error"] for result in job["results"]["failing"]]
    for error in errors:  # raised on both processes, naming the one that failed and why
        assert error is not None and error.startswith("CheckpointWriteError: committing checkpoints to s3://"), error
        assert "process 1 could not upload its files of epoch=0-step=10: PermissionError: AccessDenied" in error
    fs, root = open_store(f"{job['url']}/failing/shuffled/version_0/checkpoints")
    assert _checkpoints(fs, root) == {"epoch=0-step=5": True, "epoch=0-step=10": False}
    assert manifest.read_last(fs, root, "last") == "epoch=0-step=5"  # the previous `last` stays
    output = job["job"].output
    assert s3_env["AWS_ACCESS_KEY_ID"] not in output and s3_env["AWS_SECRET_ACCESS_KEY"] not in output
