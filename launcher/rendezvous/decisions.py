"""The controller's rules as pure functions: (job view, local clock, now, settings) -> one decision.

Nothing here reads etcd, sleeps or looks at the wall clock; `launcher.rendezvous.controller` applies what `decide`
returns through `launcher.rendezvous.protocol`. The rules, in the order they are tried (rules 4 to 9 are one
function each):

1. The job has a status: nothing more to do.
2. Leave notices of nodes that are gone and belong to no round are forgotten.
3. No round yet: MAX nodes form round 0 at once; MIN nodes form it once `last_call_timeout` passed since MIN
   were first present; fewer than MIN for `join_timeout` fail the job.
4. A member's incarnation is gone (lease ended, or the node id registered again as a newcomer): it is marked
   lost (unless it left), then a round forms without it if MIN nodes remain, else the job fails after
   `join_timeout`. A loss never counts against `--max-restarts`.
5. A member announced it is leaving: its round is drained (below), then wait until its registration is gone
   (it keeps its lease until its workers drained, or exited if they could not); after `close_timeout` it is
   evicted.
6. Workers failed: every member that has not reported is asked to answer a roll call, and its agent is probed
   (`probe_timeout`, launcher.rendezvous.liveness). Once all have answered, the failure is a worker failure: a new round
   with one more restart, or the end of the job past `--max-restarts`. A member whose agent refuses or does not
   answer the probe is lost at once; one that never answers the roll call is dead or hung: its lease ends
   (rule 4) or, after `close_timeout`, it is evicted; either way, a loss.
7. A member reported its workers stalled (all silent for several of their step intervals, launcher.workers.watchdog):
   in a synchronous job that is what a stopped or frozen peer looks like, since nothing fails. Every member
   that reported neither a stall nor an outcome is probed, at most once every `STALL_PROBE_EVERY_S` while a
   stall lasts; one that does not answer is lost at once (rule 4 follows), and when all answer, nothing
   happens: a stall is no failure (the watchdog judges hangs).
8. Every member reported success: the job finished.
9. Members that did not start the round within `close_timeout` are evicted; nodes waiting outside a round
   that has room form a scale-up round once MAX are present or `last_call_timeout` passed, and the round
   is drained (below).

Drains (`drain_timeout` > 0): before a planned change (rules 5 and 9) the controller asks the round's workers to
checkpoint at their next step boundary and wait there; the change goes ahead once every member answered (its
workers committed, or it has none that drain) or `drain_timeout` passed, so the next round redoes no step. A
drain whose change is off (the joiner went away) is withdrawn, and the workers train on.

Quarantine: a round's worker failure is charged to the nodes that caused it (`charged_nodes`): the ends of the
broken network paths its failures show, else the node of the earliest failure that was not a peer's
consequence. A node charged in `quarantine_after` consecutive rounds it took part in sits out the
following rounds for `quarantine_cooldown` seconds, unless that would leave fewer than MIN nodes; when the
cooldown ends it is readmitted like any waiting node (rule 9). Strikes and quarantines travel in the round
record, so a new controller knows them.
"""

from __future__ import annotations

import dataclasses
from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass, field
from enum import Enum

from launcher.rendezvous.job_view import JobView
from launcher.rendezvous.records import DrainReport, Member, NodeRecord, RoundRecord, WorkerFailure

# a stall lasts until the culprit is found or the workers beat again; probing every member that is not
# stalled more often than this would only load the agents (each probe is one TCP connection)
STALL_PROBE_EVERY_S = 1.0
PROBE_PEERS = 4  # live members probed beside a probe's suspects: their answers set how long a suspect may take


class RoundReason(str, Enum):
    INITIAL = "initial"
    NODE_LOST = "node_lost"
    NODE_LEFT = "node_left"
    WORKER_FAILED = "worker_failed"
    SCALE_UP = "scale_up"


