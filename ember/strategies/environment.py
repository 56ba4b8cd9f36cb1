"""Where this process sits in a job: detected from torchrun/TorchElastic, then SLURM, else one process.

`detect()` reads the environment only; `export()` writes the standard
``RANK``/``WORLD_SIZE``/``LOCAL_RANK``/``MASTER_ADDR``/``MASTER_PORT`` variables
that ``torch.distributed.init_process_group("env://")`` reads.
"""

from __future__ import annotations

import os
import re
from collections.abc import Mapping
from dataclasses import dataclass


@dataclass(frozen=True)
class ClusterEnvironment:
    """One process's place in the job."""

    kind: str  # "torchelastic", "slurm" or "single"
    world_size: int = 1
    global_rank: int = 0
    local_rank: int = 0
    node_rank: int = 0
    num_nodes: int = 1
    master_addr: str = "127.0.0.1"
    master_port: int = 29500

    def export(self) -> None:
        """Set the variables ``init_process_group`` reads (torchrun sets them already)."""
        os.environ.setdefault("MASTER_ADDR", self.master_addr)
        os.environ.setdefault("MASTER_PORT", str(self.master_port))
        os.environ["RANK"] = str(self.global_rank)
        os.environ["WORLD_SIZE"] = str(self.world_size)
        os.environ["LOCAL_RANK"] = str(self.local_rank)


def first_slurm_host(nodelist: str) -> str:
    """First host of a SLURM node list.

    ``"gpu[03-05,09],cpu1"`` -> ``"gpu03"``; ``"r[1-2]-n[01-02]"`` -> ``"r1-n01"``.
    """
    text, depth, end = nodelist.strip(), 0, None
    for i, char in enumerate(text):  # the first entry ends at a comma outside brackets
        depth += {"[": 1, "]": -1}.get(char, 0)
        if char == "," and depth == 0:
            end = i
            break
    first = text[:end]
    if not first or first.count("[") != first.count("]"):
        raise ValueError(f"cannot read the SLURM node list {nodelist!r}")
    # Each bracket group stands for its first value: "[01-02,07]" -> "01".
    return re.sub(r"\[([^\]]*)\]", lambda m: m.group(1).split(",")[0].split("-")[0], first)


def _int(env: Mapping[str, str], name: str, default: int) -> int:
    value = env.get(name)
    return int(value) if value not in (None, "") else default


def detect(env: Mapping[str, str] | None = None) -> ClusterEnvironment:
    """TorchElastic/torchrun first, then SLURM (batch jobs, not interactive shells), else a single process."""
    env = os.environ if env is None else env
    if "TORCHELASTIC_RUN_ID" in env or all(k in env for k in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR")):
        world = _int(env, "WORLD_SIZE", 1)
        local_world = _int(env, "LOCAL_WORLD_SIZE", world)
        return ClusterEnvironment(
            kind="torchelastic",
            world_size=world,
            global_rank=_int(env, "RANK", 0),
            local_rank=_int(env, "LOCAL_RANK", 0),
            node_rank=_int(env, "GROUP_RANK", _int(env, "NODE_RANK", 0)),
            num_nodes=max(world // max(local_world, 1), 1),
            master_addr=env.get("MASTER_ADDR", "127.0.0.1"),
            master_port=_int(env, "MASTER_PORT", 29500),
        )
    interactive = env.get("SLURM_JOB_NAME") in ("bash", "interactive")
    if "SLURM_NTASKS" in env and "SLURM_PROCID" in env and not interactive:
        job_id = _int(env, "SLURM_JOB_ID", 0)
        return ClusterEnvironment(
            kind="slurm",
            world_size=_int(env, "SLURM_NTASKS", 1),
            global_rank=_int(env, "SLURM_PROCID", 0),
            local_rank=_int(env, "SLURM_LOCALID", 0),
            node_rank=_int(env, "SLURM_NODEID", 0),
            num_nodes=_int(env, "SLURM_NNODES", 1),
            master_addr=env.get("MASTER_ADDR") or first_slurm_host(env.get("SLURM_NODELIST", "127.0.0.1")),
            # One port per job, so two jobs sharing a node do not collide.
            master_port=_int(env, "MASTER_PORT", 15000 + job_id % 20000),
        )
    return ClusterEnvironment(kind="single")
