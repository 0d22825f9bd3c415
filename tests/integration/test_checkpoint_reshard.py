"""Resharding: FSDP2 model + AdamW saved at N ranks loads exactly at M ranks, and with plain dcp.load."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed.checkpoint as dcp
from equality import assert_identical
from multiproc import run_ranks
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_state_dict
from torch.distributed.fsdp import fully_shard
from torch.distributed.tensor import DTensor, Replicate, Shard, distribute_tensor

from elastic import shard_local_ops
from elastic.checkpoint import CheckpointManager, ModelState
from elastic.checkpoint.model_state import init_state_on_shards

FULL = StateDictOptions(full_state_dict=True, cpu_offload=True)
SAVED_STEP = 3


def tiny_model(seed: int) -> torch.nn.Module:
    # Odd sizes so 3, 5 and 16 ranks get uneven and empty shards.
    torch.manual_seed(seed)
    return torch.nn.Sequential(torch.nn.Linear(6, 7), torch.nn.ReLU(), torch.nn.Linear(7, 5))


def sharded(seed: int) -> tuple[torch.nn.Module, torch.optim.Optimizer]:
    model = tiny_model(seed)
    for layer in model:
        if isinstance(layer, torch.nn.Linear):
            fully_shard(layer)
    fully_shard(model)
    return model, torch.optim.AdamW(model.parameters(), lr=0.1)


def full_state(model: torch.nn.Module, optimizer: torch.optim.Optimizer) -> dict[str, Any]:
    model_state, optimizer_state = get_state_dict(model, optimizer, options=FULL)
    return {"model": model_state, "optimizer": optimizer_state}


def train_and_save(rank: int, world_size: int, directory: str) -> dict[str, Any] | None:
    model, optimizer = sharded(seed=0)
    manager = CheckpointManager(directory, keep=2, async_save=True)
    state = {"model": ModelState(model, optimizer)}
    assert manager.load_latest(state) is None
    for step in range(1, SAVED_STEP + 1):
        torch.manual_seed(100 * step + rank)  # each rank trains on its own data
        model(torch.randn(4, 6)).square().mean().backward()
        optimizer.step()
        optimizer.zero_grad()
        manager.save(step, state)
    manager.close()
    expected = full_state(model, optimizer)
    return expected if rank == 0 else None


def load_resharded(rank: int, world_size: int, directory: str) -> tuple[int | None, dict[str, Any] | None]:
    model, optimizer = sharded(seed=1 + rank)  # differs from what was saved, so a no-op load would fail
    manager = CheckpointManager(directory, async_save=False)
    step = manager.load_latest({"model": ModelState(model, optimizer)})
    manager.close()
    loaded = full_state(model, optimizer)
    return step, loaded if rank == 0 else None


@pytest.fixture(scope="module")
def saved_at(tmp_path_factory: pytest.TempPathFactory):
    """Checkpoint directory and expected full state for a save at N ranks, each N saved once per module."""
    saves: dict[int, tuple[Path, dict[str, Any]]] = {}

    def save(world_size: int) -> tuple[Path, dict[str, Any]]:
        if world_size not in saves:
            directory = tmp_path_factory.mktemp(f"saved-at-{world_size}")
            expected = run_ranks(world_size, train_and_save, str(directory), timeout=120)[0]
            saves[world_size] = (directory, expected)
        return saves[world_size]

    return save


@pytest.mark.slow
@pytest.mark.timeout(240)
@pytest.mark.parametrize("saved_world, loaded_world", [(4, 2), (2, 4), (4, 3), (3, 5), (8, 16)])
def test_model_and_optimizer_reshard_exactly(saved_at, saved_world: int, loaded_world: int) -> None:
    directory, expected = saved_at(saved_world)
    step, loaded = run_ranks(loaded_world, load_resharded, str(directory), timeout=120)[0]
    assert step == SAVED_STEP
    assert expected["optimizer"]["state"], "AdamW state must be part of the comparison"
    assert_identical(loaded, expected)


@pytest.mark.timeout(240)
@pytest.mark.filterwarnings("ignore:torch.distributed is disabled")
def test_checkpoint_loads_with_plain_dcp_load(saved_at) -> None:
    directory, expected = saved_at(4)
    model = tiny_model(seed=7)
    optimizer = torch.optim.AdamW(model.parameters(), lr=0.1)
    dcp.load({"model": ModelState(model, optimizer)}, checkpoint_id=directory / f"step-{SAVED_STEP}", no_dist=True)
    model_state, optimizer_state = get_state_dict(model, optimizer)
    assert_identical({"model": model_state, "optimizer": optimizer_state}, expected)


OPTIMIZERS = {
    "adamw-fused": lambda params: torch.optim.AdamW(params, lr=0.1, fused=True),
    "adamw": lambda params: torch.optim.AdamW(params, lr=torch.tensor(0.1), weight_decay=0.5),
    "adam-amsgrad": lambda params: torch.optim.Adam(params, lr=0.1, amsgrad=True, foreach=False),
    "sgd-momentum": lambda params: torch.optim.SGD(params, lr=0.1, momentum=0.9),
    "sgd": lambda params: torch.optim.SGD(params, lr=0.1),
}


def laid_out(state: Any) -> Any:
    """A state dict with each DTensor as (its placements, global shape, local shard): comparable on each rank."""
    if isinstance(state, DTensor):
        return {"placements": repr(state.placements), "shape": list(state.shape), "local": state.to_local()}
    if isinstance(state, dict):
        return {key: laid_out(value) for key, value in state.items()}
    if isinstance(state, list):
        return [laid_out(value) for value in state]
    return state


def optimizer_state_both_ways(rank: int, world_size: int, name: str) -> tuple[Any, Any, bool]:
    """An empty optimizer's state as ModelState builds it (on the local shards) and as torch's API does, and
    whether the shards' step built any (a plain SGD has none)."""
    states = []
    built = False
    for ours in (True, False):
        model = tiny_model(seed=0)
        for layer in model:
            if isinstance(layer, torch.nn.Linear):
                fully_shard(layer)
        fully_shard(model)
        optimizer = OPTIMIZERS[name](model.parameters())
        if ours:
            init_state_on_shards(optimizer)
            built = bool(optimizer.state)
            state = ModelState(model, optimizer).state_dict()
        else:
            model_state, optimizer_state = get_state_dict(model, optimizer)
            state = {"model": model_state, "optimizer": optimizer_state}
        states.append(laid_out(state))
    return states[0], states[1], built