@dataclass(frozen=True)
class Settings:
    """What the rules need of the launch configuration."""

    rdzv_id: str
    min_nodes: int
    max_nodes: int
    max_restarts: int
    join_timeout: float
    last_call_timeout: float
    close_timeout: float
    quarantine_after: int = 0  # 0: never
    quarantine_cooldown: float = 0.0
    probe_timeout: float = 0.0  # 0: silent members are not probed (launcher.rendezvous.liveness)
    drain_timeout: float = 0.0  # 0: planned changes go ahead without a drain


@dataclass(frozen=True)
class Clock:
    """When each condition the rules wait on was first seen (local monotonic seconds; None: it does not hold)."""

    leading_since: float
    wall_offset: float = 0.0  # unix time minus monotonic time: quarantines are stored as unix times
    round: int | None = None  # the round the per-round times belong to
    round_seen_at: float | None = None
    quorum_since: float | None = None  # MIN nodes present, no round yet
    short_since: float | None = None  # fewer than MIN nodes left after a loss
    joiner_since: float | None = None  # a node waits outside a round that has room
    rollcall_since: float | None = None
    leaving_since: float | None = None
    probed: frozenset[str] = frozenset()  # members of this round the controller probed
    stall_probed_at: float | None = None  # when the controller last probed members because of a stall
    drain_since: float | None = None  # this round's drain was requested


# -- decisions -------------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class Wait:
    until: float | None  # None: until something changes in etcd
    why: str = ""


@dataclass(frozen=True)
class FormRound:
    number: int
    members: list[Member]
    reason: RoundReason
    restart_count: int
    handled_left: list[str] = field(default_factory=list)
    strikes: dict[str, int] = field(default_factory=dict)
    quarantined: dict[str, float] = field(default_factory=dict)  # node -> unix time its quarantine ends
    newly_quarantined: list[str] = field(default_factory=list)
    readmitted: list[str] = field(default_factory=list)
    drain: DrainOutcome | None = None  # how the drain before this planned change went, if one was asked for
    # (gone member, newcomer taking its place): a spare replacing a lost node in this one change
    replaced: list[tuple[str, str]] = field(default_factory=list)


@dataclass(frozen=True)
class DrainOutcome:
    round: int  # the round that was drained: the one the new round replaces
    committed: bool  # every member answered; False: drain_timeout passed first
    step: int | None  # the step its workers checkpointed (None: no worker drains)


@dataclass(frozen=True)
class MarkLost:
    reasons: dict[str, str]  # node -> why
    revoke: dict[str, int] = field(default_factory=dict)  # node -> lease to end: evicting a live agent fences it


@dataclass(frozen=True)
class CallRollCall:
    round: int


@dataclass(frozen=True)
class RequestDrain:
    """Ask the round's workers to checkpoint at their next step boundary and wait there (elastic.checkpoint.drain)."""

    round: int
    reason: str  # scale_up or node_left
    # whether a snapshot in memory answers it: every node stays (a join), or one member leaves, its next node holds
    # the copy of its part, and those that stay are enough to go on; else it is saved to disk too
    in_memory: bool = False


@dataclass(frozen=True)
class WithdrawDrain:
    """The change a drain was asked for is off (the joiner went away): the drained workers train on. Or the drain
    was asked in memory and memory no longer holds what the change needs: it is asked again, to disk."""

    round: int
    why: str = "the change it was drained for is off"


@dataclass(frozen=True)
class ProbeMembers:
    """Probe these silent members' agents; one that does not answer is lost at once (launcher.rendezvous.liveness).
    `peers`, live members probed with them, tell how fast an agent answers now."""

    members: dict[str, NodeRecord]  # node -> its registration: address, probe port, incarnation
    stall: bool = False  # because of a stall (rule 7), not of failed workers (rule 6)
    peers: dict[str, NodeRecord] = field(default_factory=dict)


@dataclass(frozen=True)
class ForgetLeft:
    nodes: list[str]


