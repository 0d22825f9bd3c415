"""Child processes that die with their parent, and stopping a whole process tree."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

# Runs in the child between fork and exec: ask the kernel to SIGKILL us when the parent dies (even by SIGKILL),
# then become the real program. Doing it in a tiny exec'd shim avoids preexec_fn, which is unsafe with threads.
_DIE_WITH_PARENT = (
    "import ctypes, os, sys\n"
    "ctypes.CDLL(None, use_errno=True).prctl(1, 9)\n"  # PR_SET_PDEATHSIG, SIGKILL
    "os.getppid() == int(sys.argv[1]) or os._exit(70)\n"  # parent already gone before prctl took effect
    "os.execvp(sys.argv[2], sys.argv[2:])\n"
)


def orphan_safe_command(command: list[str]) -> list[str]:
    """`command`, wrapped so that the process it becomes is killed when the calling process dies."""
    if not sys.platform.startswith("linux"):
        return command
    return [sys.executable, "-S", "-c", _DIE_WITH_PARENT, str(os.getpid()), *command]


def signal_group(process: subprocess.Popen, signum: int) -> None:
    """Send `signum` to the process group led by `process` (started with start_new_session=True)."""
    try:
        os.killpg(process.pid, signum)
    except (ProcessLookupError, PermissionError):
        pass


def stop_group(processes: list[subprocess.Popen], grace_s: float, first_signal: int = signal.SIGTERM) -> None:
    """Signal every process group, wait up to `grace_s` for them to exit, then SIGKILL what is left.

    SIGKILL goes to the whole group even after its leader exited, so no grandchild (a DataLoader worker,
    a compiler subprocess) outlives the worker. Workers stuck in a collective die here too.
    """
    for process in processes:
        if process.poll() is None:
            signal_group(process, first_signal)
    deadline = time.monotonic() + grace_s
    for process in processes:
        remaining = deadline - time.monotonic()
        try:
            process.wait(timeout=max(remaining, 0.0))
        except subprocess.TimeoutExpired:
            pass
    for process in processes:
        signal_group(process, signal.SIGKILL)
        try:
            process.wait(timeout=5)
        except subprocess.TimeoutExpired:  # pragma: no cover - a process in uninterruptible sleep
            pass


def child_pids(pid: int) -> list[int]:
    """Direct children of `pid` (Linux /proc): how a caller finds the workers of an agent it started."""
    found = []
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            parent = int(stat.read_text().rsplit(")", 1)[1].split()[1])
        except (OSError, IndexError, ValueError):
            continue
        if parent == pid:
            found.append(int(stat.parent.name))
    return found
