"""The controller's rules as tables: hand-built job views, a hand-set clock, no etcd and no sleeping."""

from __future__ import annotations

import dataclasses

import pytest

from launcher.rendezvous.decisions import (
    STALL_PROBE_EVERY_S,
    CallRollCall,
    Clock,
    EndJob,
    ForgetLeft,
    FormRound,
    MarkLost,
    ProbeMembers,
    RequestDrain,
    RoundReason,
    Settings,
    Wait,
    WithdrawDrain,
    assign_ranks,
    charged_nodes,
    decide,
    track,
)
from launcher.rendezvous.job_view import JobView, RoundReports
from launcher.rendezvous.records import (
    DrainReport,
    DrainRequest,
    JobStatus,
    LeaveRecord,
    Member,
    NodeFailure,
    NodeRecord,
    RollCall,
    RoundRecord,
    StallReport,
    WorkerFailure,
)

pytestmark = pytest.mark.timeout(30)

SETTINGS = Settings(
    rdzv_id="job",
    min_nodes=2,
    max_nodes=3,
    max_restarts=1,
    join_timeout=60,
    last_call_timeout=5,
    close_timeout=30,
    quarantine_after=3,
    quarantine_cooldown=300,
)
T0 = 1000.0  # the controller started leading at T0
ROLL_CALL_OPEN = Wait(until=T0 + 30, why="roll call: 1 member(s) have not answered")  # called at T0: close_timeout


def node(name: str, lease: int = 1, joined_at: float = 0.0) -> NodeRecord:
    return NodeRecord(node=name, addr="10.0.0.1", nproc=2, lease=lease, pid=1, joined_at=joined_at or ord(name[0]))


def view(
    *names: str, round_of: tuple[str, ...] | None = None, number: int = 0, restarts: int = 0, **reports
) -> JobView:
    """Nodes `names` registered (lease 1); a round `number` of `round_of` (lease 1) with `reports` about it."""
    nodes = {n: node(n) for n in names}
    result = JobView(nodes=nodes)
    if round_of is not None:
        members = assign_ranks(None, {n: node(n) for n in round_of}, 99)
        result.round = RoundRecord.of(number, members, restarts, "initial")
        result.round_revision = 10
        result.reports[number] = RoundReports(**reports)
    return result


def failure(name: str, number: int = 0, at: float = 1.0) -> NodeFailure:
    worker = WorkerFailure(node=name, round=number, local_rank=0, rank=0, exit_code=1, time=at)
    return NodeFailure(node=name, round=number, failures=[worker])


def settle(job: JobView, now: float, clock: Clock | None = None, settings: Settings = SETTINGS):
    """The decision at `now` after the controller watched the job from T0 (its clock stamped at `since`)."""
    clock = track(job, clock or Clock(leading_since=T0), now, settings)
    return decide(job, clock, now, settings), clock


def at(job: JobView, since: float, now: float, settings: Settings = SETTINGS):
    """The decision at `now` when the conditions of `job` have held since `since`."""
    _, clock = settle(job, since, settings=settings)
    return decide(job, track(job, clock, now, settings), now, settings)


# -- the first round -------------------------------------------------------------------------------------------
@pytest.mark.parametrize(
    "names, since, now, expected",
    [
        # fewer than MIN: wait for join_timeout from when the controller started leading
        (("a",), T0, T0 + 1, Wait(until=T0 + 60, why="waiting for nodes: 1 of at least 2")),
        (("a",), T0 + 30, T0 + 31, Wait(until=T0 + 60, why="waiting for nodes: 1 of at least 2")),
        (("a",), T0, T0 + 60, EndJob),  # ... and past it the job fails
        # MIN present: last call, from when they were first present
        (("a", "b"), T0, T0 + 4.9, Wait(until=T0 + 5, why="last call: 2 of up to 3 node(s)")),
        (("a", "b"), T0 + 30, T0 + 31, Wait(until=T0 + 35, why="last call: 2 of up to 3 node(s)")),
        (("a", "b"), T0, T0 + 5, FormRound),  # last call over
        (("a", "b", "c"), T0, T0, FormRound),  # MAX present: at once
    ],
)
def test_first_round_waits_for_quorum_then_last_call(names, since, now, expected):
    decision = at(view(*names), since, now)
    if isinstance(expected, Wait):
        assert decision == expected
        return
    assert type(decision) is expected
    if expected is FormRound:
        assert (decision.number, decision.reason, decision.restart_count) == (0, RoundReason.INITIAL, 0)
        assert [m.node for m in decision.members] == sorted(names)
    if expected is EndJob:
        assert not decision.finished and "rendezvous timed out: 1 of at least 2" in decision.summary


