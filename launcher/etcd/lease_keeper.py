"""Keeps one etcd lease alive from its own thread, and says when etcd let it end.

Refreshes go out once per interval while etcd confirms them, one at a time per etcd endpoint. Once a confirmation
is overdue, another goes out every quarter interval through an endpoint that holds none, without waiting for the
ones unanswered: when the etcd leader dies silently, a follower holds every refresh it forwards to the dead leader
until the call's deadline (and the member the client talks to may be that leader), so a keeper that waited for
each answer, or sent every refresh through one member, would hear of the new leader after a fence had stopped a
healthy node (a new leader extends every lease when it takes over: nothing was at risk). A refresh confirmed
through another member while the client's member still holds an older one moves the client there.

With one endpoint refreshes never overlap, and the keeper's own thread makes each call: when etcd (or this process)
is short of CPU, overlapping refreshes only add load (1,024 simulated agents on one 2-core machine,
bench/rendezvous_bench.py, kept losing their leases), and every thread woken per refresh costs CPU there.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any, Protocol

from launcher.etcd import client as etcd_client
from launcher.etcd.errors import EtcdUnavailable

logger = logging.getLogger(__name__)

# a confirmation this many intervals old is overdue: refreshes then go out every quarter interval
OVERDUE_AFTER_INTERVALS = 1.5


class LeaseRoutes(Protocol):
    """How a keeper reaches etcd: `launcher.etcd.client.LeaseRoutes` through the lease's client."""

    def endpoints(self, lease: Any) -> Sequence[str]:
        """The endpoints to refresh through, in order of preference: the one the client uses first."""
        ...

    def refresh(self, lease: Any, deadline: float, endpoint: str) -> Sequence[Any]:
        """One refresh through `endpoint` under its own deadline: etcd's answers; raises when none came."""
        ...

    def prefer(self, lease: Any, endpoint: str) -> None:
        """Move the client to `endpoint`, which answered while the one it used did not."""
        ...


@dataclass(frozen=True)
class RefreshTimes:
    """When the last refresh went out and when the newest confirmed one went out (monotonic seconds)."""

    sent: float
    confirmed: float
    in_flight: int


def refresh_due(times: RefreshTimes, now: float, interval: float, max_in_flight: int) -> bool:
    """Whether to send a refresh now: one per interval, or one per quarter interval while a confirmation is overdue;
    never more than `max_in_flight` (one per endpoint) unanswered."""
    if times.in_flight >= max_in_flight:
        return False
    since_sent = now - times.sent
    if since_sent >= interval:
        return True
    return now - times.confirmed >= OVERDUE_AFTER_INTERVALS * interval and since_sent >= interval / 4


def next_check_at(times: RefreshTimes, interval: float, max_in_flight: int) -> float | None:
    """The earliest time `refresh_due` says yes; None while `max_in_flight` refreshes are unanswered (only an answer
    changes that). The keeper sleeps until then or an answer, so a healthy lease costs one wake-up per interval."""
    if times.in_flight >= max_in_flight:
        return None
    overdue_from = times.confirmed + OVERDUE_AFTER_INTERVALS * interval
    return min(times.sent + interval, max(overdue_from, times.sent + interval / 4))


