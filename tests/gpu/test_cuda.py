"""NCCL DDP, bf16 mixed precision and FSDP on CUDA (issue 6, "Build": tests/gpu).

Skipped without CUDA. One process per GPU, at most 2 (with one GPU the NCCL job has one process, batch 8;
with two, 2 x batch 4); the reference is one process with batch 8 on ``cuda:0``. The runs are those of
tests/distributed (`dist_workload`), with ``ACCELERATOR = "cuda"``. ``benchmarks/gpu_check.sh`` runs this file
and the benchmarks on a GPU machine.
"""

from __future__ import annotations

import math
import sys
from pathlib import Path
from typing import Any

import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "distributed"))

import dist_harness as harness
import dist_workload as workload

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(
        not torch.cuda.is_available(),
        reason=f"needs CUDA: torch {torch.__version__} (CUDA build: {torch.version.cuda}) sees no CUDA device",
    ),
]

GPU_SCRIPT = """\
import sys
from pathlib import Path

import dist_workload

dist_workload.gpu_job(Path(sys.argv[1]), sys.argv[2])
"""


def _processes() -> int:
    return min(torch.cuda.device_count(), 2)


@pytest.fixture(scope="module")
def cuda_job(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, harness.Finished]:
    directory = tmp_path_factory.mktemp("cuda_job")
    script = harness.write_script(directory, GPU_SCRIPT)
    nproc = _processes()
    job = harness.run(harness.torchrun(script, str(directory / "out"), str(8 // nproc), nproc=nproc), directory, 300)
    return directory / "out", job


@pytest.fixture(scope="module")
def cuda_single(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    """One process on cuda:0, batch 8: fp32 and bf16-mixed."""
    root = tmp_path_factory.mktemp("cuda_single")
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(workload, "ACCELERATOR", "cuda")
        fp32 = workload.summary(*workload.fit_sequential("single_device", root / "fp32", batch_size=8))
        bf16 = workload.summary(
            *workload.fit_sequential("single_device", root / "bf16", batch_size=8, precision="bf16-mixed")
        )
    return {"fp32": fp32, "bf16": bf16}


def _results(cuda_job: tuple[Path, harness.Finished], name: str) -> list[dict[str, Any]]:
    out, job = cuda_job
    return harness.results(out, name, _processes(), job)


def _assert_close(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor], tolerance: float, what: str) -> None:
    assert a.keys() == b.keys(), what
    for key in a:
        diff = float((a[key].double() - b[key].double()).abs().max())
        assert torch.allclose(a[key], b[key], rtol=tolerance, atol=tolerance / 10), f"{what}: {key} off by {diff:.3g}"


def test_nccl_ddp_matches_one_process(cuda_job, cuda_single) -> None:
    ranks = _results(cuda_job, "cuda_ddp")
    for rank, result in enumerate(ranks):
        assert (result["backend"], result["device"], result["strategy"]) == ("nccl", f"cuda:{rank}", "DDPStrategy")
        assert result["steps"] == 20
        _assert_close(result["params"], cuda_single["fp32"]["params"], 1e-4, f"NCCL DDP rank {rank} vs 1 process")
        harness.assert_params_equal(result["params"], ranks[0]["params"], f"rank {rank} vs rank 0")


def test_bf16_mixed_runs_the_forward_in_bf16_and_keeps_fp32_weights(cuda_single) -> None:
    bf16, fp32 = cuda_single["bf16"], cuda_single["fp32"]
    assert bf16["device"] == "cuda:0"
    assert bf16["forward_dtype"] == "torch.bfloat16"
    assert bf16["param_dtypes"] == ["torch.float32"]
    assert all(math.isfinite(loss) for loss in bf16["losses"])
    _assert_close(bf16["params"], fp32["params"], 5e-2, "bf16-mixed vs fp32 after 20 steps")


def test_fsdp_on_cuda_matches_one_process(cuda_job, cuda_single) -> None:
    for rank, result in enumerate(_results(cuda_job, "cuda_fsdp")):
        assert (result["backend"], result["device"], result["strategy"]) == ("nccl", f"cuda:{rank}", "FSDPStrategy")
        _assert_close(result["params"], cuda_single["fp32"]["params"], 1e-4, f"FSDP rank {rank} vs 1 process")


def test_fsdp_bf16_parameters_on_cuda(cuda_job, cuda_single) -> None:
    for rank, result in enumerate(_results(cuda_job, "cuda_fsdp_bf16")):
        assert result["forward_dtype"] == "torch.bfloat16", rank  # FSDP's param_dtype: gathered in bf16
        assert result["param_dtypes"] == ["torch.float32"], rank  # the sharded parameters stay fp32
        assert all(math.isfinite(loss) for loss in result["losses"]), rank
        _assert_close(result["params"], cuda_single["fp32"]["params"], 5e-2, f"FSDP bf16 rank {rank} vs fp32")


def test_fsdp_checkpoint_resumes_bitwise_on_cuda(cuda_job) -> None:
    for rank, result in enumerate(_results(cuda_job, "cuda_fsdp_resume")):
        full, stopped, resumed = result["full"], result["stopped"], result["resumed"]
        assert (stopped["steps"], resumed["steps"]) == (10, full["steps"])
        assert resumed["losses"] == full["losses"][10:], f"rank {rank}: the steps after the resume differ"
        harness.assert_params_equal(resumed["params"], full["params"], f"rank {rank}: resumed vs uninterrupted")
