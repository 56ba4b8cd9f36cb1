"""ember's own launcher (``devices=N`` without torchrun): each worker gets its share of the cores."""

from __future__ import annotations

import os
from typing import Any

import pytest

from ember.strategies import launcher


@pytest.mark.parametrize(("cores", "nprocs", "threads"), [(8, 2, "4"), (16, 3, "5"), (2, 4, "1"), (1, 1, "1")])
def test_each_worker_gets_its_share_of_the_cores(
    monkeypatch: pytest.MonkeyPatch, cores: int, nprocs: int, threads: str
) -> None:
    monkeypatch.setattr(launcher.os, "sched_getaffinity", lambda _pid: set(range(cores)), raising=False)
    environ: dict[str, str] = {}
    launcher.set_worker_threads(nprocs, environ)
    assert environ == {"OMP_NUM_THREADS": threads}


def test_a_thread_count_the_user_set_is_kept() -> None:
    environ = {"OMP_NUM_THREADS": "7"}
    launcher.set_worker_threads(4, environ)
    assert environ == {"OMP_NUM_THREADS": "7"}


def test_relaunch_starts_the_workers_with_the_thread_count(monkeypatch: pytest.MonkeyPatch) -> None:
    import torch.distributed.launcher.api as launch_api

    for name in ("OMP_NUM_THREADS", launcher.STATUS_DIR_VAR):  # recorded, so the test leaves them as they were
        monkeypatch.setenv(name, "placeholder")
        monkeypatch.delenv(name)
    monkeypatch.setattr(launcher.os, "sched_getaffinity", lambda _pid: set(range(6)), raising=False)
    seen: dict[str, Any] = {}

    def elastic_launch(config: Any, entrypoint: str) -> Any:
        def start(*argv: str) -> None:
            seen["threads"], seen["nprocs"] = os.environ.get("OMP_NUM_THREADS"), config.nproc_per_node

        return start

    monkeypatch.setattr(launch_api, "elastic_launch", elastic_launch)
    with pytest.raises(SystemExit) as exit_info:
        launcher.relaunch(3)
    assert exit_info.value.code == 0
    assert seen == {"threads": "2", "nprocs": 3}
