"""Adopting checkpoints written by plain dcp.save, and entries saved in another layout (per-rank dataloader keys)."""

from __future__ import annotations

import logging
from pathlib import Path

import pytest
import torch
import torch.distributed.checkpoint as dcp

from elastic.checkpoint import CheckpointError, CheckpointManager, ModelState, write_commit_record

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
