"""CheckpointManager: save, commit, retain and load ``step-<N>`` checkpoints with DCP, synchronously or in the background."""

from __future__ import annotations

import logging
import os
import shutil
import time
from concurrent.futures import Future
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from pydantic import BaseModel, ConfigDict, Field
from torch.distributed.checkpoint import FileSystemReader
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner, DefaultSavePlanner
from torch.distributed.checkpoint.staging import DefaultStager, StagingOptions
from torch.distributed.checkpoint.state_dict_saver import AsyncCheckpointerType
from torch.distributed.checkpoint.stateful import Stateful

from elastic.checkpoint.foreign_state import REGENERATE_METHOD, split_entries, summarize_keys
from elastic.checkpoint.global_values import PerRankStateError, reject_per_rank_values
from elastic.checkpoint.integrity import verify_readable
from elastic.checkpoint.layout import CheckpointEntry, CheckpointError, read_commit_record, scan, step_dir, write_commit_record
from elastic.checkpoint.reader import CheckpointReader
from elastic.checkpoint.ranks import RankFailure, Ranks, describe_error
from elastic.checkpoint.retention import prune
from elastic.checkpoint.writer import CheckpointWriter

logger = logging.getLogger(__name__)


class CheckpointConfig(BaseModel):
    """How a CheckpointManager saves; validated so a typo fails at construction, not at the first save."""

    model_config = ConfigDict(frozen=True)

    directory: Path = Field(description="parent of the step-<N> folders; must be shared by all nodes")
    keep: int = Field(3, ge=1, description="committed checkpoints to keep; the newest is never deleted")
    async_save: bool = Field(True, description="write in the background; training waits only for staging")
    check_at_start: bool = Field(True, description="save step 0 when there is nothing to load, to fail fast")


@dataclass
class _SaveInFlight:
    step: int
    folder: Path
    upload: Future
    committed: Future  # set by rank 0 once commit.json is durable; already done on other ranks
    started: float