def test_last_call_counts_from_when_min_nodes_were_first_present():
    _, clock = settle(view("a"), T0)
    _, clock = settle(view("a", "b"), T0 + 10, clock)
    assert decide(view("a", "b"), clock, T0 + 14, SETTINGS) == Wait(
        until=T0 + 15, why="last call: 2 of up to 3 node(s)"
    )
    assert isinstance(decide(view("a", "b"), clock, T0 + 15, SETTINGS), FormRound)


def test_nodes_beyond_max_wait_as_spares():
    decision = at(view("a", "b", "c", "d"), T0, T0)
    assert [m.node for m in decision.members] == ["a", "b", "c"]


# -- a running round -------------------------------------------------------------------------------------------
def test_a_running_round_with_every_member_started_waits_for_a_change():
    decision = at(view("a", "b", round_of=("a", "b"), acked={"a", "b"}), T0, T0 + 1000)
    assert decision == Wait(None, "round running")


def test_scale_up_after_last_call_or_at_once_when_max_is_reached():
    running = dict(round_of=("a", "b"), acked={"a", "b"})
    four_node_max = dataclasses.replace(SETTINGS, max_nodes=4)
    assert at(view("a", "b", "c", **running), T0, T0 + 4, four_node_max) == Wait(until=T0 + 5, why="round running")
    grown = at(view("a", "b", "c", **running), T0, T0 + 5, four_node_max)
    assert (type(grown), grown.reason, grown.number) == (FormRound, RoundReason.SCALE_UP, 1)
    assert [m.node for m in grown.members] == ["a", "b", "c"]
    assert type(at(view("a", "b", "c", **running), T0, T0)) is FormRound, "MAX reached: no last call"
    two_node_max = dataclasses.replace(SETTINGS, max_nodes=2)
    assert at(view("a", "b", "c", **running), T0, T0 + 100, two_node_max) == Wait(until=None, why="round running"), (
        "full: c is a spare"
    )


# -- drains before planned changes -------------------------------------------------------------------------------
DRAINING = dataclasses.replace(SETTINGS, drain_timeout=60)


def test_a_scale_up_drains_first_and_forms_once_every_member_answered():
    job = view("a", "b", "c", round_of=("a", "b"), acked={"a", "b"})
    assert at(job, T0, T0, DRAINING) == RequestDrain(0, "scale_up", in_memory=True), "MAX present: drain, then grow"
    job.drains[0] = DrainRequest(round=0, number=7, reason="scale_up")
    job.reports[0].drained = {"a": DrainReport(number=7, step=41)}
    assert at(job, T0, T0 + 59, DRAINING) == Wait(T0 + 60, "round running"), "b still saving"
    job.reports[0].drained["b"] = DrainReport(number=7, step=41)
    grown = at(job, T0, T0 + 1, DRAINING)
    assert (type(grown), grown.reason, grown.drain.committed, grown.drain.step) == (FormRound, "scale_up", True, 41)


def test_a_drain_that_does_not_commit_within_drain_timeout_lets_the_change_go_ahead():
    job = view("a", "b", "c", round_of=("a", "b"), acked={"a", "b"})
    job.drains[0] = DrainRequest(round=0, number=7, reason="scale_up")
    job.reports[0].drained = {"a": DrainReport(number=7, step=12), "b": DrainReport(number=3, step=20)}  # old answer
    grown = at(job, T0, T0 + 60, DRAINING)
    assert (type(grown), grown.drain.committed, grown.drain.step) == (FormRound, False, 12), "b's answer is stale"


def test_a_leaving_member_drains_the_round_and_a_drain_whose_change_is_off_is_withdrawn():
    job = view("a", "b", round_of=("a", "b"), acked={"a", "b"})
    job.left["b"] = LeaveRecord(node="b", incarnation=1, reason="agent received SIGTERM")
    assert at(job, T0, T0, DRAINING) == RequestDrain(0, "node_left", in_memory=False), "a alone: fewer than MIN"
    assert at(job, T0, T0) == Wait(until=T0 + 30, why="b leaving"), "drain_timeout=0: no drain"
    job.left.clear()  # the notice is gone but b still runs: nothing planned any more
    job.drains[0] = DrainRequest(round=0, number=7, reason="node_left")
    assert at(job, T0, T0, DRAINING) == WithdrawDrain(0)


