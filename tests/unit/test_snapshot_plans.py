"""A round's first snapshot takes the plan of the snapshot it loaded: the plan read back from that snapshot's
metadata is DCP's agreed plan where every rank's state has the layout it had, and none where one does not. Two
ranks planned in one process with DCP's own planner, without I/O."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any

import pytest
import torch
from torch.distributed.checkpoint import FileSystemWriter
from torch.distributed.checkpoint.default_planner import DefaultSavePlanner
from torch.distributed.checkpoint.metadata import Metadata
from torch.distributed.checkpoint.planner import SavePlan

from elastic.checkpoint.snapshot_format import RawBytes, data_file, storage_of
from elastic.checkpoint.snapshot_plans import local_plan, plan_of_saved

pytestmark = pytest.mark.timeout(60)


def rank_state(rank: int) -> dict[str, Any]:
    return {
        "weight": torch.full((4, 3), float(rank)),  # a plain tensor on every rank: DCP keeps one rank's
        "bias": torch.zeros(3),
        "step": torch.tensor(7),
        "optimizer": {"lr": 0.1, "betas": [0.9, 0.95]},  # objects: one rank's too
        "note": "run-1",
    }


def saved_as_dcp_plans(states: list[dict[str, Any]]) -> tuple[list[SavePlan], Metadata]:
    """DCP's agreed plans for ``states`` (one per rank) and the metadata of a snapshot written with them, each
    rank's items in its own file."""
    planners = [DefaultSavePlanner() for _ in states]
    local = []
    for rank, (planner, state) in enumerate(zip(planners, states, strict=True)):
        planner.set_up_planner(state, storage_meta=None, is_coordinator=rank == 0)
        local.append(planner.create_local_plan())
    agreed, metadata = planners[0].create_global_plan(local)
    agreed = [dataclasses.replace(plan, storage_data=storage_of(rank)) for rank, plan in enumerate(agreed)]
    storage = {
        item.index: RawBytes(data_file(rank), offset, 0)
        for rank, plan in enumerate(agreed)
        for offset, item in enumerate(plan.items)
    }
    return agreed, dataclasses.replace(metadata, storage_data=storage)


def test_every_ranks_plan_read_back_from_the_metadata_is_dcps() -> None:
    states = [rank_state(rank) for rank in range(2)]
    agreed, metadata = saved_as_dcp_plans(states)
    assert {item.index.fqn for item in agreed[1].items}, "DCP gave rank 1 some of the replicated tensors"
    for rank, state in enumerate(states):
        planner = local_plan(state, is_coordinator=rank == 0)
        plan = plan_of_saved(planner, metadata, rank)
        assert plan is not None
        assert plan.agreed == agreed[rank]
        assert [item.index.index for item in plan.agreed.items] == [item.index.index for item in agreed[rank].items]
        assert plan.local == planner.local
        assert plan.metadata is metadata


def changed(change: Callable[[dict[str, Any]], object]) -> Callable[[dict[str, Any]], dict[str, Any]]:
    def apply(state: dict[str, Any]) -> dict[str, Any]:
        change(state)
        return state

    return apply


@pytest.mark.parametrize(
    "change",
    [
        pytest.param(changed(lambda s: s.update(extra=torch.ones(2))), id="an entry more"),
        pytest.param(changed(lambda s: s.update(weight=torch.zeros(5, 3))), id="another shape"),
        pytest.param(changed(lambda s: s.update(bias=torch.zeros(3, dtype=torch.bfloat16))), id="another dtype"),
        pytest.param(changed(lambda s: s.update(bias=torch.zeros(3).requires_grad_())), id="requires grad"),
        pytest.param(changed(lambda s: s.update(note=torch.zeros(1))), id="an object become a tensor"),
        pytest.param(
            changed(lambda s: s.update({"optimizer.lr": s["optimizer"].pop("lr")})),
            id="the same flat key from another nesting",
        ),
    ],
)
@pytest.mark.parametrize("rank", [0, 1])
def test_a_rank_whose_layout_changed_has_no_plan_from_the_metadata(
    change: Callable[[dict[str, Any]], dict[str, Any]], rank: int
) -> None:
    _, metadata = saved_as_dcp_plans([rank_state(r) for r in range(2)])
    planner = local_plan(change(rank_state(rank)), is_coordinator=rank == 0)
    assert plan_of_saved(planner, metadata, rank) is None


@pytest.mark.parametrize("rank", [0, 1])
def test_a_rank_without_an_entry_its_file_holds_has_no_plan_from_the_metadata(rank: int) -> None:
    """Its file would lack the entry. An entry DCP gave another rank's file may go: that rank writes it."""
    agreed, metadata = saved_as_dcp_plans([rank_state(r) for r in range(2)])
    in_own_file = {item.index.fqn.split(".")[0] for item in agreed[rank].items}
    for name in rank_state(rank):
        state = rank_state(rank)
        state.pop(name)
        plan = plan_of_saved(local_plan(state, is_coordinator=rank == 0), metadata, rank)
        assert (plan is None) == (name in in_own_file), name


def test_the_storage_data_of_a_ranks_plan_is_the_prefix_dcps_file_writer_gives_it(tmp_path) -> None:
    plans = FileSystemWriter(tmp_path).prepare_global_plan([SavePlan([]) for _ in range(3)])
    assert [plan.storage_data for plan in plans] == [storage_of(rank) for rank in range(3)]
    assert data_file(2) == "__2_0.distcp"
