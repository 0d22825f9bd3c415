"""The progress watchdog: a worker that heartbeats and then falls silent past its allowance is hung.

Workers call `elastic.heartbeat(step)` once per step; it writes a small shared-memory file per worker that the
agent created in the worker's log directory before starting it (`elastic.channel` documents the layout). On
every worker poll (`--monitor-interval`) the agent reads the file's 8-byte change counter, and the rest only once
a worker has been silent for the least allowance there can be: no etcd, no syscall, next to no CPU.

The rule, as pure functions (`allowance`, `WorkerWatch.verdict`):
- a worker that never sent a heartbeat is never watched, with one exception: once this node's workers have
  heartbeated in an earlier round, a new round's worker that has not heartbeated yet is allowed the start-up
  allowance (`StartupHistory`): the larger of the normal allowance and 5 x the longest start-up (spawn to first
  heartbeat) seen on this node. A worker stuck in `init_process_group` (a peer it cannot connect to) is caught
  so; a start-up that loads a checkpoint for long belongs inside `long_operation`;
- silence is measured from the last sign of life the agent saw: a heartbeat, or a long operation's begin or end;
- the normal allowance is `--watchdog-timeout` seconds when it is a number; with `auto` (the default) it is the
  larger of `--watchdog-min` and 10 x the slowest interval between heartbeats over the last 100 steps (less the
  time spent inside long operations: a checkpoint save every 50 steps does not inflate it);
- during a `long_operation` the allowance is the larger of the normal one and the operation's own `timeout=`
  (default `--watchdog-long-op`, 30 minutes; `math.inf`: unlimited).

Stalls, a hint for the controller rather than a verdict: when every worker of the node heartbeated at least
`STALL_MIN_INTERVALS` + 1 times in this round, none is inside a long operation, and each has been silent for more
than `STALL_FACTOR` x a slow recent step interval (the 90th percentile of the window; at least `STALL_MIN_S`),
the node is stalled (`stall_of`).
In a synchronous job that is how a stopped or frozen peer shows: its peers block in their next collective and
nothing fails. The agent reports it (`launcher.rendezvous.decisions`, rule 7) and the controller probes the members that
are not stalled; a stall costs a probe, never a restart.

A hung worker gets the signal its library registered with faulthandler (every thread's Python stack to its
stderr), SIGCONT (a stopped process handles no signal), and `DUMP_GRACE_S` later SIGKILL, then its process group
SIGKILL (at once when the worker leads it; `DUMP_GRACE_S` later when a supervisor runs it and takes its tree down).
Before the kill the agent reads which of its TCP connections stalled (`launcher.workers.failure_evidence`): evidence of
a broken path to a peer. Its failure carries `hung`, `seconds_silent`, `last_step` and those peers
(`unreachable`); the agent reports it like any failed worker and the membership log records `worker_hung`. In a
synchronous job the peers of a hung worker block in their next
collective and fall silent too; those past their allowance are reported hung as well (their stacks show them
waiting inside the collective), the others fail once the hung worker's connections close. The round's failures
count as one restart against --max-restarts, as for any worker failure.
"""

from __future__ import annotations

import dataclasses
import logging
import math
import mmap
import os
import re
import signal
import subprocess
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Literal

from elastic import channel
from launcher.workers import failure_evidence
from launcher.workers.process_tree import signal_group

logger = logging.getLogger(__name__)

HEARTBEAT_FILE = "heartbeat"  # in each worker's log directory, next to error.json
DUMP_GRACE_S = 1.0  # from the stack-dump signal to SIGKILL: time for faulthandler to write
AUTO_FACTOR = 10.0
AUTO_WINDOW = channel.WINDOW
STARTUP_FACTOR = 5.0
# a stall is reported early (it costs the controller a probe of the members that are not stalled) but not on
# the jitter of a healthy job: a few times a slow step of the window, and never below half a second. Slow, not
# the slowest: one step slowed by a loaded host would hold the allowance above the lease for 100 steps; a slow
# step that comes every few steps (an evaluation) is above the quantile and is allowed for
STALL_FACTOR = 3.0
STALL_QUANTILE = 0.9
STALL_MIN_S = 0.5
STALL_MIN_INTERVALS = 2


