"""`ModelParallelStrategy` without processes: mesh sizes, the hook contract, clipping norms, the config route,
and the char transformer's plan. The multi-process behaviour is in tests/distributed/test_model_parallel.py."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st
from torch import nn

from ember.strategies.fsdp import outermost_blocks, repeated_block_classes
from ember.strategies.model_parallel import (
    ModelParallelStrategy,
    check_size,
    hook_takes_mesh,
    mesh_shape,
    total_norm,
)
from ember.trainer import options
from ember.trainer.options import resolve_strategy

ROOT = Path(__file__).resolve().parents[3]
sizes = st.one_of(st.just("auto"), st.integers(min_value=1, max_value=16))


@given(
    world=st.integers(min_value=1, max_value=64),
    nodes=st.integers(min_value=1, max_value=8),
    dp=sizes,
    tp=sizes,
)
def test_mesh_shape_fills_the_world_or_says_why_not(world: int, nodes: int, dp: Any, tp: Any) -> None:
    per_node = max(world // nodes, 1)
    try:
        shape = mesh_shape(world, per_node, dp, tp)
    except ValueError as exc:
        assert "does not fill the" in str(exc) and str(world) in str(exc)
        if dp != "auto" and tp != "auto":
            assert dp * tp != world  # explicit sizes fail only when their product is not the world
        return
    assert shape[0] * shape[1] == world
    assert (dp == "auto" or shape[0] == dp) and (tp == "auto" or shape[1] == tp)
    if dp == tp == "auto":
        assert shape == (world // per_node, per_node)


def test_auto_sizes_make_each_node_one_tensor_parallel_group() -> None:
    assert mesh_shape(16, 8, "auto", "auto") == (2, 8)
    assert mesh_shape(8, 8, "auto", 2) == (4, 2)
    assert mesh_shape(8, 8, 2, "auto") == (2, 4)
    assert mesh_shape(2, 2, "auto", 2) == (1, 2)


@pytest.mark.parametrize("value", [0, -1, True, "2", 2.5, None])
def test_a_size_is_a_positive_int_or_auto(value: Any) -> None:
    with pytest.raises(ValueError, match="positive number of processes or 'auto'"):
        check_size("tensor_parallel_size", value)
    with pytest.raises(ValueError, match="data_parallel_size"):
        ModelParallelStrategy(data_parallel_size=value)


class Plain(nn.Module):
    pass


class NoArgument(nn.Module):
    def configure_model(self) -> None:  # FSDP's hook: builds layers (on the meta device)
        pass


class TakesMesh(nn.Module):
    def configure_model(self, device_mesh: Any) -> None:
        pass


class TakesAnything(nn.Module):
    def configure_model(self, *args: Any) -> None:
        pass


def test_which_hook_a_module_has() -> None:
    assert hook_takes_mesh(Plain()) is None
    assert hook_takes_mesh(NoArgument()) is False
    assert hook_takes_mesh(TakesMesh()) is True
    assert hook_takes_mesh(TakesAnything()) is True


@pytest.mark.parametrize(("module", "says"), [(Plain(), "is missing"), (NoArgument(), "takes no device mesh")])
def test_a_module_without_a_mesh_hook_is_refused_before_anything_is_set_up(module: nn.Module, says: str) -> None:
    strategy = ModelParallelStrategy(tensor_parallel_size=2)
    with pytest.raises(TypeError, match=rf"configure_model\(device_mesh\), which {says}.*def configure_model"):
        strategy.setup_module(module)


def test_the_mesh_exists_only_once_the_processes_joined() -> None:
    with pytest.raises(RuntimeError, match="once the processes have joined"):
        _ = ModelParallelStrategy().device_mesh


def test_the_total_norm_of_plain_gradients_is_torchs() -> None:
    grads = [torch.randn(3, 4), torch.randn(7), torch.randn(2, 2, 2)]
    expected = torch.nn.utils.get_total_norm(grads, 2.0)
    torch.testing.assert_close(total_norm(grads, 2.0), expected)
    assert float(total_norm([], 2.0)) == 0.0


def _resolve(strategy: Any, devices: int, num_nodes: int) -> Any:
    given = {"strategy": strategy, "accelerator": "cpu", "devices": devices, "num_nodes": num_nodes}
    return resolve_strategy(options.build(given))


def test_resolve_strategy_knows_model_parallel() -> None:
    strategy = _resolve("model_parallel", 4, 2)
    assert isinstance(strategy, ModelParallelStrategy)
    assert (strategy.data_parallel_size, strategy.tensor_parallel_size) == ("auto", "auto")
    assert (strategy.devices, strategy.num_nodes, strategy.world_size_requested) == (4, 2, 8)
    given = ModelParallelStrategy(2, 2, loss_parallel=True)
    assert _resolve(given, 4, 1) is given
    with pytest.raises(ValueError, match="model_parallel"):
        _resolve("tensor_parallel", 2, 1)


def test_the_tp_config_builds_its_strategy() -> None:
    from ember import config
    from ember.cli import build

    path = ROOT / "configs" / "char_transformer_tp.yaml"
    loaded = config.load([path], ["trainer.strategy.loss_parallel=true"])
    resolved = config.resolve(loaded)
    config.check(loaded, resolved, "fit")
    trainer, module, _data = build(resolved)
    strategy = trainer.strategy
    assert isinstance(strategy, ModelParallelStrategy)
    assert (strategy.data_parallel_size, strategy.tensor_parallel_size, strategy.loss_parallel) == ("auto", 2, True)
    assert strategy.world_size_requested == 2
    assert hook_takes_mesh(module) is True


@pytest.mark.slow  # 4 s of CPU on a 2-core machine, with the processes it starts
def test_a_bad_size_in_the_config_is_one_line_and_exit_2(tmp_path: Path) -> None:
    path = ROOT / "configs" / "char_transformer_tp.yaml"
    done = subprocess.run(
        [sys.executable, "-m", "ember", "fit", "-c", str(path), "trainer.strategy.tensor_parallel_size=0"],
        capture_output=True,
        text=True,
        cwd=tmp_path,
        env={**_env(), "PYTHONPATH": str(ROOT)},
        timeout=120,
    )
    assert done.returncode == 2, done.stderr
    lines = done.stderr.strip().splitlines()
    assert len(lines) == 1 and "tensor_parallel_size=0" in lines[0] and "Traceback" not in done.stderr


def _env() -> dict[str, str]:
    import os

    return {k: v for k, v in os.environ.items() if not k.startswith(("RANK", "WORLD_SIZE", "TORCHELASTIC"))}


def test_fsdp_shards_the_outermost_repeated_blocks() -> None:
    from examples.char_transformer import CharTransformer

    module = CharTransformer(context=8, d_model=8, n_heads=2, n_layers=3)
    classes = repeated_block_classes(module)
    assert {c.__name__ for c in classes} == {"Block", "CausalSelfAttention"}  # nested: attention inside a block
    assert outermost_blocks(module, classes) == list(module.blocks)


class _FakeMesh:
    def __init__(self, tp: int) -> None:
        self.tp = tp

    def __getitem__(self, name: str) -> Any:
        return self

    def size(self) -> int:
        return self.tp


def test_the_char_transformer_plan() -> None:
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel

    from examples.char_transformer import CharTransformer, tensor_parallel_plan

    plan = tensor_parallel_plan(2)
    assert sorted(plan) == sorted(
        f"blocks.{i}.{name}" for i in range(2) for name in ("attn.q", "attn.k", "attn.v", "attn.proj", "mlp.0", "mlp.2")
    )
    assert all(isinstance(plan[f"blocks.1.{n}"], ColwiseParallel) for n in ("attn.q", "attn.k", "attn.v", "mlp.0"))
    assert all(isinstance(plan[f"blocks.0.{n}"], RowwiseParallel) for n in ("attn.proj", "mlp.2"))
    assert isinstance(tensor_parallel_plan(1, loss_parallel=True)["lm_head"], ColwiseParallel)
    module = CharTransformer(context=8, d_model=12, n_heads=3, n_layers=1)
    module._trainer = None
    with pytest.raises(ValueError, match="n_heads=3 must be a multiple of the tensor-parallel size 2"):
        module.configure_model(_FakeMesh(2))