@dataclass(frozen=True)
class EndJob:
    finished: bool
    summary: str
    cause: WorkerFailure | None = None


Action = FormRound | MarkLost | CallRollCall | ProbeMembers | RequestDrain | WithdrawDrain | ForgetLeft | EndJob
Decision = Wait | Action


# -- pure helpers ----------------------------------------------------------------------------------------------
def assign_ranks(previous: RoundRecord | None, nodes: dict[str, NodeRecord], max_nodes: int) -> list[Member]:
    """Deterministic membership: surviving members keep their order, then newcomers by join time and name.

    A survivor is the same incarnation as in `previous`; a node id that registered again is a newcomer.
    """
    order = []
    if previous is not None:
        order = [n for n, inc in zip(previous.nodes, previous.incarnations) if n in nodes and nodes[n].lease == inc]
    kept = set(order)
    newcomers = sorted((n for n in nodes if n not in kept), key=lambda n: (nodes[n].joined_at, n))
    members, next_rank = [], 0
    for group_rank, node in enumerate((order + newcomers)[:max_nodes]):
        record = nodes[node]
        members.append(Member(node, record.lease, group_rank, record.nproc, next_rank, record.addr))
        next_rank += record.nproc
    return members


def _replacements(previous: RoundRecord | None, members: list[Member]) -> list[tuple[str, str]]:
    """Members of `previous` not in `members`, each paired with a newcomer that took a place, in order."""
    if previous is None:
        return []
    kept = {(m.node, m.incarnation) for m in members}
    gone = [n for n, inc in zip(previous.nodes, previous.incarnations) if (n, inc) not in kept]
    before = set(zip(previous.nodes, previous.incarnations))
    newcomers = [m.node for m in members if (m.node, m.incarnation) not in before]
    return list(zip(gone, newcomers))


def root_cause(failures: list[WorkerFailure]) -> WorkerFailure:
    """The earliest failure that was not a consequence of a peer's (the earliest of all when every one was):
    later ones are usually peers noticing the first, as torchrun reports it, but a peer can notice first."""
    causes = [failure for failure in failures if not failure.consequence]
    return min(causes or failures, key=lambda f: (f.time, f.rank))


def charged_nodes(failures: list[WorkerFailure], members: list[Member]) -> list[str]:
    """The nodes a round's `failures` are charged to, by name (evidence from `launcher.workers.failure_evidence`).

    Broken network paths first: the nodes touching the most of them (two nodes that lost each other are both
    charged, and either one out mends the job; a node that lost everyone touches every broken path and is
    charged alone; a path whose far end is unknown touches its reporter only; an address several members share,
    nodes on one host, names none of them). Without such evidence, the node of the earliest failure that was
    not a consequence of a peer's; none when every failure was (every rank hung waiting in a collective).
    """
    by_addr: dict[str, set[str]] = {}
    for member in members:
        by_addr.setdefault(member.addr, set()).add(member.node)
    broken: set[frozenset[str]] = set()
    for failure in failures:
        if not failure.path_broken:
            continue
        peers = {peer for addr in failure.unreachable if len(by_addr.get(addr, ())) == 1 for peer in by_addr[addr]}
        peers.discard(failure.node)
        broken.update(frozenset((failure.node, peer)) for peer in peers)
        if not peers:
            broken.add(frozenset((failure.node,)))
    if broken:
        touching = Counter(node for path in broken for node in path)
        most = max(touching.values())
        return sorted(node for node, count in touching.items() if count == most)
    cause = root_cause(failures)
    return [] if cause.consequence else [cause.node]


def failure_summary(rdzv_id: str, restarts: int, cause: WorkerFailure) -> str:
    exit_text = f"exit code {cause.exit_code}" if cause.exit_code >= 0 else f"killed by signal {-cause.exit_code}"
    lines = [
        f"job {rdzv_id} failed after {restarts} restart(s): root cause node {cause.node}, "
        f"rank {cause.rank} (local_rank {cause.local_rank}), {exit_text}, in round {cause.round}"
    ]
    if cause.message:
        lines.append(f"error: {cause.message}")
    if cause.traceback:
        lines.append(cause.traceback.rstrip())
    return "\n".join(lines)


