"""`ModelParallelStrategy` over NCCL: tensor parallel (with FSDP2 over the rest of the GPUs) against one GPU,
and an exact resume with deterministic=True (issue 23). Needs at least 2 CUDA devices (one TP group of 2);
with more, the data-parallel size is the GPU count / 2 (all GPUs whose number keeps the global batch of 8
divisible). The runs are tests/distributed/mp_workload.py's, with ``ACCELERATOR = "cuda"``.
"""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "distributed"))

import dist_harness as harness
import dist_workload as workload

HERE = Path(__file__).resolve().parent
DISTRIBUTED = HERE.parent / "distributed"

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(
        torch.cuda.device_count() < 2,
        reason=f"needs 2 CUDA devices for a tensor-parallel group; torch sees {torch.cuda.device_count()}",
    ),
]

SCRIPT = f"""\\
import sys
from pathlib import Path

sys.path[:0] = [{str(DISTRIBUTED)!r}, {str(HERE.parents[1])!r}]
import dist_workload as W
import mp_workload as M

W.ACCELERATOR = "cuda"
out, dp = Path(sys.argv[1]), int(sys.argv[2])
tp = lambda: M.model_parallel(dp, 2)
W.section(out, "cuda_tp_seq", lambda: M.summary(*M.fit_sequential(tp(), out / "seq", dp=dp)))
W.section(out, "cuda_tp_resume", lambda: M.resume_runs(out, "resume", tp, dp, None, dropout=0.2, deterministic=True))
"""


def _processes() -> int:
    """GPUs in TP groups of 2, as many groups as keep 8 / dp an integer."""
    return 2 * max(dp for dp in range(1, torch.cuda.device_count() // 2 + 1) if 8 % dp == 0)


@pytest.fixture(scope="module")
def tp_job(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, harness.Finished, int]:
    directory = tmp_path_factory.mktemp("cuda_tp_job")
    script = harness.write_script(directory, SCRIPT)
    nproc = _processes()
    job = harness.run(harness.torchrun(script, str(directory / "out"), str(nproc // 2), nproc=nproc), directory, 300)
    return directory / "out", job, nproc


def _results(tp_job: tuple[Path, harness.Finished, int], name: str) -> list[dict[str, Any]]:
    out, job, nproc = tp_job
    return harness.results(out, name, nproc, job)


def test_tensor_parallel_on_nccl_matches_one_gpu(tp_job, tmp_path) -> None:
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(workload, "ACCELERATOR", "cuda")
        reference = workload.summary(*workload.fit_sequential("single_device", tmp_path, batch_size=8))
    for rank, result in enumerate(_results(tp_job, "cuda_tp_seq")):
        assert (result["backend"], result["device"]) == ("nccl", f"cuda:{rank % torch.cuda.device_count()}")
        assert result["mesh"][1] == 2 and result["steps"] == 20
        for key, value in reference["params"].items():
            diff = float((result["params"][key].double() - value.double()).abs().max())
            assert diff <= 1e-4, f"rank {rank}: {key} differs from one GPU by {diff:.3g}"


def test_a_tensor_parallel_checkpoint_resumes_bitwise_on_nccl(tp_job) -> None:
    for rank, result in enumerate(_results(tp_job, "cuda_tp_resume")):
        full, stopped, resumed = result["full"], result["stopped"], result["resumed"]
        assert (stopped["steps"], resumed["steps"]) == (10, full["steps"])
        assert resumed["losses"] == full["losses"][10:], f"rank {rank}"
        harness.assert_params_equal(resumed["params"], full["params"], f"rank {rank}: resumed vs uninterrupted")
