"""PURE: when a worker is hung or a node's workers are stalled; no process, file or clock is touched here.

Workers call `elastic.heartbeat(step)` once per step (`elastic.channel`); `launcher.workers.watchdog` reads what
they wrote and asks these rules, passing its own clock's readings:
- a worker that never sent a heartbeat is never watched, with one exception: once this node's workers have
  heartbeated in an earlier round, a new round's worker that has not heartbeated yet is allowed the start-up
  allowance (`NodeHistory`): the larger of the normal allowance and `STARTUP_FACTOR` x the longest start-up
  (spawn to first heartbeat) seen on this node. A worker stuck in `init_process_group` (a peer it cannot connect
  to) is caught so; a start-up that loads a checkpoint for long belongs inside `long_operation`. A starting
  worker whose process is stopped (SIGSTOP) is not starting, nor is one whose connects are stuck on a broken
  path (`launcher.workers.failure_evidence`; no slow start-up retries a connect): each gets the normal allowance;
- a worker that heartbeated in this round and whose process is stopped by a signal (SIGSTOP, SIGTSTP; not a
  debugger's stop) is hung once it is silent past its stall allowance (below): it runs nothing until someone
  continues it, so the rest of the normal allowance would only wait for that;
- silence is measured from the last sign of life the agent saw: a heartbeat, or a long operation's begin or end;
- the normal allowance is `--watchdog-timeout` seconds when it is a number; with `auto` it is the larger of
  `--watchdog-min` and `AUTO_FACTOR` x the slowest interval between heartbeats over the last `AUTO_WINDOW` steps
  (less the time spent inside long operations: a checkpoint save every 50 steps does not inflate it);
- during a `long_operation` the allowance is the larger of the normal one and the operation's own `timeout=`
  (by default `--watchdog-long-op`; `math.inf`: unlimited).

Stalls, a hint for the controller rather than a verdict: when every worker of the node stepped in this round and
each has been silent for more than `STALL_FACTOR` x a slow recent step interval (the `STALL_QUANTILE` of the
window; at least `STALL_MIN_S`), the node is stalled (`stall_of`). Until a worker has shown its pace in the round
(`STALL_MIN_INTERVALS` intervals), its node's pace in the previous round stands in (`NodeHistory.pace`, read from
the channels when that round ended): a peer stopped two steps into a round is found as soon as one stopped later.
Before its first heartbeat in a round a worker is starting (re-entering, building, loading): once its node's workers
heartbeated in an earlier round (as for the start-up allowance), it counts once it has been silent past
`STALL_MIN_S` and idle over the last `STALL_MIN_S` (under `IDLE_CPU_SHARE` of a core), waiting on its peers instead
of starting; inside a long operation it declared (the checkpoint load, whose reads are gathered from every rank),
once silent past the stall allowance of the node's last pace and idle since the operation began. A peer stopped
during the load held a chaos run's scale-up until its lease ended (3.8 s). A peer stopped as the round began holds
every survivor there: before, only its lease's end found it (2.4-3.1 s). So does a round's first step that waits
where no pace is known yet (neither the worker's, one heartbeat in, nor its node's, whose last round ended too
early to show one): a peer re-entered in process and stopped one step into the round held the survivors until its
lease ended (10 s in a CI run). A start-up that waits on a slow peer (a joiner's start) costs a probe that every
member answers.
In a synchronous job that is how a stopped or frozen peer shows: its peers block in their next collective and
nothing fails. The agent reports it (`launcher.rendezvous.decisions`, rule 7) and the controller
probes the members that are not stalled; a stall costs a probe, never a restart. Inside a long operation silence
alone says little (a checkpoint save works without heartbeats): there a worker counts only if it is also idle, its
process having used under `IDLE_CPU_SHARE` of a core since its last sign of life, as one blocked in a collective
on a stopped peer is (a chaos run's stop during a disk checkpoint's save waited 3.8 s for the lease).
"""

from __future__ import annotations

