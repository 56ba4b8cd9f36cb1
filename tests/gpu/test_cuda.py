"""NCCL DDP and FSDP, bf16-mixed and 16-mixed, compile and exact resume on CUDA (issues 6 and 23: tests/gpu).

Skipped without CUDA. The NCCL job runs one process per GPU (`_processes`: every GPU, as long as their number
divides the global batch of 8; with one GPU, one process with batch 8); the reference is one process with
batch 8 on ``cuda:0``. The runs are those of tests/distributed (`dist_workload`), with ``ACCELERATOR =
"cuda"``. ``benchmarks/gpu_check.sh`` runs this directory and the GPU benchmarks on a GPU machine.
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
    """One process per GPU: the most GPUs whose number divides the global batch of 8."""
    return max(n for n in range(1, torch.cuda.device_count() + 1) if 8 % n == 0)


@pytest.fixture(scope="module")
def cuda_job(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, harness.Finished]:
    directory = tmp_path_factory.mktemp("cuda_job")
    script = harness.write_script(directory, GPU_SCRIPT)
    nproc = _processes()
    job = harness.run(harness.torchrun(script, str(directory / "out"), str(8 // nproc), nproc=nproc), directory, 300)
    return directory / "out", job


class OnDevice(workload.Net):
    """`dist_workload.Net` that records where each training batch and the parameters were."""

    def __init__(self) -> None:
        super().__init__()
        self.batch_devices: set[str] = set()
        self.param_devices: set[str] = set()

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        self.batch_devices |= {str(t.device) for t in batch}
        self.param_devices |= {str(p.device) for p in self.parameters()}
        return super().training_step(batch, batch_idx)


def _fit_single(root: Path, module_cls: type[workload.Net] | None = None, **kwargs: Any) -> dict[str, Any]:
    """`dist_workload.fit_sequential` in this process on cuda:0, batch 8 (`module_cls` in place of Net)."""
    import ember

    if module_cls is None:
        return workload.summary(*workload.fit_sequential("single_device", root, batch_size=8, **kwargs))
    ember.seed_everything(workload.SEED)
    module = module_cls()
    trainer = ember.Trainer(max_steps=20, default_root_dir=root, accelerator="cuda", **workload.QUIET, **kwargs)
    train = torch.utils.data.DataLoader(workload.train_set(workload.N_SEQ), batch_size=8)
    trainer.fit(module, train)
    where = {
        "batch_devices": getattr(module, "batch_devices", None),
        "param_devices": getattr(module, "param_devices", None),
    }
    return {**workload.summary(trainer, module), **where}


@pytest.fixture(scope="module")
def cuda_single(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    """One process on cuda:0, batch 8: fp32, bf16-mixed, 16-mixed, compiled, and where things were."""
    root = tmp_path_factory.mktemp("cuda_single")
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(workload, "ACCELERATOR", "cuda")
        runs = {
            "fp32": _fit_single(root / "fp32"),
            "bf16": _fit_single(root / "bf16", precision="bf16-mixed"),
            "fp16": _fit_single(root / "fp16", precision="16-mixed"),
        }
        torch._dynamo.reset()
        runs["compiled"] = _fit_single(root / "compiled", compile=True)
        runs["placed"] = _fit_single(root / "placed", module_cls=OnDevice)
    return runs


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


def test_batches_and_parameters_are_on_the_gpu(cuda_single) -> None:
    placed = cuda_single["placed"]
    assert placed["batch_devices"] == {"cuda:0"}  # ember moved every tensor of every batch
    assert placed["param_devices"] == {"cuda:0"}
    _assert_close(placed["params"], cuda_single["fp32"]["params"], 1e-6, "the recording module vs plain Net")


def test_16_mixed_runs_the_forward_in_fp16_with_a_loss_scaler(cuda_single) -> None:
    fp16, fp32 = cuda_single["fp16"], cuda_single["fp32"]
    assert fp16["forward_dtype"] == "torch.float16"
    assert fp16["param_dtypes"] == ["torch.float32"]
    assert all(math.isfinite(loss) for loss in fp16["losses"])
    _assert_close(fp16["params"], fp32["params"], 5e-2, "16-mixed vs fp32 after 20 steps")


def test_compile_on_cuda_matches_eager(cuda_single) -> None:
    compiled, eager = cuda_single["compiled"], cuda_single["fp32"]
    assert compiled["device"] == "cuda:0" and compiled["steps"] == 20
    torch.testing.assert_close(torch.tensor(compiled["losses"]), torch.tensor(eager["losses"]), rtol=1e-3, atol=1e-4)
    _assert_close(compiled["params"], eager["params"], 1e-3, "compile=True vs eager on cuda:0")


def test_an_exact_resume_on_the_gpu_with_deterministic_algorithms(tmp_path) -> None:
    """One process on cuda:0, deterministic=True: stopped at step 10 and resumed ends bitwise where an
    uninterrupted run ends (AdamW, dropout, a shuffled loader)."""
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(workload, "ACCELERATOR", "cuda")
        run = lambda root, **kw: workload.summary(  # noqa: E731
            *workload.fit_shuffled("single_device", root, deterministic=True, **kw)
        )
        full = run(tmp_path / "full")
        stopped = run(tmp_path / "resumable", ckpt_every=5, stop_at=10, keep=-1)
        resumed = run(tmp_path / "resumable", ckpt_every=5, ckpt_path="last", keep=-1)
    assert (stopped["steps"], resumed["steps"]) == (10, full["steps"]) and full["steps"] > 10
    assert resumed["device"] == "cuda:0"
    assert resumed["losses"] == full["losses"][10:]
    harness.assert_params_equal(resumed["params"], full["params"], "resumed vs uninterrupted on cuda:0")
