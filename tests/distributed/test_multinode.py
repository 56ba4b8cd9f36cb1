"""Several nodes on one machine, SLURM variables, and environment detection (issue 6, "must show" 3).

The distributed tests start two 1-process torchrun "nodes" that rendezvous over c10d on localhost, and
two plain Python processes with SLURM's variables set by hand; both run ``fit_sequential`` and must end
with the parameters of the single-node 2-process run of the shared job (`conftest.main_job`). The unit
tests below them check `detect` and `first_slurm_host` on environment dicts.
"""

from __future__ import annotations

import sys

import dist_harness as harness
import pytest

from ember.strategies.environment import ClusterEnvironment, detect, first_slurm_host

SEQ_SCRIPT = """\
import sys
from pathlib import Path

import dist_workload

dist_workload.sequential_job(Path(sys.argv[1]), *sys.argv[2:])
"""


@pytest.mark.distributed
def test_two_torchrun_nodes_on_localhost_train_together(main_job, tmp_path) -> None:
    script = harness.write_script(tmp_path, SEQ_SCRIPT)
    endpoint = f"127.0.0.1:{harness.free_port()}"
    jobs = [
        harness.Job(
            harness.torchrun(script, "out", "multinode", "2", nproc=1, nnodes=2, node_rank=node, endpoint=endpoint),
            tmp_path,
        )
        for node in (0, 1)
    ]
    finished = [job.wait(timeout=150) for job in jobs]
    for node, job in enumerate(finished):
        assert job.returncode == 0, f"node {node}: {harness.describe(job)}"
    ranks = harness.results(tmp_path / "out", "multinode", 2)
    for rank, result in enumerate(ranks):
        assert (result["rank"], result["world_size"], result["local_rank"]) == (rank, 2, 0)
        assert (result["kind"], result["num_nodes"], result["steps"]) == ("torchelastic", 2, 20)
    assert sorted(r["node_rank"] for r in ranks) == [0, 1]
    harness.assert_params_equal(ranks[0]["params"], ranks[1]["params"], "node 0 vs node 1")
    single_node = main_job.results("ddp_seq")
    harness.assert_params_equal(ranks[0]["params"], single_node[0]["params"], "2 nodes vs 1 node x 2 processes")
    for rank in range(2):
        assert ranks[rank]["seen"] == single_node[rank]["seen"]


@pytest.mark.distributed
def test_slurm_variables_set_by_hand_are_picked_up(main_job, tmp_path) -> None:
    script = harness.write_script(tmp_path, SEQ_SCRIPT)
    port = str(harness.free_port())
    jobs = []
    for rank in (0, 1):
        env = harness.clean_env(
            {
                "SLURM_NTASKS": "2",
                "SLURM_PROCID": str(rank),
                "SLURM_LOCALID": str(rank),
                "SLURM_NODEID": "0",
                "SLURM_NNODES": "1",
                "SLURM_NODELIST": "localhost",
                "SLURM_JOB_ID": "4242",
                "SLURM_JOB_NAME": "train",
                "MASTER_PORT": port,
            }
        )
        jobs.append(harness.Job([sys.executable, str(script), "out", "slurm"], tmp_path, env))
    finished = [job.wait(timeout=120) for job in jobs]
    for rank, job in enumerate(finished):
        assert job.returncode == 0, f"SLURM task {rank}: {harness.describe(job)}"
    ranks = harness.results(tmp_path / "out", "slurm", 2)
    for rank, result in enumerate(ranks):
        assert (result["kind"], result["rank"], result["local_rank"], result["world_size"]) == ("slurm", rank, rank, 2)
        assert result["steps"] == 20
    single_node = main_job.results("ddp_seq")
    for rank in range(2):
        harness.assert_params_equal(
            ranks[rank]["params"], single_node[rank]["params"], f"SLURM rank {rank} vs torchrun"
        )


# --- detection on environment dicts (no processes) --------------------------------------------------------

TORCHRUN = {
    "TORCHELASTIC_RUN_ID": "abc",
    "RANK": "5",
    "WORLD_SIZE": "8",
    "LOCAL_RANK": "1",
    "LOCAL_WORLD_SIZE": "4",
    "GROUP_RANK": "1",
    "MASTER_ADDR": "node7",
    "MASTER_PORT": "29400",
}
SLURM = {
    "SLURM_NTASKS": "8",
    "SLURM_PROCID": "6",
    "SLURM_LOCALID": "2",
    "SLURM_NODEID": "1",
    "SLURM_NNODES": "2",
    "SLURM_NODELIST": "gpu[03-04]",
    "SLURM_JOB_ID": "123456",
    "SLURM_JOB_NAME": "train",
}


def test_detect_torchrun() -> None:
    assert detect(TORCHRUN) == ClusterEnvironment(
        kind="torchelastic",
        world_size=8,
        global_rank=5,
        local_rank=1,
        node_rank=1,
        num_nodes=2,
        master_addr="node7",
        master_port=29400,
    )


def test_detect_a_hand_set_torch_environment_without_torchelastic() -> None:
    env = {k: v for k, v in TORCHRUN.items() if k not in ("TORCHELASTIC_RUN_ID", "LOCAL_WORLD_SIZE", "GROUP_RANK")}
    found = detect(env)
    assert (found.kind, found.world_size, found.global_rank, found.local_rank) == ("torchelastic", 8, 5, 1)


def test_torchrun_inside_a_slurm_job_wins() -> None:
    found = detect({**SLURM, **TORCHRUN})
    assert (found.kind, found.global_rank, found.world_size) == ("torchelastic", 5, 8)


def test_detect_slurm() -> None:
    assert detect(SLURM) == ClusterEnvironment(
        kind="slurm",
        world_size=8,
        global_rank=6,
        local_rank=2,
        node_rank=1,
        num_nodes=2,
        master_addr="gpu03",
        master_port=15000 + 123456 % 20000,
    )


def test_slurm_master_address_and_port_can_be_given() -> None:
    found = detect({**SLURM, "MASTER_ADDR": "10.0.0.1", "MASTER_PORT": "1234"})
    assert (found.master_addr, found.master_port) == ("10.0.0.1", 1234)


def test_two_slurm_jobs_on_one_node_get_different_ports() -> None:
    assert detect({**SLURM, "SLURM_JOB_ID": "1"}).master_port != detect({**SLURM, "SLURM_JOB_ID": "2"}).master_port


@pytest.mark.parametrize("name", ["bash", "interactive"])
def test_an_interactive_slurm_shell_is_a_single_process(name: str) -> None:
    assert detect({**SLURM, "SLURM_JOB_NAME": name}).kind == "single"


def test_no_launcher_is_a_single_process() -> None:
    found = detect({"PATH": "/usr/bin", "SLURM_JOB_ID": "1"})  # SLURM_JOB_ID alone: e.g. salloc, no srun
    assert found == ClusterEnvironment(kind="single")
    assert found.world_size == 1


@pytest.mark.parametrize(
    ("nodelist", "first"),
    [
        ("localhost", "localhost"),
        ("node1", "node1"),
        ("node1,node2", "node1"),
        ("gpu[03-05,09],cpu1", "gpu03"),
        ("node[009-011]", "node009"),
        ("node[7]", "node7"),
        ("gpu-a100-[3,5]", "gpu-a100-3"),
        (" node[1-4] ", "node1"),
        ("rack[1-2]-node[01-02]", "rack1-node01"),  # ranges in several places of one name
        ("node[01-02]-ib,login1", "node01-ib"),  # a suffix after the range
    ],
)
def test_first_slurm_host(nodelist: str, first: str) -> None:
    assert first_slurm_host(nodelist) == first