def test_a_leaving_members_drain_is_answered_in_memory_where_those_that_stay_go_on():
    """One member leaving: the others hold every part of the snapshot (each node's next holds a copy of its part),
    in memory, if they are enough to go on. Two leaving: the part of one may leave with the other, and the job
    may end: to disk. A drain asked in memory before the second announced it is withdrawn, then asked to disk."""
    job = view("a", "b", "c", "d", round_of=("a", "b", "c", "d"), acked={"a", "b", "c", "d"})
    job.left["c"] = LeaveRecord(node="c", incarnation=1, reason="agent received SIGTERM")
    assert at(job, T0, T0, DRAINING) == RequestDrain(0, "node_left", in_memory=True)
    job.drains[0] = DrainRequest(round=0, number=7, reason="node_left", in_memory=True)
    job.left["d"] = LeaveRecord(node="d", incarnation=1, reason="agent received SIGTERM")
    withdrawn = at(job, T0, T0, DRAINING)
    assert isinstance(withdrawn, WithdrawDrain) and withdrawn.round == 0
    del job.drains[0]
    assert at(job, T0, T0, DRAINING) == RequestDrain(0, "node_left", in_memory=False), "two leave: to disk"
    job.drains[0] = DrainRequest(round=0, number=8, reason="node_left", in_memory=False)
    assert not isinstance(at(job, T0, T0, DRAINING), (WithdrawDrain, RequestDrain)), "asked to disk: kept"
    two = view("a", "b", round_of=("a", "b"), acked={"a", "b"})
    two.left["b"] = LeaveRecord(node="b", incarnation=1, reason="agent received SIGTERM")
    assert at(two, T0, T0, DRAINING) == RequestDrain(0, "node_left", in_memory=False), "a alone: fewer than MIN"


def test_members_that_never_start_the_round_are_evicted_after_close_timeout():
    job = view("a", "b", round_of=("a", "b"), acked={"a"})
    assert at(job, T0, T0 + 29) == Wait(until=T0 + 30, why="round running")
    decision = at(job, T0, T0 + 30)
    assert decision == MarkLost({"b": "did not start round 0 within close_timeout=30s"}, {"b": 1})


def test_every_member_done_finishes_the_job():
    decision = at(view("a", "b", round_of=("a", "b"), acked={"a", "b"}, done={"a", "b"}), T0, T0)
    assert decision == EndJob(True, "job job finished")


def test_a_finished_job_decides_nothing():
    job = view("a", "b", round_of=("a", "b"))
    job.status = JobStatus(state="finished")
    assert at(job, T0, T0 + 1000) == Wait(None, "the job is over")


# -- lost versus failed ----------------------------------------------------------------------------------------
def test_a_member_whose_lease_ended_is_marked_lost_then_a_round_forms_without_charge():
    job = view("a", "b", round_of=("a", "b", "c"), restarts=1, acked={"a", "b", "c"}, failed={"a": failure("a")})
    assert at(job, T0, T0) == MarkLost({"c": "lease expired"})
    job.reports[0].lost["c"] = "lease expired"
    decision = at(job, T0, T0)
    assert (type(decision), decision.reason, decision.restart_count) == (FormRound, RoundReason.NODE_LOST, 1)
    assert [m.node for m in decision.members] == ["a", "b"]


def test_a_spare_replaces_a_lost_member_in_the_same_round_and_the_round_says_so():
    job = view("a", "b", "c", "d", round_of=("a", "b", "c"), acked={"a", "b", "c"})
    del job.nodes["b"]  # b's lease ended; d waited as a spare (max 3)
    assert at(job, T0, T0) == MarkLost({"b": "lease expired"})
    job.reports[0].lost["b"] = "lease expired"
    decision = at(job, T0, T0)
    assert (type(decision), decision.reason) == (FormRound, RoundReason.NODE_LOST)
    assert [m.node for m in decision.members] == ["a", "c", "d"], "one change, the world size kept"
    assert decision.replaced == [("b", "d")]
    assert at(view("a", "b", "c", round_of=("a", "b"), acked={"a", "b"}), T0, T0 + 100).replaced == [], "a join"


