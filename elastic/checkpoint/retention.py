"""Retention: keep the newest committed checkpoints, drop older ones and leftovers of crashed saves."""

from __future__ import annotations

import logging
import os
import shutil
from pathlib import Path

from elastic.checkpoint.layout import scan

logger = logging.getLogger(__name__)


def prune(directory: str | os.PathLike, keep: int) -> list[Path]:
    """Delete all but the newest ``keep`` committed checkpoints, and torn folders older than the newest
    committed one; returns what was deleted. Torn folders newer than it may be a save in flight and stay.
    """
    if keep < 1:
        raise ValueError(f"keep must be at least 1 (the newest committed checkpoint is never deleted), got {keep}")
    entries = scan(directory)
    committed = [entry for entry in entries if entry.committed]
    if not committed:
        return []
    newest = committed[-1].step
    doomed = committed[:-keep] + [entry for entry in entries if not entry.committed and entry.step < newest]
    for entry in doomed:
        shutil.rmtree(entry.path)
        logger.info("deleted %s checkpoint %s", "committed" if entry.committed else "torn", entry.path)
    return [entry.path for entry in doomed]
