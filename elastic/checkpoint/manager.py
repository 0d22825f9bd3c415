"""CheckpointManager: save, commit, retain and load ``step-<N>`` checkpoints with DCP, in the foreground or in the
background."""

from __future__ import annotations

import logging
import os
import time
from pathlib import Path
from typing import Any, NoReturn

import torch.distributed as dist
from pydantic import BaseModel, ConfigDict, Field
from torch.distributed.checkpoint.api import CheckpointException

from elastic import process_groups
from elastic.channel import long_operation
from elastic.checkpoint.adopt import adopt_all
from elastic.checkpoint.attempt import (
    Attempt,
    commit_attempt,
    discard_attempt,
    prepare_attempt,
    round_from_env,
    run_id_from_env,
)
from elastic.checkpoint.drain import Drains
from elastic.checkpoint.errors import CheckpointError
from elastic.checkpoint.fence import Fence, claim
from elastic.checkpoint.global_values import PerRankStateError, reject_per_rank_values
from elastic.checkpoint.integrity import verify_readable
from elastic.checkpoint.layout import CheckpointEntry, scan, step_dir
from elastic.checkpoint.loading import load_newest, state_dicts
from elastic.checkpoint.memory import Inventory, MemorySnapshots, found_in, node_of
from elastic.checkpoint.ranks import RankFailure, Ranks, describe_error
from elastic.checkpoint.retention import prune
from elastic.checkpoint.saver import AttemptSaver, SaveInFlight
from elastic.node_memory import MEMORY_DIR_ENV, memory_dir_from_env

logger = logging.getLogger(__name__)


class CheckpointConfig(BaseModel):
    """How a CheckpointManager saves; validated so a typo fails at construction, not at the first save."""

    model_config = ConfigDict(frozen=True)

    directory: Path = Field(description="parent of the step-<N> folders; must be shared by all nodes")
    keep: int = Field(3, ge=1, description="committed checkpoints to keep; the newest is never deleted")
    async_save: bool = Field(True, description="write in the background; training waits only for staging")
    check_at_start: bool = Field(True, description="save step 0 when there is nothing to load, to fail fast")
    every: int = Field(0, ge=0, description="should_save's schedule: every this many steps (0: drains only)")
    memory_every: int = Field(
        0, ge=0, description="also snapshot into the nodes' memory every this many steps, under elastic-run (0: never)"
    )
    adopt_foreign: bool = Field(
        False, description="commit whole DCP checkpoints another tool wrote (no commit.json) at load, so they load"
    )


class SnapshotPause:
    """When to try snapshots in memory again after they failed: after 1, 2, 4, ... and at most
    ``2**MAX_DOUBLINGS`` scheduled snapshots. Room in the nodes' memory can come back (a file freed, another job's
    memory gone), and a try that fails again costs one snapshot's planning and an ENOSPC, not a step."""

    MAX_DOUBLINGS = 6

    def __init__(self) -> None:
        self.failures = 0  # in a row
        self.retry_at: int | None = None

    def over(self, step: int) -> bool:
        """Whether snapshots may be taken at ``step``."""
        return self.retry_at is None or step >= self.retry_at

    def failed(self, step: int, every: int) -> int:
        """The snapshot of ``step`` failed (snapshots are scheduled every ``every`` steps): the step to try at next."""
        self.failures += 1
        self.retry_at = step + every * 2 ** min(self.failures - 1, self.MAX_DOUBLINGS)
        return self.retry_at

    def resumed(self) -> bool:
        """A snapshot succeeded: whether snapshots had paused."""
        paused, self.failures, self.retry_at = self.failures > 0, 0, None
        return paused


