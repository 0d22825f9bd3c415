"""A snapshot's and a load's local plans, made from the items of this process's last plan where an entry's layout
is the same: DCP's plans item for item, at 3 ranks with uneven shards, through changes of layout, of chunks and of
mesh. Planning only (no training), so these run beside the busy modules' tests (conftest.BUSY_MODULES)."""

from __future__ import annotations

import contextlib
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from multiproc import run_ranks
from torch.distributed.checkpoint.default_planner import DefaultSavePlanner
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import DTensor, Replicate, Shard, distribute_tensor

from elastic.checkpoint import snapshot_plans


def local_plans_through_layout_changes(rank: int, world_size: int) -> list[tuple[str, bool, list[str]]]:
    """Per change of a state's layout: whether snapshot_plans' local plan, made from the last plan's items, is the
    one DCP makes, and which DTensor entries it had DCP make anew."""
    mesh = init_device_mesh("cpu", (world_size,))
    torch.manual_seed(0)
    rows, wide = torch.randn(7, 3), torch.randn(5, 2)  # uneven shards at 3 ranks
    made: list[str] = []
    dcps = snapshot_plans.create_default_local_save_plan

    def counted(state_dict: dict[str, Any], is_coordinator: bool) -> Any:
        made.extend(state_dict)
        return dcps(state_dict, is_coordinator)

    snapshot_plans.create_default_local_save_plan = counted
    state: dict[str, Any] = {
        "weight": distribute_tensor(rows, mesh, [Shard(0)]),
        "bias": distribute_tensor(torch.randn(4), mesh, [Replicate()]),
        "trainable": distribute_tensor(wide, mesh, [Shard(1)]).requires_grad_(),
        "optimizer": {"step": torch.tensor(3.0), "lr": 0.1},
        "note": "text",
    }
    changes = [
        ("the first plan", False, lambda: None),
        ("the same layout, other values", False, lambda: state["weight"].to_local().add_(1)),
        ("resharded along another dim", False, lambda: state.update(weight=distribute_tensor(rows, mesh, [Shard(1)]))),
        ("a larger shape", False, lambda: state.update(weight=distribute_tensor(torch.randn(8, 3), mesh, [Shard(0)]))),
        ("renamed", False, lambda: state.update(renamed=state.pop("weight"))),
        ("another dtype", False, lambda: state.update(bias=state["bias"].to(torch.bfloat16))),
        ("a plain tensor of another shape", False, lambda: state["optimizer"].update(step=torch.tensor([3.0, 4.0]))),
        ("planned without grad", True, lambda: None),
        ("an entry more", True, lambda: state.update(extra=distribute_tensor(wide, mesh, [Replicate()]))),
        ("a new mesh of the same ranks (a new round)", True, lambda: state.update(on_a_new_mesh(state))),
    ]
    known: snapshot_plans.EntryItems = {}
    outcomes = []
    for name, no_grad, change in changes:
        change()
        made.clear()
        with torch.no_grad() if no_grad else contextlib.nullcontext():
            ours = snapshot_plans.local_plan(state, is_coordinator=rank == 0, known=known)
            dcp_planner = DefaultSavePlanner()
            dcp_planner.set_up_planner(state, storage_meta=None, is_coordinator=rank == 0)
            dcps_plan = dcp_planner.create_local_plan()
        known = ours.entry_items
        outcomes.append((name, ours.local == dcps_plan, sorted(made)))
    snapshot_plans.create_default_local_save_plan = dcps
    return outcomes


def on_a_new_mesh(state: dict[str, Any]) -> dict[str, Any]:
    """The DTensors of ``state`` on a mesh made anew over the same ranks, as a new round's model has them."""
    mesh = init_device_mesh("cpu", (dist.get_world_size(),))
    return {
        name: DTensor.from_local(
            value.to_local(), mesh, value.placements, shape=value.shape, stride=value.stride()
        ).requires_grad_(value.requires_grad)
        for name, value in state.items()
        if isinstance(value, DTensor)
    }