def _alive(view: JobView, member: Member) -> bool:
    record = view.nodes.get(member.node)
    return record is not None and record.lease == member.incarnation


def _leaving(view: JobView, node: str, incarnation: int) -> bool:
    notice = view.left.get(node)
    return notice is not None and notice.incarnation == incarnation


def _quarantined(view: JobView, wall: float) -> dict[str, float]:
    """Nodes kept out of rounds at unix time `wall`, with the time their quarantine ends."""
    if view.round is None:
        return {}
    return {n: until for n, until in view.round.quarantined.items() if until > wall}


def _eligible(view: JobView, wall: float) -> dict[str, NodeRecord]:
    """Registered nodes that may join a round: every one but those on their way out or in quarantine."""
    kept_out = _quarantined(view, wall)
    return {n: r for n, r in view.nodes.items() if not _leaving(view, n, r.lease) and n not in kept_out}


def _members(view: JobView) -> list[Member]:
    return view.round.members if view.round is not None else []


def _waiting(view: JobView, eligible: dict[str, NodeRecord]) -> list[str]:
    """Eligible nodes that are not (this incarnation of) a member of the current round."""
    if view.round is None:
        return list(eligible)
    return [n for n, r in eligible.items() if view.round.member(n, r.lease) is None]


def _silent(view: JobView) -> list[Member]:
    reports = view.current()
    return [m for m in _members(view) if m.node not in reports.failed and m.node not in reports.done]


def _since(current: float | None, holds: bool, now: float) -> float | None:
    if not holds:
        return None
    return now if current is None else current


def track(view: JobView, clock: Clock, now: float, settings: Settings, applied: Decision | None = None) -> Clock:
    """The clock after looking at `view` at `now`: conditions that began are stamped, those that ended cleared.

    `applied` is the decision the controller applies at `now`: the probes it makes are remembered here, since
    they leave nothing in etcd, so that rule 6 probes a member once a round and rule 7 once a stall interval.
    """
    number = view.round.round if view.round is not None else None
    if number != clock.round:
        clock = Clock(
            leading_since=clock.leading_since,
            round=number,
            round_seen_at=now if number is not None else None,
            quorum_since=clock.quorum_since,
            short_since=clock.short_since,
            wall_offset=clock.wall_offset,
        )
    eligible = _eligible(view, now + clock.wall_offset)
    members = _members(view)
    gone = [m for m in members if not _alive(view, m)]
    leaving = [m for m in members if _alive(view, m) and _leaving(view, m.node, m.incarnation)]
    has_room = view.round is not None and len(members) < settings.max_nodes
    rollcall = view.round is not None and view.round.round in view.rollcalls
    if isinstance(applied, ProbeMembers) and applied.stall:
        clock = dataclasses.replace(clock, stall_probed_at=now)
    elif isinstance(applied, ProbeMembers):
        clock = dataclasses.replace(clock, probed=clock.probed | set(applied.members))
    return dataclasses.replace(
        clock,
        quorum_since=_since(clock.quorum_since, view.round is None and len(eligible) >= settings.min_nodes, now),
        short_since=_since(clock.short_since, bool(gone) and len(eligible) < settings.min_nodes, now),
        joiner_since=_since(clock.joiner_since, has_room and bool(_waiting(view, eligible)), now),
        rollcall_since=_since(clock.rollcall_since, rollcall, now),
        leaving_since=_since(clock.leaving_since, bool(leaving), now),
        drain_since=_since(clock.drain_since, view.round is not None and view.round.round in view.drains, now),
    )


