"""On-disk layout: ``<directory>/step-<N>`` folders and the commit record that makes one loadable.

A save writes into a folder of its own, ``step-<N>.attempt-e<epoch>-r<round>-<id>``, and is committed
by writing ``commit.json`` into it and renaming it to ``step-<N>`` (see attempt.py), so a committed
folder holds the files of exactly one save. A ``step-<N>`` folder counts only when it holds a valid
``commit.json`` whose save the directory's fence admits (fence.py); anything else under that name is never
loaded: a stale round's commit (fenced), a whole DCP checkpoint another tool wrote (foreign: torchtitan, plain
``dcp.save``; loaded once adopted, adopt.py), or a save that did not finish (torn).
"""

from __future__ import annotations

import json
import os
import re
from datetime import UTC, datetime
from enum import Enum
from pathlib import Path
from typing import NamedTuple

import torch
from pydantic import BaseModel, ConfigDict, Field, ValidationError

import elastic
from elastic.checkpoint.durable import fsync_dir, write_durably
from elastic.checkpoint.errors import CheckpointError
from elastic.checkpoint.fence import Fence, read_fence
from elastic.checkpoint.integrity import (
    DCP_METADATA_FILE,
    metadata_digest,
    read_metadata,
    verify_readable,
    writer_count,
)

# re-exported: older code imports them from here
__all__ = ["DCP_METADATA_FILE", "CheckpointError", "fsync_dir", "write_durably"]

COMMIT_FILE = "commit.json"
_STEP_DIR_PATTERN = re.compile(r"step-(0|[1-9][0-9]*)")
_ATTEMPT_DIR_PATTERN = re.compile(r"step-(0|[1-9][0-9]*)\.attempt-e([1-9][0-9]*)-r([0-9]+)-([0-9a-f]+)")


class CommitRecord(BaseModel):
    """What ``commit.json`` holds: the proof that a step folder is complete, and where it came from."""

    model_config = ConfigDict(frozen=True, extra="ignore")

    step: int = Field(ge=0, description="training step the checkpoint was taken after")
    world_size: int = Field(ge=1, description="number of ranks that wrote it")
    time: datetime = Field(description="UTC time of the commit")
    torch_version: str
    elastic_version: str
    # Which save made it; None in records written by hand (write_commit_record, elastic-ckpt convert).
    round: int | None = Field(None, description="ELASTIC_ROUND of the ranks that saved it")
    run_id: str | None = Field(None, description="TORCHELASTIC_RUN_ID of the ranks that saved it")
    epoch: int | None = Field(None, description="the directory's fence epoch the save belonged to")
    attempt: str | None = Field(None, description="id of the save attempt, unique per save")
    metadata_sha256: str | None = Field(None, description="digest of the DCP .metadata that save wrote")
    adopted: bool = Field(False, description="committed afterwards, as a whole checkpoint another tool wrote")


class EntryState(str, Enum):
    """What a ``step-<N>`` folder is, and so whether it loads."""

    COMMITTED = "committed"  # a commit record the directory's fence admits: loaded
    FENCED = "fenced"  # a commit record of a save whose round was no longer current: never loaded
    FOREIGN = "foreign"  # whole DCP checkpoint without a commit record (another tool wrote it): loaded once adopted
    TORN = "torn"  # a save that did not finish: no DCP .metadata, or a data file it names missing or short


class CheckpointEntry(BaseModel):
    """One ``step-<N>`` folder as found on disk; ``record`` is its commit record, and ``problem`` says why it
    is not committed."""

    model_config = ConfigDict(frozen=True)

    step: int
    path: Path
    state: EntryState
    record: CommitRecord | None = None
    problem: str | None = None

    @property
    def committed(self) -> bool:
        return self.state is EntryState.COMMITTED

    @property
    def fenced(self) -> bool:
        return self.state is EntryState.FENCED

    @property
    def foreign(self) -> bool:
        return self.state is EntryState.FOREIGN

    @property
    def key(self) -> str:
        """What identifies this commit across renames: its attempt id, or its name and time for hand-made ones."""
        if self.record is None:
            return f"{self.path.name}@{self.state.value}"  # nothing to identify: never kept track of
        return self.record.attempt or f"{self.path.name}@{self.record.time.isoformat()}"


class AttemptName(NamedTuple):
    """What the name of an attempt folder ``step-<N>.attempt-e<epoch>-r<round>-<id>`` says."""

    step: int
    epoch: int
    round: int
    attempt: str


def step_dir(directory: str | os.PathLike, step: int) -> Path:
    return Path(directory) / f"step-{step}"


def parse_step(name: str) -> int | None:
    """The step of a folder named ``step-<N>`` (N unpadded), or None for any other name."""
    match = _STEP_DIR_PATTERN.fullmatch(name)
    return int(match.group(1)) if match else None


def attempt_dir(directory: str | os.PathLike, step: int, epoch: int, round_: int, attempt: str) -> Path:
    return Path(directory) / f"step-{step}.attempt-e{epoch}-r{round_}-{attempt}"


def parse_attempt(name: str) -> AttemptName | None:
    """What an attempt folder's name says, or None for any other name."""
    match = _ATTEMPT_DIR_PATTERN.fullmatch(name)
    if not match:
        return None
    step, epoch, round_, attempt = match.groups()
    return AttemptName(int(step), int(epoch), int(round_), attempt)