class LeaseKeeper:
    """Refreshes `lease` every `interval` seconds until stopped; calls `on_lost` once if etcd no longer has it.

    A refresh that etcd does not answer is followed by more, through other endpoints (see the module's docstring):
    the lease outlives a few misses, and etcd extends every lease when it restarts or elects a new leader.
    """

    def __init__(
        self,
        lease,
        interval: float,
        on_lost: Callable[[], None],
        name: str = "lease-keepalive",
        routes: LeaseRoutes = etcd_client.LEASE_ROUTES,
        granted_at: float | None = None,
    ) -> None:
        """`granted_at`: when the lease's grant was asked for (monotonic; default now), from which etcd counts its
        TTL until the first refresh."""
        self.lease = lease
        self.interval = interval
        self.on_lost = on_lost
        self.lost = False
        self._routes = routes
        self._lock = threading.Lock()
        granted = time.monotonic() if granted_at is None else granted_at
        self._times = RefreshTimes(sent=granted, confirmed=granted, in_flight=0)  # the grant counts as a refresh
        self._busy: dict[str, float] = {}  # endpoint -> when the refresh it holds went out
        self._stop = threading.Event()
        self._answered = threading.Event()  # a refresh finished: the next check may be sooner
        self._thread = threading.Thread(target=self._run, name=name, daemon=True)
        self._attempts = ThreadPoolExecutor(max_workers=len(routes.endpoints(lease)), thread_name_prefix=f"{name}-call")

    def start(self) -> LeaseKeeper:
        self._thread.start()
        return self

    def stop(self) -> None:
        self._stop.set()
        self._answered.set()
        self._attempts.shutdown(wait=False, cancel_futures=True)

    @property
    def refreshed_at(self) -> float:
        """When the newest refresh etcd confirmed was sent: etcd restarts the TTL no earlier than it receives it."""
        return self._times.confirmed

    def silent_for(self) -> float:
        """Seconds since etcd last confirmed the lease: past most of the TTL, peers may form a round without us."""
        return time.monotonic() - self._times.confirmed

    def _run(self) -> None:
        while not self._stop.is_set():
            endpoints = self._routes.endpoints(self.lease)
            with self._lock:
                wake_at = next_check_at(self._times, self.interval, len(endpoints))
            self._answered.wait(None if wake_at is None else max(0.0, wake_at - time.monotonic()))
            self._answered.clear()
            if self._stop.is_set():
                return
            now = time.monotonic()
            with self._lock:
                free = [endpoint for endpoint in endpoints if endpoint not in self._busy]
                if not free or not refresh_due(self._times, now, self.interval, len(endpoints)):
                    continue
                self._busy[free[0]] = now
                self._times = RefreshTimes(now, self._times.confirmed, len(self._busy))
            if len(endpoints) == 1:
                self._attempt(now, free[0])  # they never overlap: no other thread needs to wake for it
                continue
            try:
                self._attempts.submit(self._attempt, now, free[0])
            except RuntimeError:  # stopped meanwhile
                return

    def _attempt(self, sent: float, endpoint: str) -> None:
        try:
            # under its own deadline: the client's, for every call, outlasts a fence's budget
            responses = self._routes.refresh(self.lease, self.interval, endpoint)
        except EtcdUnavailable as exc:
            logger.debug("lease %x refresh through %s failed, sending more: %s", self.lease.id, endpoint, exc)
            responses = None
        except Exception as exc:
            logger.warning("lease %x refresh through %s refused: %s", self.lease.id, endpoint, exc)
            responses = None
        in_use = self._routes.endpoints(self.lease)[0]
        with self._lock:
            del self._busy[endpoint]
            previous = self._times.confirmed
            answered = responses is not None and len(responses) > 0 and responses[0].TTL > 0
            confirmed = max(previous, sent) if answered else previous
            self._times = RefreshTimes(self._times.sent, confirmed, len(self._busy))
            gone = responses is not None and len(responses) > 0 and responses[0].TTL <= 0
            gone = gone and not self.lost and not self._stop.is_set()
            self.lost = self.lost or gone
            # the client's member still holds a refresh sent before this one, which another member confirmed
            move = answered and endpoint != in_use and self._busy.get(in_use, sent) < sent
        self._answered.set()
        if confirmed - previous >= OVERDUE_AFTER_INTERVALS * self.interval:
            logger.info("etcd confirmed lease %x again, %.1fs after the last time", self.lease.id, confirmed - previous)
        if move:
            logger.info("etcd endpoint %s holds a lease refresh that %s answered: using %s", in_use, endpoint, endpoint)
            self._routes.prefer(self.lease, endpoint)
        if gone:
            self.stop()
            self.on_lost()
