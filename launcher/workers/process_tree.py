"""Child processes that die with their parent, and stopping a whole process tree.

Workers run under a small supervisor (`supervised_command`), one per worker, so that nothing a worker starts
outlives it, even a grandchild that left the worker's process group (setsid) or was orphaned (a double fork):

    agent ─ supervisor (session + group leader, child subreaper) ─ worker ─ its children ...
                                                                 └ orphans of the worker's tree (reparented)

- The supervisor is a child subreaper, so every process orphaned anywhere below it is reparented to it and
  `descendant_pids(supervisor)` finds the worker's whole tree, left process groups and double forks included.
- It gets a catchable parent-death signal: when the agent dies, even by SIGKILL, it SIGKILLs its whole subtree
  and exits. The worker itself gets SIGKILL as its parent-death signal, in case the supervisor is killed.
- It shares its process group with the worker: a signal the agent sends to the group reaches the worker (and
  whatever stayed in the group) exactly once; the supervisor itself ignores it.
- When the worker exits, the supervisor SIGKILLs whatever the worker left behind, then exits with the worker's
  status: the same exit code, or the same death signal re-raised, so `Popen.returncode` reads as the worker's.
- `stop_group` signals each group, waits the grace period, then SIGKILLs the worker's tree below the supervisor
  (which is still alive to adopt the orphans, so none escapes) before the group itself. It returns once that
  tree has exited, not just the supervisor: a SIGKILLed group loses its small supervisor first, while a large
  worker still frees its memory (a GPU's too) for a moment after.
- `child_pids` looks through supervisors, so callers that find an agent's workers get the worker processes.
"""

from __future__ import annotations

import logging
import os
import signal
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import NoReturn, Protocol

from launcher.workers.warm_interpreter import (
    IDLE_NAME,
    STANDBY_NAME,
    STORE_NAME,
    SUPERVISOR_NAME,
    ZYGOTE_NAME,
    process_name,
    set_process_name,
)

logger = logging.getLogger(__name__)

_PR_SET_PDEATHSIG = 1
_PR_SET_CHILD_SUBREAPER = 36

# Runs in the child between fork and exec: ask the kernel to SIGKILL us when the parent dies (even by SIGKILL),
# then become the real program. Doing it in a tiny exec'd shim avoids preexec_fn, which is unsafe with threads.
_DIE_WITH_PARENT = (
    "import ctypes, os, sys\n"
    "ctypes.CDLL(None, use_errno=True).prctl(1, 9)\n"  # PR_SET_PDEATHSIG, SIGKILL
    "os.getppid() == int(sys.argv[1]) or os._exit(70)\n"  # parent already gone before prctl took effect
    "os.execvp(sys.argv[2], sys.argv[2:])\n"
)

# The supervisor: a fresh interpreter (-I -S: no site, no PYTHON* variables) that imports only this module.
_SUPERVISOR_MARK = "elastic-worker-supervisor"
_PACKAGE_ROOT = str(Path(__file__).resolve().parents[2])
_SUPERVISE = (
    "import sys; sys.path.append(sys.argv[2]); from launcher.workers.process_tree import _supervise; _supervise()"
)
_PARENT_GONE_EXIT = 70  # the parent died before the worker could start
_EXEC_FAILED_EXIT = 127  # as a shell reports a command it cannot run
_STRAY_KILL_TIMEOUT_S = 10.0
_TREE_EXIT_TIMEOUT_S = 5.0  # a SIGKILLed worker of GBs exits in a fraction of a second; longer is a stuck one


class WorkerProcess(Protocol):
    """What the agent holds of a worker: its supervisor, a `subprocess.Popen` (a cold worker) or a
    `launcher.workers.zygote.ForkedProcess` (one forked from the node's zygote)."""

    @property
    def pid(self) -> int: ...

    @property
    def returncode(self) -> int | None: ...

    def poll(self) -> int | None: ...

    def wait(self, timeout: float | None = None) -> int: ...


def orphan_safe_command(command: list[str]) -> list[str]:
    """`command`, wrapped so that the process it becomes is killed when the calling process dies.

    Only that process: what it starts is not covered (use `supervised_command` for a process tree)."""
    if not sys.platform.startswith("linux"):
        return command
    return [sys.executable, "-S", "-c", _DIE_WITH_PARENT, str(os.getpid()), *command]


def supervised_command(command: list[str]) -> list[str]:
    """`command` under a supervisor: it and everything it starts die when the caller dies (even by SIGKILL) or
    when it exits; the supervisor's exit status is the command's. Start it with start_new_session=True."""
    if not sys.platform.startswith("linux"):
        return command
    return [sys.executable, "-I", "-S", "-c", _SUPERVISE, _SUPERVISOR_MARK, _PACKAGE_ROOT, str(os.getpid()), *command]


