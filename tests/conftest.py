"""Shared test setup: every test runs in its own empty working directory, offline, and leaves the process's
global state (environment, random streams, torch's settings) as it found it, so that no test depends on which
tests ran before it in the same process (the suite runs in random order, on several xdist workers)."""

from __future__ import annotations

import gc
import os
import random
import signal
import sys
import tempfile
from collections.abc import Iterator
from pathlib import Path
from typing import Any

# One intra-op thread for each test process and every process it starts (a value set by the caller is kept).
# The suite runs 2 xdist workers on 2 cores: with torch's default of one thread per core, each worker's OpenMP
# threads spin waiting for the CPU the other worker holds, and the same small fit (lr_find's 100 steps on the
# digits MLP) took 2.8 times the CPU. Set before torch is imported, and once more below in case a plugin
# imported it first.
os.environ.setdefault("OMP_NUM_THREADS", "1")

sys.path.insert(0, str(Path(__file__).resolve().parent))  # tests/forked_cli.py: `ember` commands forked

import pytest
import torch
from hypothesis import HealthCheck, settings

os.environ.setdefault("WANDB_MODE", "offline")


def _temporary_files_in_memory() -> None:
    """Temporary files (pytest's `tmp_path`, `tempfile` in the tests and in every process they start) go to
    /dev/shm where it is a RAM disk with room: every checkpoint the suite writes fsyncs its files and its folder,
    about 9 ms a file on a virtual disk, and thousands of them made the workers wait instead of compute.
    Durability itself is tested by the tests that fake fsync or mount a disk of their own; a TMPDIR set by the
    caller is kept."""
    shm = Path("/dev/shm")
    if "TMPDIR" in os.environ or not sys.platform.startswith("linux") or not os.access(shm, os.W_OK):
        return
    try:
        room = os.statvfs(shm)
    except OSError:
        return
    if room.f_bavail * room.f_frsize >= 4 << 30:
        os.environ["TMPDIR"] = str(shm)
        tempfile.tempdir = None  # `tempfile.gettempdir()` reads TMPDIR again


_temporary_files_in_memory()

torch.set_num_threads(int(os.environ["OMP_NUM_THREADS"]))

# Ctrl-C as a terminal delivers it, in this process and in every process it starts. A suite started in the
# background (bash ignores SIGINT in `cmd &` jobs; nohup) inherits SIGINT ignored, passes that on to every
# `ember` it starts, and the Ctrl-C tests then send a signal nobody receives: the run completes and exits 0.
if signal.getsignal(signal.SIGINT) == signal.SIG_IGN:
    signal.signal(signal.SIGINT, signal.default_int_handler)

# The hypothesis profile of every generated test, whichever tests a run collects. ``EMBER_HYPOTHESIS_PROFILE``:
# ``ci`` (the default: fixed examples, so every run draws the same) or ``thorough`` (20 times as many for the
# tests that ask for a multiple of the profile's count, tests/exactness; freshly drawn each run).
_COMMON = dict(
    deadline=None,  # a fit's duration varies with the machine's load
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
    database=None,  # found failures are kept as explicit tests (tests/exactness/test_regressions.py), not in a cache
    print_blob=True,
)
settings.register_profile("ci", max_examples=6, derandomize=True, **_COMMON)
settings.register_profile("thorough", max_examples=120, derandomize=False, **_COMMON)
settings.load_profile(os.environ.get("EMBER_HYPOTHESIS_PROFILE", "ci"))

pytest_plugins = ("pytester",)  # tests/test_isolation.py runs small pytest sessions of its own


