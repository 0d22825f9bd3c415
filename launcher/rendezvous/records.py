"""The records a job keeps in etcd, as validated models. Where they live is `launcher.rendezvous.protocol`'s
business."""

from __future__ import annotations

import functools
import math
import time
import zlib
from dataclasses import dataclass
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator


class Record(BaseModel):
    model_config = ConfigDict(extra="ignore", frozen=True)

    def dumps(self) -> str:
        return self.model_dump_json(exclude_none=True)

    @classmethod
    def loads(cls, raw: bytes | str):
        return cls.model_validate_json(raw)


class NodeRecord(Record):
    """An agent's registration, held under its lease: it disappears when the agent is lost.

    `lease` is the registration's incarnation: an agent that registers again under the same node id is a
    newcomer with another lease, never the member of a round formed for its previous incarnation.
    """

    node: str
    addr: str
    nproc: int = Field(ge=1)
    lease: int
    pid: int
    joined_at: float = Field(default_factory=time.time)
    probe_port: int = 0  # where its agent answers liveness probes (launcher.rendezvous.liveness); 0: it does not
    # workers ready in standby when it registered (launcher.workers.standby): its first round hands them their ranks
    prepared: int = Field(0, ge=0)


@dataclass(frozen=True)
class Member:
    """One node's place in a round."""

    node: str
    incarnation: int
    group_rank: int
    nproc: int
    first_rank: int
    addr: str

    @property
    def last_rank(self) -> int:
        return self.first_rank + self.nproc - 1


class RoundHeader(Record):
    """What every agent watches of a round: a few hundred bytes whatever the job's size.

    The members sit in `buckets` separate records, by a hash of the node id, so an agent receives only its own
    bucket: receiving every member list would cost etcd N x N bytes per round. A bucket holds about
    MEMBERS_PER_BUCKET members (a hash spreads them, not a count) in a round near the job's maximum size.
    """

    round: int = Field(ge=0)
    size: int = Field(ge=0)  # members
    world_size: int = Field(ge=0)
    restart_count: int = 0
    reason: str
    formed_at: float = Field(default_factory=time.time)
    buckets: int = Field(ge=1)
    # node -> consecutive rounds it took part in whose worker failure it caused (only nodes with one or more)
    strikes: dict[str, int] = {}
    # node -> unix time until which it is kept out of rounds
    quarantined: dict[str, float] = {}


class MemberBucket(Record):
    """The members of one round whose node ids hash to one bucket, with their places in the round."""

    # the header's: a bucket a rival controller wrote for the same round number, and lost the race with, is not this
    # round's (an agent may see it in its watch before the winner's)
    formed_at: float = 0.0
    nodes: list[str]
    incarnations: list[int]
    nproc: list[int]
    addrs: list[str]
    group_ranks: list[int]
    first_ranks: list[int]

    def member(self, node: str, incarnation: int | None = None) -> Member | None:
        i = _position(self.nodes, self.incarnations, node, incarnation)
        if i is None:
            return None
        return Member(
            node, self.incarnations[i], self.group_ranks[i], self.nproc[i], self.first_ranks[i], self.addrs[i]
        )


def _position(nodes: list[str], incarnations: list[int], node: str, incarnation: int | None) -> int | None:
    """Where `node` (that incarnation of it, if given) stands in column-wise members; None if absent."""
    try:
        index = nodes.index(node)
    except ValueError:
        return None
    return None if incarnation is not None and incarnations[index] != incarnation else index


# what one agent receives of a round, about 4 KB whatever the job's size: a cap on the bucket count instead would make
# the bytes etcd sends per round grow as N x N
MEMBERS_PER_BUCKET = 64


def bucket_of(node: str, buckets: int) -> int:
    return zlib.crc32(node.encode()) % buckets


def watched_bucket_count(max_nodes: int) -> int:
    """How many buckets a round of a job of at most `max_nodes` nodes has when it is near that size: what an agent
    knows before any round forms, so that it watches its bucket and etcd sends it the bucket with the round."""
    return max(1, math.ceil(max_nodes / MEMBERS_PER_BUCKET))


def bucket_count(size: int, max_nodes: int) -> int:
    """How many buckets a round of `size` members has: the watched count, unless that would leave the buckets
    mostly empty (a job far below its maximum would write hundreds of near-empty buckets every round); its
    agents then read their bucket instead."""
    watched, by_size = watched_bucket_count(max_nodes), max(1, math.ceil(size / MEMBERS_PER_BUCKET))
    return watched if watched <= _SPARSE_BUCKETS * by_size else by_size


_SPARSE_BUCKETS = 4  # how many times more buckets than a round's size needs are still worth watching


