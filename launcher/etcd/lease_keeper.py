"""Keeps one etcd lease alive from its own thread, and says when etcd let it end.

Refreshes go out once per interval while etcd confirms them. Once a confirmation is overdue, they go out every
quarter interval, each under its own deadline, without waiting for the ones still unanswered: when the etcd leader
dies silently, a follower holds every refresh it forwards to the dead leader until the call's deadline, and a
keeper that waited for each answer would hear of the new leader a whole deadline late, long enough to fence a
healthy node (a new leader extends every lease when it takes over, so nothing was at risk).

Known cost: when every answer is slow (etcd, or this process, short of CPU) the extra refreshes add load. 1,024
simulated agents on one 2-core machine (bench/rendezvous_bench.py) then keep losing their leases; with one refresh
at a time they do not, but a silent cut of the etcd leader then fenced a node in about one run in six. Issue #18.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any

from launcher.etcd import client as etcd_client
from launcher.etcd.errors import EtcdUnavailable

logger = logging.getLogger(__name__)

# refreshes unanswered at once: enough to keep sending through one deadline at a quarter interval apart
MAX_IN_FLIGHT = 4
# a confirmation this many intervals old is overdue: refreshes then go out every quarter interval
OVERDUE_AFTER_INTERVALS = 1.5

Refresh = Callable[[Any, float], Sequence[Any]]  # (lease, deadline s) -> etcd's answers; raises when none came


@dataclass(frozen=True)
class RefreshTimes:
    """When the last refresh went out and when the newest confirmed one went out (monotonic seconds)."""

    sent: float
    confirmed: float
    in_flight: int


def refresh_due(times: RefreshTimes, now: float, interval: float) -> bool:
    """Whether to send a refresh now: one per interval, or one per quarter interval while a confirmation is overdue."""
    if times.in_flight >= MAX_IN_FLIGHT:
        return False
    since_sent = now - times.sent
    if since_sent >= interval:
        return True
    return now - times.confirmed >= OVERDUE_AFTER_INTERVALS * interval and since_sent >= interval / 4


def next_check_at(times: RefreshTimes, interval: float) -> float | None:
    """The earliest time `refresh_due` says yes; None while MAX_IN_FLIGHT refreshes are unanswered (only an answer
    changes that). The keeper sleeps until then or an answer, so a healthy lease costs one wake-up per interval."""
    if times.in_flight >= MAX_IN_FLIGHT:
        return None
    overdue_from = times.confirmed + OVERDUE_AFTER_INTERVALS * interval
    return min(times.sent + interval, max(overdue_from, times.sent + interval / 4))


class LeaseKeeper:
    """Refreshes `lease` every `interval` seconds until stopped; calls `on_lost` once if etcd no longer has it.

    A refresh that etcd does not answer is followed by more (see the module's docstring): the lease outlives a
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
        self._lock = threading.Lock()
        now = time.monotonic()
        self._times = RefreshTimes(sent=now, confirmed=now, in_flight=0)  # granted counts as confirmed
        self._stop = threading.Event()
        self._answered = threading.Event()  # a refresh finished: the next check may be sooner
        self._thread = threading.Thread(target=self._run, name=name, daemon=True)
        self._attempts = ThreadPoolExecutor(max_workers=MAX_IN_FLIGHT, thread_name_prefix=f"{name}-call")

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
            with self._lock:
                wake_at = next_check_at(self._times, self.interval)
            self._answered.wait(None if wake_at is None else max(0.0, wake_at - time.monotonic()))
            self._answered.clear()
            if self._stop.is_set():
                return
            now = time.monotonic()
            with self._lock:
                if not refresh_due(self._times, now, self.interval):
                    continue
                self._times = RefreshTimes(now, self._times.confirmed, self._times.in_flight + 1)
            try:
                self._attempts.submit(self._attempt, now)
            except RuntimeError:  # stopped meanwhile
                return

    def _attempt(self, sent: float) -> None:
        try:
            # under its own deadline: the client's, for every call, outlasts a fence's budget
            responses = self._refresh(self.lease, self.interval)
        except EtcdUnavailable as exc:
            logger.debug("lease %x refresh failed, sending more: %s", self.lease.id, exc)
            responses = None
        except Exception as exc:
            logger.warning("lease %x refresh refused: %s", self.lease.id, exc)
            responses = None
        with self._lock:
            previous = self._times.confirmed
            confirmed = max(previous, sent) if responses and responses[0].TTL > 0 else previous
            self._times = RefreshTimes(self._times.sent, confirmed, self._times.in_flight - 1)
            gone = responses is not None and len(responses) > 0 and responses[0].TTL <= 0
            gone = gone and not self.lost and not self._stop.is_set()
            self.lost = self.lost or gone
        self._answered.set()
        if confirmed - previous >= OVERDUE_AFTER_INTERVALS * self.interval:
            logger.info("etcd confirmed lease %x again, %.1fs after the last time", self.lease.id, confirmed - previous)
        if gone:
            self.stop()
            self.on_lost()
