"""CPU allocator tuning: applied on glibc Linux when a run starts, and not when opted out or not glibc's malloc.

Each case runs in a fresh process (the setting is process-wide and cannot be undone): a child forked from
one interpreter per test module that has imported torch and ember (and torch._dynamo, which the first optimizer
imports) but run nothing (so no case pays for the imports again), or a new interpreter where the case is about
how the process starts (a preloaded malloc).
The child runs a one-step fit, then reads glibc's behaviour back through ``mallinfo2``: a 64 MiB request is
served by ``mmap`` with glibc's defaults (its adaptive threshold stops at 32 MiB), and from the heap, where
the freed block stays for the next request, once ember raised the thresholds.
"""

from __future__ import annotations

import ctypes
import json
import os
import shutil
import subprocess
import sys
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

from ember.strategies import allocator

ROOT = Path(__file__).resolve().parents[3]


def _glibc_with_mallinfo2() -> bool:
    if not sys.platform.startswith("linux") or not os.confstr("CS_GNU_LIBC_VERSION"):
        return False
    return hasattr(ctypes.CDLL("libc.so.6"), "mallinfo2")  # glibc >= 2.33


requires_glibc = pytest.mark.skipif(
    not _glibc_with_mallinfo2(), reason="needs Linux with glibc >= 2.33 (mallopt and mallinfo2 to read it back)"
)

CHILD = r"""
import ctypes, json, sys
import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset
import ember
from ember.strategies import allocator

class Tiny(ember.TrainingModule):
    def __init__(self):
        super().__init__()
        self.model, self.loss_fn = nn.Linear(4, 2), nn.CrossEntropyLoss()
    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.1)

def fit(**options):
    data = DataLoader(TensorDataset(torch.randn(8, 4), torch.randint(0, 2, (8,))), batch_size=4)
    quiet = dict(logger=False, enable_progress_bar=False, enable_model_summary=False, enable_checkpointing=False)
    ember.Trainer(max_steps=1, **quiet, **options).fit(Tiny(), data)

class MallInfo2(ctypes.Structure):
    _fields_ = [(name, ctypes.c_size_t) for name in
                "arena ordblks smblks hblks hblkhd usmblks fsmblks uordblks fordblks keepcost".split()]

def probe():
    # What glibc does with a 64 MiB request: mmapped (hblkhd grows), or from the heap and kept after free.
    libc = ctypes.CDLL("libc.so.6")
    libc.mallinfo2.restype = MallInfo2
    libc.malloc.restype, libc.malloc.argtypes = ctypes.c_void_p, [ctypes.c_size_t]
    libc.free.argtypes = [ctypes.c_void_p]
    size = 64 << 20
    before = libc.mallinfo2().hblkhd
    block = libc.malloc(size)
    mmapped = libc.mallinfo2().hblkhd - before >= size
    libc.free(block)
    return {"mmapped": mmapped, "kept_after_free": libc.mallinfo2().keepcost >= size}

def case(fits):
    for options in fits:
        fit(**options)
    status = allocator.allocator_status()
    return json.dumps({"applied": status.applied, "reason": status.reason, **probe()})

if len(sys.argv) > 1:  # one case in this new interpreter
    print(case(json.loads(sys.argv[1])))
else:  # one case per line of stdin ({"fits": [...], "env": {...}}), each in a child forked from here
    import os
    import torch._dynamo  # what building the first optimizer imports: once here, not in every child
    for line in sys.stdin:
        request = json.loads(line)
        read, write = os.pipe()
        pid = os.fork()
        if pid == 0:
            os.close(read)
            os.dup2(2, 1)  # anything the fit prints goes to stderr: stdout carries one answer per line
            code = 1
            try:
                os.environ.update(request["env"])
                os.write(write, case(request["fits"]).encode())
                code = 0
            except BaseException as error:
                os.write(write, json.dumps({"error": repr(error)}).encode())
            finally:
                os._exit(code)
        os.close(write)
        with os.fdopen(read, "rb") as answer:
            result = answer.read().decode()
        os.waitpid(pid, 0)
        print(result, flush=True)
"""


def clean_env(**env: str) -> dict[str, str]:
    """This process's environment without the allocator's settings, plus `env`."""
    full_env = {k: v for k, v in os.environ.items() if k != allocator.ENV_VAR and not k.startswith("MALLOC_")}
    full_env.pop("LD_PRELOAD", None)
    full_env.update(PYTHONPATH=str(ROOT), **env)
    return full_env