class RoundRecord(Record):
    """A membership round as a whole: who trains, with which ranks. The controller's view of a round.

    Stored column-wise, in group-rank order; ranks are handed out cumulatively in that order. In etcd it is
    split (`split`) into a RoundHeader and MemberBuckets, written in one transaction.
    """

    round: int = Field(ge=0)
    nodes: list[str]
    incarnations: list[int]
    nproc: list[int]
    addrs: list[str]
    restart_count: int = 0
    reason: str
    formed_at: float = Field(default_factory=time.time)
    strikes: dict[str, int] = {}
    quarantined: dict[str, float] = {}

    @model_validator(mode="after")
    def _columns_agree(self) -> RoundRecord:
        if not len(self.nodes) == len(self.incarnations) == len(self.nproc) == len(self.addrs):
            raise ValueError("round record columns differ in length")
        return self

    @classmethod
    def of(
        cls,
        round_: int,
        members: list[Member],
        restart_count: int,
        reason: str,
        strikes: dict[str, int] | None = None,
        quarantined: dict[str, float] | None = None,
    ) -> RoundRecord:
        return cls(
            round=round_,
            nodes=[m.node for m in members],
            incarnations=[m.incarnation for m in members],
            nproc=[m.nproc for m in members],
            addrs=[m.addr for m in members],
            restart_count=restart_count,
            reason=reason,
            strikes=strikes or {},
            quarantined=quarantined or {},
        )

    @property
    def world_size(self) -> int:
        return sum(self.nproc)

    @property
    def members(self) -> list[Member]:
        return list(self._members)

    def member(self, node: str, incarnation: int | None = None) -> Member | None:
        """`node`'s place in this round; None if it is not a member (or, given an incarnation, not that one)."""
        found = self._by_node.get(node)
        return None if found is None or (incarnation is not None and found.incarnation != incarnation) else found

    # Built once per record (it is frozen): the controller asks about every registered node in each decision, and
    # a search of the columns per node made that quadratic (80 ms a decision at 2,048 nodes, on the GIL of the
    # controller's host, whose agents then missed their lease refreshes).
    @functools.cached_property
    def _members(self) -> tuple[Member, ...]:
        found, first_rank = [], 0
        for group_rank, (node, incarnation, nproc, addr) in enumerate(
            zip(self.nodes, self.incarnations, self.nproc, self.addrs)
        ):
            found.append(Member(node, incarnation, group_rank, nproc, first_rank, addr))
            first_rank += nproc
        return tuple(found)

    @functools.cached_property
    def _by_node(self) -> dict[str, Member]:
        by_node: dict[str, Member] = {}
        for member in self._members:
            by_node.setdefault(member.node, member)  # the first, as a search of the columns finds
        return by_node

    def member_summary(self) -> list[dict]:
        return [
            {"node": m.node, "group_rank": m.group_rank, "first_rank": m.first_rank, "last_rank": m.last_rank}
            for m in self.members
        ]

    def split(self, count: int) -> tuple[RoundHeader, list[MemberBucket]]:
        """The header every agent watches, and the `count` member buckets each agent receives one of."""
        columns: list[dict[str, list]] = [
            {"nodes": [], "incarnations": [], "nproc": [], "addrs": [], "group_ranks": [], "first_ranks": []}
            for _ in range(count)
        ]
        for m in self.members:
            column = columns[bucket_of(m.node, count)]
            for name, value in (
                ("nodes", m.node),
                ("incarnations", m.incarnation),
                ("nproc", m.nproc),
                ("addrs", m.addr),
                ("group_ranks", m.group_rank),
                ("first_ranks", m.first_rank),
            ):
                column[name].append(value)
        header = RoundHeader(
            round=self.round,
            size=len(self.nodes),
            world_size=self.world_size,
            restart_count=self.restart_count,
            reason=self.reason,
            formed_at=self.formed_at,
            buckets=count,
            strikes=self.strikes,
            quarantined=self.quarantined,
        )
        return header, [MemberBucket(formed_at=self.formed_at, **column) for column in columns]

    @classmethod
    def assemble(cls, header: RoundHeader, buckets: list[MemberBucket]) -> RoundRecord:
        """The whole round from its stored parts (the inverse of `split`)."""
        members = sorted(
            (
                Member(n, inc, g, p, f, a)
                for b in buckets
                for n, inc, p, a, g, f in zip(b.nodes, b.incarnations, b.nproc, b.addrs, b.group_ranks, b.first_ranks)
            ),
            key=lambda m: m.group_rank,
        )
        return cls.of(
            header.round, members, header.restart_count, header.reason, header.strikes, header.quarantined
        ).model_copy(update={"formed_at": header.formed_at})


