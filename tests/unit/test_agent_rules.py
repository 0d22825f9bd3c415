"""launcher.node.rules: what an agent does next, as tables without etcd, processes or sleeping."""

from __future__ import annotations

import signal

import pytest

from launcher.node import rules
from launcher.node.rules import (
    Acknowledge,
    AnswerRollCall,
    CheckController,
    EndWithJob,
    EnterRound,
    Fence,
    FollowDrain,
    FollowStall,
    GiveUp,
    LeaseFacts,
    Leave,
    Phase,
    PollWorkers,
    RecordProgress,
    RefillWarmPool,
    Rejoin,
    Report,
    RoundFacts,
    RoundRun,
    StartWorkers,
    WorkersSucceeded,
)
from launcher.rendezvous.records import (
    DrainRequest,
    JobStatus,
    MasterRecord,
    Member,
    NodeFailure,
    RollCall,
    RoundHeader,
)

FINISHED = JobStatus(state="finished", summary="done")
HEALTHY = LeaseFacts(silent_for=0.5, ttl=3, lost=False)


def lifecycle(
    signal_: int | None = None,
    lease: LeaseFacts = HEALTHY,
    fence_pending: bool = False,
    workers_running: bool = True,
    status: JobStatus | None = None,
):
    return rules.lifecycle(
        signal=signal_,
        lease=lease,
        join_timeout=60.0,
        fence_pending=fence_pending,
        workers_running=workers_running,
        status=status,
    )


@pytest.mark.parametrize(
    "case, kwargs, expected",
    [
        ("healthy, training", {}, None),
        ("a signal comes first, even cut off", {"signal_": signal.SIGTERM, "lease": LeaseFacts(70, 3, True)}, Leave),
        ("etcd silent past TTL + join_timeout", {"lease": LeaseFacts(63.0, 3, False)}, GiveUp),
        ("just under TTL + join_timeout: fence, not give up", {"lease": LeaseFacts(62.9, 3, False)}, Fence),
        ("the lease is gone", {"lease": LeaseFacts(0.2, 3, True)}, Rejoin),
        ("silent 2.75 s of a 3 s lease with workers", {"lease": LeaseFacts(2.75, 3, False)}, Fence),
        ("silent 2.7 s of a 3 s lease: an etcd election fits", {"lease": LeaseFacts(2.7, 3, False)}, None),
        ("silent 5.75 s of a 6 s lease", {"lease": LeaseFacts(5.75, 6, False)}, Fence),
        ("silent 0.75 s of a 1 s lease (a quarter of it)", {"lease": LeaseFacts(0.75, 1, False)}, Fence),
        ("silent 0.7 s of a 1 s lease", {"lease": LeaseFacts(0.7, 1, False)}, None),
        ("silent, but no workers to fence", {"lease": LeaseFacts(2.5, 3, False), "workers_running": False}, None),
        ("a fence still pending, etcd back", {"fence_pending": True, "workers_running": False}, Fence),
        ("the job finished", {"status": FINISHED}, EndWithJob),
        ("a fence comes before the job's end", {"lease": LeaseFacts(2.8, 3, False), "status": FINISHED}, Fence),
    ],
)
def test_lifecycle(case, kwargs, expected):
    action = lifecycle(**kwargs)
    assert (type(action) if action is not None else None) is expected, case


HEADER = RoundHeader(round=3, size=2, world_size=2, reason="initial", buckets=1, formed_at=0.0)
MEMBER0 = Member(node="a", incarnation=1, group_rank=0, nproc=1, first_rank=0, addr="10.0.0.1")
MEMBER1 = Member(node="b", incarnation=2, group_rank=1, nproc=1, first_rank=1, addr="10.0.0.2")
MASTER = MasterRecord(addr="10.0.0.1", port=29500)
FAILURE = NodeFailure(node="b", round=3, failures=[])
ROLLCALL = RollCall(round=3, nonce="n1")
NEWER = RoundHeader(round=4, size=1, world_size=1, reason="node_lost", buckets=1, formed_at=0.0)


def run(phase: Phase, member: Member | None = MEMBER1, **fields) -> RoundRun:
    return RoundRun(header=HEADER, revision=7, member=member, phase=phase, **fields)


