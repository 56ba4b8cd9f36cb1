"""The training runs the distributed tests compare, in one place.

Each job script (written by a test into its tmp_path, next to a copy of this file) calls one of the
``*_job`` entry points below; the single-process references call the same functions inside the pytest
process. Every rank saves what it saw with `save_result` (``<name>-rank<R>.pt``): final parameters
(full tensors, also under FSDP), per-step losses and sample indices, metrics, and where it ran.

The model has two repeated blocks, so FSDP shards them as their own units besides the root.
"""

from __future__ import annotations

import io
import os
import signal
import sys
import time
import traceback
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor, nn
from torch.utils.data import DataLoader, Sampler, TensorDataset

import ember
from ember.callbacks.model_checkpoint import ModelCheckpoint

SEED = 123
N_SEQ = 160  # 2 ranks x batch 4 (or 1 x 8): 20 steps per epoch
N_SHUFFLED = 96  # 2 ranks x batch 4: 12 steps per epoch
N_VAL = 37  # odd: ranks get 19 and 18 samples
N_VAL_UNEVEN = 41  # batch 5: rank 0 gets 5 batches, rank 1 gets 4
#: Collective timeout of the test jobs: a desynchronised job fails in seconds, not in torch's 30 minutes.
PG_TIMEOUT_S = 30.0
#: Where the runs train: the CPU (gloo) for tests/distributed, even on a machine with GPUs; tests/gpu sets "cuda".
ACCELERATOR = "cpu"
QUIET: dict[str, Any] = dict(logger=False, enable_progress_bar=False, enable_model_summary=False)


# --- data and model -----------------------------------------------------------------------------


def features(n: int, seed: int) -> tuple[Tensor, Tensor]:
    g = torch.Generator().manual_seed(seed)
    return torch.randn(n, 4, generator=g), torch.randint(0, 3, (n,), generator=g)


def train_set(n: int) -> TensorDataset:
    """(x, y, index): the training step records which samples each step saw."""
    x, y = features(n, 0)
    return TensorDataset(x, y, torch.arange(n))


def val_set(n: int) -> TensorDataset:
    x, y = features(n, 1)
    return TensorDataset(x, y)


class Block(nn.Module):
    def __init__(self, width: int, dropout: float) -> None:
        super().__init__()
        self.linear = nn.Linear(width, width)
        self.drop = nn.Dropout(dropout) if dropout else nn.Identity()

    def forward(self, x: Tensor) -> Tensor:
        return self.drop(torch.relu(self.linear(x)))


class Net(ember.TrainingModule):
    """3-class classifier; default validation step (``val/loss`` with sync_dist, ``val/acc`` torchmetrics).

    ``accuracy=False`` leaves the torchmetrics accuracy out, for runs that never evaluate: importing
    torchmetrics costs a process about 2 s of CPU (it imports transformers and scipy), and the accuracy holds no
    parameters, so training is the same with or without it."""

    def __init__(self, dropout: float = 0.0, adamw: bool = False, accuracy: bool = True) -> None:
        super().__init__()
        self.model = nn.Sequential(nn.Linear(4, 16), Block(16, dropout), Block(16, dropout), nn.Linear(16, 3))
        self.loss_fn = nn.CrossEntropyLoss()
        if accuracy:
            from torchmetrics.classification import MulticlassAccuracy

            self.metrics = {"acc": MulticlassAccuracy(num_classes=3, average="micro")}
        self.adamw = adamw
        self.seen: list[list[int]] = []
        self.losses: list[float] = []
        self.epochs: list[int] = []
        self.forward_dtype = ""

    def training_step(self, batch: Any, batch_idx: int) -> Tensor:
        x, y, idx = batch
        logits = self(x)
        self.forward_dtype = str(logits.dtype)
        loss: Tensor = self.loss_fn(logits, y)
        self.seen.append(idx.tolist())
        self.losses.append(float(loss.detach()))
        self.epochs.append(self.trainer.current_epoch)
        self.log("train/loss", loss)
        return loss

    def configure_optimizers(self) -> torch.optim.Optimizer:
        if self.adamw:
            return torch.optim.AdamW(self.parameters(), lr=0.01)
        return torch.optim.SGD(self.parameters(), lr=0.1)