import dataclasses
import math
import os
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Literal

from elastic import channel
from launcher.config import LaunchConfig
from launcher.workers.stack_dumps import main_thread_frame

AUTO_FACTOR = 10.0
AUTO_WINDOW = channel.WINDOW
STARTUP_FACTOR = 5.0
# a stall is reported early (it costs the controller a probe of the members that are not stalled) but not on
# the jitter of a healthy job: twice a slow step of the window, and never below half a second. Slow, not the
# slowest: one step slowed by a loaded host would hold the allowance above the lease for 100 steps; a slow step
# that comes every few steps (an evaluation) is above the quantile and is allowed for. Twice, not more: every
# second of it is a second a stopped node holds the job; on 2 x 200 fault-free steps of the chaos bench one
# step passed twice its window's slow step (one probe, answered) and none passed three times
STALL_FACTOR = 2.0
STALL_QUANTILE = 0.9
STALL_MIN_S = 0.5
STALL_MIN_INTERVALS = 2
IDLE_CPU_SHARE = 0.1  # of one core, over a silence inside a long operation or a start-up's last STALL_MIN_S: waiting


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
    """What the watchdog allows, from the launch configuration (`from_config`); `timeout` None means auto;
    `startup` None: a worker is not watched before its first heartbeat."""

    timeout: float | None
    minimum: float
    long_op: float
    factor: float = AUTO_FACTOR
    window: int = AUTO_WINDOW
    startup: float | None = None

    @property
    def floor(self) -> float:
        """The least allowance any worker can have: below it, no silence needs a closer look."""
        return self.timeout if self.timeout is not None else self.minimum

    @classmethod
    def from_config(cls, config: LaunchConfig) -> Policy | None:
        """None when the watchdog is off."""
        timeout = config.watchdog_timeout
        if timeout == "off":
            return None
        return cls(
            timeout=None if timeout == "auto" else float(timeout),
            minimum=config.watchdog_min,
            long_op=config.watchdog_long_op,
        )


class NodeHistory:
    """What this node's workers showed over the agent's rounds: the longest they took from spawn to their first
    heartbeat, and their step pace in the latest round that ran enough steps to show one."""

    def __init__(self) -> None:
        self.longest: float | None = None
        self.pace: tuple[float, ...] = ()  # step intervals, as a worker's channel holds them

    def record_startup(self, seconds: float) -> None:
        self.longest = seconds if self.longest is None else max(self.longest, seconds)

    def record_pace(self, snapshots: Sequence[channel.Snapshot | None]) -> None:
        """Keep the step intervals of the workers that ran enough steps in this round to show their pace."""
        shown = [s.intervals[-AUTO_WINDOW:] for s in snapshots if s is not None and _shows_pace(s.intervals)]
        if shown:
            self.pace = tuple(interval for intervals in shown for interval in intervals)

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
    long_op: str | None = None  # the long operation one of them was idle in (a drain's save is one)


def stall_allowance(intervals: Sequence[float]) -> float | None:
    """Seconds of silence after which a worker with these recent step intervals counts as stalled; None while
    too few steps were seen to know its pace."""
    recent = sorted(intervals[-AUTO_WINDOW:])
    if not _shows_pace(recent):
        return None
    slow = recent[math.ceil(STALL_QUANTILE * len(recent)) - 1]  # nearest rank
    return max(STALL_MIN_S, STALL_FACTOR * slow)


def _shows_pace(intervals: Sequence[float]) -> bool:
    return len(intervals) >= STALL_MIN_INTERVALS


def pace_unknown(beats: int, prior: Sequence[float]) -> bool:
    """Whether neither a worker that heartbeated `beats` times in its round (one interval fewer) nor its node's
    ``prior`` pace shows a pace to judge its silence by."""
    return beats <= STALL_MIN_INTERVALS and not _shows_pace(prior)