def facts(**fields) -> RoundFacts:
    return RoundFacts(header=HEADER, header_revision=7, **fields)


def actions(
    facts_: RoundFacts,
    run_: RoundRun | None,
    now: float = 0.0,
    started: bool = False,
    hang: bool = False,
    latest_step: int | None = None,
    stalled: bool = False,
):
    """Every action of one step, in order, as the agent takes them when applying changes nothing; entering a round
    changes everything, so the step's table ends there."""
    done: set[type] = set()
    taken = []
    while (
        action := rules.next_action(
            facts_,
            run_,
            now=now,
            workers_started=started,
            reporting_hang=hang,
            done=frozenset(done),
            latest_step=latest_step,
            stalled=stalled,
        )
    ) is not None:
        done.add(type(action))
        taken.append(action)
        if isinstance(action, EnterRound):
            break
    return taken


@pytest.mark.parametrize(
    "case, facts_, run_, kwargs, expected",
    [
        ("no round yet", RoundFacts(header=None, header_revision=0), None, {}, []),
        ("a first round", facts(), None, {}, [EnterRound(header=HEADER, revision=7)]),
        (
            "a newer round",
            RoundFacts(header=NEWER, header_revision=9),
            run(Phase.RUNNING),
            {"started": True},
            [EnterRound(header=NEWER, revision=9)],
        ),
        ("a spare waits", facts(), run(Phase.SPARE, member=None), {}, []),
        ("rank 1 waits for the master", facts(), run(Phase.STARTING), {}, [FollowDrain(None), FollowStall()]),
        (
            "rank 0 publishes the master",
            facts(),
            run(Phase.STARTING, member=MEMBER0),
            {},
            [StartWorkers(master=None), FollowDrain(None), FollowStall()],
        ),
        (
            "the master is known",
            facts(masters={3: MASTER}),
            run(Phase.STARTING),
            {},
            [StartWorkers(master=MASTER), FollowDrain(None), FollowStall()],
        ),
        (
            "running, not yet acknowledged",
            facts(),
            run(Phase.RUNNING),
            {"started": True},
            [PollWorkers(), Acknowledge(), FollowDrain(None), FollowStall()],
        ),
        (
            "time to refill the warm pool",
            facts(),
            run(Phase.RUNNING, acknowledged=True, refill_warm_at=5.0),
            {"started": True, "now": 5.0},
            [PollWorkers(), RefillWarmPool(), FollowDrain(None), FollowStall()],
        ),
        (
            "not yet time to refill",
            facts(),
            run(Phase.RUNNING, acknowledged=True, refill_warm_at=5.0),
            {"started": True, "now": 4.9},
            [PollWorkers(), FollowDrain(None), FollowStall()],
        ),
        (
            "succeeded: report it",
            facts(),
            run(Phase.FINISHED, acknowledged=True, outcome=WorkersSucceeded()),
            {},
            [Report(WorkersSucceeded()), FollowDrain(None), FollowStall()],
        ),
        (
            "failed: report it and check the controller",
            facts(controller="a#1"),
            run(Phase.FINISHED, acknowledged=True, outcome=FAILURE),
            {},
            [Report(FAILURE), CheckController(holder="a#1"), FollowDrain(None), FollowStall()],
        ),
        (
            "failed, reported, controller checked",
            facts(controller="a#1"),
            run(Phase.FINISHED, acknowledged=True, outcome=FAILURE, reported=True, controller_checked=True),
            {},
            [FollowDrain(None), FollowStall()],
        ),
        (
            "a drain for our round",
            facts(drains={3: DrainRequest(round=3, number=2, reason="node_left")}),
            run(Phase.RUNNING, acknowledged=True),
            {"started": True},
            [PollWorkers(), FollowDrain(DrainRequest(round=3, number=2, reason="node_left")), FollowStall()],
        ),
        (
            "a roll call",
            facts(rollcalls={3: ROLLCALL}),
            run(Phase.RUNNING, acknowledged=True),
            {"started": True},
            [PollWorkers(), FollowDrain(None), FollowStall(), AnswerRollCall(nonce="n1")],
        ),
        (
            "a roll call while our watchdog reports a hang: its report comes first",
            facts(rollcalls={3: ROLLCALL}),
            run(Phase.RUNNING, acknowledged=True),
            {"started": True, "hang": True},
            [PollWorkers(), FollowDrain(None), FollowStall()],
        ),
        (
            "a roll call already answered",
            facts(rollcalls={3: ROLLCALL}),
            run(Phase.RUNNING, acknowledged=True, answered_rollcall="n1"),
            {"started": True},
            [PollWorkers(), FollowDrain(None), FollowStall()],
        ),
        (
            "a spare answers no roll call and follows no drain",
            facts(
                rollcalls={3: ROLLCALL},
                drains={3: DrainRequest(round=3, number=1, reason="node_left")},
            ),
            run(Phase.SPARE, member=None),
            {},
            [],
        ),
    ],
)
def test_one_step_of_a_round(case, facts_, run_, kwargs, expected):
    assert actions(facts_, run_, **kwargs) == expected, case