class StopAt(ember.Callback):
    def __init__(self, step: int) -> None:
        self.step = step

    def on_train_batch_end(self, trainer: Any, module: Any, outputs: Any, batch: Any, batch_idx: int) -> None:
        if trainer.global_step >= self.step:
            trainer.should_stop = True


class Reversed(Sampler[int]):
    """A custom sampler: the dataset backwards."""

    def __init__(self, n: int) -> None:
        self.n = n

    def __iter__(self) -> Any:
        return iter(range(self.n - 1, -1, -1))

    def __len__(self) -> int:
        return self.n


# --- helpers ------------------------------------------------------------------------------------


def rank() -> int:
    return dist.get_rank() if dist.is_initialized() else 0


def ddp(**kwargs: Any) -> Any:
    from ember.strategies import DDPStrategy

    return DDPStrategy(timeout_s=PG_TIMEOUT_S, **kwargs)


def fsdp(**kwargs: Any) -> Any:
    from ember.strategies import FSDPStrategy

    return FSDPStrategy(timeout_s=PG_TIMEOUT_S, **kwargs)


def full_state(module: nn.Module) -> dict[str, Tensor]:
    """The module's state with FSDP's DTensor shards gathered (a collective under FSDP: call on every rank)."""
    out = {}
    for key, value in module.state_dict().items():
        full = value.full_tensor() if hasattr(value, "full_tensor") else value
        out[key] = full.detach().to("cpu", copy=True)
    return out


def where(trainer: ember.Trainer) -> dict[str, Any]:
    """Where this process ran, as the trainer and the environment see it."""
    cluster = getattr(trainer.strategy, "cluster", None)
    return {
        "rank": trainer.global_rank,
        "world_size": trainer.world_size,
        "kind": cluster.kind if cluster is not None else "single",
        "local_rank": cluster.local_rank if cluster is not None else 0,
        "node_rank": cluster.node_rank if cluster is not None else 0,
        "num_nodes": cluster.num_nodes if cluster is not None else 1,
        "strategy": type(trainer.strategy).__name__,
        "backend": dist.get_backend() if dist.is_initialized() else None,
        "device": str(trainer.strategy.root_device),
        "pid": os.getpid(),
        "restart_count": int(os.environ.get("TORCHELASTIC_RESTART_COUNT", 0)),
    }


def save_result(out: Path, name: str, data: dict[str, Any]) -> None:
    """``<out>/<name>-rank<R>.pt``, written under a temporary name and renamed (readers never see half)."""
    out.mkdir(parents=True, exist_ok=True)
    path = out / f"{name}-rank{rank()}.pt"
    tmp = path.with_name(f".{path.name}.tmp")
    buffer = io.BytesIO()  # serialized in memory, written by Python: a failed write names its OSError (errno), where
    torch.save(data, buffer)  # torch's own file writer once reported a parent directory that existed as missing
    tmp.write_bytes(buffer.getvalue())
    os.replace(tmp, path)


def summary(trainer: ember.Trainer, module: Net) -> dict[str, Any]:
    return {
        **where(trainer),
        "params": full_state(module),
        "losses": list(module.losses),
        "seen": list(module.seen),
        "epochs": list(module.epochs),
        "steps": trainer.global_step,
        "metrics": dict(trainer.callback_metrics),
        "forward_dtype": module.forward_dtype,
        "param_dtypes": sorted({str(p.dtype) for p in module.parameters()}),
    }


# --- the runs -------------------------------------------------------------------------------------


def fit_sequential(
    strategy: Any,
    root: Path,
    batch_size: int = 4,
    devices: int | str = "auto",
    num_nodes: int = 1,
    accuracy: bool = True,
    **trainer_kwargs: Any,
) -> tuple[ember.Trainer, Net]:
    """20 SGD steps over a ``shuffle=False`` loader, validation on 37 samples; checkpoint at the end.
    ``accuracy=False``: without ``val/acc`` (see `Net`), for jobs whose tests read no metric."""
    ember.seed_everything(SEED)
    module = Net(accuracy=accuracy)
    trainer = ember.Trainer(
        max_steps=20,
        strategy=strategy,
        devices=devices,
        num_nodes=num_nodes,
        num_sanity_val_steps=0,
        default_root_dir=root,
        run_name="seq",
        accelerator=ACCELERATOR,
        **QUIET,
        **trainer_kwargs,
    )
    train = DataLoader(train_set(N_SEQ), batch_size=batch_size, shuffle=False)
    trainer.fit(module, train, DataLoader(val_set(N_VAL), batch_size=5))
    return trainer, module


