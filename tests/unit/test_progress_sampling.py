"""Elastic sampling: global batches, rank shares, exactly-once across resizes, DataLoader use."""

from __future__ import annotations

import logging
from collections import Counter

import pytest
import torch
from pydantic import ValidationError
from torch.distributed.checkpoint.stateful import Stateful
from torch.utils.data import DataLoader, Dataset

from elastic.sampling import (
    ElasticSampler,
    SamplingConfig,
    passes_per_step,
    rank_micro_batches,
    share_bounds,
    stream_slice,
)

pytestmark = pytest.mark.timeout(60)


class IndexDataset(Dataset):
    """Returns its own index, so a batch shows which samples it holds."""

    def __init__(self, size: int) -> None:
        self.size = size

    def __len__(self) -> int:
        return self.size

    def __getitem__(self, index: int) -> torch.Tensor:
        return torch.tensor(index)


def samples_of_step(config: SamplingConfig, world_size: int, samples_consumed: int) -> list[list[int]]:
    """Real (non-padding) samples of each rank for one step, from independent per-rank samplers."""
    shares = []
    for rank in range(world_size):
        sampler = ElasticSampler(config, rank, world_size)
        sampler.samples_consumed = samples_consumed
        shares.append([i for mb in sampler.step_plan() if not mb.padding for i in mb.indices])
    return shares


def test_each_epoch_is_a_permutation_and_epochs_differ() -> None:
    config = SamplingConfig(dataset_size=10, global_batch=4, seed=3)
    first, second = stream_slice(config, 0, 10), stream_slice(config, 10, 10)
    assert sorted(first) == list(range(10)) and sorted(second) == list(range(10))
    assert first != second


def test_global_batch_crosses_the_epoch_boundary() -> None:
    config = SamplingConfig(dataset_size=10, global_batch=4, seed=3)
    assert stream_slice(config, 8, 4) == stream_slice(config, 0, 20)[8:12]


def test_without_shuffle_the_stream_is_dataset_order() -> None:
    config = SamplingConfig(dataset_size=5, global_batch=3, shuffle=False)
    assert stream_slice(config, 3, 4) == [3, 4, 0, 1]


@pytest.mark.parametrize("global_batch,world_size", [(8, 3), (7, 2), (5, 5), (3, 4), (12, 1)])
def test_shares_partition_the_global_batch(global_batch: int, world_size: int) -> None:
    bounds = [share_bounds(global_batch, world_size, rank) for rank in range(world_size)]
    assert bounds[0][0] == 0 and bounds[-1][1] == global_batch
    assert all(stop == next_start for (_, stop), (next_start, _) in zip(bounds, bounds[1:]))
    sizes = [stop - start for start, stop in bounds]
    assert max(sizes) - min(sizes) <= 1


def test_uneven_shares_weight_the_loss_to_the_global_mean() -> None:
    # 8 samples on 3 ranks: shares 3, 3, 2. Gradient reduction averages over ranks,
    # so sum over ranks of sum(weight * mean loss) / world_size must be the global mean.
    config = SamplingConfig(dataset_size=100, global_batch=8, micro_batch=2, seed=1)
    batch = stream_slice(config, 0, 8)
    per_sample_loss = {index: float(index) for index in batch}
    world_size = 3
    total = 0.0
    for rank in range(world_size):
        plan = rank_micro_batches(config, batch, world_size, rank)
        assert len(plan) == passes_per_step(config, world_size) == 2
        for mb in plan:
            mean = sum(per_sample_loss[i] for i in mb.indices) / len(mb.indices)
            total += mb.loss_weight * mean
    assert total / world_size == pytest.approx(sum(per_sample_loss.values()) / 8)


def test_short_shares_are_padded_with_zero_weight_passes() -> None:
    # 3 samples on 4 ranks: rank 3 has none but must still run the step's one pass.
    config = SamplingConfig(dataset_size=50, global_batch=3, seed=0)
    batch = stream_slice(config, 0, 3)
    plan = rank_micro_batches(config, batch, 4, 3)
    assert len(plan) == 1 and plan[0].padding and plan[0].loss_weight == 0.0
    assert plan[0].indices[0] in batch