def test_entering_a_round_comes_first_and_once():
    step = actions(facts(), run(Phase.RUNNING, acknowledged=True), started=True)
    assert EnterRound not in {type(a) for a in step}
    newer = RoundFacts(header=NEWER, header_revision=11)
    assert (
        rules.next_action(
            newer, run(Phase.RUNNING), now=0.0, workers_started=True, reporting_hang=False, done=frozenset({EnterRound})
        )
        == PollWorkers()
    )


@pytest.mark.parametrize("members, spread", [(1, 0.001), (500, 0.5), (1000, 1.0), (8192, 1.0)])
def test_standby_controllers_spread_their_claims_by_the_size_of_the_round(members, spread):
    assert rules.claim_spread(members) == pytest.approx(spread)


@pytest.mark.parametrize(
    "max_nodes, interval, quick_losses, spread",
    [
        (3, 1.0, 0, 0.003),  # a small job's node rejoins at once
        (3, 1.0, 4, 0.048),
        (500, 1.0, 0, 0.5),
        (2048, 1.0, 0, 1.0),  # a whole job's herd, after one etcd stall, over up to one interval
        (2048, 1.0, 2, 4.0),  # registrations that outlived their leases: doubled for each one in a row
        (2048, 1.0, 10, 8.0),  # never more than 8 intervals
        (8192, 5.0, 0, 5.0),
        (8192, 5.0, 3, 40.0),
    ],
)
def test_a_node_that_lost_its_lease_spreads_its_registration_by_the_job_and_its_losses(
    max_nodes, interval, quick_losses, spread
):
    assert rules.rejoin_spread(max_nodes, interval, quick_losses) == pytest.approx(spread)


@pytest.mark.parametrize("lived, ttl, soon", [(0.5, 3, True), (8.9, 3, True), (9.0, 3, False), (600, 15, False)])
def test_an_incarnation_lost_within_three_ttls_of_registering_was_lost_soon(lived, ttl, soon):
    assert rules.lost_soon(lived, ttl) is soon


@pytest.mark.parametrize("filled, expected", [(None, 100.2), (False, 100.5)])
def test_the_warm_pool_refills_right_after_a_launch_and_retries_while_the_zygote_imports(filled, expected):
    assert rules.refill_warm_at(100.0, filled) == pytest.approx(expected)


@pytest.mark.parametrize(
    "case, run_, latest_step, now, expected",
    [
        ("group rank 0, the round's first step: at once", run(Phase.RUNNING, MEMBER0), 41, 0.0, 41),
        ("no step reported yet", run(Phase.RUNNING, MEMBER0), None, 0.0, None),
        ("another node's agent never records", run(Phase.RUNNING, MEMBER1), 41, 0.0, None),
        ("a spare has no steps", run(Phase.SPARE, None), 41, 0.0, None),
        ("workers still starting", run(Phase.STARTING, MEMBER0), 41, 0.0, None),
        ("workers exited", run(Phase.FINISHED, MEMBER0), 41, 0.0, None),
        (
            "a newer step 9.9 s later: not yet",
            run(Phase.RUNNING, MEMBER0, progress_step=41, progress_at=1.0),
            90,
            10.9,
            None,
        ),
        ("a newer step 10 s later", run(Phase.RUNNING, MEMBER0, progress_step=41, progress_at=1.0), 90, 11.0, 90),
        ("no newer step, however long", run(Phase.RUNNING, MEMBER0, progress_step=41, progress_at=1.0), 41, 99.0, None),
    ],
)
def test_progress_is_recorded_by_group_rank_0_at_a_bounded_rate(case, run_, latest_step, now, expected):
    action = rules.progress_to_record(run_, latest_step, now)
    assert (action.step if action is not None else None) == expected, case


