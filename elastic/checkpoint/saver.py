"""Writing one attempt's data with DCP: in the foreground, or in the background behind one stager kept for the
manager's life (it reuses its CPU copies, so staging after the first save is a memcpy).

Saves here and in `elastic.checkpoint.memory` use DCP's default planner, without plan caching: DCP caches plans
per planner class for the whole process, and a round re-entered in process (`elastic.run`) at another world size
merged its plans with the last world's (half of each tensor missing, in tests). A memory snapshot reuses a plan
of its own instead, kept by the round's manager (`elastic.checkpoint.snapshot_plans`)."""

from __future__ import annotations

from concurrent.futures import Future
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.staging import DefaultStager, StagingOptions
from torch.distributed.checkpoint.state_dict_saver import AsyncCheckpointerType

from elastic import process_groups
from elastic.checkpoint.attempt import Attempt, commit_attempt
from elastic.checkpoint.ranks import Ranks
from elastic.checkpoint.writer import CheckpointWriter


@dataclass
class SaveInFlight:
    """A background save: its ranks' upload, and rank 0's commit once every rank's data is on disk."""

    attempt: Attempt
    upload: Future
    committed: Future  # set by rank 0 once the attempt is renamed to step-<N>; already done on other ranks
    started: float

    def result(self) -> None:
        """Wait for the upload and the commit; raise the first that failed."""
        self.upload.result()
        self.committed.result()


class AttemptSaver:
    """Writes attempts of the ranks in ``ranks`` with DCP."""

    def __init__(self, ranks: Ranks, in_background: bool) -> None:
        self.ranks = ranks
        # With CUDA, the copies are pinned and filled by non-blocking copies (synchronised before the write).
        on_gpu = torch.cuda.is_available()
        options = StagingOptions(
            use_pinned_memory=on_gpu, use_shared_memory=False, use_async_staging=False, use_non_blocking_copy=on_gpu
        )
        self._stager = DefaultStager(options) if in_background else None

    def write(self, attempt: Attempt, state_dict: dict[str, Any]) -> str | None:
        """Write ``attempt`` on every rank and return the digest of DCP's metadata (rank 0; None elsewhere).
        A failure is raised on every rank, once every rank stopped writing."""
        writer = CheckpointWriter(attempt.folder)
        dcp.save(
            state_dict,
            storage_writer=writer,
            process_group=self.ranks.group,
            no_dist=self.ranks.group is None,
        )
        return writer.metadata_sha256

    def start(self, attempt: Attempt, state_dict: dict[str, Any], started: float) -> SaveInFlight:
        """Stage ``state_dict`` and write it in the background; rank 0 commits as soon as every rank's data and
        DCP's metadata are on disk, so the checkpoint is committed even if training never waits for it. ``started``:
        when the save began (time.monotonic()), for the log of its commit."""
        assert self._stager is not None, "background saves need the stager of an in_background saver"
        aborts = process_groups.aborts()
        writer = CheckpointWriter(attempt.folder)
        upload = dcp.async_save(
            state_dict,
            storage_writer=writer,
            process_group=self.ranks.group,
            async_checkpointer_type=AsyncCheckpointerType.THREAD,
            async_stager=self._stager,
            no_dist=self.ranks.group is None,
        )
        # The stager stages synchronously (use_async_staging=False), so async_save hands back the upload's future
        # itself; an AsyncSaveResponse comes only from a stager that returns a staging future.
        assert isinstance(upload, Future)
        committed: Future = Future()
        if self.ranks.rank == 0:
            upload.add_done_callback(lambda done: self._commit_after_upload(done, attempt, writer, committed, aborts))
        else:
            committed.set_result(None)
        return SaveInFlight(attempt, upload, committed, started)

    def close(self) -> None:
        if self._stager is not None:
            self._stager.close()

    def _commit_after_upload(
        self, upload: Future, attempt: Attempt, writer: CheckpointWriter, committed: Future, aborts: int
    ) -> None:
        # runs on rank 0's writer thread
        try:
            upload.result()
            process_groups.check_not_aborted(aborts, f"the background save of step {attempt.step}")
            commit_attempt(attempt, self.ranks.world_size, writer.metadata_sha256)
        except BaseException as error:  # handed to the manager's wait(), which raises it on every rank
            committed.set_exception(error)
        else:
            committed.set_result(None)
