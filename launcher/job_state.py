"""One consistent snapshot of a job's live state in etcd, read with a single range request."""

from __future__ import annotations

from dataclasses import dataclass, field

from launcher.records import JobKeys, JobStatus, MasterRecord, NodeFailure, NodeRecord, RoundRecord


@dataclass
class RoundState:
    """What members reported about one round."""

    master: MasterRecord | None = None
    failed: dict[str, NodeFailure] = field(default_factory=dict)
    done: set[str] = field(default_factory=set)
    acked: set[str] = field(default_factory=set)
    lost: set[str] = field(default_factory=set)


@dataclass
class JobSnapshot:
    revision: int = 0
    nodes: dict[str, NodeRecord] = field(default_factory=dict)
    controller: str | None = None
    round: RoundRecord | None = None
    round_mod_revision: int = 0
    status: JobStatus | None = None
    left: set[str] = field(default_factory=set)
    rounds: dict[int, RoundState] = field(default_factory=dict)

    def current(self) -> RoundState:
        """Reports for the current round (empty before the first round)."""
        return self.rounds.get(self.round.round, RoundState()) if self.round else RoundState()


def read_snapshot(client, keys: JobKeys) -> JobSnapshot:
    snapshot = JobSnapshot()
    for raw, meta in client.get_prefix(keys.state):
        snapshot.revision = max(snapshot.revision, meta.response_header.revision)
        key = meta.key.decode()[len(keys.state) :]
        if key.startswith("nodes/"):
            record = NodeRecord.loads(raw)
            snapshot.nodes[record.node] = record
        elif key == "controller":
            snapshot.controller = raw.decode()
        elif key == "round":
            snapshot.round = RoundRecord.loads(raw)
            snapshot.round_mod_revision = meta.mod_revision
        elif key == "status":
            snapshot.status = JobStatus.loads(raw)
        elif key.startswith("left/"):
            snapshot.left.add(key.removeprefix("left/"))
        elif key.startswith("rounds/"):
            _, number, kind, *rest = key.split("/")
            state = snapshot.rounds.setdefault(int(number), RoundState())
            node = "/".join(rest)
            if kind == "master":
                state.master = MasterRecord.loads(raw)
            elif kind == "failed":
                state.failed[node] = NodeFailure.loads(raw)
            elif kind == "done":
                state.done.add(node)
            elif kind == "ack":
                state.acked.add(node)
            elif kind == "lost":
                state.lost.add(node)
    return snapshot
