"""The progress watchdog at work: reads each worker's channel on every poll, and dumps and kills hung workers.

On every worker poll (`--monitor-interval`) the agent reads each channel's 8-byte change counter, and the rest only
once a worker has been silent for the least allowance there can be: no etcd, no syscall, next to no CPU. When a
worker is hung and when a node is stalled are the rules of `launcher.workers.watchdog_rules`.

A hung worker gets the signal its library registered with faulthandler (every thread's Python stack to its
`stacks.log`, which the group copies where its stderr goes), SIGCONT (a stopped process handles no signal), and
once the dump is written (`StackDump`: at most `DUMP_GRACE_S` later) SIGKILL, then its process group
SIGKILL (at once when the worker leads it; `DUMP_GRACE_S` later when a supervisor runs it and takes its tree down).
Before the kill the agent reads which of its TCP connections stalled (`launcher.workers.failure_evidence`): evidence of
a broken path to a peer. Its failure carries `hung`, `seconds_silent`, `last_step` and those peers
(`unreachable`); the agent reports it like any failed worker and the membership log records `worker_hung`. In a
synchronous job the peers of a hung worker block in their next collective and fall silent too; those past their
allowance are reported hung as well (their stacks show them waiting inside the collective,
`launcher.workers.stack_dumps`), the others fail once the hung worker's connections close. The round's failures
count as one restart against --max-restarts, as for any worker failure.
"""

from __future__ import annotations

import dataclasses
import logging
import math
import mmap
import os
import signal
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

from elastic import channel
from launcher.workers import failure_evidence
from launcher.workers.process_tree import (
    WorkerProcess,
    cpu_seconds,
    is_stopped,
    own_children,
    parent_pid,
    signal_group,
)
from launcher.workers.watchdog_rules import (
    STALL_MIN_S,
    Hang,
    NodeHistory,
    Policy,
    Stall,
    WorkerWatch,
    next_threshold,
    pace_unknown,
    stall_of,
)

logger = logging.getLogger(__name__)

DUMP_GRACE_S = 1.0  # from the stack-dump signal to SIGKILL at the latest: time for faulthandler to write
PATH_CHECK_EVERY_S = 1.0  # how often a silent starting worker's connects are looked at (/proc, a connect)


@dataclass
class _Worker:
    path: Path
    watch: WorkerWatch = field(default_factory=WorkerWatch)
    view: mmap.mmap | None = None
    hang: Hang | None = None
    dump: StackDump | None = None  # asked of it when found hung; SIGKILL once it is over
    group_kill_at: float | None = None  # SIGKILL to its process group, if it still runs
    started: bool = False  # its first heartbeat was seen
    paths_checked_at: float = -math.inf  # when its connects were last looked at while it starts
    spared: bool = False  # found hung, left alive: it runs under elastic.run and takes the next round in process
    # (seq, the pid read, its CPU seconds) when that seq was first seen: what a silence inside a long operation used
    cpu_mark: tuple[int, int, float | None] | None = None
    # while no pace judges it, (when, the pid read, its CPU seconds) at each poll of about the last STALL_MIN_S:
    # whether it works or waits now
    cpu_trail: deque[tuple[float, int, float]] = field(default_factory=deque)


