"""Everything a worker starts dies with it: with the agent (SIGKILLed or not), and with the worker when it is stopped.

tests/workers/spawner.py starts `sleep MARKER` as a plain child, as a setsid()'d child and as a double-forked
setsid()'d orphan; MARKER (600.<random>) is unique per test, so a test finds exactly its own sleeps in /proc and
kills them afterwards even when it failed.
"""

from __future__ import annotations

import json
import os
import random
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from launcher_harness import REPO, wait_until

from launcher.workers.process_tree import child_pids, descendant_pids, is_running, stop_group, supervised_command

SPAWNER = REPO / "tests" / "workers" / "spawner.py"


def sleeps_of(marker: str) -> list[int]:
    """Living `sleep MARKER` processes."""
    found = []
    for cmdline in Path("/proc").glob("[0-9]*/cmdline"):
        try:
            arguments = cmdline.read_bytes().split(b"\0")
        except OSError:
            continue
        if arguments[:2] == [b"sleep", marker.encode()] and is_running(int(cmdline.parent.name)):
            found.append(int(cmdline.parent.name))
    return found


def processes_mentioning(marker: str) -> list[int]:
    """Every process with `marker` among its arguments: the sleeps, the spawners and their supervisors."""
    found = []
    for cmdline in Path("/proc").glob("[0-9]*/cmdline"):
        try:
            if marker.encode() in cmdline.read_bytes().split(b"\0"):
                found.append(int(cmdline.parent.name))
        except OSError:
            continue
    return found


@pytest.fixture
def marker():
    """A unique `sleep` argument; every process still carrying it is SIGKILLed after the test."""
    value = f"600.{random.randrange(10**9):09d}"
    try:
        yield value
    finally:
        for pid in processes_mentioning(value):
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass


def ready(directory: Path, ranks: int) -> dict[int, dict] | None:
    files = {rank: directory / f"rank{rank}.json" for rank in range(ranks)}
    if not all(path.is_file() for path in files.values()):
        return None
    return {rank: json.loads(path.read_text()) for rank, path in files.items()}


def spawner(marker: str, directory: Path, *more: str) -> list[str]:
    return [sys.executable, str(SPAWNER), "--marker", marker, "--dir", str(directory), *more]


def kill_group(process: subprocess.Popen) -> None:
    try:
        os.killpg(process.pid, signal.SIGKILL)
    except ProcessLookupError:
        pass
    process.wait(timeout=10)


# -- the supervisor on its own (no etcd, no agent) ------------------------------------------------------------


@pytest.mark.timeout(60)
def test_supervisor_exits_with_the_workers_status():
    cases = {
        "pass": 0,
        "raise SystemExit(3)": 3,
        "import os; os.kill(os.getpid(), 9)": -signal.SIGKILL,
        "import os; os.kill(os.getpid(), 15)": -signal.SIGTERM,
        "import os; os.abort()": -signal.SIGABRT,
    }
    for code, expected in cases.items():
        process = subprocess.Popen(
            supervised_command([sys.executable, "-c", code]), start_new_session=True, stderr=subprocess.DEVNULL
        )
        try:
            assert process.wait(timeout=20) == expected, code
        finally:
            if process.poll() is None:
                kill_group(process)


@pytest.mark.timeout(60)
def test_worker_keeps_its_environment_and_output(tmp_path):
    out = tmp_path / "out.log"
    code = "import os, sys; print(os.environ['TORCHELASTIC_ERROR_FILE']); print('err', file=sys.stderr)"
    env = dict(os.environ, TORCHELASTIC_ERROR_FILE=str(tmp_path / "error.json"))
    with open(out, "wb") as sink:
        process = subprocess.Popen(
            supervised_command([sys.executable, "-c", code]),
            env=env,
            stdout=sink,
            stderr=subprocess.PIPE,
            start_new_session=True,
        )
    try:
        _, stderr = process.communicate(timeout=20)
    finally:
        if process.poll() is None:
            kill_group(process)
    assert process.returncode == 0
    assert out.read_text() == f"{tmp_path / 'error.json'}\n" and stderr == b"err\n"


@pytest.mark.timeout(60)
def test_parent_sigkill_takes_the_whole_tree(marker, tmp_path):
    parent_code = (
        "import subprocess, sys, time\n"
        f"sys.path.insert(0, {str(REPO)!r})\n"
        "from launcher.workers.process_tree import supervised_command\n"
        "subprocess.Popen(supervised_command(sys.argv[1:]), start_new_session=True)\n"
        "time.sleep(600)\n"
    )
    parent = subprocess.Popen(
        [sys.executable, "-c", parent_code, *spawner(marker, tmp_path)],
        env=dict(os.environ, RANK="0"),
        start_new_session=True,
    )
    try:
        worker = wait_until(lambda: ready(tmp_path, 1), 30, "the worker's sleeps")[0]
        assert len(sleeps_of(marker)) == 3
        assert child_pids(parent.pid) == [worker["pid"]], "child_pids sees through the supervisor"
        os.kill(parent.pid, signal.SIGKILL)
        parent.wait(timeout=10)
        # SIGKILL is delivered at once but a process takes a moment to exit: a small sleep can be gone before
        # the larger worker that was killed first
        wait_until(
            lambda: not sleeps_of(marker) and not is_running(worker["pid"]), 5, "the tree to die with the parent"
        )
    finally:
        kill_group(parent)


