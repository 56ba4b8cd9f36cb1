"""What a first multi-GPU job meets and a CPU run passes over (issue 34, item 9): 16-mixed under DDP and FSDP
over NCCL, a mid-epoch resume with epoch metrics synced across processes, async checkpoints on CUDA (resumed
bitwise, staged outside device memory), a checkpoint written by every GPU resumed in one process, and batches
that are not dicts reaching the GPU.

Skipped without CUDA. The NCCL job (`dist_workload.gpu_resume_job`) runs one process per GPU, as in
test_cuda.py; ``benchmarks/gpu_check.sh`` runs this directory on a GPU machine. The job itself also runs over
gloo with ``accelerator="cpu"`` (how it was tried on a machine without a GPU).
"""

from __future__ import annotations

import dataclasses
import math
import sys
from collections import UserDict, namedtuple
from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import Any

import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "distributed"))

import dist_harness as harness
import dist_workload as workload
from torch.utils.data import DataLoader, TensorDataset, default_collate

#: Where the one-process tests train (``cuda:0``; a CPU try of this file sets it to ``cpu``).
DEVICE = torch.device("cuda", 0)

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(
        not torch.cuda.is_available(),
        reason=f"needs CUDA: torch {torch.__version__} (CUDA build: {torch.version.cuda}) sees no CUDA device",
    ),
]

JOB = """\
import sys
from pathlib import Path

import dist_workload

getattr(dist_workload, sys.argv[1])(Path(sys.argv[2]), *sys.argv[3:])
"""


def _processes() -> int:
    """One process per GPU: the most GPUs whose number divides the global batch of 8."""
    return max(n for n in range(1, torch.cuda.device_count() + 1) if 8 % n == 0)


