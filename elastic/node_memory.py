"""The node's shared-memory folder, where workers keep checkpoint snapshots (elastic/checkpoint/memory.py).

elastic-run's agent empties it when it starts and removes it when it exits, and names it to its workers in
``ELASTIC_MEMORY_DIR``: snapshots outlive a crashed worker, not the job's agent on this node. It lies on tmpfs
(``/dev/shm``), so a snapshot is a copy in RAM; where no writable ``/dev/shm`` exists, in the temp folder.

An agent killed by SIGKILL cannot remove its folder, and tmpfs holds it until the host reboots. So the folder
names its owner (``owner.json``: pid, the process's start time, its pid namespace), and an agent that starts frees
the folders whose owner is gone: in its own pid namespace only, since another container sharing ``/dev/shm``
has pids this one cannot see. One agent on a host sweeps per minute (a stamp file says when), so that a host
running many agents does not read every folder's owner once per agent. Making a folder and sweeping hold one
lock of the host (``flock`` on a file beside the folders): an agent restarted with its node id re-creates the
folder a sweeper just found abandoned, and the sweep must not delete the new one.
"""

from __future__ import annotations

import contextlib
import fcntl
import json
import logging
import os
import shutil
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path

logger = logging.getLogger(__name__)

MEMORY_DIR_ENV = "ELASTIC_MEMORY_DIR"
SHARED_MEMORY = Path("/dev/shm")
OWNER = "owner.json"
SWEEP_EVERY_S = 60.0
_PREFIX = "elastic-"
_SWEPT = ".elastic-memory-swept"
_LOCK = ".elastic-memory-lock"


def node_memory_dir(job_id: str, node_id: str, agent_pid: int) -> Path:
    """The folder of ``node_id``'s snapshots in job ``job_id`` (both are restricted to [A-Za-z0-9._:-]), held by
    the agent ``agent_pid``. The pid is in the name, as in the agent's doorbell: two agents with one job id and
    node id on one host (two jobs that name theirs alike against two etcds) never empty each other's folder."""
    return memory_base() / f"{_PREFIX}{job_id}-{node_id.replace(':', '_')}-{agent_pid}"


def job_memory_dirs(job_id: str) -> list[Path]:
    """The folders of job ``job_id``'s agents on this host, for a harness that killed them to remove."""
    return sorted(memory_base().glob(f"{_PREFIX}{job_id}-*"))


def memory_base() -> Path:
    """Where the nodes' folders lie: ``/dev/shm``, or the temp folder where no writable ``/dev/shm`` exists."""
    return SHARED_MEMORY if os.access(SHARED_MEMORY, os.W_OK) else Path(tempfile.gettempdir())


def _identity(pid: int) -> dict[str, object]:
    """What tells process ``pid`` from a later one with its number: its start time; and its pid namespace."""
    try:
        started = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[19]
    except (OSError, IndexError):
        started = None
    try:
        namespace = os.readlink("/proc/self/ns/pid")
    except OSError:
        namespace = None
    return {"pid": pid, "started": started, "namespace": namespace}


def memory_dir_from_env() -> Path | None:
    value = os.environ.get(MEMORY_DIR_ENV)
    return Path(value) if value else None


def create_empty(folder: Path) -> None:
    """Make ``folder`` empty, private and this process's; what an earlier agent of this node left there is not
    this one's."""
    folder.parent.mkdir(parents=True, exist_ok=True)
    with _host_lock(folder.parent):
        shutil.rmtree(folder, ignore_errors=True)
        folder.mkdir(mode=0o700)
        (folder / OWNER).write_text(json.dumps(_identity(os.getpid())))


def remove_abandoned(base: Path) -> list[Path]:
    """Remove the folders under ``base`` whose owner process is gone (in this pid namespace), unless an agent
    did so less than ``SWEEP_EVERY_S`` ago; those removed."""
    stamp = base / _SWEPT
    try:
        if time.time() - stamp.stat().st_mtime < SWEEP_EVERY_S:
            return []
    except FileNotFoundError:
        pass
    stamp.touch()
    namespace = _identity(os.getpid())["namespace"]
    removed = []
    with _host_lock(base):
        for folder in base.glob(f"{_PREFIX}*"):
            try:
                owner = json.loads((folder / OWNER).read_text())
            except (OSError, ValueError):
                continue  # not a folder of ours
            if owner.get("namespace") != namespace or _identity(owner["pid"]) == owner:
                continue
            shutil.rmtree(folder, ignore_errors=True)
            removed.append(folder)
            logger.info("freed %s: memory snapshots of an agent that is gone (pid %s)", folder, owner["pid"])
    return removed


@contextlib.contextmanager
def _host_lock(base: Path) -> Iterator[None]:
    with open(base / _LOCK, "a") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        yield


def remove(folder: Path) -> None:
    """Free the node's snapshots: the job is over on this node."""
    shutil.rmtree(folder, ignore_errors=True)
    logger.debug("removed the node's memory snapshots in %s", folder)
