"""The records a job keeps in etcd, as validated models, and the keys they live under."""

from __future__ import annotations

import time
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field

KEY_ROOT = "/elastic"


class Record(BaseModel):
    model_config = ConfigDict(extra="ignore")

    def dumps(self) -> str:
        return self.model_dump_json(exclude_none=True)

    @classmethod
    def loads(cls, raw: bytes | str):
        return cls.model_validate_json(raw)


class NodeRecord(Record):
    """An agent's registration, held under its lease: it disappears when the agent is lost."""

    node: str
    addr: str
    nproc: int
    joined_at: float = Field(default_factory=time.time)
    pid: int


class Member(Record):
    node: str
    group_rank: int
    nproc: int
    first_rank: int
    addr: str

    @property
    def last_rank(self) -> int:
        return self.first_rank + self.nproc - 1


class RoundRecord(Record):
    """A membership round: who trains, with which ranks. Written once, in one transaction, by the controller."""

    round: int
    members: list[Member]
    restart_count: int = 0
    reason: str
    formed_at: float = Field(default_factory=time.time)

    @property
    def world_size(self) -> int:
        return sum(m.nproc for m in self.members)

    def member(self, node: str) -> Member | None:
        return next((m for m in self.members if m.node == node), None)

    def member_summary(self) -> list[dict]:
        return [
            {"node": m.node, "group_rank": m.group_rank, "first_rank": m.first_rank, "last_rank": m.last_rank}
            for m in self.members
        ]


class MasterRecord(Record):
    """Where a round's rank 0 serves its store: a fresh port every round, so no round reads another's keys."""

    addr: str
    port: int


class WorkerFailure(Record):
    node: str
    round: int
    local_rank: int
    rank: int
    exit_code: int
    time: float
    message: str = ""
    traceback: str = ""


class NodeFailure(Record):
    """What one agent saw fail in a round: every failed local worker, earliest first."""

    node: str
    round: int
    failures: list[WorkerFailure]


class JobStatus(Record):
    state: Literal["finished", "failed"]
    time: float = Field(default_factory=time.time)
    summary: str = ""


class JobKeys:
    """Every key of one job, under /elastic/<rdzv-id>/, so two jobs on one etcd never see each other.

    Live state sits below `state/`, so one range read gives a whole snapshot; the membership log sits
    below `events/`; what belongs to one round sits below `state/rounds/<round>/` and is deleted with it.
    """

    def __init__(self, rdzv_id: str) -> None:
        self.prefix = f"{KEY_ROOT}/{rdzv_id}/"
        self.state = self.prefix + "state/"
        self.events = self.prefix + "events/"
        self.nodes = self.state + "nodes/"
        self.controller = self.state + "controller"
        self.round = self.state + "round"
        self.status = self.state + "status"
        self.left = self.state + "left/"
        self.rounds = self.state + "rounds/"

    def node(self, node: str) -> str:
        return self.nodes + node

    def round_prefix(self, round_: int) -> str:
        return f"{self.rounds}{round_:010d}/"

    def master(self, round_: int) -> str:
        return self.round_prefix(round_) + "master"

    def failed(self, round_: int, node: str) -> str:
        return self.round_prefix(round_) + "failed/" + node

    def done(self, round_: int, node: str) -> str:
        return self.round_prefix(round_) + "done/" + node

    def ack(self, round_: int, node: str) -> str:
        return self.round_prefix(round_) + "ack/" + node

    def lost(self, round_: int, node: str) -> str:
        return self.round_prefix(round_) + "lost/" + node
