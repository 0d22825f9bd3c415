"""The agent's rules: what one node's agent does next, as pure functions of its view of the job, its round and time.

`launcher.node.agent` applies them, as the controller applies `launcher.rendezvous.decisions`. Nothing here reads
etcd, touches a process, sleeps or looks at a clock.

Lifecycle (`lifecycle`), checked first, in this order:
  1. a signal arrived                                        -> Leave (drain if asked, leave the membership)
  2. etcd unanswered for the lease TTL plus join_timeout      -> GiveUp (exit 1: nothing can go on without etcd)
  3. etcd says our lease is gone                              -> Rejoin as a new incarnation
  4. workers run while etcd has not confirmed our lease for
     most of its TTL (or a fence is still pending)           -> Fence: kill them, end the lease, rejoin
  5. the job finished or failed                              -> EndWithJob

Within a round (`next_action`), one action at a time, each kind at most once per step, in this order:
  EnterRound (a newer round names us or not) -> StartWorkers (we are a member and the master is known, or we are
  group rank 0 and publish it) -> PollWorkers -> RefillWarmPool -> Acknowledge (the controller learns our workers
  started) -> Report (success or failure) -> CheckController (after our failure: is its agent alive?) ->
  FollowDrain -> FollowStall -> AnswerRollCall (not while our watchdog reports a hang: its report comes first) ->
  CheckController (while our workers are stalled, if we watch the controller) ->
  RecordProgress (group rank 0 only: the workers' newest step into the membership log, the first one of every
  round at once and then at most every PROGRESS_EVERY_S, so the log grows by one event per job, not per node).

Phases of a round on this node:
  SPARE    the round formed without this incarnation; wait for the next one
  STARTING a member; its workers start once the round's master address is known
  RUNNING  the workers run
  FINISHED the workers exited; the outcome is reported (retried until etcd takes it)
"""

from __future__ import annotations

import enum
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from launcher.rendezvous.protocol import Holder
from launcher.rendezvous.records import (
    DrainRequest,
    JobStatus,
    MasterRecord,
    Member,
    NodeFailure,
    RollCall,
    RoundHeader,
)

if TYPE_CHECKING:  # the rules import nothing of etcd: the view is only read here
    from launcher.rendezvous.job_view import JobView

# Standby controllers wait a random part of this (per member of the round, capped) before claiming a free
# controller key, so that thousands of agents do not all write at once when the controller dies.
CLAIM_SPREAD_PER_MEMBER_S = 0.001
CLAIM_SPREAD_MAX_S = 1.0
# A node that lost its lease registers again after a random part of a spread that grows with the job (one etcd
# stall can end every node's lease at once) and doubles for each incarnation in a row that ended soon after it
# registered: at 2,048 simulated agents, registrations that each outlived their lease kept etcd too busy to
# confirm the others' refreshes, and the job had not converged 4 minutes on.
REJOIN_SPREAD_PER_NODE_S = 0.001
REJOIN_SPREAD_MAX_INTERVALS = 8  # keep-alive intervals
QUICK_LOSS_TTLS = 3  # an incarnation that ended within this many lease TTLs of registering was lost soon
WARM_REFILL_AFTER_S = 0.2  # forks of the zygote: milliseconds of CPU, out of the way of the round's launch
WARM_REFILL_RETRY_S = 0.5  # while the zygote still imports
PROGRESS_EVERY_S = 10.0
# The members of the lowest group ranks, less the controller's node, probe the controller's agent while their
# workers are stalled: the controller probes every other suspect of a stall, but not itself. A few, not all, so
# that a stall of thousands of nodes costs the controller's agent a few connections, not thousands.
CONTROLLER_WATCHERS = 3
CONTROLLER_STALL_CHECK_EVERY_S = 1.0  # as often as the controller probes the suspects of a stall


class Phase(enum.Enum):
    SPARE = "spare"
    STARTING = "starting"
    RUNNING = "running"
    FINISHED = "finished"


@dataclass(frozen=True)
class WorkersSucceeded:
    """Every worker of this node exited 0."""


Outcome = WorkersSucceeded | NodeFailure


@dataclass
class RoundRun:
    """Everything of one round on this node; a new round replaces it whole."""

    header: RoundHeader
    revision: int  # mod revision of the round record: the guard of every report about it
    member: Member | None  # None: a spare in this round
    phase: Phase
    acknowledged: bool = False  # the controller knows our workers started
    outcome: Outcome | None = None  # how our workers ended (set in FINISHED)
    reported: bool = False  # the outcome is in etcd, or the round moved on and it no longer matters
    controller_checked: bool = False  # after our failure, we probed the controller's agent
    controller_checked_in_stall_at: float | None = None  # when we last probed it while our workers were stalled
    answered_rollcall: str | None = None  # the nonce of the last roll call answered
    drain_asked: int = 0  # the drain our workers were asked for (0: none, or withdrawn)
    drain_answered: int = 0  # the drain our answer is in etcd for
    drained_step: int | None = None  # the step our workers committed for that answer (None: they drained nothing)
    refill_warm_at: float | None = None  # when to pre-start the next round's warm workers (monotonic)
    progress_step: int | None = None  # the last step recorded in the membership log this round
    progress_at: float = 0.0  # when it was recorded (monotonic)

    @property
    def round(self) -> int:
        return self.header.round


