"""`seed_everything`: one call that seeds Python, NumPy and torch."""

from __future__ import annotations

import os
import random

import torch


def seed_everything(seed: int = 0) -> int:
    """Seed `random`, NumPy (when installed) and torch (CPU and every CUDA device).

    Also sets ``EMBER_SEED`` so subprocesses can read the seed. Returns `seed`.
    """
    if not isinstance(seed, int) or isinstance(seed, bool):
        raise TypeError(f"seed must be an int; got {seed!r}")
    os.environ["EMBER_SEED"] = str(seed)
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
