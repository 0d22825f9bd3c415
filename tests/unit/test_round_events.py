"""The events written with a new round, as a table: hand-built decisions, no etcd."""

from __future__ import annotations

import pytest

from launcher.rendezvous.decisions import DrainOutcome, FormRound, RoundReason, Settings, assign_ranks
from launcher.rendezvous.records import NodeRecord, RoundRecord
from launcher.rendezvous.round_events import MAX_LOGGED_MEMBERS, round_events

SETTINGS = Settings(
    rdzv_id="job",
    min_nodes=2,
    max_nodes=3,
    max_restarts=3,
    join_timeout=60,
    last_call_timeout=5,
    close_timeout=30,
    quarantine_after=3,
    quarantine_cooldown=300,
    drain_timeout=60,
)
AT = 1_700_000_000.0
MEMBERS = assign_ranks(
    None, {n: NodeRecord(node=n, addr="10.0.0.1", nproc=2, lease=1, pid=1, joined_at=i) for i, n in enumerate("ab")}, 9
)
SUMMARY = [
    {"node": "a", "group_rank": 0, "first_rank": 0, "last_rank": 1},
    {"node": "b", "group_rank": 1, "first_rank": 2, "last_rank": 3},
]


def formed(reason: RoundReason, restart_count: int = 0, **fields) -> FormRound:
    """Round 5 of a and b (two workers each), formed for `reason`."""
    return FormRound(number=5, members=MEMBERS, reason=reason, restart_count=restart_count, **fields)


def started(reason: str, restart_count: int = 0) -> dict:
    return dict(
        event="round_started",
        round=5,
        world_size=4,
        size=2,
        members=SUMMARY,
        reason=reason,
        restart_count=restart_count,
    )


QUARANTINED = dict(
    event="node_quarantined",
    round=5,
    node="c",
    reason="caused the worker failure of 3 consecutive rounds",
    message="kept out of rounds for 300s",
)
RESTART = dict(
    event="restart", round=5, restart_count=2, reason="worker_failed", message="restart 2 of --max-restarts 3"
)
TIMED_OUT = dict(
    event="drain_timed_out",
    round=4,
    step=12,
    message="not every member drained within --drain-timeout 60s; steps since the last checkpoint are redone",
)


@pytest.mark.parametrize(
    "decision, expected",
    [
        (formed(RoundReason.INITIAL), [started("initial")]),
        (formed(RoundReason.NODE_LOST, 1), [started("node_lost", 1)]),  # a loss restarts nothing
        # a spare took the lost node's place: round_started names both
        (
            formed(RoundReason.NODE_LOST, replaced=[("c", "b")]),
            [dict(started("node_lost"), replaced=[{"node": "c", "by": "b"}])],
        ),
        (formed(RoundReason.NODE_LEFT, handled_left=["c"]), [started("node_left")]),  # node_left is the agent's
        (formed(RoundReason.WORKER_FAILED, 2), [RESTART, started("worker_failed", 2)]),
        # quarantines and readmissions come first, in the decision's order
        (
            formed(RoundReason.WORKER_FAILED, 2, newly_quarantined=["c"], readmitted=["d", "e"]),
            [
                QUARANTINED,
                dict(event="node_readmitted", round=5, node="d", reason="quarantine over"),
                dict(event="node_readmitted", round=5, node="e", reason="quarantine over"),
                RESTART,
                started("worker_failed", 2),
            ],
        ),
        # a drain belongs to the round it ended (4), the step its workers checkpointed is named
        (
            formed(RoundReason.SCALE_UP, drain=DrainOutcome(round=4, committed=True, step=41)),
            [dict(event="drain_committed", round=4, step=41), started("scale_up")],
        ),
        # committed without a step: no worker drains, nothing to tell
        (formed(RoundReason.SCALE_UP, drain=DrainOutcome(round=4, committed=True, step=None)), [started("scale_up")]),
        (
            formed(RoundReason.NODE_LEFT, drain=DrainOutcome(round=4, committed=False, step=12)),
            [TIMED_OUT, started("node_left")],
        ),
        (
            formed(RoundReason.SCALE_UP, drain=DrainOutcome(round=4, committed=False, step=None)),
            [{k: v for k, v in TIMED_OUT.items() if k != "step"}, started("scale_up")],
        ),
    ],
)
def test_the_events_of_a_new_round_end_with_round_started(decision, expected):
    record = RoundRecord.of(decision.number, decision.members, decision.restart_count, decision.reason.value)
    events = round_events(decision, record, SETTINGS, AT)
    assert [e.model_dump(exclude_none=True, exclude={"time"}) for e in events] == expected
    assert {e.time for e in events} == {AT}


@pytest.mark.parametrize("size, listed", [(MAX_LOGGED_MEMBERS, True), (MAX_LOGGED_MEMBERS + 1, False)])
def test_round_started_lists_members_while_the_list_fits_in_the_rounds_transaction(size, listed):
    nodes = {f"n{i:05d}": NodeRecord(node=f"n{i:05d}", addr="10.0.0.1", nproc=1, lease=1, pid=1) for i in range(size)}
    decision = FormRound(number=1, members=assign_ranks(None, nodes, size), reason=RoundReason.INITIAL, restart_count=0)
    record = RoundRecord.of(1, decision.members, 0, "initial")
    (event,) = round_events(decision, record, SETTINGS, AT)
    assert event.size == size and event.world_size == size
    assert (event.members is not None) == listed
    assert len(event.dumps()) < 400 * 1024, "with the round's buckets, it must stay well under etcd's 1.5 MiB"