class Watchdog:
    """The watchdog of one WorkerGroup: channels created before the workers start, checked on every poll."""

    def __init__(
        self,
        policy: Policy | None,
        paths: list[Path],
        clock: Callable[[], float] = time.monotonic,
        history: NodeHistory | None = None,
        spare_reentrant: bool = False,
        store: tuple[str, int] | None = None,
    ) -> None:
        # with --inprocess: a hung worker under elastic.run that is not stopped is dumped but not killed. In a
        # synchronous job most hung workers wait in a collective on the one that hangs; the next round's offer
        # aborts that collective and they re-enter (one that does not is replaced after --inprocess-timeout)
        self.spare_reentrant = spare_reentrant
        # the round's store (address, port): the first peer a starting worker must reach
        self.store = store
        self._store_checked_at = -math.inf
        self._store_refuses = False
        self.history = history if history is not None else NodeHistory()
        self.policy = self.history.policy(policy)
        self.clock = clock
        self.started_at = clock()
        self.workers = [_Worker(path) for path in paths]
        self.stall: Stall | None = None  # as of the last check
        for worker in self.workers:  # with the watchdog off too: the channel also carries drains
            worker.path.parent.mkdir(parents=True, exist_ok=True)
            channel.create_channel(worker.path)

    def acting(self) -> bool:
        """A hung worker is being dumped or killed: its failure is about to be reported."""
        return any(w.dump is not None or w.group_kill_at is not None for w in self.workers)

    def hang(self, local_rank: int) -> Hang | None:
        return self.workers[local_rank].hang if local_rank < len(self.workers) else None

    def check(self, processes: list[WorkerProcess], first_rank: int = 0) -> None:
        """Read every running worker's channel; dump and kill the hung ones (never blocks)."""
        self.stall = None
        if self.policy is None:
            return
        now = self.clock()
        for local_rank, (worker, process) in enumerate(zip(self.workers, processes)):
            if process.poll() is not None:
                worker.dump = worker.group_kill_at = None  # nothing left to kill
                continue
            if worker.hang is None:
                worker.hang = self._find_hang(self.policy, worker, process, now)
                if worker.hang is not None:
                    # decided now, before the dump's SIGCONT revives a stopped worker: the round may end at once
                    stopped = self._stopped(worker, process)
                    worker.spared = self.spare_reentrant and not stopped and self._inprocess(worker)
                    logger.error(
                        "worker local_rank %d (rank %d) is hung: %s; dumping its stacks, then %s",
                        local_rank,
                        first_rank + local_rank,
                        worker.hang.summary(),
                        "leaving it alive for the next round" if worker.spared else "killing its process group",
                    )
                    worker.dump = self._dump(worker, process, now)
            if worker.dump is not None and worker.dump.over(now):
                worker.dump = None
                if worker.spared:
                    logger.warning(
                        "worker local_rank %d (rank %d) runs under elastic.run: left alive for the next round",
                        local_rank,
                        first_rank + local_rank,
                    )
                else:
                    worker.group_kill_at = now + self._kill(worker, process)
            if worker.group_kill_at is not None and now >= worker.group_kill_at:
                worker.group_kill_at = None
                signal_group(process, signal.SIGKILL)
        running = all(process.poll() is None for process in processes) and len(processes) == len(self.workers)
        if running and not any(worker.hang for worker in self.workers):
            self.stall = stall_of(
                [
                    (w.watch.silent_for(now), w.watch.current(), self._cpu_share(w, p, now))
                    for w, p in zip(self.workers, processes)
                ],
                self.history.pace,
            )

    def next_look_at(self) -> float | None:
        """When (this watchdog's clock) a silent worker's verdict may change next: the agent looks then
        (`watchdog_rules.next_threshold`). None: nothing is due, or the watchdog is off."""
        if self.policy is None:
            return None
        now = self.clock()
        due = [next_threshold(w.watch, self.policy, now, self.history.pace) for w in self.workers if w.hang is None]
        return min((at for at in due if at is not None), default=None)

    def stopped(self, processes: list[WorkerProcess]) -> list[int]:
        """The local ranks of the running workers whose process is stopped (SIGSTOP): they answer nothing."""
        return [
            local_rank
            for local_rank, (worker, process) in enumerate(zip(self.workers, processes))
            if process.poll() is None and self._stopped(worker, process)
        ]

    def request_drain(self, number: int, in_memory: bool = False) -> None:
        """Ask every worker for drain `number` (0 withdraws it) through its channel; `in_memory`: a snapshot in
        memory answers it."""
        for worker in self.workers:
            try:
                channel.request_drain(worker.path, number, in_memory)
            except OSError as exc:
                logger.warning("could not ask worker %s for a drain: %s", worker.path.parent.name, exc)

    def opened(self, local_rank: int) -> bool:
        """Whether a worker opened the channel of `local_rank` (one handed this round in process re-entered)."""
        worker = self.workers[local_rank]
        return self._open(worker) and channel.read_owner(worker.view) != 0

    def inprocess(self, local_rank: int) -> bool:
        """Whether the worker of `local_rank` runs under `elastic.run`: it takes the next round in process."""
        return self._inprocess(self.workers[local_rank])

    def _inprocess(self, worker: _Worker) -> bool:
        return self._open(worker) and channel.read_inprocess(worker.view)

    def spared(self, local_rank: int) -> bool:
        """The worker of `local_rank` was found hung and left alive for the next round (`spare_reentrant`)."""
        return self.workers[local_rank].spared

    def renew(self, local_rank: int) -> None:
        """A fresh channel for a new process of `local_rank`, watched as a worker just started."""
        path = self.workers[local_rank].path
        channel.create_channel(path)
        self.workers[local_rank] = _Worker(path)

    def keep_pace(self) -> None:
        """Keep this round's step pace in the node's history (its channels are read only during silences: here,
        at the round's end, in full), by which the next round's first steps are judged."""
        self.history.record_pace([channel.read(w.view) if self._open(w) else None for w in self.workers])

    def latest_step(self) -> int | None:
        """The newest step any worker passed to heartbeat (None: none yet, or no channel can be read)."""
        snapshots = [channel.read(w.view) for w in self.workers if self._open(w)]
        return max((s.last_step for s in snapshots if s is not None and s.last_step is not None), default=None)

    def drain_states(self) -> list[channel.DrainState | None]:
        """What each worker said of drains (None: its channel cannot be read)."""
        return [channel.read_drain(w.view) if self._open(w) else None for w in self.workers]

    def _find_hang(self, policy: Policy, worker: _Worker, process: WorkerProcess, now: float) -> Hang | None:
        """The worker's hang, with the peers its broken paths lead to, if it is hung."""
        if not self._open(worker):
            return None
        seq = channel.read_seq(worker.view)
        if not worker.started and seq != worker.watch.seq:
            self._note_start(worker, now)
        worker.watch.observe(seq, now)
        if worker.watch.seq is not None and (worker.cpu_mark is None or worker.cpu_mark[0] != worker.watch.seq):
            owner = self._owner(worker, process)
            worker.cpu_mark = (worker.watch.seq, owner, cpu_seconds(owner))
        # where no pace judges its silence yet (a start-up, a round's first steps on a node that showed none), whether
        # it works or waits does: followed once its node's workers heartbeated in an earlier round
        if policy.startup is not None and self._pace_unknown(worker):
            self._follow_cpu(worker, process, now)
        else:
            worker.cpu_trail.clear()
        silent = worker.watch.silent_for(now)
        if silent > min(policy.floor, STALL_MIN_S) and worker.watch.current() is None:
            worker.watch.snapshot = channel.read(worker.view)  # once per silence: nothing changed since
        if silent <= min(policy.floor, STALL_MIN_S):
            return None
        # below the floor only a worker that heartbeated can be hung: held to its stall allowance if its process is
        # stopped (watchdog_rules), so a starting worker's processes are not looked at until then
        if silent <= policy.floor and not worker.started:
            return None
        # once it heartbeated only a signal's stop counts, not a debugger's
        stopped = self._stopped(worker, process, by_tracer=not worker.started)
        if silent <= policy.floor and not stopped:
            return None
        # a start-up stuck on a broken path cannot finish: looked for (once a second) past the normal allowance,
        # where a start-up is watched at all (the script heartbeats)
        cut_off: list[str] | None = None  # None: not looked for in this poll
        watched_start = policy.startup is not None and not worker.started and not stopped
        if watched_start and now >= worker.paths_checked_at + PATH_CHECK_EVERY_S:
            worker.paths_checked_at = now
            cut_off = self._broken_paths(worker, process, starting=True)
        hang = worker.watch.verdict(
            policy, worker.watch.current(), now, time.time(), stopped, bool(cut_off), self.history.pace
        )
        if hang is None:
            return None
        stalled = cut_off if cut_off is not None else self._broken_paths(worker, process, hang.starting)
        return dataclasses.replace(hang, stalled_peers=tuple(stalled))

    def _cpu_share(self, worker: _Worker, process: WorkerProcess, now: float) -> float | None:
        """The share of a core the worker's process used, looked at only where silence alone does not tell work
        from a wait on a stopped peer: inside a long operation (a save), since its last sign of life; while no pace
        judges it (a start-up, a round's first steps: `_pace_unknown`), over the last `STALL_MIN_S` (None: neither,
        or not known)."""
        snapshot = worker.watch.current()
        if snapshot is None:
            return None
        if snapshot.long_op is None:
            trail = worker.cpu_trail
            if not trail or trail[0][0] > now - STALL_MIN_S or trail[-1][0] <= trail[0][0]:
                return None
            return (trail[-1][2] - trail[0][2]) / (trail[-1][0] - trail[0][0])
        if worker.cpu_mark is None:
            return None
        seq, owner, then = worker.cpu_mark
        silent = worker.watch.silent_for(now)
        if seq != worker.watch.seq or owner != self._owner(worker, process) or then is None or silent <= 0:
            return None
        used = cpu_seconds(owner)
        return None if used is None else (used - then) / silent

    def _pace_unknown(self, worker: _Worker) -> bool:
        """Whether neither the worker (too few heartbeats in this round) nor its node's last round shows a step pace
        to judge its silence by."""
        return not worker.started or pace_unknown(channel.read_beats(worker.view), self.history.pace)

    def _follow_cpu(self, worker: _Worker, process: WorkerProcess, now: float) -> None:
        """Sample a starting worker's CPU seconds, keeping the samples of the last `STALL_MIN_S` and the one
        before them (a new owner, a worker that opened its channel under a supervisor, starts the trail anew)."""
        owner = self._owner(worker, process)
        used = cpu_seconds(owner)
        trail = worker.cpu_trail
        if used is None or (trail and trail[-1][1] != owner):
            trail.clear()
        if used is not None:
            trail.append((now, owner, used))
        while len(trail) > 1 and trail[1][0] <= now - STALL_MIN_S:
            trail.popleft()

    def _broken_paths(self, worker: _Worker, process: WorkerProcess, starting: bool) -> list[str]:
        """The peers the worker's broken paths lead to (failure_evidence): its stalled connections; for a starting
        worker with none, the round's store when the agent's own connect there fails on the way (the worker's
        fails at once and is retried: no socket shows it)."""
        stalled = failure_evidence.stalled_peers(self._owner(worker, process))
        if not stalled and starting and self.store is not None and self._store_cut_off(self.store):
            stalled = [self.store[0]]
        return stalled

    def _store_cut_off(self, store: tuple[str, int]) -> bool:
        """Whether a connect to the round's `store` fails on the way; asked once a second at most, for all workers
        (a connect may wait up to failure_evidence.PATH_CHECK_TIMEOUT_S)."""
        now = self.clock()
        if now >= self._store_checked_at + PATH_CHECK_EVERY_S:
            self._store_checked_at = now
            self._store_refuses = failure_evidence.path_refuses(*store)
        return self._store_refuses

    def _note_start(self, worker: _Worker, now: float) -> None:
        """Record the worker's start-up (spawn to first heartbeat) once its channel shows a heartbeat."""
        snapshot = channel.read(worker.view)
        if snapshot is not None and snapshot.beats:
            worker.started = True
            self.history.record_startup(now - self.started_at)

    def _open(self, worker: _Worker) -> bool:
        if worker.view is None:
            try:
                with open(worker.path, "rb") as file:
                    worker.view = mmap.mmap(file.fileno(), channel.SIZE, mmap.MAP_SHARED, mmap.PROT_READ)
            except (OSError, ValueError):
                return False
        return True

    def _stopped(self, worker: _Worker, process: WorkerProcess, by_tracer: bool = True) -> bool:
        """Whether the worker's process is stopped (by a tracer too, with `by_tracer`): the one that owns its
        channel; before it opened it, the process we started or one of its children (under a supervisor, the
        worker is its child)."""
        owner = self._owner(worker, process)
        candidates = [owner] if owner != process.pid else [process.pid, *own_children(process.pid)]
        return any(is_stopped(pid, by_tracer) for pid in candidates)

    def _owner(self, worker: _Worker, process: WorkerProcess) -> int:
        """The worker's own pid, from its channel, if it is `process` or below it (a supervisor, a wrapper)."""
        snapshot = worker.watch.snapshot
        if snapshot is not None:
            pid = snapshot.pid
        else:  # not read yet: a worker that keeps heartbeating is never silent long enough to be read
            pid = channel.read_owner(worker.view) if self._open(worker) else 0
        if pid and _descends_from(pid, process.pid):
            return pid
        return process.pid

    def _dump(self, worker: _Worker, process: WorkerProcess, now: float) -> StackDump:
        """Ask for the stack dump the kill waits for."""
        snapshot = worker.watch.snapshot
        if snapshot is None:
            return StackDump.none(now)
        dump = StackDump.ask(self._owner(worker, process), snapshot.dump_signal, now)
        if dump.deadline > now:
            signal_group(process, signal.SIGCONT)
        return dump

    def _kill(self, worker: _Worker, process: WorkerProcess) -> float:
        """SIGKILL the worker; the seconds until its whole process group gets SIGKILL too.

        A worker that is our child leads its process group: the group dies at once. One under a supervisor
        (`launcher.workers.process_tree.supervised_command`) dies first, so that its supervisor, still alive, takes the
        worker's whole tree down and exits with the worker's status; the group follows if anything still runs.
        """
        owner = self._owner(worker, process)
        try:
            os.kill(owner, signal.SIGKILL)
        except (ProcessLookupError, PermissionError):
            pass
        return 0.0 if owner == process.pid else DUMP_GRACE_S