def test_progress_is_the_last_action_of_a_step():
    taken = actions(facts(masters={3: MASTER}), run(Phase.RUNNING, MEMBER0, acknowledged=True), latest_step=5)
    assert taken == [PollWorkers(), FollowDrain(request=None), FollowStall(), RecordProgress(step=5)]


MEMBER3 = Member(node="d", incarnation=4, group_rank=3, nproc=1, first_rank=3, addr="10.0.0.4")
STALL_CHECK = CheckController(holder="a#1", stalled=True)


@pytest.mark.parametrize(
    "case, run_, stalled, controller, now, checks",
    [
        (
            "stalled, group rank 1, the controller on node a",
            run(Phase.RUNNING, acknowledged=True),
            True,
            "a#1",
            0.0,
            True,
        ),
        ("not stalled: nothing to ask", run(Phase.RUNNING, acknowledged=True), False, "a#1", 0.0, False),
        ("no controller: a standby claims the key", run(Phase.RUNNING, acknowledged=True), True, None, 0.0, False),
        (
            "our own node holds the controller key",
            run(Phase.RUNNING, acknowledged=True),
            True,
            "b#2",
            0.0,
            False,
        ),
        (
            "group rank 3 does not watch: a stall of thousands of nodes costs a few probes",
            run(Phase.RUNNING, MEMBER3, acknowledged=True),
            True,
            "a#1",
            0.0,
            False,
        ),
        (
            "probed 0.9 s ago in this stall: not yet again",
            run(Phase.RUNNING, acknowledged=True, controller_checked_in_stall_at=10.0),
            True,
            "a#1",
            10.9,
            False,
        ),
        (
            "probed 1 s ago and still stalled: again, as the controller probes a stall's suspects",
            run(Phase.RUNNING, acknowledged=True, controller_checked_in_stall_at=10.0),
            True,
            "a#1",
            11.0,
            True,
        ),
        ("workers still starting", run(Phase.STARTING), True, "a#1", 0.0, False),
        ("a spare trains nothing", run(Phase.SPARE, member=None), True, "a#1", 0.0, False),
    ],
)
def test_watchers_probe_the_controller_while_their_workers_stall(case, run_, stalled, controller, now, checks):
    """A stopped controller fails nobody's workers and probes no suspect, itself least of all: the members of
    the lowest group ranks probe it while their workers stall, since nobody else would until its lease ends."""
    taken = actions(facts(controller=controller), run_, now=now, started=True, stalled=stalled)
    assert (STALL_CHECK in taken) is checks, (case, taken)


@pytest.mark.parametrize(
    "member, controller_node, watches",
    [
        (MEMBER0, "z", True),
        (MEMBER1, "z", True),
        (Member(node="c", incarnation=3, group_rank=2, nproc=1, first_rank=2, addr="10.0.0.3"), "z", True),
        (MEMBER3, "z", False),
        (MEMBER0, "a", False),
    ],
)
def test_the_lowest_group_ranks_watch_the_controller_but_its_own_node(member, controller_node, watches):
    assert rules.watches_controller(member, controller_node) is watches


def test_a_failure_checks_the_controller_once_and_not_again_for_the_stall():
    """After our failure the check asks for certainty (every failed member probes at once); in the same step a
    stall adds no second probe."""
    taken = actions(
        facts(controller="a#1"), run(Phase.FINISHED, acknowledged=True, outcome=FAILURE), started=True, stalled=True
    )
    assert [a for a in taken if isinstance(a, CheckController)] == [CheckController(holder="a#1")]
