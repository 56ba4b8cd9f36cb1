"""The model-parallel runs the tests compare: tensor parallel, 2-D (dp x tp), HSDP, and resumes across meshes.

`TPNet` is `dist_workload.Net` with a tensor-parallel plan (``configure_model(device_mesh)``): the four
linear layers alternate colwise / rowwise, so each pair communicates once (an all-reduce after the
rowwise one). Job scripts (written by the tests next to copies of this file and `dist_workload`) call
`mp_job` (2 processes) or `mesh_job` (4 processes); each rank saves its results with `save_result`.

Every run keeps the *global* batch at 8 samples: a process gets ``8 / dp`` samples per step, and the
processes of one TP group get the same ones. So every mesh shape trains on the same batches as one
process with batch 8.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Any

import dist_workload as W
import torch
import torch.distributed as dist
from torch.utils.data import DataLoader, DistributedSampler
from torchmetrics import Metric

import ember
from ember.callbacks.model_checkpoint import ModelCheckpoint

GLOBAL_BATCH = 8
#: The resume runs: 3 epochs of 96 samples in global batches of 8 (36 steps), stopped after step 10.
STOP_AT = 10


class SampleCount(Metric):
    """How many samples a (synchronised) evaluation saw: a sum, which counts a TP group once only if the
    metric synchronises over the data-parallel processes."""

    def __init__(self) -> None:
        super().__init__()
        self.add_state("count", torch.zeros(()), dist_reduce_fx="sum")

    def update(self, preds: torch.Tensor, target: torch.Tensor) -> None:
        self.count += target.numel()

    def compute(self) -> torch.Tensor:
        return self.count


class TPNet(W.Net):
    """`dist_workload.Net` whose linear layers are split over the ``tp`` mesh dimension.

    Its evaluation also reports sums: ``val/count`` (a torchmetrics sum) and ``val/samples``
    (``self.log(..., reduce_fx="sum", sync_dist=True)``), which must equal the number of samples.
    """

    def __init__(self, dropout: float = 0.0, adamw: bool = False) -> None:
        super().__init__(dropout, adamw)
        self.metrics["count"] = SampleCount()

    def validation_step(self, batch: Any, batch_idx: int, dataloader_idx: int = 0) -> torch.Tensor:
        loss: torch.Tensor = super().validation_step(batch, batch_idx, dataloader_idx)
        self.log("val/samples", float(len(batch[1])), reduce_fx="sum", sync_dist=True)
        return loss

    def configure_model(self, device_mesh: Any) -> None:
        from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

        plan = {
            "0": ColwiseParallel(),  # 4 -> 16, output features split
            "1.linear": RowwiseParallel(),  # 16 -> 16, input features split; output all-reduced
            "2.linear": ColwiseParallel(),
            "3": RowwiseParallel(),  # 16 -> 3
        }
        parallelize_module(self.model, device_mesh["tp"], plan)


class HookShardsItself(TPNet):
    """Applies the TP plan and FSDP2 over ``dp`` itself (ember must then shard nothing)."""

    def configure_model(self, device_mesh: Any) -> None:
        from torch.distributed.fsdp import fully_shard

        super().configure_model(device_mesh)
        for block in (self.model[1], self.model[2]):
            fully_shard(block, mesh=device_mesh["dp"])
        fully_shard(self, mesh=device_mesh["dp"])


def model_parallel(dp: int | str, tp: int | str, **kwargs: Any) -> Any:
    from ember.strategies import ModelParallelStrategy

    return ModelParallelStrategy(dp, tp, timeout_s=W.PG_TIMEOUT_S, **kwargs)


def fit_sequential(strategy: Any, root: Path, dp: int, module_cls: type[W.Net] = TPNet, **kwargs: Any) -> Any:
    """`dist_workload.fit_sequential` for `module_cls`: 20 SGD steps, global batch 8, ``shuffle=False``."""
    ember.seed_everything(W.SEED)
    module = module_cls()
    trainer = ember.Trainer(
        max_steps=20,
        strategy=strategy,
        num_sanity_val_steps=0,
        default_root_dir=root,
        run_name="seq",
        accelerator=W.ACCELERATOR,
        **W.QUIET,
        **kwargs,
    )
    train = DataLoader(W.train_set(W.N_SEQ), batch_size=GLOBAL_BATCH // dp, shuffle=False)
    trainer.fit(module, train, DataLoader(W.val_set(W.N_VAL), batch_size=5))
    return trainer, module


def fit_shuffled(
    strategy: Any,
    root: Path,
    dp: int,
    *,
    stop_at: int | None = None,
    ckpt_path: str | None = None,
    module_cls: type[W.Net] = TPNet,
    dropout: float = 0.0,
    callbacks: Sequence[ember.Callback] = (),
    loader: DataLoader | None = None,
    **kwargs: Any,
) -> tuple[ember.Trainer, W.Net]:
    """AdamW over a ``shuffle=True`` loader for 3 epochs (36 steps); a run stopped at `stop_at` saves a
    checkpoint every 5 steps."""
    ember.seed_everything(W.SEED)
    module = module_cls(dropout=dropout, adamw=True)
    added: list[ember.Callback] = []
    if stop_at is not None:
        added += [ModelCheckpoint(every_n_train_steps=5, save_top_k=-1), W.StopAt(stop_at)]
    trainer = ember.Trainer(
        max_epochs=3,
        strategy=strategy,
        callbacks=[*added, *callbacks],
        enable_checkpointing=stop_at is not None,
        default_root_dir=root,
        run_name="shuffled",
        accelerator=W.ACCELERATOR,
        **W.QUIET,
        **kwargs,
    )
    if loader is None:
        loader = DataLoader(W.train_set(W.N_SHUFFLED), batch_size=GLOBAL_BATCH // dp, shuffle=True)
    trainer.fit(module, loader, ckpt_path=ckpt_path)
    return trainer, module


def optimizer_state(trainer: ember.Trainer, module: W.Net) -> dict[str, torch.Tensor]:
    """The optimizer's state as full tensors keyed ``<param name>/<state key>`` (a collective when sharded)."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_optimizer_state_dict

    state = get_optimizer_state_dict(
        module, trainer.optimizers[0], options=StateDictOptions(full_state_dict=True, cpu_offload=False)
    )
    out = {}
    for name, values in state["state"].items():
        for key, value in values.items():
            full = value.full_tensor() if hasattr(value, "full_tensor") else value
            out[f"{name}/{key}"] = torch.as_tensor(full).detach().to("cpu", copy=True)
    return out


