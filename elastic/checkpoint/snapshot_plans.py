"""A memory snapshot's save plan, made once and reused while no rank's state changed its layout.

DCP plans every save across the ranks: their local plans gathered, deduplicated and scattered back, then their
write results gathered and the metadata written by the coordinator. Those are four collectives, and with a
snapshot every step they cost more than the snapshot's own writes (at 6 ranks on 2 cores, 68 ms a step of a
107 ms snapshot, for a tiny model). Between two snapshots of one round the state's layout rarely changes: the
same entries, the same shards, the same dtypes. So the plan the ranks agreed on for one snapshot serves the
next ones as long as every rank's local plan is the same as it was; each rank then writes its part with it,
and the write results, gathered once, complete the metadata (what differs between two snapshots of one layout
is only where each pickled object lies, since a pickle's size follows its value).

`memory.py` decides, with every rank's answer, whether the plan still fits; a plan is never reused across
rounds (a manager, and its snapshots, last one round).
"""

from __future__ import annotations

import dataclasses
import pickle
from dataclasses import dataclass
from typing import Any

from torch.distributed.checkpoint.default_planner import DefaultSavePlanner
from torch.distributed.checkpoint.metadata import Metadata, StorageMeta
from torch.distributed.checkpoint.planner import SavePlan
from torch.distributed.checkpoint.storage import WriteResult


class RecordingPlanner(DefaultSavePlanner):
    """DCP's default planner, remembering this rank's local plan and the plan the ranks agreed it writes."""

    def __init__(self) -> None:
        super().__init__()
        self.local: SavePlan | None = None
        self.agreed: SavePlan | None = None

    def create_local_plan(self) -> SavePlan:
        self.local = super().create_local_plan()
        return self.local

    def finish_plan(self, new_plan: SavePlan) -> SavePlan:
        self.agreed = super().finish_plan(new_plan)
        return self.agreed


def local_plan(state_dict: dict[str, Any], is_coordinator: bool) -> RecordingPlanner:
    """A planner set up for ``state_dict`` with this rank's local plan made, as DCP's save makes it."""
    planner = RecordingPlanner()
    planner.set_up_planner(state_dict, storage_meta=None, is_coordinator=is_coordinator)
    planner.create_local_plan()
    return planner


@dataclass(frozen=True)
class SnapshotPlan:
    """What one snapshot's save planned on this rank: reusable for a state whose local plan is ``local``."""

    local: SavePlan  # this rank's plan before the ranks agreed (DCP's planner makes it alike for one layout)
    agreed: SavePlan  # what the ranks agreed this rank writes
    metadata: Metadata  # the metadata of the snapshot it was made for; only where its items lie changes

    def fits(self, planner: RecordingPlanner) -> bool:
        """Whether the state ``planner`` was set up for has this plan's layout on this rank."""
        return planner.local == self.local

    def metadata_with(self, results: list[list[WriteResult]], save_id: str) -> bytes:
        """The metadata of a snapshot written with this plan, given every rank's write results (rank order) and
        the snapshot's own ``save_id`` (rank 0 draws it). Every node's leader builds it from the same values: the
        same bytes on every node, and never the same bytes for two snapshots, whose metadata's digest names each
        (two snapshots of one layout can have their items in the same places)."""
        metadata = dataclasses.replace(
            self.metadata,
            storage_data={result.index: result.storage_data for written in results for result in written},
            storage_meta=StorageMeta(save_id=save_id),  # DCP's named the first snapshot's folder on one node
        )
        return pickle.dumps(metadata)