def parse_timeout(spec: str | float) -> float | Literal["auto", "off"]:
    """`--watchdog-timeout SECONDS|auto|off`."""
    text = str(spec).strip().lower()
    if text in ("auto", "off"):
        return text  # type: ignore[return-value]
    try:
        seconds = float(text)
    except ValueError:
        raise ValueError(f"bad --watchdog-timeout {spec!r}: expected seconds, auto or off") from None
    if not seconds > 0 or math.isinf(seconds):
        raise ValueError(f"bad --watchdog-timeout {spec!r}: seconds must be positive (or pass off)")
    return seconds


@dataclass(frozen=True)
class Policy:
    """What the watchdog allows; `timeout` None means auto; `startup` None: a worker is not watched before its
    first heartbeat."""

    timeout: float | None = None
    minimum: float = 60.0
    long_op: float = 1800.0
    factor: float = AUTO_FACTOR
    window: int = AUTO_WINDOW
    startup: float | None = None

    @property
    def floor(self) -> float:
        """The least allowance any worker can have: below it, no silence needs a closer look."""
        return self.timeout if self.timeout is not None else self.minimum

    @classmethod
    def from_config(cls, config) -> Policy | None:
        """None when the watchdog is off."""
        timeout = getattr(config, "watchdog_timeout", "off")
        if timeout == "off":
            return None
        return cls(
            timeout=None if timeout == "auto" else float(timeout),
            minimum=config.watchdog_min,
            long_op=config.watchdog_long_op,
        )


class StartupHistory:
    """How long this node's workers took from spawn to their first heartbeat, over the agent's rounds."""

    def __init__(self) -> None:
        self.longest: float | None = None

    def record(self, seconds: float) -> None:
        self.longest = seconds if self.longest is None else max(self.longest, seconds)

    def policy(self, policy: Policy | None) -> Policy | None:
        """`policy` with its start-up allowance, once a start-up was seen (the script heartbeats)."""
        if policy is None or self.longest is None:
            return policy
        return dataclasses.replace(policy, startup=max(policy.floor, STARTUP_FACTOR * self.longest))


def allowance(policy: Policy, intervals: Sequence[float], long_op: channel.LongOp | None = None) -> float:
    """Seconds of silence allowed to a worker that heartbeats, given its recent step intervals (oldest first)."""
    if policy.timeout is not None:
        normal = policy.timeout
    else:
        recent = intervals[-policy.window :] if policy.window else ()
        normal = max(policy.minimum, policy.factor * max(recent, default=0.0))
    if long_op is None:
        return normal
    own = long_op.timeout if long_op.timeout is not None else policy.long_op
    return max(normal, own)


@dataclass(frozen=True)
class Stall:
    """Every worker of the node silent past its stall allowance."""

    seconds_silent: float  # the shortest silence among them: how long the node has been stalled at least
    last_step: int | None


def stall_allowance(intervals: Sequence[float]) -> float | None:
    """Seconds of silence after which a worker with these recent step intervals counts as stalled; None while
    too few steps were seen to know its pace."""
    recent = sorted(intervals[-AUTO_WINDOW:])
    if len(recent) < STALL_MIN_INTERVALS:
        return None
    slow = recent[math.ceil(STALL_QUANTILE * len(recent)) - 1]  # nearest rank
    return max(STALL_MIN_S, STALL_FACTOR * slow)


def stall_of(workers: Sequence[tuple[float, channel.Snapshot | None]]) -> Stall | None:
    """A Stall when every one of a node's workers, given as (seconds silent, its channel as last read, None if
    unread since its last sign of life), is silent past its stall allowance outside any long operation."""
    if not workers:
        return None
    for silent, snapshot in workers:
        if snapshot is None or snapshot.long_op is not None:
            return None
        allowed = stall_allowance(snapshot.intervals)
        if allowed is None or silent <= allowed:
            return None
    steps = [snapshot.last_step for _, snapshot in workers if snapshot is not None and snapshot.last_step is not None]
    return Stall(seconds_silent=min(silent for silent, _ in workers), last_step=max(steps, default=None))


