"""The rendezvous protocol: every etcd key of a job, who writes it, when, under which guard, and who removes it.

Everything lives under `/elastic/<rdzv-id>/`; live state under `state/`, the membership log under `events/`.

| key (below the job prefix)        | value          | writer      | when                                 | guard                                   | removed by                                |
|-----------------------------------|----------------|-------------|--------------------------------------|-----------------------------------------|-------------------------------------------|
| state/nodes/<node>                | NodeRecord     | agent       | register (under its lease)           | key absent (or already ours: a retry)   | lease expiry or revoke; the agent leaving |
| state/left/<node>                 | LeaveRecord    | agent       | SIGTERM/SIGINT, before workers stop  | none (the agent's own notice)           | controller, once it handled the leave     |
| state/ctl/controller              | "<node>#<lease>"| agent      | claim (under its lease), held        | key absent (or already ours)            | lease expiry or revoke; an agent whose probe finds the holder gone |
| state/ctl/round                   | RoundHeader    | controller  | form a round                         | holds controller; round rev unchanged; no status | never (replaced by the next round) |
| state/members/<bucket>/<round>    | MemberBucket   | controller  | with the round's header (same txn); those its txn has no room for just before it | as the header | controller: a bucket's older rounds with its write two rounds on; buckets past the count with the next header |
| state/ctl/master/<round>          | MasterRecord   | group rank 0| before starting its workers          | round rev unchanged                     | controller, when the next round forms     |
| state/ctl/rollcall/<round>        | RollCall       | controller  | workers failed while a member is silent | holds controller; round rev unchanged | controller, when the next round forms     |
| state/ctl/drain/<round>           | DrainRequest   | controller  | before a scale-up or a node leaving  | holds controller; round rev unchanged   | controller: next round, or change off     |
| state/ctl/status                  | JobStatus      | controller  | finish, fail                         | holds controller; round rev unchanged; no status | purge                             |
| state/rounds/<round>/ack/<node>   | agent pid      | agent       | its workers started                  | round rev unchanged                     | controller, when the next round forms     |
| state/rounds/<round>/done/<node>  | "0"            | agent       | its workers all exited 0             | round rev unchanged                     | controller, when the next round forms     |
| state/rounds/<round>/failed/<node>| NodeFailure    | agent       | a worker exited non-zero or hung     | round rev unchanged                     | controller, when the next round forms     |
| state/rounds/<round>/alive/<node> | roll-call nonce| agent       | it saw the round's roll call         | round rev unchanged                     | controller, when the next round forms     |
| state/rounds/<round>/drained/<node>| DrainReport   | agent       | its workers committed the drain's checkpoint | round rev unchanged             | controller, when the next round forms     |
| state/rounds/<round>/stalled/<node>| StallReport   | agent       | all its workers silent for several step intervals | round rev unchanged        | the agent, when they beat again; controller, when the next round forms |
| state/rounds/<round>/lost/<node>  | reason         | controller  | a member's lease ended, or it was evicted | holds controller; marker absent    | controller, when the next round forms     |
| events/<time_ns>-<author>-<seq>   | MembershipEvent| both        | in the same transaction as the change | that change's guard                    | controller keeps the newest `max_events`; purge |
| access-check/<uuid>               | ""             | elastic-run | at start, before the agent: may this etcd user write here? | none (unique to the check) | the same check, at once |

Agents watch `state/ctl/` (a few small keys per round, whatever the job's size) and the one member bucket that
holds their node (by a hash of the node id, over the bucket count of a round near `--nnodes` MAX:
`records.bucket_count`), so etcd sends each agent its place with the round; where a round has another count (far
below MAX) the agent reads its bucket. The controller watches all of `state/`. Every write that
may be retried carries a marker key unique to that attempt (its event, or its own value), so a retry whose first attempt committed, and only the reply was lost, recognises its own write.

`JobKeys` builds every key of the table and `JobKeys.parse` reads one back as a typed key (`NodeKey`, `ReportKey`,
...): nothing else spells the layout. `JobStore` does every read and write of a job; it retries while etcd does not
answer and raises the launcher's errors, never gRPC's: `EtcdUnavailable` once its deadline passed, `LeaseGone`,
`NodeIdTaken`. A refusal (an etcd user without the rights) stays the client's error, which `etcd_client.explain` words.
"""

