"""Adopting checkpoints written by plain dcp.save, and entries saved in another layout (per-rank dataloader keys).

The seed's story with torchtitan's dataloader layout, ``{"dp_rank_<r>": ..., "world_size": <dp>}``: saved by 8
ranks with plain ``dcp.save`` as torchtitan saves, loaded at 16 (and at 8) in real processes.
"""

from __future__ import annotations

import logging
import pickle
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed.checkpoint as dcp
from equality import assert_identical
from multiproc import run_ranks
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_state_dict
from torch.distributed.fsdp import fully_shard

from elastic.checkpoint import CheckpointError, CheckpointManager, ModelState, write_commit_record
from elastic.sampling import ElasticSampler, SamplingConfig

pytestmark = [pytest.mark.timeout(60), pytest.mark.filterwarnings("ignore:torch.distributed is disabled")]

STEP = 40


class GlobalLoader:
    """Progress derived from the global step, so it can rebuild itself after a resize."""

    def __init__(self) -> None:
        self.samples_consumed = 0
        self.regenerated_from: int | None = None

    def state_dict(self) -> dict:
        return {"samples_consumed": self.samples_consumed}

    def load_state_dict(self, state: dict) -> None:
        self.samples_consumed = state["samples_consumed"]

    def regenerate_state(self, step: int) -> None:
        self.regenerated_from = step
        self.samples_consumed = step * 32


class PerRankOnlyLoader(GlobalLoader):
    regenerate_state = None  # cannot rebuild itself


def model_state(seed: int, width: int = 3) -> ModelState:
    torch.manual_seed(seed)
    model = torch.nn.Linear(4, width)
    return ModelState(model, torch.optim.AdamW(model.parameters()))


@pytest.fixture
def torchtitan_style_checkpoint(tmp_path: Path) -> tuple[Path, ModelState]:
    """A step folder written by plain dcp.save with torchtitan's per-rank dataloader keys, then adopted."""
    saved = model_state(seed=0)
    folder = tmp_path / f"step-{STEP}"
    dataloader = {f"dp_rank_{rank}": {"position": rank * 10} for rank in range(8)}
    dcp.save({"model": saved, "dataloader": dataloader}, checkpoint_id=folder, no_dist=True)
    write_commit_record(folder, STEP, world_size=8)
    return tmp_path, saved


def load(directory: Path, state: dict) -> int | None:
    manager = CheckpointManager(directory, check_at_start=False)
    try:
        return manager.load_latest(state)
    finally:
        manager.close()


def test_foreign_entry_is_regenerated_from_the_global_step(torchtitan_style_checkpoint, caplog) -> None:
    directory, saved = torchtitan_style_checkpoint
    state = {"model": model_state(seed=1), "dataloader": GlobalLoader()}
    with caplog.at_level(logging.WARNING):
        assert load(directory, state) == STEP
    assert state["dataloader"].regenerated_from == STEP and state["dataloader"].samples_consumed == STEP * 32
    assert torch.equal(state["model"].model.weight, saved.model.weight)
    warnings = [record.getMessage() for record in caplog.records if record.levelno == logging.WARNING]
    assert len(warnings) == 1
    assert str(directory / f"step-{STEP}") in warnings[0]
    assert "dataloader.dp_rank_{0..7}.position" in warnings[0] and f"global step {STEP}" in warnings[0]


def test_foreign_entry_without_regenerate_state_is_an_error(torchtitan_style_checkpoint) -> None:
    directory, _ = torchtitan_style_checkpoint
    with pytest.raises(CheckpointError) as failure:
        load(directory, {"model": model_state(seed=1), "dataloader": PerRankOnlyLoader()})
    message = str(failure.value)
    assert message.startswith(f"{directory / f'step-{STEP}'} holds per-rank state for state entry 'dataloader'")
    assert "(dataloader.dp_rank_{0..7}.position), saved by 8 ranks, now 1" in message
    assert "give that object (PerRankOnlyLoader) a regenerate_state(step) method or drop it from the state" in message


def test_missing_model_keys_are_an_error_even_with_foreign_entries(torchtitan_style_checkpoint) -> None:
    directory, _ = torchtitan_style_checkpoint
    wider = model_state(seed=1)
    wider.model.add_module("extra", torch.nn.Linear(2, 2))
    with pytest.raises(CheckpointError, match=r"lacks \d+ of the \d+ keys of state entry 'model'.*model\.model\.extra"):
        load(directory, {"model": wider, "dataloader": GlobalLoader()})


def test_entry_present_in_the_checkpoint_loads_normally(tmp_path: Path) -> None:
    manager = CheckpointManager(tmp_path, async_save=False, check_at_start=False)
    loader = GlobalLoader()
    loader.samples_consumed = 123
    manager.save(5, {"model": model_state(seed=0), "dataloader": loader})
    manager.close()
    fresh = GlobalLoader()
    assert load(tmp_path, {"model": model_state(seed=1), "dataloader": fresh}) == 5
    assert fresh.samples_consumed == 123 and fresh.regenerated_from is None