# -- the rules -------------------------------------------------------------------------------------------------
def decide(view: JobView, clock: Clock, now: float, settings: Settings) -> Decision:
    """The one thing the controller should do next (see the module docstring for the rules)."""
    if view.status is not None:
        return Wait(until=None, why="the job is over")
    stale = _stale_leave_notices(view)
    if stale:
        return ForgetLeft(nodes=stale)
    if view.round is None:
        return _first_round(view, clock, now, settings)
    return _running_round(view, view.round, clock, now, settings)


def _stale_leave_notices(view: JobView) -> list[str]:
    stale = []
    for node, notice in view.left.items():
        still_here = _alive(view, Member(node, notice.incarnation, 0, 1, 0, ""))
        member = view.round is not None and view.round.member(node, notice.incarnation) is not None
        if not still_here and not member:
            stale.append(node)
    return stale


def _first_round(view: JobView, clock: Clock, now: float, settings: Settings) -> Decision:
    wall = now + clock.wall_offset
    eligible = _eligible(view, wall)
    count = len(eligible)
    if count >= settings.max_nodes:
        return _form(view, eligible, RoundReason.INITIAL, 0, settings, wall)
    if count >= settings.min_nodes:
        deadline = _set(clock.quorum_since) + settings.last_call_timeout
        if now >= deadline:
            return _form(view, eligible, RoundReason.INITIAL, 0, settings, wall)
        return Wait(until=deadline, why=f"last call: {count} of up to {settings.max_nodes} node(s)")
    deadline = clock.leading_since + settings.join_timeout
    if now >= deadline:
        return EndJob(
            finished=False,
            summary=f"rendezvous timed out: {count} of at least {settings.min_nodes} node(s) joined "
            f"within join_timeout={settings.join_timeout:g}s",
        )
    return Wait(until=deadline, why=f"waiting for nodes: {count} of at least {settings.min_nodes}")


def _running_round(view: JobView, round_: RoundRecord, clock: Clock, now: float, settings: Settings) -> Decision:
    """Rules 4 to 9, in order: the first that has something to do decides."""
    for rule in (_lost_members, _leaving_members, _failed_workers, _probe_for_stall, _finished):
        decision = rule(view, round_, clock, now, settings)
        if decision is not None:
            return decision
    return _evict_or_grow(view, round_, clock, now, settings)


def _lost_members(view: JobView, round_: RoundRecord, clock: Clock, now: float, settings: Settings) -> Decision | None:
    """Rule 4: members whose incarnation is gone are marked lost, then a round forms without them (after a leave,
    once the others drained), or the job fails once fewer than MIN nodes were left for join_timeout."""
    gone = [m for m in round_.members if not _alive(view, m)]
    if not gone:
        return None
    reports = view.current()
    unmarked = {
        m.node: "lease expired" if m.node not in view.nodes else "registered again as a new incarnation"
        for m in gone
        if m.node not in reports.lost and not _leaving(view, m.node, m.incarnation)
    }
    if unmarked:
        return MarkLost(reasons=unmarked)
    wall = now + clock.wall_offset
    eligible = _eligible(view, wall)
    left = [m.node for m in gone if _leaving(view, m.node, m.incarnation)]
    reason = RoundReason.NODE_LEFT if len(left) == len(gone) else RoundReason.NODE_LOST
    if reason is RoundReason.NODE_LEFT and round_.round in view.drains and not reports.failed:
        # a leaver goes once its own workers drained, and can be gone before its peers' answers are in: their
        # workers drain at the same step, so wait for the answers (as a scale-up does) up to drain_timeout, or
        # until a failure says they will not come
        answers = _drain_answers(view)
        draining = [m.node for m in round_.members if m not in gone and m.node not in answers]
        deadline = _set(clock.drain_since) + settings.drain_timeout
        if draining and now < deadline:
            return Wait(until=deadline, why=f"{', '.join(draining)} draining")
    if len(eligible) >= settings.min_nodes:
        return _form(view, eligible, reason, round_.restart_count, settings, wall, handled_left=left)
    deadline = _set(clock.short_since) + settings.join_timeout
    if now >= deadline:
        return EndJob(
            finished=False,
            summary=f"only {len(eligible)} node(s) left, fewer than MIN={settings.min_nodes}, "
            f"for join_timeout={settings.join_timeout:g}s",
        )
    return Wait(until=deadline, why=f"{len(eligible)} node(s), fewer than MIN={settings.min_nodes}")


