"""launcher.etcd.lease_keeper: when refreshes go out and through which endpoint; one held by a dead leader does not
hold the others, and with one endpoint they never overlap."""

from __future__ import annotations

import threading
import time
from types import SimpleNamespace

import pytest

from launcher.etcd.errors import EtcdUnavailable
from launcher.etcd.lease_keeper import LeaseKeeper, RefreshTimes, next_check_at, refresh_due

INTERVAL = 1.0
ENDPOINTS = 3


@pytest.mark.parametrize(
    "sent, confirmed, in_flight, now, due",
    [
        (0.0, 0.0, 0, 0.5, False),  # confirmed, and an interval has not passed
        (0.0, 0.0, 0, 1.0, True),  # one refresh per interval
        (1.0, 0.0, 1, 1.2, False),  # the regular one is unanswered, but no confirmation is overdue yet
        (1.0, 0.0, 1, 1.5, True),  # overdue (1.5 intervals), a quarter interval since the last one: another
        (1.5, 0.0, 2, 1.6, False),  # overdue, but the last one went out less than a quarter interval ago
        (1.5, 0.0, 2, 1.75, True),
        (2.0, 0.0, ENDPOINTS, 3.0, False),  # one in flight per endpoint: none more, however late
        (2.0, 1.9, 1, 2.5, False),  # a confirmation came: back to one per interval
    ],
)
def test_refreshes_go_out_once_per_interval_and_every_quarter_interval_while_overdue(
    sent, confirmed, in_flight, now, due
):
    assert (
        refresh_due(RefreshTimes(sent=sent, confirmed=confirmed, in_flight=in_flight), now, INTERVAL, ENDPOINTS) is due
    )


@pytest.mark.parametrize(
    "sent, confirmed, in_flight, wake",
    [
        (0.0, 0.0, 0, 1.0),  # confirmed: the next regular refresh
        (1.0, 0.0, 1, 1.5),  # unanswered: when the confirmation becomes overdue
        (1.5, 0.0, 2, 1.75),  # overdue: a quarter interval after the last one
        (2.0, 0.0, ENDPOINTS, None),  # one in flight per endpoint: only an answer wakes the keeper
    ],
)
def test_the_keeper_sleeps_until_a_refresh_can_be_due(sent, confirmed, in_flight, wake):
    assert next_check_at(RefreshTimes(sent=sent, confirmed=confirmed, in_flight=in_flight), INTERVAL, ENDPOINTS) == wake


def test_no_refresh_is_due_before_the_wake_up_and_one_is_at_it():
    """Over a grid of states: sleeping until next_check_at misses no refresh and wakes for one."""
    steps = [i / 8 for i in range(25)]
    for sent in steps:
        for confirmed in (c for c in steps if c <= sent):
            for in_flight in range(ENDPOINTS):
                times = RefreshTimes(sent=sent, confirmed=confirmed, in_flight=in_flight)
                wake = next_check_at(times, INTERVAL, ENDPOINTS)
                assert wake is not None and refresh_due(times, wake, INTERVAL, ENDPOINTS), times
                due = (refresh_due(times, now, INTERVAL, ENDPOINTS) for now in steps if sent <= now < wake)
                assert not any(due), times


def test_with_one_endpoint_a_refresh_waits_for_the_one_before():
    """One etcd member, slow to answer: never two refreshes at once, and the next goes out at once after a miss."""
    times = RefreshTimes(sent=1.0, confirmed=0.0, in_flight=1)
    assert not refresh_due(times, 1.9, INTERVAL, 1) and next_check_at(times, INTERVAL, 1) is None
    missed = RefreshTimes(sent=1.0, confirmed=0.0, in_flight=0)  # its deadline, one interval, passed
    assert refresh_due(missed, 2.0, INTERVAL, 1)


