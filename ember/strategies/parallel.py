"""What DDP and FSDP share: the process group, collectives, distributed samplers, checkpoint group.

torch.distributed is the engine: the process group is initialised from the
environment torchrun/TorchElastic or SLURM set up (`environment.detect`), with
NCCL on CUDA and gloo on CPU.
"""

from __future__ import annotations

import atexit
import contextlib
import math
import os
import time
from collections.abc import Iterator
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor
from torch.utils.data import DataLoader, RandomSampler, Sampler, SequentialSampler
from torch.utils.data.distributed import DistributedSampler

from ember.strategies.collectives import keep
from ember.strategies.environment import ClusterEnvironment, detect
from ember.strategies.precision import Precision
from ember.strategies.strategy import Strategy

_REDUCE_OPS = {"sum": dist.ReduceOp.SUM, "mean": dist.ReduceOp.SUM, "max": dist.ReduceOp.MAX, "min": dist.ReduceOp.MIN}


class EvalDistributedSampler(Sampler[int]):
    """Rank r takes samples r, r + W, r + 2W, ...: no padding, so no sample is counted twice."""

    def __init__(self, length: int, num_replicas: int, rank: int) -> None:
        self.length, self.num_replicas, self.rank = length, num_replicas, rank

    def __iter__(self) -> Iterator[int]:
        return iter(range(self.rank, self.length, self.num_replicas))

    def __len__(self) -> int:
        return len(range(self.rank, self.length, self.num_replicas))


def rebuilt_loader(loader: DataLoader[Any], **changes: Any) -> DataLoader[Any]:
    """A new DataLoader like `loader` (dataset, batch size, workers, collate, generator, ...) with `changes`
    (a ``sampler``, a ``batch_size``, ``shuffle``...): DataLoader forbids changing these on a built one."""
    kept: dict[str, Any] = {
        "batch_size": loader.batch_size,
        "num_workers": loader.num_workers,
        "collate_fn": loader.collate_fn,
        "pin_memory": loader.pin_memory,
        "pin_memory_device": loader.pin_memory_device,
        "drop_last": loader.drop_last,
        "timeout": loader.timeout,
        "worker_init_fn": loader.worker_init_fn,
        "multiprocessing_context": loader.multiprocessing_context,
        "generator": loader.generator,
        "prefetch_factor": loader.prefetch_factor,
        "persistent_workers": loader.persistent_workers,
    }
    return DataLoader(loader.dataset, **{**kept, **changes})


def cuda_index(local_rank: int, visible: int) -> int:
    """The CUDA device of the process with `local_rank` on a node where it sees `visible` devices.

    One device per process on the node: device ``local_rank``. One device bound to each process (SLURM's
    ``--gpus-per-task=1``, or ``CUDA_VISIBLE_DEVICES`` set per process): device 0, the only one it sees.
    """
    if visible == 1:
        return 0
    if 0 <= local_rank < visible:
        return local_rank
    raise RuntimeError(
        f"the process with local rank {local_rank} sees {visible} CUDA devices "
        f"(CUDA_VISIBLE_DEVICES={os.environ.get('CUDA_VISIBLE_DEVICES', 'unset')}); start at most one process per "
        "visible device on each node, or bind one device to each process (SLURM: --gpus-per-task=1)"
    )