def run_child(fits: list[dict[str, Any]], env: dict[str, str] | None = None) -> dict[str, Any]:
    """Run the fits (one Trainer's keywords each) in a new interpreter; what ember says and what glibc does."""
    out = subprocess.run(
        [sys.executable, "-c", CHILD, json.dumps(fits)], capture_output=True, text=True, env=clean_env(**(env or {})),
        timeout=120,
    )  # fmt: skip
    assert out.returncode == 0, out.stderr[-3000:]
    result: dict[str, Any] = json.loads(out.stdout.strip().splitlines()[-1])
    return result


Forked = Callable[..., dict[str, Any]]


@pytest.fixture(scope="module")
def forked() -> Iterator[Forked]:
    """Run the fits in a child forked from an interpreter that imported torch and ember and ran nothing."""
    parent = subprocess.Popen(
        [sys.executable, "-c", CHILD], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, env=clean_env()
    )
    assert parent.stdin is not None and parent.stdout is not None

    def run(fits: list[dict[str, Any]], env: dict[str, str] | None = None) -> dict[str, Any]:
        assert parent.stdin is not None and parent.stdout is not None
        parent.stdin.write(json.dumps({"fits": fits, "env": env or {}}) + "\n")
        parent.stdin.flush()
        line = parent.stdout.readline()
        assert line, f"the forking interpreter exited with status {parent.wait(timeout=60)}"
        result: dict[str, Any] = json.loads(line)
        assert "error" not in result, result["error"]
        return result

    try:
        yield run
    finally:
        parent.stdin.close()
        parent.wait(timeout=60)
        parent.stdout.close()


@requires_glibc
@pytest.mark.slow  # a forked fit; the module's forking interpreter costs 3 s of CPU once
def test_applied_when_a_run_starts_and_glibc_keeps_freed_blocks(forked: Forked) -> None:
    tuned = forked([{}])
    assert tuned["applied"], tuned
    assert "mmap threshold 256 MiB, trim threshold 1024 MiB" in tuned["reason"]
    assert not tuned["mmapped"] and tuned["kept_after_free"], tuned


@requires_glibc
@pytest.mark.slow  # a forked fit; the module's forking interpreter costs 3 s of CPU once
def test_opted_out_by_the_trainer_keyword(forked: Forked) -> None:
    result = forked([{"tune_cpu_allocator": False}])
    assert not result["applied"] and "tune_cpu_allocator=False" in result["reason"]
    # glibc's defaults: the same request is mmapped and unmapped again (what the other tests rule out).
    assert result["mmapped"] and not result["kept_after_free"], result


@requires_glibc
@pytest.mark.slow  # a forked fit; the module's forking interpreter costs 3 s of CPU once
def test_opted_out_by_the_environment_variable(forked: Forked) -> None:
    result = forked([{}], env={allocator.ENV_VAR: "0"})
    assert not result["applied"] and "EMBER_TUNE_CPU_ALLOCATOR=0" in result["reason"]
    assert result["mmapped"], result


@requires_glibc
@pytest.mark.slow  # a forked fit; the module's forking interpreter costs 3 s of CPU once
def test_a_later_run_that_allows_it_applies_it_once(forked: Forked) -> None:
    result = forked([{"tune_cpu_allocator": False}, {}, {"tune_cpu_allocator": False}])
    assert result["applied"], result  # applied by the second fit; the third cannot undo it
    assert not result["mmapped"], result


@requires_glibc
@pytest.mark.slow  # a forked fit; the module's forking interpreter costs 3 s of CPU once
def test_malloc_options_the_user_set_are_left_alone(forked: Forked) -> None:
    result = forked([{}], env={"MALLOC_ARENA_MAX": "2"})
    assert not result["applied"] and "MALLOC_ARENA_MAX" in result["reason"], result
    assert result["mmapped"], result


@requires_glibc
@pytest.mark.skipif(shutil.which("cc") is None, reason="needs a C compiler to build a malloc replacement to preload")
@pytest.mark.slow  # 3 s of CPU on a 2-core machine, with the processes it starts
def test_not_applied_when_another_allocator_provides_malloc(tmp_path: Path) -> None:
    # A stand-in for a preloaded jemalloc/tcmalloc: a library whose malloc replaces glibc's for the process.
    source = tmp_path / "replacement.c"
    source.write_text(
        "#include <stddef.h>\n"
        "extern void *__libc_malloc(size_t);\n"
        "void *malloc(size_t n) { return __libc_malloc(n); }\n"
    )
    library = tmp_path / "libreplacementmalloc.so"
    subprocess.run(["cc", "-shared", "-fPIC", "-o", str(library), str(source)], check=True, timeout=60)
    result = run_child([{}], env={"LD_PRELOAD": str(library)})
    assert not result["applied"], result
    assert "another allocator provides malloc" in result["reason"] and "libreplacementmalloc.so" in result["reason"]
    assert result["mmapped"], result


