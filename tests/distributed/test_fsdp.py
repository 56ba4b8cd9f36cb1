"""FSDP2 with 2 processes, and checkpoints across strategies and world sizes (issue 6, "must show" 2).

Sections of the shared 2-process job (`conftest.main_job`): ``fsdp_seq`` is ``ddp_seq`` under FSDP;
``fsdp_resume`` runs the shuffled AdamW/dropout fit uninterrupted, then stopped at step 10 with a
checkpoint every 5 steps, then resumed from ``last`` in a new Trainer. The one-process resumes run here.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import dist_harness as harness
import dist_workload as workload
import pytest
import torch
from torch.distributed.checkpoint.metadata import TensorStorageMetadata
from torch.utils.data import DataLoader

import ember
from ember import checkpoint as ckpt

pytestmark = pytest.mark.distributed

ASYNC_SCRIPT = """\
import sys
from pathlib import Path

import dist_workload

dist_workload.async_job(Path(sys.argv[1]))
"""


COMPILE_SCRIPT = """\
import sys
from pathlib import Path

import torch
from torch._dynamo.utils import counters
from torch.utils.data import DataLoader

import dist_workload as W
import ember


def fit(strategy, compile_):
    torch.manual_seed(0)
    module = W.Net(accuracy=False)  # no validation
    trainer = ember.Trainer(
        max_epochs=2, strategy=strategy, devices=2, compile=compile_, logger=False, enable_progress_bar=False,
        enable_model_summary=False, enable_checkpointing=False, num_sanity_val_steps=0,
    )
    trainer.fit(module, DataLoader(W.train_set(64), batch_size=8))
    return module


for name, make in (("ddp", W.ddp), ("fsdp", W.fsdp)):
    torch._dynamo.reset()
    counters.clear()
    eager, compiled = fit(make(), False), fit(make(), True)
    W.save_result(Path(sys.argv[1]), f"compile_{name}", {
        "eager": eager.losses,
        "compiled": compiled.losses,
        "graphs": counters["stats"]["unique_graphs"],
        "compiled_modules": [n for n, m in compiled.named_modules() if m._compiled_call_impl is not None],
    })
"""


@pytest.mark.slow
def test_compile_under_ddp_compiles_the_model_and_under_fsdp_each_sharded_block(tmp_path) -> None:
    script = harness.write_script(tmp_path, COMPILE_SCRIPT)
    job = harness.run(harness.spawn(script, "out"), tmp_path, timeout=300)
    expected = {"ddp": ["model"], "fsdp": ["model.1", "model.2"]}  # FSDP: the two Blocks, not the root
    for name, compiled_modules in expected.items():
        for result in harness.results(tmp_path / "out", f"compile_{name}", 2, job):
            assert result["compiled_modules"] == compiled_modules, name
            assert result["graphs"] >= 1, name
            assert len(result["compiled"]) == len(result["eager"]) == 8  # 64 samples, 2 ranks, batch 8, 2 epochs
            torch.testing.assert_close(torch.tensor(result["compiled"]), torch.tensor(result["eager"]))
    assert job.returncode == 0, harness.describe(job)


def test_fsdp_losses_match_ddp(main_job, single) -> None:
    fsdp, ddp = main_job.results("fsdp_seq"), main_job.results("ddp_seq")
    for rank in range(2):
        assert (fsdp[rank]["strategy"], fsdp[rank]["steps"]) == ("FSDPStrategy", 20)
        assert len(fsdp[rank]["losses"]) == 20
        torch.testing.assert_close(
            torch.tensor(fsdp[rank]["losses"]), torch.tensor(ddp[rank]["losses"]), rtol=1e-5, atol=1e-6
        )
        harness.assert_params_close(fsdp[rank]["params"], ddp[rank]["params"], f"FSDP vs DDP, rank {rank}")
        harness.assert_params_close(fsdp[rank]["params"], single["seq"]["params"], f"FSDP rank {rank} vs 1 process")
    harness.assert_params_equal(fsdp[0]["params"], fsdp[1]["params"], "FSDP rank 0 vs rank 1 (gathered)")


def test_a_sharded_fsdp_checkpoint_resumes_bitwise_under_fsdp(main_job) -> None:
    for rank, result in enumerate(main_job.results("fsdp_resume")):
        full, stopped, resumed = result["full"], result["stopped"], result["resumed"]
        assert (stopped["steps"], resumed["steps"], full["steps"]) == (10, 36, 36)
        harness.assert_params_equal(resumed["params"], full["params"], f"rank {rank}: resumed vs uninterrupted")
        assert resumed["losses"] == full["losses"][10:], f"rank {rank}: the steps after the resume differ"
        assert resumed["seen"] == full["seen"][10:], f"rank {rank}: the resumed run saw other samples"
    path = Path(result["ckpt"])
    assert path.name == "epoch=0-step=10"
    # Sharded: every module tensor is stored as one chunk per rank, each rank wrote its own file.
    chunks = _module_chunks(path)
    assert chunks and all(n == 2 for n in chunks.values()), chunks
    for rank in range(2):
        assert (path / f"__{rank}_0.distcp").stat().st_size > 0
        assert (path / f"rank-{rank}.pt").exists()


def test_a_ddp_checkpoint_is_not_sharded(main_job) -> None:
    chunks = _module_chunks(Path(main_job.results("ddp_seq")[0]["ckpt"]))
    assert chunks and all(n == 1 for n in chunks.values()), chunks


def test_every_rank_sees_the_final_checkpoint_as_last_when_fit_returns(main_job) -> None:
    """`fit(); fit(ckpt_path="last")` or `test(ckpt_path="last")` on every rank must pick the same checkpoint."""
    ranks = main_job.results("ddp_seq")
    final = Path(ranks[0]["ckpt"]).name
    assert [r["last_on_return"] for r in ranks] == [final, final]


def test_background_checkpoint_writes_neither_hang_nor_change_training(main_job, tmp_path) -> None:
    """``ModelCheckpoint(every_n_train_steps=1, async_save=True)`` under DDP and FSDP: each write's collectives
    run in a background thread while training (and the preemption flag) go on in the main one."""
    script = harness.write_script(tmp_path, ASYNC_SCRIPT)
    job = harness.run(harness.spawn(script, "out"), tmp_path, timeout=150)
    references = {
        "async_ddp": main_job.results("ddp_shuffled"),
        "async_fsdp": [r["full"] for r in main_job.results("fsdp_resume")],
    }
    for name, reference in references.items():
        ranks = harness.results(tmp_path / "out", name, 2, job)
        for rank, result in enumerate(ranks):
            assert result["steps"] == 36
            harness.assert_params_equal(result["params"], reference[rank]["params"], f"{name} rank {rank}")
        path = Path(ranks[0]["ckpt"])
        assert path.name.endswith("step=36"), path
        harness.assert_params_equal(ckpt.read_module_state(path)[1], ranks[0]["params"], f"{name}: final checkpoint")
    assert job.returncode == 0, harness.describe(job)


class _LoadedWeights(ember.Callback):
    """The module's weights when training is about to start (after the checkpoint was loaded)."""

    def on_fit_start(self, trainer: Any, module: Any) -> None:
        self.weights = {k: v.detach().clone() for k, v in module.state_dict().items()}