@dataclass(frozen=True)
class RoundFacts:
    """What the agent's view of the job says, for one step."""

    header: RoundHeader | None
    header_revision: int
    masters: dict[int, MasterRecord] = field(default_factory=dict)
    controller: str | None = None
    drains: dict[int, DrainRequest] = field(default_factory=dict)
    rollcalls: dict[int, RollCall] = field(default_factory=dict)

    @classmethod
    def of(cls, view: JobView) -> RoundFacts:
        return cls(
            header=view.round_header,
            header_revision=view.round_revision,
            masters=view.masters,
            controller=view.controller,
            drains=view.drains,
            rollcalls=view.rollcalls,
        )


# -- lifecycle ------------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class LeaseFacts:
    silent_for: float  # seconds since etcd last confirmed our lease
    ttl: int
    lost: bool  # etcd said the lease is gone


@dataclass(frozen=True)
class Leave:
    signum: int


@dataclass(frozen=True)
class GiveUp:
    silent_for: float


@dataclass(frozen=True)
class Rejoin:
    why: str


@dataclass(frozen=True)
class Fence:
    silent_for: float


@dataclass(frozen=True)
class EndWithJob:
    status: JobStatus


LifecycleAction = Leave | GiveUp | Rejoin | Fence | EndWithJob


# etcd ends a lease no sooner than a TTL after it received the newest refresh it confirmed (sent at silent_for 0),
# and the job needs a new round and its workers seconds more: killing ours this long before the TTL is in time,
# and leaves the default 3 s lease room for an etcd leader election (1 to 2 s at etcd's default timing), which ends
# no lease (the new leader extends them all) but answers no refresh either.
FENCE_MARGIN_S = 0.25


def fence_due(silent_for: float, ttl: int) -> bool:
    """etcd has not confirmed our lease for most of its TTL: the job may form a round without us at its end."""
    return silent_for >= ttl - min(FENCE_MARGIN_S, ttl / 4)


def lifecycle(
    *,
    signal: int | None,
    lease: LeaseFacts,
    join_timeout: float,
    fence_pending: bool,
    workers_running: bool,
    status: JobStatus | None,
) -> LifecycleAction | None:
    if signal is not None:
        return Leave(signum=signal)
    if lease.silent_for >= lease.ttl + join_timeout:
        return GiveUp(silent_for=lease.silent_for)
    if lease.lost:
        return Rejoin(why="etcd no longer has our lease (it expired, or the controller evicted this node)")
    if fence_pending or (workers_running and fence_due(lease.silent_for, lease.ttl)):
        return Fence(silent_for=lease.silent_for)
    if status is not None:
        return EndWithJob(status=status)
    return None


# -- the controller key ---------------------------------------------------------------------------------------


def claim_spread(members: int) -> float:
    """The most a standby waits, at random, before claiming a free controller key."""
    return min(CLAIM_SPREAD_MAX_S, CLAIM_SPREAD_PER_MEMBER_S * members)


def rejoin_spread(max_nodes: int, keep_alive_interval: float, quick_losses: int) -> float:
    """The most a node waits, at random, before registering again, after `quick_losses` incarnations in a row that
    ended soon after they registered (0: its last one lived long)."""
    first = min(keep_alive_interval, REJOIN_SPREAD_PER_NODE_S * max_nodes)
    return min(REJOIN_SPREAD_MAX_INTERVALS * keep_alive_interval, first * 2**quick_losses)


def lost_soon(lived_s: float, ttl: int) -> bool:
    """Whether an incarnation that lived `lived_s` seconds under a lease of `ttl` seconds ended soon after it
    registered."""
    return lived_s < QUICK_LOSS_TTLS * ttl


# -- one round --------------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class EnterRound:
    header: RoundHeader
    revision: int


@dataclass(frozen=True)
class StartWorkers:
    master: MasterRecord | None  # None: we are group rank 0 and publish where the store listens


@dataclass(frozen=True)
class PollWorkers:
    pass


@dataclass(frozen=True)
class RefillWarmPool:
    pass


@dataclass(frozen=True)
class Acknowledge:
    pass


@dataclass(frozen=True)
class Report:
    outcome: Outcome