@dataclass(frozen=True)
class Hang:
    """A worker found silent past its allowance."""

    seconds_silent: float
    allowance: float
    last_step: int | None
    long_op: str | None = None
    starting: bool = False  # no heartbeat yet in this round: held to the start-up allowance
    at: float = field(default_factory=time.time)  # wall clock of the verdict
    stalled_peers: tuple[str, ...] = ()  # peers its stalled TCP connections lead to (launcher.workers.failure_evidence)

    @property
    def silent_since(self) -> float:
        """Wall clock of its last sign of life: when the hang began."""
        return self.at - self.seconds_silent

    def summary(self) -> str:
        if self.starting:
            step = "since it started, none yet in this round"
        else:
            step = f"after step {self.last_step}" if self.last_step is not None else "(no step given)"
        inside = f" inside long operation {self.long_op!r}" if self.long_op else ""
        kind = "start-up allowance" if self.starting else "allowance"
        stalled = f"; stalled connections to {', '.join(self.stalled_peers)}" if self.stalled_peers else ""
        return f"no heartbeat for {self.seconds_silent:.1f}s {step}{inside} ({kind} {self.allowance:g}s){stalled}"

    def describe(self, dump: str = "") -> str:
        """The failure message: what the membership log and the job's failure summary show; its stack `dump`
        (from its stderr log, when redirected) adds where its main thread was."""
        frame = main_thread_frame(dump)
        inside = f" in {frame.function} ({os.path.basename(frame.file)}:{frame.line})" if frame else ""
        return f"hung{inside}: {self.summary()}; stacks dumped to its stderr, process group killed"

    def waited_on_peer(self, dump: str = "") -> bool:
        """Whether its main thread sat in a torch.distributed call (a collective, process-group set-up)."""
        frame = main_thread_frame(dump)
        return frame is not None and frame.in_collective

    def failed_at(self, dump: str = "") -> float:
        """When it failed, for the root cause (the earliest failure): when it fell silent, unless it waited on a
        peer: then it failed when found hung."""
        return self.at if self.waited_on_peer(dump) else self.silent_since


_FRAME = re.compile(r'^\s*File "(?P<file>[^"]*)", line (?P<line>\d+) in (?P<function>\S+)')
_THREAD = ("Current thread 0x", "Thread 0x")


def last_dump(text: str) -> str:
    """The last faulthandler dump (every thread's stack) in a worker's stderr; "" if there is none."""
    lines = text.splitlines()
    headers = [i for i, line in enumerate(lines) if line.startswith(_THREAD)]
    if not headers:
        return ""

    def in_dump(line: str) -> bool:
        return line.startswith(_THREAD) or line.startswith("  ") or not line.strip()

    start = end = headers[-1]
    while start > 0 and in_dump(lines[start - 1]):
        start -= 1
    while end + 1 < len(lines) and (lines[end + 1].startswith("  ") or lines[end + 1].startswith(_THREAD)):
        end += 1
    return "\n".join(lines[start : end + 1]).strip("\n") + "\n"


def read_dump(path: Path, tail_bytes: int = 65536) -> str:
    """The last stack dump in the log file at `path` (its last `tail_bytes`), "" when none is there."""
    try:
        with open(path, "rb") as file:
            file.seek(max(0, file.seek(0, os.SEEK_END) - tail_bytes))
            return last_dump(file.read().decode(errors="replace"))
    except OSError:
        return ""


@dataclass(frozen=True)
class Frame:
    file: str
    line: int
    function: str

    @property
    def in_collective(self) -> bool:
        return "/torch/distributed/" in self.file.replace(os.sep, "/")


def main_thread_frame(dump: str) -> Frame | None:
    """Where the main thread was (its innermost frame) in the last faulthandler dump in `dump`, if any.

    The main thread is the dumped thread whose outermost frame is `<module>`. Peers of a hung worker show a
    collective here (`all_reduce` in torch/distributed/distributed_c10d.py), the hung worker something else.
    """
    blocks: list[list[re.Match[str]]] = []
    current: list[re.Match[str]] | None = None
    for line in dump.splitlines():
        if line.startswith(("Current thread 0x", "Thread 0x")):
            current = []
            blocks.append(current)
        elif current is not None:
            match = _FRAME.match(line)
            if match:
                current.append(match)
            elif line.strip():
                current = None  # the dump ended
    candidates = [b for b in blocks[-32:] if b]
    main = next((b for b in reversed(candidates) if b[-1]["function"] == "<module>"), None)
    if main is None:
        return None
    top = main[0]
    return Frame(top["file"], int(top["line"]), top["function"])