def fit_shuffled(
    strategy: Any,
    root: Path,
    *,
    ckpt_every: int | None = None,
    stop_at: int | None = None,
    ckpt_path: str | None = None,
    callbacks: Sequence[ember.Callback] = (),
    max_epochs: int | None = 3,
    max_steps: int = -1,
    keep: int = 1,
    async_save: bool = False,
    module_cls: type[Net] | None = None,
    **trainer_kwargs: Any,
) -> tuple[ember.Trainer, Net]:
    """AdamW, dropout, a ``shuffle=True`` loader: what an exact resume has to get right (`module_cls`: a
    subclass of `Net` in its place)."""
    ember.seed_everything(SEED)
    module = (module_cls or Net)(dropout=0.2, adamw=True, accuracy=False)  # no validation
    cbs: list[ember.Callback] = []
    if ckpt_every is not None:
        cbs.append(ModelCheckpoint(every_n_train_steps=ckpt_every, save_top_k=keep, async_save=async_save))
    if stop_at is not None:
        cbs.append(StopAt(stop_at))
    trainer = ember.Trainer(
        max_epochs=max_epochs,
        max_steps=max_steps,
        strategy=strategy,
        callbacks=[*cbs, *callbacks],
        enable_checkpointing=ckpt_every is not None,
        default_root_dir=root,
        run_name="shuffled",
        accelerator=ACCELERATOR,
        **QUIET,
        **trainer_kwargs,
    )
    trainer.fit(module, DataLoader(train_set(N_SHUFFLED), batch_size=4, shuffle=True), ckpt_path=ckpt_path)
    return trainer, module


def fit_seen(strategy: Any, loader: DataLoader, steps: int = 3, **trainer_kwargs: Any) -> list[list[int]]:
    """Sample indices of the first `steps` steps through `loader`."""
    ember.seed_everything(SEED)
    module = Net(accuracy=False)  # no validation
    trainer = ember.Trainer(
        max_steps=steps,
        strategy=strategy,
        enable_checkpointing=False,
        accelerator=ACCELERATOR,
        **QUIET,
        **trainer_kwargs,
    )
    trainer.fit(module, loader)
    return module.seen


def evaluate(strategy: Any, n_val: int) -> dict[str, Any]:
    """validate and test of the freshly initialised model over `n_val` samples (batch 5)."""
    ember.seed_everything(SEED)
    module = Net()
    trainer = ember.Trainer(strategy=strategy, enable_checkpointing=False, accelerator=ACCELERATOR, **QUIET)
    loader = DataLoader(val_set(n_val), batch_size=5)
    validated = trainer.validate(module, loader)[0]
    tested = trainer.test(module, loader)[0]
    batches = len(trainer.strategy.distribute_loader(loader, training=False))
    return {**where(trainer), "validate": validated, "test": tested, "batches": batches}


def section(out: Path, name: str, run: Callable[[], dict[str, Any]]) -> None:
    """Run one part of a job and save its result; an error is saved too (for the test's message), then raised."""
    start, cpu = time.monotonic(), time.process_time()
    own = os.environ.get("RANK", os.environ.get("SLURM_PROCID", "0"))  # before the process group exists, too
    (out / f"{name}.error-rank{own}.pt").unlink(missing_ok=True)  # an earlier attempt's (torchrun restarts)
    try:
        data = run()
    except Exception:  # not SystemExit: the devices=N launcher process exits through fit
        save_result(out, f"{name}.error", {"traceback": traceback.format_exc()})
        raise
    data["seconds"], data["cpu_seconds"] = time.monotonic() - start, time.process_time() - cpu
    save_result(out, name, data)


# --- job entry points -------------------------------------------------------------------------------