def signal_group(process: WorkerProcess, signum: int) -> None:
    """Send `signum` to the process group led by `process` (started with start_new_session=True)."""
    try:
        os.killpg(process.pid, signum)
    except (ProcessLookupError, PermissionError):
        pass


def stop_group(processes: list[WorkerProcess], grace_s: float, first_signal: int = signal.SIGTERM) -> None:
    """Signal every process group, wait up to `grace_s` for them to exit, then SIGKILL what is left.

    SIGKILL goes to every descendant of a process that is still running (for a supervised worker: its whole tree,
    setsid'd and orphaned grandchildren included, since they are reparented to the supervisor), then to the whole
    group even after its leader exited, so no grandchild (a DataLoader worker, a compiler subprocess) outlives the
    worker. Workers stuck in a collective die here too. Returns once every process of their trees has exited.
    """
    tree = descendant_pids(*(process.pid for process in processes if process.poll() is None))
    for process in processes:
        if process.poll() is None:
            signal_group(process, first_signal)
            signal_group(process, signal.SIGCONT)  # a stopped process acts on no signal until continued
    deadline = time.monotonic() + grace_s
    for process in processes:
        remaining = deadline - time.monotonic()
        try:
            process.wait(timeout=max(remaining, 0.0))
        except subprocess.TimeoutExpired:
            pass
    for process in processes:
        if process.poll() is None:  # not reaped, so its pid is still its own
            kill_descendants(process.pid)
    for process in processes:
        try:  # a supervisor exits right after its worker, with the worker's status
            process.wait(timeout=2)
        except subprocess.TimeoutExpired:
            pass
    for process in processes:
        signal_group(process, signal.SIGKILL)
        try:
            process.wait(timeout=5)
        except subprocess.TimeoutExpired:  # pragma: no cover - a process in uninterruptible sleep
            pass
    _wait_exited(tree, _TREE_EXIT_TIMEOUT_S)


def _wait_exited(pids: list[int], timeout_s: float) -> None:
    """Wait until none of `pids` runs (a zombie has exited), for up to `timeout_s`."""
    deadline = time.monotonic() + timeout_s
    while running := [pid for pid in pids if is_running(pid)]:
        if time.monotonic() > deadline:  # pragma: no cover - a process in uninterruptible sleep
            logger.warning(
                "process(es) %s still exiting %.0fs after SIGKILL: in uninterruptible sleep (a hung file system "
                "or driver?); going on without them",
                running,
                timeout_s,
            )
            return
        time.sleep(0.002)


# -- /proc ---------------------------------------------------------------------------------------------------


_EXITED = ("Z", "X")  # /proc states of a process that exited: a zombie not yet reaped, or dead