def _resume_in_one_process(path: Path, tmp_path: Path, loader: DataLoader, **kwargs: Any) -> tuple[Any, Any]:
    module, loaded = workload.Net(**kwargs), _LoadedWeights()
    trainer = ember.Trainer(
        max_steps=25,
        strategy="single_device",
        accelerator=workload.ACCELERATOR,
        callbacks=[loaded],
        enable_checkpointing=False,
        default_root_dir=tmp_path,
        **workload.QUIET,
    )
    with pytest.warns(RuntimeWarning, match=r"written by 2 process\(es\) and resumes on 1"):
        trainer.fit(module, loader, ckpt_path=path)
    return trainer, loaded.weights


def test_a_ddp_checkpoint_resumes_in_one_process(main_job, tmp_path, own_random_state) -> None:
    rank0 = main_job.results("ddp_seq")[0]
    path = Path(rank0["ckpt"])
    loader = DataLoader(workload.train_set(workload.N_SEQ), batch_size=8)
    trainer, weights = _resume_in_one_process(path, tmp_path, loader)
    harness.assert_params_equal(weights, ckpt.read_module_state(path)[1], "loaded vs the checkpoint's")
    harness.assert_params_equal(weights, rank0["params"], "loaded vs the DDP run's final weights")
    assert trainer.global_step == 25  # continued from step 20


def test_an_fsdp_checkpoint_resumes_in_one_process(main_job, tmp_path, own_random_state) -> None:
    rank0 = main_job.results("fsdp_resume")[0]
    path = Path(rank0["ckpt"])
    loader = DataLoader(workload.train_set(workload.N_SHUFFLED), batch_size=4, shuffle=True)
    trainer, weights = _resume_in_one_process(path, tmp_path, loader, dropout=0.2, adamw=True)
    harness.assert_params_equal(weights, ckpt.read_module_state(path)[1], "loaded vs the checkpoint's")
    harness.assert_params_equal(weights, rank0["stopped"]["params"], "loaded vs the FSDP run at step 10")
    assert trainer.global_step == 25  # continued from step 10


def _module_chunks(path: Path) -> dict[str, int]:
    """Stored chunks per module tensor of a checkpoint."""
    metadata = ckpt.read_metadata(path)
    return {
        key: len(item.chunks)
        for key, item in metadata.state_dict_metadata.items()
        if key.startswith("/module/") and isinstance(item, TensorStorageMetadata)
    }
