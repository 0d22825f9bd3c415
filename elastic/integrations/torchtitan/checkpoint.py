"""Loading torchtitan's checkpoints at any world size, and the one hook that puts that load into its trainer.

torchtitan (0.3.0) saves ``<dump_folder>/<checkpoint.folder>/step-<N>`` with DCP, with no commit record of
ours (so they are foreign here, layout.py):

- the model's keys at the top level, as its ``ModelWrapper`` flattens them, state-dict hooks applied (the fused
  QKV projection ``wqkv`` is saved as ``wq``, ``wk``, ``wv``);
- ``optimizer.*``, as its ``OptimizersContainer`` flattens them, keyed by parameter name;
- ``lr_scheduler`` (``last_epoch``) and ``train_state`` (``step``, ``ntokens_seen``): global values;
- ``dataloader`` as ``{"dp_rank_<r>": <that rank's position>, "world_size": <data-parallel degree>}``.

torchtitan's own load at another data-parallel degree dies on the new ranks' missing ``dataloader.dp_rank_<r>``
(pytorch/torchtitan#811). ``load`` reads the same folders through this library: the model and optimizer are
resharded by DCP, the global entries are loaded, and the dataloader is loaded exactly at the same degree or
regenerated from the step on every rank at another one (entry_rules.py). Regenerating takes a dataloader whose
position is a function of the step, such as ``ElasticDataLoader``; torchtitan's own keeps a position per rank
in its shard of a stream, which no other degree can take over, so at another degree it is refused, on every
rank alike, before anything loads.
"""

from __future__ import annotations

import os
from collections.abc import Collection, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch.distributed as dist
import torch.nn as nn
from torch.distributed.checkpoint.stateful import Stateful
from torchtitan.components.checkpoint import (
    DATALOADER,
    LR_SCHEDULER,
    MODEL,
    OPTIMIZER,
    CheckpointManager,
    ModelWrapper,
)
from torchtitan.tools import filesystem

from elastic.checkpoint.errors import CheckpointError
from elastic.checkpoint.loading import load_newest
from elastic.checkpoint.ranks import Ranks
from elastic.shard_local_ops import take_over_step_ops

_TRAINER_ENTRIES = (MODEL, OPTIMIZER, LR_SCHEDULER, DATALOADER)


class LRSchedulerState(Stateful):
    """torchtitan's LRSchedulersContainer, rebuilt from the global step when a checkpoint lacks its state."""

    def __init__(self, lr_schedulers: Stateful) -> None:
        self.lr_schedulers = lr_schedulers

    def state_dict(self) -> dict[str, Any]:
        return self.lr_schedulers.state_dict()

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self.lr_schedulers.load_state_dict(state_dict)

    def regenerate_state(self, step: int) -> None:
        # torchtitan's schedules are functions of (last_epoch, base lr): the step is their whole state
        self.lr_schedulers.load_state_dict({"last_epoch": step})


def load(
    checkpoint_dir: str | os.PathLike,
    model_parts: nn.Module | list[nn.Module] | ModelWrapper,
    optimizers: Stateful | None,
    lr_schedulers: Stateful | None,
    dataloader: Stateful | None,
    step: int | None = None,
    *,
    states: Mapping[str, Any] | None = None,
    exclude: Collection[str] = (),
    process_group: dist.ProcessGroup | None = None,
) -> int | None:
    """Load torchtitan's checkpoint of ``step`` (default: the newest whole one) from ``checkpoint_dir`` (the
    folder of its ``step-<N>`` folders) at this world size; returns its step, or None when there is none.

    ``model_parts`` are torchtitan's model parts (or its ModelWrapper), ``optimizers`` its OptimizersContainer,
    ``lr_schedulers`` its LRSchedulersContainer, ``dataloader`` its dataloader; ``states`` holds the other
    entries (torchtitan's ``{"train_state": trainer}``); ``exclude`` names entries not to load (torchtitan's
    ``checkpoint.exclude_from_loading``). As torchtitan does, step 0 (its seed checkpoint) loads the model only.
    A collective: call it on every rank. Committed checkpoints of this library load too.
    """
    wrapper = model_parts if isinstance(model_parts, ModelWrapper) else ModelWrapper(model_parts)
    others: dict[str, Any] = {
        OPTIMIZER: optimizers,
        LR_SCHEDULER: LRSchedulerState(lr_schedulers) if lr_schedulers is not None else None,
        DATALOADER: dataloader,
        **(states or {}),
    }
    loadable = {name: entry for name, entry in others.items() if entry is not None and name not in exclude}
    model_state: dict[str, Any] = {}

    def state_at(saved_step: int) -> dict[str, Any]:
        model_state.clear()
        model_state.update(wrapper.state_dict())
        return {**model_state, **(loadable if saved_step else {})}

    ranks = Ranks.dedicated(process_group)
    try:
        loaded = load_newest(ranks, Path(checkpoint_dir), state_at, foreign=True, step=step)
    finally:
        if process_group is None and ranks.group is not None:
            dist.destroy_process_group(ranks.group)
    if loaded.entry is None:
        return None
    # DCP loaded into the model state's tensors in place; those its hooks made (the split QKV) go back through them
    wrapper.load_state_dict(model_state)
    return loaded.entry.step


class ElasticCheckpointManager(CheckpointManager):
    """torchtitan's CheckpointManager, resuming at any world size through ``load``: the one hook into its trainer.

    Select it in the job's config, ``checkpoint=ElasticCheckpointManager.Config(...)`` (same fields as
    torchtitan's). Saving, retention, and the initial load when there is nothing to resume (a seed checkpoint,
    Hugging Face weights) stay torchtitan's; resuming from a checkpoint of its folder goes through ``load``.

    Built, it has the trainer's fused optimizer steps and gradient clipping run on the local shards wherever DTensor
    would run them there (`elastic.shard_local_ops`): a restarted trainer's first clipping otherwise spends a
    second in DTensor's sharding propagation (300 parameters, 2 ranks, 2 cores).
    """

    @dataclass(kw_only=True, slots=True)
    class Config(CheckpointManager.Config):
        """torchtitan's checkpoint settings, unchanged."""

    def __init__(self, config: Config, **components: Any) -> None:
        super().__init__(config, **components)
        if self.enable and filesystem.is_remote(self.folder):
            raise ValueError(
                f"ElasticCheckpointManager reads checkpoints from a local or mounted file system, and {self.folder} "
                "is remote; mount it, or use torchtitan's CheckpointManager (which cannot resume at another size)"
            )
        take_over_step_ops()

    def _load(self, step: int = -1) -> bool:
        loaded = load(
            self.folder,
            self.states[MODEL],
            self.states[OPTIMIZER],
            self.states[LR_SCHEDULER],
            self.states[DATALOADER],
            None if step == -1 else step,
            states={name: entry for name, entry in self.states.items() if name not in _TRAINER_ENTRIES},
            exclude=self.exclude_from_loading,
        )
        if loaded is not None:
            return True
        if self._find_load_step() != -1:  # torchtitan would load a folder that has DCP metadata but is not whole
            raise CheckpointError(
                f"{self.folder} holds no whole checkpoint, only torn ones (see the warnings above); "
                "move them away to start from scratch"
            )
        return super()._load(step)
