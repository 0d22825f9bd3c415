"""Loading the newest checkpoint every rank can read, and setting aside committed ones that turned out damaged."""

from __future__ import annotations

import functools
import logging
import traceback
import warnings
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import Any, NamedTuple

import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.metadata import Metadata
from torch.distributed.checkpoint.stateful import Stateful

from elastic.checkpoint.aside import UNREADABLE, set_aside
from elastic.checkpoint.entry_rules import (
    REGENERATE_METHOD,
    Load,
    RankView,
    Refuse,
    Regenerate,
    SavedEntry,
    decide,
    is_world_size_key,
    rank_view,
    world_sizes,
)
from elastic.checkpoint.errors import CheckpointError, UnreadableDataError
from elastic.checkpoint.integrity import verify_readable
from elastic.checkpoint.layout import CheckpointEntry, saved_world_size, scan
from elastic.checkpoint.load_plans import MadeLoadPlan, ReusingLoadPlanner
from elastic.checkpoint.ranks import Ranks
from elastic.checkpoint.reader import CheckpointReader
from elastic.checkpoint.torch_internals import flat_keys

logger = logging.getLogger(__name__)


class Loaded(NamedTuple):
    entry: CheckpointEntry | None  # None when nothing could be loaded
    listed: set[str]  # keys of the committed checkpoints the listing found


def state_dicts(state: dict[str, Any]) -> dict[str, Any]:
    """Each entry's state dict; entries that are not Stateful are plain state already."""
    return {name: value.state_dict() if isinstance(value, Stateful) else value for name, value in state.items()}


def load_newest(
    ranks: Ranks,
    directory: Path,
    state_at: Callable[[int], dict[str, Any]],
    foreign: bool = False,
    step: int | None = None,
) -> Loaded:
    """Load the newest committed checkpoint of ``directory`` that every rank can read, in place, into the state
    ``state_at(step)`` gives for its step; with ``foreign``, whole checkpoints another tool wrote (no commit record)
    count too, and are read as they are. With ``step``, only that step's checkpoint is a candidate.

    A checkpoint that no rank can read, or whose data fails to decode, is skipped, and set aside once
    an older one loaded: it then neither blocks saving its step again nor counts for retention. While
    nothing older loads nothing is moved, so a failed start leaves the directory as it was. One that
    only some ranks cannot read is skipped but left in place: the storage, not it, is at fault.
    """
    entries = ranks.agree(lambda: scan(directory), f"listing {directory}", only_rank0=True)
    candidates = [entry for entry in entries if entry.committed or (foreign and entry.foreign)]
    if ranks.rank == 0:
        for entry in entries:
            if entry not in candidates:
                logger.warning("skipping %s checkpoint %s: %s", entry.state.value, entry.path, entry.problem)
    if step is not None:
        candidates = [entry for entry in candidates if entry.step == step]
        if not candidates:
            raise CheckpointError(
                f"{directory} holds no loadable checkpoint of step {step}; its steps: {_steps(entries)}"
            )
    listed = {entry.key for entry in entries if entry.committed}
    damaged: list[tuple[CheckpointEntry, str]] = []
    for entry in reversed(candidates):
        digest = entry.record.metadata_sha256 if entry.record is not None else None
        problems = ranks.problems(functools.partial(verify_readable, entry.path, digest))
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
        damage = failed[0][1] if failed else _try_load(ranks, entry, state_at(entry.step))
        if damage is None:
            _set_aside_damaged(ranks, damaged)
            return Loaded(entry, listed)
        if ranks.rank == 0:
            logger.warning("checkpoint %s cannot be read: %s", entry.path, damage)
        damaged.append((entry, damage))
    if candidates:
        kind = "committed or foreign" if foreign else "committed"
        raise CheckpointError(
            f"none of the {len(candidates)} {kind} checkpoints in {directory} can be read on every rank "
            "(see the warnings above); fix the storage, or move them away to start from scratch"
        )
    return Loaded(None, listed)


def _steps(entries: list[CheckpointEntry]) -> str:
    return ", ".join(f"{entry.step} ({entry.state.value})" for entry in entries) or "none"


def _try_load(ranks: Ranks, entry: CheckpointEntry, state: dict[str, Any]) -> str | None:
    """Load ``entry``; None when it loaded, why not when its data is damaged. Other failures are raised."""
    try:
        load_folder(ranks, entry.path, entry.step, state, saved_world_size(entry))
    except CheckpointException as error:  # DCP raises it on every rank, with every rank's failure
        for _, (failure, _) in sorted(error.failures.items()):
            if isinstance(failure, UnreadableDataError):
                return str(failure)
        raise
    return None