def test_failures_while_a_member_is_silent_call_the_roll_and_wait_without_a_timer_guess():
    job = view("a", "b", round_of=("a", "b"), acked={"a", "b"}, failed={"a": failure("a")})
    assert at(job, T0, T0) == CallRollCall(0)
    job.rollcalls[0] = RollCall(round=0, nonce="n1")
    # b's etcd lease outlives b by far (a slow etcd): however long, the failure is not charged
    assert at(job, T0, T0 + 29) == ROLL_CALL_OPEN
    del job.nodes["b"]  # the lease ended at last
    assert at(job, T0, T0 + 29) == MarkLost({"b": "lease expired"})


def test_a_silent_member_is_probed_once_when_probes_are_on_and_its_agent_has_a_port():
    probing = dataclasses.replace(SETTINGS, probe_timeout=0.5)
    job = view(
        "a", "b", "c", round_of=("a", "b", "c"), acked={"a", "b", "c"}, failed={"a": failure("a")}, alive={"c": "n1"}
    )
    job.rollcalls[0] = RollCall(round=0, nonce="n1")
    assert at(job, T0, T0, probing) == ROLL_CALL_OPEN, "b registered no probe port (an older agent): no probe"
    job.nodes["b"] = job.nodes["b"].model_copy(update={"probe_port": 4100})
    assert at(job, T0, T0) == ROLL_CALL_OPEN, "probes are off"
    decision = at(job, T0, T0, probing)
    assert decision == ProbeMembers({"b": job.nodes["b"]}), "b only: c answered the roll call"
    _, clock = settle(job, T0, settings=probing)
    clock = track(job, clock, T0, probing, applied=decision)  # the controller probed b; it answered
    assert decide(job, clock, T0 + 1, probing) == ROLL_CALL_OPEN, "probed once per round"


PROBING = dataclasses.replace(SETTINGS, probe_timeout=0.5)
STALL = StallReport(seconds_silent=0.6, last_step=41)


def stalled_round(**reports) -> JobView:
    """A round of a, b, c (each with a probe port), all started, with `reports` about it."""
    job = view("a", "b", "c", round_of=("a", "b", "c"), acked={"a", "b", "c"}, **reports)
    for name, record in job.nodes.items():
        job.nodes[name] = record.model_copy(update={"probe_port": 4100})
    return job


@pytest.mark.parametrize(
    "reports, probed",
    [
        ({}, None),  # nobody stalled: nothing to probe
        (dict(stalled={"a": STALL}), {"b", "c"}),  # a's workers wait on someone: every other member is probed
        (dict(stalled={"a": STALL, "c": STALL}), {"b"}),  # stalled members are victims, not suspects
        (dict(stalled={"a": STALL, "b": STALL, "c": STALL}), None),  # everyone waits (a hang): the watchdog's job
        (dict(stalled={"a": STALL}, done={"b"}), {"c"}),  # a member that finished is no suspect
        (dict(stalled={"a": STALL}, done={"a"}), None),  # a stall of workers that finished since is over
    ],
)
def test_a_stall_probes_the_members_that_are_not_stalled(reports, probed):
    decision = at(stalled_round(**reports), T0, T0, PROBING)
    if probed is None:
        assert not isinstance(decision, ProbeMembers)
    else:
        assert isinstance(decision, ProbeMembers) and decision.stall
        assert set(decision.members) == probed
        # the other members are probed beside them, to tell how fast a live agent answers now
        assert set(decision.peers) == {"a", "b", "c"} - probed


def test_a_probe_compares_with_at_most_a_few_live_members_that_have_a_probe_port():
    names = [f"n{i}" for i in range(8)]
    stalled = {name: STALL for name in names[:6]}
    job = view(*names, round_of=tuple(names), acked=set(names), stalled=stalled)
    for name in names:
        if name != "n1":  # an older agent: no probe port
            job.nodes[name] = job.nodes[name].model_copy(update={"probe_port": 4100})
    decision = at(job, T0, T0, PROBING)
    assert isinstance(decision, ProbeMembers)
    assert set(decision.members) == {"n6", "n7"}
    assert list(decision.peers) == ["n0", "n2", "n3", "n4"], "PROBE_PEERS of them, in rank order"


