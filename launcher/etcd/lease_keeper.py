"""Keeps one etcd lease alive from its own thread, and says when etcd let it end.

Refreshes go out once per interval while etcd confirms them, each under a deadline of one interval (the client's
own, for every call, outlasts a fence's budget). Once a confirmation is overdue, the next goes out as soon as the
last one is answered or reaches its deadline, at least a quarter interval apart: when the etcd leader dies
silently, a follower holds the refresh it forwards to the dead leader until that deadline, and the one after goes
to the new leader (which extends every lease when it takes over, so nothing was at risk).

Refreshes never overlap. Sending more while one is unanswered did get past a held one sooner, but when every
answer is slow (etcd, or this process, short of CPU) more refreshes only add load: with up to four in flight,
1,024 simulated agents on one 2-core machine kept losing their leases and one host's 256 never saw a new round.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

from launcher.etcd import client as etcd_client
from launcher.etcd.errors import EtcdUnavailable

logger = logging.getLogger(__name__)

# a confirmation this many intervals old is overdue: refreshes then go out every quarter interval
OVERDUE_AFTER_INTERVALS = 1.5

Refresh = Callable[[Any, float], Sequence[Any]]  # (lease, deadline s) -> etcd's answers; raises when none came


@dataclass(frozen=True)
class RefreshTimes:
    """When the last refresh went out and when the newest confirmed one went out (monotonic seconds)."""

    sent: float
    confirmed: float


def refresh_due(times: RefreshTimes, now: float, interval: float) -> bool:
    """Whether to send a refresh now (the last one was answered or gave up): one per interval, or one per quarter
    interval while a confirmation is overdue."""
    since_sent = now - times.sent
    if since_sent >= interval:
        return True
    return now - times.confirmed >= OVERDUE_AFTER_INTERVALS * interval and since_sent >= interval / 4


def next_check_at(times: RefreshTimes, interval: float) -> float:
    """The earliest time `refresh_due` says yes: the keeper sleeps until then, one wake-up per interval while the
    lease is healthy."""
    overdue_from = times.confirmed + OVERDUE_AFTER_INTERVALS * interval
    return min(times.sent + interval, max(overdue_from, times.sent + interval / 4))


class LeaseKeeper:
    """Refreshes `lease` every `interval` seconds until stopped; calls `on_lost` once if etcd no longer has it.

    One thread per lease sends the refreshes and waits for each (see the module's docstring): the lease outlives a
    few misses, and etcd extends every lease when it restarts or elects a new leader.
    """

    def __init__(
        self,
        lease,
        interval: float,
        on_lost: Callable[[], None],
        name: str = "lease-keepalive",
        refresh: Refresh = etcd_client.refresh_lease,
    ) -> None:
        self.lease = lease
        self.interval = interval
        self.on_lost = on_lost
        self.lost = False
        self._refresh = refresh
        now = time.monotonic()
        self._times = RefreshTimes(sent=now, confirmed=now)  # granted counts as confirmed; replaced whole
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name=name, daemon=True)

    def start(self) -> LeaseKeeper:
        self._thread.start()
        return self

    def stop(self) -> None:
        self._stop.set()

    @property
    def refreshed_at(self) -> float:
        """When the newest refresh etcd confirmed was sent: etcd restarts the TTL no earlier than it receives it."""
        return self._times.confirmed

    def silent_for(self) -> float:
        """Seconds since etcd last confirmed the lease: past most of the TTL, peers may form a round without us."""
        return time.monotonic() - self._times.confirmed

    def _run(self) -> None:
        while not self._stop.wait(max(0.0, next_check_at(self._times, self.interval) - time.monotonic())):
            now = time.monotonic()
            if refresh_due(self._times, now, self.interval):
                self._refresh_once(now)

    def _refresh_once(self, sent: float) -> None:
        self._times = RefreshTimes(sent, self._times.confirmed)
        try:
            # under its own deadline: the client's, for every call, outlasts a fence's budget
            responses = self._refresh(self.lease, self.interval)
        except EtcdUnavailable as exc:
            logger.debug("lease %x refresh failed, sending the next one: %s", self.lease.id, exc)
            return
        except Exception as exc:
            logger.warning("lease %x refresh refused: %s", self.lease.id, exc)
            return
        if responses and responses[0].TTL > 0:
            previous = self._times.confirmed
            self._times = RefreshTimes(sent, sent)
            if sent - previous >= OVERDUE_AFTER_INTERVALS * self.interval:
                logger.info("etcd confirmed lease %x again, %.1fs after the last time", self.lease.id, sent - previous)
        elif responses and not self.lost and not self._stop.is_set():
            self.lost = True
            self.stop()
            self.on_lost()