class GlobalState:
    """What a test may change for the whole process and must not leave changed: every environment variable
    (``seed_everything`` sets ``EMBER_SEED``/``EMBER_SEED_WORKERS``, launchers ``RANK``, ``MASTER_PORT``...),
    the global random streams of Python, NumPy and torch (CUDA's too once it is initialized), and torch's
    process-wide settings. Taking and restoring it costs well under a millisecond."""

    def __init__(self) -> None:
        self.environ = dict(os.environ)
        self.python_rng = random.getstate()
        numpy = sys.modules.get("numpy")
        self.numpy_rng = numpy.random.get_state() if numpy is not None else None
        self.torch_rng = torch.get_rng_state()
        self.cuda_rng = torch.cuda.get_rng_state_all() if torch.cuda.is_initialized() else None
        self.settings = self._settings()
        self.modules = set(sys.modules)

    @staticmethod
    def _settings() -> dict[str, Any]:
        return {
            "default_dtype": torch.get_default_dtype(),
            "num_threads": torch.get_num_threads(),
            "deterministic": (
                torch.are_deterministic_algorithms_enabled(),
                torch.is_deterministic_algorithms_warn_only_enabled(),
            ),
            "grad_enabled": torch.is_grad_enabled(),
            "anomaly": torch.is_anomaly_enabled(),
            "matmul_precision": torch.get_float32_matmul_precision(),
            "cudnn": (torch.backends.cudnn.deterministic, torch.backends.cudnn.benchmark),
        }

    def restore(self) -> None:
        # Packages a test imported from its own temporary folder (a project such as ``my_project``): left in
        # sys.modules, the next test's project of the same name would be shadowed by this one's.
        temp = tempfile.gettempdir()
        for name in set(sys.modules) - self.modules:
            origin = getattr(sys.modules.get(name), "__file__", None) or ""
            if origin.startswith(temp):
                del sys.modules[name]
        for name in [name for name in os.environ if name not in self.environ]:
            del os.environ[name]
        for name, value in self.environ.items():
            if os.environ.get(name) != value:
                os.environ[name] = value
        random.setstate(self.python_rng)
        if self.numpy_rng is not None:
            sys.modules["numpy"].random.set_state(self.numpy_rng)
        torch.set_rng_state(self.torch_rng)
        if self.cuda_rng is not None:
            torch.cuda.set_rng_state_all(self.cuda_rng)
        if self._settings() != self.settings:
            self._restore_settings()

    def _restore_settings(self) -> None:
        saved = self.settings
        torch.set_default_dtype(saved["default_dtype"])
        if torch.get_num_threads() != saved["num_threads"]:
            torch.set_num_threads(saved["num_threads"])
        enabled, warn_only = saved["deterministic"]
        torch.use_deterministic_algorithms(enabled, warn_only=warn_only)
        torch.set_grad_enabled(saved["grad_enabled"])
        torch.set_anomaly_enabled(saved["anomaly"])
        torch.set_float32_matmul_precision(saved["matmul_precision"])
        torch.backends.cudnn.deterministic, torch.backends.cudnn.benchmark = saved["cudnn"]


# --- the garbage collector's full passes -------------------------------------------------------------------------
# A test process holds over a million objects once the suite's imports are done (torch, Lightning, transformers,
# mlflow...), and a full pass of the cyclic collector walks all of them: 0.6 s each, about 50 times in the unit
# tests alone (30 of their 133 s). What outlives a test file is moved out of the collector's sight
# (`gc.freeze`) once that file's garbage is collected: later passes walk only what the running file made. What the
# tests themselves create stays collectable as before.
@pytest.hookimpl(trylast=True)
def pytest_collection_finish(session: pytest.Session) -> None:
    gc.collect()
    gc.freeze()


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_teardown(item: pytest.Item, nextitem: pytest.Item | None) -> Iterator[None]:
    yield  # the file's module fixtures end with its last test
    if nextitem is None or nextitem.path != item.path:
        gc.collect()
        gc.freeze()


@pytest.hookimpl(tryfirst=True)  # before pytest-xdist reads the groups (`--dist loadgroup`, pyproject.toml)
def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """Tests marked `perf` (wall-clock ratios) run only when ``-m`` names them (``-m perf``): any other run,
    ``-m "not slow and not distributed"`` included, leaves them out.

    Which tests one xdist worker runs one after the other:

    - every test marked `distributed` (group ``distributed``): two multi-process jobs never share the 2 CPUs
      (their collectives have timeouts);
    - the tests of a module that share a module-scoped fixture (a trained run, a built site, a clone; group: the
      module's file), so that the fixture is built once, not once per worker.

    Then the files holding tests marked `distributed`, then those holding tests marked `waits` (a server's start,
    a paced run: one core stays idle, which the multi-process tests running beside them on the other worker use),
    then those holding other `slow` tests, move to the front (a stable sort of whole files: the random order stays
    within each kind, and a file's tests stay together so that its module fixtures are built once), so that no
    worker starts a long test when the others are about to finish. pytest-xdist hands out the largest groups first
    (``--loadscope-reorder``, its default), then single tests in this order.
    """
    if "perf" not in (config.getoption("markexpr") or ""):
        perf = [item for item in items if item.get_closest_marker("perf") is not None]
        if perf:
            config.hook.pytest_deselected(items=perf)
            items[:] = [item for item in items if item.get_closest_marker("perf") is None]
    for item in items:
        if item.get_closest_marker("xdist_group") is not None:
            continue
        if item.get_closest_marker("distributed") is not None:
            item.add_marker(pytest.mark.xdist_group("distributed"))
        elif _uses_a_module_fixture(item):
            item.add_marker(pytest.mark.xdist_group(item.nodeid.split("::")[0]))
    file_rank: dict[str, int] = {}
    for item in items:
        path = item.nodeid.split("::")[0]
        file_rank[path] = min(file_rank.get(path, 3), _start_rank(item))
    items.sort(key=lambda item: file_rank[item.nodeid.split("::")[0]])