def test_a_stall_is_probed_again_while_it_lasts_and_never_without_probes_or_ports():
    job = stalled_round(stalled={"a": STALL})
    decision, clock = settle(job, T0, settings=PROBING)
    clock = track(job, clock, T0, PROBING, applied=decision)  # the controller probed b and c; both answered
    assert decide(job, clock, T0 + 0.5, PROBING) == Wait(T0 + STALL_PROBE_EVERY_S, "round running")
    assert isinstance(decide(job, clock, T0 + STALL_PROBE_EVERY_S, PROBING), ProbeMembers), "still stalled: again"
    assert at(job, T0, T0) == Wait(until=None, why="round running"), "probes are off"
    job.nodes["b"] = job.nodes["b"].model_copy(update={"probe_port": 0})
    assert set(at(job, T0, T0, PROBING).members) == {"c"}, "b registered no probe port (an older agent)"


def test_a_stall_never_costs_a_restart_and_a_failure_goes_by_the_failure_rules():
    job = stalled_round(stalled={"a": STALL})
    decision, clock = settle(job, T0, settings=PROBING)
    clock = track(job, clock, T0, PROBING, applied=decision)
    for now in (T0 + 0.5, T0 + 600):  # however long it lasts: no round, no eviction, no restart
        assert not isinstance(decide(job, clock, now, PROBING), FormRound | MarkLost | EndJob)
    job.reports[0].failed["a"] = failure("a")
    assert decide(job, clock, T0 + 1, PROBING) == CallRollCall(0)


@pytest.mark.parametrize(
    "number, applied, probed, stall_probed_at",
    [
        (0, None, {"a"}, T0),  # nothing applied: nothing to remember
        (0, CallRollCall(round=0), {"a"}, T0),  # the roll call is in etcd: the view shows it
        (0, ProbeMembers(members={"b": node("b")}), {"a", "b"}, T0),  # b is probed no more this round
        (0, ProbeMembers(members={"b": node("b")}, stall=True), {"a"}, T0 + 1),  # the next stall probe is due later
        (1, None, set(), None),  # a new round: none of its members was probed yet
    ],
)
def test_track_remembers_the_probes_the_controller_makes(number, applied, probed, stall_probed_at):
    """Probes leave nothing in etcd: the clock is what keeps rules 6 and 7 from repeating them."""
    _, clock = settle(stalled_round(), T0, settings=PROBING)
    clock = dataclasses.replace(clock, probed=frozenset({"a"}), stall_probed_at=T0)  # round 0 probed a, and a stall
    job = stalled_round()
    job.round = job.round.model_copy(update={"round": number})
    clock = track(job, clock, T0 + 1, PROBING, applied=applied)
    assert (clock.probed, clock.stall_probed_at) == (probed, stall_probed_at)


def test_a_stall_suspect_that_fails_its_probe_is_lost_and_the_round_forms_without_it():
    job = stalled_round(stalled={"a": STALL, "c": STALL})
    del job.nodes["b"]  # the controller marked b lost and revoked its lease
    job.reports[0].lost["b"] = "no answer to a liveness probe within probe_timeout=0.5s"
    decision = at(job, T0, T0, PROBING)
    assert (type(decision), decision.reason, decision.restart_count) == (FormRound, RoundReason.NODE_LOST, 0)
    assert [m.node for m in decision.members] == ["a", "c"]


def test_a_silent_member_that_answers_the_roll_call_makes_it_a_worker_failure():
    job = view("a", "b", round_of=("a", "b"), acked={"a", "b"}, failed={"a": failure("a")}, alive={"b": "n1"})
    job.rollcalls[0] = RollCall(round=0, nonce="n1")
    decision = at(job, T0, T0)
    assert (type(decision), decision.reason, decision.restart_count) == (FormRound, RoundReason.WORKER_FAILED, 1)


def test_an_answer_to_an_earlier_roll_call_does_not_count():
    job = view("a", "b", round_of=("a", "b"), acked={"a", "b"}, failed={"a": failure("a")}, alive={"b": "old"})
    job.rollcalls[0] = RollCall(round=0, nonce="n1")
    assert at(job, T0, T0) == ROLL_CALL_OPEN


