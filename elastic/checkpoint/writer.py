"""The DCP storage writer for our checkpoints: one fsynced file per rank."""

from __future__ import annotations

from pathlib import Path

from torch.distributed.checkpoint import FileSystemWriter
from torch.distributed.checkpoint.metadata import Metadata
from torch.distributed.checkpoint.storage import WriteResult

from elastic.checkpoint.integrity import metadata_digest


class CheckpointWriter(FileSystemWriter):
    """FileSystemWriter with one fsynced file per rank, written by the calling thread.

    On the coordinator it also keeps the digest of the ``.metadata`` it wrote: the commit checks that
    the folder it finalises still holds exactly that file, which lists the files this save's ranks wrote.
    """

    def __init__(self, folder: Path) -> None:
        super().__init__(folder, single_file_per_rank=True, sync_files=True, thread_count=1, overwrite=True)
        self.metadata_sha256: str | None = None

    def finish(self, metadata: Metadata, results: list[list[WriteResult]]) -> None:
        super().finish(metadata, results)
        self.metadata_sha256 = metadata_digest(Path(self.path))