def test_a_bad_environment_value_names_the_fix(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(allocator, "_status", None)
    monkeypatch.setenv(allocator.ENV_VAR, "maybe")
    with pytest.raises(ValueError, match=r"EMBER_TUNE_CPU_ALLOCATOR='maybe': use 0 .* 1"):
        allocator.tune_cpu_allocator()


def test_the_keyword_takes_a_bool() -> None:
    with pytest.raises(TypeError, match="tune_cpu_allocator must be True or False; got 'no'"):
        allocator.tune_cpu_allocator("no")  # type: ignore[arg-type]


def test_not_applied_off_linux(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(sys, "platform", "darwin")
    status = allocator._apply()
    assert not status.applied and "not Linux" in status.reason


def test_the_trainer_keyword_is_in_the_config_schema() -> None:
    from ember.config.schema import TrainerConfig

    assert TrainerConfig().tune_cpu_allocator is True


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="the detection runs on Linux only")
def test_a_detected_allocator_stops_it_before_mallopt(monkeypatch: pytest.MonkeyPatch) -> None:
    # The detection seam: whatever other_allocator reports, mallopt is not reached.
    monkeypatch.setattr(allocator, "other_allocator", lambda: "/usr/lib/x86_64-linux-gnu/libjemalloc.so.2")

    def no_libc(name: str) -> None:
        raise AssertionError(f"mallopt was looked up in {name} although another allocator provides malloc")

    monkeypatch.setattr(allocator.ctypes, "CDLL", no_libc)
    status = allocator._apply()
    if os.confstr("CS_GNU_LIBC_VERSION"):
        assert not status.applied and status.reason == (
            "another allocator provides malloc: /usr/lib/x86_64-linux-gnu/libjemalloc.so.2"
        )
    else:
        assert not status.applied and "not glibc" in status.reason


def test_the_trainer_rejects_a_non_bool_before_any_work() -> None:
    import ember

    with pytest.raises(TypeError, match="tune_cpu_allocator='no' must be True or False"):
        ember.Trainer(tune_cpu_allocator="no")  # type: ignore[arg-type]


def test_not_applied_to_a_run_on_a_gpu(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(allocator, "_status", None)  # as in a fresh process
    monkeypatch.setattr(allocator, "_last_skip", None)
    monkeypatch.delenv(allocator.ENV_VAR, raising=False)

    def no_apply() -> allocator.AllocatorStatus:
        raise AssertionError("the thresholds were set for a GPU run")

    monkeypatch.setattr(allocator, "_apply", no_apply)
    status = allocator.tune_cpu_allocator(True, "cuda")
    assert not status.applied and status.reason == "not needed: the run trains on cuda, not on the CPU"
    assert allocator.allocator_status() == status


def test_a_run_passes_its_device_type(monkeypatch: pytest.MonkeyPatch) -> None:
    import torch
    from torch import nn
    from torch.utils.data import DataLoader, TensorDataset

    import ember

    seen: list[tuple[bool, str]] = []
    record = lambda enabled, device_type: seen.append((enabled, device_type))  # noqa: E731
    monkeypatch.setattr(allocator, "tune_cpu_allocator", record)

    class Tiny(ember.TrainingModule):
        def __init__(self) -> None:
            super().__init__()
            self.model, self.loss_fn = nn.Linear(4, 2), nn.CrossEntropyLoss()

        def configure_optimizers(self) -> torch.optim.Optimizer:
            return torch.optim.SGD(self.parameters(), lr=0.1)

    data = DataLoader(TensorDataset(torch.randn(4, 4), torch.randint(0, 2, (4,))), batch_size=4)
    quiet = dict(logger=False, enable_progress_bar=False, enable_model_summary=False, enable_checkpointing=False)
    ember.Trainer(max_steps=1, accelerator="cpu", **quiet).fit(Tiny(), data)  # type: ignore[arg-type]
    assert seen == [(True, "cpu")]
