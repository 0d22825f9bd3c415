"""Retention: keep the newest readable committed checkpoints; clear away what no save will ever finish.

- The newest ``keep`` committed checkpoints that are readable stay. An unreadable one among them is
  set aside (``step-<N>.unreadable-<time>``, never deleted, never counted), so a damaged newest
  checkpoint does not push readable ones out. Older committed checkpoints are deleted.
- A stale round's commit (fenced) is set aside: it is a whole save, but one that does not count.
- Torn ``step-<N>`` folders older than the newest committed one are deleted: no save writes into a
  ``step-<N>`` folder itself, so nothing can still be writing them. Newer ones stay (an older
  version of this library may be saving into one). Foreign ones (whole checkpoints another tool wrote)
  are never touched: they count once adopted.
- Attempt folders of epochs older than the directory's current one are deleted: their manager has
  lost the directory, so they can never be committed; a writer still writing them writes into the
  renamed tree (aside.py).

Everything deleted is renamed first; nothing is deleted when no readable committed checkpoint is found.
"""

from __future__ import annotations

import logging
import os
from pathlib import Path

from elastic.checkpoint.aside import FENCED, UNREADABLE, dispose, is_being_deleted, remove, set_aside
from elastic.checkpoint.errors import CheckpointError
from elastic.checkpoint.fence import read_fence
from elastic.checkpoint.integrity import verify_readable
from elastic.checkpoint.layout import CheckpointEntry, EntryState, attempts, scan

logger = logging.getLogger(__name__)


def prune(directory: str | os.PathLike, keep: int, verified: set[str] | None = None) -> list[Path]:
    """Apply the rules above to ``directory``; returns the paths deleted (their names before deletion).

    ``verified`` holds the keys of checkpoints known to be readable (checked at commit or load), which
    are not checked again; the keys of those checked here are added to it.
    """
    if keep < 1:
        raise ValueError(f"keep must be at least 1 (the newest committed checkpoint is never deleted), got {keep}")
    verified = set() if verified is None else verified
    entries = scan(directory)
    for entry in entries:
        if entry.fenced:
            logger.warning("set aside %s as %s: %s", entry.path, set_aside(entry.path, FENCED), entry.problem)
    kept, unreadable, doomed = _split_committed([entry for entry in entries if entry.committed], keep, verified)
    if not kept:
        if unreadable:
            logger.warning("no committed checkpoint in %s is readable; deleting nothing", directory)
        return []
    for entry, problem in unreadable:
        logger.warning(
            "set aside unreadable checkpoint %s as %s: %s", entry.path, set_aside(entry.path, UNREADABLE), problem
        )
    newest = kept[0].step
    doomed += [entry for entry in entries if entry.state is EntryState.TORN and entry.step < newest]
    deleted = [entry.path for entry in doomed]
    for entry in doomed:
        dispose(entry.path)
        logger.info("deleted %s checkpoint %s", entry.state.value, entry.path)
    deleted += _drop_abandoned_attempts(Path(directory))
    return deleted


def _split_committed(
    committed: list[CheckpointEntry], keep: int, verified: set[str]
) -> tuple[list[CheckpointEntry], list[tuple[CheckpointEntry, str]], list[CheckpointEntry]]:
    """(kept, unreadable with why, to delete), going from the newest committed checkpoint back."""
    kept: list[CheckpointEntry] = []
    unreadable: list[tuple[CheckpointEntry, str]] = []
    doomed: list[CheckpointEntry] = []
    for entry in reversed(committed):
        if len(kept) == keep:
            doomed.append(entry)
            continue
        if entry.key not in verified:
            assert entry.record is not None  # only committed entries are passed in, and they have a commit record
            try:
                verify_readable(entry.path, entry.record.metadata_sha256)
            except (CheckpointError, OSError) as error:
                unreadable.append((entry, str(error)))
                continue
            verified.add(entry.key)
        kept.append(entry)
    return kept, unreadable, doomed


def _drop_abandoned_attempts(directory: Path) -> list[Path]:
    fence = read_fence(directory)
    deleted = []
    for path, name in attempts(directory):
        if fence is not None and name.epoch < fence.epoch:
            dispose(path)
            logger.info("deleted %s, an attempt of epoch %d that can no longer commit", path, name.epoch)
            deleted.append(path)
    for leftover in directory.iterdir():
        if is_being_deleted(leftover.name):  # a deletion interrupted by a crash
            remove(leftover)
    return deleted
