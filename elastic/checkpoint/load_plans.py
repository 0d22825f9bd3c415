"""A rank's local load plan, made once where a load needs it twice.

A snapshot's load from memory plans this rank's reads first to know which byte ranges of the files its node lacks
to gather (memory.py), and DCP's load then plans them again. Each plan computes every DTensor entry's shard offsets
(`compute_local_shape_and_global_offset`, 0.3-0.6 ms an entry on a loaded CPU): at 6 ranks on 2 cores, 40-45 ms
of CPU per rank at every change of round, for a tiny model. DCP's load takes the first plan where it would make the
same one: the same flat state, tensor for tensor, loaded from a checkpoint of exactly its keys (nothing missing,
nothing left over, so neither strictness nor DCP's guess at a pre-2.4 checkpoint comes into it).

A tensor entry's reads depend only on its layout (snapshot_plans.entry_layout) and on the chunks the checkpoint
holds of it, and an object's on its name, so a plan takes the read items of this process's last plan where those
are the same: a worker elastic.run re-entered after a crash loads the same layouts, from a snapshot chunked as the
last one it loaded.
"""

from __future__ import annotations

from collections.abc import Hashable
from dataclasses import dataclass
from typing import Any

import torch
from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner, create_default_local_load_plan
from torch.distributed.checkpoint.metadata import STORAGE_TYPES, BytesStorageMetadata, Metadata
from torch.distributed.checkpoint.planner import LoadPlan, ReadItem
from torch.distributed.tensor import DTensor

from elastic.checkpoint.snapshot_plans import OBJECT, entry_layout


@dataclass(frozen=True)
class MadeLoadPlan:
    """A local load plan and the flat state (DCP's flattening) it was made for."""

    plan: LoadPlan
    leaves: dict[str, Any]

    def serves(self, flat_state: dict[str, Any], metadata: Metadata) -> bool:
        """Whether DCP's planner, set up with ``flat_state`` and ``metadata``, would make this plan."""
        saved = metadata.state_dict_metadata
        return flat_state.keys() == self.leaves.keys() == saved.keys() and all(
            _plans_alike(flat_state[key], leaf) for key, leaf in self.leaves.items()
        )


def _plans_alike(leaf: Any, planned: Any) -> bool:
    """Whether DCP plans the same reads for ``leaf`` as for ``planned`` under one key of one checkpoint: the same
    tensor (its shape and shards make its reads), or two values with no size (flattening copies lists and tuples;
    a value is read whole, whatever it is)."""
    if _sized(leaf) or _sized(planned):
        return leaf is planned
    return True


def _sized(value: Any) -> bool:
    # DCP checks a value's size() against the checkpoint's, and plans a tensor's reads by its chunks
    return isinstance(value, torch.Tensor) or hasattr(value, "size")


# The read items of the last load plan this process made, by the entry's layout and saved chunks (`_read_layout`)
_last_read_items: dict[Hashable, list[ReadItem]] = {}


def make_load_plan(state_dict: dict[str, Any], metadata: Metadata) -> MadeLoadPlan:
    """This rank's local plan to load ``state_dict`` from the checkpoint of ``metadata``, as DCP's load makes it;
    entries the checkpoint lacks are left out."""
    planner = DefaultLoadPlanner(allow_partial_load=True)
    planner.set_up_planner(state_dict, metadata, is_coordinator=False)
    saved = metadata.state_dict_metadata
    if not saved.keys() <= planner.state_dict.keys():  # DCP may take it for a pre-2.4 checkpoint: it plans
        return MadeLoadPlan(planner.create_local_plan(), dict(planner.state_dict))
    global _last_read_items
    known, _last_read_items = _last_read_items, {}
    items: list[ReadItem] = []
    for fqn, value in planner.state_dict.items():
        if fqn not in saved:
            continue
        layout = _read_layout(fqn, value, saved[fqn])
        made = known.get(layout) if layout is not None else None
        if made is None:
            made = create_default_local_load_plan({fqn: value}, metadata, strict=False).items
        if layout is not None:
            _last_read_items[layout] = made
        items += made
    return MadeLoadPlan(LoadPlan(items), dict(planner.state_dict))


def _read_layout(fqn: str, value: Any, saved: STORAGE_TYPES) -> Hashable | None:
    """What an entry's read items are made of (DCP's `_create_read_items`): an object's, its name alone; a tensor's,
    its layout and the chunks the checkpoint holds of it (in their order, which their index hints follow). None
    for a value that makes its own chunks, and for a mismatch DCP's planner answers."""
    if isinstance(saved, BytesStorageMetadata):
        return None if isinstance(value, DTensor) else (fqn, OBJECT)
    layout = entry_layout(fqn, value) if isinstance(value, torch.Tensor) else None
    if layout is None:
        return None
    return layout, saved.size, tuple((tuple(chunk.offsets), tuple(chunk.sizes)) for chunk in saved.chunks)


class ReusingLoadPlanner(DefaultLoadPlanner):
    """DCP's default load planner, taking ``made`` for its local plan where that is the plan it would make."""

    def __init__(self, made: MadeLoadPlan | None) -> None:
        super().__init__()
        self._made = made

    def create_local_plan(self) -> LoadPlan:
        if self._made is not None and self.metadata is not None and self._made.serves(self.state_dict, self.metadata):
            return self._made.plan
        return super().create_local_plan()
