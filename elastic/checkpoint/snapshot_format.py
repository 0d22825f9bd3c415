"""The file format of snapshots in memory: DCP's metadata, and each tensor as its raw bytes.

A disk checkpoint stores each tensor as a torch.save record (a zip entry with a checksum), which costs a pass
over the bytes to write and a header to parse per tensor to read. A snapshot lives in shared memory for minutes
and is read back by the same code that wrote it, so it stores the bytes alone, aligned, and is read by mapping
its file and copying each chunk (or the rows a resharded rank keeps) straight into the state's tensors. The
metadata is DCP's own, so planning, resharding and the foreign-key checks work as for a disk checkpoint.
"""

from __future__ import annotations

import collections
import contextlib
import dataclasses
import io
import os
from collections.abc import Iterable
from pathlib import Path

import torch
from torch.distributed.checkpoint import FileSystemWriter
from torch.distributed.checkpoint.filesystem import _StoragePrefix
from torch.distributed.checkpoint.metadata import Metadata, MetadataIndex, TensorStorageMetadata
from torch.distributed.checkpoint.planner import (
    LoadItemType,
    LoadPlan,
    LoadPlanner,
    ReadItem,
    SavePlan,
    SavePlanner,
    WriteItem,
    WriteItemType,
)
from torch.distributed.checkpoint.storage import WriteResult
from torch.futures import Future

from elastic.checkpoint.reader import CheckpointReader

_ALIGNMENT = 64  # every tensor starts on a multiple of any element size, so a mapped file views as its dtype


@dataclasses.dataclass(frozen=True)
class RawBytes:
    """Where one item's raw bytes lie; read by DCP's code as its own storage info (the same fields)."""

    relative_path: str
    offset: int
    length: int
    transform_descriptors: None = None


def mapped_file(path: Path) -> torch.Tensor:
    """A file's bytes as a tensor, mapped copy-on-write: read in place, no copy in this process."""
    return torch.from_file(str(path), shared=False, size=path.stat().st_size, dtype=torch.uint8)


def filled_in_place(path: Path, size: int, ranges: Iterable[tuple[int, int]] | None = None) -> torch.Tensor:
    """``path``, created or resized to ``size`` bytes, mapped shared: what is written to the tensor is in the file.
    Its pages (only those of the ``(offset, length)`` ranges, when given) are allotted first. tmpfs allots a page
    when it is first written, and a write through a mapping that finds the filesystem full kills the process with
    SIGBUS (a container's /dev/shm is 64 MB unless told otherwise); allotted first, a full one raises ENOSPC
    before a byte is written."""
    with open(path, "ab") as stream:
        stream.truncate(size)
        for offset, length in [(0, size)] if ranges is None else ranges:
            if length:
                os.posix_fallocate(stream.fileno(), offset, length)
    return torch.from_file(str(path), shared=True, size=size, dtype=torch.uint8) if size else _EMPTY


def storage_of(rank: int) -> _StoragePrefix:
    """The storage data DCP's global plan gives rank ``rank``'s plan (FileSystemWriter.prepare_global_plan): the
    prefix of the file it writes."""
    return _StoragePrefix(f"__{rank}_")


def data_file(rank: int) -> str:
    """The file that rank ``rank`` of the saving group writes its items to."""
    return f"{storage_of(rank).prefix}0.distcp"


class MappedFiles:
    """This process's shared mappings of the snapshot files it wrote last. Writing the next snapshot over one of
    them (memory.py reuses the oldest snapshot's files) is then a memory copy: mapping a file anew, or write(),
    takes a fault per page, which costs twice the copy itself."""

    def __init__(self, keep: int) -> None:
        self._keep = keep
        self._mapped: collections.OrderedDict[tuple[int, int], torch.Tensor] = collections.OrderedDict()

    def of_size(self, path: Path, size: int) -> torch.Tensor:
        """The bytes of ``path``, created or resized to ``size``, as a tensor: what is written to it is in the file.
        A full filesystem raises ENOSPC here, before anything is written (``filled_in_place``)."""
        key = None
        with contextlib.suppress(FileNotFoundError):
            key = _identity(path)
        mapped = self._mapped.pop(key, None) if key is not None else None
        if mapped is None or mapped.numel() != size:
            mapped = filled_in_place(path, size)
            key = _identity(path)  # a new file, or resized in place
        assert key is not None
        self._mapped[key] = mapped
        while len(self._mapped) > self._keep:  # the files of older snapshots: gone, or to be written anew
            self._mapped.popitem(last=False)
        return mapped