def test_a_member_that_never_answers_the_roll_call_is_evicted_as_lost_after_close_timeout():
    job = view("a", "b", round_of=("a", "b"), acked={"a", "b"}, failed={"a": failure("a")})
    job.rollcalls[0] = RollCall(round=0, nonce="n1")
    decision = at(job, T0, T0 + 30)
    assert decision == MarkLost({"b": "did not answer the roll call within close_timeout=30s"}, {"b": 1})


def test_failures_past_max_restarts_end_the_job_with_the_earliest_as_root_cause():
    failed = {"a": failure("a", 1, at=5.0), "b": failure("b", 1, at=2.0)}
    decision = at(view("a", "b", round_of=("a", "b"), number=1, restarts=1, failed=failed), T0, T0)
    assert type(decision) is EndJob and not decision.finished
    assert decision.cause.node == "b"
    assert decision.summary.startswith("job job failed after 1 restart(s): root cause node b, rank 0")


def test_fewer_than_min_nodes_after_a_loss_fail_the_job_after_join_timeout():
    job = view("a", round_of=("a", "b"), acked={"a", "b"}, lost={"b": "lease expired"})
    assert at(job, T0, T0 + 59) == Wait(until=T0 + 60, why="1 node(s), fewer than MIN=2")
    decision = at(job, T0, T0 + 60)
    assert type(decision) is EndJob and "only 1 node(s) left, fewer than MIN=2" in decision.summary


# -- identity by incarnation -----------------------------------------------------------------------------------
def test_a_node_registered_again_never_reenters_the_round_of_its_previous_incarnation():
    job = view("a", "b", round_of=("a", "b"), acked={"a", "b"})
    job.nodes["b"] = node("b", lease=2)
    assert at(job, T0, T0) == MarkLost({"b": "registered again as a new incarnation"})
    job.reports[0].lost["b"] = "registered again as a new incarnation"
    decision = at(job, T0, T0)
    assert (type(decision), decision.reason) == (FormRound, RoundReason.NODE_LOST)
    assert [(m.node, m.incarnation) for m in decision.members] == [("a", 1), ("b", 2)]


# -- leaving ---------------------------------------------------------------------------------------------------
def test_a_leaving_member_holds_the_round_until_it_is_gone_and_its_peers_failures_are_not_charged():
    job = view("a", "b", "c", round_of=("a", "b", "c"), acked={"a", "b", "c"}, failed={"a": failure("a")})
    job.left["b"] = LeaveRecord(node="b", incarnation=1, reason="agent received SIGTERM")
    assert at(job, T0, T0 + 29) == Wait(until=T0 + 30, why="b leaving")
    del job.nodes["b"]  # b's workers exited, it wrote node_left and dropped its registration
    decision = at(job, T0, T0 + 29)
    assert (type(decision), decision.reason, decision.restart_count) == (FormRound, RoundReason.NODE_LEFT, 0)
    assert [m.node for m in decision.members] == ["a", "c"] and decision.handled_left == ["b"]


def test_a_leaver_gone_before_its_peers_answered_the_drain_waits_for_their_answers():
    """The leaving agent goes once its own workers drained; its peers' workers drain at the same step, but their
    answers can reach etcd after it is gone (a loaded CI host). Formed then, the round logged drain_timed_out
    for a drain that committed."""
    job = view("a", "c", round_of=("a", "b", "c"), acked={"a", "b", "c"})
    job.left["b"] = LeaveRecord(node="b", incarnation=1, reason="agent received SIGTERM")
    job.drains[0] = DrainRequest(round=0, number=7, reason="node_left")
    job.reports[0].drained = {"b": DrainReport(number=7, step=6), "a": DrainReport(number=7, step=6)}
    assert at(job, T0, T0 + 1, DRAINING) == Wait(until=T0 + 60, why="c draining")
    job.reports[0].drained["c"] = DrainReport(number=7, step=6)
    formed = at(job, T0, T0 + 1, DRAINING)
    assert (type(formed), formed.reason, formed.drain.committed, formed.drain.step) == (
        FormRound,
        RoundReason.NODE_LEFT,
        True,
        6,
    )
    del job.reports[0].drained["c"]
    late = at(job, T0, T0 + 60, DRAINING)
    assert (type(late), late.drain.committed) == (FormRound, False), "drain_timeout passed: it goes ahead"
    job.reports[0].failed = {"c": failure("c")}
    assert type(at(job, T0, T0 + 1, DRAINING)) is FormRound, "c failed instead of draining: nothing to wait for"