def test_micro_batch_limits_every_pass() -> None:
    config = SamplingConfig(dataset_size=100, global_batch=10, micro_batch=3, seed=0)
    for world_size in (1, 2, 3):
        for rank in range(world_size):
            plan = rank_micro_batches(config, stream_slice(config, 0, 10), world_size, rank)
            assert all(len(mb.indices) <= 3 for mb in plan)
            assert len(plan) == passes_per_step(config, world_size)


def test_config_rejects_micro_batch_above_global_batch() -> None:
    with pytest.raises(ValidationError, match="micro_batch .* larger than global_batch"):
        SamplingConfig(dataset_size=10, global_batch=4, micro_batch=5)


@pytest.mark.parametrize(
    "world_sizes",
    [[2] * 9, [2, 2, 3, 3, 1, 1, 4, 4, 2], [5, 1, 3, 2, 4, 1, 1, 3, 2]],
)
def test_every_sample_of_an_epoch_is_used_exactly_once_across_resizes(world_sizes: list[int]) -> None:
    # 3 epochs of 12 samples in 9 steps of 4: each epoch's samples exactly once,
    # whatever world size each step ran at (uneven shares included).
    config = SamplingConfig(dataset_size=12, global_batch=4, micro_batch=1, seed=7)
    per_epoch: dict[int, Counter] = {}
    consumed = 0
    reference = stream_slice(config, 0, 36)
    for step, world_size in enumerate(world_sizes):
        shares = samples_of_step(config, world_size, consumed)
        used = [i for share in shares for i in share]
        assert used == reference[step * 4 : (step + 1) * 4]
        per_epoch.setdefault(consumed // 12, Counter()).update(used)
        consumed += 4
    for epoch, counts in per_epoch.items():
        assert counts == Counter(range(12)), f"epoch {epoch}"


def test_state_is_global_and_restores_the_same_next_batch() -> None:
    config = SamplingConfig(dataset_size=30, global_batch=6, seed=5)
    ranks = [ElasticSampler(config, rank, 2) for rank in range(2)]
    for sampler in ranks:
        for _ in range(7):
            sampler.complete_step()
    assert isinstance(ranks[0], Stateful)  # what the checkpoint manager checks
    states = [sampler.state_dict() for sampler in ranks]
    assert states[0] == states[1] == {"seed": 5, "epoch": 1, "samples_consumed": 42}

    resumed = ElasticSampler(config, 2, 3)
    resumed.load_state_dict(states[0])
    assert resumed.global_batch() == ranks[0].global_batch() == stream_slice(config, 42, 6)


def test_load_adopts_the_checkpointed_seed(caplog: pytest.LogCaptureFixture) -> None:
    config = SamplingConfig(dataset_size=30, global_batch=6, seed=5)
    sampler = ElasticSampler(config.model_copy(update={"seed": 9}), 0, 1)
    with caplog.at_level(logging.WARNING, logger="elastic.sampling"):
        sampler.load_state_dict({"seed": 5, "epoch": 0, "samples_consumed": 12})
    assert "checkpointed sampling seed 5" in caplog.text
    assert sampler.global_batch() == stream_slice(config, 12, 6)


def test_load_rejects_progress_that_does_not_fit_the_dataset() -> None:
    sampler = ElasticSampler(SamplingConfig(dataset_size=30, global_batch=6), 0, 1)
    with pytest.raises(ValueError, match="dataset changed"):
        sampler.load_state_dict({"seed": 0, "epoch": 0, "samples_consumed": 36})


def test_regenerate_state_recomputes_progress_from_the_step() -> None:
    config = SamplingConfig(dataset_size=30, global_batch=6, seed=5)
    sampler = ElasticSampler(config, 1, 4)
    sampler.regenerate_state(11)
    assert sampler.state_dict() == {"seed": 5, "epoch": 2, "samples_consumed": 66}


@pytest.mark.parametrize("num_workers", [0, 2])
def test_dataloader_yields_the_plan_in_order(num_workers: int) -> None:
    config = SamplingConfig(dataset_size=20, global_batch=5, micro_batch=2, seed=2)
    sampler = ElasticSampler(config, rank=1, world_size=2)
    sampler.samples_consumed = 15  # start mid-run, across an epoch boundary
    loader = DataLoader(IndexDataset(20), batch_sampler=sampler, num_workers=num_workers)
    batches = iter(loader)
    for _ in range(3):
        for micro_batch in sampler.step_plan():
            assert next(batches).tolist() == list(micro_batch.indices)
        sampler.complete_step()