def load_plans_through_layout_changes(rank: int, world_size: int, folder: str) -> list[tuple[str, bool, list[str]]]:
    """Per change of a state's layout or of its checkpoint's chunks: whether load_plans' local plan, made from the
    last plan's items, is DCP's, and which DTensor entries it had DCP plan anew."""
    from torch.distributed.checkpoint import FileSystemReader
    from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner

    from elastic.checkpoint import load_plans

    mesh = init_device_mesh("cpu", (world_size,))
    torch.manual_seed(0)
    rows = torch.randn(7, 3)  # uneven shards at 3 ranks
    state: dict[str, Any] = {
        "weight": distribute_tensor(rows, mesh, [Shard(0)]),
        "bias": distribute_tensor(torch.randn(4), mesh, [Replicate()]),
        "step": torch.tensor(3.0),
        "note": "text",
    }
    dcp.save(state, checkpoint_id=f"{folder}/by-rows")
    dcp.save({**state, "weight": distribute_tensor(rows, mesh, [Shard(1)])}, checkpoint_id=f"{folder}/by-columns")
    by_rows, by_columns = (FileSystemReader(f"{folder}/{name}").read_metadata() for name in ("by-rows", "by-columns"))
    made: list[str] = []
    dcps = load_plans.create_default_local_load_plan

    def counted(state_dict: dict[str, Any], *args: Any, **kwargs: Any) -> Any:
        made.extend(state_dict)
        return dcps(state_dict, *args, **kwargs)

    load_plans.create_default_local_load_plan = counted
    changes = [
        ("the first plan", by_rows, lambda: None),
        ("the same layout and chunks", by_rows, lambda: None),
        ("a new mesh of the same ranks (a new round)", by_rows, lambda: state.update(on_a_new_mesh(state))),
        (
            "resharded along another dim",
            by_rows,
            lambda: state.update(weight=distribute_tensor(rows, mesh, [Shard(1)])),
        ),
        ("a checkpoint chunked otherwise", by_columns, lambda: None),
    ]
    outcomes = []
    for name, metadata, change in changes:
        change()
        made.clear()
        ours = load_plans.make_load_plan(state, metadata)
        dcp_planner = DefaultLoadPlanner(allow_partial_load=True)
        dcp_planner.set_up_planner(state, metadata, is_coordinator=False)
        outcomes.append((name, ours.plan == dcp_planner.create_local_plan(), sorted(made)))
    load_plans.create_default_local_load_plan = dcps
    return outcomes


@pytest.mark.timeout(120)
def test_a_load_plan_makes_anew_only_the_dtensors_whose_layout_or_chunks_changed(tmp_path: Path) -> None:
    """A worker re-entered in a new round loads the same layouts from a snapshot chunked as the last one: its plan
    takes the last plan's read items, and is DCP's plan item for item, at 3 ranks with uneven shards."""
    for outcomes in run_ranks(3, load_plans_through_layout_changes, str(tmp_path)):
        assert outcomes == [
            ("the first plan", True, ["bias", "note", "step", "weight"]),
            ("the same layout and chunks", True, []),
            ("a new mesh of the same ranks (a new round)", True, []),
            ("resharded along another dim", True, ["weight"]),
            ("a checkpoint chunked otherwise", True, ["weight"]),
        ]


@pytest.mark.timeout(120)
def test_a_local_plan_makes_anew_only_the_dtensors_whose_layout_changed() -> None:
    """A snapshot's local plan is made every step; DCP computes each DTensor's shard offsets for it again. Ours
    takes the items of the last plan for entries of the same name, shape, dtype, mesh, placements and grad (plain
    tensors: name, shape and properties; objects: name), and is DCP's plan item for item, at 3 ranks with uneven
    shards."""
    for outcomes in run_ranks(3, local_plans_through_layout_changes):
        assert outcomes == [
            ("the first plan", True, ["bias", "note", "optimizer.lr", "optimizer.step", "trainable", "weight"]),
            ("the same layout, other values", True, []),
            ("resharded along another dim", True, ["weight"]),
            ("a larger shape", True, ["weight"]),
            ("renamed", True, ["renamed"]),
            ("another dtype", True, ["bias"]),
            ("a plain tensor of another shape", True, ["optimizer.step"]),
            ("planned without grad", True, ["trainable"]),
            ("an entry more", True, ["extra"]),
            ("a new mesh of the same ranks (a new round)", True, []),
        ]
