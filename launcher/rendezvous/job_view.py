"""A job's state as plain data, parsed from the raw keys of a `RangeMirror`; malformed keys are named once and
ignored."""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from typing import assert_never

from pydantic import ValidationError

from launcher.etcd.entry import Entry
from launcher.rendezvous.protocol import (
    ControllerKey,
    DrainKey,
    JobKey,
    JobKeys,
    LeftKey,
    MasterKey,
    MemberBucketKey,
    NodeKey,
    ReportKey,
    ReportKind,
    RollCallKey,
    RoundHeaderKey,
    StatusKey,
)
from launcher.rendezvous.records import (
    DrainReport,
    DrainRequest,
    JobStatus,
    LeaveRecord,
    MasterRecord,
    MemberBucket,
    NodeFailure,
    NodeRecord,
    RollCall,
    RoundHeader,
    RoundRecord,
    StallReport,
)

logger = logging.getLogger(__name__)


@dataclass
class RoundReports:
    """What members reported about one round, and what the controller recorded about it."""

    acked: set[str] = field(default_factory=set)
    done: set[str] = field(default_factory=set)
    failed: dict[str, NodeFailure] = field(default_factory=dict)
    alive: dict[str, str] = field(default_factory=dict)  # node -> the roll-call nonce it answered
    lost: dict[str, str] = field(default_factory=dict)  # node -> why
    drained: dict[str, DrainReport] = field(default_factory=dict)
    stalled: dict[str, StallReport] = field(default_factory=dict)


@dataclass
class JobView:
    """Everything the agent or the controller knows of the job at one etcd revision."""

    revision: int = 0
    nodes: dict[str, NodeRecord] = field(default_factory=dict)
    controller: str | None = None
    round_header: RoundHeader | None = None
    # the whole round, header and member buckets: only where they are watched (the controller's view)
    round: RoundRecord | None = None
    round_revision: int = 0  # mod revision of the round header: the guard of every write about that round
    status: JobStatus | None = None
    masters: dict[int, MasterRecord] = field(default_factory=dict)
    rollcalls: dict[int, RollCall] = field(default_factory=dict)
    drains: dict[int, DrainRequest] = field(default_factory=dict)
    left: dict[str, LeaveRecord] = field(default_factory=dict)
    reports: dict[int, RoundReports] = field(default_factory=dict)

    def current(self) -> RoundReports:
        """Reports about the current round (empty before the first round)."""
        return self.reports.get(self.round.round, RoundReports()) if self.round else RoundReports()


# (full key, mod revision) of every malformed value warned about: once per process, however many parsers see it
_warned: set[tuple[str, int]] = set()


class ViewParser:
    """Turns the raw entries of a mirror of `mirror_prefix` (the job's `state/` or a range below it) into a JobView.

    A value that does not parse (a foreign tool wrote under our prefix, a half-upgraded agent) is reported
    once per key and revision as a warning naming the key, and left out: it never stops the job.
    """

    def __init__(self, state_prefix: str, mirror_prefix: str) -> None:
        if not mirror_prefix.startswith(state_prefix):
            raise ValueError(f"{mirror_prefix} is not below {state_prefix}")
        self.mirror_prefix = mirror_prefix  # what turns a mirror's key into the full key
        # full key -> (mod revision, parsed record): a controller of thousands of nodes re-parses only what changed
        self._parsed: dict[str, tuple[int, object]] = {}
        self._next_parsed: dict[str, tuple[int, object]] = {}
        self._assembled: tuple[int, RoundRecord] | None = None  # (header revision, the round it assembled)

    def parse(self, entries: dict[str, Entry], revision: int) -> JobView:
        view = JobView(revision=revision)
        self._next_parsed = {}
        buckets: dict[int, dict[int, MemberBucket]] = {}  # round -> index -> bucket
        for below, entry in entries.items():
            key = self.mirror_prefix + below
            try:
                parsed = JobKeys.parse(key)
                if isinstance(parsed, MemberBucketKey):
                    buckets.setdefault(parsed.round, {})[parsed.bucket] = self._load(key, entry, MemberBucket)
                else:
                    self._place(view, parsed, key, entry)
            except (ValidationError, ValueError, UnicodeDecodeError) as exc:
                self._warn(key, entry, f"{type(exc).__name__}: {str(exc).splitlines()[0]}")
        self._parsed = self._next_parsed
        header = view.round_header
        if header is not None:
            # a round written in several transactions may leave buckets past the header's count (a lost race)
            found = buckets.get(header.round, {})
            parts = [found[i] for i in range(header.buckets) if i in found]
            if len(parts) == header.buckets:
                if self._assembled is None or self._assembled[0] != view.round_revision:
                    self._assembled = (view.round_revision, RoundRecord.assemble(header, parts))
                view.round = self._assembled[1]
        return view

    def _load(self, key: str, entry: Entry, model):
        cached = self._parsed.get(key)
        record = cached[1] if cached is not None and cached[0] == entry.mod_revision else model.loads(entry.value)
        self._next_parsed[key] = (entry.mod_revision, record)
        return record

    def _warn(self, key: str, entry: Entry, why: str) -> None:
        if (key, entry.mod_revision) in _warned:
            return
        _warned.add((key, entry.mod_revision))
        logger.warning("ignoring malformed value under the job's prefix at %s (%s)", key, why)

    def _place(self, view: JobView, parsed: JobKey, key: str, entry: Entry) -> None:
        raw = entry.value
        match parsed:
            case ControllerKey():
                view.controller = raw.decode()
            case RoundHeaderKey():
                view.round_header, view.round_revision = self._load(key, entry, RoundHeader), entry.mod_revision
            case StatusKey():
                view.status = JobStatus.loads(raw)
            case MasterKey(round=number):
                view.masters[number] = MasterRecord.loads(raw)
            case RollCallKey(round=number):
                view.rollcalls[number] = RollCall.loads(raw)
            case DrainKey(round=number):
                view.drains[number] = DrainRequest.loads(raw)
            case NodeKey(node=node):
                record = self._load(key, entry, NodeRecord)
                if record.node != node:
                    raise ValueError(f"record names node {record.node!r}")
                view.nodes[node] = record
            case LeftKey(node=node):
                view.left[node] = self._load(key, entry, LeaveRecord)
            case ReportKey():
                self._place_report(view.reports.setdefault(parsed.round, RoundReports()), parsed, key, entry)
            case _:
                raise ValueError("not a key of a job's state")

    def _place_report(self, reports: RoundReports, parsed: ReportKey, key: str, entry: Entry) -> None:
        node, raw = parsed.node, entry.value
        match parsed.kind:
            case ReportKind.ACK:
                reports.acked.add(node)
            case ReportKind.DONE:
                reports.done.add(node)
            case ReportKind.FAILED:
                reports.failed[node] = self._load(key, entry, NodeFailure)
            case ReportKind.ALIVE:
                reports.alive[node] = raw.decode()
            case ReportKind.DRAINED:
                reports.drained[node] = DrainReport.loads(raw)
            case ReportKind.STALLED:
                reports.stalled[node] = self._load(key, entry, StallReport)
            case ReportKind.LOST:
                reports.lost[node] = raw.decode()
            case _:
                assert_never(parsed.kind)