def _identity(path: Path) -> tuple[int, int]:
    status = path.stat()
    return status.st_dev, status.st_ino


_EMPTY = torch.empty(0, dtype=torch.uint8)


class SnapshotWriter(FileSystemWriter):
    """One file per rank, unsynced (shared memory), tensors as raw bytes; objects as DCP pickles them."""

    def __init__(self, folder: Path, files: MappedFiles) -> None:
        super().__init__(folder, single_file_per_rank=True, sync_files=False, thread_count=1, overwrite=True)
        self._files = files

    def write_data(self, plan: SavePlan, planner: SavePlanner) -> Future[list[WriteResult]]:
        name = f"{plan.storage_data.prefix}0.distcp"  # rank i's plan has storage_of(i): data_file(i)
        placed: list[tuple[WriteItem, torch.Tensor, int]] = []
        end = 0
        for item in plan.items:
            data = planner.resolve_data(item)
            if item.type == WriteItemType.BYTE_IO:
                assert isinstance(data, io.BytesIO), "DCP resolves a BYTE_IO item to a BytesIO"
                pickled = bytearray(data.getbuffer())
                payload = torch.frombuffer(pickled, dtype=torch.uint8) if pickled else _EMPTY
            else:
                assert isinstance(data, torch.Tensor), "DCP resolves a tensor item to a tensor"
                end += -end % _ALIGNMENT
                payload = data.detach()
            placed.append((item, payload, end))
            end += payload.numel() * payload.element_size()
        target = self._files.of_size(Path(self.path) / name, end)
        results = []
        for item, payload, offset in placed:
            length = payload.numel() * payload.element_size()
            # from the device too: no staging copy in between
            target[offset : offset + length].view(payload.dtype).view(payload.shape).copy_(payload)
            storage = RawBytes(name, offset, length)
            results.append(WriteResult(index=item.index, size_in_bytes=length, storage_data=storage))
        done: Future[list[WriteResult]] = Future()
        done.set_result(results)
        return done


class SnapshotReader(CheckpointReader):
    """Reads raw items by mapping their file; anything else (a checkpoint written otherwise) as from disk."""

    def set_up_storage_reader(self, metadata: Metadata, is_coordinator: bool, *args, **kwargs) -> None:
        super().set_up_storage_reader(metadata, is_coordinator, *args, **kwargs)
        self._chunks = {
            (fqn, tuple(chunk.offsets)): (entry.properties.dtype, chunk.sizes)
            for fqn, entry in metadata.state_dict_metadata.items()
            if isinstance(entry, TensorStorageMetadata)
            for chunk in entry.chunks
        }

    def _read_data(self, plan: LoadPlan, planner: LoadPlanner) -> Future[None]:
        files: dict[str, torch.Tensor] = {}
        written_otherwise: list[ReadItem] = []
        for request in plan.items:
            storage = self.storage_data[request.storage_index]
            if not isinstance(storage, RawBytes):
                written_otherwise.append(request)
                continue
            if storage.relative_path not in files:
                files[storage.relative_path] = mapped_file(Path(self.path) / storage.relative_path)
            data = files[storage.relative_path][storage.offset : storage.offset + storage.length]
            if request.type == LoadItemType.BYTE_IO:
                planner.load_bytes(request, io.BytesIO(data.numpy().tobytes()))
            else:
                self._copy_chunk(request, data, planner)
        return super()._read_data(dataclasses.replace(plan, items=written_otherwise), planner)

    def _copy_chunk(self, request: ReadItem, data: torch.Tensor, planner: LoadPlanner) -> None:
        index: MetadataIndex = request.storage_index
        dtype, sizes = self._chunks[(index.fqn, tuple(index.offset or ()))]
        saved = data.view(dtype).view(sizes)
        for dim, (start, length) in enumerate(zip(request.storage_offsets, request.lengths)):
            saved = saved.narrow(dim, start, length)
        target = planner.resolve_tensor(request).detach()
        if target.size() != saved.size():
            raise ValueError(f"{index.fqn}: saved slice {tuple(saved.size())} != target {tuple(target.size())}")
        target.copy_(saved)
        planner.commit_tensor(request, target)