def load_folder(
    ranks: Ranks,
    folder: Path,
    step: int,
    state: dict[str, Any],
    saved_world_size: int | None,
    reader: Callable[[Path], CheckpointReader] = CheckpointReader,
    prepare: Callable[[], object] | None = None,
    dicts: dict[str, Any] | None = None,
    load_plan: MadeLoadPlan | None = None,
) -> Metadata:
    """Load the DCP checkpoint of ``step`` in ``folder`` (a committed step-<N>, or a snapshot in memory, read
    with its own ``reader``) into ``state``, in place, at this world size. Whether each entry is loaded or
    regenerated from ``step`` is decided alike on every rank (entry_rules.py) from every rank's view of it and
    the world size the checkpoint was saved at (``saved_world_size``, None when unknown); an entry the
    checkpoint cannot serve raises CheckpointError on every rank, before any rank loads. ``prepare`` runs first
    on every rank (a snapshot's files gathered into ``folder``); a failure there or in reading the metadata
    raises RankFailure on every rank. One collective before DCP's load: at a change of round each costs every
    rank a wait for the slowest (about 13 ms at 6 ranks on 2 cores). ``dicts``: ``state_dicts(state)``, where the
    caller has them already; ``load_plan``: this rank's local plan for them, where the caller made it already.
    Returns the checkpoint's metadata."""
    if dicts is None:
        dicts = state_dicts(state)
    saved_keys: dict[str, list[str]] = {}
    storage = reader(folder)

    def look() -> tuple[dict[str, RankView], dict[str, tuple[tuple[str, int], ...]]]:
        """This rank's view of each entry; on rank 0, the world sizes the checkpoint recorded too."""
        if prepare is not None:
            prepare()
        saved_keys.update(_keys_by_entry(storage.read_metadata().state_dict_metadata, dicts))
        recorded = {}
        if ranks.rank == 0 and any(is_world_size_key(key) for keys in saved_keys.values() for key in keys):
            recorded = _recorded_world_sizes(storage, saved_keys)
        views = {name: _view(state[name], name, value, saved_keys[name]) for name, value in dicts.items()}
        return views, recorded

    looks = ranks.each(look, f"loading {folder}")
    views = [rank_views for rank_views, _ in looks]
    recorded = looks[0][1]
    decisions = {
        name: decide(
            name,
            SavedEntry(tuple(saved_keys[name]), recorded.get(name, ())),
            [rank_views[name] for rank_views in views],
            saved_world_size,
            ranks.world_size,
        )
        for name in dicts
    }
    refusals = [decision.message for decision in decisions.values() if isinstance(decision, Refuse)]
    if refusals:
        more = f" (and {len(refusals) - 1} more state entries it cannot serve)" if len(refusals) > 1 else ""
        raise CheckpointError(f"{folder} {refusals[0]}{more}")
    loadable = {name: dicts[name] for name, decision in decisions.items() if isinstance(decision, Load)}
    _load_each_rank_alone(ranks, loadable, storage, load_plan)
    for name, loaded in loadable.items():
        if isinstance(state[name], Stateful):
            state[name].load_state_dict(loaded)
        else:
            state[name] = loaded
    for name, decision in decisions.items():
        if isinstance(decision, Regenerate):
            getattr(state[name], REGENERATE_METHOD)(step)
            if ranks.rank == 0:
                logger.warning("%s %s; regenerated %r from global step %d", folder, decision.reason, name, step)
    return storage.read_metadata()


def _load_each_rank_alone(
    ranks: Ranks, state_dict: dict[str, Any], storage: CheckpointReader, load_plan: MadeLoadPlan | None
) -> None:
    """``dcp.load`` with every rank planning its own reads, then one gather of the ranks' failures, raised on every
    rank as the CheckpointException DCP raises. A load plan needs no coordination (DCP's global load plan is the
    ranks' own plans), and DCP's collectives around it (the plans gathered and scattered, then the reads'
    outcomes gathered) cost more than the reads of a snapshot in memory: at 6 ranks on 2 cores, DCP's load took
    49-57 ms (21 ms of CPU per rank) with them and 18 ms (8 ms) alone, in every change of round. Every rank reads
    the metadata, as DCP's ranks do: `storage` has it already, from deciding what to load."""
    failure: tuple[BaseException, traceback.StackSummary] | None = None
    try:
        with warnings.catch_warnings():  # it says torch.distributed is off, which is not so: it is not used
            warnings.filterwarnings("ignore", "torch.distributed is disabled", UserWarning)
            dcp.load(state_dict, storage_reader=storage, planner=ReusingLoadPlanner(load_plan), no_dist=True)
    except CheckpointException as error:  # alone, DCP raises this rank's failure as rank 0's
        failure = next(iter(error.failures.values()))
    except Exception as error:
        failure = (error, traceback.extract_tb(error.__traceback__))
    failures = {rank: failed for rank, failed in enumerate(ranks.gather(failure)) if failed is not None}
    if failures:
        raise CheckpointException("load", failures)


def _keys_by_entry(saved: Iterable[str], entries: Iterable[str]) -> dict[str, list[str]]:
    """The checkpoint's flat keys under each entry name (the name itself, or the name and a dot before more)."""
    names = set(entries)
    by_entry: dict[str, list[str]] = {name: [] for name in names}
    for key in saved:
        parts = key.split(".")
        prefixes = (".".join(parts[:end]) for end in range(1, len(parts) + 1))
        owner = next((prefix for prefix in prefixes if prefix in names), None)
        if owner is not None:
            by_entry[owner].append(key)
    return by_entry


def _view(entry: Any, name: str, entry_state: Any, saved: list[str]) -> RankView:
    flat = flat_keys({name: entry_state})
    regenerable = callable(getattr(entry, REGENERATE_METHOD, None))
    return rank_view(flat.keys(), saved, type(entry).__name__, regenerable, world_sizes(flat))


def _recorded_world_sizes(
    storage: CheckpointReader, saved_keys: dict[str, list[str]]
) -> dict[str, tuple[tuple[str, int], ...]]:
    """The world sizes each entry recorded in the checkpoint, read on this rank alone (they are small values)."""
    wanted: dict[str, Any] = {key: None for keys in saved_keys.values() for key in keys if is_world_size_key(key)}
    dcp.load(wanted, storage_reader=storage, no_dist=True)
    return {
        name: recorded
        for name, keys in saved_keys.items()
        if (recorded := world_sizes({key: wanted[key] for key in keys if key in wanted}))
    }


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
