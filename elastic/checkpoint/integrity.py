"""Checks that a checkpoint folder can really be read from here: DCP metadata and every data file it names."""

from __future__ import annotations

import hashlib
import re
from pathlib import Path

from torch.distributed.checkpoint import FileSystemReader
from torch.distributed.checkpoint.metadata import Metadata

from elastic.checkpoint.errors import CheckpointError

DCP_METADATA_FILE = ".metadata"
_DCP_DATA_FILE = re.compile(r"__(\d+)_\d+\.distcp")


def read_metadata(folder: Path) -> Metadata:
    """DCP's metadata of ``folder``; raises CheckpointError naming the folder when it is missing or garbage."""
    try:
        metadata = FileSystemReader(folder).read_metadata()
    except FileNotFoundError:
        raise CheckpointError(f"{folder} cannot be read: it has no DCP {DCP_METADATA_FILE}") from None
    except Exception as error:  # unpickling garbage raises anything
        raise CheckpointError(f"{folder} cannot be read: its DCP {DCP_METADATA_FILE} is garbage ({error!r})") from None
    if not isinstance(metadata, Metadata) or not isinstance(metadata.storage_data, dict):
        raise CheckpointError(f"{folder} cannot be read: its DCP {DCP_METADATA_FILE} is not DCP metadata")
    return metadata


def metadata_digest(folder: Path) -> str:
    """SHA-256 of DCP's ``.metadata`` in ``folder``: what ties a commit to the metadata its own save wrote."""
    digest = hashlib.sha256()
    with open(folder / DCP_METADATA_FILE, "rb") as stream:
        for block in iter(lambda: stream.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()


def verify_readable(folder: Path, metadata_sha256: str | None = None) -> None:
    """Check that DCP's metadata of ``folder`` and every data file it names exist here, long enough.

    Catches a rank whose file never reached shared storage, or a file cut short, before a load trips on it.
    With ``metadata_sha256`` (from the commit record), also that ``.metadata`` is the one that save wrote.
    """
    metadata = read_metadata(folder)
    if metadata_sha256 is not None and metadata_digest(folder) != metadata_sha256:
        raise CheckpointError(
            f"{folder} cannot be read: its DCP {DCP_METADATA_FILE} is not the one its save wrote "
            "(its SHA-256 differs from the one recorded when that save finished); something replaced it"
        )
    needed_bytes: dict[str, int] = {}
    for info in metadata.storage_data.values():
        needed_bytes[info.relative_path] = max(needed_bytes.get(info.relative_path, 0), info.offset + info.length)
    for relative_path, needed in sorted(needed_bytes.items()):
        path = folder / relative_path
        try:
            size = path.stat().st_size
        except OSError as error:
            raise CheckpointError(
                f"{folder} cannot be read from here: data file {relative_path} is not visible ({error.strerror}); "
                "every rank must see the same checkpoint directory (use storage shared by all nodes)"
            ) from None
        if size < needed:
            raise CheckpointError(
                f"{folder} cannot be read from here: data file {relative_path} has {size} bytes, "
                f"the metadata needs {needed}; the file was cut short or is still being copied"
            )


def writer_count(metadata: Metadata) -> int | None:
    """How many ranks wrote a checkpoint, from the names of the data files DCP's FileSystemWriter gives each rank
    (``__<rank>_<n>.distcp``); None when its files are named otherwise. A rank whose every value another rank
    also wrote may write no file, so this can undercount: it is for checkpoints that carry no commit record."""
    ranks = [_DCP_DATA_FILE.fullmatch(info.relative_path) for info in metadata.storage_data.values()]
    if not ranks or not all(ranks):
        return None
    return 1 + max(int(match.group(1)) for match in ranks if match)
