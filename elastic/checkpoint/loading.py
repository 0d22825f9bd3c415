"""Loading the newest checkpoint every rank can read, and setting aside committed ones that turned out damaged."""

from __future__ import annotations

import functools
import logging
from pathlib import Path
from typing import Any, NamedTuple

import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint import FileSystemReader
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner
from torch.distributed.checkpoint.stateful import Stateful

from elastic.checkpoint.aside import UNREADABLE, set_aside
from elastic.checkpoint.errors import CheckpointError, UnreadableDataError
from elastic.checkpoint.foreign_state import REGENERATE_METHOD, split_entries, summarize_keys
from elastic.checkpoint.integrity import verify_readable
from elastic.checkpoint.layout import CheckpointEntry, scan
from elastic.checkpoint.ranks import Ranks
from elastic.checkpoint.reader import CheckpointReader

logger = logging.getLogger(__name__)


class Loaded(NamedTuple):
    entry: CheckpointEntry | None  # None when nothing is committed
    listed: set[str]  # keys of the committed checkpoints the listing found


def state_dicts(state: dict[str, Any]) -> dict[str, Any]:
    """Each entry's state dict; entries that are not Stateful are plain state already."""
    return {name: value.state_dict() if isinstance(value, Stateful) else value for name, value in state.items()}


def load_newest(ranks: Ranks, directory: Path, state: dict[str, Any]) -> Loaded:
    """Load the newest committed checkpoint of ``directory`` that every rank can read into ``state``, in place.

    A checkpoint that no rank can read, or whose data fails to decode, is skipped, and set aside once
    an older one loaded: it then neither blocks saving its step again nor counts for retention. While
    nothing older loads nothing is moved, so a failed start leaves the directory as it was. One that
    only some ranks cannot read is skipped but left in place: the storage, not it, is at fault.
    """
    entries = ranks.agree(lambda: scan(directory), f"listing {directory}", only_rank0=True)
    if ranks.rank == 0:
        for entry in entries:
            if not entry.committed:
                logger.warning("skipping %s checkpoint %s: %s", entry.state, entry.path, entry.problem)
    committed = [entry for entry in entries if entry.committed]
    listed = {entry.key for entry in committed}
    damaged: list[tuple[CheckpointEntry, str]] = []
    for entry in reversed(committed):
        assert entry.record is not None  # a committed entry has a commit record
        problems = ranks.problems(functools.partial(verify_readable, entry.path, entry.record.metadata_sha256))
        failed = [(rank, problem) for rank, problem in enumerate(problems) if problem is not None]
        if failed and len(failed) < len(problems):
            if ranks.rank == 0:
                rank, problem = failed[0]
                logger.warning(
                    "skipping checkpoint %s: %d of %d ranks cannot read it (rank %d: %s)",
                    entry.path,
                    len(failed),
                    len(problems),
                    rank,
                    problem,
                )
            continue
        damage = failed[0][1] if failed else _try_load(ranks, entry, state)
        if damage is None:
            _set_aside_damaged(ranks, damaged)
            return Loaded(entry, listed)
        if ranks.rank == 0:
            logger.warning("checkpoint %s cannot be read: %s", entry.path, damage)
        damaged.append((entry, damage))
    if committed:
        raise CheckpointError(
            f"none of the {len(committed)} committed checkpoints in {directory} can be read on every rank "
            "(see the warnings above); fix the storage, or move them away to start from scratch"
        )
    return Loaded(None, listed)


def _try_load(ranks: Ranks, entry: CheckpointEntry, state: dict[str, Any]) -> str | None:
    """Load ``entry``; None when it loaded, why not when its data is damaged. Other failures are raised."""
    try:
        load_folder(ranks, entry.path, entry.step, state)
    except CheckpointException as error:  # DCP raises it on every rank, with every rank's failure
        for _, (failure, _) in sorted(error.failures.items()):
            if isinstance(failure, UnreadableDataError):
                return str(failure)
        raise
    return None


def load_folder(
    ranks: Ranks, folder: Path, step: int, state: dict[str, Any], reader: type[CheckpointReader] = CheckpointReader
) -> None:
    """Load the DCP checkpoint of ``step`` in ``folder`` (a committed step-<N>, or a snapshot in memory, read
    with its own ``reader``) into ``state``, in place, at this world size; entries saved in a foreign layout are
    regenerated from ``step``."""
    dicts = state_dicts(state)
    metadata = FileSystemReader(folder).read_metadata()
    to_regenerate = split_entries(state, dicts, metadata.state_dict_metadata, folder)
    loadable = {name: value for name, value in dicts.items() if name not in to_regenerate}
    dcp.load(
        loadable,
        storage_reader=reader(folder),
        planner=DefaultLoadPlanner(),
        process_group=ranks.group,
        no_dist=ranks.group is None,
    )
    for name, loaded in loadable.items():
        if isinstance(state[name], Stateful):
            state[name].load_state_dict(loaded)
        else:
            state[name] = loaded
    for name, foreign_keys in to_regenerate.items():
        getattr(state[name], REGENERATE_METHOD)(step)
        if ranks.rank == 0:
            logger.warning(
                "%s holds %s for state entry %r, not its keys; regenerated %r from global step %d",
                folder,
                summarize_keys(foreign_keys) or "nothing",
                name,
                name,
                step,
            )


def _set_aside_damaged(ranks: Ranks, damaged: list[tuple[CheckpointEntry, str]]) -> None:
    if ranks.rank != 0:
        return
    for entry, damage in damaged:
        try:
            moved = set_aside(entry.path, UNREADABLE)
        except OSError as error:
            logger.warning("could not set aside unreadable checkpoint %s: %s", entry.path, error)
            continue
        logger.warning(
            "set aside unreadable checkpoint %s as %s (%s); step %d can be saved again",
            entry.path,
            moved,
            damage,
            entry.step,
        )