class MasterRecord(Record):
    """Where a round's store is served: a fresh port every round, so no round reads another's keys. By group
    rank 0's agent, through a process forked from its zygote (`agent_store`: the workers connect as clients,
    TORCHELASTIC_USE_AGENT_STORE=True), or else by rank 0's worker."""

    addr: str
    port: int
    agent_store: bool = False


class WorkerFailure(Record):
    node: str
    round: int
    local_rank: int
    rank: int
    exit_code: int
    time: float
    message: str = ""
    traceback: str = ""
    # set when the progress watchdog found the worker hung and killed it (launcher.workers.watchdog)
    hung: bool = False
    seconds_silent: float | None = None
    last_step: int | None = None
    # what its traces say of the cause (launcher.workers.failure_evidence): a network path broke (to the peer
    # addresses in `unreachable`, where known), or it failed because a peer did
    path_broken: bool = False
    unreachable: list[str] = Field(default_factory=list)
    consequence: bool = False


class NodeFailure(Record):
    """What one agent saw fail in a round: every failed local worker, earliest first."""

    node: str
    round: int
    failures: list[WorkerFailure]


class StallReport(Record):
    """An agent's notice that every one of its workers has been silent for several of its own step intervals
    (launcher.workers.watchdog.stall_of): peers block in a collective when a node stops, so nothing fails to tell the
    controller; it probes the members that are not stalled (launcher.rendezvous.decisions, rule 7)."""

    seconds_silent: float
    last_step: int | None = None


class LeaveRecord(Record):
    """An agent's notice that it is leaving: written before its workers stop, kept until the controller handled it."""

    node: str
    incarnation: int
    reason: str
    time: float = Field(default_factory=time.time)


class RollCall(Record):
    """The controller's request that every member of a round answer: a live agent does within milliseconds."""

    round: int
    nonce: str


class DrainRequest(Record):
    """The controller's request, before a planned change, that a round's workers checkpoint at their next step
    boundary and wait there (elastic.checkpoint.drain; the agents pass it on in launcher.node.round_workers)."""

    round: int
    number: int = Field(gt=0, lt=2**63)  # what the agents write into the workers' channels
    reason: Literal["scale_up", "node_left"]
    # a snapshot in memory answers it (the nodes that stay hold every part of it); False: to disk too
    in_memory: bool = False


class DrainReport(Record):
    """An agent's answer to a drain: its workers committed the checkpoint of `step`, or (None) it has no worker
    that drains (no CheckpointManager), so there is nothing to wait for."""

    number: int
    step: int | None = None


class JobStatus(Record):
    state: Literal["finished", "failed"]
    time: float = Field(default_factory=time.time)
    summary: str = ""


EventName = Literal[
    "node_joined",
    "node_left",
    "node_lost",
    "round_started",
    "workers_started",
    "worker_failed",
    "worker_hung",
    "workers_stalled",
    "restart",
    "job_finished",
    "job_failed",
    "node_quarantined",
    "node_readmitted",
    "drain_requested",
    "drain_committed",
    "drain_timed_out",
    "controller_lost",
    "training_progress",
]
TERMINAL_EVENTS = {"job_finished", "job_failed"}


class MembershipEvent(BaseModel):
    """One entry of the job's membership log (`events/`): what happened to the job, and when."""

    model_config = ConfigDict(extra="allow")

    event: EventName
    time: float
    round: int | None = None
    node: str | None = None
    world_size: int | None = None
    # round_started: each member's node and ranks, up to MAX_LOGGED_MEMBERS of them (the event is written in the
    # round's transaction, which etcd limits to 1.5 MiB); `size` counts them always
    members: list[dict] | None = None
    size: int | None = None
    local_rank: int | None = None
    rank: int | None = None
    exit_code: int | None = None
    restart_count: int | None = None
    reason: str | None = None
    message: str | None = None
    # worker_hung, workers_stalled: how long it had been (they had all been) silent when the watchdog acted
    seconds_silent: float | None = None
    last_step: int | None = None  # worker_hung, workers_stalled: the last step reported
    # drain_committed: the step the workers checkpointed before the change; training_progress: the newest step
    step: int | None = None
    in_memory: bool | None = None  # drain_requested: a snapshot in memory answers it (else it goes to disk too)
    # round_started: each member of the last round not in this one, and the newcomer (a spare) in its place
    replaced: list[dict] | None = None
    # workers_started: this node's workers handed the round in process (elastic.run), and those started anew;
    # node_joined, workers_started: its workers started in standby before the round (ready when it joined)
    inprocess: int | None = None
    fresh: int | None = None
    prepared: int | None = None
    revision: int | None = None  # etcd revision: the order of the log, filled in when read back

    def dumps(self) -> str:
        return self.model_dump_json(exclude_none=True)


def new_event(event: EventName, **fields) -> MembershipEvent:
    return MembershipEvent(event=event, time=time.time(), **fields)