def main_job(out: Path) -> None:
    """The 2-process job most tests read: DDP, then FSDP, in the same processes (one start-up for all)."""

    def ddp_seq() -> dict[str, Any]:
        trainer, module = fit_sequential(ddp(), out / "runs")
        # What this rank finds as `last` the moment fit returns (every rank should see the final checkpoint) ...
        last_on_return = _read_last(out / "runs" / "seq")
        dist.barrier()  # ... and, for the tests that load it, the path once rank 0 has surely written it.
        return {
            **summary(trainer, module),
            "last_on_return": last_on_return,
            "ckpt": str(_last_checkpoint(out / "runs" / "seq")),
        }

    def ddp_shuffled() -> dict[str, Any]:
        return summary(*fit_shuffled(ddp(), out / "runs-ddp-shuffled"))

    def ddp_samplers() -> dict[str, Any]:
        data = train_set(N_SEQ)
        return {
            "custom_sampler": fit_seen(ddp(), DataLoader(data, batch_size=4, sampler=Reversed(N_SEQ))),
            "custom_batch_sampler": fit_seen(ddp(), DataLoader(data, batch_sampler=[[5, 1], [7, 3], [0, 2]])),
            "opt_out": fit_seen(ddp(), DataLoader(data, batch_size=4), use_distributed_sampler=False),
        }

    def ddp_eval() -> dict[str, Any]:
        return {"even": evaluate(ddp(), N_VAL), "uneven": evaluate(ddp(), N_VAL_UNEVEN)}

    def fsdp_seq() -> dict[str, Any]:
        trainer, module = fit_sequential(fsdp(), out / "runs-fsdp")
        return summary(trainer, module)

    section(out, "ddp_seq", ddp_seq)
    section(out, "ddp_shuffled", ddp_shuffled)
    section(out, "ddp_samplers", ddp_samplers)
    section(out, "ddp_eval", ddp_eval)
    section(out, "fsdp_seq", fsdp_seq)
    section(out, "fsdp_eval", lambda: evaluate(fsdp(), N_VAL))
    section(out, "fsdp_resume", lambda: fsdp_resume(out))
    # Last: ranks with different numbers of eval batches (a hang here must not cost the other results).
    section(out, "fsdp_eval_uneven", lambda: evaluate(fsdp(), N_VAL_UNEVEN))


def fsdp_resume(out: Path, **trainer_kwargs: Any) -> dict[str, Any]:
    """`fit_shuffled` under FSDP uninterrupted; stopped at step 10 (checkpoints every 5 steps); resumed."""
    root = out / "runs-fsdp-shuffled"
    full = summary(*fit_shuffled(fsdp(), out / "runs-fsdp-shuffled-full", **trainer_kwargs))
    stopped = summary(*fit_shuffled(fsdp(), root, ckpt_every=5, stop_at=10, keep=-1, **trainer_kwargs))
    dist.barrier()  # as if the resume were a new launch (fit returning early is pinned by ddp_seq's last_on_return)
    ckpt = _last_checkpoint(root / "shuffled")
    resumed = summary(*fit_shuffled(fsdp(), root, ckpt_every=5, ckpt_path="last", keep=-1, **trainer_kwargs))
    return {"full": full, "stopped": stopped, "resumed": resumed, "ckpt": str(ckpt)}


def _checkpoint_dir(run_root: Path) -> Path:
    versions = sorted(run_root.glob("version_*"), key=lambda p: int(p.name.split("_")[1]))
    return versions[-1] / "checkpoints"


def _read_last(run_root: Path) -> str | None:
    """The checkpoint name the ``last`` file holds now (None: no such file yet)."""
    try:
        return (_checkpoint_dir(run_root) / "last").read_text(encoding="utf-8").strip()
    except FileNotFoundError:
        return None


def _last_checkpoint(run_root: Path) -> Path:
    return _checkpoint_dir(run_root) / (_checkpoint_dir(run_root) / "last").read_text(encoding="utf-8").strip()