class CheckpointManager:
    """Committed, resharding checkpoints under ``directory``; see the package docstring for the protocol."""

    def __init__(
        self,
        directory: str | os.PathLike,
        keep: int = 3,
        async_save: bool = True,
        process_group: dist.ProcessGroup | None = None,
        check_at_start: bool = True,
    ) -> None:
        self.config = CheckpointConfig(
            directory=Path(directory), keep=keep, async_save=async_save, check_at_start=check_at_start
        )
        self._owns_group = process_group is None
        self._ranks = Ranks.dedicated(process_group)
        # One stager for the manager's life: it reuses its CPU copies, so staging after the first save is a memcpy.
        self._stager = DefaultStager(StagingOptions(False, False, False, False)) if async_save else None
        self._in_flight: _SaveInFlight | None = None
        self._closed = False

    @property
    def directory(self) -> Path:
        return self.config.directory

    def load_latest(self, state: dict[str, Any]) -> int | None:
        """Load the newest checkpoint committed and readable on every rank into ``state``, in place.

        Returns its step, or None when there is none (after saving step 0 unless ``check_at_start`` is off).
        """
        self._ensure_open()
        self.wait()
        entry = self._newest_loadable()
        if entry is None:
            if self.config.check_at_start:
                self._check_directory_at_start(state)
            return None
        started = time.monotonic()
        self._load(entry, state)
        logger.info(
            "loaded %s (saved by %d ranks, now %d) in %.2fs",
            entry.path, entry.record.world_size, self._ranks.world_size, time.monotonic() - started,
        )
        return entry.step

    def save(self, step: int, state: dict[str, Any]) -> None:
        """Save ``state`` as ``step``; returns once it is staged (async) or committed (sync).

        Waits first for the save in flight, and raises its failure if it failed.
        """
        self._ensure_open()
        self.wait()
        self._save(step, state, self.config.async_save)

    def wait(self) -> None:
        """Block until the save in flight is committed; raise on every rank if it failed anywhere."""
        in_flight, self._in_flight = self._in_flight, None
        if in_flight is None:
            return

        def finish() -> None:
            in_flight.upload.result()
            in_flight.committed.result()

        self._ranks.agree(finish, f"background save of step {in_flight.step} to {in_flight.folder}")
        logger.info(
            "committed %s, %.2fs after the save began", in_flight.folder, time.monotonic() - in_flight.started
        )
        self._prune()

    def close(self) -> None:
        """Wait for the save in flight, then release the stager and the manager's own process group."""
        if self._closed:
            return
        self._closed = True
        try:
            self.wait()
        finally:
            if self._stager is not None:
                self._stager.close()
            if self._owns_group and self._ranks.group is not None and dist.is_initialized():
                dist.destroy_process_group(self._ranks.group)

    @property
    def _single(self) -> bool:
        """True when this process checkpoints alone, without torch.distributed."""
        return self._ranks.group is None

    def _ensure_open(self) -> None:
        if self._closed:
            raise RuntimeError(f"the CheckpointManager of {self.directory} is closed; create a new one")

    def _save(self, step: int, state: dict[str, Any], in_background: bool) -> None:
        if step < 0:
            raise ValueError(f"step must be >= 0, got {step}")
        started = time.monotonic()
        state_dict = _state_dicts(state)
        reject_per_rank_values(state_dict, self._ranks)
        folder = step_dir(self.directory, step)
        if not self._ranks.agree(lambda: _prepare_folder(folder), f"preparing {folder}", only_rank0=True):
            logger.warning("%s is already committed; not saving step %d again", folder, step)
            return
        writer = CheckpointWriter(folder)
        planner = DefaultSavePlanner(enable_plan_caching=True)
        if not in_background:
            dcp.save(
                state_dict, storage_writer=writer, planner=planner, process_group=self._ranks.group, no_dist=self._single
            )
            self._ranks.agree(
                lambda: write_commit_record(folder, step, self._ranks.world_size), f"committing {folder}", only_rank0=True
            )
            logger.info("saved and committed %s in %.2fs", folder, time.monotonic() - started)
            self._prune()
            return
        upload = dcp.async_save(
            state_dict,
            storage_writer=writer,
            planner=planner,
            process_group=self._ranks.group,
            async_checkpointer_type=AsyncCheckpointerType.THREAD,
            async_stager=self._stager,
            no_dist=self._single,
        )
        committed: Future = Future()
        if self._ranks.rank == 0:
            upload.add_done_callback(lambda done: self._commit_after_upload(done, folder, step, committed))
        else:
            committed.set_result(None)
        self._in_flight = _SaveInFlight(step, folder, upload, committed, started)
        logger.info("staged step %d in %.2fs; writing %s in the background", step, time.monotonic() - started, folder)

    def _commit_after_upload(self, upload: Future, folder: Path, step: int, committed: Future) -> None:
        # Runs on rank 0's writer thread as soon as every rank's data and DCP's metadata are on disk,
        # so the checkpoint is committed even if training never calls wait() again.
        try:
            upload.result()
            write_commit_record(folder, step, self._ranks.world_size)
        except BaseException as error:  # handed to wait(), which raises it on every rank
            committed.set_exception(error)
        else:
            committed.set_result(None)

    def _prune(self) -> None:
        if self._ranks.rank != 0:
            return
        try:
            prune(self.directory, self.config.keep)
        except OSError as error:
            logger.warning("could not delete old checkpoints in %s: %s", self.directory, error)

    def _newest_loadable(self) -> CheckpointEntry | None:
        entries = self._ranks.agree(lambda: scan(self.directory), f"listing {self.directory}", only_rank0=True)
        if self._ranks.rank == 0:
            for entry in entries:
                if not entry.committed:
                    logger.warning("skipping torn checkpoint %s: %s", entry.path, entry.problem)
        committed = [entry for entry in entries if entry.committed]
        for entry in reversed(committed):
            try:
                self._ranks.agree(lambda: verify_readable(entry.path), f"checking {entry.path}")
                return entry
            except RankFailure as error:
                if self._ranks.rank == 0:
                    logger.warning("skipping checkpoint %s: %s", entry.path, error)
        if committed:
            raise CheckpointError(
                f"none of the {len(committed)} committed checkpoints in {self.directory} can be read on every rank "
                "(see the warnings above); fix the storage, or move them away to start from scratch"
            )
        return None

    def _load(self, entry: CheckpointEntry, state: dict[str, Any]) -> None:
        state_dicts = _state_dicts(state)
        metadata = FileSystemReader(entry.path).read_metadata()
        to_regenerate = split_entries(state, state_dicts, metadata.state_dict_metadata, entry.path)
        loadable = {name: value for name, value in state_dicts.items() if name not in to_regenerate}
        dcp.load(
            loadable,
            storage_reader=CheckpointReader(entry.path),
            planner=DefaultLoadPlanner(),
            process_group=self._ranks.group,
            no_dist=self._single,
        )
        for name, loaded in loadable.items():
            if isinstance(state[name], Stateful):
                state[name].load_state_dict(loaded)
            else:
                state[name] = loaded
        for name, foreign_keys in to_regenerate.items():
            getattr(state[name], REGENERATE_METHOD)(entry.step)
            if self._ranks.rank == 0:
                logger.warning(
                    "%s holds %s for state entry %r, not its keys; regenerated %r from global step %d",
                    entry.path, summarize_keys(foreign_keys) or "nothing", name, name, entry.step,
                )

    def _check_directory_at_start(self, state: dict[str, Any]) -> None:
        started = time.monotonic()
        folder = step_dir(self.directory, 0)
        try:
            self._save(0, state, in_background=False)
            self._ranks.agree(lambda: verify_readable(folder), f"reading {folder} back")
        except PerRankStateError:
            raise
        except (Exception, CheckpointException) as error:
            raise CheckpointError(
                f"checkpoint directory {self.directory} failed the step-0 check: {describe_error(error)}. "
                "Use a writable directory with free space that every node sees at the same path, "
                "or pass check_at_start=False"
            ) from None
        logger.info(
            "step-0 checkpoint check of %s passed in %.2fs (%d ranks wrote and read it back)",
            self.directory, time.monotonic() - started, self._ranks.world_size,
        )


def _state_dicts(state: dict[str, Any]) -> dict[str, Any]:
    """Each entry's state dict; entries that are not Stateful are plain state already."""
    return {name: value.state_dict() if isinstance(value, Stateful) else value for name, value in state.items()}


def _prepare_folder(folder: Path) -> bool:
    """Make ``folder`` ready for a new save; False when it is already committed, which is never touched."""
    if folder.exists():
        try:
            read_commit_record(folder)
            return False
        except CheckpointError as torn:
            logger.warning("clearing %s before saving into it: %s", folder, torn)
            shutil.rmtree(folder)
    folder.mkdir(parents=True)
    return True
