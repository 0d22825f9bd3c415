"""A memory snapshot's save plan, made once and reused while no rank's state changed its layout.

DCP plans every save across the ranks: their local plans gathered, deduplicated and scattered back, then their
write results gathered and the metadata written by the coordinator. Those are four collectives, and with a
snapshot every step they cost more than the snapshot's own writes (at 6 ranks on 2 cores, 68 ms a step of a
107 ms snapshot, for a tiny model). Between two snapshots of one round the state's layout rarely changes: the
same entries, the same shards, the same dtypes. So the plan the ranks agreed on for one snapshot serves the
next ones as long as every rank's local plan is the same as it was; each rank then writes its part with it,
and the write results, gathered once, complete the metadata (what differs between two snapshots of one layout
is only where each pickled object lies, since a pickle's size follows its value).

`memory.py` decides, with every rank's answer, whether the plan still fits. A manager, and its snapshots, last one
round, so each round's first snapshot has no plan of its own to reuse; where the round loaded a snapshot saved at
its world size, though, that snapshot's metadata holds the plan the ranks agreed then (`plan_of_saved`): each
rank wrote the items its file holds. A round that only replaced a crashed worker has the same layout on every
rank, and its first snapshot is then written as the next ones are, without DCP's collectives and global plan
(0.1 s of CPU per rank at 6 ranks, on the step after every change).

Whether it fits is asked of the local plan, made every step. DCP makes a DTensor's write item from its shard's
offsets, computed anew for each entry (`compute_local_shape_and_global_offset`: 0.3-0.6 ms an entry on a loaded
CPU, most of a snapshot's own planning). The item depends only on the entry's name, its global shape and dtype,
its mesh, this rank's place in it and the placements, and its local tensor's properties (a plain tensor's: on its
shape and properties; any other value's: on its name), so a planner keeps the items of this process's last plan
by those and makes only the entries whose layout it has not seen: in a worker elastic.run re-entered, the new
round's first snapshot too.
"""

from __future__ import annotations

import dataclasses
import pickle
from collections.abc import Hashable
from dataclasses import dataclass
from typing import Any

import torch
from torch.distributed.checkpoint.default_planner import DefaultSavePlanner, create_default_local_save_plan
from torch.distributed.checkpoint.metadata import (
    BytesStorageMetadata,
    Metadata,
    MetadataIndex,
    StorageMeta,
    TensorStorageMetadata,
)
from torch.distributed.checkpoint.planner import SavePlan, WriteItem, WriteItemType
from torch.distributed.checkpoint.storage import WriteResult
from torch.distributed.tensor import DTensor

from elastic.checkpoint.snapshot_format import data_file, storage_of

EntryItems = dict[Hashable, list[WriteItem]]  # an entry's write items, by its layout (`entry_layout`)

# The write items of the last local plan this process made without ``known``: the next one's, in its round or in
# the next (a worker elastic.run re-entered builds the same layouts, and its meshes equal the last ones)
_last_entry_items: EntryItems = {}


class RecordingPlanner(DefaultSavePlanner):
    """DCP's default planner, remembering this rank's local plan and the plan the ranks agreed it writes. Its local
    plan takes each entry's write items from ``known`` (by default, this process's last local plan's
    ``entry_items``) when the entry's layout is the same."""

    def __init__(self, known: EntryItems | None = None) -> None:
        super().__init__()
        self.local: SavePlan | None = None
        self.agreed: SavePlan | None = None
        self._remembered = known is None
        self._known = _last_entry_items if known is None else known
        self.entry_items: EntryItems = {}  # this plan's, for the next planner

    def create_local_plan(self) -> SavePlan:
        """DCP's local plan (`create_default_local_save_plan`, DCP's plan caching off), entry by entry in order."""
        items: list[WriteItem] = []
        for fqn, value in self.state_dict.items():
            layout = entry_layout(fqn, value)
            if layout is None:
                items += create_default_local_save_plan({fqn: value}, self.is_coordinator).items
                continue
            made = self._known.get(layout)
            if made is None:
                made = create_default_local_save_plan({fqn: value}, self.is_coordinator).items
            self.entry_items[layout] = made
            items += made
        if self._remembered:
            global _last_entry_items
            _last_entry_items = self.entry_items
        plan = SavePlan(items)
        if self.flatten_state_dict:
            plan = dataclasses.replace(plan, planner_data=self.mappings)
        self.plan = self.local = plan
        return plan

    def finish_plan(self, new_plan: SavePlan) -> SavePlan:
        self.agreed = super().finish_plan(new_plan)
        return self.agreed