def sequential_job(
    out: Path, name: str, num_nodes: str = "1", devices: str = "auto", strategy: str = "", batch_size: str = "4"
) -> None:
    """`fit_sequential` (arguments as given on a command line): under multi-node torchrun, SLURM variables set
    by hand, or ``devices=2`` without a launcher (`strategy` "ddp": the string, else a `ddp()` instance).
    Without the accuracy metric: the tests of these jobs compare parameters and samples, and every process
    (the ``devices=2`` launcher included) would otherwise import torchmetrics for nothing."""
    count: int | str = int(devices) if devices.isdigit() else devices
    run = lambda: summary(  # noqa: E731
        *fit_sequential(
            strategy or ddp(),
            out / "runs",
            batch_size=int(batch_size),
            devices=count,
            num_nodes=int(num_nodes),
            accuracy=False,
        )
    )
    section(out, name, run)


class RaiseAt(ember.Callback):
    """Rank `rank` raises at step `step`, after noting when (``raised_at``)."""

    def __init__(self, out: Path, rank: int, step: int) -> None:
        self.out, self.rank, self.step = out, rank, step

    def on_train_batch_end(self, trainer: Any, module: Any, outputs: Any, batch: Any, batch_idx: int) -> None:
        if trainer.global_rank == self.rank and trainer.global_step == self.step:
            (self.out / "raised_at").write_text(repr(time.time()), encoding="utf-8")
            raise ValueError(f"boom from rank {self.rank} at step {self.step}")


def raise_job(out: Path) -> None:
    """Rank 1 raises at step 3; a rank whose fit ever returns writes ``done-rank<R>``."""
    out.mkdir(parents=True, exist_ok=True)
    ember.seed_everything(SEED)
    module = Net(accuracy=False)  # no validation
    trainer = ember.Trainer(
        max_steps=200, strategy=ddp(), callbacks=[RaiseAt(out, 1, 3)], accelerator=ACCELERATOR, **QUIET
    )
    trainer.fit(module, DataLoader(train_set(N_SEQ), batch_size=4))
    (out / f"done-rank{trainer.global_rank}").write_text("fit returned")


class KillOnce(ember.Callback):
    """Rank `rank` SIGKILLs itself at step `step`, once (a marker file remembers it across restarts)."""

    def __init__(self, marker: Path, rank: int, step: int) -> None:
        self.marker, self.rank, self.step = marker, rank, step

    def on_train_batch_end(self, trainer: Any, module: Any, outputs: Any, batch: Any, batch_idx: int) -> None:
        if trainer.global_rank == self.rank and trainer.global_step == self.step and not self.marker.exists():
            self.marker.write_text(f"killed at step {self.step}", encoding="utf-8")
            os.kill(os.getpid(), signal.SIGKILL)


def kill_job(out: Path, kill_step: int = 7) -> None:
    """`fit_shuffled` under DDP with a checkpoint every step and ckpt_path="last"; rank 1 dies once."""
    kill = KillOnce(out / "killed", 1, kill_step)
    section(
        out,
        "killed",
        lambda: summary(*fit_shuffled(ddp(), out / "runs", ckpt_every=1, ckpt_path="last", callbacks=[kill])),
    )


class SignalAt(ember.Callback):
    """Rank `rank` sends itself SIGTERM (a preemption notice) at step `step`; notes when fit stopped."""

    def __init__(self, rank: int, step: int) -> None:
        self.rank, self.step = rank, step
        self.sent_at: float | None = None
        self.stopped: tuple[int, float] | None = None

    def on_train_batch_end(self, trainer: Any, module: Any, outputs: Any, batch: Any, batch_idx: int) -> None:
        if trainer.global_rank == self.rank and trainer.global_step == self.step:
            self.sent_at = time.time()
            os.kill(os.getpid(), signal.SIGTERM)

    def on_exception(self, trainer: Any, module: Any, exception: BaseException) -> None:
        self.stopped = (trainer.global_step, time.time())