from __future__ import annotations

import itertools
import logging
import time
import uuid
from dataclasses import dataclass
from enum import Enum
from typing import Any, TypeAlias

from pydantic import ValidationError

from launcher.etcd.entry import Entry
from launcher.etcd.errors import EtcdTimedOut, LeaseGone, call_with_retry
from launcher.rendezvous.records import (
    DrainReport,
    DrainRequest,
    JobStatus,
    LeaveRecord,
    MasterRecord,
    Member,
    MemberBucket,
    MembershipEvent,
    NodeFailure,
    NodeRecord,
    RollCall,
    RoundHeader,
    RoundRecord,
    StallReport,
    bucket_of,
    new_event,
)

logger = logging.getLogger(__name__)

KEY_ROOT = "/elastic"
_sequence = itertools.count()
# How long a call waits for etcd to answer before it raises EtcdUnavailable:
_WRITE_DEADLINE_S = 30.0  # the protocol's writes and reads that the job cannot go on without
_STEP_DEADLINE_S = 5.0  # an agent's own steps, which its caller retries or gives up on its own schedule
# etcd allows 128 operations in one transaction by default (--max-txn-ops). A bucket takes two (its put and the
# clean-up of its older rounds); 64 buckets of ~64 members are ~280 KB, well inside its 1.5 MiB request limit.
_MAX_TRANSACTION_OPS = 128
_HOUSEKEEPING_DEADLINE_S = 1.0  # trimming and mirroring the log: its next turn does what this one could not
# (full key, mod revision) of every malformed event warned about: once per process, however often it is read
_warned_events: set[tuple[str, int]] = set()


class NodeIdTaken(Exception):
    """Another live agent holds this node id in the job."""


class ReportKind(str, Enum):
    """What a node reports about a round, under `state/rounds/<round>/<kind>/<node>` (`lost`: the controller)."""

    ACK = "ack"
    DONE = "done"
    FAILED = "failed"
    ALIVE = "alive"
    DRAINED = "drained"
    STALLED = "stalled"
    LOST = "lost"


# The keys of the table, parsed (`JobKeys.parse`): what each names, without the job it belongs to.
@dataclass(frozen=True)
class NodeKey:
    node: str


@dataclass(frozen=True)
class LeftKey:
    node: str


@dataclass(frozen=True)
class ControllerKey:
    pass


@dataclass(frozen=True)
class RoundHeaderKey:
    pass


@dataclass(frozen=True)
class StatusKey:
    pass


@dataclass(frozen=True)
class MasterKey:
    round: int


@dataclass(frozen=True)
class RollCallKey:
    round: int


@dataclass(frozen=True)
class DrainKey:
    round: int


@dataclass(frozen=True)
class MemberBucketKey:
    round: int
    bucket: int


@dataclass(frozen=True)
class ReportKey:
    round: int
    kind: ReportKind
    node: str


@dataclass(frozen=True)
class EventKey:
    time_ns: int
    author: str
    sequence: int


@dataclass(frozen=True)
class AccessCheckKey:
    probe: str


JobKey: TypeAlias = (
    NodeKey
    | LeftKey
    | ControllerKey
    | RoundHeaderKey
    | StatusKey
    | MasterKey
    | RollCallKey
    | DrainKey
    | MemberBucketKey
    | ReportKey
    | EventKey
    | AccessCheckKey
)


