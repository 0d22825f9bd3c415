"""The DCP storage writer for our checkpoints: one fsynced file per rank, without zip CRCs."""

from __future__ import annotations

from pathlib import Path

import torch.utils.serialization as serialization
from torch.distributed.checkpoint import FileSystemWriter
from torch.distributed.checkpoint.metadata import Metadata
from torch.distributed.checkpoint.planner import SavePlan, SavePlanner
from torch.distributed.checkpoint.storage import WriteResult
from torch.futures import Future

from elastic.checkpoint.integrity import metadata_digest


class CheckpointWriter(FileSystemWriter):
    """FileSystemWriter that skips the CRC32 torch.save computes over every tensor record.

    torch.load never verifies that CRC, and computing it costs about as much CPU as the write
    itself, which on a busy host halves save throughput. The files stay plain DCP.

    On the coordinator it also keeps the digest of the ``.metadata`` it wrote: the commit checks that
    the folder it finalises still holds exactly that file, which lists the files this save's ranks wrote.
    """

    def __init__(self, folder: Path) -> None:
        super().__init__(folder, single_file_per_rank=True, sync_files=True, thread_count=1, overwrite=True)
        self.metadata_sha256: str | None = None

    def write_data(self, plan: SavePlan, planner: SavePlanner) -> Future[list[WriteResult]]:
        # With thread_count=1 the whole write happens inside this call, on this thread.
        # install_config_module adds patch() to the config module at runtime; torch ships no typing for it
        with serialization.config.patch({"save.compute_crc32": False}):  # type: ignore[attr-defined]  # see above
            return super().write_data(plan, planner)

    def finish(self, metadata: Metadata, results: list[list[WriteResult]]) -> None:
        super().finish(metadata, results)
        self.metadata_sha256 = metadata_digest(Path(self.path))