class ParallelStrategy(Strategy):
    """Base of the multi-process strategies; one process per device.

    ``devices``/``num_nodes`` are what the Trainer asked for; the environment
    (torchrun, SLURM) must agree with them, or the error says what it found.
    """

    def __init__(
        self,
        precision: Precision | None = None,
        backend: str | None = None,
        timeout_s: float = 1800.0,
        use_distributed_sampler: bool = True,
    ) -> None:
        super().__init__("cpu", precision)
        self.backend = backend
        self.timeout_s = timeout_s
        self.use_distributed_sampler = use_distributed_sampler
        self.cluster: ClusterEnvironment = detect()
        self.devices = 1
        self.num_nodes = 1
        self.accelerator = "auto"
        self.checkpoint_group: Any = None
        self.flag_group: Any = None
        #: Seconds between two exchanges of the preemption flags (ranks agree on it in each exchange).
        self.flag_interval_s = 0.5
        self._flag_work: Any = None
        self._boundaries_to_exchange = 1
        self._last_exchange = 0.0

    def configure(  # type: ignore[override]
        self,
        precision: Precision,
        *,
        devices: int = 1,
        num_nodes: int = 1,
        accelerator: str = "auto",
        use_distributed_sampler: bool = True,
    ) -> None:
        """Take the Trainer's precision plugin and topology (``devices`` per node, ``num_nodes``,
        ``accelerator``, ``use_distributed_sampler``)."""
        super().configure(precision)
        self.devices, self.num_nodes, self.accelerator = devices, num_nodes, accelerator
        self.use_distributed_sampler = use_distributed_sampler

    # --- topology -----------------------------------------------------------
    @property
    def world_size(self) -> int:
        return dist.get_world_size() if dist.is_initialized() else self.cluster.world_size

    @property
    def global_rank(self) -> int:
        return dist.get_rank() if dist.is_initialized() else self.cluster.global_rank

    @property
    def local_rank(self) -> int:
        return self.cluster.local_rank

    @property
    def world_size_requested(self) -> int:
        return self.devices * self.num_nodes

    @property
    def distributed_sampler_kwargs(self) -> dict[str, int]:
        """``num_replicas`` and ``rank`` of this process's data shard: every process has its own (the
        model-parallel strategy shares one shard among the processes of a tensor-parallel group)."""
        return {"num_replicas": self.world_size, "rank": self.global_rank}

    def needs_launch(self) -> bool:
        """True when ``devices > 1`` was asked for but no launcher started the processes."""
        if self.cluster.kind != "single" or self.world_size_requested == 1:
            return False
        if self.num_nodes > 1:
            raise RuntimeError(
                f"num_nodes={self.num_nodes} needs a launcher on every node: run `torchrun --nnodes={self.num_nodes} "
                f"--nproc-per-node={self.devices} --rdzv-endpoint=HOST:PORT ...` on each, or submit through SLURM"
            )
        return True

    # --- setup --------------------------------------------------------------
    def setup_environment(self) -> None:
        """Join (or create) the process group; pick this process's device."""
        self.cluster = detect()
        expected = self.devices * self.num_nodes
        if self.cluster.kind != "single" and self.cluster.world_size != expected and self.devices != -1:
            raise RuntimeError(
                f"Trainer(devices={self.devices}, num_nodes={self.num_nodes}) expects {expected} processes, but the "
                f"{self.cluster.kind} environment has WORLD_SIZE={self.cluster.world_size} "
                f"({self.cluster.num_nodes} node(s)); make them agree (e.g. torchrun --nnodes={self.num_nodes} "
                f"--nproc-per-node={self.devices})"
            )
        use_cuda = self.accelerator == "cuda" or (self.accelerator == "auto" and torch.cuda.is_available())
        if use_cuda:
            self.root_device = torch.device("cuda", cuda_index(self.cluster.local_rank, torch.cuda.device_count()))
            torch.cuda.set_device(self.root_device)
        else:
            self.root_device = torch.device("cpu")
        if not dist.is_initialized():
            self.cluster.export()
            backend = self.backend or ("nccl" if use_cuda else "gloo")
            timeout = timedelta(seconds=self.timeout_s)
            store = _store_of_this_attempt(timeout)
            # Bound to this process's GPU: NCCL then creates its communicator for that device (no guess from
            # the current device, no warning at the first barrier).
            device_id = self.root_device if backend == "nccl" else None
            if store is None:
                dist.init_process_group(backend, timeout=timeout, device_id=device_id)
            else:
                dist.init_process_group(
                    backend, timeout=timeout, store=store, rank=self.cluster.global_rank,
                    world_size=self.cluster.world_size, device_id=device_id,
                )  # fmt: skip
            atexit.register(_destroy_group)
        if self.checkpoint_group is None:
            # Checkpoint writes (possibly in a background thread) and the preemption flag each get their
            # own gloo group: collectives of one group issued from two threads could pair up differently
            # on each rank, and neither may interleave with the training collectives.
            timeout = timedelta(seconds=self.timeout_s)
            self.checkpoint_group = dist.new_group(backend="gloo", timeout=timeout)
            self.flag_group = dist.new_group(backend="gloo", timeout=timeout)

    def distribute_loader(self, loader: Any, training: bool) -> Any:
        """Give a DataLoader a distributed sampler that keeps the user's intent.

        A shuffling training loader is shuffled by (seed, epoch) across ranks;
        a sequential one stays sequential, so W ranks x batch B see exactly the
        samples of one batch W*B. Evaluation is never shuffled or padded. Loaders
        with a custom sampler or batch sampler are left as they are. On a GPU the
        rebuilt loader pins its batches (``pin_memory=True``).
        """
        if not self.use_distributed_sampler or self.world_size == 1 or not isinstance(loader, DataLoader):
            return loader
        if loader.batch_sampler is not None and type(loader.batch_sampler).__name__ != "BatchSampler":
            return loader  # a custom batch sampler: the user decides
        if type(loader.sampler) not in (RandomSampler, SequentialSampler):
            return loader  # a custom sampler: the user decides
        dataset = loader.dataset
        shard = self.distributed_sampler_kwargs
        sampler: Sampler[int]
        if training:
            shuffle = isinstance(loader.sampler, RandomSampler)
            seed = int(os.environ.get("EMBER_SEED", 0))
            sampler = DistributedSampler(
                dataset, num_replicas=shard["num_replicas"], rank=shard["rank"], shuffle=shuffle, seed=seed
            )
        else:
            sampler = EvalDistributedSampler(len(dataset), **shard)  # type: ignore[arg-type]
        # Batches bound for a GPU come from pinned memory: their non_blocking copy then overlaps the step.
        pin = loader.pin_memory or self.root_device.type == "cuda"
        distributed = rebuilt_loader(loader, sampler=sampler, pin_memory=pin)
        # The sampler it replaces: a checkpoint written by one process replays its order to continue an
        # interrupted epoch on several (ember.checkpoint.data_position).
        distributed.ember_source_sampler = loader.sampler
        return distributed

    # --- collectives --------------------------------------------------------
    def reduce(self, tensor: Tensor, reduce_fx: str = "mean") -> Tensor:
        if not dist.is_initialized():
            return tensor
        out = tensor.clone()
        keep(out)
        dist.all_reduce(out, op=_REDUCE_OPS[reduce_fx])
        return out / self.world_size if reduce_fx == "mean" else out

    def barrier(self) -> None:
        """Wait until every process of the job gets here (nothing to wait for before the process group exists)."""
        if not dist.is_initialized():
            return
        if self.root_device.type == "cuda" and dist.get_backend() == "nccl":
            dist.barrier(device_ids=[self.root_device.index])  # NCCL's barrier runs on this process's GPU
        else:
            dist.barrier()

    def broadcast(self, obj: Any, src: int = 0) -> Any:
        if not dist.is_initialized():
            return obj
        box = [obj]
        dist.broadcast_object_list(box, src=src)
        return box[0]

    def all_gather_object(self, obj: Any) -> list[Any]:
        if not dist.is_initialized():
            return [obj]
        every: list[Any] = [None] * dist.get_world_size()
        dist.all_gather_object(every, obj)
        return every

    def check_same_batch_count(self, count: float) -> None:
        """Agree on the training batches per epoch before the first step; unequal counts are an error on every
        process (gradient synchronisation would otherwise pair up different collectives and abort the job).

        A loader without a length (``inf``) is not checked: its end cannot be known in advance.
        """
        if not dist.is_initialized() or self.world_size == 1:
            return
        mine = torch.tensor([-1 if math.isinf(count) else int(count)], dtype=torch.int64, device=self.root_device)
        every = [torch.zeros_like(mine) for _ in range(self.world_size)]
        keep(mine, *every)
        dist.all_gather(every, mine)
        counts = [int(t) for t in every]
        if len(set(counts)) > 1 and -1 not in counts:
            shown = ", ".join(f"rank {rank}: {n}" for rank, n in enumerate(counts))
            raise RuntimeError(
                f"the processes have different numbers of training batches per epoch ({shown}); every process "
                "must take the same number of optimizer steps. Let ember shard the data "
                "(use_distributed_sampler=True), give each rank an equal share (e.g. DistributedSampler with "
                "drop_last=True), or cap the epoch with limit_train_batches"
            )

    def any_flag(self, flag: bool, proposal: int = 1) -> Any:
        """Start a non-blocking exchange of `flag` (OR over ranks) and of a proposed number of boundaries
        until the next exchange (MIN over ranks); returns ``(work, tensor)`` to read later."""
        tensor = torch.tensor([1 if flag else 0, -proposal], dtype=torch.int64)
        keep(tensor)
        work = dist.all_reduce(tensor, op=dist.ReduceOp.MAX, group=self.flag_group, async_op=True)
        return work, tensor

    def preemption_requested(self, local: bool) -> bool:
        """Whether any process got a preemption signal, agreed without a blocking collective.

        The ranks exchange their flags only every `flag_interval_s` seconds or
        so, not every step (a collective per step costs a host round trip). An
        exchange is started at a boundary and read at the next exchange (long
        finished by then); with the flags each rank proposes how many boundaries
        make up the interval at its step time, and all take the smallest, so
        every process reads the result, and stops, at the same boundary.
        """
        self._boundaries_to_exchange -= 1  # first: most boundaries end here, without a call into torch
        if self._boundaries_to_exchange > 0:
            return False
        if not dist.is_initialized() or self.world_size == 1:
            return local
        now = time.perf_counter()
        stop, interval = False, 1
        if self._flag_work is not None:
            (work, tensor), boundaries = self._flag_work
            work.wait()
            stop, interval = bool(tensor[0]), int(-tensor[1])  # a CPU tensor of the gloo group: no device sync
            step_s = (now - self._last_exchange) / boundaries
            proposal = max(1, min(10_000, int(self.flag_interval_s / step_s) if step_s > 0 else 1))
        else:
            proposal = 1
        self._last_exchange = now
        self._boundaries_to_exchange = interval
        self._flag_work = (self.any_flag(local, proposal), interval)
        if torch.autograd._profiler_enabled():  # a profiler must not stop while the exchange is in flight
            self._flag_work[0][0].wait()
        return stop

    def settle(self) -> None:
        """Finish the flag exchange still in flight (the training epochs are over).

        Every rank started that exchange at the same boundary, so it completes (or fails at once where a peer
        is gone). Left pending, it is in flight while ``on_train_end`` runs: a torch profiler stopped there
        (the batch-size finder's memory recorder) while gloo's worker still recorded the collective crashed
        the process now and then (SIGSEGV freeing the profiler's records) or hung it; and a gloo work item
        holding a Python tensor must not outlive the run into interpreter shutdown.
        """
        pending, self._flag_work = self._flag_work, None
        if pending is not None:
            with contextlib.suppress(RuntimeError):  # a peer that died: its error is reported elsewhere
                pending[0][0].wait()

    def teardown(self) -> None:
        """Finish the flag exchange still in flight (`settle`); the process group stays up for the next
        fit/validate/test (it is closed at exit), whose first boundary starts an exchange on every rank."""
        self.settle()
        self._boundaries_to_exchange = 1


def _store_of_this_attempt(timeout: timedelta) -> dist.Store | None:
    """Under torchrun, a store whose keys belong to this restart attempt only.

    torchrun's workers share the agent's store across restarts, so after a
    restart a worker could read the previous attempt's peer addresses and the
    rendezvous times out. Keys prefixed by the restart count cannot collide.
    """
    if os.environ.get("TORCHELASTIC_USE_AGENT_STORE") != "True":
        return None
    attempt = os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")
    client = dist.TCPStore(os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]), is_master=False, timeout=timeout)
    return dist.PrefixStore(f"/ember/attempt_{attempt}/", client)


def _destroy_group() -> None:
    if dist.is_initialized():
        dist.destroy_process_group()