@dataclass(frozen=True)
class CheckController:
    holder: str  # the encoded controller key's value
    # our workers are stalled, not failed: a probe that times out is as much proof as the controller asks of a
    # stalled round's suspects, since a stopped controller would otherwise hold the job until its lease ends
    stalled: bool = False


@dataclass(frozen=True)
class FollowDrain:
    request: DrainRequest | None


@dataclass(frozen=True)
class FollowStall:
    pass


@dataclass(frozen=True)
class AnswerRollCall:
    nonce: str


@dataclass(frozen=True)
class RecordProgress:
    step: int


RoundAction = (
    EnterRound
    | StartWorkers
    | PollWorkers
    | RefillWarmPool
    | Acknowledge
    | Report
    | CheckController
    | FollowDrain
    | FollowStall
    | AnswerRollCall
    | RecordProgress
)


def enters_round(facts: RoundFacts, run: RoundRun | None) -> EnterRound | None:
    header = facts.header
    if header is not None and (run is None or header.round != run.round):
        return EnterRound(header=header, revision=facts.header_revision)
    return None


def next_action(
    facts: RoundFacts,
    run: RoundRun | None,
    *,
    now: float,
    workers_started: bool,
    reporting_hang: bool,
    done: frozenset[type],
    latest_step: int | None = None,
    stalled: bool = False,
) -> RoundAction | None:
    """The next thing to do in this step, skipping the kinds of action in `done` (already applied this step)."""
    entering = enters_round(facts, run)
    if entering is not None and EnterRound not in done:
        return entering
    if run is None:
        return None
    candidates: list[RoundAction] = []
    if run.phase is Phase.STARTING:
        master = facts.masters.get(run.round)
        if master is not None or (run.member is not None and run.member.group_rank == 0):
            candidates.append(StartWorkers(master=master))
    if run.phase is Phase.RUNNING:
        candidates.append(PollWorkers())
    if run.refill_warm_at is not None and now >= run.refill_warm_at:
        candidates.append(RefillWarmPool())
    if workers_started and not run.acknowledged:
        candidates.append(Acknowledge())
    if run.outcome is not None and not run.reported:
        candidates.append(Report(outcome=run.outcome))
    if isinstance(run.outcome, NodeFailure) and not run.controller_checked and facts.controller is not None:
        candidates.append(CheckController(holder=facts.controller))
    if run.member is not None:
        candidates.append(FollowDrain(request=facts.drains.get(run.round)))
        candidates.append(FollowStall())
        rollcall = facts.rollcalls.get(run.round)
        if rollcall is not None and run.answered_rollcall != rollcall.nonce and not reporting_hang:
            candidates.append(AnswerRollCall(nonce=rollcall.nonce))
        # after FollowStall: our report goes out first, so a live controller probes the suspects meanwhile
        if stalled and facts.controller is not None and controller_check_due(run, facts.controller, now):
            candidates.append(CheckController(holder=facts.controller, stalled=True))
    progress = progress_to_record(run, latest_step, now)
    if progress is not None:
        candidates.append(progress)
    return next((action for action in candidates if type(action) not in done), None)


def watches_controller(member: Member, controller_node: str) -> bool:
    """Whether `member` is one of the round's CONTROLLER_WATCHERS lowest group ranks, the controller's node not
    counted among them (so 2 watch when it holds one of those ranks)."""
    return member.node != controller_node and member.group_rank < CONTROLLER_WATCHERS


def controller_check_due(run: RoundRun, holder: str, now: float) -> bool:
    """Our workers are stalled: whether to probe the controller's agent now (a watcher's first probe of the round,
    or CONTROLLER_STALL_CHECK_EVERY_S after its last)."""
    if run.member is None or run.phase is not Phase.RUNNING:
        return False
    if not watches_controller(run.member, Holder.decode(holder).node):
        return False
    last = run.controller_checked_in_stall_at
    return last is None or now - last >= CONTROLLER_STALL_CHECK_EVERY_S


def progress_to_record(run: RoundRun, latest_step: int | None, now: float) -> RecordProgress | None:
    """Group rank 0's running workers reached a step the log does not have: the round's first at once, later ones
    once PROGRESS_EVERY_S passed since the last."""
    if run.member is None or run.member.group_rank != 0 or run.phase is not Phase.RUNNING or latest_step is None:
        return None
    if run.progress_step is not None and (latest_step <= run.progress_step or now - run.progress_at < PROGRESS_EVERY_S):
        return None
    return RecordProgress(step=latest_step)


def refill_warm_at(now: float, filled: bool | None = None) -> float:
    """When to fork the next round's warm workers: right after this round's launch (`filled` None), or again
    soon when the last fill could not finish (False: the zygote still imports)."""
    return now + (WARM_REFILL_RETRY_S if filled is False else WARM_REFILL_AFTER_S)