def summary(trainer: ember.Trainer, module: W.Net) -> dict[str, Any]:
    """`dist_workload.summary`, plus the mesh, the parameter placements and the full optimizer state."""
    mesh = getattr(trainer.strategy, "_device_mesh", None)
    placements = {n: str(getattr(p, "placements", "plain")) for n, p in module.named_parameters()}
    return {
        **W.summary(trainer, module),
        "mesh": tuple(mesh.shape) if mesh is not None else None,
        "sampler": dict(trainer.strategy.distributed_sampler_kwargs) if mesh is not None else None,
        "placements": placements,
        "optimizer": optimizer_state(trainer, module),
    }


class Loaded(ember.Callback):
    """Full weights and optimizer state when training is about to start (after a checkpoint was loaded).

    Only for runs that resume: on an optimizer without state, DCP's ``get_optimizer_state_dict`` creates it
    by stepping the optimizer once (zero gradients, zero learning rate), which changes the run (AdamW's step
    count)."""

    def on_fit_start(self, trainer: Any, module: Any) -> None:
        self.weights = W.full_state(module)
        self.optimizer = optimizer_state(trainer, module)


def evaluate(strategy: Any, n_val: int) -> dict[str, Any]:
    """`dist_workload.evaluate` for `TPNet`: validate and test of the fresh model over `n_val` samples."""
    ember.seed_everything(W.SEED)
    module = TPNet()
    trainer = ember.Trainer(strategy=strategy, enable_checkpointing=False, accelerator=W.ACCELERATOR, **W.QUIET)
    loader = DataLoader(W.val_set(n_val), batch_size=5)
    validated = trainer.validate(module, loader)[0]
    tested = trainer.test(module, loader)[0]
    batches = len(trainer.strategy.distribute_loader(loader, training=False))
    return {**W.where(trainer), "validate": validated, "test": tested, "batches": batches}


def resume_runs(
    out: Path, name: str, strategy: Any, dp: int, source: Path | None, dropout: float = 0.0, **kwargs: Any
) -> dict[str, Any]:
    """Under `strategy()` (mesh ``(dp, .)``): the uninterrupted run, and one resumed from checkpoint `source`
    (the step-10 checkpoint of a run at another or the same mesh). With `source` None, this mesh also writes
    the stopped run whose step-10 checkpoint is resumed."""
    full = summary(*fit_shuffled(strategy(), out / f"{name}-full", dp, dropout=dropout, **kwargs))
    result: dict[str, Any] = {"full": full}
    if source is None:
        stopped = fit_shuffled(strategy(), out / f"{name}-stopped", dp, stop_at=STOP_AT, dropout=dropout, **kwargs)
        result["stopped"] = summary(*stopped)
        dist.barrier()  # as if the resume were a new launch
        source = W._last_checkpoint(out / f"{name}-stopped" / "shuffled")
    loaded = Loaded()
    resumed = fit_shuffled(
        strategy(), out / f"{name}-resumed", dp, ckpt_path=str(source), dropout=dropout, callbacks=[loaded], **kwargs
    )
    result.update(resumed=summary(*resumed), loaded=loaded.weights, loaded_optimizer=loaded.optimizer, ckpt=str(source))
    return result


