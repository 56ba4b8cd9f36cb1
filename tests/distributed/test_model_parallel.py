"""Tensor parallel x FSDP2 on a ("dp", "tp") mesh, HSDP, and checkpoints that reshard across mesh shapes
(issue 23, "must show" 1 and 2; docs/distributed.md, "Tensor parallelism").

Two shared jobs (`mp_workload`): ``mp_job`` with 2 processes (TP(2); resumes at (1, 2) and (2, 1); the char
transformer's plan), then ``mesh_job`` with 4 (the 2-D mesh (2, 2); HSDP on (2, 2) against DDP; the (1, 2)
checkpoint resumed at (2, 2)). The one-process references run in the pytest process. Every model-parallel
run keeps the global batch at 8 samples, so each equals one process with batch 8.
"""

from __future__ import annotations

import contextlib
import os
import random
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import dist_harness as harness
import dist_workload as workload
import mp_workload
import pytest
import torch
from torch.distributed.checkpoint.metadata import TensorStorageMetadata

from ember import checkpoint as ckpt

pytestmark = pytest.mark.distributed

HERE = Path(__file__).resolve().parent
ROOT = HERE.parents[1]
SCRIPT = f"""\
import sys
from pathlib import Path

sys.path[:0] = [{str(HERE)!r}, {str(ROOT)!r}]
import mp_workload

getattr(mp_workload, sys.argv[1])(Path(sys.argv[2]), *sys.argv[3:])
"""

#: "Within 1e-5" (issue 23): the largest absolute difference allowed against one process.
TOLERANCE = 1e-5
#: A resume at another mesh shape against the uninterrupted run: within 1e-6.
RESHARD_TOLERANCE = 1e-6


@dataclass
class Job:
    out: Path
    job: harness.Finished
    world_size: int

    def results(self, name: str) -> list[dict[str, Any]]:
        try:
            return harness.results(self.out, name, self.world_size, self.job)
        except AssertionError as exc:
            pytest.fail(str(exc), pytrace=False)


def _launch(directory: Path, nproc: int, *args: str) -> Job:
    script = harness.write_script(directory, SCRIPT)
    out = directory / "out"
    finished = harness.run(
        harness.spawn(script, *args[:1], str(out), *args[1:], nproc=nproc, preload=["mp_workload"], path=[HERE, ROOT]),
        directory,
        420,
    )
    print(f"{args[0]} ({nproc} processes): {harness.describe(finished)}")
    return Job(out, finished, nproc)


@pytest.fixture(scope="session")
def mp_job(tmp_path_factory: pytest.TempPathFactory) -> Job:
    return _launch(tmp_path_factory.mktemp("mp_job"), 2, "mp_job")


@pytest.fixture(scope="session")
def source_ckpt(mp_job: Job) -> Path:
    """The step-10 checkpoint of the (1, 2) run without dropout: what the other meshes resume."""
    return Path(mp_job.results("tp_source")[0]["ckpt"])


@pytest.fixture(scope="session")
def mesh_job(tmp_path_factory: pytest.TempPathFactory, source_ckpt: Path) -> Job:
    return _launch(tmp_path_factory.mktemp("mesh_job"), 4, "mesh_job", str(source_ckpt))


def max_diff(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> float:
    assert a.keys() == b.keys(), f"keys differ: {sorted(set(a) ^ set(b))}"
    return max(float((a[k].double() - b[k].double()).abs().max()) for k in a)


def assert_within(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor], tolerance: float, what: str) -> None:
    diff = max_diff(a, b)
    assert diff <= tolerance, f"{what}: differs by up to {diff:.3g} (allowed {tolerance:g})"


def losses_within(a: list[float], b: list[float], tolerance: float, what: str) -> None:
    assert len(a) == len(b), f"{what}: {len(a)} vs {len(b)} steps"
    diff = float((torch.tensor(a, dtype=torch.float64) - torch.tensor(b, dtype=torch.float64)).abs().max())
    assert diff <= tolerance, f"{what}: losses differ by up to {diff:.3g}"


# --- tensor parallel against one process ------------------------------------------------------------------