def _stat_fields(pid: int | str) -> list[str] | None:
    """Fields of /proc/PID/stat after the command name: [state, ppid, pgrp, session, ...]; None if gone."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    except (OSError, IndexError):
        return None


def is_stopped(pid: int, by_tracer: bool = True) -> bool:
    """Whether `pid` is stopped (SIGSTOP, SIGTSTP, or, unless `by_tracer` is False, a tracer such as a debugger
    at a breakpoint): it runs no code until it is continued."""
    fields = _stat_fields(pid)
    return fields is not None and fields[0] in (("T", "t") if by_tracer else ("T",))


def cpu_seconds(pid: int) -> float | None:
    """The CPU time `pid` used so far, user and system, all its threads together (None: gone)."""
    fields = _stat_fields(pid)
    if fields is None:
        return None
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def parent_pid(pid: int) -> int | None:
    """The parent of `pid` (None: gone)."""
    fields = _stat_fields(pid)
    return None if fields is None else int(fields[1])


def is_running(pid: int) -> bool:
    """Whether `pid` exists and is not a zombie: one whose parent died waits as a zombie until whoever adopted it
    (init, a subreaper) reaps it, which on a busy host can take seconds."""
    fields = _stat_fields(pid)
    return fields is not None and fields[0] not in _EXITED


def own_children(pid: int) -> list[int]:
    """The children of `pid` (its main thread's, from /proc: one file, no scan); [] if gone."""
    try:
        return [int(child) for child in Path(f"/proc/{pid}/task/{pid}/children").read_text().split()]
    except OSError:
        return []


def _living_processes(zombies: bool = False) -> dict[int, list[str]]:
    """pid -> stat fields of every process that is not a zombie (or of every process, with `zombies`)."""
    found: dict[int, list[str]] = {}
    if not os.path.isdir("/proc"):
        return found
    for entry in os.scandir("/proc"):
        if entry.name.isdigit():
            fields = _stat_fields(entry.name)
            if fields is not None and (zombies or fields[0] not in _EXITED):
                found[int(entry.name)] = fields
    return found


def descendant_pids(*pids: int) -> list[int]:
    """Every living descendant of `pids` (Linux /proc, one scan), parents before their children."""
    if not pids:
        return []
    children: dict[int, list[int]] = {}
    for child, fields in _living_processes().items():
        children.setdefault(int(fields[1]), []).append(child)
    found, frontier = [], list(pids)
    while frontier:
        frontier = [child for parent in frontier for child in children.get(parent, ())]
        found += frontier
    return found


def kill_descendants(pid: int, timeout_s: float = _STRAY_KILL_TIMEOUT_S, reap: bool = False) -> None:
    """SIGKILL every descendant of `pid`, again and again until none is left (a process that forked while we
    looked leaves an orphan, found next time when `pid` is its subreaper). `reap`: `pid` is us, reap as we go."""
    deadline = time.monotonic() + timeout_s
    while True:
        if reap:
            _reap_all()
        pids = descendant_pids(pid)
        if not pids or time.monotonic() > deadline:
            return
        for found in pids:
            try:
                os.kill(found, signal.SIGKILL)
            except (ProcessLookupError, PermissionError):
                pass
        time.sleep(0.005)


def worker_under(supervisor: int) -> int:
    """The worker `supervisor` runs (its first child), or the supervisor itself before the worker started."""
    return next(iter(own_children(supervisor)), supervisor)


def _is_supervisor(pid: int) -> bool:
    try:
        arguments = Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")
    except OSError:
        return False
    return _SUPERVISOR_MARK.encode() in arguments[:8] or process_name(pid) == SUPERVISOR_NAME


def child_pids(pid: int) -> list[int]:
    """The workers of `pid` (Linux /proc): its direct children and the zygote's, where a supervisor stands for the
    worker it runs (its first child, or itself before the worker started), and where warm workers that wait for a
    round (`launcher.workers.warm_pool`), standby workers before their first round (`launcher.workers.standby`)
    and the zygote are left out. How a caller finds the workers of an agent
    it started."""
    processes = _living_processes(zombies=True)
    children: dict[int, list[int]] = {}
    for child, fields in processes.items():
        children.setdefault(int(fields[1]), []).append(child)
    found = []
    for supervisor in children.get(pid, ()):
        if process_name(supervisor) == ZYGOTE_NAME:  # its warm workers' supervisors are its children
            found += [w for s in children.get(supervisor, ()) if (w := _worker_of(s, children, processes))]
        elif worker := _worker_of(supervisor, children, processes):
            found.append(worker)
    return found


def _worker_of(supervisor: int, children: dict[int, list[int]], processes: dict[int, list[str]]) -> int | None:
    """The worker under `supervisor` (or `supervisor` itself if it is none); None while it waits for a round."""
    child = supervisor
    if _is_supervisor(supervisor):
        # orphans adopted by the supervisor are its children too; the worker is the one that started first
        # (an exited worker not yet reaped included, so that no orphan is taken for it)
        child = min(children.get(child, ()), key=lambda p: (int(processes[p][19]), p), default=child)  # starttime
        if child == supervisor:  # it may have forked since the snapshot: a forked supervisor names itself after
            child = worker_under(supervisor)
    # a warm worker is named so from its fork until its launch, and a standby worker until its first round; its
    # supervisor has the zygote's name until the worker is forked, and its own after; the round's store, forked
    # from the zygote too, is no worker
    return None if process_name(child) in (IDLE_NAME, STANDBY_NAME, ZYGOTE_NAME, STORE_NAME) else child


# -- the supervisor, run as `python -I -S -c _SUPERVISE MARK ROOT PARENT_PID COMMAND...` ----------------------


class _ParentGone(Exception):
    pass


def _prctl(option: int, value: int) -> None:
    import ctypes

    libc = ctypes.CDLL(None, use_errno=True)
    if libc.prctl(option, value, 0, 0, 0) != 0:
        raise OSError(ctypes.get_errno(), f"prctl({option}, {value})")


def _reap_all() -> list[tuple[int, int]]:
    reaped: list[tuple[int, int]] = []
    while True:
        try:
            pid, status = os.waitpid(-1, os.WNOHANG)
        except ChildProcessError:
            return reaped
        if pid == 0:
            return reaped
        reaped.append((pid, status))


def _exit_like(status: int) -> NoReturn:
    """Exit with the worker's wait status: its exit code, or its death signal raised against ourselves."""
    if os.WIFSIGNALED(status):
        signum = os.WTERMSIG(status)
        try:
            import resource

            resource.setrlimit(resource.RLIMIT_CORE, (0, 0))  # the worker dumped its core, if any; not us
        except (ImportError, OSError, ValueError):
            pass
        if signum != signal.SIGKILL:
            try:
                signal.signal(signum, signal.SIG_DFL)
                signal.pthread_sigmask(signal.SIG_UNBLOCK, [signum])
            except (OSError, ValueError):
                pass
        os.kill(os.getpid(), signum)
        os._exit(128 + signum)  # a signal that does not kill by default
    os._exit(os.waitstatus_to_exitcode(status) if os.WIFEXITED(status) else 1)


def _supervise() -> None:
    """The cold supervisor's program: supervise `COMMAND`, exec'd in the forked worker."""
    command = sys.argv[4:]
    supervise(int(sys.argv[3]), lambda me, ignored: _exec_worker(command, me, ignored))


def supervise(parent: int, start_worker: Callable[[int, list[int]], None], name: str | None = None) -> NoReturn:
    """Be the supervisor of one worker: fork it (`start_worker(supervisor_pid, ignored_signals)` runs in the child
    and must not return into this code), reap it and the orphans of its tree, kill what it leaves behind, and exit
    with its status; kill its tree and exit when `parent` dies. `name`: this process's name once the worker is
    forked (a supervisor forked from the zygote has the zygote's command line, not the supervisor's mark)."""
    me = os.getpid()
    parent_gone: list[int] = []

    def on_signal(signum, frame) -> None:
        # the parent-death signal, or a signal the agent sent to the group (the worker got it too: ignored here)
        if os.getpid() == me and not parent_gone and os.getppid() != parent:
            parent_gone.append(signum)
            raise _ParentGone

    # what the worker would have inherited from the agent: an ignored signal (nohup's SIGHUP) stays ignored;
    # SIGPIPE and SIGXFSZ are ignored by Python itself, Popen gave us their defaults
    ignored: list[int] = []
    for signum in signal.valid_signals():
        if signum in (signal.SIGKILL, signal.SIGSTOP):
            continue
        try:
            if signal.getsignal(signum) == signal.SIG_IGN and signum not in (signal.SIGPIPE, signal.SIGXFSZ):
                ignored.append(signum)
        except (OSError, ValueError):
            continue
        if signum in (
            signal.SIGCHLD,
            signal.SIGCONT,
            signal.SIGTSTP,
            signal.SIGTTIN,
            signal.SIGTTOU,
            signal.SIGWINCH,
            signal.SIGURG,
        ):
            continue
        try:
            signal.signal(signum, on_signal)
        except (OSError, ValueError):
            pass
    worker = None
    try:
        _prctl(_PR_SET_CHILD_SUBREAPER, 1)
        _prctl(_PR_SET_PDEATHSIG, signal.SIGTERM)
        if os.getppid() != parent:  # the parent died before the parent-death signal was armed
            parent_gone.append(0)
            raise _ParentGone
        # a signal that lands while Python runs its at-fork handlers is reported and dropped, not raised: held
        # until the fork is done, it is raised below (the parent's death) or never seen (the child's)
        mask = signal.pthread_sigmask(signal.SIG_BLOCK, signal.valid_signals())
        worker = os.fork()
        signal.pthread_sigmask(signal.SIG_SETMASK, mask)
        if worker == 0:
            start_worker(me, ignored)
            os._exit(_EXEC_FAILED_EXIT)  # pragma: no cover - start_worker execs, exits or unwinds past us
        if name is not None:
            set_process_name(name)
        while True:
            pid, status = os.waitpid(-1, 0)  # the worker, and the orphans of its tree as they exit
            if pid == worker:
                break
        kill_descendants(os.getpid(), reap=True)  # whatever the worker left behind dies with it
        _exit_like(status)
    except _ParentGone:
        kill_descendants(os.getpid(), reap=True)
        os._exit(_PARENT_GONE_EXIT if worker is None else 128 + signal.SIGKILL)


def _exec_worker(command: list[str], supervisor: int, ignored: list[int]) -> None:
    """In the forked child: the signal handling the worker would have had, die with the supervisor, exec."""
    try:
        for signum in signal.valid_signals():
            if signum not in (signal.SIGKILL, signal.SIGSTOP):
                try:
                    signal.signal(signum, signal.SIG_IGN if signum in ignored else signal.SIG_DFL)
                except (OSError, ValueError):
                    pass
        _prctl(_PR_SET_PDEATHSIG, signal.SIGKILL)
        if os.getppid() != supervisor:
            os._exit(_PARENT_GONE_EXIT)
        os.execvp(command[0], command)
    except BaseException as exc:  # noqa: BLE001 - nothing may return into the supervisor's code in this child
        try:
            os.write(2, f"elastic-run: cannot run {command[:1]}: {exc}\n".encode())
        finally:
            os._exit(_EXEC_FAILED_EXIT)