def pace_of(snapshot: channel.Snapshot, prior: Sequence[float]) -> Sequence[float]:
    """The step intervals to judge a worker's silence by: its own; in a round's first steps (it stepped in this
    round, too few times to show its pace), ``prior``, the node's pace in its last round. A node stopped (SIGSTOP)
    two steps after a round began was otherwise found only by its lease's expiry: 3.3 s, against 0.1 s later on."""
    if snapshot.last_step is not None and not _shows_pace(snapshot.intervals):
        return prior
    return snapshot.intervals


def stall_of(
    workers: Sequence[tuple[float, channel.Snapshot | None, float | None]], prior: Sequence[float] = ()
) -> Stall | None:
    """A Stall when every one of a node's workers, given as (seconds silent, its channel as last read, None if
    unread since its last sign of life, and the share of a core its process used, None if not measured: inside a
    long operation since its last sign of life, while it starts over the last `STALL_MIN_S`), is silent past its
    stall allowance (``pace_of``, with the node's ``prior`` pace; `STALL_MIN_S` for a start-up that waits, and for
    a round's first steps that wait where neither shows a pace), and idle as well if it is inside a long
    operation."""
    if not workers:
        return None
    long_op = None
    for silent, snapshot, cpu_share in workers:
        if snapshot is None:
            return None
        idle = cpu_share is not None and cpu_share < IDLE_CPU_SHARE
        if snapshot.beats == 0 and snapshot.long_op is not None:
            # a start-up's load: the load gathers from every rank, a stopped one holds it
            allowed = stall_allowance(prior) if idle else None
        else:
            allowed = stall_allowance(pace_of(snapshot, prior))
            # no pace known (a start-up, or a round's first steps where no round showed one): whether it waits
            if allowed is None and snapshot.long_op is None:
                allowed = STALL_MIN_S if idle else None
        if allowed is None or silent <= allowed:
            return None
        if snapshot.long_op is not None:
            if not idle:
                return None
            long_op = snapshot.long_op.name
    steps = [
        snapshot.last_step for _, snapshot, _ in workers if snapshot is not None and snapshot.last_step is not None
    ]
    return Stall(
        seconds_silent=min(silent for silent, _, _ in workers), last_step=max(steps, default=None), long_op=long_op
    )


def next_threshold(watch: WorkerWatch, policy: Policy, now: float, prior: Sequence[float] = ()) -> float | None:
    """The next moment after `now` (the agent's monotonic clock) at which the worker's silence passes a threshold
    these rules judge by (None: none ahead, or no sign of life seen yet): where its channel is first read, its
    stall allowance, its allowance. Looking then, not at the next poll, finds a stall or a hang without a
    monitor interval's delay; a threshold that changes no verdict costs one look."""
    if watch.active_at is None:
        return None
    thresholds = [min(policy.floor, STALL_MIN_S)]
    snapshot = watch.current()
    if snapshot is not None:
        stalled_after = stall_allowance(pace_of(snapshot, prior))
        if stalled_after is not None:
            thresholds.append(stalled_after)
        thresholds.append(allowance(policy, snapshot.intervals, snapshot.long_op))
    ahead = [watch.active_at + seconds for seconds in thresholds if watch.active_at + seconds > now]
    return min(ahead, default=None)