def write_commit_record(
    step_dir: str | os.PathLike, step: int, world_size: int, *, adopted: bool = False
) -> CommitRecord:
    """Commit a finished DCP checkpoint folder in place (one written by plain ``dcp.save``, or by hand).

    Call it on one rank only, after ``dcp.save`` returned on every rank. The record names no save
    attempt, so the directory's fence always admits it: this is for people adopting checkpoints, while
    CheckpointManager commits its own saves through attempt folders (attempt.py). It records the digest of
    the folder's DCP metadata, so a later replacement of that file is caught before a load.
    """
    folder = Path(step_dir)
    if not (folder / DCP_METADATA_FILE).is_file():
        raise CheckpointError(
            f"cannot commit {folder}: it has no DCP {DCP_METADATA_FILE} file, so the save did not finish; "
            "commit only after dcp.save returned on every rank"
        )
    record = CommitRecord(
        step=step,
        world_size=world_size,
        time=datetime.now(UTC),
        torch_version=torch.__version__,
        elastic_version=elastic.__version__,
        metadata_sha256=metadata_digest(folder),
        adopted=adopted,
    )
    write_durably(folder / COMMIT_FILE, record.model_dump_json(indent=2).encode())
    fsync_dir(folder.parent)  # the step folder's own entry must survive a crash too
    return record


def read_commit_record(folder: Path) -> CommitRecord:
    """The commit record of ``folder``; raises CheckpointError naming the folder when it is torn."""
    step = parse_step(folder.name)
    if step is None:
        raise CheckpointError(f"{folder} is not a checkpoint folder: its name must be step-<N>")
    try:
        record = CommitRecord.model_validate(json.loads((folder / COMMIT_FILE).read_bytes()))
    except FileNotFoundError:
        raise CheckpointError(f"{folder} is not committed: it has no {COMMIT_FILE}") from None
    except (OSError, ValueError, ValidationError) as error:
        reason = str(error).splitlines()[0]
        raise CheckpointError(f"{folder} is torn: its {COMMIT_FILE} is unreadable ({reason})") from None
    if record.step != step:
        raise CheckpointError(f"{folder} is torn: its {COMMIT_FILE} records step {record.step}, not {step}")
    if not (folder / DCP_METADATA_FILE).is_file():
        raise CheckpointError(f"{folder} is torn: it has a {COMMIT_FILE} but no DCP {DCP_METADATA_FILE}")
    return record


def read_entry(folder: Path, fence: Fence | None) -> CheckpointEntry:
    """The ``step-<N>`` folder ``folder`` as a CheckpointEntry, judged by the directory's ``fence``."""
    step = parse_step(folder.name)
    if step is None:
        raise CheckpointError(f"{folder} is not a checkpoint folder: its name must be step-<N>")
    if not (folder / COMMIT_FILE).exists():
        return _uncommitted(folder, step)
    try:
        record = read_commit_record(folder)
    except CheckpointError as error:
        return CheckpointEntry(step=step, path=folder, state=EntryState.TORN, problem=str(error))
    if fence is not None and not fence.admits(record.epoch, record.attempt):
        problem = (
            f"{folder} was committed by a save of epoch {record.epoch} (round {record.round}, attempt "
            f"{record.attempt}) after {fence.describe()} took the directory over: its round was no longer current"
        )
        return CheckpointEntry(step=step, path=folder, state=EntryState.FENCED, record=record, problem=problem)
    return CheckpointEntry(step=step, path=folder, state=EntryState.COMMITTED, record=record)


def _uncommitted(folder: Path, step: int) -> CheckpointEntry:
    """A step folder without a commit record: foreign when its DCP checkpoint is whole, torn otherwise."""
    if not (folder / DCP_METADATA_FILE).is_file():
        problem = f"{folder} is torn: it has no {COMMIT_FILE} and no DCP {DCP_METADATA_FILE} (the save did not finish)"
        return CheckpointEntry(step=step, path=folder, state=EntryState.TORN, problem=problem)
    try:
        verify_readable(folder)
    except CheckpointError as error:
        problem = f"{folder} is torn: it has no {COMMIT_FILE}, and {error}"
        return CheckpointEntry(step=step, path=folder, state=EntryState.TORN, problem=problem)
    problem = (
        f"{folder} is a whole DCP checkpoint without a {COMMIT_FILE} (another tool wrote it); "
        f"adopt it with `elastic-ckpt adopt {folder.parent}` to load it"
    )
    return CheckpointEntry(step=step, path=folder, state=EntryState.FOREIGN, problem=problem)


def saved_world_size(entry: CheckpointEntry) -> int | None:
    """How many ranks saved ``entry``: its commit record says; a foreign one's data files tell; None for a torn one."""
    if entry.record is not None:
        return entry.record.world_size
    return writer_count(read_metadata(entry.path)) if entry.foreign else None


def scan(directory: str | os.PathLike) -> list[CheckpointEntry]:
    """Every ``step-<N>`` folder under ``directory``, oldest first; a missing directory holds none."""
    root = Path(directory)
    if not root.is_dir():
        return []
    fence = read_fence(root)
    entries = [
        read_entry(child, fence) for child in root.iterdir() if parse_step(child.name) is not None and child.is_dir()
    ]
    return sorted(entries, key=lambda entry: entry.step)


def attempts(directory: str | os.PathLike) -> list[tuple[Path, AttemptName]]:
    """Every attempt folder under ``directory``: saves in flight, and leftovers of saves that never committed."""
    root = Path(directory)
    if not root.is_dir():
        return []
    found = [(child, parse_attempt(child.name)) for child in root.iterdir()]
    return sorted(((path, name) for path, name in found if name is not None), key=lambda item: item[1])


def folder_size(folder: Path) -> int:
    return sum(path.stat().st_size for path in folder.rglob("*") if path.is_file())