class _Etcd:
    """Stands in for etcd's members answering keep-alives: a member that is cut off, or that forwards to a dead
    leader, holds a refresh until the caller's deadline; the others answer at once."""

    def __init__(self, members: list[str]) -> None:
        self.in_use = members[0]
        self.members = members
        self.silent: set[str] = set()
        self.calls: list[str] = []
        self.lock = threading.Lock()
        self.most_in_flight = self.in_flight = 0

    def endpoints(self, lease) -> list[str]:
        return [self.in_use, *(m for m in self.members if m != self.in_use)]

    def refresh(self, lease, deadline: float, endpoint: str):
        with self.lock:
            self.calls.append(endpoint)
            self.in_flight += 1
            self.most_in_flight = max(self.most_in_flight, self.in_flight)
        try:
            if endpoint in self.silent:
                time.sleep(deadline)
                raise EtcdUnavailable("deadline exceeded")
            return [SimpleNamespace(TTL=3)]
        finally:
            with self.lock:
                self.in_flight -= 1

    def prefer(self, lease, endpoint: str) -> None:
        self.in_use = endpoint


@pytest.mark.timeout(30)
def test_a_refresh_held_by_a_dead_leader_does_not_hold_the_next_ones():
    """Every member forwards to a dead leader: the refreshes sent meanwhile go out a quarter interval apart, one per
    member, and the first one after a new leader took over is answered at once."""
    etcd = _Etcd(["m0", "m1", "m2"])
    interval = 0.2
    keeper = LeaseKeeper(SimpleNamespace(id=1), interval, on_lost=lambda: None, routes=etcd).start()
    try:
        time.sleep(3 * interval)
        assert keeper.silent_for() < 2 * interval
        calls_before = len(etcd.calls)
        etcd.silent.update(etcd.members)
        time.sleep(3 * interval)  # the refreshes sent meanwhile hang for a whole deadline each
        calls_while_dead = len(etcd.calls) - calls_before
        etcd.silent.clear()  # a new leader: the next refresh is answered at once
        elected = time.monotonic()
        while keeper.silent_for() > time.monotonic() - elected:
            assert time.monotonic() - elected < interval / 2, "the refreshes waited for the ones the dead leader held"
            time.sleep(0.01)
        assert calls_while_dead >= 4, "refreshes went out one deadline apart, each waiting for the one before"
        assert etcd.most_in_flight <= 3, "more refreshes in flight than members"
    finally:
        keeper.stop()


@pytest.mark.timeout(30)
def test_a_silent_member_in_use_is_left_for_one_that_answers():
    """The member the client uses is cut off: well before a fence could come (2.75 intervals of a 3-interval TTL),
    another member confirms the lease, and the client moves there."""
    etcd = _Etcd(["m0", "m1", "m2"])
    interval = 0.2
    keeper = LeaseKeeper(SimpleNamespace(id=1), interval, on_lost=lambda: None, routes=etcd).start()
    try:
        time.sleep(2 * interval)
        etcd.silent.add("m0")
        cut = time.monotonic()
        while etcd.in_use == "m0":
            assert time.monotonic() - cut < 3 * interval, f"still on the cut member; calls {etcd.calls}"
            time.sleep(0.01)
        assert keeper.silent_for() < 2.25 * interval
        time.sleep(3 * interval)
        assert keeper.silent_for() < 1.5 * interval and etcd.calls[-1] != "m0"
    finally:
        keeper.stop()


@pytest.mark.timeout(30)
def test_with_one_member_refreshes_never_overlap():
    etcd = _Etcd(["m0"])
    etcd.silent.add("m0")
    keeper = LeaseKeeper(SimpleNamespace(id=1), 0.05, on_lost=lambda: None, routes=etcd).start()
    try:
        time.sleep(0.6)
    finally:
        keeper.stop()
    assert etcd.most_in_flight == 1 and len(etcd.calls) >= 8, etcd.calls


@pytest.mark.timeout(30)
def test_etcd_saying_the_lease_is_gone_calls_on_lost_once_and_stops():
    lost = threading.Event()
    etcd = _Etcd(["m0"])
    etcd.refresh = lambda lease, deadline, endpoint: (etcd.calls.append(endpoint), [SimpleNamespace(TTL=0)])[1]
    keeper = LeaseKeeper(SimpleNamespace(id=1), 0.05, on_lost=lost.set, routes=etcd).start()
    assert lost.wait(5)
    time.sleep(0.3)
    assert keeper.lost and len(etcd.calls) == 1