class JobKeys:
    """Every key of one job, under /elastic/<rdzv-id>/, so two jobs on one etcd never see each other."""

    def __init__(self, rdzv_id: str) -> None:
        self.rdzv_id = rdzv_id
        self.prefix = f"{KEY_ROOT}/{rdzv_id}/"
        self.state = self.prefix + "state/"
        self.ctl = self.state + "ctl/"
        self.events = self.prefix + "events/"
        self.access_checks = self.prefix + "access-check/"
        self.nodes = self.state + "nodes/"
        self.left_prefix = self.state + "left/"
        self.controller = self.ctl + "controller"
        self.round = self.ctl + "round"
        self.status = self.ctl + "status"
        self.masters = self.ctl + "master/"
        self.rollcalls = self.ctl + "rollcall/"
        self.drains = self.ctl + "drain/"
        self.rounds = self.state + "rounds/"
        self.members = self.state + "members/"

    def node(self, node: str) -> str:
        return self.nodes + node

    def left(self, node: str) -> str:
        return self.left_prefix + node

    def master(self, round_: int) -> str:
        return f"{self.masters}{round_:010d}"

    def rollcall(self, round_: int) -> str:
        return f"{self.rollcalls}{round_:010d}"

    def drain(self, round_: int) -> str:
        return f"{self.drains}{round_:010d}"

    def bucket_prefix(self, bucket: int) -> str:
        """Every round's bucket `bucket`: what the agents whose node ids hash to it watch."""
        return f"{self.members}{bucket:04d}/"

    def member_bucket(self, round_: int, bucket: int) -> str:
        return f"{self.bucket_prefix(bucket)}{round_:010d}"

    def round_prefix(self, round_: int) -> str:
        return f"{self.rounds}{round_:010d}/"

    def report(self, round_: int, kind: ReportKind, node: str) -> str:
        return f"{self.round_prefix(round_)}{kind.value}/{node}"

    def new_event_key(self, author: str) -> str:
        """Sorts by time; unique per writer and call, so an event put is its own idempotence marker."""
        return f"{self.events}{time.time_ns():020d}-{author}-{next(_sequence):06d}"

    def new_access_check_key(self) -> str:
        return f"{self.access_checks}{uuid.uuid4().hex}"

    @staticmethod
    def parse(key: str) -> JobKey:
        """What the full key `key` of any job names, as the builders above spell it; ValueError if none does."""
        _, below = _split_job(key)
        match below.split("/"):
            case ["state", "nodes", node] if node:
                return NodeKey(node)
            case ["state", "left", node] if node:
                return LeftKey(node)
            case ["state", "ctl", "controller"]:
                return ControllerKey()
            case ["state", "ctl", "round"]:
                return RoundHeaderKey()
            case ["state", "ctl", "status"]:
                return StatusKey()
            case ["state", "ctl", "master", number]:
                return MasterKey(_number(number))
            case ["state", "ctl", "rollcall", number]:
                return RollCallKey(_number(number))
            case ["state", "ctl", "drain", number]:
                return DrainKey(_number(number))
            case ["state", "members", bucket, number]:
                return MemberBucketKey(_number(number), _number(bucket))
            case ["state", "rounds", number, kind, node] if node:
                return ReportKey(_number(number), ReportKind(kind), node)
            case ["events", name]:
                time_ns, _, rest = name.partition("-")
                author, _, sequence = rest.rpartition("-")
                if author:
                    return EventKey(_number(time_ns), author, _number(sequence))
            case ["access-check", probe] if probe:
                return AccessCheckKey(probe)
        raise ValueError(f"{key!r} is not a key of this protocol")


def _split_job(key: str) -> tuple[str, str]:
    """(rdzv id, the rest) of a key under KEY_ROOT."""
    rdzv_id, slash, below = key.removeprefix(KEY_ROOT + "/").partition("/")
    if not key.startswith(KEY_ROOT + "/") or not rdzv_id or not slash:
        raise ValueError(f"{key!r} is not a key of a job under {KEY_ROOT}/")
    return rdzv_id, below


def _number(text: str) -> int:
    if not text.isascii() or not text.isdigit():
        raise ValueError(f"{text!r} is not a number")
    return int(text)


@dataclass(frozen=True)
class Holder:
    """Who holds the controller key: a node id and the lease (incarnation) it holds it under."""

    node: str
    lease: int

    def encode(self) -> str:
        return f"{self.node}#{self.lease:x}"

    @classmethod
    def decode(cls, value: str) -> Holder:
        node, _, lease = value.rpartition("#")
        return cls(node, int(lease, 16))


