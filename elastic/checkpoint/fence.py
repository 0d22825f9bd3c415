"""Who may commit into a checkpoint directory: the fence that keeps a stale round from committing.

Every CheckpointManager claims a new epoch of its directory before its first save, by creating
``.elastic-fence/epoch-<E>.json`` exclusively, so epochs are totally ordered and the newest
claimant (under elastic-run: the newest round) owns the directory. Two rules follow:

- a save commits only while its epoch is still the newest (checked right before the commit's rename);
- a commit of an older epoch counts only if the new owner admitted it when it claimed the directory
  (listed in ``admitted``): a stale commit that slipped in between that check and its rename, or
  after the new owner listed what it loads, is never loaded and is set aside.

Loading alone never claims, so a job that only reads checkpoints does not fence out the trainer.
"""

from __future__ import annotations

import logging
import os
import re
from collections.abc import Callable
from datetime import UTC, datetime
from pathlib import Path

from pydantic import BaseModel, ConfigDict, Field, ValidationError

from elastic.checkpoint.durable import create_exclusively
from elastic.checkpoint.errors import CheckpointError, FencedError

logger = logging.getLogger(__name__)

FENCE_DIR = ".elastic-fence"
EPOCH_FILES_KEPT = 8  # only the newest epoch decides anything; a few older ones stay for people to read
_EPOCH_FILE = re.compile(r"epoch-([1-9][0-9]*)\.json")


class Fence(BaseModel):
    """One epoch of a checkpoint directory: which save owns it, and which older commits stay valid."""

    model_config = ConfigDict(frozen=True, extra="ignore")

    epoch: int = Field(ge=1, description="claim order within the directory; the highest owns it")
    round: int = Field(ge=0, description="ELASTIC_ROUND of the claimant (0 outside elastic-run)")
    run_id: str | None = Field(description="TORCHELASTIC_RUN_ID of the claimant")
    time: datetime
    admitted: frozenset[str] = Field(frozenset(), description="attempt ids of older epochs' commits that count")

    def admits(self, epoch: int | None, attempt: str | None) -> bool:
        """Whether a commit made in ``epoch`` by save ``attempt`` counts under this fence.

        Commits without an epoch were made by hand (``write_commit_record``, ``elastic-ckpt convert``)
        and are outside the fence.
        """
        return epoch is None or epoch >= self.epoch or attempt in self.admitted

    def describe(self) -> str:
        return f"epoch {self.epoch} (round {self.round}, run {self.run_id or '-'}, claimed {self.time.isoformat()})"


def fence_dir(directory: str | os.PathLike) -> Path:
    return Path(directory) / FENCE_DIR


def _epochs(directory: str | os.PathLike) -> list[int]:
    try:
        names = os.listdir(fence_dir(directory))
    except (FileNotFoundError, NotADirectoryError):
        return []
    return sorted(int(match.group(1)) for name in names if (match := _EPOCH_FILE.fullmatch(name)))


def read_fence(directory: str | os.PathLike) -> Fence | None:
    """The newest epoch of ``directory``, or None when no manager ever saved into it."""
    epochs = _epochs(directory)
    if not epochs:
        return None
    path = fence_dir(directory) / f"epoch-{epochs[-1]}.json"
    try:
        return Fence.model_validate_json(path.read_bytes())
    except (OSError, ValidationError) as error:
        reason = str(error).splitlines()[0]
        raise CheckpointError(
            f"{path} is unreadable ({reason}); it decides which save may commit into {directory}. "
            "Delete it if it is garbage"
        ) from None


def claim(directory: str | os.PathLike, round_: int, run_id: str | None, admitted: Callable[[], set[str]]) -> Fence:
    """Make this manager the owner of ``directory``: create the next epoch, admitting ``admitted()``.

    ``admitted`` lists the attempts of the commits that stay valid; it is evaluated after the
    current epoch was read, so a claim that raced with another is retried on the newer epoch.
    """
    fence_dir(directory).mkdir(parents=True, exist_ok=True)
    while True:
        current = read_fence(directory)
        fence = Fence(
            epoch=current.epoch + 1 if current else 1,
            round=round_,
            run_id=run_id,
            time=datetime.now(UTC),
            admitted=frozenset(admitted()),
        )
        if create_exclusively(
            fence_dir(directory) / f"epoch-{fence.epoch}.json", fence.model_dump_json(indent=2).encode()
        ):
            break
        logger.info("another save claimed epoch %d of %s at the same time; claiming the next", fence.epoch, directory)
    if current is not None:
        logger.info("%s now belongs to %s; it was %s's", directory, fence.describe(), current.describe())
    _drop_old_epoch_files(directory, fence.epoch)
    return fence


def ensure_current(directory: str | os.PathLike, epoch: int, what: str) -> None:
    """Raise FencedError unless ``epoch`` still owns ``directory``; ``what`` names the commit refused."""
    current = read_fence(directory)
    if current is not None and current.epoch != epoch:
        raise FencedError(
            f"not committing {what}: this save belongs to epoch {epoch} of {directory}, but "
            f"{current.describe()} has taken the directory over; this worker's round is no longer current"
        )


def _drop_old_epoch_files(directory: str | os.PathLike, newest: int) -> None:
    for epoch in _epochs(directory):
        if epoch <= newest - EPOCH_FILES_KEPT:
            (fence_dir(directory) / f"epoch-{epoch}.json").unlink(missing_ok=True)