def preempt_job(out: Path) -> None:
    """Rank 1 alone gets SIGTERM at step 5 of a long fit; then the fit resumes from ``last`` for 6 steps and an
    uninterrupted fit runs to the same step (both in this process)."""

    def run() -> dict[str, Any]:
        ember.seed_everything(SEED)
        module, notice = Net(dropout=0.2, adamw=True, accuracy=False), SignalAt(1, 5)
        trainer = ember.Trainer(
            max_epochs=1000,
            strategy=ddp(),
            callbacks=[notice],
            enable_checkpointing=False,
            default_root_dir=out / "runs",
            run_name="shuffled",
            accelerator=ACCELERATOR,
            **QUIET,
        )
        code: Any = 0
        try:
            trainer.fit(module, DataLoader(train_set(N_SHUFFLED), batch_size=4, shuffle=True))
        except SystemExit as exc:
            code = exc.code
        stopped_at = trainer.global_step
        dist.barrier()
        ckpt = _last_checkpoint(out / "runs" / "shuffled")
        end = stopped_at + 6
        resumed = summary(*fit_shuffled(ddp(), out / "runs", ckpt_path="last", max_epochs=None, max_steps=end))
        reference = summary(*fit_shuffled(ddp(), out / "runs-reference", max_epochs=None, max_steps=end))
        return {
            "code": code,
            "stopped_at": stopped_at,
            "stopped": notice.stopped,
            "sent_at": notice.sent_at,
            "ckpt": str(ckpt),
            "resumed": resumed,
            "reference": reference,
        }

    section(out, "preempted", run)


