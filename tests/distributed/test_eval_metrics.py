"""Evaluation metrics across processes equal the single-process ones (issue 6, "must show" 5).

The freshly initialised `dist_workload.Net` is validated and tested (default steps: ``val/loss`` logged
with ``sync_dist=True``, ``val/acc`` a torchmetrics accuracy) over 37 samples (ranks get 19 and 18) and
41 samples (with batch 5, rank 0 gets 5 batches and rank 1 gets 4), inside the shared 2-process job
(`conftest.main_job`), under DDP and FSDP; the reference runs in the pytest process (`conftest.single`).
"""

from __future__ import annotations

import dist_workload as workload
import pytest
import torch
from torch.nn import functional as F

pytestmark = pytest.mark.distributed

SIZES = {"even": workload.N_VAL, "uneven": workload.N_VAL_UNEVEN}


def _assert_same_metrics(result: dict, reference: dict, what: str) -> None:
    for stage in ("validate", "test"):
        got, want = result[stage], reference[stage]
        assert got.keys() == want.keys(), f"{what} {stage}: {sorted(got)} vs {sorted(want)}"
        for key in got:
            # Sums in another order: float rounding only. Accuracy is a ratio of counts: exact.
            tolerance = 0.0 if key.endswith("acc") else 1e-6
            assert got[key] == pytest.approx(want[key], rel=tolerance), f"{what} {stage} {key}"


@pytest.mark.parametrize("size", ["even", "uneven"])
def test_ddp_eval_metrics_equal_the_single_process_values(main_job, single, size: str) -> None:
    reference = single["eval"][size]
    ranks = main_job.results("ddp_eval")
    assert [r[size]["batches"] for r in ranks] == ([4, 4] if size == "even" else [5, 4])
    for rank, result in enumerate(ranks):
        _assert_same_metrics(result[size], reference, f"DDP rank {rank}, {SIZES[size]} samples")


def test_the_metrics_would_show_duplicated_samples(single, own_random_state) -> None:
    """The comparison can fail: padding the 37 samples to 38 (as DistributedSampler does) moves both values."""
    torch.manual_seed(workload.SEED)
    module = workload.Net()
    x, y = workload.val_set(workload.N_VAL).tensors
    with torch.no_grad():
        logits = module(x)
    padded = torch.cat([torch.arange(len(y)), torch.tensor([0])])  # DistributedSampler repeats sample 0
    loss, padded_loss = F.cross_entropy(logits, y), F.cross_entropy(logits[padded], y[padded])
    correct = (logits.argmax(1) == y).float()
    reference = single["eval"]["even"]["validate"]
    assert reference["val/loss"] == pytest.approx(float(loss), rel=1e-6)
    assert reference["val/acc"] == pytest.approx(float(correct.mean()), rel=1e-6)
    assert abs(float(padded_loss) - float(loss)) > 1e-4
    assert float(correct[padded].mean()) != pytest.approx(float(correct.mean()), rel=1e-6)


def test_validation_inside_fit_matches_the_single_process_value(main_job, single) -> None:
    reference = single["seq"]["metrics"]
    for rank, result in enumerate(main_job.results("ddp_seq")):
        assert result["metrics"]["val/loss"] == pytest.approx(reference["val/loss"], rel=1e-5), rank
        assert result["metrics"]["val/acc"] == reference["val/acc"], rank


def test_fsdp_eval_metrics_equal_the_single_process_values(main_job, single) -> None:
    for rank, result in enumerate(main_job.results("fsdp_eval")):
        _assert_same_metrics(result, single["eval"]["even"], f"FSDP rank {rank}")


def test_fsdp_eval_with_a_different_number_of_batches_per_rank(main_job, single) -> None:
    """41 samples, batch 5: rank 0 runs 5 eval batches, rank 1 runs 4; FSDP gathers parameters in every
    forward, so the ranks must not disagree about how many collectives the evaluation makes."""
    for rank, result in enumerate(main_job.results("fsdp_eval_uneven")):
        _assert_same_metrics(result, single["eval"]["uneven"], f"FSDP rank {rank}")