def _leaving_members(
    view: JobView, round_: RoundRecord, clock: Clock, now: float, settings: Settings
) -> Decision | None:
    """Rule 5: a member that announced it is leaving has its round drained, then is waited for until
    close_timeout and evicted after it. The drain is answered in memory where one member leaves and the others
    are enough to go on: each node's part of a snapshot is copied to the next node only, so the part of one of
    two leaving neighbours would leave with the other; and a job that falls below MIN may end with the nodes
    that stay. A drain asked in memory whose premise went (a second member announced it leaves) is withdrawn,
    and asked again to disk."""
    leaving = [m for m in round_.members if _leaving(view, m.node, m.incarnation)]
    if not leaving:
        return None
    if settings.drain_timeout:
        in_memory = len(leaving) == 1 and len(round_.members) - 1 >= settings.min_nodes
        asked = view.drains.get(round_.round)
        if asked is None:  # the leaving agent waits for it
            return RequestDrain(round=round_.round, reason=RoundReason.NODE_LEFT.value, in_memory=in_memory)
        if asked.in_memory and not in_memory:
            return WithdrawDrain(round=round_.round, why="more than one member leaves: draining to disk instead")
    return _evict_after_close_timeout(
        leaving,
        _set(clock.leaving_since),
        now,
        settings,
        "did not finish leaving",
        f"{', '.join(m.node for m in leaving)} leaving",
    )


def _failed_workers(
    view: JobView, round_: RoundRecord, clock: Clock, now: float, settings: Settings
) -> Decision | None:
    """Rule 6: once every silent member answered the roll call, failed workers are a worker failure: a new
    round with one more restart, or the end of the job past --max-restarts."""
    reports = view.current()
    if not reports.failed:
        return None
    rollcall = _roll_call(view, round_, clock, now, settings)
    if rollcall is not None:
        return rollcall
    failures = [f for report in reports.failed.values() for f in report.failures]
    restarts = round_.restart_count + 1
    if restarts > settings.max_restarts:
        cause = root_cause(failures)
        return EndJob(
            finished=False, summary=failure_summary(settings.rdzv_id, round_.restart_count, cause), cause=cause
        )
    wall = now + clock.wall_offset
    charged = charged_nodes(failures, round_.members)
    return _form(view, _eligible(view, wall), RoundReason.WORKER_FAILED, restarts, settings, wall, charged=charged)


def _roll_call(view: JobView, round_: RoundRecord, clock: Clock, now: float, settings: Settings) -> Decision | None:
    """Rule 6, before a failure counts: the silent members are called, their agents probed once, and those that
    never answer evicted after close_timeout. None: every member reported or answered."""
    silent = _silent(view)
    if not silent:
        return None
    rollcall = view.rollcalls.get(round_.round)
    if rollcall is None:
        return CallRollCall(round=round_.round)
    reports = view.current()
    unanswered = [m for m in silent if reports.alive.get(m.node) != rollcall.nonce]
    unprobed = {
        m.node: view.nodes[m.node]
        for m in unanswered
        if settings.probe_timeout and m.node not in clock.probed and view.nodes[m.node].probe_port
    }
    if unprobed:
        return ProbeMembers(members=unprobed, peers=_probe_peers(view, unprobed))
    if not unanswered:
        return None
    return _evict_after_close_timeout(
        unanswered,
        _set(clock.rollcall_since),
        now,
        settings,
        "did not answer the roll call",
        f"roll call: {len(unanswered)} member(s) have not answered",
    )


