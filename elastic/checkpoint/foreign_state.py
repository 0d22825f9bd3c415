"""Decides, per top-level state entry, whether a checkpoint loads it, regenerates it, or cannot serve it.

A checkpoint may hold an entry in another layout, e.g. torchtitan's per-rank ``dataloader.dp_rank_<i>``
keys, which no longer fit after a resize. An object that can rebuild itself from the global step
(``regenerate_state(step)``) is then regenerated instead of loaded.
"""

from __future__ import annotations

import re
from collections import defaultdict
from collections.abc import Iterable
from pathlib import Path
from typing import Any

from elastic.checkpoint.layout import CheckpointError
from elastic.checkpoint.torch_internals import flat_keys

REGENERATE_METHOD = "regenerate_state"
_LAST_NUMBER = re.compile(r"(\d+)(?!.*\d)")


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


def split_entries(
    state: dict[str, Any], state_dicts: dict[str, Any], checkpoint_keys: Iterable[str], folder: Path
) -> dict[str, list[str]]:
    """The entries to regenerate, each with the checkpoint's keys for it; raises CheckpointError for an
    entry the checkpoint cannot serve. ``state_dicts`` holds each entry's state dict (the entry itself
    when it is not Stateful)."""
    available = set(checkpoint_keys)
    to_regenerate: dict[str, list[str]] = {}
    for name, entry_state in state_dicts.items():
        wanted = set(flat_keys({name: entry_state}))
        missing = wanted - available
        if not missing:
            continue
        if missing != wanted:
            raise CheckpointError(
                f"{folder} lacks {len(missing)} of the {len(wanted)} keys of state entry {name!r}: "
                f"{summarize_keys(missing)}; the model or optimizer differs from the one that was saved"
            )
        theirs = sorted(key for key in available if key == name or key.startswith(name + "."))
        if not callable(getattr(state[name], REGENERATE_METHOD, None)):
            found = f"holds {summarize_keys(theirs)} for it instead" if theirs else "holds nothing for it"
            raise CheckpointError(
                f"{folder} has none of the keys of state entry {name!r} ({summarize_keys(wanted)}) and "
                f"{found}; give that object a {REGENERATE_METHOD}(step) method or drop it from the state"
            )
        to_regenerate[name] = theirs
    return to_regenerate