class CheckpointManager:
    """Committed, resharding checkpoints under ``directory``; see the package docstring for the protocol."""

    def __init__(
        self,
        directory: str | os.PathLike,
        keep: int = 3,
        async_save: bool = True,
        process_group: dist.ProcessGroup | None = None,
        check_at_start: bool = True,
        every: int = 0,
        memory_every: int = 0,
        adopt_foreign: bool = False,
    ) -> None:
        self.config = CheckpointConfig(
            directory=Path(directory),
            keep=keep,
            async_save=async_save,
            check_at_start=check_at_start,
            every=every,
            memory_every=memory_every,
            adopt_foreign=adopt_foreign,
        )
        # Which round saves (recorded in every commit), and the directory's epoch this manager claims
        # at its first save; a newer manager's claim fences this one's commits out (fence.py).
        # Read before the process group is made, so a bad ELASTIC_ROUND leaks nothing.
        self._round = round_from_env()
        self._run_id = run_id_from_env()
        self._fence: Fence | None = None
        self._owns_group = process_group is None
        self._ranks = Ranks.dedicated(process_group)
        # drains agree every step, and memory snapshots are taken, on a group of their own: the checkpoint group
        # may be busy in a background save. Both act in the training thread, one after the other: one group
        # serves both (each group costs a rendezvous of every rank at every change of round)
        in_step = Ranks.dedicated(None)
        self._drains = Drains(in_step.group)
        self._drain = 0  # the drain the next save answers
        self._memory = self._memory_snapshots(in_step) if memory_every else None
        self._memory_pause = SnapshotPause()
        self._memory_step: int | None = None  # the step should_save chose a memory snapshot for
        self._memory_only = False  # and whether that step is not also saved to disk
        self._saver = AttemptSaver(self._ranks, in_background=async_save)
        self._in_flight: SaveInFlight | None = None
        self._closed = False
        self._seen_at_load: set[str] | None = None  # commits load_latest listed; a claim admits only these
        self._verified: set[str] = set()  # keys of checkpoints known readable, so retention checks each once

    @property
    def directory(self) -> Path:
        return self.config.directory

    def load_latest(self, state: dict[str, Any]) -> int | None:
        """Load the newest checkpoint committed and readable on every rank into ``state``, in place.

        Returns its step, or None when there is none (after saving step 0 unless ``check_at_start`` is off).
        A committed checkpoint that no rank can read is set aside (``step-<N>.unreadable-<time>``) once
        an older one loaded. Loading claims nothing, so a job that only loads never fences out a trainer.
        A whole checkpoint another tool wrote (no ``commit.json``: torchtitan's, plain ``dcp.save``'s) is neither
        loaded nor deleted, unless ``adopt_foreign`` commits it first (adopt.py).
        """
        self._ensure_open()
        self.wait()
        started = time.monotonic()
        if self.config.adopt_foreign:
            self._ranks.agree(
                lambda: adopt_all(self.directory),
                f"adopting the foreign checkpoints of {self.directory}",
                only_rank0=True,
            )
        if self._memory is not None:
            step = self._load_from_memory(state)
            if step is not None:
                return step
        entry, self._seen_at_load = load_newest(self._ranks, self.directory, lambda _: state)
        if entry is None:
            if self.config.check_at_start:
                self._check_directory_at_start(state)
            return None
        assert entry.record is not None  # load_newest loads only committed checkpoints, which have a commit record
        logger.info(
            "loaded %s (saved by %d ranks, now %d) in %.2fs",
            entry.path,
            entry.record.world_size,
            self._ranks.world_size,
            time.monotonic() - started,
        )
        self._verified.add(entry.key)
        return entry.step

    def should_save(self, step: int) -> bool:
        """Whether to save at ``step``: on the ``every`` schedule, or when elastic-run asks for a drain before a
        planned change (drain.py), to disk, unless a snapshot in memory answers the drain; on the ``memory_every``
        schedule, into memory (memory.py), and that too at a disk step saved asynchronously (until its commit, the
        snapshot is the newest state) and at a drain's (the next round loads it at once, from memory faster than
        from disk).
        A collective: call it on every rank at every step, as in ``if mgr.should_save(step): mgr.save(step, state)``."""
        self._ensure_open()
        drain = self._drains.requested()
        self._drain = drain.number
        memory_on = self._memory is not None and self._memory_pause.over(step)
        on_schedule = bool(self.config.every and step % self.config.every == 0)
        durable = on_schedule or (bool(drain.number) and (drain.to_disk or not memory_on))
        in_memory = memory_on and (
            # the next round loads a drain's checkpoint at once, faster from memory than from disk
            bool(drain.number) or (step % self.config.memory_every == 0 and (self.config.async_save or not durable))
        )
        self._memory_step = step if in_memory else None
        self._memory_only = in_memory and not durable
        return durable or in_memory

    def save(self, step: int, state: dict[str, Any]) -> None:
        """Save ``state`` as ``step``; returns once it is staged (async) or committed (sync).

        When should_save chose a memory snapshot for ``step``, snapshots it into the nodes' memory first (every
        rank wrote it when that returns), then saves to disk only if ``step`` is a disk step too; any other call
        saves to disk, marked for elastic-run's watchdog as a long operation (a snapshot is not: it is part of
        the step it follows, watched as the step is).

        Waits first for the save in flight, and raises its failure if it failed. A manager's first
        save claims the directory (fence.py): from then on, a save of a manager that claimed it
        earlier (a worker of an older round) is refused at its commit and never loaded. A save that
        answers a drain commits before it returns, and returns only once the drain is withdrawn.
        """
        self._ensure_open()
        if self._memory is not None and self._memory_step == step:
            self._memory_step = None
            try:
                self._memory.save(step, state)
            except (RankFailure, CheckpointException) as error:  # raised on every rank: every rank pauses them
                self._pause_memory_snapshots(step, error)
                snapshotted = False
            else:
                snapshotted = True
                if self._memory_pause.resumed() and self._ranks.rank == 0:
                    logger.info("snapshots in memory are on again, from step %d", step)
            if self._memory_only and not self._drain:
                return
            if self._memory_only and snapshotted and self._commit_drain_in_memory(step):
                return
            # a drain whose snapshot failed, or is not on every node's next node: to disk
        with long_operation("checkpoint save"):
            self.wait()
            drain, self._drain = self._drain, 0
            self._save(step, state, self.config.async_save and not drain)
            if drain:
                self._drains.committed(drain, step)

    def _commit_drain_in_memory(self, step: int) -> bool:
        """Answer the drain with the snapshot of `step` just taken, once the save to disk in flight committed (a
        round change would abort it) and every node's part is on the next node too (the node that leaves takes
        its memory; one lost during the change is covered), and wait at the step boundary as a drain saved to disk
        does. False, answering nothing, where a copy failed."""
        assert self._memory is not None
        with long_operation("checkpoint save"):
            self.wait()
            if not self._memory.copied_everywhere():
                if self._ranks.rank == 0:
                    logger.warning("drain at step %d: the snapshot is not on every next node; saving to disk", step)
                return False
        drain, self._drain = self._drain, 0
        self._drains.committed(drain, step)
        return True

    def wait(self) -> None:
        """Block until the save in flight is committed; raise on every rank if it failed anywhere."""
        in_flight, self._in_flight = self._in_flight, None
        if in_flight is None:
            return
        attempt = in_flight.attempt
        self._agree_or_discard(attempt, in_flight.result, f"background save of step {attempt.step} to {attempt.target}")
        logger.info("committed %s, %.2fs after the save began", attempt.target, time.monotonic() - in_flight.started)
        self._verified.add(attempt.id)
        self._prune()

    def finish(self, step: int, state: dict[str, Any]) -> None:
        """End the job at ``step``: commit ``state`` as ``step`` to disk unless that checkpoint is committed already,
        then ``close``. Call it on every rank after the last step, including when there was nothing left to train:
        a run resumed at its last step may have loaded it from memory, which dies with elastic-run's agents, and a
        job that ended with its last state in memory only would have trained for nothing."""
        self._ensure_open()
        with long_operation("checkpoint save"):
            self.wait()
            durable = self._ranks.agree(
                lambda: any(entry.committed for entry in scan(self.directory) if entry.step == step),
                f"looking for step {step} in {self.directory}",
                only_rank0=True,
            )
            if not durable:
                self._save(step, state, in_background=False)
        self.close()

    def close(self) -> None:
        """Wait for the save in flight, then release the stager and the manager's own process group."""
        if self._closed:
            return
        self._closed = True
        try:
            self.wait()
            if self._memory is not None:
                self._memory.wait_for_copy()
        finally:
            self._saver.close()
            if self._owns_group and self._ranks.group is not None and dist.is_initialized():
                dist.destroy_process_group(self._ranks.group)
            if self._drains.group is not None and dist.is_initialized():
                dist.destroy_process_group(self._drains.group)

    def _ensure_open(self) -> None:
        if self._closed:
            raise RuntimeError(f"the CheckpointManager of {self.directory} is closed; create a new one")

    def _save(self, step: int, state: dict[str, Any], in_background: bool) -> None:
        if step < 0:
            raise ValueError(f"step must be >= 0, got {step}")
        started = time.monotonic()
        state_dict = state_dicts(state)
        reject_per_rank_values(state_dict, self._ranks)
        if self._fence is None:
            self._fence = self._ranks.agree(
                self._claim, f"claiming {self.directory} for this round's saves", only_rank0=True
            )
        fence = self._fence
        attempt = self._ranks.agree(
            lambda: prepare_attempt(self.directory, step, fence),
            f"preparing step {step} in {self.directory}",
            only_rank0=True,
        )
        if attempt is None:
            logger.warning("%s is already committed; not saving step %d again", step_dir(self.directory, step), step)
            return
        if in_background:
            self._in_flight = self._saver.start(attempt, state_dict, started)
            elapsed = time.monotonic() - started
            logger.info("staged step %d in %.2fs; writing %s in the background", step, elapsed, attempt.folder)
            return
        aborts = process_groups.aborts()
        try:
            metadata_sha256 = self._saver.write(attempt, state_dict)
        except (RankFailure, CheckpointException) as error:  # raised on every rank
            self._raise_failed(attempt, error, f"saving step {step} to {attempt.target}")
        except Exception:
            self._discard(attempt)
            raise

        def commit() -> None:
            process_groups.check_not_aborted(aborts, f"the save of step {step}")
            commit_attempt(attempt, self._ranks.world_size, metadata_sha256)

        self._agree_or_discard(
            attempt,
            commit,
            f"committing {attempt.target}",
            only_rank0=True,
        )
        logger.info("saved and committed %s in %.2fs", attempt.target, time.monotonic() - started)
        self._verified.add(attempt.id)
        self._prune()

    def _memory_snapshots(self, snapshots: Ranks) -> MemorySnapshots | None:
        """Snapshots in the memory elastic-run's agents hold, taken on ``snapshots``, when every rank runs under
        one (collective)."""
        copies = Ranks.dedicated(None)
        root = memory_dir_from_env()
        nodes = snapshots.gather(None if root is None else node_of(root))
        if root is None or None in nodes:
            if snapshots.rank == 0:
                logger.warning(
                    "memory_every=%d: no snapshots in memory, since %s is not set on every rank (elastic-run sets "
                    "it); saving to disk only",
                    self.config.memory_every,
                    MEMORY_DIR_ENV,
                )
            return None
        return MemorySnapshots(root, snapshots, copies.group, nodes)

    def _pause_memory_snapshots(self, step: int, error: BaseException) -> None:
        """A snapshot in memory failed on some rank, most likely for want of room in the nodes' shared memory, and
        would fail again at the next steps: they pause (``SnapshotPause``), the disk checkpoints go on, and the
        snapshots already held stay loadable. Rank 0 says why once, not at every try."""
        assert self._memory is not None
        self._memory.discard(step)
        retry_at = self._memory_pause.failed(step, self.config.memory_every)
        if self._ranks.rank == 0 and self._memory_pause.failures == 1:
            logger.warning(
                "could not snapshot step %d into the nodes' memory (%s): snapshots in memory are off, checkpoints "
                "go to disk only; tried again at step %d, then less and less often. Give the nodes more shared "
                "memory (docker run --shm-size, or a larger /dev/shm) or pass memory_every=0",
                step,
                describe_error(error),
                retry_at,
            )

    def _load_from_memory(self, state: dict[str, Any]) -> int | None:
        """Load the newest memory snapshot if no committed checkpoint is newer; its step, else None. The nodes'
        inventories and the directory's listing are gathered in one collective."""
        memory = self._memory
        assert memory is not None
        ranks = self._ranks

        def look() -> tuple[Inventory | None, list[CheckpointEntry] | None]:
            return memory.inventory(), scan(self.directory) if ranks.rank == 0 else None

        looks = ranks.each(look, f"listing {self.directory} and the snapshots in memory")
        found = found_in([inventory for inventory, _ in looks])
        entries = looks[0][1]
        assert entries is not None
        committed = [entry for entry in entries if entry.committed]
        if found is None or (committed and committed[-1].step > found.step):
            return None
        try:
            memory.load(found, state)
        except (RankFailure, CheckpointException) as error:  # raised on every rank; the disk load overwrites all
            logger.warning("could not load step %d from memory (%s); loading from disk", found.step, error)
            return None
        self._seen_at_load = {entry.key for entry in committed}
        return found.step

    def _claim(self) -> Fence:
        """Claim the directory (rank 0); the commits it keeps counting are those load_latest listed, if it ran."""
        seen = self._seen_at_load

        def admitted() -> set[str]:
            valid = {entry.key for entry in scan(self.directory) if entry.committed}
            return valid if seen is None else valid & seen

        return claim(self.directory, self._round, self._run_id, admitted)

    def _agree_or_discard(self, attempt: Attempt, action: Any, what: str, only_rank0: bool = False) -> None:
        try:
            self._ranks.agree(action, what, only_rank0=only_rank0)
        except RankFailure as error:
            self._raise_failed(attempt, error, what)

    def _raise_failed(self, attempt: Attempt, error: RankFailure | CheckpointException, what: str) -> NoReturn:
        """Discard the attempt of a save that failed on some rank (every rank knows it), and raise the failure as a
        RankFailure (DCP's CheckpointException is no Exception: a script's handlers, elastic.run and torchrun's
        error file all miss it), saying so when the disk is full: a full disk surfaces as whatever the writer
        tripped on ("unexpected pos 704 vs 598"). The space is measured before the attempt is deleted."""
        shortage = self._ranks.agree(
            lambda: _space_shortage(self.directory), f"measuring the free space of {self.directory}", only_rank0=True
        )
        self._discard(attempt)
        if isinstance(error, RankFailure) and not shortage:
            raise error
        message = str(error) if isinstance(error, RankFailure) else f"{what} failed: {describe_error(error)}"
        if shortage:  # first: a line cut short keeps it
            message = f"{shortage}: {message}. Free some space, or keep fewer checkpoints (CheckpointManager's keep)"
        raise RankFailure(message) from error

    def _discard(self, attempt: Attempt) -> None:
        if self._ranks.rank != 0:
            return
        try:
            discard_attempt(attempt)
        except OSError as error:
            logger.warning("could not delete %s, the folder of a failed save: %s", attempt.folder, error)

    def _prune(self) -> None:
        if self._ranks.rank != 0:
            return
        try:
            prune(self.directory, self.config.keep, self._verified)
        except (OSError, CheckpointError) as error:
            logger.warning("could not delete old checkpoints in %s: %s", self.directory, error)

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
            self.directory,
            time.monotonic() - started,
            self._ranks.world_size,
        )


def _space_shortage(directory: Path) -> str | None:
    """What to say about ``directory``'s filesystem when it is (nearly) full: a save that failed there most likely
    failed for want of room."""
    try:
        status = os.statvfs(directory)
    except OSError:
        return None
    free, size = status.f_bavail * status.f_frsize, status.f_blocks * status.f_frsize
    if free >= min(size // 20, 1 << 30):
        return None
    return f"no room in {directory} ({free / 2**20:.1f} MiB free of {size / 2**20:.1f} MiB)"