def test_a_member_that_never_finishes_leaving_is_evicted():
    job = view("a", "b", round_of=("a", "b"), acked={"a", "b"})
    job.left["b"] = LeaveRecord(node="b", incarnation=1, reason="agent received SIGTERM")
    assert at(job, T0, T0 + 30) == MarkLost({"b": "did not finish leaving within close_timeout=30s"}, {"b": 1})


def test_leave_notices_of_gone_non_members_are_forgotten():
    job = view("a", "b", round_of=("a", "b"), acked={"a", "b"})
    job.left["spare"] = LeaveRecord(node="spare", incarnation=3, reason="agent received SIGTERM")
    assert at(job, T0, T0) == ForgetLeft(["spare"])


def test_a_leaving_spare_is_not_taken_into_a_round():
    job = view("a", "b", "c")
    job.left["c"] = LeaveRecord(node="c", incarnation=1, reason="agent received SIGINT")
    decision = at(job, T0, T0 + 5)
    assert [m.node for m in decision.members] == ["a", "b"]


# -- quarantine ------------------------------------------------------------------------------------------------
def strikes(job: JobView, counts: dict[str, int], quarantined: dict[str, float] | None = None) -> JobView:
    job.round = job.round.model_copy(update={"strikes": counts, "quarantined": quarantined or {}})
    return job


def test_the_root_cause_of_three_consecutive_failures_sits_out_the_next_rounds():
    failed = {"a": failure("a", at=5.0), "c": failure("c", at=2.0)}  # c failed first: the root cause
    job = strikes(view("a", "b", "c", round_of=("a", "b", "c"), failed=failed, done={"b"}), {"c": 2, "b": 1})
    decision = at(job, T0, T0 + 7, dataclasses.replace(SETTINGS, max_restarts=9))
    assert (type(decision), decision.reason) == (FormRound, RoundReason.WORKER_FAILED)
    assert [m.node for m in decision.members] == ["a", "b"]
    assert decision.newly_quarantined == ["c"] and decision.quarantined == {"c": T0 + 7 + 300}
    assert decision.strikes == {}, "b took part without causing the failure: its strike is cleared"


def test_quarantine_ends_are_unix_times_in_every_round():
    """The rules' clock is monotonic, quarantines are unix times (a later controller reads them): the offset between
    the two must outlive the clock's reset at each new round."""
    unix_minus_monotonic = 1.7e9
    failed = {"a": failure("a", number=3, at=5.0), "c": failure("c", number=3, at=2.0)}
    job = strikes(view("a", "b", "c", round_of=("a", "b", "c"), number=3, failed=failed, done={"b"}), {"c": 2})
    clock = Clock(leading_since=T0, wall_offset=unix_minus_monotonic)
    decision, clock = settle(job, T0 + 7, clock, dataclasses.replace(SETTINGS, max_restarts=9))
    assert clock.wall_offset == unix_minus_monotonic
    assert decision.quarantined == {"c": unix_minus_monotonic + T0 + 7 + 300}


def test_a_first_or_second_strike_only_counts():
    failed = {"a": failure("a", at=5.0), "c": failure("c", at=2.0)}
    job = strikes(view("a", "b", "c", round_of=("a", "b", "c"), failed=failed, done={"b"}), {"c": 1})
    decision = at(job, T0, T0, dataclasses.replace(SETTINGS, max_restarts=9))
    assert decision.strikes == {"c": 2} and not decision.newly_quarantined
    assert [m.node for m in decision.members] == ["a", "b", "c"]


def test_no_quarantine_that_would_leave_fewer_than_min_nodes():
    job = strikes(view("a", "b", round_of=("a", "b"), failed={"b": failure("b")}, done={"a"}), {"b": 2})
    decision = at(job, T0, T0, dataclasses.replace(SETTINGS, max_restarts=9))
    assert [m.node for m in decision.members] == ["a", "b"] and decision.strikes == {"b": 3}