def gpu_job(out: Path, batch_size: str) -> None:
    """tests/gpu: NCCL DDP, FSDP (fp32 and bf16 parameters) and an FSDP resume on CUDA, one process per GPU."""
    global ACCELERATOR
    ACCELERATOR = "cuda"
    batch = int(batch_size)
    section(out, "cuda_ddp", lambda: summary(*fit_sequential(ddp(), out / "runs-ddp", batch_size=batch)))
    section(out, "cuda_fsdp", lambda: summary(*fit_sequential(fsdp(), out / "runs-fsdp", batch_size=batch)))
    bf16 = fsdp(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    section(out, "cuda_fsdp_bf16", lambda: summary(*fit_sequential(bf16, out / "runs-bf16", batch_size=batch)))
    section(out, "cuda_fsdp_resume", lambda: fsdp_resume(out, deterministic=True))


class SyncedEpochMetrics(Net):
    """`Net` that also logs epoch-level training metrics synced across processes (sum, max, mean): after a
    mid-epoch resume their running totals must be where the collectives can take them (on the GPU for NCCL)."""

    def training_step(self, batch: Any, batch_idx: int) -> Tensor:
        loss = super().training_step(batch, batch_idx)
        for fx in ("sum", "max", "mean"):
            self.log(f"train/loss_{fx}", loss.detach(), on_step=False, on_epoch=True, sync_dist=True, reduce_fx=fx)
        return loss


def steps_per_epoch_shuffled() -> int:
    """`fit_shuffled`'s optimizer steps per epoch at this world size (batch 4 per process)."""
    world = dist.get_world_size() if dist.is_initialized() else 1
    return N_SHUFFLED // (4 * world)


def resume_runs(out: Path, name: str, strategy: Callable[[], Any], **kwargs: Any) -> dict[str, Any]:
    """`fit_shuffled` uninterrupted; stopped in the middle of its second epoch (a checkpoint every step); resumed
    from ``last`` (`kwargs` go to all three fits)."""
    stop = steps_per_epoch_shuffled() + max(steps_per_epoch_shuffled() // 2, 1)
    full = summary(*fit_shuffled(strategy(), out / f"runs-{name}-full", **kwargs))
    stopped = summary(*fit_shuffled(strategy(), out / f"runs-{name}", ckpt_every=1, stop_at=stop, **kwargs))
    if dist.is_initialized():
        dist.barrier()
    resumed = summary(*fit_shuffled(strategy(), out / f"runs-{name}", ckpt_every=1, ckpt_path="last", **kwargs))
    return {
        "full": full,
        "stopped": stopped,
        "resumed": resumed,
        "ckpt": str(_last_checkpoint(out / f"runs-{name}" / "shuffled")),
    }


def peak_memory_fit(strategy: Callable[[], Any], root: Path, async_save: bool) -> dict[str, Any]:
    """`fit_shuffled` with a checkpoint every step, sync or async; the device's peak memory during it (bytes,
    None off CUDA) and the bytes of the state a checkpoint stages (parameters and optimizer state, this rank's)."""
    on_cuda = ACCELERATOR == "cuda"
    if on_cuda:
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
    trainer, module = fit_shuffled(strategy(), root, ckpt_every=1, async_save=async_save, max_epochs=1)
    peak = torch.cuda.max_memory_allocated() if on_cuda else None
    local = lambda t: t.to_local() if hasattr(t, "to_local") else t  # noqa: E731  (FSDP: this rank's shard)
    state = [local(p) for p in module.parameters()]
    state += [local(v) for o in trainer.optimizers for s in o.state.values() for v in s.values() if torch.is_tensor(v)]
    return {
        **summary(trainer, module),
        "peak_bytes": peak,
        "state_bytes": sum(t.numel() * t.element_size() for t in state),
    }


def gpu_resume_job(out: Path, batch_size: str, accelerator: str = "cuda") -> None:
    """tests/gpu/test_cuda_resume.py, one process per GPU over NCCL: 16-mixed under DDP and FSDP, a mid-epoch
    resume with synced epoch metrics, async checkpoints (resumed bitwise; staged outside device memory), and
    the checkpoint a one-process resume reads. `accelerator` "cpu" runs the same over gloo (to try the job)."""
    global ACCELERATOR
    ACCELERATOR = accelerator
    batch = int(batch_size)
    fp16 = {"precision": "16-mixed"}
    section(out, "ddp_16", lambda: summary(*fit_sequential(ddp(), out / "runs-ddp16", batch_size=batch, **fp16)))
    section(out, "fsdp_16", lambda: summary(*fit_sequential(fsdp(), out / "runs-fsdp16", batch_size=batch, **fp16)))
    synced = {"module_cls": SyncedEpochMetrics, "deterministic": True}
    section(out, "synced_resume", lambda: resume_runs(out, "synced", ddp, **synced))
    for name, strategy in (("async_ddp", ddp), ("async_fsdp", fsdp)):
        section(out, name, lambda s=strategy, n=name: resume_runs(out, n, s, async_save=True, deterministic=True))
        section(
            out,
            f"{name}_memory",
            lambda s=strategy, n=name: {
                "sync": peak_memory_fit(s, out / f"runs-{n}-mem-sync", async_save=False),
                "async": peak_memory_fit(s, out / f"runs-{n}-mem-async", async_save=True),
            },
        )
    stop = steps_per_epoch_shuffled() + 1  # in the second epoch
    run = lambda: summary(  # noqa: E731
        *fit_shuffled(ddp(), out / "runs-other_count", ckpt_every=1, stop_at=stop, deterministic=True)
    )
    section(out, "for_one_process", run)


def one_process_resume_job(out: Path, accelerator: str = "cuda") -> None:
    """Resume `gpu_resume_job`'s ``other_count`` run (written by every GPU) in this one process."""
    global ACCELERATOR
    ACCELERATOR = accelerator
    root = out / "runs-other_count"
    run = lambda: summary(  # noqa: E731
        *fit_shuffled("single_device", root, ckpt_every=1, ckpt_path="last", deterministic=True)
    )
    section(out, "one_process", run)


def async_job(out: Path) -> None:
    """`fit_shuffled` with a background checkpoint write every step, under DDP then FSDP. A watchdog dumps
    every thread's stack and ends the process if the job hangs (collectives that never meet)."""
    import faulthandler

    faulthandler.dump_traceback_later(45, exit=True)
    for name, strategy in (("async_ddp", ddp), ("async_fsdp", fsdp)):
        root = out / f"runs-{name}"

        def run(strategy: Callable[[], Any] = strategy, root: Path = root) -> dict[str, Any]:
            result = summary(*fit_shuffled(strategy(), root, ckpt_every=1, async_save=True))
            dist.barrier()
            return {**result, "ckpt": str(_last_checkpoint(root / "shuffled"))}

        section(out, name, run)
    faulthandler.cancel_dump_traceback_later()


if __name__ == "__main__":  # pragma: no cover  (jobs import this module; this is for trying it by hand)
    globals()[sys.argv[1]](Path(sys.argv[2]), *sys.argv[3:])