@pytest.fixture(scope="module")
def job(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, harness.Finished, Path]:
    directory = tmp_path_factory.mktemp("cuda_resume_job")
    script = harness.write_script(directory, JOB)
    nproc = _processes()
    cmd = harness.torchrun(script, "gpu_resume_job", str(directory / "out"), str(8 // nproc), "cuda", nproc=nproc)
    return directory / "out", harness.run(cmd, directory, 200), script


def _ranks(job: tuple[Path, harness.Finished, Path], name: str) -> list[dict[str, Any]]:
    out, finished, _ = job
    return harness.results(out, name, _processes(), finished)


def check_16_mixed(ranks: list[dict[str, Any]], reference: dict[str, torch.Tensor], what: str) -> None:
    """Each rank ran the forward in fp16, kept fp32 parameters, and ends near the fp32 one-process run."""
    for rank, result in enumerate(ranks):
        assert result["forward_dtype"] == "torch.float16", f"{what} rank {rank}"
        assert result["param_dtypes"] == ["torch.float32"], f"{what} rank {rank}"
        assert result["steps"] == 20 and all(math.isfinite(loss) for loss in result["losses"]), f"{what} rank {rank}"
        for key, value in reference.items():
            diff = float((result["params"][key].double() - value.double()).abs().max())
            assert diff <= 5e-2, f"{what} rank {rank}: {key} off the fp32 run by {diff:.3g}"
        harness.assert_params_equal(result["params"], ranks[0]["params"], f"{what}: rank {rank} vs rank 0")


def check_resumed_bitwise(ranks: list[dict[str, Any]], what: str) -> None:
    """Stopped mid-epoch and resumed from ``last``: the steps after the stop and the final weights are those of the
    uninterrupted run, on every rank."""
    for rank, result in enumerate(ranks):
        full, stopped, resumed = result["full"], result["stopped"], result["resumed"]
        assert 0 < stopped["steps"] < full["steps"] == resumed["steps"], f"{what} rank {rank}"
        assert resumed["losses"] == full["losses"][stopped["steps"] :], f"{what} rank {rank}: the resumed steps differ"
        harness.assert_params_equal(resumed["params"], full["params"], f"{what} rank {rank}: resumed vs uninterrupted")


def check_synced_epoch_metrics(ranks: list[dict[str, Any]]) -> None:
    """The epoch metrics synced across processes (sum, max, mean) after a mid-epoch resume equal the uninterrupted
    run's, and every rank holds the same values."""
    check_resumed_bitwise(ranks, "synced epoch metrics")
    names = [f"train/loss_{fx}" for fx in ("sum", "max", "mean")]
    for rank, result in enumerate(ranks):
        full, resumed = result["full"]["metrics"], result["resumed"]["metrics"]
        for name in names:
            assert resumed[name] == pytest.approx(full[name], rel=1e-6), f"rank {rank}: {name}"
            assert resumed[name] == ranks[0]["resumed"]["metrics"][name], f"rank {rank}: {name} differs from rank 0"
    assert ranks[0]["resumed"]["metrics"]["train/loss_max"] == ranks[0]["full"]["metrics"]["train/loss_max"]


def check_staging_memory(ranks: list[dict[str, Any]], what: str) -> None:
    """An async checkpoint every step raises the device's peak by less than half the state it stages: the staged
    copy is in host memory (a copy on the device would add all of it)."""
    for rank, result in enumerate(ranks):
        sync, asynchronous = result["sync"], result["async"]
        extra = asynchronous["peak_bytes"] - sync["peak_bytes"]
        assert extra < sync["state_bytes"] / 2, (
            f"{what} rank {rank}: async saves add {extra} bytes at the peak for {sync['state_bytes']} bytes of state"
        )
        harness.assert_params_equal(asynchronous["params"], sync["params"], f"{what} rank {rank}: async vs sync")


def test_16_mixed_under_nccl_ddp_and_fsdp(job, tmp_path) -> None:
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(workload, "ACCELERATOR", "cuda")
        reference = workload.summary(*workload.fit_sequential("single_device", tmp_path, batch_size=8))["params"]
    check_16_mixed(_ranks(job, "ddp_16"), reference, "16-mixed DDP")
    check_16_mixed(_ranks(job, "fsdp_16"), reference, "16-mixed FSDP")


def test_a_mid_epoch_resume_with_synced_epoch_metrics_on_nccl(job) -> None:
    check_synced_epoch_metrics(_ranks(job, "synced_resume"))


@pytest.mark.parametrize("strategy", ["ddp", "fsdp"])
def test_async_checkpoints_on_cuda_resume_bitwise(job, strategy: str) -> None:
    check_resumed_bitwise(_ranks(job, f"async_{strategy}"), f"async saves under {strategy}")


@pytest.mark.parametrize("strategy", ["ddp", "fsdp"])
def test_async_checkpoints_stage_outside_device_memory(job, strategy: str) -> None:
    check_staging_memory(_ranks(job, f"async_{strategy}_memory"), f"async saves under {strategy}")


@pytest.mark.skipif(
    torch.cuda.device_count() < 2,
    reason=f"needs 2 CUDA devices to write a checkpoint on more GPUs than it resumes on; torch sees "
    f"{torch.cuda.device_count()}",
)
def test_a_checkpoint_written_by_every_gpu_resumes_in_one_process_on_one_gpu(job) -> None:
    out, _, script = job
    stopped = _ranks(job, "for_one_process")
    env = harness.clean_env({"CUDA_VISIBLE_DEVICES": "0"})  # one device: the checkpoint holds every GPU's streams
    finished = harness.run([sys.executable, str(script), "one_process_resume_job", str(out)], script.parent, 120, env)
    (resumed,) = harness.results(out, "one_process", 1, finished)
    assert resumed["device"] == "cuda:0" and resumed["world_size"] == 1
    assert resumed["steps"] > stopped[0]["steps"], "the resume trained nothing"
    assert resumed["losses"] and all(math.isfinite(loss) for loss in resumed["losses"])


# --- batches that are not dicts -------------------------------------------------------------------------------


class Encoding(Mapping[str, Any]):
    """A read-only mapping with a ``.to`` of its own, shaped like Hugging Face's ``BatchEncoding``."""

    def __init__(self, data: dict[str, Any]) -> None:
        self.data = data

    def __getitem__(self, key: str) -> Any:
        return self.data[key]

    def __iter__(self) -> Iterator[str]:
        return iter(self.data)

    def __len__(self) -> int:
        return len(self.data)

    def to(self, device: Any) -> Encoding:
        return Encoding({k: v.to(device) for k, v in self.data.items()})


@dataclasses.dataclass
class Pair:
    x: torch.Tensor
    y: torch.Tensor


class Movable:
    """Any object with a ``.to(device)`` (a packed sequence, a graph batch)."""

    def __init__(self, x: torch.Tensor, y: torch.Tensor) -> None:
        self.x, self.y = x, y

    def to(self, device: Any) -> Movable:
        return Movable(self.x.to(device), self.y.to(device))


XY = namedtuple("XY", ["x", "y"])
CONTAINERS = {
    "UserDict": lambda x, y: UserDict({"x": x, "y": y}),
    "Mapping with .to": lambda x, y: Encoding({"x": x, "y": y}),
    "dataclass": Pair,
    "object with .to": Movable,
    "namedtuple": XY,
}


def _fields(batch: Any) -> tuple[torch.Tensor, torch.Tensor]:
    if isinstance(batch, Mapping):  # UserDict and Encoding
        return batch["x"], batch["y"]
    return batch.x, batch.y


class Where(workload.Net):
    """`dist_workload.Net` over batches of any container: records the container type and its tensors' devices."""

    def __init__(self) -> None:
        super().__init__()
        self.seen: list[tuple[str, set[str]]] = []

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        x, y = _fields(batch)
        self.seen.append((type(batch).__name__, {str(x.device), str(y.device)}))
        return self.loss_fn(self(x), y)


@pytest.mark.parametrize("container", list(CONTAINERS))
def test_batches_of_any_container_reach_the_gpu(container: str, tmp_path: Path) -> None:
    import ember

    make = CONTAINERS[container]
    given: list[Any] = []

    def collate(items: list[tuple[torch.Tensor, torch.Tensor]]) -> Any:
        given.append(make(*default_collate(items)))
        return given[-1]

    loader = DataLoader(TensorDataset(*workload.features(16, 0)), batch_size=4, collate_fn=collate)
    module = Where()
    trainer = ember.Trainer(max_steps=4, default_root_dir=tmp_path, accelerator=DEVICE.type, **workload.QUIET)
    trainer.fit(module, loader)
    assert len(module.seen) == 4
    for name, devices in module.seen:
        assert name == type(given[0]).__name__, "the batch changed its type on the way"
        assert devices == {str(DEVICE)}, f"{container}: a tensor stayed on {devices}"
    assert all(t.device.type == "cpu" for t in _fields(given[0])), "the loader's batch was changed in place"
