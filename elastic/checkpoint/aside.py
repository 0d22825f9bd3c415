"""Moving checkpoint folders out of the way: set aside for people to look at, or deleted.

Either way the folder is renamed first. A writer of an old round that is still alive opens its
files by path, so after the rename it writes into the renamed tree or fails; it can never write
into a folder that a newer save creates under the old name.
"""

from __future__ import annotations

import logging
import shutil
import uuid
from datetime import UTC, datetime
from pathlib import Path

logger = logging.getLogger(__name__)

DELETING_MARK = ".deleting-"
UNREADABLE = "unreadable"  # committed, then found damaged
FENCED = "fenced"  # committed by a save whose round was no longer current
FOREIGN = "foreign"  # a whole checkpoint another tool wrote, in the way of a save of its step


def set_aside(folder: Path, reason: str) -> Path:
    """Rename ``folder`` to ``<name>.<reason>-<UTC time>`` next to it and return the new path; nothing is deleted."""
    stamp = datetime.now(UTC).strftime("%Y%m%dT%H%M%SZ")
    target = folder.with_name(f"{folder.name}.{reason}-{stamp}")
    if target.exists():  # set aside twice within a second
        target = target.with_name(f"{target.name}-{uuid.uuid4().hex[:6]}")
    folder.rename(target)
    return target


def dispose(path: Path) -> None:
    """Delete ``path`` (a folder or a file) by renaming it to ``<name>.deleting-<id>`` first, then removing that."""
    doomed = path.with_name(f"{path.name}{DELETING_MARK}{uuid.uuid4().hex[:8]}")
    try:
        path.rename(doomed)
    except FileNotFoundError:
        return  # someone else moved or deleted it first
    remove(doomed)


def remove(doomed: Path) -> None:
    """Remove a path already renamed for deletion; another process removing it at the same time is fine."""
    if doomed.is_dir() and not doomed.is_symlink():
        shutil.rmtree(doomed, ignore_errors=True)
        if doomed.exists():
            logger.warning("could not delete all of %s; it is retried at the next prune", doomed)
    else:
        doomed.unlink(missing_ok=True)


def is_being_deleted(name: str) -> bool:
    return DELETING_MARK in name


def is_set_aside(name: str) -> bool:
    return name.startswith("step-") and any(f".{reason}-" in name for reason in (UNREADABLE, FENCED, FOREIGN))
