"""Writes that survive a crash and that readers on other nodes see whole or not at all."""

from __future__ import annotations

import os
import uuid
from pathlib import Path


def fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _write_tmp(path: Path, data: bytes) -> Path:
    # A unique name, so two writers of the same file never write into one tmp file.
    tmp = path.with_name(f".{path.name}.{uuid.uuid4().hex[:8]}.tmp")
    with open(tmp, "wb") as stream:
        stream.write(data)
        stream.flush()
        os.fsync(stream.fileno())
    return tmp


def write_durably(path: Path, data: bytes) -> None:
    """Write via a tmp file, fsync, atomic rename and fsync of the folder, so readers see all of it or nothing."""
    tmp = _write_tmp(path, data)
    os.replace(tmp, path)
    fsync_dir(path.parent)


def create_exclusively(path: Path, data: bytes) -> bool:
    """Create ``path`` holding ``data`` unless it exists; False when another writer created it first.

    A hard link of a complete tmp file is atomic and fails on an existing name, so a reader never
    sees a half-written file and of two writers racing for one name exactly one wins.
    """
    tmp = _write_tmp(path, data)
    try:
        os.link(tmp, path)
    except FileExistsError:
        return False
    except OSError:  # no hard links here (some FUSE file systems): exclusive create, then one write
        try:
            fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)
        except FileExistsError:
            return False
        with os.fdopen(fd, "wb") as stream:
            stream.write(data)
            stream.flush()
            os.fsync(stream.fileno())
    finally:
        tmp.unlink()
    fsync_dir(path.parent)
    return True