def one_process_loader() -> DataLoader:
    """The shuffled loader of `fit_shuffled` for one process, in the order every mesh shape sees: the model-
    parallel strategy shuffles by (seed, epoch) with a `DistributedSampler` of ``dp`` replicas, whose global
    order does not depend on ``dp``."""
    data = W.train_set(W.N_SHUFFLED)
    sampler = DistributedSampler(data, num_replicas=1, rank=0, shuffle=True, seed=W.SEED)
    return DataLoader(data, batch_size=GLOBAL_BATCH, sampler=sampler)


class StepLosses(ember.Callback):
    """Each training step's loss, as a float (the whole value of a loss-parallel DTensor)."""

    def __init__(self) -> None:
        self.losses: list[float] = []

    def on_train_batch_end(self, trainer: Any, module: Any, outputs: Any, batch: Any, batch_idx: int) -> None:
        loss = outputs["loss"]
        self.losses.append(float(loss.full_tensor() if hasattr(loss, "full_tensor") else loss))


def char_fit(strategy: Any, root: Path, batch_size: int = 8) -> dict[str, Any]:
    """examples/char_transformer.py at a small size: 6 steps over the standard library's first 40 kB, in
    order (``shuffle=False``), `batch_size` windows per process."""
    from examples.char_transformer import CharTransformer, StdlibText, Windows

    ember.seed_everything(W.SEED)
    data = StdlibText(seq_len=32, batch_size=8, max_bytes=40_000)
    data.setup("fit")
    module = CharTransformer(context=32, d_model=32, n_heads=4, n_layers=2, warmup_steps=2, total_steps=6)
    losses = StepLosses()
    trainer = ember.Trainer(
        max_steps=6,
        strategy=strategy,
        callbacks=[losses],
        limit_val_batches=2,
        num_sanity_val_steps=0,
        enable_checkpointing=False,
        default_root_dir=root,
        accelerator=W.ACCELERATOR,
        **W.QUIET,
    )
    train = DataLoader(Windows(data.train_tokens, 32), batch_size=batch_size)
    trainer.fit(module, train, DataLoader(Windows(data.val_tokens, 32), batch_size=8))
    kinds = {type(p).__name__ for p in module.parameters()}
    metrics = {k: float(v) for k, v in trainer.callback_metrics.items()}
    return {"losses": losses.losses, "params": W.full_state(module), "metrics": metrics, "param_types": kinds}


def no_plan() -> dict[str, Any]:
    """Set up a module whose hook applies no TP plan, at tp=2: the error names the fix."""
    strategy = model_parallel(1, 2)
    strategy.devices = 2
    strategy.setup_environment()

    class NoPlan(W.Net):
        def configure_model(self, device_mesh: Any) -> None:
            pass

    try:
        strategy.setup_module(NoPlan())
    except RuntimeError as exc:
        return {"error": str(exc)}
    return {"error": None}


def compiled(out: Path) -> dict[str, Any]:
    """`fit_sequential` at (1, 2) with ``compile`` (dynamo with the aot_eager backend: the tracing of the
    DTensor graphs, not inductor's code generation, which tests/gpu runs)."""
    from torch._dynamo.utils import counters

    torch._dynamo.reset()
    counters.clear()
    trainer, module = fit_sequential(model_parallel(1, 2), out / "tp-compile", dp=1, compile={"backend": "aot_eager"})
    names = [n for n, m in module.named_modules() if m._compiled_call_impl is not None]
    return {**summary(trainer, module), "compiled_modules": names, "graphs": counters["stats"]["unique_graphs"]}


# --- job entry points -------------------------------------------------------------------------------


