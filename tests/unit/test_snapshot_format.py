"""The snapshot file format: raw tensor bytes under DCP's metadata, read back value for value."""

from __future__ import annotations

import errno

import pytest
import torch
import torch.distributed.checkpoint as dcp
from small_tmpfs import small_tmpfs, used_bytes
from torch.distributed.checkpoint import FileSystemReader, FileSystemWriter

from elastic.checkpoint.snapshot_format import MappedFiles, RawBytes, SnapshotReader, SnapshotWriter, filled_in_place

pytestmark = pytest.mark.timeout(60)


def state() -> dict:
    generator = torch.Generator().manual_seed(0)
    return {
        "weights": torch.randn(5, 3, generator=generator),
        "half": torch.randn(7, generator=generator).to(torch.bfloat16),  # 14 bytes: the next item must realign
        "mask": torch.rand(3, generator=generator) > 0.5,
        "step": torch.tensor(41, dtype=torch.int64),
        "transposed": torch.arange(6.0).reshape(2, 3).t(),  # not contiguous
        "extra": {"name": "run-1", "lrs": [0.1, 0.01]},
    }


def blank_like(saved: dict) -> dict:
    return {
        name: torch.zeros_like(value) if isinstance(value, torch.Tensor) else {"name": "", "lrs": []}
        for name, value in saved.items()
    }


def test_every_tensor_is_stored_as_aligned_raw_bytes_and_read_back_exactly(tmp_path):
    saved = state()
    dcp.save(saved, storage_writer=SnapshotWriter(tmp_path, MappedFiles(2)), no_dist=True)
    storage = FileSystemReader(tmp_path).read_metadata().storage_data
    tensors = {index.fqn: info for index, info in storage.items() if not index.fqn.startswith("extra")}
    assert all(isinstance(info, RawBytes) and info.offset % 64 == 0 for info in tensors.values())
    assert tensors["weights"].length == 5 * 3 * 4 and tensors["step"].length == 8

    loaded = blank_like(saved)
    dcp.load(loaded, storage_reader=SnapshotReader(tmp_path), no_dist=True)
    for name, value in saved.items():
        if isinstance(value, torch.Tensor):
            assert loaded[name].dtype == value.dtype and torch.equal(loaded[name], value), name
    assert loaded["extra"] == saved["extra"]


def test_a_snapshot_written_as_a_disk_checkpoint_is_read_by_the_disk_path(tmp_path):
    saved = state()
    dcp.save(saved, storage_writer=FileSystemWriter(tmp_path), no_dist=True)
    loaded = blank_like(saved)
    dcp.load(loaded, storage_reader=SnapshotReader(tmp_path), no_dist=True)
    assert all(torch.equal(loaded[n], v) for n, v in saved.items() if isinstance(v, torch.Tensor))


def test_a_snapshot_written_over_an_older_file_reads_back_its_own_values(tmp_path):
    """The same file, mapped once, takes a snapshot of the same size (a later step), then a smaller one."""
    files = MappedFiles(2)
    older = state()
    dcp.save(older, storage_writer=SnapshotWriter(tmp_path, files), no_dist=True)
    for newer in ({**older, "weights": older["weights"] + 1}, {"weights": torch.ones(2, 2)}):
        dcp.save(newer, storage_writer=SnapshotWriter(tmp_path, files), no_dist=True)
        loaded = blank_like(newer)
        dcp.load(loaded, storage_reader=SnapshotReader(tmp_path), no_dist=True)
        assert all(torch.equal(loaded[n], v) for n, v in newer.items() if isinstance(v, torch.Tensor))
    assert (tmp_path / "__0_0.distcp").stat().st_size == 2 * 2 * 4, "the file holds the smaller snapshot alone"


def test_a_file_that_does_not_fit_raises_enospc_before_a_byte_is_written(tmp_path):
    """tmpfs allots a page when it is first written: writing through the mapping of a file larger than the room
    left killed the writer with SIGBUS (a container's 64 MB /dev/shm and a real model). Its pages are now allotted
    when the file is made, so a full filesystem is an OSError the checkpoint code can handle."""
    with small_tmpfs(tmp_path / "shm", 64 << 10) as shm:
        with pytest.raises(OSError) as raised:
            MappedFiles(2).of_size(shm / "snapshot", 1 << 20)
        assert raised.value.errno == errno.ENOSPC
        fits = MappedFiles(2).of_size(shm / "fits", 32 << 10)
        fits.fill_(7)
        assert used_bytes(shm) >= 32 << 10


def test_only_the_ranges_asked_for_take_memory(tmp_path):
    """A load receives a few ranges of another node's file into a sparse one: only those take pages."""
    with small_tmpfs(tmp_path / "shm", 64 << 10) as shm:
        sparse = filled_in_place(shm / "sparse", 1 << 30, [(0, 4096), (1 << 29, 4096)])
        sparse[(1 << 29) : (1 << 29) + 4096] = 1
        assert used_bytes(shm) <= 16 << 10
        with pytest.raises(OSError):
            filled_in_place(shm / "too-much", 1 << 30, [(0, 1 << 20)])