class JobStore:
    """The named operations of the protocol on one job; the only code that reads or writes its keys.

    Each operation retries while etcd does not answer, up to its deadline, then raises EtcdUnavailable; one under
    a lease etcd no longer has raises LeaseGone (the connection, `launcher.etcd.client`, turns gRPC's errors into
    these, so that this module, which the pure rules import for its keys, imports no etcd client).
    """

    def __init__(self, client: Any, rdzv_id: str) -> None:
        self.client = client  # a launcher.etcd.client connection
        self.keys = JobKeys(rdzv_id)
        self._tx = client.transactions

    # -- plumbing ------------------------------------------------------------------------------------------
    def _commit(self, compare: list, success: list, marker: str, deadline_s: float = _WRITE_DEADLINE_S) -> bool:
        """Run one guarded transaction, retrying transient errors; True if it (or an earlier attempt) committed.

        `marker` is a key that `success` creates and nothing else does: when a retry finds its guard false,
        the marker tells whether the reason is our own first attempt. After an attempt etcd did not answer in time,
        the marker is read before the transaction is sent again: etcd, slow, applies most of those later, and
        thousands of nodes sending theirs again (4,096 acknowledging a round) would each add a copy to its backlog.
        """
        timed_out = False

        def attempt() -> bool:
            nonlocal timed_out
            try:
                if timed_out and self.client.get_response(marker, count_only=True).count:
                    return True
                won, responses = self.client.transaction(
                    compare=compare, success=success, failure=[self._tx.get(marker)]
                )
            except EtcdTimedOut:
                timed_out = True
                raise
            return won or bool(responses and responses[0])

        return call_with_retry(attempt, deadline_s=deadline_s)

    def _apply(self, compare: list, success: list, deadline_s: float = _WRITE_DEADLINE_S) -> bool:
        """Run one guarded transaction whose repeat is harmless (deletes, puts of the same values), retrying
        transient errors; True if its guard held (for deletes, a false guard means there is nothing left to do)."""
        won, _ = call_with_retry(
            self.client.transaction, compare=compare, success=success, failure=[], deadline_s=deadline_s
        )
        return won

    def _count(self, prefix: str, deadline_s: float = _WRITE_DEADLINE_S) -> int:
        return call_with_retry(self.client.get_prefix_response, prefix, count_only=True, deadline_s=deadline_s).count

    def _event(self, event: MembershipEvent, author: str) -> tuple[str, object]:
        key = self.keys.new_event_key(author)
        return key, self._tx.put(key, event.dumps())

    def _holds_controller(self, holder: Holder):
        return self._tx.value(self.keys.controller) == holder.encode()

    def _round_unchanged(self, round_revision: int):
        if round_revision == 0:
            return self._tx.version(self.keys.round) == 0
        return self._tx.mod(self.keys.round) == round_revision

    # -- agents --------------------------------------------------------------------------------------------
    def grant_lease(self, ttl: int):
        return call_with_retry(self.client.lease, ttl, deadline_s=_WRITE_DEADLINE_S)

    def register(self, record: NodeRecord) -> None:
        """Join the job under `record.lease`; raises NodeIdTaken if another incarnation holds the id."""
        key = self.keys.node(record.node)
        value = record.dumps()
        event_key, event_put = self._event(
            new_event(
                "node_joined",
                node=record.node,
                message=f"{record.addr}, {record.nproc} worker(s)",
                prepared=record.prepared or None,
            ),
            record.node,
        )

        def attempt() -> None:
            won, responses = self.client.transaction(
                compare=[self._tx.version(key) == 0],
                success=[self._tx.put(key, value, lease=record.lease), event_put],
                failure=[self._tx.get(key)],
            )
            if won:
                return
            found = responses[0] if responses else []
            if found and found[0][0].decode() == value:
                return  # our own first attempt committed; only its reply was lost
            holder = NodeRecord.loads(found[0][0]) if found else None
            raise NodeIdTaken(
                f"node id {record.node!r} is already in job (pid {holder.pid if holder else '?'} at "
                f"{holder.addr if holder else '?'}): pass a unique --node-id"
            )

        call_with_retry(attempt, deadline_s=_WRITE_DEADLINE_S)

    def announce_leaving(self, node: str, incarnation: int, reason: str) -> None:
        """Tell the controller we are leaving before our workers stop, so their peers' failures are not charged."""
        record = LeaveRecord(node=node, incarnation=incarnation, reason=reason)
        call_with_retry(self.client.put, self.keys.left(node), record.dumps(), deadline_s=_STEP_DEADLINE_S)

    def leave(self, record: NodeRecord, round_: int | None, reason: str) -> None:
        """Our workers have exited: log node_left and drop our registration in one step, then end the lease."""
        event_key, event_put = self._event(
            new_event("node_left", node=record.node, round=round_, reason=reason), record.node
        )
        key = self.keys.node(record.node)
        self._commit(
            compare=[self._tx.value(key) == record.dumps()],
            success=[event_put, self._tx.delete(key)],
            marker=event_key,
            deadline_s=_STEP_DEADLINE_S,
        )
        self.revoke(record.lease)

    def revoke(self, lease_id: int, deadline_s: float = _STEP_DEADLINE_S) -> None:
        """End a lease now; a lease that is already gone is fine."""
        try:
            call_with_retry(self.client.revoke_lease, lease_id, deadline_s=deadline_s)
        except LeaseGone as exc:
            logger.debug("lease %x already gone: %s", lease_id, exc)

    def read_node(self, node: str) -> NodeRecord | None:
        """A node's registration as etcd holds it now (None: not registered)."""
        raw, _ = call_with_retry(self.client.get, self.keys.node(node), deadline_s=_STEP_DEADLINE_S)
        return NodeRecord.model_validate_json(raw) if raw is not None else None

    def depose_controller(self, holder: Holder, reason: str, author: str) -> bool:
        """The controller's agent is gone (its probe found it so): log it and end its lease now, not at expiry,
        so a standby claims the key at once. False: `holder` no longer held it."""
        event_key, event_put = self._event(new_event("controller_lost", node=holder.node, reason=reason), author)
        deposed = self._commit(
            compare=[self._holds_controller(holder)],
            success=[event_put, self._tx.delete(self.keys.controller)],
            marker=event_key,
        )
        if deposed:
            self.revoke(holder.lease)  # fences the node: an agent alive after all finds its lease gone
        return deposed

    def claim_controller(self, holder: Holder) -> bool:
        """Become the job's controller if nobody is; the key lives and dies with the claimant's lease."""
        key, value = self.keys.controller, holder.encode()

        def attempt() -> bool:
            won, responses = self.client.transaction(
                compare=[self._tx.version(key) == 0],
                success=[self._tx.put(key, value, lease=holder.lease)],
                failure=[self._tx.get(key)],
            )
            found = responses[0] if responses and not won else []
            return won or bool(found and found[0][0].decode() == value)

        try:
            return call_with_retry(attempt, deadline_s=_STEP_DEADLINE_S)
        except LeaseGone:
            return False  # our lease ended meanwhile: the agent rejoins before it can lead

    def read_member(self, header: RoundHeader, node: str, incarnation: int) -> Member | None:
        """This incarnation's place in the round `header` announces (None: not a member): one bucket read."""
        key = self.keys.member_bucket(header.round, bucket_of(node, header.buckets))
        raw, _ = call_with_retry(self.client.get, key, deadline_s=_STEP_DEADLINE_S)
        return MemberBucket.loads(raw).member(node, incarnation) if raw is not None else None

    def publish_master(self, round_: int, round_revision: int, master: MasterRecord) -> bool:
        key = self.keys.master(round_)
        return self._commit([self._round_unchanged(round_revision)], [self._tx.put(key, master.dumps())], key)

    def acknowledge(
        self,
        round_: int,
        round_revision: int,
        node: str,
        pid: int,
        inprocess: int = 0,
        fresh: int = 0,
        prepared: int = 0,
    ) -> bool:
        """This node started its workers in the round. When `inprocess` of them were handed it in process
        (elastic.run), `prepared` took it as their first after starting in standby, and `fresh` started as new
        processes, a workers_started event says so (a round where every worker starts anew writes none: thousands
        of nodes would fill the log with them)."""
        key = self.keys.report(round_, ReportKind.ACK, node)
        writes = [self._tx.put(key, str(pid))]
        if inprocess or prepared:
            event = new_event(
                "workers_started",
                round=round_,
                node=node,
                inprocess=inprocess,
                fresh=fresh,
                prepared=prepared or None,
            )
            writes.append(self._event(event, node)[1])
        return self._commit([self._round_unchanged(round_revision)], writes, key)

    def report_done(self, round_: int, round_revision: int, node: str) -> bool:
        key = self.keys.report(round_, ReportKind.DONE, node)
        return self._commit([self._round_unchanged(round_revision)], [self._tx.put(key, "0")], key)

    def report_failed(self, round_revision: int, report: NodeFailure) -> bool:
        """Workers failed: the report and one worker_failed (or worker_hung) event each, only while the round is
        still current."""
        key = self.keys.report(report.round, ReportKind.FAILED, report.node)
        events = [
            self._event(
                new_event(
                    "worker_hung" if f.hung else "worker_failed",
                    round=report.round,
                    node=report.node,
                    local_rank=f.local_rank,
                    rank=f.rank,
                    exit_code=f.exit_code,
                    message=f.message or None,
                    **(dict(seconds_silent=f.seconds_silent, last_step=f.last_step) if f.hung else {}),
                ),
                report.node,
            )[1]
            for f in report.failures
        ]
        return self._commit([self._round_unchanged(round_revision)], [self._tx.put(key, report.dumps()), *events], key)

    def answer_rollcall(self, round_: int, round_revision: int, node: str, nonce: str) -> bool:
        key = self.keys.report(round_, ReportKind.ALIVE, node)
        return self._commit([self._round_unchanged(round_revision)], [self._tx.put(key, nonce)], key)

    def report_drained(self, round_: int, round_revision: int, node: str, report: DrainReport) -> bool:
        key = self.keys.report(round_, ReportKind.DRAINED, node)
        return self._commit([self._round_unchanged(round_revision)], [self._tx.put(key, report.dumps())], key)

    def report_stalled(self, round_: int, round_revision: int, node: str, report: StallReport) -> bool:
        """All our workers are silent past their stall allowance: the report and a workers_stalled event."""
        key = self.keys.report(round_, ReportKind.STALLED, node)
        event = new_event(
            "workers_stalled",
            round=round_,
            node=node,
            seconds_silent=round(report.seconds_silent, 3),
            last_step=report.last_step,
        )
        _, event_put = self._event(event, node)
        return self._commit(
            [self._round_unchanged(round_revision)], [self._tx.put(key, report.dumps()), event_put], key
        )

    def record_progress(self, round_: int, round_revision: int, node: str, step: int) -> bool:
        """A training_progress event: the workers of round `round_` reached `step` (only while it is current)."""
        key, put = self._event(new_event("training_progress", round=round_, node=node, step=step), node)
        return self._commit([self._round_unchanged(round_revision)], [put], key, deadline_s=_STEP_DEADLINE_S)

    def clear_stalled(self, round_: int, round_revision: int, node: str) -> None:
        """Our workers beat again (or exited): the stall is over."""
        stalled = self.keys.report(round_, ReportKind.STALLED, node)
        self._apply([self._round_unchanged(round_revision)], [self._tx.delete(stalled)], deadline_s=_STEP_DEADLINE_S)

    # -- the controller ------------------------------------------------------------------------------------
    def read_events(
        self, after_revision: int = 0, deadline_s: float = _HOUSEKEEPING_DEADLINE_S
    ) -> list[MembershipEvent]:
        """The job's events with an etcd revision above `after_revision`, in log order; malformed ones left out."""
        # events are never modified, so their mod revision is their create revision
        kvs, _ = call_with_retry(
            self.client.read_prefix, self.keys.events, min_mod_revision=after_revision + 1, deadline_s=deadline_s
        )
        return _events_in({kv.key.decode(errors="replace"): Entry(kv.value, kv.mod_revision) for kv in kvs})

    # -- whole job -------------------------------------------------------------------------------------------
    def check_access(self) -> None:
        """Read and write under the job's prefix once, so that an etcd user without the rights fails now, in one
        line, not halfway through a rendezvous. Raises what the client raises."""
        probe = self.keys.new_access_check_key()
        call_with_retry(self.client.get, self.keys.controller, deadline_s=_STEP_DEADLINE_S)
        call_with_retry(self.client.put, probe, "", deadline_s=_STEP_DEADLINE_S)
        call_with_retry(self.client.delete, probe, deadline_s=_STEP_DEADLINE_S)

    def read_status(self) -> JobStatus | None:
        raw, _ = call_with_retry(self.client.get, self.keys.status, deadline_s=_WRITE_DEADLINE_S)
        return JobStatus.loads(raw) if raw is not None else None

    def live_nodes(self) -> int:
        return self._count(self.keys.nodes)

    def key_count(self) -> int:
        return self._count(self.keys.prefix)

    def purge(self) -> int:
        """Delete every key of the job; returns how many there were."""
        count = self.key_count()
        call_with_retry(self.client.delete_prefix, self.keys.prefix, deadline_s=_WRITE_DEADLINE_S)
        return count