def _start_rank(item: pytest.Item) -> int:
    """0 for a multi-process test, 1 for one that mostly waits, 2 for another slow one, 3 for the rest."""
    for rank, kind in enumerate(("distributed", "waits", "slow")):
        if item.get_closest_marker(kind) is not None:
            return rank
    return 3


def _uses_a_module_fixture(item: pytest.Item) -> bool:
    info = getattr(item, "_fixtureinfo", None)
    return info is not None and any(defs[-1].scope == "module" for defs in info.name2fixturedefs.values() if defs)


@pytest.fixture(autouse=True)
def _restore_global_state() -> Iterator[GlobalState]:
    """After every test, put back the environment, the random streams and torch's settings as they were."""
    state = GlobalState()
    yield state
    state.restore()


@pytest.fixture(autouse=True)
def _isolated_cwd(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Runs write `runs/` into the working directory, and runs on a store stage into ``EMBER_CACHE``: keep each
    test's apart from the repo and from the home directory."""
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("EMBER_CACHE", str(tmp_path / ".ember-cache"))


# --- a real S3 API server (moto) for the tests of checkpoints and runs on object storage ----------------------

_MOTO_SERVER = Path(sys.executable).parent / "moto_server"
#: The dummy credentials the S3 tests put in the environment (and check that nothing stored or printed shows).
S3_CREDENTIALS = {"AWS_ACCESS_KEY_ID": "AKIDEMBERTEST0001", "AWS_SECRET_ACCESS_KEY": "ember-test-secret-Zq9xW"}


@pytest.fixture(scope="module")
def s3_endpoint() -> Iterator[str]:
    """A moto S3 server on 127.0.0.1 for the module's tests (``http://127.0.0.1:PORT``); stopped (its process
    group) afterwards. Skips when moto's server is not installed."""
    import signal
    import socket
    import subprocess
    import time

    if not _MOTO_SERVER.exists():
        pytest.skip("moto_server is not installed (pip install 'moto[server]')")
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = int(sock.getsockname()[1])
    proc = subprocess.Popen(
        [str(_MOTO_SERVER), "-H", "127.0.0.1", "-p", str(port)],
        stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True,
    )  # fmt: skip
    try:
        deadline = time.monotonic() + 30
        while True:
            try:
                socket.create_connection(("127.0.0.1", port), timeout=0.5).close()
                break
            except OSError:
                if time.monotonic() > deadline or proc.poll() is not None:
                    pytest.fail("moto_server did not start within 30 s")
                time.sleep(0.1)
        yield f"http://127.0.0.1:{port}"
    finally:
        os.killpg(proc.pid, signal.SIGTERM)
        proc.wait(timeout=10)


@pytest.fixture(scope="module")
def s3_server_env(s3_endpoint: str) -> dict[str, str]:
    """The environment a client of `s3_endpoint` needs (dummy credentials, region, endpoint), to set (`s3_env`)
    or to give the processes a test starts."""
    pytest.importorskip("s3fs", reason="s3:// needs s3fs (pip install -e '.[dev]')")
    return {**S3_CREDENTIALS, "AWS_DEFAULT_REGION": "us-east-1", "AWS_ENDPOINT_URL": s3_endpoint}


@pytest.fixture
def s3_env(s3_server_env: dict[str, str], monkeypatch: pytest.MonkeyPatch) -> Iterator[dict[str, str]]:
    """`s3_server_env` set in this test's environment only (credentials from the environment, as a real
    deployment would)."""
    env = dict(s3_server_env)
    for key, value in env.items():
        monkeypatch.setenv(key, value)
    import fsspec

    fsspec.AbstractFileSystem.clear_instance_cache()  # an s3fs made before the env changed would be reused
    yield env
    fsspec.AbstractFileSystem.clear_instance_cache()