def entry_layout(fqn: str, value: Any) -> Hashable | None:
    """What an entry's write items are made of (DCP's `_create_write_items`): for a DTensor, its global shape, mesh,
    this rank's place in it, placements and local tensor's properties; for a plain tensor, its shape and properties;
    for any other object, its name alone (one item of pickled bytes). None for a value that makes its own items."""
    if isinstance(value, DTensor):
        local = value._local_tensor  # what `to_local()` returns without grad, with no autograd node made
        if hasattr(local, "__create_write_items__"):
            return None
        # DCP takes the properties of `to_local()` in the caller's grad mode: with grad, a view requiring what the
        # DTensor requires
        requires_grad = value.requires_grad if torch.is_grad_enabled() else local.requires_grad
        return (
            fqn,
            value.device_mesh,  # equal to another round's mesh of the same ranks, with this rank elsewhere in it
            value.device_mesh.get_coordinate(),
            tuple(value.placements),
            value.shape,
            local.dtype,
            local.layout,
            requires_grad,
            local.is_pinned(),
        )
    if type(value) in (torch.Tensor, torch.nn.Parameter):
        return fqn, value.shape, value.dtype, value.layout, value.requires_grad, value.is_pinned()
    if isinstance(value, torch.Tensor) or hasattr(value, "__create_write_items__"):
        return None  # a tensor subclass, a ShardedTensor
    return fqn, OBJECT


OBJECT = "object"  # the layout of an entry DCP pickles


def local_plan(state_dict: dict[str, Any], is_coordinator: bool, known: EntryItems | None = None) -> RecordingPlanner:
    """A planner set up for ``state_dict`` with this rank's local plan made, as DCP's save makes it, from the write
    items ``known`` (by default, this process's last plan's) where an entry's layout is the same."""
    planner = RecordingPlanner(known)
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


def plan_of_saved(planner: RecordingPlanner, saved: Metadata, rank: int) -> SnapshotPlan | None:
    """The plan the snapshot ``saved`` describes was written with, for this rank's state as ``planner`` planned it
    locally: the items of this rank's plan that ``saved`` stores in this rank's file (DCP's global plan gave each
    replicated item to one rank), with the index hints ``saved`` has. None where this rank's state does not have
    the layout ``saved`` describes: an item ``saved`` lacks or describes otherwise (shape, dtype, shard), or one of
    this rank's file that this rank would not write. The caller makes sure ``saved`` was saved at this world size,
    by these files, and that every rank found its plan: every item of ``saved`` is then written by one rank."""
    local = planner.local
    assert local is not None, "the planner made its local plan"
    stored = {index: index for index in saved.storage_data}  # a MetadataIndex equals and hashes without its hint
    own = data_file(rank)
    mine: list[WriteItem] = []
    for item in local.items:
        index = stored.get(item.index)
        if index is None or not _described(item, index, saved):
            return None
        if saved.storage_data[index].relative_path == own:
            mine.append(dataclasses.replace(item, index=index))
    in_own_file = {index for index, info in saved.storage_data.items() if info.relative_path == own}
    if {item.index for item in mine} != in_own_file:
        return None
    mappings = local.planner_data or {}
    if any((saved.planner_data or {}).get(key) != path for key, path in mappings.items()):
        return None
    return SnapshotPlan(local, dataclasses.replace(local, items=mine, storage_data=storage_of(rank)), saved)


def _described(item: WriteItem, index: MetadataIndex, saved: Metadata) -> bool:
    """Whether ``saved`` describes the entry of ``item`` as ``item`` does: an object, or a tensor of its size and
    properties with ``item``'s chunk at ``index``'s place among its chunks."""
    entry = saved.state_dict_metadata.get(item.index.fqn)
    if item.type == WriteItemType.BYTE_IO:
        return isinstance(entry, BytesStorageMetadata)
    data = item.tensor_data
    return (
        isinstance(entry, TensorStorageMetadata)
        and data is not None
        and entry.properties == data.properties
        and entry.size == data.size
        and index.index is not None
        and index.index < len(entry.chunks)
        and entry.chunks[index.index] == data.chunk
    )
