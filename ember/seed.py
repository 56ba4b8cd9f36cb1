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