def _finished(view: JobView, round_: RoundRecord, clock: Clock, now: float, settings: Settings) -> Decision | None:
    """Rule 8: every member reported success."""
    if not all(m.node in view.current().done for m in round_.members):
        return None
    return EndJob(finished=True, summary=f"job {settings.rdzv_id} finished")


def _evict_or_grow(view: JobView, round_: RoundRecord, clock: Clock, now: float, settings: Settings) -> Decision:
    """Rule 9: members that did not start the round are evicted after close_timeout; waiting nodes that fit form
    a scale-up round, drained first; otherwise wait for the earliest deadline of rules 7 and 9 and quarantines."""
    reports = view.current()
    wall = now + clock.wall_offset
    eligible = _eligible(view, wall)
    members = round_.members
    deadlines: list[float] = []
    unstarted = [m for m in members if m.node not in reports.acked and m.node not in reports.done]
    if unstarted:
        decision = _evict_after_close_timeout(
            unstarted,
            _set(clock.round_seen_at),
            now,
            settings,
            f"did not start round {round_.round}",
            "members starting",
        )
        if isinstance(decision, MarkLost):
            return decision
        if decision.until is not None:
            deadlines.append(decision.until)

    waiting = _waiting(view, eligible)
    growing = bool(waiting) and len(members) < settings.max_nodes
    if round_.round in view.drains and not growing:
        return WithdrawDrain(round=round_.round)
    if growing:
        deadline = _set(clock.joiner_since) + settings.last_call_timeout
        if len(members) + len(waiting) >= settings.max_nodes or now >= deadline:
            if settings.drain_timeout and round_.round not in view.drains:
                return RequestDrain(round=round_.round, reason=RoundReason.SCALE_UP.value, in_memory=True)
            drain_deadline = (clock.drain_since or now) + settings.drain_timeout
            if not settings.drain_timeout or _drained(view) or now >= drain_deadline:
                return _form(view, eligible, RoundReason.SCALE_UP, round_.restart_count, settings, wall)
            deadline = drain_deadline
        deadlines.append(deadline)
    registered_out = [until for n, until in _quarantined(view, wall).items() if n in view.nodes]
    if registered_out:
        deadlines.append(min(registered_out) - clock.wall_offset)  # readmitted then, as a waiting node
    stall_probed_at = clock.stall_probed_at
    if stall_probed_at is not None and _stall_suspects(view, settings):
        deadlines.append(stall_probed_at + STALL_PROBE_EVERY_S)  # probed again then, if the stall lasts
    return Wait(until=min(deadlines) if deadlines else None, why="round running")


def _stall_suspects(view: JobView, settings: Settings) -> dict[str, NodeRecord]:
    """While some member's workers are stalled: the members that could be why (alive by their lease, reported
    neither a stall nor an outcome, with a probe port), with their registrations. Empty: no stall, or no suspect."""
    reports = view.current()
    if not settings.probe_timeout or not any(node not in reports.done for node in reports.stalled):
        return {}
    reported = reports.stalled.keys() | reports.failed.keys() | reports.done
    return {m.node: view.nodes[m.node] for m in _members(view) if m.node not in reported and _probeable(view, m)}


def _probe_for_stall(
    view: JobView, round_: RoundRecord, clock: Clock, now: float, settings: Settings
) -> ProbeMembers | None:
    """Rule 7: probe the suspects of a stall, unless they were probed less than STALL_PROBE_EVERY_S ago."""
    suspects = _stall_suspects(view, settings)
    if not suspects:
        return None
    if clock.stall_probed_at is not None and now < clock.stall_probed_at + STALL_PROBE_EVERY_S:
        return None
    return ProbeMembers(members=suspects, stall=True, peers=_probe_peers(view, suspects))


