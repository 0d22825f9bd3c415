"""launcher.etcd.lease_keeper: when refreshes go out, and that one held by a dead leader does not hold the others."""

from __future__ import annotations

import threading
import time
from types import SimpleNamespace

import pytest

from launcher.etcd.errors import EtcdUnavailable
from launcher.etcd.lease_keeper import MAX_IN_FLIGHT, LeaseKeeper, RefreshTimes, next_check_at, refresh_due

INTERVAL = 1.0


@pytest.mark.parametrize(
    "sent, confirmed, in_flight, now, due",
    [
        (0.0, 0.0, 0, 0.5, False),  # confirmed, and an interval has not passed
        (0.0, 0.0, 0, 1.0, True),  # one refresh per interval
        (1.0, 0.0, 1, 1.2, False),  # the regular one is unanswered, but no confirmation is overdue yet
        (1.0, 0.0, 1, 1.5, True),  # overdue (1.5 intervals), a quarter interval since the last one: another
        (1.5, 0.0, 2, 1.6, False),  # overdue, but the last one went out less than a quarter interval ago
        (1.5, 0.0, 2, 1.75, True),
        (2.0, 0.0, MAX_IN_FLIGHT, 3.0, False),  # as many in flight as allowed: none more, however late
        (2.0, 1.9, 1, 2.5, False),  # a confirmation came: back to one per interval
    ],
)
def test_refreshes_go_out_once_per_interval_and_every_quarter_interval_while_overdue(
    sent, confirmed, in_flight, now, due
):
    assert refresh_due(RefreshTimes(sent=sent, confirmed=confirmed, in_flight=in_flight), now, INTERVAL) is due


@pytest.mark.parametrize(
    "sent, confirmed, in_flight, wake",
    [
        (0.0, 0.0, 0, 1.0),  # confirmed: the next regular refresh
        (1.0, 0.0, 1, 1.5),  # unanswered: when the confirmation becomes overdue
        (1.5, 0.0, 2, 1.75),  # overdue: a quarter interval after the last one
        (2.0, 0.0, MAX_IN_FLIGHT, None),  # as many in flight as allowed: only an answer wakes the keeper
    ],
)
def test_the_keeper_sleeps_until_a_refresh_can_be_due(sent, confirmed, in_flight, wake):
    assert next_check_at(RefreshTimes(sent=sent, confirmed=confirmed, in_flight=in_flight), INTERVAL) == wake


def test_no_refresh_is_due_before_the_wake_up_and_one_is_at_it():
    """Over a grid of states: sleeping until next_check_at misses no refresh and wakes for one."""
    steps = [i / 8 for i in range(25)]
    for sent in steps:
        for confirmed in (c for c in steps if c <= sent):
            for in_flight in range(MAX_IN_FLIGHT):
                times = RefreshTimes(sent=sent, confirmed=confirmed, in_flight=in_flight)
                wake = next_check_at(times, INTERVAL)
                assert wake is not None and refresh_due(times, wake, INTERVAL), times
                assert not any(refresh_due(times, now, INTERVAL) for now in steps if sent <= now < wake), times


class _Etcd:
    """Stands in for etcd's answer to one keep-alive: a follower holds it until the caller's deadline while its
    leader is dead (silently cut), and answers at once once another member leads."""

    def __init__(self) -> None:
        self.leader_dead = threading.Event()
        self.calls = 0

    def refresh(self, lease, timeout: float):
        self.calls += 1
        if self.leader_dead.is_set():
            time.sleep(timeout)
            raise EtcdUnavailable("deadline exceeded")
        return [SimpleNamespace(TTL=3)]


@pytest.mark.timeout(30)
def test_a_refresh_held_by_a_dead_leader_does_not_hold_the_next_ones():
    etcd = _Etcd()
    interval = 0.2
    keeper = LeaseKeeper(SimpleNamespace(id=1), interval, on_lost=lambda: None, refresh=etcd.refresh).start()
    try:
        time.sleep(3 * interval)
        assert keeper.silent_for() < 2 * interval
        calls_before = etcd.calls
        etcd.leader_dead.set()
        time.sleep(3 * interval)  # the refreshes sent meanwhile hang for a whole deadline each
        calls_while_dead = etcd.calls - calls_before
        etcd.leader_dead.clear()  # a new leader: the next refresh is answered at once
        elected = time.monotonic()
        while keeper.silent_for() > time.monotonic() - elected:
            assert time.monotonic() - elected < interval / 2, "the refreshes waited for the one the dead leader held"
            time.sleep(0.01)
        assert calls_while_dead >= 5, "refreshes went out one deadline apart, each waiting for the one before"
    finally:
        keeper.stop()


@pytest.mark.timeout(30)
def test_etcd_saying_the_lease_is_gone_calls_on_lost_once_and_stops():
    lost = threading.Event()
    calls = []

    def refresh(lease, timeout):
        calls.append(time.monotonic())
        return [SimpleNamespace(TTL=0)]

    keeper = LeaseKeeper(SimpleNamespace(id=1), 0.05, on_lost=lost.set, refresh=refresh).start()
    assert lost.wait(5)
    time.sleep(0.3)
    assert keeper.lost and len(calls) == 1
