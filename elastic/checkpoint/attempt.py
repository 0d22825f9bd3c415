"""One save attempt: a folder of its own, and the commit that publishes it as ``step-<N>``.

Every rank writes its DCP data into ``step-<N>.attempt-e<epoch>-r<round>-<id>``, a name no other
save uses, so the files of two saves of one step never mix. Rank 0 then commits:

1. the folder still holds the ``.metadata`` this save's coordinator wrote (its digest), and every
   data file that metadata names is there, long enough;
2. ``commit.json`` (step, world size, round, run id, epoch, attempt id, metadata digest) is written into it;
3. the directory's fence still names this save's epoch, else the save is refused (FencedError);
4. the folder is renamed to ``step-<N>``: atomic, and it fails if ``step-<N>`` exists, so a commit
   never replaces or joins another save's files.
"""

from __future__ import annotations

import logging
import os
import uuid
from dataclasses import dataclass
from datetime import UTC, datetime
from pathlib import Path

import torch

import elastic
from elastic.checkpoint.aside import FENCED, FOREIGN, dispose, set_aside
from elastic.checkpoint.durable import fsync_dir, write_durably
from elastic.checkpoint.errors import CheckpointError
from elastic.checkpoint.fence import Fence, ensure_current, read_fence
from elastic.checkpoint.integrity import verify_readable
from elastic.checkpoint.layout import COMMIT_FILE, CommitRecord, attempt_dir, read_entry, step_dir

logger = logging.getLogger(__name__)


def round_from_env() -> int:
    """ELASTIC_ROUND, the membership round elastic-run gives its workers; 0 outside elastic-run."""
    text = os.environ.get("ELASTIC_ROUND", "0")
    try:
        value = int(text)
    except ValueError:
        value = -1
    if value < 0:
        raise ValueError(f"ELASTIC_ROUND must be a round number (an integer >= 0), got {text!r}")
    return value


def run_id_from_env() -> str | None:
    return os.environ.get("TORCHELASTIC_RUN_ID") or None


@dataclass(frozen=True)
class Attempt:
    """One save of one step: where its ranks write, and the ``step-<N>`` it becomes when committed."""

    directory: Path
    step: int
    epoch: int
    round: int
    run_id: str | None
    id: str

    @property
    def folder(self) -> Path:
        return attempt_dir(self.directory, self.step, self.epoch, self.round, self.id)

    @property
    def target(self) -> Path:
        return step_dir(self.directory, self.step)


def prepare_attempt(directory: Path, step: int, fence: Fence) -> Attempt | None:
    """Create the folder of a new save of ``step``; None when ``step`` is committed already (never touched)."""
    if _clear_target(step_dir(directory, step), fence):
        return None
    attempt = Attempt(directory, step, fence.epoch, fence.round, fence.run_id, uuid.uuid4().hex[:16])
    attempt.folder.mkdir(parents=True)
    return attempt


def commit_attempt(attempt: Attempt, world_size: int, metadata_sha256: str | None) -> CommitRecord:
    """Publish ``attempt`` as ``step-<N>``; call it on one rank, after the save returned on every rank."""
    folder, target = attempt.folder, attempt.target
    if not folder.is_dir():
        raise CheckpointError(f"cannot commit {folder}: it is gone (a newer round deleted the folders of older ones)")
    if metadata_sha256 is None:
        raise CheckpointError(f"cannot commit {folder}: this save wrote no DCP metadata")
    verify_readable(folder, metadata_sha256)
    record = CommitRecord(
        step=attempt.step,
        world_size=world_size,
        time=datetime.now(UTC),
        torch_version=torch.__version__,
        elastic_version=elastic.__version__,
        round=attempt.round,
        run_id=attempt.run_id,
        epoch=attempt.epoch,
        attempt=attempt.id,
        metadata_sha256=metadata_sha256,
    )
    write_durably(folder / COMMIT_FILE, record.model_dump_json(indent=2).encode())
    if _clear_target(target, read_fence(attempt.directory)):
        raise CheckpointError(f"cannot commit {folder}: another save committed {target} meanwhile; not replacing it")
    # Last, so the time between this check and the rename is as short as it gets; a stale commit
    # landing in that window is still never loaded (fence.py).
    ensure_current(attempt.directory, attempt.epoch, f"step {attempt.step} to {target}")
    try:
        os.rename(folder, target)  # an empty target is replaced, a non-empty one refuses
    except OSError as error:
        raise CheckpointError(
            f"cannot commit {folder} as {target}: {error.strerror}; another save created {target} meanwhile"
        ) from None
    fsync_dir(attempt.directory)
    return record


def discard_attempt(attempt: Attempt) -> None:
    """Delete the folder of a save that failed on every rank, so no writer of it is left."""
    if attempt.folder.exists():
        dispose(attempt.folder)
        logger.info("deleted %s, the folder of a failed save of step %d", attempt.folder, attempt.step)


def _clear_target(target: Path, fence: Fence | None) -> bool:
    """True when ``target`` is a committed checkpoint; otherwise make sure nothing is in the way.

    A stale round's commit and a whole checkpoint another tool wrote are set aside (kept for people to look
    at or adopt); anything else there is garbage left by hand or by an older version, and is deleted after a
    rename.
    """
    if not os.path.lexists(target):
        return False
    if not target.is_dir():
        logger.warning("deleting %s before saving into it: it is not a folder", target)
        dispose(target)
        return False
    entry = read_entry(target, fence)
    if entry.committed:
        return True
    if entry.fenced or entry.foreign:
        reason = FENCED if entry.fenced else FOREIGN
        logger.warning("set aside %s as %s: %s", target, set_aside(target, reason), entry.problem)
    else:
        logger.warning("clearing %s before saving into it: %s", target, entry.problem)
        dispose(target)
    return False