@dataclass(frozen=True)
class Hang:
    """A worker found silent past its allowance, at unix time `at`."""

    seconds_silent: float
    allowance: float
    last_step: int | None
    at: float
    long_op: str | None = None
    starting: bool = False  # no heartbeat yet in this round: held to the start-up allowance
    stopped: bool = False  # starting, but its process is stopped: held to the normal allowance
    halted: bool = False  # heartbeated, and its process is stopped by a signal: held to its stall allowance
    cut_off: bool = False  # starting, but its connects are stuck on a broken path: held to the normal allowance
    # peers its stalled TCP connections lead to, or the store its start-up cannot reach (failure_evidence)
    stalled_peers: tuple[str, ...] = ()

    @property
    def silent_since(self) -> float:
        """Unix time of its last sign of life: when the hang began."""
        return self.at - self.seconds_silent

    def summary(self) -> str:
        if self.halted:
            step = f"after step {self.last_step}" if self.last_step is not None else "after its last heartbeat"
            step += ", and its process is stopped"
        elif self.stopped:
            step = "since it started, none yet in this round, and its process is stopped"
        elif self.cut_off:
            step = "since it started, none yet in this round, its start-up stuck on a broken path"
        elif self.starting:
            step = "since it started, none yet in this round"
        else:
            step = f"after step {self.last_step}" if self.last_step is not None else "(no step given)"
        inside = f" inside long operation {self.long_op!r}" if self.long_op else ""
        kind = "start-up allowance" if self.starting and not self.cut_off else "allowance"
        if self.halted:
            kind = "stall allowance"
        stalled = f"; broken paths to {', '.join(self.stalled_peers)}" if self.stalled_peers else ""
        return f"no heartbeat for {self.seconds_silent:.1f}s {step}{inside} ({kind} {self.allowance:g}s){stalled}"

    def describe(self, dump: str = "", spared: bool = False) -> str:
        """The failure message: what the membership log and the job's failure summary show; its stack `dump`
        (from its stacks.log) adds where its main thread was. `spared`: left alive for the next
        round (it runs under elastic.run), not killed."""
        frame = main_thread_frame(dump)
        inside = f" in {frame.function} ({os.path.basename(frame.file)}:{frame.line})" if frame else ""
        fate = "left alive to take the next round in process" if spared else "process group killed"
        return f"hung{inside}: {self.summary()}; stacks dumped to its stderr, {fate}"

    def waited_on_peer(self, dump: str = "") -> bool:
        """Whether its main thread sat in a torch.distributed call (a collective, process-group set-up)."""
        frame = main_thread_frame(dump)
        return frame is not None and frame.in_collective

    def failed_at(self, dump: str = "") -> float:
        """When it failed, for the root cause (the earliest failure): when it fell silent, unless it waited on a
        peer: then it failed when found hung."""
        return self.at if self.waited_on_peer(dump) else self.silent_since


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

    def verdict(
        self,
        policy: Policy,
        snapshot: channel.Snapshot | None,
        now: float,
        wall: float,
        stopped: bool = False,
        cut_off: bool = False,
        prior: Sequence[float] = (),
    ) -> Hang | None:
        """A Hang when the worker heartbeated before and has been silent longer than its allowance; `now` is the
        agent's monotonic clock, `wall` the unix time of the same moment, `stopped` whether its process is
        stopped by a signal, `cut_off` whether its connects are stuck on a broken path (a starting worker then
        gets the normal allowance: it starts nothing, or cannot finish; one that heartbeated and is stopped, its
        stall allowance (``pace_of``, with the node's ``prior`` pace), if that is shorter)."""
        if snapshot is None:
            return None
        self.observe(snapshot.seq, now)
        self.snapshot = snapshot
        starting = snapshot.beats == 0
        if starting and policy.startup is None:
            return None  # a script that never calls heartbeat is never watched
        if starting and policy.startup is not None and not stopped and not cut_off:
            allowed = max(policy.startup, allowance(policy, (), snapshot.long_op))
        else:
            allowed = allowance(policy, snapshot.intervals, snapshot.long_op)
        halted = False
        if stopped and not starting:
            stalled_after = stall_allowance(pace_of(snapshot, prior))
            if stalled_after is not None and stalled_after < allowed:
                allowed, halted = stalled_after, True
        silent = self.silent_for(now)
        if silent <= allowed:
            return None
        return Hang(
            seconds_silent=silent,
            allowance=allowed,
            last_step=snapshot.last_step,
            at=wall,
            long_op=snapshot.long_op.name if snapshot.long_op else None,
            starting=starting and not stopped,
            stopped=starting and stopped,
            halted=halted,
            cut_off=starting and not stopped and cut_off,
        )
