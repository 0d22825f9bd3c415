"""Adopting whole DCP checkpoints another tool wrote (torchtitan, plain ``dcp.save``): a commit record makes one count.

Such a ``step-<N>`` folder is foreign (layout.py) while it has DCP's ``.metadata`` and every data file that
metadata names, whole, but no ``commit.json``. Adopting it checks that again and writes the commit record, with
the number of ranks that wrote it read from its data files' names; from then on it loads, and counts for
retention, like a checkpoint this library saved.
"""

from __future__ import annotations

import logging
import os
from pathlib import Path

from elastic.checkpoint.errors import CheckpointError
from elastic.checkpoint.fence import read_fence
from elastic.checkpoint.layout import CommitRecord, EntryState, read_entry, saved_world_size, scan, write_commit_record

logger = logging.getLogger(__name__)


def adopt(folder: str | os.PathLike) -> CommitRecord:
    """Commit the foreign checkpoint ``folder`` (a ``step-<N>``) in place; raises CheckpointError for any other."""
    path = Path(folder)
    if not path.is_dir():
        raise CheckpointError(f"{path} is not a folder; pass a step-<N> folder holding a DCP checkpoint")
    entry = read_entry(path, read_fence(path.parent))
    if entry.state is not EntryState.FOREIGN:
        reason = f"it is {entry.state.value} already" if entry.committed else entry.problem
        raise CheckpointError(f"cannot adopt {path}: {reason}")
    world_size = saved_world_size(entry)
    if world_size is None:
        raise CheckpointError(
            f"cannot adopt {path}: its data files are not named as DCP's FileSystemWriter names them "
            "(__<rank>_<n>.distcp), so the number of ranks that wrote it is unknown; commit it with "
            "elastic.checkpoint.write_commit_record(folder, step, world_size)"
        )
    record = write_commit_record(path, entry.step, world_size, adopted=True)
    logger.info("adopted %s: step %d, written by %d ranks", path, entry.step, world_size)
    return record


def adopt_all(directory: str | os.PathLike) -> list[Path]:
    """Adopt every foreign checkpoint of ``directory``; returns their folders."""
    foreign = [entry.path for entry in scan(directory) if entry.foreign]
    for folder in foreign:
        adopt(folder)
    return foreign