@pytest.mark.timeout(60)
def test_stop_group_takes_setsid_and_orphaned_grandchildren(marker, tmp_path):
    processes = []
    try:
        for rank in (0, 1):  # rank 0 ignores SIGTERM (so do its sleeps): SIGKILL after the grace
            command = supervised_command(spawner(marker, tmp_path, "--ignore-sigterm-rank", "0"))
            processes.append(subprocess.Popen(command, env=dict(os.environ, RANK=str(rank)), start_new_session=True))
        workers = wait_until(lambda: ready(tmp_path, 2), 30, "the workers' sleeps")
        assert len(sleeps_of(marker)) == 6
        below = {rank: set(descendant_pids(process.pid)) for rank, process in enumerate(processes)}
        for rank, worker in workers.items():
            assert {worker["pid"], *worker["sleeps"]} <= below[rank]
        started = time.monotonic()
        stop_group(processes, grace_s=1.0)
        assert time.monotonic() - started < 1.0 + 3
        assert not sleeps_of(marker)
        assert processes[1].returncode == -signal.SIGTERM  # the worker's own death, seen through the supervisor
        assert processes[0].returncode == -signal.SIGKILL
    finally:
        for process in processes:
            kill_group(process)


@pytest.mark.timeout(60)
def test_stop_group_returns_once_a_killed_large_worker_has_exited():
    """SIGKILL takes the small supervisor at once; a worker holding 512 MiB needs some 0.1 s more to free it,
    and whoever was told the workers are stopped (a fenced agent, the next round's worker) counts on it."""
    holds = "import signal; held = b'x' * 2**29; print(flush=True); signal.pause()"  # until the test kills it
    for _ in range(3):
        process = subprocess.Popen(
            supervised_command([sys.executable, "-c", holds]), start_new_session=True, stdout=subprocess.PIPE
        )
        try:
            assert process.stdout is not None
            process.stdout.readline()
            worker = descendant_pids(process.pid)
            assert worker
            stop_group([process], 0.0, signal.SIGKILL)
            assert not [pid for pid in worker if is_running(pid)]
        finally:
            kill_group(process)
            process.stdout.close()


@pytest.mark.timeout(60)
def test_worker_exit_takes_what_it_left_behind(marker, tmp_path):
    command = supervised_command(spawner(marker, tmp_path, "--exit-code", "3"))
    process = subprocess.Popen(command, env=dict(os.environ, RANK="0"), start_new_session=True)
    try:
        assert process.wait(timeout=30) == 3
        assert ready(tmp_path, 1)
        assert not sleeps_of(marker)
    finally:
        kill_group(process)


# -- real agents ---------------------------------------------------------------------------------------------


@pytest.mark.slow
@pytest.mark.timeout(120)
def test_sigkilled_agent_takes_every_descendant_of_its_workers(cluster, marker, tmp_path):
    out = tmp_path / "ready"
    out.mkdir()
    agent = cluster.start("solo", ["--marker", marker, "--dir", str(out)], nproc=2, script=SPAWNER)
    workers = cluster.wait_for(lambda: ready(out, 2), 60, "both workers' sleeps")
    assert len(sleeps_of(marker)) == 6
    assert sorted(child_pids(agent.pid)) == sorted(w["pid"] for w in workers.values())

    os.kill(agent.pid, signal.SIGKILL)
    agent.wait(timeout=10)
    # the workers were killed before their sleeps, but a larger process can take longer to exit
    cluster.wait_for(
        lambda: not sleeps_of(marker) and not any(is_running(w["pid"]) for w in workers.values()),
        5,
        "no worker or sleep left",
    )


@pytest.mark.slow
@pytest.mark.timeout(120)
def test_sigterm_to_the_agent_stops_every_descendant_of_its_workers(cluster, marker, tmp_path):
    out = tmp_path / "ready"
    out.mkdir()
    args = ["--marker", marker, "--dir", str(out), "--ignore-sigterm-rank", "0"]  # rank 0 needs the SIGKILL
    agent = cluster.start("solo", args, nproc=2, script=SPAWNER)
    workers = cluster.wait_for(lambda: ready(out, 2), 60, "both workers' sleeps")
    assert len(sleeps_of(marker)) == 6

    os.kill(agent.pid, signal.SIGTERM)
    assert agent.wait(timeout=30) == 128 + signal.SIGTERM, cluster.dump()
    assert not sleeps_of(marker), "stopped with the workers, before the agent exits"
    assert not any(is_running(w["pid"]) for w in workers.values())


@pytest.mark.slow
@pytest.mark.timeout(120)
def test_worker_exit_code_is_reported_and_its_descendants_die(cluster, marker, tmp_path):
    out = tmp_path / "ready"
    out.mkdir()
    agent = cluster.start("solo", ["--marker", marker, "--dir", str(out), "--exit-code", "3"], nproc=1, script=SPAWNER)
    assert agent.wait(timeout=60) == 1, cluster.dump()
    assert ready(out, 1)
    failed = [e for e in agent.membership() if e["event"] == "worker_failed"]
    assert [(e["local_rank"], e["exit_code"]) for e in failed] == [(0, 3)]
    assert not sleeps_of(marker)


def test_a_zombie_is_not_running():
    """A process whose parent has not reaped it yet still has its /proc entry: the zygote's supervisors, adopted
    by init when the zygote dies, wait so until init reaps them, and a pool waiting on one to be gone timed out
    (10 s) in one CI run."""
    child = subprocess.Popen(["true"])
    try:
        deadline = time.monotonic() + 10
        while is_running(child.pid) and time.monotonic() < deadline:
            time.sleep(0.01)
        assert not is_running(child.pid) and Path(f"/proc/{child.pid}").exists(), "exited, not yet reaped"
    finally:
        child.wait()
    assert not is_running(child.pid)
    assert is_running(os.getpid())
