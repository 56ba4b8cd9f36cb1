"""``Trainer(devices=2)`` without a launcher re-runs the program under torch's elastic launcher; ``num_nodes``
must agree with the launcher (issue 6, "Build": environments; DESIGN.md section 8).

The re-launch test starts a plain ``python job.py``; the ``num_nodes`` checks run in the pytest process with a
torchrun environment set by hand (they fail before any process group is joined).
"""

from __future__ import annotations

import sys

import dist_harness as harness
import dist_workload as workload
import pytest
import torch
import torch.distributed as dist
from torch.utils.data import DataLoader

import ember
from ember.strategies import DDPStrategy

RELAUNCH_SCRIPT = """\
import os
import sys
from pathlib import Path

import dist_workload

out = Path(sys.argv[1])
out.mkdir(exist_ok=True)
(out / f"started-{os.getpid()}").write_text(os.environ.get("RANK", "no launcher"))
dist_workload.sequential_job(out, "relaunched", devices="2", strategy="ddp")
"""


@pytest.mark.distributed
def test_devices_2_from_plain_python_relaunches_in_two_processes(main_job, tmp_path) -> None:
    script = harness.write_script(tmp_path, RELAUNCH_SCRIPT)
    job = harness.Job([sys.executable, str(script), "out"], tmp_path)
    launcher = job.proc.pid
    finished = job.wait(timeout=150)
    assert finished.returncode == 0, harness.describe(finished)
    assert "ember: starting 2 processes" in finished.output
    started = {p.name: p.read_text() for p in (tmp_path / "out").glob("started-*")}
    assert sorted(started.values()) == ["0", "1", "no launcher"], started
    assert started[f"started-{launcher}"] == "no launcher"
    ranks = harness.results(tmp_path / "out", "relaunched", 2)
    for rank, result in enumerate(ranks):
        assert (result["rank"], result["world_size"], result["kind"]) == (rank, 2, "torchelastic")
        assert (result["strategy"], result["steps"]) == ("DDPStrategy", 20)
        assert result["pid"] != launcher
    reference = main_job.results("ddp_seq")
    for rank in range(2):
        harness.assert_params_equal(ranks[rank]["params"], reference[rank]["params"], f"re-launched rank {rank}")


def _loader() -> DataLoader:
    return DataLoader(workload.train_set(workload.N_SEQ), batch_size=4)


def test_num_nodes_without_a_launcher_is_a_clear_error(own_random_state) -> None:
    trainer = ember.Trainer(strategy="ddp", devices=2, num_nodes=2, accelerator="cpu", **workload.QUIET)
    with pytest.raises(
        RuntimeError, match=r"num_nodes=2 needs a launcher on every node.*--nnodes=2 --nproc-per-node=2"
    ):
        trainer.fit(workload.Net(), _loader())
    assert not dist.is_initialized()


@pytest.mark.parametrize(("devices", "num_nodes", "says"), [(2, 2, "expects 4 processes"), ("auto", 3, "num_nodes=3")])
def test_num_nodes_that_disagree_with_the_launcher_are_a_clear_error(
    monkeypatch, own_random_state, devices, num_nodes, says
) -> None:
    torchrun_env = {
        "TORCHELASTIC_RUN_ID": "test",
        "RANK": "0",
        "WORLD_SIZE": "2",
        "LOCAL_RANK": "0",
        "LOCAL_WORLD_SIZE": "2",
        "GROUP_RANK": "0",
        "MASTER_ADDR": "127.0.0.1",
        "MASTER_PORT": str(harness.free_port()),
    }
    for key, value in torchrun_env.items():
        monkeypatch.setenv(key, value)
    with pytest.raises((RuntimeError, ValueError)) as error:
        trainer = ember.Trainer(
            strategy=DDPStrategy(timeout_s=5), devices=devices, num_nodes=num_nodes, accelerator="cpu", **workload.QUIET
        )
        trainer.fit(workload.Net(), _loader())
    message = str(error.value)
    assert says in message and "WORLD_SIZE=2" in message, message
    assert "devices=0" not in message and "nproc-per-node=0" not in message, f"a count nobody asked for: {message}"
    assert not dist.is_initialized()


#: The smallest run `ember predict` can make, for the test below: the digits example would have each of its three
#: processes (the launcher and two workers) import torchmetrics and scikit-learn, about 3 s of CPU apiece.
PREDICT_MODULE = """\
import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

import ember


class Classifier(ember.TrainingModule):
    def __init__(self) -> None:
        super().__init__()
        self.model = nn.Linear(4, 3)


class Data(ember.DataModule):
    def predict_dataloader(self) -> DataLoader:
        return DataLoader(TensorDataset(torch.randn(40, 4, generator=torch.Generator().manual_seed(0))), batch_size=8)
"""
PREDICT_CONFIG = """\
seed: 0
module:
  _target_: predict_job.Classifier
data:
  _target_: predict_job.Data
"""


@pytest.mark.distributed
def test_ember_predict_on_two_processes_prints_its_summary_once(tmp_path) -> None:
    """Each process saves its share; only process 0 prints (issue 21: "predict done" came from both ranks)."""
    import os
    import subprocess
    from pathlib import Path

    repo = Path(__file__).resolve().parents[2]
    (tmp_path / "predict_job.py").write_text(PREDICT_MODULE, encoding="utf-8")  # imported from the working folder
    (tmp_path / "predict.yaml").write_text(PREDICT_CONFIG, encoding="utf-8")
    env = {**os.environ, "PYTHONPATH": str(repo), "WANDB_MODE": "offline"}
    command = [sys.executable, "-m", "ember", "predict", "-c", "predict.yaml", "trainer.devices=2",
               "trainer.logger=false"]  # fmt: skip
    done = subprocess.run(command, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=240)
    assert done.returncode == 0, done.stderr[-3000:]
    assert done.stdout.count("predict done") == 1, done.stdout
    run = tmp_path / "runs" / "classifier" / "version_0"
    assert sorted(p.name for p in run.glob("predictions-rank*.pt")) == ["predictions-rank0.pt", "predictions-rank1.pt"]
    assert "saved to runs/classifier/version_0/predictions-rank*.pt" in done.stdout
    shares = [torch.load(run / f"predictions-rank{rank}.pt", weights_only=True) for rank in range(2)]
    rows = [sum(len(batch) for batch in share) for share in shares]
    assert rows == [20, 20], rows  # 40 samples: 20 per process (in batches of 8, 8 and 4)