def _descends_from(pid: int, ancestor: int, depth: int = 8) -> bool:
    """Whether `pid` is `ancestor` or a descendant within `depth` generations (Linux /proc)."""
    for _ in range(depth + 1):
        if pid == ancestor:
            return True
        parent = parent_pid(pid)
        if parent is None or parent <= 1:
            return False
        pid = parent
    return False


@dataclass
class StackDump:
    """A stack dump asked of a worker (`ask`), over once it is written or `DUMP_GRACE_S` passed.

    Written, by the evidence in /proc: the signal is no longer pending, the worker wrote since it was sent (its
    `wchar` grew), and then wrote nothing more between two checks. faulthandler writes the whole dump from its
    signal handler within milliseconds, so a hung worker is killed a poll or two after the signal instead of a
    fixed second later, and its round changes that much sooner. Where /proc cannot tell, the grace decides."""

    pid: int
    signum: int
    deadline: float
    written_before: int | None  # the worker's wchar before the signal (None: unreadable)
    written_last: int | None = None  # at the last check since it grew

    @classmethod
    def none(cls, now: float) -> StackDump:
        """No dump to wait for."""
        return cls(0, 0, now, None)

    @classmethod
    def ask(cls, worker: int, signum: int, now: float) -> StackDump:
        """Have `worker` write every thread's stack to its stacks.log, through the handler `elastic.channel` registers
        for `signum` (none is asked of a worker without it, never registered or gone in interpreter shutdown: the
        signal would kill it)."""
        before = _bytes_written(worker)
        grace = dump_stacks(worker, signum)
        return cls(worker, signum, now + grace, before)

    def over(self, now: float) -> bool:
        if now >= self.deadline:
            return True
        if self.written_before is None or _pending(self.pid, self.signum):
            return False
        written = _bytes_written(self.pid)
        if written is None or written == self.written_before:
            return False
        settled, self.written_last = written == self.written_last, written
        return settled


