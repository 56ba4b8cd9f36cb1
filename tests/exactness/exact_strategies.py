"""Hypothesis strategies for `exact_workload.Config`, one per property, and the count of what ran.

Every option is drawn so that it shrinks towards the plainest run (index 0 of each choice is the
default), so a failure shrinks to the few options that cause it.
"""

from __future__ import annotations

import math
from typing import Any

from exact_workload import SAMPLERS, Config, planned_batches, train_loader
from hypothesis import settings
from hypothesis import strategies as st

#: Distinct configurations each property exercised in this session (printed at the end by conftest.py).
SEEN: dict[str, set[str]] = {}


def examples(weight: int) -> int:
    """`weight` times the loaded profile's ``max_examples`` (conftest.py loads the profile)."""
    return weight * settings().max_examples


def record(prop: str, *keys: Any) -> None:
    SEEN.setdefault(prop, set()).add(repr(keys))


def _loader_batches(cfg: Config) -> float:
    return len(train_loader(cfg)) if cfg.has_length else math.inf


def weighted(*choices: tuple[Any, int]) -> st.SearchStrategy[Any]:
    """One of `choices` ``(value, weight)``, drawn `weight` times as often; shrinks towards the first."""
    return st.sampled_from([value for value, weight in choices for _ in range(weight)])


@st.composite
def data_options(draw: st.DrawFn, *, samplers: tuple[str, ...] = SAMPLERS, workers: tuple[int, ...] = (0, 2)) -> dict:
    """The data pipeline: dataset size (dividing the batch size or not), sampler, workers, augmentation.

    Weighted towards what most runs use (a shuffled map-style dataset with its own generator, no workers),
    so a bug in the common case shows in the few examples of the CI profile.
    """
    batch_size = draw(st.integers(1, 6))
    # n a multiple of the batch size half of the time: the case where the last batch ends before the sampler
    n = draw(st.one_of(st.integers(1, 6).map(lambda k: k * batch_size), st.integers(2, 30)))
    common = "shuffle" if "shuffle" in samplers else samplers[0]
    sampler = draw(weighted((common, len(samplers)), *((s, 1) for s in samplers if s != common)))
    generator = draw(weighted((True, 2), (False, 1))) if sampler not in ("sequential", "iterable") else False
    num_samples = draw(st.one_of(st.none(), st.integers(1, 2 * n))) if sampler in ("replacement", "weighted") else None
    drop_last = draw(weighted((False, 2), (True, 1))) if sampler != "batch_sampler" and n >= batch_size else False
    num_workers = draw(weighted(*((w, 2 if w == 0 else 1) for w in workers)))
    persistent = draw(st.booleans()) if num_workers else False
    augment = draw(st.sampled_from(("none", "global", "per_sample")))
    options = dict(
        n=n,
        batch_size=batch_size,
        sampler=sampler,
        generator=generator,
        num_samples=num_samples,
        drop_last=drop_last,
        num_workers=num_workers,
        persistent_workers=persistent,
        augment=augment,
    )
    if _loader_batches(Config(**options)) == 0:  # e.g. drop_last with fewer samples than a batch
        options["drop_last"] = False
    return options


