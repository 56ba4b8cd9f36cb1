"""A TorchServe archive from ``ember.export`` served by a real TorchServe: start, one request, stop.

Skipped unless Java, the ``torchserve`` command and torch-model-archiver are installed. The server
binds 127.0.0.1 only, on free ports, keeps its logs, model store and temporary files under tmp_path,
and is stopped (its whole process group killed if need be) even when the test fails.
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import signal
import socket
import subprocess
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch

from ember.export import export_torchserve
from examples.digits import Classifier

READY_TIMEOUT_S = 120


def _missing() -> str | None:
    import importlib.util

    if shutil.which("java") is None:
        return "TorchServe needs Java (e.g. apt-get install openjdk-17-jre-headless)"
    if shutil.which("torchserve") is None or importlib.util.find_spec("ts") is None:
        return "the torchserve package is not installed (pip install torchserve)"
    if importlib.util.find_spec("model_archiver") is None:
        return "torch-model-archiver is not installed (pip install torch-model-archiver)"
    return None


pytestmark = [pytest.mark.slow, pytest.mark.skipif(_missing() is not None, reason=str(_missing()))]


def free_ports(count: int) -> list[int]:
    sockets = [socket.socket() for _ in range(count)]
    try:
        for s in sockets:
            s.bind(("127.0.0.1", 0))
        return [s.getsockname()[1] for s in sockets]
    finally:
        for s in sockets:
            s.close()


def get_json(url: str) -> Any:
    with urllib.request.urlopen(url, timeout=5) as response:
        return json.loads(response.read())


@contextlib.contextmanager
def torchserve(root: Path, store: Path, model: str) -> Iterator[tuple[str, str]]:
    """Run TorchServe in the foreground of its own process group; yield (inference URL, management URL)."""
    inference, management, metrics, grpc_inference, grpc_management = free_ports(5)
    config = root / "config.properties"
    config.write_text(
        f"inference_address=http://127.0.0.1:{inference}\n"
        f"management_address=http://127.0.0.1:{management}\n"
        f"metrics_address=http://127.0.0.1:{metrics}\n"
        f"grpc_inference_address=127.0.0.1\ngrpc_inference_port={grpc_inference}\n"
        f"grpc_management_address=127.0.0.1\ngrpc_management_port={grpc_management}\n"
        "default_workers_per_model=1\nnumber_of_netty_threads=1\nnetty_client_threads=1\n"
        "disable_system_metrics=true\nvmargs=-Xmx256m -XX:+UseSerialGC\n"
    )
    (root / "logs").mkdir()
    (root / "tmp").mkdir()
    env = {
        **os.environ,
        "TMPDIR": str(root / "tmp"),  # TorchServe's pid file, unpacked models and worker sockets
        "TEMP": str(root / "tmp"),
        "LOG_LOCATION": str(root / "logs"),
        "METRICS_LOCATION": str(root / "logs"),
    }
    torchserve_cmd = shutil.which("torchserve") or "torchserve"
    start = [torchserve_cmd, "--start", "--foreground", "--ncs", "--disable-token-auth", "--model-store", str(store),
             "--models", f"{model}={model}.mar", "--ts-config", str(config)]  # fmt: skip
    with open(root / "torchserve.out", "w") as out:
        server = subprocess.Popen(
            start, cwd=root, env=env, stdout=out, stderr=subprocess.STDOUT, start_new_session=True
        )
    try:
        yield f"http://127.0.0.1:{inference}", f"http://127.0.0.1:{management}"
    finally:
        with contextlib.suppress(subprocess.SubprocessError, OSError):
            subprocess.run([torchserve_cmd, "--stop", "--foreground"], cwd=root, env=env, timeout=60, check=False,
                           capture_output=True)  # fmt: skip
        try:
            server.wait(timeout=30)
        except subprocess.TimeoutExpired:
            os.killpg(server.pid, signal.SIGKILL)  # the launcher's group: the Java frontend and its workers
            server.wait(timeout=30)
        with contextlib.suppress(ProcessLookupError):
            os.killpg(server.pid, signal.SIGKILL)  # a worker left behind by a frontend that stopped


def wait_until_ready(management: str, model: str, log: Path) -> None:
    deadline = time.monotonic() + READY_TIMEOUT_S
    while time.monotonic() < deadline:
        with contextlib.suppress(OSError, urllib.error.URLError, ValueError, KeyError, IndexError):
            workers = get_json(f"{management}/models/{model}")[0]["workers"]
            if workers and workers[0]["status"] == "READY":
                return
        time.sleep(0.5)
    pytest.fail(f"TorchServe did not load {model} in {READY_TIMEOUT_S} s; its output:\n{log.read_text()[-3000:]}")


def test_torchserve_serves_the_archive_and_answers_like_predict_step(tmp_path: Path) -> None:
    torch.manual_seed(0)
    module = Classifier(hidden=16).eval()
    store = tmp_path / "store"
    result = export_torchserve(module, store / "digits.mar", torch.rand(2, 64))
    assert result.path == store / "digits.mar"

    x = torch.rand(3, 64, generator=torch.Generator().manual_seed(5))
    with torchserve(tmp_path, store, "digits") as (inference, management):
        wait_until_ready(management, "digits", tmp_path / "torchserve.out")
        assert get_json(f"{inference}/ping") == {"status": "Healthy"}
        request = urllib.request.Request(
            f"{inference}/predictions/digits",
            data=json.dumps({"inputs": x.tolist()}).encode(),
            headers={"Content-Type": "application/json"},
        )
        with urllib.request.urlopen(request, timeout=60) as response:
            prediction = json.loads(response.read())
    with torch.no_grad():
        torch.testing.assert_close(torch.tensor(prediction), module.predict_step(x, 0), atol=1e-6, rtol=1e-5)
    assert (tmp_path / "logs" / "ts_log.log").is_file()  # logs went where they were told