def _probe_peers(view: JobView, suspects: dict[str, NodeRecord]) -> dict[str, NodeRecord]:
    """Up to PROBE_PEERS live members other than `suspects` that have a probe port, in rank order."""
    peers: dict[str, NodeRecord] = {}
    for m in _members(view):
        if len(peers) == PROBE_PEERS:
            break
        if m.node not in suspects and _probeable(view, m):
            peers[m.node] = view.nodes[m.node]
    return peers


def _probeable(view: JobView, member: Member) -> bool:
    """The member's agent is alive by its lease and answers probes (it registered a probe port)."""
    return _alive(view, member) and bool(view.nodes[member.node].probe_port)


def _drain_answers(view: JobView) -> dict[str, DrainReport]:
    """Members' answers to the current round's drain (an answer to a withdrawn earlier one does not count)."""
    request = view.drains.get(view.round.round) if view.round is not None else None
    if request is None:
        return {}
    return {node: r for node, r in view.current().drained.items() if r.number == request.number}


def _drained(view: JobView) -> bool:
    """Every member of the current round answered its drain."""
    answers = _drain_answers(view)
    return bool(answers) and view.round is not None and all(m.node in answers for m in view.round.members)


def _drain_outcome(view: JobView) -> DrainOutcome | None:
    """How the current round's drain went, when the next round forms; None when none was asked for."""
    if view.round is None or view.round.round not in view.drains:
        return None
    steps = [r.step for r in _drain_answers(view).values() if r.step is not None]
    return DrainOutcome(round=view.round.round, committed=_drained(view), step=max(steps, default=None))


def _set(since: float | None) -> float:
    """A clock reading that `track` set, because the condition it times holds in this view."""
    assert since is not None, "track() times every condition that holds"
    return since


def _evict_after_close_timeout(
    members: list[Member], since: float, now: float, settings: Settings, failed_to: str, waiting_for: str
) -> MarkLost | Wait:
    """Members that `failed_to` do something within close_timeout of `since` are evicted: lost, and fenced."""
    deadline = since + settings.close_timeout
    if now < deadline:
        return Wait(until=deadline, why=waiting_for)
    reason = f"{failed_to} within close_timeout={settings.close_timeout:g}s"
    return MarkLost(reasons={m.node: reason for m in members}, revoke={m.node: m.incarnation for m in members})


def _form(
    view: JobView,
    eligible: dict[str, NodeRecord],
    reason: RoundReason,
    restart_count: int,
    settings: Settings,
    wall: float,
    charged: Sequence[str] = (),
    handled_left: Sequence[str] = (),
) -> FormRound:
    """The next round of `eligible` nodes; each node `charged` with a worker failure takes a strike."""
    previous = view.round
    number = previous.round + 1 if previous is not None else 0
    strikes, quarantined, newly = {}, _quarantined(view, wall), []
    if previous is not None:
        # a strike counts only consecutive rounds: taking part without causing the failure clears it
        strikes = {n: k for n, k in previous.strikes.items() if n not in previous.nodes}
        counts = {node: previous.strikes.get(node, 0) + 1 for node in charged}
        for node in sorted(counts, key=lambda n: (-counts[n], n)):
            enough_left = len(eligible) - (node in eligible) >= settings.min_nodes
            if settings.quarantine_after and counts[node] >= settings.quarantine_after and enough_left:
                quarantined[node] = wall + settings.quarantine_cooldown
                eligible = {n: r for n, r in eligible.items() if n != node}
                newly.append(node)
            else:
                strikes[node] = counts[node]
    readmitted = sorted(set(previous.quarantined) - set(quarantined)) if previous is not None else []
    members = assign_ranks(previous, eligible, settings.max_nodes)
    return FormRound(
        replaced=_replacements(previous, members),
        number=number,
        members=members,
        reason=reason,
        restart_count=restart_count,
        handled_left=list(handled_left),
        strikes=strikes,
        quarantined=quarantined,
        newly_quarantined=newly,
        readmitted=readmitted,
        drain=_drain_outcome(view),
    )
