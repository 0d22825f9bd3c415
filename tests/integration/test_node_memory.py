"""The node's memory folder: owned by its agent, freed by the next agent on the host once its owner is gone."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import threading
import time

import pytest

from elastic import node_memory

pytestmark = pytest.mark.timeout(30)


def owned_by_a_process_that_exited(folder) -> None:
    child = subprocess.Popen([sys.executable, "-c", "import sys; sys.stdin.read()"], stdin=subprocess.PIPE)
    identity = node_memory._identity(child.pid)
    child.communicate(b"")
    folder.mkdir()
    (folder / node_memory.OWNER).write_text(json.dumps(identity))
    (folder / "own").mkdir()


def test_two_agents_with_one_job_and_node_id_on_a_host_keep_their_own_folders():
    """Two jobs named alike against two etcds (or two test runs side by side): the second agent to start must
    not empty the first one's snapshots, as it did while the folder was named by job and node id only."""
    first = node_memory.node_memory_dir("job", "a", os.getpid())
    child = subprocess.Popen([sys.executable, "-c", "import sys; sys.stdin.read()"], stdin=subprocess.PIPE)
    second = node_memory.node_memory_dir("job", "a", child.pid)
    try:
        node_memory.create_empty(first)
        (first / "own").mkdir()
        node_memory.create_empty(second)
        assert first != second and (first / "own").is_dir(), "the other agent's snapshots are kept"
    finally:
        child.communicate(b"")
        shutil.rmtree(first, ignore_errors=True)
        shutil.rmtree(second, ignore_errors=True)


def test_folders_whose_owner_is_gone_are_freed_and_no_other(tmp_path):
    mine = tmp_path / "elastic-job-a"
    node_memory.create_empty(mine)
    abandoned = tmp_path / "elastic-job-b"
    owned_by_a_process_that_exited(abandoned)
    elsewhere = tmp_path / "elastic-job-c"  # an agent in another container sharing /dev/shm
    elsewhere.mkdir()
    identity = dict(node_memory._identity(1), namespace="pid:[0]", started="0")
    (elsewhere / node_memory.OWNER).write_text(json.dumps(identity))
    unowned = tmp_path / "elastic-job-d"  # not written by this code
    unowned.mkdir()
    other = tmp_path / "other-folder"
    other.mkdir()
    (other / node_memory.OWNER).write_text((abandoned / node_memory.OWNER).read_text())

    assert node_memory.remove_abandoned(tmp_path) == [abandoned]
    assert sorted(p.name for p in tmp_path.iterdir()) == [
        ".elastic-memory-lock",
        ".elastic-memory-swept",
        "elastic-job-a",
        "elastic-job-c",
        "elastic-job-d",
        "other-folder",
    ]


def test_one_agent_per_minute_sweeps_a_host(tmp_path):
    assert node_memory.remove_abandoned(tmp_path) == []  # the first sweeps (nothing to free) and stamps
    abandoned = tmp_path / "elastic-job-b"
    owned_by_a_process_that_exited(abandoned)
    assert node_memory.remove_abandoned(tmp_path) == [], "swept less than a minute ago"
    stamp = tmp_path / ".elastic-memory-swept"
    os.utime(stamp, (time.time() - node_memory.SWEEP_EVERY_S - 1,) * 2)
    assert node_memory.remove_abandoned(tmp_path) == [abandoned]


def test_an_agent_restarted_with_its_node_id_keeps_its_folder_while_another_sweeps(tmp_path):
    """An agent restarted with the same --node-id re-creates its folder while another agent of the host sweeps:
    the sweeper read the old owner (gone), and must not then delete the new folder, nor pull it away while it is
    being made (FileNotFoundError in create_empty)."""
    folder = tmp_path / "elastic-job-b"
    owned_by_a_process_that_exited(folder)
    dead_owner = (folder / node_memory.OWNER).read_text()
    stop, errors = threading.Event(), []

    def sweep() -> None:
        while not stop.is_set():
            (tmp_path / ".elastic-memory-swept").unlink(missing_ok=True)
            try:
                node_memory.remove_abandoned(tmp_path)
            except OSError as exc:
                errors.append(exc)

    sweeper = threading.Thread(target=sweep)
    sweeper.start()
    try:
        for _ in range(300):
            shutil.rmtree(folder, ignore_errors=True)
            folder.mkdir()
            (folder / node_memory.OWNER).write_text(dead_owner)  # what the killed agent left
            node_memory.create_empty(folder)
            time.sleep(0.001)  # a sweep that read the dead owner before create_empty would delete it now
            assert json.loads((folder / node_memory.OWNER).read_text())["pid"] == os.getpid()
    finally:
        stop.set()
        sweeper.join()
    assert not errors, errors[:3]
