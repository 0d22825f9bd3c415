"""A tmpfs of a few hundred kilobytes mounted for one test, to fill as a container's small /dev/shm fills."""

from __future__ import annotations

import contextlib
import os
import subprocess
from collections.abc import Iterator
from pathlib import Path

import pytest


@contextlib.contextmanager
def small_tmpfs(path: Path, size: int) -> Iterator[Path]:
    """``path`` as a tmpfs of ``size`` bytes (rounded up to pages), unmounted after; skips the test without root."""
    if os.geteuid() != 0:
        pytest.skip("mounting a tmpfs needs root")
    path.mkdir(parents=True, exist_ok=True)
    subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={size}", "tmpfs", str(path)], check=True, timeout=10)
    try:
        yield path
    finally:
        subprocess.run(["umount", "--lazy", str(path)], check=True, timeout=10)


def used_bytes(path: Path) -> int:
    status = os.statvfs(path)
    return (status.f_blocks - status.f_bfree) * status.f_frsize
