"""On-disk layout: ``<directory>/step-<N>`` folders and the commit record that makes one loadable.

A step folder is committed only when it holds a valid ``commit.json``; rank 0 writes that file
after DCP's ``.metadata`` exists, which DCP itself writes only after every rank wrote its data.
Anything else under ``step-<N>`` (a crash mid-save, garbage) is torn and never loaded.
"""

from __future__ import annotations

import json
import os
import re
from datetime import datetime, timezone
from pathlib import Path

import torch
from pydantic import BaseModel, ConfigDict, Field, ValidationError

import elastic

COMMIT_FILE = "commit.json"
DCP_METADATA_FILE = ".metadata"
_STEP_DIR_PATTERN = re.compile(r"step-(0|[1-9][0-9]*)")


class CheckpointError(ValueError):
    """A checkpoint or checkpoint directory that cannot be used as asked; the message says why and what to do."""


class CommitRecord(BaseModel):
    """What ``commit.json`` holds: the proof that a step folder is complete, and where it came from."""

    model_config = ConfigDict(frozen=True, extra="ignore")

    step: int = Field(ge=0, description="training step the checkpoint was taken after")
    world_size: int = Field(ge=1, description="number of ranks that wrote it")
    time: datetime = Field(description="UTC time of the commit")
    torch_version: str
    elastic_version: str


class CheckpointEntry(BaseModel):
    """One ``step-<N>`` folder as found on disk; ``record`` is None when it is torn, and ``problem`` says why."""

    model_config = ConfigDict(frozen=True)

    step: int
    path: Path
    record: CommitRecord | None = None
    problem: str | None = None

    @property
    def committed(self) -> bool:
        return self.record is not None


def step_dir(directory: str | os.PathLike, step: int) -> Path:
    return Path(directory) / f"step-{step}"


def parse_step(name: str) -> int | None:
    """The step of a folder named ``step-<N>`` (N unpadded), or None for any other name."""
    match = _STEP_DIR_PATTERN.fullmatch(name)
    return int(match.group(1)) if match else None


def fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def write_durably(path: Path, data: bytes) -> None:
    """Write via a tmp file, fsync, atomic rename and fsync of the folder, so readers see all of it or nothing."""
    tmp = path.with_name(path.name + ".tmp")
    with open(tmp, "wb") as stream:
        stream.write(data)
        stream.flush()
        os.fsync(stream.fileno())
    os.replace(tmp, path)
    fsync_dir(path.parent)


def write_commit_record(step_dir: str | os.PathLike, step: int, world_size: int) -> CommitRecord:
    """Commit a finished DCP checkpoint folder (ours, or one written by plain ``dcp.save`` elsewhere).

    Call it on one rank only, after ``dcp.save`` returned on every rank.
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
        time=datetime.now(timezone.utc),
        torch_version=torch.__version__,
        elastic_version=elastic.__version__,
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
        raise CheckpointError(f"{folder} is torn: it has no {COMMIT_FILE} (the save did not finish)") from None
    except (OSError, ValueError, ValidationError) as error:
        reason = str(error).splitlines()[0]
        raise CheckpointError(f"{folder} is torn: its {COMMIT_FILE} is unreadable ({reason})") from None
    if record.step != step:
        raise CheckpointError(f"{folder} is torn: its {COMMIT_FILE} records step {record.step}, not {step}")
    if not (folder / DCP_METADATA_FILE).is_file():
        raise CheckpointError(f"{folder} is torn: it has a {COMMIT_FILE} but no DCP {DCP_METADATA_FILE}")
    return record


def scan(directory: str | os.PathLike) -> list[CheckpointEntry]:
    """Every ``step-<N>`` folder under ``directory``, oldest first; a missing directory holds none."""
    root = Path(directory)
    if not root.is_dir():
        return []
    entries = []
    for child in root.iterdir():
        step = parse_step(child.name)
        if step is None or not child.is_dir():
            continue
        try:
            entries.append(CheckpointEntry(step=step, path=child, record=read_commit_record(child)))
        except CheckpointError as error:
            entries.append(CheckpointEntry(step=step, path=child, problem=str(error)))
    return sorted(entries, key=lambda entry: entry.step)


def folder_size(folder: Path) -> int:
    return sum(path.stat().st_size for path in folder.rglob("*") if path.is_file())