def test_commit_record_refuses_an_unfinished_save(tmp_path: Path) -> None:
    with pytest.raises(CheckpointError, match=r"no DCP \.metadata"):
        write_commit_record(tmp_path, 3, world_size=2)


SAMPLING = SamplingConfig(dataset_size=1000, global_batch=48, seed=3)


class TorchtitanLayoutLoader:
    """torchtitan's dataloader state layout over an ElasticSampler, able to regenerate; records what it did."""

    def __init__(self, rank: int, world_size: int) -> None:
        self.rank, self.world_size = rank, world_size
        self.sampler = ElasticSampler(SAMPLING, rank, world_size)
        self.loaded = False
        self.regenerated_from: int | None = None

    def state_dict(self) -> dict[str, Any]:
        return {f"dp_rank_{self.rank}": pickle.dumps(self.sampler.state_dict()), "world_size": self.world_size}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.loaded = True
        self.sampler.load_state_dict(pickle.loads(state[f"dp_rank_{self.rank}"]))

    def regenerate_state(self, step: int) -> None:
        self.regenerated_from = step
        self.sampler.regenerate_state(step)


def sharded_model(seed: int) -> ModelState:
    torch.manual_seed(seed)
    model = torch.nn.Sequential(torch.nn.Linear(6, 7), torch.nn.ReLU(), torch.nn.Linear(7, 5))
    for layer in (model[0], model[2], model):
        fully_shard(layer)
    return ModelState(model, torch.optim.AdamW(model.parameters(), lr=0.1))


def full_values(entry: ModelState) -> dict[str, Any]:
    model_state, optimizer_state = get_state_dict(
        entry.model, entry.optimizers, options=StateDictOptions(full_state_dict=True, cpu_offload=True)
    )
    return {"model": model_state, "optimizer": optimizer_state}


def save_as_torchtitan(rank: int, world_size: int, directory: str) -> dict[str, Any]:
    """Plain dcp.save of the model and torchtitan's per-rank dataloader layout after STEP steps: a foreign step."""
    model = sharded_model(seed=0)
    loader = TorchtitanLayoutLoader(rank, world_size)
    for step in range(STEP):
        torch.manual_seed(step * 100 + rank)
        model.model(torch.randn(4, 6)).square().mean().backward()
        model.optimizers[0].step()
        model.optimizers[0].zero_grad()
        loader.sampler.complete_step()
    dcp.save({"model": model, "dataloader": loader}, checkpoint_id=Path(directory) / f"step-{STEP}")
    return {**full_values(model), "next": loader.sampler.step_plan()}


def load_at(rank: int, world_size: int, directory: str) -> dict[str, Any]:
    model = sharded_model(seed=1 + rank)
    loader = TorchtitanLayoutLoader(rank, world_size)
    manager = CheckpointManager(directory, check_at_start=False, adopt_foreign=True)
    step = manager.load_latest({"model": model, "dataloader": loader})
    manager.close()
    return {
        "step": step,
        "loaded": loader.loaded,
        "regenerated_from": loader.regenerated_from,
        "next": loader.sampler.step_plan(),
        **full_values(model),
    }


@pytest.fixture(scope="module")
def saved_by_8(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, list[dict[str, Any]]]:
    directory = tmp_path_factory.mktemp("saved-by-8")
    return directory, run_ranks(8, save_as_torchtitan, str(directory), timeout=120)


@pytest.mark.timeout(240)
def test_seeds_story_8_to_16_regenerates_every_ranks_data_position(saved_by_8) -> None:
    directory, saved = saved_by_8
    loaded = run_ranks(16, load_at, str(directory), timeout=180)
    assert {result["step"] for result in loaded} == {STEP}
    assert [(result["loaded"], result["regenerated_from"]) for result in loaded] == [(False, STEP)] * 16
    assert_identical(
        {key: loaded[0][key] for key in ("model", "optimizer")},
        {"model": saved[0]["model"], "optimizer": saved[0]["optimizer"]},
    )
    # the 16 new ranks' next step is the global batch an uninterrupted run takes next, each sample once
    drawn = [index for result in loaded for micro_batch in result["next"] for index in micro_batch.indices]
    assert drawn == ElasticSampler(SAMPLING, 0, 1).global_batch(STEP * SAMPLING.global_batch)


@pytest.mark.timeout(240)
def test_at_8_again_every_rank_loads_its_own_position_exactly(saved_by_8) -> None:
    directory, saved = saved_by_8
    loaded = run_ranks(8, load_at, str(directory), timeout=180)
    assert [(result["loaded"], result["regenerated_from"]) for result in loaded] == [(True, None)] * 8
    assert [result["next"] for result in loaded] == [rank_saved["next"] for rank_saved in saved]
