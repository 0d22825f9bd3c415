"""Whether a load takes each state entry from the checkpoint or regenerates it: one decision for the whole job.

A state entry is a top-level name of the state handed to a load. It is loaded as saved, regenerated from the
global step by its object's ``regenerate_state(step)``, or the load is refused. Every rank describes what its
own object asks of the checkpoint (a RankView); the views are gathered and every rank applies the same rules
to the same views, so all ranks do the same thing: none loads while another raises, and none loads a per-rank
value of the old world while another regenerates.

The rules, in order:

1. An entry whose saved layout depends on the world size, saved at another world size, is regenerated on every
   rank, or refused when some rank's object cannot regenerate. Its layout depends on the world size when it
   records one (a ``world_size``, ``dp_degree`` or ``dp_world_size`` value, as torchtitan's dataloader does),
   when the ranks' objects ask for different keys (``dp_rank_<r>``), or when every rank leaves some of its
   saved keys unread. The world size it was saved at is the one it recorded, else the checkpoint's (its commit
   record, a snapshot's record, or its data files); an unknown one counts as another.
2. An entry that every rank finds whole is loaded, each rank its own keys.
3. An entry of which no rank finds any key is in a foreign layout: regenerated, or refused when it cannot be.
4. Anything else is refused: some of its keys are there and some are not, so the model or optimizer differs
   from the one that was saved.

Nothing here does I/O or talks to other ranks: ``loading.py`` gathers the views and applies the decisions.
"""

from __future__ import annotations

import hashlib
import re
from collections import defaultdict
from collections.abc import Collection, Iterable, Mapping, Sequence
from dataclasses import dataclass

REGENERATE_METHOD = "regenerate_state"
WORLD_SIZE_NAMES = frozenset({"world_size", "dp_degree", "dp_world_size"})
NAMED_MISSING = 8  # missing keys a view carries by name, for messages
_LAST_NUMBER = re.compile(r"(\d+)(?!.*\d)")


@dataclass(frozen=True)
class RankView:
    """What one rank's object for one entry asks of the checkpoint."""

    layout: str  # digest of the keys it asks for: equal on every rank unless the entry is per rank
    wanted: int
    missing: int
    missing_named: tuple[str, ...]  # the first NAMED_MISSING missing keys, sorted
    unread: int  # the entry's saved keys it does not ask for
    kind: str  # the object's type, named when it cannot regenerate
    regenerable: bool
    world_sizes: tuple[tuple[str, int], ...]  # the world sizes it records (flat key, value)


@dataclass(frozen=True)
class SavedEntry:
    """What the checkpoint holds for one entry."""

    keys: tuple[str, ...]
    world_sizes: tuple[tuple[str, int], ...]  # the world sizes it recorded (flat key, value)


@dataclass(frozen=True)
class Load:
    """Load the entry as saved."""


@dataclass(frozen=True)
class Regenerate:
    """Rebuild the entry from the global step; ``reason`` says why, after the checkpoint's name, for the log."""

    reason: str


@dataclass(frozen=True)
class Refuse:
    """The checkpoint cannot serve the entry; ``message`` follows the checkpoint's name in the error."""

    message: str


Decision = Load | Regenerate | Refuse


def is_world_size_key(key: str) -> bool:
    return key.rsplit(".", 1)[-1] in WORLD_SIZE_NAMES


def world_sizes(flat: Mapping[str, object]) -> tuple[tuple[str, int], ...]:
    """The world sizes among a flat state dict's values: integers under a world-size name."""
    return tuple(
        sorted(
            (key, value)
            for key, value in flat.items()
            if is_world_size_key(key) and isinstance(value, int) and not isinstance(value, bool)
        )
    )


def rank_view(
    wanted: Collection[str],
    saved: Collection[str],
    kind: str,
    regenerable: bool,
    recorded: tuple[tuple[str, int], ...],
) -> RankView:
    """The view of one rank's object that asks for ``wanted`` keys of an entry the checkpoint holds ``saved`` for."""
    saved_set, wanted_set = set(saved), set(wanted)
    missing = sorted(wanted_set - saved_set)
    digest = hashlib.blake2b("\n".join(sorted(wanted_set)).encode(), digest_size=16).hexdigest()
    return RankView(
        layout=digest,
        wanted=len(wanted_set),
        missing=len(missing),
        missing_named=tuple(missing[:NAMED_MISSING]),
        unread=len(saved_set - wanted_set),
        kind=kind,
        regenerable=regenerable,
        world_sizes=recorded,
    )


