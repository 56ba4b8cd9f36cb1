"""Which GPU a process of a multi-process job takes, with CUDA stood in for (``torch.cuda`` patched).

One process per GPU of a node takes ``cuda:LOCAL_RANK``; a process bound to one GPU (SLURM
``--gpus-per-task=1``: ``CUDA_VISIBLE_DEVICES`` names one device) sees it as ``cuda:0``.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
import torch.distributed as dist

import ember
from ember.strategies import DDPStrategy
from ember.strategies.parallel import cuda_index
from ember.strategies.precision import Precision

LAUNCHER_VARS = ("TORCHELASTIC_RUN_ID", "RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT")


@pytest.mark.parametrize(("local_rank", "visible", "index"), [(0, 8, 0), (5, 8, 5), (5, 1, 0), (0, 1, 0)])
def test_the_device_index_of_a_process(local_rank: int, visible: int, index: int) -> None:
    assert cuda_index(local_rank, visible) == index


def test_more_processes_than_visible_devices_is_a_clear_error(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "0,1")
    with pytest.raises(RuntimeError, match=r"local rank 3 sees 2 CUDA devices \(CUDA_VISIBLE_DEVICES=0,1\)"):
        cuda_index(3, 2)


@pytest.fixture
def slurm_task_with_one_gpu(monkeypatch: pytest.MonkeyPatch) -> list[torch.device]:
    """Task 5 of 8 on one node, its GPU bound by SLURM (it sees one device); `torch.cuda.set_device` recorded."""
    for name in LAUNCHER_VARS:
        monkeypatch.delenv(name, raising=False)
    slurm = dict(SLURM_NTASKS="8", SLURM_PROCID="5", SLURM_LOCALID="5", SLURM_NODEID="0", SLURM_NNODES="1",
                 SLURM_JOB_NAME="train", SLURM_NODELIST="node1", CUDA_VISIBLE_DEVICES="5")  # fmt: skip
    for name, value in slurm.items():
        monkeypatch.setenv(name, value)
    set_devices: list[torch.device] = []
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    monkeypatch.setattr(torch.cuda, "set_device", set_devices.append)
    return set_devices


def test_devices_8_under_slurm_with_one_gpu_per_task_is_accepted(slurm_task_with_one_gpu, tmp_path: Path) -> None:
    trainer = ember.Trainer(devices=8, accelerator="cuda", logger=False, default_root_dir=tmp_path)
    assert isinstance(trainer.strategy, DDPStrategy)


def test_a_slurm_task_with_one_gpu_takes_cuda_0(slurm_task_with_one_gpu, monkeypatch: pytest.MonkeyPatch) -> None:
    strategy = DDPStrategy()
    strategy.configure(Precision(), devices=8, accelerator="cuda")
    monkeypatch.setattr(dist, "is_initialized", lambda: True)  # the process group exists already
    strategy.checkpoint_group = strategy.flag_group = "made earlier"
    strategy.setup_environment()
    assert strategy.root_device == torch.device("cuda", 0)
    assert slurm_task_with_one_gpu == [torch.device("cuda", 0)]


def test_devices_beyond_this_machine_without_a_launcher_are_refused(monkeypatch: pytest.MonkeyPatch) -> None:
    for name in LAUNCHER_VARS:
        monkeypatch.delenv(name, raising=False)
    monkeypatch.delenv("SLURM_NTASKS", raising=False)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)
    with pytest.raises(ValueError, match="devices=4 but this machine has 2 CUDA device"):
        ember.Trainer(devices=4, accelerator="cuda", logger=False)


def test_the_nccl_group_is_bound_to_the_process_gpu(slurm_task_with_one_gpu, monkeypatch: pytest.MonkeyPatch) -> None:
    calls: list[tuple[str, dict[str, object]]] = []
    monkeypatch.setattr(dist, "is_initialized", lambda: bool(calls))
    monkeypatch.setattr(dist, "init_process_group", lambda backend, **kw: calls.append((backend, kw)))
    monkeypatch.setattr(dist, "get_backend", lambda *_: "nccl")
    monkeypatch.setattr(dist, "barrier", lambda **kw: calls.append(("barrier", kw)))
    monkeypatch.setattr("ember.strategies.parallel.atexit.register", lambda *_: None)
    for name in ("MASTER_ADDR", "MASTER_PORT", "RANK", "WORLD_SIZE", "LOCAL_RANK"):
        monkeypatch.setenv(name, "placeholder")  # recorded, so what setup_environment exports is undone
        monkeypatch.delenv(name)
    strategy = DDPStrategy()
    strategy.configure(Precision(), devices=8, accelerator="cuda")
    strategy.checkpoint_group = strategy.flag_group = "made earlier"
    strategy.setup_environment()
    strategy.barrier()
    (backend, options), barrier = calls
    assert backend == "nccl" and options["device_id"] == torch.device("cuda", 0)
    assert barrier == ("barrier", {"device_ids": [0]})


def test_a_gloo_barrier_names_no_device(monkeypatch: pytest.MonkeyPatch) -> None:
    calls: list[dict[str, object]] = []
    monkeypatch.setattr(dist, "is_initialized", lambda: True)
    monkeypatch.setattr(dist, "get_backend", lambda *_: "gloo")
    monkeypatch.setattr(dist, "barrier", lambda **kw: calls.append(kw))
    DDPStrategy().barrier()
    assert calls == [{}]