@dataclass
class WorkerWatch:
    """What the agent has seen of one worker's channel, on its own clock (no cross-process time is compared).

    Every poll looks at `seq` only (it changes on every heartbeat and long-operation begin or end); the whole
    snapshot is read once per silence, when it exceeds the least allowance or stall allowance there can be.
    """

    seq: int | None = None
    active_at: float | None = None  # agent monotonic time at which `seq` was last seen to change
    snapshot: channel.Snapshot | None = None  # the last one read (the pid and dump signal to use)

    def observe(self, seq: int | None, now: float) -> None:
        if seq is not None and seq != self.seq:
            self.seq, self.active_at = seq, now

    def silent_for(self, now: float) -> float:
        return 0.0 if self.active_at is None else now - self.active_at

    def current(self) -> channel.Snapshot | None:
        """The snapshot read since the last change of `seq` (None: none read since)."""
        return self.snapshot if self.snapshot is not None and self.snapshot.seq == self.seq else None

    def verdict(self, policy: Policy, snapshot: channel.Snapshot | None, now: float) -> Hang | None:
        """A Hang when the worker heartbeated before and has been silent longer than its allowance."""
        if snapshot is None:
            return None
        self.observe(snapshot.seq, now)
        self.snapshot = snapshot
        starting = snapshot.beats == 0
        if starting and policy.startup is None:
            return None  # a script that never calls heartbeat is never watched
        if starting and policy.startup is not None:
            allowed = max(policy.startup, allowance(policy, (), snapshot.long_op))
        else:
            allowed = allowance(policy, snapshot.intervals, snapshot.long_op)
        silent = self.silent_for(now)
        if silent <= allowed:
            return None
        return Hang(
            seconds_silent=silent,
            allowance=allowed,
            last_step=snapshot.last_step,
            long_op=snapshot.long_op.name if snapshot.long_op else None,
            starting=starting,
        )


@dataclass
class _Worker:
    path: Path
    watch: WorkerWatch = field(default_factory=WorkerWatch)
    view: mmap.mmap | None = None
    hang: Hang | None = None
    kill_at: float | None = None  # SIGKILL to the worker
    group_kill_at: float | None = None  # SIGKILL to its process group, if it still runs
    started: bool = False  # its first heartbeat was seen


