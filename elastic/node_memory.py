"""The node's shared-memory folder, where workers keep checkpoint snapshots (elastic/checkpoint/memory.py).

elastic-run's agent empties it when it starts and removes it when it exits, and names it to its workers in
``ELASTIC_MEMORY_DIR``: snapshots outlive a crashed worker, not the job's agent on this node. It lies on tmpfs
(``/dev/shm``), so a snapshot is a copy in RAM; where no writable ``/dev/shm`` exists, in the temp folder.
"""

from __future__ import annotations

import logging
import os
import shutil
import tempfile
from pathlib import Path

logger = logging.getLogger(__name__)

MEMORY_DIR_ENV = "ELASTIC_MEMORY_DIR"
SHARED_MEMORY = Path("/dev/shm")


def node_memory_dir(job_id: str, node_id: str) -> Path:
    """The folder of ``node_id``'s snapshots in job ``job_id`` (both are restricted to [A-Za-z0-9._:-])."""
    base = SHARED_MEMORY if os.access(SHARED_MEMORY, os.W_OK) else Path(tempfile.gettempdir())
    return base / f"elastic-{job_id}-{node_id.replace(':', '_')}"


def memory_dir_from_env() -> Path | None:
    value = os.environ.get(MEMORY_DIR_ENV)
    return Path(value) if value else None


def create_empty(folder: Path) -> None:
    """Make ``folder`` empty and private; what an earlier agent of this node left there is not this one's."""
    shutil.rmtree(folder, ignore_errors=True)
    folder.mkdir(mode=0o700, parents=True)


def remove(folder: Path) -> None:
    """Free the node's snapshots: the job is over on this node."""
    shutil.rmtree(folder, ignore_errors=True)
    logger.debug("removed the node's memory snapshots in %s", folder)
