"""DDP over gloo with 2 processes (issue 6, "must show" 1; the data rules of docs/distributed.md).

The runs are sections of the shared 2-process job (`conftest.main_job`): ``ddp_seq`` trains 20 SGD steps
with 2 x batch 4 over a ``shuffle=False`` loader, ``ddp_shuffled`` 3 epochs over a ``shuffle=True`` one,
``ddp_samplers`` feeds loaders the user built with their own (batch) sampler. The reference is one process
with batch 8 (`conftest.single`).
"""

from __future__ import annotations

import itertools

import dist_harness as harness
import dist_workload as workload
import pytest
import torch
from torch.utils.data.distributed import DistributedSampler

pytestmark = pytest.mark.distributed


def test_two_processes_with_batch_b_match_one_process_with_batch_2b(main_job, single) -> None:
    ranks = main_job.results("ddp_seq")
    reference = single["seq"]
    for rank, result in enumerate(ranks):
        assert (result["rank"], result["world_size"]) == (rank, 2)
        assert (result["kind"], result["strategy"]) == ("torchelastic", "DDPStrategy")
        assert result["steps"] == reference["steps"] == 20
        harness.assert_params_close(result["params"], reference["params"], f"rank {rank} vs one process")
    harness.assert_params_equal(ranks[0]["params"], ranks[1]["params"], "rank 0 vs rank 1")
    # Each step's loss over 8 samples is the mean of the two ranks' losses over their 4.
    mean_of_ranks = (torch.tensor(ranks[0]["losses"]) + torch.tensor(ranks[1]["losses"])) / 2
    torch.testing.assert_close(mean_of_ranks, torch.tensor(reference["losses"]), rtol=1e-5, atol=1e-6)


def test_a_sequential_loader_splits_each_batch_of_one_process_between_the_ranks(main_job, single) -> None:
    ranks = main_job.results("ddp_seq")
    reference = single["seq"]["seen"]
    assert reference == [list(range(8 * step, 8 * step + 8)) for step in range(20)]  # sequential, batch 8
    for step, expected in enumerate(reference):
        on_0, on_1 = ranks[0]["seen"][step], ranks[1]["seen"][step]
        assert len(on_0) == len(on_1) == 4
        assert sorted(on_0 + on_1) == expected, f"step {step}: rank 0 saw {on_0}, rank 1 saw {on_1}"


def test_a_shuffling_loader_is_shuffled_by_seed_and_epoch(main_job) -> None:
    ranks = main_job.results("ddp_shuffled")
    n, epochs = workload.N_SHUFFLED, 3
    orders = {}
    for rank, result in enumerate(ranks):
        assert result["steps"] == epochs * n // 2 // 4
        for epoch in range(epochs):
            seen = [i for e, batch in zip(result["epochs"], result["seen"], strict=True) if e == epoch for i in batch]
            sampler = DistributedSampler(range(n), num_replicas=2, rank=rank, shuffle=True, seed=workload.SEED)
            sampler.set_epoch(epoch)
            assert seen == list(sampler), f"rank {rank}, epoch {epoch}: not DistributedSampler(seed, epoch)'s order"
            orders[rank, epoch] = seen
    for epoch in range(epochs):
        both = orders[0, epoch] + orders[1, epoch]
        assert sorted(both) == list(range(n)), f"epoch {epoch}: the ranks do not split the data set"
        assert both != list(range(n))
    for rank, (a, b) in itertools.product(range(2), itertools.combinations(range(epochs), 2)):
        assert orders[rank, a] != orders[rank, b], f"rank {rank}: epochs {a} and {b} see the same order"
    harness.assert_params_equal(ranks[0]["params"], ranks[1]["params"], "rank 0 vs rank 1 (dropout, AdamW)")


def test_loaders_with_their_own_sampler_are_left_alone(main_job) -> None:
    for rank, result in enumerate(main_job.results("ddp_samplers")):
        # Every rank iterates the user's sampler as given (no DistributedSampler in between).
        assert result["custom_sampler"] == [list(range(159 - 4 * s, 155 - 4 * s, -1)) for s in range(3)], rank
        assert result["custom_batch_sampler"] == [[5, 1], [7, 3], [0, 2]], rank
        # use_distributed_sampler=False: the shuffle=False loader too.
        assert result["opt_out"] == [[0, 1, 2, 3], [4, 5, 6, 7], [8, 9, 10, 11]], rank