def test_tp2_equals_one_process_over_20_steps(mp_job, single) -> None:
    reference = single["seq"]
    for rank, result in enumerate(mp_job.results("tp_seq")):
        assert (result["strategy"], result["mesh"], result["steps"]) == ("ModelParallelStrategy", (1, 2), 20)
        assert result["placements"]["model.0.weight"] == "(Shard(dim=0),)"  # the plan was applied
        assert result["placements"]["model.3.weight"] == "(Shard(dim=1),)"
        assert result["sampler"] == {"num_replicas": 1, "rank": 0}  # one data-parallel group: one shard
        assert result["seen"] == reference["seen"], f"rank {rank}: TP peers must see the whole global batch"
        losses_within(result["losses"], reference["losses"], TOLERANCE, f"TP rank {rank} vs one process")
        assert_within(result["params"], reference["params"], TOLERANCE, f"TP rank {rank} vs one process")
        for key in ("val/loss", "val/acc"):
            assert result["metrics"][key] == pytest.approx(reference["metrics"][key], abs=TOLERANCE), key
        assert result["metrics"]["val/count"] == result["metrics"]["val/samples"] == workload.N_VAL


@pytest.fixture(scope="module")
def single_clipped(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    """One process, batch 8, clipped by norm (0.1) and by value (0.002)."""
    runs = {}
    with workload_random_state():
        for name, options in (("norm", {"gradient_clip_val": 0.1}), ("value", CLIP_VALUE)):
            root = tmp_path_factory.mktemp(f"clip-{name}")
            runs[name] = workload.summary(*workload.fit_sequential("single_device", root, batch_size=8, **options))
    return runs


CLIP_VALUE = {"gradient_clip_val": 0.002, "gradient_clip_algorithm": "value"}


@contextlib.contextmanager
def workload_random_state() -> Iterator[None]:
    """Runs in the pytest process leave the global random streams and EMBER_SEED as they found them."""
    seed, python = os.environ.get("EMBER_SEED"), random.getstate()
    with torch.random.fork_rng(devices=[]):
        try:
            yield
        finally:
            random.setstate(python)
            if seed is None:
                os.environ.pop("EMBER_SEED", None)
            else:
                os.environ["EMBER_SEED"] = seed


def test_clipping_by_norm_takes_the_norm_over_every_shard(mp_job, mesh_job, single, single_clipped) -> None:
    reference = single_clipped["norm"]
    assert max_diff(reference["params"], single["seq"]["params"]) > 1e-3, "the clip must be active"
    for name, job in (("tp_clip", mp_job), ("mesh_clip", mesh_job)):
        for rank, result in enumerate(job.results(name)):
            assert_within(result["params"], reference["params"], TOLERANCE, f"{name} rank {rank} vs one process")


def test_clipping_by_value_clips_every_shard(mp_job, single, single_clipped) -> None:
    reference = single_clipped["value"]
    assert max_diff(reference["params"], single["seq"]["params"]) > 1e-3, "the clip must be active"
    for rank, result in enumerate(mp_job.results("tp_clip_value")):
        assert_within(result["params"], reference["params"], TOLERANCE, f"value clip, rank {rank} vs one process")


def test_compile_under_tp_compiles_each_block_and_changes_nothing(mp_job, single) -> None:
    for rank, result in enumerate(mp_job.results("tp_compile")):
        assert result["compiled_modules"] == ["model.1", "model.2"], rank
        assert result["graphs"] >= 1, rank
        assert_within(result["params"], single["seq"]["params"], TOLERANCE, f"compiled TP rank {rank}")


# --- the 2-D mesh ---------------------------------------------------------------------------------------


def test_2d_mesh_equals_one_process_with_the_global_batch(mesh_job, single) -> None:
    reference = single["seq"]
    ranks = mesh_job.results("mesh_seq")
    for rank, result in enumerate(ranks):
        dp_rank = rank // 2  # mesh [[0, 1], [2, 3]]: ranks 0, 1 form TP group 0
        assert (result["mesh"], result["world_size"]) == ((2, 2), 4)
        assert result["sampler"] == {"num_replicas": 2, "rank": dp_rank}
        assert len(result["placements"]["model.0.weight"].split(",")) >= 2, "a 2-D placement (dp and tp)"
        assert_within(result["params"], reference["params"], TOLERANCE, f"(2, 2) rank {rank} vs one process")
        for key in ("val/loss", "val/acc"):
            assert result["metrics"][key] == pytest.approx(reference["metrics"][key], abs=TOLERANCE), key
        # Sums over the data-parallel processes only: each TP group counts once.
        assert result["metrics"]["val/count"] == result["metrics"]["val/samples"] == workload.N_VAL
    for step, expected in enumerate(reference["seen"]):
        assert ranks[0]["seen"][step] == ranks[1]["seen"][step], "TP peers see the same batch"
        assert ranks[2]["seen"][step] == ranks[3]["seen"][step]
        assert sorted(ranks[0]["seen"][step] + ranks[2]["seen"][step]) == expected, f"step {step}"
        # Each step's loss over 8 samples is the mean of the two data-parallel groups' losses over their 4.
        mean = (ranks[0]["losses"][step] + ranks[2]["losses"][step]) / 2
        assert mean == pytest.approx(reference["losses"][step], abs=TOLERANCE), f"step {step}"


def test_a_hook_that_shards_itself_is_not_sharded_again(mesh_job) -> None:
    ember_sharded, self_sharded = mesh_job.results("mesh_seq"), mesh_job.results("hook_seq")
    for rank in range(4):
        assert self_sharded[rank]["placements"] == ember_sharded[rank]["placements"], rank
        harness.assert_params_equal(self_sharded[rank]["params"], ember_sharded[rank]["params"], f"rank {rank}")


def test_evaluation_with_unequal_batches_per_data_parallel_group(mesh_job, single) -> None:
    reference = single["eval"]["uneven"]["validate"]
    ranks = mesh_job.results("mesh_eval_uneven")
    assert [r["batches"] for r in ranks] == [5, 5, 4, 4]  # 41 samples, batch 5: dp group 0 has one more
    for rank, result in enumerate(ranks):
        assert result["validate"]["val/loss"] == pytest.approx(reference["val/loss"], abs=TOLERANCE), rank
        assert result["validate"]["val/acc"] == pytest.approx(reference["val/acc"], abs=TOLERANCE), rank
        assert result["validate"]["val/count"] == workload.N_VAL_UNEVEN


# --- HSDP on (2, 2) ---------------------------------------------------------------------------------------


def test_hsdp_equals_ddp(mesh_job, single) -> None:
    hsdp, ddp = mesh_job.results("hsdp_seq"), mesh_job.results("ddp_seq")
    for rank in range(4):
        assert (hsdp[rank]["strategy"], ddp[rank]["strategy"]) == ("FSDPStrategy", "DDPStrategy")
        losses_within(hsdp[rank]["losses"], ddp[rank]["losses"], TOLERANCE, f"HSDP vs DDP, rank {rank}")
        assert_within(hsdp[rank]["params"], ddp[rank]["params"], TOLERANCE, f"HSDP vs DDP, rank {rank}")
        assert_within(hsdp[rank]["params"], single["seq"]["params"], TOLERANCE, f"HSDP rank {rank} vs 1 process")
        assert hsdp[rank]["seen"] == ddp[rank]["seen"]


def test_an_hsdp_checkpoint_resumes_bitwise_and_is_sharded_within_replicas(mesh_job) -> None:
    for rank, result in enumerate(mesh_job.results("hsdp_resume")):
        full, stopped, resumed = result["full"], result["stopped"], result["resumed"]
        assert (stopped["steps"], resumed["steps"], full["steps"]) == (10, 18, 18)  # 96 / (4 x 4) x 3 epochs
        harness.assert_params_equal(resumed["params"], full["params"], f"rank {rank}: resumed vs uninterrupted")
        assert resumed["losses"] == full["losses"][10:], f"rank {rank}"
        assert resumed["seen"] == full["seen"][10:], f"rank {rank}"
    path = Path(result["ckpt"])
    chunks = _module_chunks(path)
    assert chunks and all(n == 2 for n in chunks.values()), chunks  # 2 shards; the replicas write each once


def test_hsdp_evaluation_equals_one_process(mesh_job, single) -> None:
    for rank, result in enumerate(mesh_job.results("hsdp_eval")):
        for key, n in (("even", workload.N_VAL), ("uneven", workload.N_VAL_UNEVEN)):
            got, expected = result[str(n)], single["eval"][key]
            for stage in ("validate", "test"):
                for metric, value in expected[stage].items():
                    assert got[stage][metric] == pytest.approx(value, abs=TOLERANCE), (rank, key, stage, metric)


def test_an_hsdp_checkpoint_resumes_in_one_process(mesh_job, tmp_path, own_random_state) -> None:
    rank0 = mesh_job.results("hsdp_resume")[0]
    path = Path(rank0["ckpt"])
    module, loaded = workload.Net(dropout=0.2, adamw=True), mp_workload.Loaded()
    trainer = _one_process_trainer(tmp_path, [loaded], max_steps=12)
    loader = torch.utils.data.DataLoader(workload.train_set(workload.N_SHUFFLED), batch_size=16, shuffle=True)
    with pytest.warns(RuntimeWarning, match=r"written by 4 process\(es\) and resumes on 1"):
        trainer.fit(module, loader, ckpt_path=path)
    harness.assert_params_equal(loaded.weights, rank0["stopped"]["params"], "loaded vs the HSDP run at step 10")
    harness.assert_params_equal(loaded.weights, ckpt.read_module_state(path)[1], "loaded vs the checkpoint's")
    assert trainer.global_step == 12


# --- resumes: the same mesh (bitwise) and other meshes (within 1e-6) -------------------------------------


def test_a_checkpoint_resumes_bitwise_at_the_same_mesh(mp_job) -> None:
    # (1, 2) with dropout 0.2 and without; (2, 1) with dropout: every data-parallel rank continues exactly.
    for name in ("tp_resume", "tp_source", "dp_resume"):
        for rank, result in enumerate(mp_job.results(name)):
            full, stopped, resumed = result["full"], result["stopped"], result["resumed"]
            assert (stopped["steps"], resumed["steps"], full["steps"]) == (10, 36, 36)
            harness.assert_params_equal(result["loaded"], stopped["params"], f"{name} rank {rank}: loaded")
            harness.assert_params_equal(result["loaded_optimizer"], stopped["optimizer"], f"{name} {rank}: optimizer")
            harness.assert_params_equal(resumed["params"], full["params"], f"{name} rank {rank}: final weights")
            harness.assert_params_equal(resumed["optimizer"], full["optimizer"], f"{name} rank {rank}: optimizer")
            assert resumed["losses"] == full["losses"][10:], f"{name} rank {rank}"
            assert resumed["seen"] == full["seen"][10:], f"{name} rank {rank}"


def test_a_tp_checkpoint_is_stored_sharded(source_ckpt) -> None:
    chunks = _module_chunks(source_ckpt)
    for key in ("model.0.weight", "model.1.linear.weight", "model.2.linear.weight", "model.3.weight"):
        assert chunks[f"/module/{key}"] == 2, chunks  # split by the plan, each half written by its process
    assert chunks["/module/model.1.linear.bias"] == 1  # replicated: written once


def _check_reshard(result: dict[str, Any], source: dict[str, Any], shape: tuple[int, int] | None, what: str) -> None:
    """Loaded state equals the source's at step 10 (bitwise); the continuation equals the uninterrupted run at
    this shape within 1e-6, and the source shape's uninterrupted run within 1e-6."""
    full, resumed = result["full"], result["resumed"]
    if shape is not None:
        assert full["mesh"] == resumed["mesh"] == shape, what
    assert resumed["steps"] == full["steps"] == 36, what
    harness.assert_params_equal(result["loaded"], source["stopped"]["params"], f"{what}: loaded weights")
    harness.assert_params_equal(result["loaded_optimizer"], source["stopped"]["optimizer"], f"{what}: loaded state")
    assert_within(resumed["params"], full["params"], RESHARD_TOLERANCE, f"{what}: final weights vs uninterrupted")
    assert_within(resumed["optimizer"], full["optimizer"], RESHARD_TOLERANCE, f"{what}: optimizer vs uninterrupted")
    assert_within(resumed["params"], source["full"]["params"], RESHARD_TOLERANCE, f"{what}: vs the (1, 2) run")
    assert resumed["seen"] == full["seen"][10:], f"{what}: other batches after the resume"


def test_a_tp_checkpoint_resumes_at_dp2_tp1(mp_job) -> None:
    source = mp_job.results("tp_source")
    for rank, result in enumerate(mp_job.results("tp_to_dp")):
        _check_reshard(result, source[rank], (2, 1), f"(1, 2) -> (2, 1), rank {rank}")


def test_a_tp_checkpoint_resumes_at_dp2_tp2(mp_job, mesh_job) -> None:
    source = mp_job.results("tp_source")[0]  # both TP ranks of the source hold the same (full) values
    for rank, result in enumerate(mesh_job.results("mesh_from_tp")):
        _check_reshard(result, source, (2, 2), f"(1, 2) -> (2, 2), rank {rank}")


def test_a_tp_checkpoint_resumes_in_one_process(mp_job, source_ckpt, tmp_path, own_random_state) -> None:
    source = mp_job.results("tp_source")[0]
    runs: dict[str, Any] = {}
    for name, path in (("full", None), ("resumed", str(source_ckpt))):
        loaded = mp_workload.Loaded()
        warns = pytest.warns(RuntimeWarning, match=r"written by 2 process\(es\) and resumes on 1")
        # (`Loaded` only where a checkpoint filled the optimizer: DCP steps an empty one to create its state.)
        with warns if path is not None else contextlib.nullcontext():
            trainer, module = mp_workload.fit_shuffled(
                "single_device", tmp_path / name, 1, ckpt_path=path, callbacks=[loaded] if path else [],
                loader=mp_workload.one_process_loader(),
            )  # fmt: skip
        runs[name] = mp_workload.summary(trainer, module)
        if path is not None:
            runs.update(loaded=loaded.weights, loaded_optimizer=loaded.optimizer)
    assert runs["full"]["seen"] == source["full"]["seen"], "the one-process order is the meshes' order"
    _check_reshard(runs, source, None, "(1, 2) -> one process")


def _one_process_trainer(root: Path, callbacks: list[Any], max_steps: int) -> Any:
    import ember

    return ember.Trainer(
        max_steps=max_steps,
        strategy="single_device",
        accelerator=workload.ACCELERATOR,
        callbacks=callbacks,
        enable_checkpointing=False,
        default_root_dir=root,
        **workload.QUIET,
    )


# --- the char transformer's plan, and errors --------------------------------------------------------------


@pytest.fixture(scope="module")
def char_single(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    with workload_random_state():
        return mp_workload.char_fit("single_device", tmp_path_factory.mktemp("char"))


def _split_key_biases(params: dict[str, torch.Tensor]) -> tuple[dict[str, torch.Tensor], dict[str, torch.Tensor]]:
    """(the key projections' biases, everything else). Adding a constant to every key leaves the attention
    unchanged, so a key bias has a gradient of exactly zero but for rounding; AdamW divides that rounding
    noise by its own magnitude and moves the bias by up to lr per step whatever the noise's size. Those
    biases are compared against that bound, everything else within 1e-5."""
    key_biases = {k: v for k, v in params.items() if k.endswith("attn.k.bias")}
    return key_biases, {k: v for k, v in params.items() if k not in key_biases}


def _assert_char_run_matches(result: dict[str, Any], char_single: dict[str, Any], what: str) -> None:
    key_biases, others = _split_key_biases(result["params"])
    single_key_biases, single_others = _split_key_biases(char_single["params"])
    assert len(key_biases) == 2, sorted(result["params"])
    assert_within(others, single_others, TOLERANCE, what)
    assert_within(key_biases, single_key_biases, 6 * 3e-3, f"{what}: key biases")  # 6 steps at lr <= 3e-3


def test_the_char_transformer_plan_equals_one_process(mp_job, char_single) -> None:
    for name in ("char_tp", "char_loss_parallel"):
        for rank, result in enumerate(mp_job.results(name)):
            assert result["param_types"] == {"DTensor", "Parameter"}, name  # blocks split, embeddings replicated
            losses_within(result["losses"], char_single["losses"], TOLERANCE, f"{name} rank {rank}")
            _assert_char_run_matches(result, char_single, f"{name} rank {rank}")
            assert result["metrics"]["val/ppl"] == pytest.approx(char_single["metrics"]["val/ppl"], rel=TOLERANCE)


def test_fsdp_shards_the_char_transformer_without_applying_its_plan(mp_job, char_single) -> None:
    ranks = mp_job.results("char_fsdp")  # 2 processes x batch 4: the batches of one process with batch 8
    for rank, result in enumerate(ranks):
        assert result["param_types"] == {"DTensor"}  # every parameter sharded by FSDP
        _assert_char_run_matches(result, char_single, f"FSDP rank {rank}")
    mean = [(a + b) / 2 for a, b in zip(ranks[0]["losses"], ranks[1]["losses"], strict=True)]
    losses_within(mean, char_single["losses"], TOLERANCE, "FSDP: the mean of the ranks' losses")


def test_a_hook_that_applies_no_plan_is_an_error(mp_job) -> None:
    for result in mp_job.results("no_plan"):
        assert result["error"] is not None and "left every parameter unsharded" in result["error"]
        assert "parallelize_module" in result["error"]


def test_the_jobs_exit_cleanly(mp_job, mesh_job) -> None:
    for job in (mp_job, mesh_job):
        assert job.job.returncode == 0, harness.describe(job.job)
        assert not job.job.leftover


def _module_chunks(path: Path) -> dict[str, int]:
    metadata = ckpt.read_metadata(path)
    return {
        key: len(item.chunks)
        for key, item in metadata.state_dict_metadata.items()
        if key.startswith("/module/") and isinstance(item, TensorStorageMetadata)
    }