@pytest.mark.parametrize("name", sorted(OPTIMIZERS))
@pytest.mark.timeout(120)
def test_an_empty_optimizers_state_is_built_on_the_shards_as_torch_builds_it(name: str) -> None:
    """Before a load, torch's state-dict API gives an empty optimizer its state with one step over the DTensor
    parameters: 0.34-0.45 s of sharding propagation at each round change of a 6-rank job on 2 cores. ModelState
    takes that step on the local shards: the same keys, layouts and values, the parameters untouched, at 3 ranks
    (uneven shards)."""
    for ours, torchs, built in run_ranks(3, optimizer_state_both_ways, name):
        assert_identical(ours, torchs)
        assert built is (name != "sgd"), "built on the shards, not left to torch's step"


def copies_in_and_out_of_the_context(rank: int, world_size: int) -> dict[str, Any]:
    """A model's state dict loaded through ModelState, copies that DTensor must redistribute or convert made in
    the same context, and what was copied shard to shard."""
    local_copies = []
    laid_out_alike = shard_local_ops.laid_out_alike

    def counted(target: Any, source: Any) -> bool:
        alike = laid_out_alike(target, source)
        local_copies.append(alike)
        return alike

    shard_local_ops.laid_out_alike = counted
    try:
        source, _ = sharded(seed=0)
        target, optimizer = sharded(seed=1)
        ModelState(target).load_state_dict({"model": source.state_dict()})
        loaded = list(local_copies)
        mesh = target[0].weight.device_mesh
        full = torch.arange(12.0).reshape(4, 3)
        sharded_target = distribute_tensor(torch.zeros(4, 3), mesh, [Shard(0)])
        as_float64 = distribute_tensor(full.double(), mesh, [Shard(0)])
        replicated = distribute_tensor(full, mesh, [Replicate()])
        del local_copies[:]
        with shard_local_ops.copies_between_shards():
            sharded_target.copy_(replicated)  # a redistribution: DTensor's own copy
            redistributed = sharded_target.full_tensor()
            sharded_target.zero_()
            sharded_target.copy_(as_float64)  # a conversion: DTensor's own copy
            converted = sharded_target.full_tensor()
    finally:
        shard_local_ops.laid_out_alike = laid_out_alike
    handler_left = torch.ops.aten.copy_.default in DTensor._op_dispatcher._custom_op_handlers
    return {
        "equal": [
            torch.equal(a.to_local(), b.to_local())
            for a, b in zip(target.state_dict().values(), source.state_dict().values())
        ],
        "parameters": len(source.state_dict()),
        "loaded": loaded,
        "others": list(local_copies),
        "redistributed": torch.equal(redistributed, full),
        "converted": torch.equal(converted, full),
        "handler_left": handler_left,
    }


@pytest.mark.timeout(120)
def test_a_load_copies_each_parameter_shard_to_shard_and_other_copies_as_dtensor_does() -> None:
    """Loading a state dict copies each DTensor parameter from a DTensor laid out as it; DTensor works out each
    such copy's sharding through fake tensors, once per mesh: 0.2 s of a 6-rank load on 2 cores at every round
    change. ModelState copies those shard to shard (3 ranks, uneven shards): the same values; a copy that needs
    a redistribution or a conversion still goes through DTensor, right; and nothing stays installed after."""
    for result in run_ranks(3, copies_in_and_out_of_the_context):
        assert all(result["equal"]) and len(result["equal"]) == result["parameters"] == 4
        assert result["loaded"] == [True] * result["parameters"], "every parameter copied shard to shard"
        assert result["others"] == [False, False], "the redistribution and the conversion went to DTensor"
        assert result["redistributed"] and result["converted"]
        assert not result["handler_left"]