def test_a_quarantined_node_is_readmitted_as_a_waiting_node_when_its_cooldown_ends():
    job = strikes(view("a", "b", "c", round_of=("a", "b"), number=4, acked={"a", "b"}), {}, {"c": T0 + 100})
    four_node_max = dataclasses.replace(SETTINGS, max_nodes=4)
    assert at(job, T0, T0 + 99, four_node_max) == Wait(T0 + 100, "round running")
    decision = at(job, T0 + 100, T0 + 105, four_node_max)
    assert (type(decision), decision.reason) == (FormRound, RoundReason.SCALE_UP)
    assert [m.node for m in decision.members] == ["a", "b", "c"] and decision.readmitted == ["c"]
    assert decision.quarantined == {}


# -- who is charged with a round's failure -----------------------------------------------------------------------
MEMBERS = [Member(n, 1, i, 1, i, f"10.0.0.{i + 1}") for i, n in enumerate("abcd")]  # a: .1, b: .2, c: .3, d: .4


def worker(
    name: str, at: float, unreachable: tuple[str, ...] = (), broken: bool | None = None, consequence: bool = False
) -> WorkerFailure:
    return WorkerFailure(
        node=name,
        round=0,
        local_rank=0,
        rank="abcd".index(name),
        exit_code=1,
        time=at,
        path_broken=bool(unreachable) if broken is None else broken,
        unreachable=list(unreachable),
        consequence=consequence,
    )


PEER = {"consequence": True}  # it failed because a peer did


@pytest.mark.parametrize(
    "failures, charged",
    [
        # no evidence of a broken path: the earliest failure's node
        ([worker("a", 2.0), worker("c", 1.0), worker("b", 3.0)], ["c"]),
        # ... that was not a consequence of a peer's failure (a reset seen before the crash was recorded)
        ([worker("a", 1.0, **PEER), worker("c", 2.0), worker("b", 3.0, **PEER)], ["c"]),
        ([worker("a", 1.0, **PEER), worker("b", 3.0, **PEER)], []),  # every rank waited in a collective
        # b and c lost each other (both ends or one end saw it); a, which reset earliest, is not charged
        ([worker("a", 1.0), worker("b", 2.0, ("10.0.0.3",)), worker("c", 2.0, ("10.0.0.2",))], ["b", "c"]),
        ([worker("a", 1.0), worker("b", 2.0, ("10.0.0.3",)), worker("c", 2.0)], ["b", "c"]),
        # a connect with no route, its peer unknown: its reporter
        ([worker("a", 1.0, **PEER), worker("b", 2.0, broken=True)], ["b"]),
        # d lost everyone: it touches every broken path
        ([worker("a", 1.0, ("10.0.0.4",)), worker("b", 2.0, ("10.0.0.4",)), worker("d", 3.0, ("10.0.0.1",))], ["d"]),
        # an address that is not a member's, or the failing node's own, names no peer
        ([worker("a", 1.0, ("192.168.9.9", "10.0.0.1")), worker("b", 0.5)], ["a"]),
    ],
)
def test_a_failure_is_charged_to_the_ends_of_broken_paths_else_to_the_root_cause(failures, charged):
    assert charged_nodes(failures, MEMBERS) == charged


def test_an_address_nodes_share_names_none_of_them_and_the_path_touches_its_reporter_only():
    shared = [Member(n, 1, i, 1, i, "10.0.0.9" if n != "a" else "10.0.0.1") for i, n in enumerate("abc")]
    failures = [worker("a", 2.0, ("10.0.0.9",)), worker("b", 1.0)]
    assert charged_nodes(failures, shared) == ["a"]


def test_both_ends_of_a_cut_take_a_strike_and_one_sits_out_when_min_allows():
    failed = {"a": failure("a", at=1.0)}
    failed["b"] = NodeFailure(node="b", round=0, failures=[worker("b", 2.0, ("10.0.0.1",))])
    job = view("a", "b", "c", round_of=("a", "b", "c"), failed=failed, done={"c"})
    job.nodes = {n: r.model_copy(update={"addr": f"10.0.0.{'abc'.index(n) + 1}"}) for n, r in job.nodes.items()}
    job.round = RoundRecord.of(0, assign_ranks(None, job.nodes, 99), 0, "initial")
    decision = at(strikes(job, {"a": 2, "b": 2}), T0, T0, dataclasses.replace(SETTINGS, max_restarts=9))
    assert decision.newly_quarantined == ["a"], "a tie quarantines the first by name, and only one: MIN is 2"
    assert [m.node for m in decision.members] == ["b", "c"] and decision.strikes == {"b": 3}
