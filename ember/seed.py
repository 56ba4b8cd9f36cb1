"""`seed_everything`: one call that seeds Python, NumPy and torch."""

from __future__ import annotations

import os
import random
from typing import Any

import torch


def seed_everything(seed: int = 0, workers: bool = False) -> int:
    """Seed `random`, NumPy (when installed) and torch (CPU and every CUDA device).

    Also sets ``EMBER_SEED`` so subprocesses can read the seed. Returns `seed`.

    ``workers=True`` (Lightning's keyword) also seeds DataLoader worker processes from the seed and the
    process's rank: each worker's `random`, NumPy and torch streams then differ between workers and between
    the processes of a distributed run, and repeat from run to run. (Without it torch seeds each worker from the
    main process's stream, which repeats too, but is the same on every rank.) ember applies it to the
    DataLoaders a run uses, through their ``worker_init_fn``.
    """
    if not isinstance(seed, int) or isinstance(seed, bool):
        raise TypeError(f"seed must be an int; got {seed!r}")
    os.environ["EMBER_SEED"] = str(seed)
    os.environ["EMBER_SEED_WORKERS"] = "1" if workers else "0"
    random.seed(seed)
    try:
        import numpy as np
    except ImportError:
        pass
    else:
        np.random.seed(seed % 2**32)
    torch.manual_seed(seed)
    return seed


def sample_generator(index: int, epoch: int = 0, seed: int = 0) -> torch.Generator:
    """A generator seeded from ``(seed, epoch, index)`` alone: the same in any process, at any time.

    Draw a sample's random augmentation from it in ``Dataset.__getitem__`` and
    the augmentation no longer depends on which DataLoader worker loads the
    sample or on what that worker drew before, so a run resumed with
    ``num_workers > 0`` sees exactly the samples an uninterrupted run saw. Give
    the dataset a ``set_epoch(epoch)`` method: ember calls it before every
    training epoch, like ``DistributedSampler.set_epoch``.
    """
    mixed = ((seed * 1_000_003 + epoch) * 1_000_003 + index) % (2**63 - 1)
    generator = torch.Generator()
    generator.manual_seed(mixed)
    return generator


def seed_worker(worker_id: int) -> None:
    """A DataLoader ``worker_init_fn`` (``seed_everything(..., workers=True)``): reseed this worker's `random`,
    NumPy and torch from torch's seed for it (the main process's draw plus `worker_id`) and the global rank."""
    rank = int(os.environ.get("RANK", "0"))
    base = torch.initial_seed()  # DataLoader set it to base_seed + worker_id in this worker
    mixed = int(torch.randint(2**62, (), generator=torch.Generator().manual_seed((base * 1_000_003 + rank) % 2**63)))
    random.seed(mixed)
    torch.manual_seed(mixed)
    try:
        import numpy as np
    except ImportError:
        return
    np.random.seed(mixed % 2**32)


class _SeededWorkers:
    """A ``worker_init_fn``: `seed_worker`, then the loader's own (a class, so spawned workers can unpickle it)."""

    def __init__(self, then: Any) -> None:
        self.then = then

    def __call__(self, worker_id: int) -> None:
        seed_worker(worker_id)
        if self.then is not None:
            self.then(worker_id)


def with_seeded_workers(loader: Any) -> Any:
    """`loader` with `seed_worker` run in each of its workers (before its own ``worker_init_fn``), when
    ``seed_everything(..., workers=True)`` asked for it; set once per loader."""
    if os.environ.get("EMBER_SEED_WORKERS") != "1" or not getattr(loader, "num_workers", 0):
        return loader
    if not isinstance(loader.worker_init_fn, _SeededWorkers):
        loader.worker_init_fn = _SeededWorkers(loader.worker_init_fn)
    return loader
