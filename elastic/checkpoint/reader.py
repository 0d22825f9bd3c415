"""The DCP storage reader for our loads: reads only the rows a rank needs when it loads a resharded checkpoint.

DCP's FileSystemReader deserialises a whole saved chunk and then narrows it, so at 8 ranks each rank
of a 4-rank checkpoint reads twice the bytes it keeps. A chunk is one torch.save'd contiguous tensor,
so a slice along dim 0 is one byte range of its storage record; this reader reads just that range.
Anything else (objects, slices along other dims, transformed records) goes through DCP's own path.

A failure while reading or decoding the data is raised as UnreadableDataError, so the manager can
tell a damaged checkpoint (set aside, load the previous one) from a state that does not fit it.
"""

from __future__ import annotations

import dataclasses
import io
import math
import sys
from typing import IO, Any, cast

import torch
from torch.distributed.checkpoint import FileSystemReader, Metadata
from torch.distributed.checkpoint.planner import LoadItemType, LoadPlan, LoadPlanner, ReadItem
from torch.futures import Future

from elastic.checkpoint.errors import UnreadableDataError
from elastic.checkpoint.torch_internals import RecordView, storage_record_offset


class CheckpointReader(FileSystemReader):
    def __init__(self, *args: Any, metadata: Metadata | None = None, **kwargs: Any) -> None:
        """``metadata``: the folder's, where the caller unpickled it already."""
        super().__init__(*args, **kwargs)
        self._metadata = metadata

    def read_metadata(self, *args: Any, **kwargs: Any) -> Metadata:
        """The folder's metadata, unpickled once by this reader: a load reads it to decide what it loads, and DCP
        again to plan the reads (3 ms of CPU each time, at every rank, in every change of round)."""
        if args or kwargs:  # another rank's metadata file: not the one kept
            return super().read_metadata(*args, **kwargs)
        if self._metadata is None:
            self._metadata = super().read_metadata()
        return self._metadata

    def read_data(self, plan: LoadPlan, planner: LoadPlanner) -> Future[None]:
        # Planning (keys, shapes) is over by now: what fails here are the bytes on disk.
        try:
            return self._read_data(plan, planner)
        except Exception as error:  # torch.load and unpickling of damaged bytes raise anything
            first_line = (str(error).strip().splitlines() or [""])[0]
            raise UnreadableDataError(f"{self.path} cannot be read: {type(error).__name__}: {first_line}") from error

    def _read_data(self, plan: LoadPlan, planner: LoadPlanner) -> Future[None]:
        by_file: dict[str, list[ReadItem]] = {}
        for request in plan.items:
            by_file.setdefault(self.storage_data[request.storage_index].relative_path, []).append(request)
        left_to_dcp: list[ReadItem] = []
        for relative_path, requests in by_file.items():
            with open(self.fs.concat_path(self.path, relative_path), "rb") as stream:
                for request in requests:
                    if request.type == LoadItemType.BYTE_IO or not self._read_rows(stream, request, planner):
                        left_to_dcp.append(request)
        if left_to_dcp:
            return super().read_data(dataclasses.replace(plan, items=left_to_dcp), planner)
        done: Future[None] = Future()
        done.set_result(None)
        return done

    def _read_rows(self, stream: io.BufferedReader, request: ReadItem, planner: LoadPlanner) -> bool:
        """Read ``request`` straight from the storage record; False when it needs DCP's general path."""
        info = self.storage_data[request.storage_index]
        if info.transform_descriptors or sys.byteorder != "little":
            return False
        storage = storage_record_offset(stream, info.offset, info.length)
        if storage is None:
            return False
        record_offset, _ = storage
        # map_location="meta" reads the pickled header only: shape, strides, dtype, no data.
        record = cast(IO[bytes], RecordView(stream, info.offset, info.length))  # a readable, seekable binary file
        saved = torch.load(record, map_location="meta", weights_only=True)
        offsets, lengths = list(request.storage_offsets), list(request.lengths)
        whole_rows = all(
            offset == 0 and length == size for offset, length, size in zip(offsets[1:], lengths[1:], saved.shape[1:])
        )
        if not saved.is_contiguous() or not whole_rows:
            return False
        first_element = saved.storage_offset() + (offsets[0] * saved.stride(0) if offsets else 0)
        rows = torch.empty(lengths, dtype=saved.dtype)
        stream.seek(info.offset + record_offset + first_element * saved.element_size())
        wanted = math.prod(lengths) * saved.element_size()
        rows_bytes = rows.view(-1).view(torch.uint8).numpy()
        # numpy's stubs give ndarray the buffer protocol (__buffer__) only from Python 3.12 on
        if stream.readinto(rows_bytes) != wanted:  # type: ignore[arg-type]  # an ndarray is a writable buffer
            raise OSError(f"{stream.name} ended before the {wanted} bytes of {request.storage_index.fqn}")
        target = planner.resolve_tensor(request).detach()
        if target.size() != rows.size():
            raise ValueError(
                f"{request.storage_index.fqn}: saved slice {tuple(rows.size())} != target {tuple(target.size())}"
            )
        target.copy_(rows)
        planner.commit_tensor(request, target)
        return True