def decide(
    name: str, saved: SavedEntry, views: Sequence[RankView], saved_world_size: int | None, world_size: int
) -> Decision:
    """Apply the rules above to entry ``name``; ``views`` holds every rank's view, in rank order."""
    resized = _resized_per_rank_state(saved, views, saved_world_size, world_size)
    if resized is not None:
        keys = summarize_keys(saved.keys) or "no keys"
        held = f"holds per-rank state for state entry {name!r} ({keys}), saved {resized}"
        return _regenerate_or_refuse(views, held, f"{held}, that does not fit this world")
    if not any(view.missing for view in views):
        return Load()
    if all(view.missing == view.wanted for view in views):
        found = f"holds {summarize_keys(saved.keys)} for it instead" if saved.keys else "holds nothing for it"
        return _regenerate_or_refuse(
            views,
            f"holds {summarize_keys(saved.keys) or 'nothing'} for state entry {name!r}, not its keys",
            f"has none of the keys of state entry {name!r} ({_named_missing(views[0])}) and {found}",
        )
    rank, view = next((rank, view) for rank, view in enumerate(views) if view.missing)
    where = "" if len(views) == 1 else f" on rank {rank}"
    return Refuse(
        f"lacks {view.missing} of the {view.wanted} keys of state entry {name!r}{where}: {_named_missing(view)}; "
        "the model or optimizer differs from the one that was saved"
    )


def _resized_per_rank_state(
    saved: SavedEntry, views: Sequence[RankView], saved_world_size: int | None, world_size: int
) -> str | None:
    """How the world changed since the save (``at world_size 2, now 4``), for an entry whose saved layout depends
    on it; None when it does not, or when the world is the one it was saved in."""
    if saved.world_sizes:
        current = dict(views[0].world_sizes)
        for key, value in saved.world_sizes:
            now = current.get(key, world_size)
            if value != now:
                return f"at {key.rsplit('.', 1)[-1]} {value}, now {now}"
        return None
    per_rank = (
        any(view.world_sizes for view in views)
        or len({view.layout for view in views}) > 1
        or all(view.unread for view in views)
    )
    if not per_rank or saved_world_size == world_size:
        return None
    saved_by = "an unknown number of" if saved_world_size is None else str(saved_world_size)
    return f"by {saved_by} ranks, now {world_size}"


def _regenerate_or_refuse(views: Sequence[RankView], reason: str, problem: str) -> Decision:
    unable = [rank for rank, view in enumerate(views) if not view.regenerable]
    if not unable:
        return Regenerate(reason)
    where = "" if len(views) == 1 else f" (not on rank{'s' if len(unable) > 1 else ''} {_ranks(unable)})"
    kind = views[unable[0]].kind
    return Refuse(
        f"{problem}; give that object ({kind}) a {REGENERATE_METHOD}(step) method{where} or drop it from the state"
    )


def _named_missing(view: RankView) -> str:
    more = view.missing - len(view.missing_named)
    return summarize_keys(view.missing_named) + (f" and {more} more" if more > 0 else "")


def _ranks(ranks: list[int], limit: int = 8) -> str:
    shown = ", ".join(map(str, ranks[:limit]))
    return shown + (f" and {len(ranks) - limit} more" if len(ranks) > limit else "")


def summarize_keys(keys: Iterable[str], limit: int = 6) -> str:
    """``a.dp_rank_{0..7}, b`` for many keys differing in one number, so messages stay one line."""
    groups: dict[str, list[int]] = defaultdict(list)
    for key in keys:
        match = _LAST_NUMBER.search(key)
        if match is None:
            groups[key] = []
        else:
            groups[key[: match.start()] + "{}" + key[match.end() :]].append(int(match.group(1)))
    parts = []
    for pattern, numbers in sorted(groups.items()):
        numbers = sorted(numbers)
        if not numbers:
            parts.append(pattern)
        elif len(numbers) == 1:
            parts.append(pattern.replace("{}", str(numbers[0])))
        elif numbers == list(range(numbers[0], numbers[-1] + 1)):
            parts.append(pattern.replace("{}", f"{{{numbers[0]}..{numbers[-1]}}}"))
        else:
            parts.append(pattern.replace("{}", "{" + ",".join(map(str, numbers)) + "}"))
    shown = ", ".join(parts[:limit])
    return shown + (f" and {len(parts) - limit} more" if len(parts) > limit else "")