@st.composite
def training_options(draw: st.DrawFn, base: dict, *, manual: bool | None = None, validation: bool = True) -> dict:
    """Training options over a drawn data pipeline `base` (whole epochs and no step limit most of the time)."""
    cfg = Config(**base)
    length = _loader_batches(cfg)
    manual = draw(weighted((False, 3), (True, 1))) if manual is None else manual
    options: dict[str, Any] = dict(
        epochs=draw(weighted((2, 2), (3, 2), (1, 1))),
        optimizer=draw(st.sampled_from(("sgd", "adam"))),
        dropout=draw(st.sampled_from((0.0, 0.3))),
        precision=draw(weighted(("32-true", 2), ("bf16-mixed", 1))),
        manual=manual,
    )
    if not manual:  # accumulation and clipping belong to automatic optimization
        options["accumulate"] = draw(weighted((1, 2), (2, 1), (3, 1)))
        options["clip"] = draw(st.sampled_from((None, ("norm", 0.5), ("value", 0.05))))
    schedulers: tuple[str | None, ...] = (None, "step", "epoch") if manual else (None, "step", "epoch", "plateau")
    options["scheduler"] = draw(st.sampled_from(schedulers))
    limit: int | float = 1.0
    limit_kind = draw(weighted(("whole", 3), ("count", 1), ("fraction", 1)))
    fractions = [f for f in (0.25, 0.5, 0.75) if math.isfinite(length) and int(length * f) >= 1]
    if limit_kind == "count":
        limit = draw(st.integers(1, int(length) + 1 if math.isfinite(length) else 5))  # a count, maybe > len
    elif limit_kind == "fraction" and fractions:
        limit = draw(st.sampled_from(fractions))
    options["limit_train_batches"] = limit
    batches = planned_batches(Config(**base, limit_train_batches=limit), train_loader(cfg))
    if validation and draw(st.booleans()):
        counts = st.integers(1, int(batches)) if math.isfinite(batches) else st.integers(1, 3)
        options["val_check_interval"] = draw(st.one_of(st.just(1.0), st.sampled_from((0.5, 0.34)), counts))
        options["check_val_every_n_epoch"] = draw(st.integers(1, 2))
        options["num_sanity_val_steps"] = draw(st.sampled_from((0, 2)))
    steps_per_epoch = math.ceil(batches / options.get("accumulate", 1)) if math.isfinite(batches) else 8
    if draw(weighted((False, 3), (True, 1))):
        options["max_steps"] = draw(st.integers(1, max(1, steps_per_epoch * options["epochs"])))
    return options


@st.composite
def parity_configs(draw: st.DrawFn) -> Config:
    """Property (a): the whole space."""
    base = draw(data_options())
    return Config(**base, **draw(training_options(base)))


@st.composite
def resume_configs(draw: st.DrawFn) -> Config:
    """Property (b): the space where a resume is documented to be exact (docs/trainer.md, "Exactness").

    Left out: random augmentation drawn from the global RNG inside DataLoader workers (a worker's stream
    restarts on resume; use `ember.seed.sample_generator`), and an iterable dataset read by workers (its
    position lives in the workers; use torchdata's StatefulDataLoader).
    """
    base = draw(data_options())
    if base["num_workers"] and base["augment"] == "global":
        base["augment"] = "per_sample"
    if base["num_workers"] and base["sampler"] == "iterable":
        base["num_workers"], base["persistent_workers"] = 0, False
    cfg = Config(**base, **draw(training_options(base)))
    return cfg


@st.composite
def ddp_configs(draw: st.DrawFn) -> Config:
    """Property (c): where 2 processes x batch B and 1 process x batch 2B see the same samples per step.

    A ``shuffle=False`` map-style loader over an even number of samples (each process gets half of every
    batch of 2B), no dropout and no augmentation from the global RNG (each process draws its own), fp32
    (bf16 sums of B and 2B products round differently), no plateau scheduler (it watches a per-process value).
    """
    base = draw(data_options(samplers=("sequential",), workers=(0,)))
    base["n"] += base["n"] % 2
    if base["n"] // 2 < base["batch_size"]:  # each process's half would hold no whole batch
        base["drop_last"] = False
    base["augment"] = "none" if base["augment"] == "global" else base["augment"]
    options = draw(training_options(base, manual=False, validation=False))
    options.update(dropout=0.0, precision="32-true")
    if options["scheduler"] == "plateau":
        options["scheduler"] = "epoch"
    limit = options["limit_train_batches"]
    each_process = len(train_loader(Config(**base), batch_size=2 * base["batch_size"]))  # = 1 x 2B's
    if isinstance(limit, float) and int(each_process * limit) < 1:  # drawn for batch B over all samples
        options["limit_train_batches"] = 1.0
    return Config(**base, **options)