def _events_in(entries: dict[str, Entry]) -> list[MembershipEvent]:
    """The events among `entries` (their keys and values), in log order: by revision, then key (one transaction's
    events share a revision). A value that is no event is named in a warning once and left out."""
    found = []
    for key, entry in sorted(entries.items(), key=lambda item: (item[1].mod_revision, item[0])):
        try:
            event = MembershipEvent.model_validate_json(entry.value)
        except ValidationError as exc:
            if (key, entry.mod_revision) not in _warned_events:  # a foreign or damaged value: never fatal
                _warned_events.add((key, entry.mod_revision))
                logger.warning("ignoring malformed membership event at %s (%s)", key, str(exc).splitlines()[0])
            continue
        event.revision = entry.mod_revision
        found.append(event)
    return found


def _prefix_end(prefix: str) -> str:
    return prefix[:-1] + chr(ord(prefix[-1]) + 1)


class ControllerStore(JobStore):
    """The writes only the controller makes: each is guarded by holding the controller key (the table above)."""

    def form_round(
        self,
        holder: Holder,
        round_revision: int,
        record: RoundRecord,
        events: list[MembershipEvent],
        handled_left: list[str],
        buckets: int,
    ) -> bool:
        """Write round `record.round` in `buckets` member buckets, and its events; drop earlier rounds' reports,
        the leaves it handled, and the buckets no reader needs any more."""
        number = record.round
        header, parts = record.split(buckets)
        bucket_writes = [
            [
                self._tx.put(self.keys.member_bucket(number, i), part.dumps()),
                # the previous round's bucket stays until the next one: an agent may still be reading it
                *(
                    [self._tx.delete(self.keys.bucket_prefix(i), range_end=self.keys.member_bucket(number - 1, i))]
                    if number >= 2
                    else []
                ),
            ]
            for i, part in enumerate(parts)
        ]
        compare = [
            self._holds_controller(holder),
            self._round_unchanged(round_revision),
            self._tx.version(self.keys.status) == 0,
        ]
        puts = [self._event(e, holder.node) for e in events]
        ops = [
            self._tx.put(self.keys.round, header.dumps()),
            # what belonged to earlier rounds goes with them: nothing stale reaches a new round
            self._tx.delete(self.keys.bucket_prefix(buckets), range_end=_prefix_end(self.keys.members)),
            self._tx.delete(self.keys.rounds, range_end=self.keys.round_prefix(number)),
            self._tx.delete(self.keys.masters, range_end=self.keys.master(number)),
            self._tx.delete(self.keys.rollcalls, range_end=self.keys.rollcall(number)),
            self._tx.delete(self.keys.drains, range_end=self.keys.drain(number)),
            *(self._tx.delete(self.keys.left(node)) for node in handled_left),
            *(put for _, put in puts),
        ]
        # the buckets the header's transaction has no room for go first, under its guard: an agent takes a bucket
        # only once the header announced its round. One that a lost race leaves behind is never taken (its index
        # is past the header's count, or the winner wrote it again) and goes with a later round's clean-up.
        with_header = max(0, (_MAX_TRANSACTION_OPS - len(ops)) // 2)
        first_with_header = max(0, len(bucket_writes) - with_header)
        per_transaction = _MAX_TRANSACTION_OPS // 2
        for start in range(0, first_with_header, per_transaction):
            batch = bucket_writes[start : min(start + per_transaction, first_with_header)]
            if not self._apply(compare, [op for write in batch for op in write]):
                return False
        ops += [op for write in bucket_writes[first_with_header:] for op in write]
        return self._commit(compare, ops, marker=puts[-1][0])

    def call_rollcall(self, holder: Holder, round_: int, round_revision: int) -> bool:
        key = self.keys.rollcall(round_)
        call = RollCall(round=round_, nonce=uuid.uuid4().hex[:12])
        compare = [self._holds_controller(holder), self._round_unchanged(round_revision)]
        return self._commit(compare, [self._tx.put(key, call.dumps())], key)

    def request_drain(self, holder: Holder, round_revision: int, request: DrainRequest) -> bool:
        """Ask the round's workers to checkpoint and wait (a drain_requested event with it)."""
        key = self.keys.drain(request.round)
        _, event_put = self._event(
            new_event("drain_requested", round=request.round, reason=request.reason, in_memory=request.in_memory),
            holder.node,
        )
        compare = [self._holds_controller(holder), self._round_unchanged(round_revision)]
        return self._commit(compare, [self._tx.put(key, request.dumps()), event_put], key)

    def withdraw_drain(self, holder: Holder, round_: int) -> None:
        self._apply([self._holds_controller(holder)], [self._tx.delete(self.keys.drain(round_))])

    def mark_lost(self, holder: Holder, round_: int, node: str, reason: str) -> bool:
        """Record `node` as lost in `round_`, once: its marker and its node_lost event in one transaction."""
        key = self.keys.report(round_, ReportKind.LOST, node)
        _, event_put = self._event(new_event("node_lost", round=round_, node=node, reason=reason), holder.node)
        compare = [self._holds_controller(holder), self._tx.version(key) == 0]
        return self._commit(compare, [self._tx.put(key, reason), event_put], key)

    def forget_left(self, holder: Holder, nodes: list[str]) -> None:
        """Drop leave notices of nodes that are gone and belong to no round."""
        self._apply([self._holds_controller(holder)], [self._tx.delete(self.keys.left(node)) for node in nodes])

    def end_job(self, holder: Holder, round_revision: int, status: JobStatus, event: MembershipEvent) -> bool:
        compare = [
            self._holds_controller(holder),
            self._round_unchanged(round_revision),
            self._tx.version(self.keys.status) == 0,
        ]
        event_key, event_put = self._event(event, holder.node)
        ops = [
            self._tx.put(self.keys.status, status.dumps()),
            event_put,
            self._tx.delete(self.keys.left_prefix, range_end=_prefix_end(self.keys.left_prefix)),
        ]
        return self._commit(compare, ops, marker=event_key)

    def trim_events(self, keep: int) -> int:
        """Delete all but the newest `keep` events in etcd; returns how many went."""
        excess = self._count(self.keys.events, deadline_s=_HOUSEKEEPING_DEADLINE_S) - keep
        if excess <= 0:
            return 0
        oldest = call_with_retry(
            self.client.get_prefix_response,
            self.keys.events,
            keys_only=True,
            limit=excess,
            sort_order="ascend",
            sort_target="key",
            deadline_s=_HOUSEKEEPING_DEADLINE_S,
        )
        last = oldest.kvs[-1].key.decode()
        self._apply([], [self._tx.delete(self.keys.events, range_end=last + "\0")], _HOUSEKEEPING_DEADLINE_S)
        return excess

    # -- the membership log ------------------------------------------------------------------------------------