def dump_stacks(worker: int, signum: int = channel.DUMP_SIGNAL) -> float:
    """Have `worker` write every thread's stack to its stacks.log, through the handler `elastic.channel` registers for
    `signum`; the seconds to give it at most before it is killed (0: it has no handler, never registered or gone in
    interpreter shutdown, and the signal would kill it)."""
    if not signum or not _catches(worker, signum):
        return 0.0
    try:
        os.kill(worker, signum)
        os.kill(worker, signal.SIGCONT)  # a stopped worker handles the signal once continued
    except (ProcessLookupError, PermissionError):
        return 0.0
    return DUMP_GRACE_S


def _bytes_written(pid: int) -> int | None:
    """The bytes `pid` passed to write calls so far (`wchar` of /proc/PID/io); None where it cannot be read."""
    return _proc_fields(pid, "io").get("wchar")


def _pending(pid: int, signum: int) -> bool:
    """Whether `signum` waits to be delivered to `pid` (SigPnd or ShdPnd of its /proc status; False where unknown)."""
    status = _proc_fields(pid, "status", base=16)
    return any(status.get(mask, 0) >> (signum - 1) & 1 for mask in ("SigPnd", "ShdPnd"))


def _catches(pid: int, signum: int) -> bool:
    """Whether `pid` has a handler installed for `signum` (its SigCgt mask in /proc; True where unknown)."""
    caught = _proc_fields(pid, "status", base=16).get("SigCgt")
    return caught is None or bool(caught >> (signum - 1) & 1)


def _proc_fields(pid: int, name: str, base: int = 10) -> dict[str, int]:
    """The numeric `key: value` lines of /proc/PID/<name> (those in `base`); empty where it cannot be read."""
    fields = {}
    try:
        text = Path(f"/proc/{pid}/{name}").read_text()
    except OSError:
        return {}
    for line in text.splitlines():
        key, _, value = line.partition(":")
        try:
            fields[key] = int(value.split()[0], base)
        except (ValueError, IndexError):
            continue  # not a number in this base (a name, a list): not one of the fields asked for
    return fields