class Watchdog:
    """The watchdog of one WorkerGroup: channels created before the workers start, checked on every poll."""

    def __init__(
        self, policy: Policy | None, paths: list[Path], clock=time.monotonic, startups: StartupHistory | None = None
    ) -> None:
        self.startups = startups if startups is not None else StartupHistory()
        self.policy = self.startups.policy(policy)
        self.clock = clock
        self.started_at = clock()
        self.workers = [_Worker(path) for path in paths]
        self.stall: Stall | None = None  # as of the last check
        for worker in self.workers:  # with the watchdog off too: the channel also carries drains
            worker.path.parent.mkdir(parents=True, exist_ok=True)
            channel.create_channel(worker.path)

    def acting(self) -> bool:
        """A hung worker is being dumped or killed: its failure is about to be reported."""
        return any(w.kill_at is not None or w.group_kill_at is not None for w in self.workers)

    def hang(self, local_rank: int) -> Hang | None:
        return self.workers[local_rank].hang if local_rank < len(self.workers) else None

    def check(self, processes: list[subprocess.Popen], first_rank: int = 0) -> None:
        """Read every running worker's channel; dump and kill the hung ones (never blocks)."""
        self.stall = None
        if self.policy is None:
            return
        now = self.clock()
        for local_rank, (worker, process) in enumerate(zip(self.workers, processes)):
            if process.poll() is not None:
                worker.kill_at = worker.group_kill_at = None  # nothing left to kill
                continue
            if worker.hang is None and self._open(worker):
                seq = channel.read_seq(worker.view)
                if not worker.started and seq != worker.watch.seq:
                    self._note_start(worker, now)
                worker.watch.observe(seq, now)
                hang = None
                silent = worker.watch.silent_for(now)
                if silent > min(self.policy.floor, STALL_MIN_S) and worker.watch.current() is None:
                    worker.watch.snapshot = channel.read(worker.view)  # once per silence: nothing changed since
                if silent > self.policy.floor:
                    hang = worker.watch.verdict(self.policy, worker.watch.current(), now)
                if hang is not None:
                    stalled = failure_evidence.stalled_peers(self._owner(worker, process))
                    hang = dataclasses.replace(hang, stalled_peers=tuple(stalled))
                    worker.hang = hang
                    logger.error(
                        "worker local_rank %d (rank %d) is hung: %s; dumping its stacks, then killing its "
                        "process group",
                        local_rank,
                        first_rank + local_rank,
                        hang.summary(),
                    )
                    worker.kill_at = now + self._dump(worker, process)
            if worker.kill_at is not None and now >= worker.kill_at:
                worker.kill_at = None
                worker.group_kill_at = now + self._kill(worker, process)
            if worker.group_kill_at is not None and now >= worker.group_kill_at:
                worker.group_kill_at = None
                signal_group(process, signal.SIGKILL)
        running = all(process.poll() is None for process in processes) and len(processes) == len(self.workers)
        if running and not any(worker.hang for worker in self.workers):
            self.stall = stall_of([(w.watch.silent_for(now), w.watch.current()) for w in self.workers])

    def request_drain(self, number: int) -> None:
        """Ask every worker for drain `number` (0 withdraws it) through its channel."""
        for worker in self.workers:
            try:
                channel.request_drain(worker.path, number)
            except OSError as exc:
                logger.warning("could not ask worker %s for a drain: %s", worker.path.parent.name, exc)

    def drain_states(self) -> list[channel.DrainState | None]:
        """What each worker said of drains (None: its channel cannot be read)."""
        return [channel.read_drain(w.view) if self._open(w) else None for w in self.workers]

    def _note_start(self, worker: _Worker, now: float) -> None:
        """Record the worker's start-up (spawn to first heartbeat) once its channel shows a heartbeat."""
        snapshot = channel.read(worker.view)
        if snapshot is not None and snapshot.beats:
            worker.started = True
            self.startups.record(now - self.started_at)

    def _open(self, worker: _Worker) -> bool:
        if worker.view is None:
            try:
                with open(worker.path, "rb") as file:
                    worker.view = mmap.mmap(file.fileno(), channel.SIZE, mmap.MAP_SHARED, mmap.PROT_READ)
            except (OSError, ValueError):
                return False
        return True

    def _owner(self, worker: _Worker, process: subprocess.Popen) -> int:
        """The worker's own pid, from its channel, if it is `process` or below it (a supervisor, a wrapper)."""
        snapshot = worker.watch.snapshot
        if snapshot is not None and snapshot.pid and _descends_from(snapshot.pid, process.pid):
            return snapshot.pid
        return process.pid

    def _dump(self, worker: _Worker, process: subprocess.Popen) -> float:
        """Ask for the stack dump; the seconds to wait before the kill."""
        snapshot = worker.watch.snapshot
        owner = self._owner(worker, process)
        if snapshot is None or not snapshot.dump_signal or not _catches(owner, snapshot.dump_signal):
            return 0.0  # no handler (never registered, or gone in interpreter shutdown): the signal would kill it
        try:
            os.kill(owner, snapshot.dump_signal)
            os.kill(owner, signal.SIGCONT)  # a stopped worker handles the signal once continued
        except (ProcessLookupError, PermissionError):
            return 0.0
        signal_group(process, signal.SIGCONT)
        return DUMP_GRACE_S

    def _kill(self, worker: _Worker, process: subprocess.Popen) -> float:
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
        try:
            pid = int(Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[1])
        except (OSError, IndexError, ValueError):
            return False
        if pid <= 1:
            return False
    return False


def _catches(pid: int, signum: int) -> bool:
    """Whether `pid` has a handler installed for `signum` (its SigCgt mask in /proc; True where unknown)."""
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith("SigCgt:"):
                return bool(int(line.split()[1], 16) >> (signum - 1) & 1)
    except (OSError, ValueError, IndexError):
        pass
    return True