def mp_job(out: Path) -> None:
    """2 processes: TP(2) against one process (plain, clipped, compiled); at (1, 2) a run with dropout stopped
    at step 10 and resumed at (1, 2); one without dropout stopped at step 10 (the checkpoint the other meshes
    resume) and resumed at (1, 2) and (2, 1); at (2, 1) a run with dropout stopped and resumed; the char
    transformer's plan (with and without loss parallel, and under FSDP, which skips the plan); a hook that
    applies no plan."""
    tp = lambda: model_parallel("auto", 2)  # noqa: E731
    W.section(out, "tp_seq", lambda: summary(*fit_sequential(tp(), out / "tp-seq", dp=1)))
    W.section(out, "tp_clip", lambda: summary(*fit_sequential(tp(), out / "tp-clip", dp=1, gradient_clip_val=0.1)))
    clip_value = dict(gradient_clip_val=0.002, gradient_clip_algorithm="value")
    W.section(out, "tp_clip_value", lambda: summary(*fit_sequential(tp(), out / "tp-clip-v", dp=1, **clip_value)))
    W.section(out, "tp_resume", lambda: resume_runs(out, "tp-dropout", tp, 1, None, dropout=0.2))
    W.section(out, "tp_source", lambda: resume_runs(out, "tp", tp, 1, None))
    source = W._last_checkpoint(out / "tp-stopped" / "shuffled")
    W.section(out, "tp_to_dp", lambda: resume_runs(out, "dp", lambda: model_parallel(2, 1), 2, source))
    W.section(out, "dp_resume", lambda: resume_runs(out, "dp-dropout", lambda: model_parallel(2, 1), 2, None, 0.2))
    W.section(out, "char_tp", lambda: char_fit(tp(), out / "char-tp"))
    W.section(out, "char_loss_parallel", lambda: char_fit(model_parallel(1, 2, loss_parallel=True), out / "char-lp"))
    W.section(out, "char_fsdp", lambda: char_fit(W.fsdp(), out / "char-fsdp", batch_size=4))
    W.section(out, "no_plan", no_plan)
    W.section(out, "tp_compile", lambda: compiled(out))


def hsdp_resume(out: Path) -> dict[str, Any]:
    """`dist_workload.fit_shuffled` (dropout, AdamW) under HSDP: uninterrupted, stopped at 10, resumed."""
    hsdp = lambda: W.fsdp(replicate_degree=2)  # noqa: E731
    root = out / "hsdp-shuffled"
    full = W.summary(*W.fit_shuffled(hsdp(), out / "hsdp-shuffled-full"))
    stopped = W.summary(*W.fit_shuffled(hsdp(), root, ckpt_every=5, stop_at=STOP_AT, keep=-1))
    dist.barrier()
    ckpt = W._last_checkpoint(root / "shuffled")
    resumed = W.summary(*W.fit_shuffled(hsdp(), root, ckpt_every=5, ckpt_path="last", keep=-1))
    return {"full": full, "stopped": stopped, "resumed": resumed, "ckpt": str(ckpt)}


def mesh_job(out: Path, source: str) -> None:
    """4 processes: the 2-D mesh (2, 2) against one process (plain, clipped, and with a hook that shards
    itself); the (1, 2) checkpoint `source` resumed at (2, 2); HSDP on (2, 2) against DDP, its resume and its
    evaluation; last, evaluation at (2, 2) with data-parallel groups running different numbers of batches."""
    mesh = lambda: model_parallel(2, 2)  # noqa: E731
    hsdp = lambda: W.fsdp(replicate_degree=2)  # noqa: E731
    W.section(out, "mesh_seq", lambda: summary(*fit_sequential(mesh(), out / "mesh-seq", dp=2)))
    hook = lambda: summary(*fit_sequential(mesh(), out / "hook-seq", dp=2, module_cls=HookShardsItself))  # noqa: E731
    W.section(out, "hook_seq", hook)
    clip = lambda: summary(*fit_sequential(mesh(), out / "mesh-clip", dp=2, gradient_clip_val=0.1))  # noqa: E731
    W.section(out, "mesh_clip", clip)
    W.section(out, "mesh_from_tp", lambda: resume_runs(out, "mesh", mesh, 2, Path(source)))
    W.section(out, "ddp_seq", lambda: W.summary(*W.fit_sequential(W.ddp(), out / "ddp-seq", batch_size=2)))
    W.section(out, "hsdp_seq", lambda: W.summary(*W.fit_sequential(hsdp(), out / "hsdp-seq", batch_size=2)))
    W.section(out, "hsdp_resume", lambda: hsdp_resume(out))
    W.section(out, "hsdp_eval", lambda: {str(n): W.evaluate(hsdp(), n) for n in (W.N_VAL, W.N_VAL_UNEVEN)})
    W.section(out, "mesh_eval_uneven", lambda: evaluate(mesh(), W.N_VAL_UNEVEN))
