"""Keeps one etcd lease alive from its own thread, and says when etcd let it end."""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable

from launcher.etcd import client as etcd_client

logger = logging.getLogger(__name__)


class LeaseKeeper:
    """Refreshes `lease` every `interval` seconds until stopped; calls `on_lost` once if etcd no longer has it.

    A refresh that etcd does not answer is tried again at the next interval: the lease outlives a few misses,
    and etcd extends every lease when it restarts or elects a new leader.
    """

    def __init__(self, lease, interval: float, on_lost: Callable[[], None], name: str = "lease-keepalive") -> None:
        self.lease = lease
        self.interval = interval
        self.on_lost = on_lost
        self.lost = False
        self.refreshed_at = time.monotonic()  # when etcd last confirmed the lease (granted counts)
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name=name, daemon=True)

    def start(self) -> LeaseKeeper:
        self._thread.start()
        return self

    def stop(self) -> None:
        self._stop.set()

    def silent_for(self) -> float:
        """Seconds since etcd last confirmed the lease: past most of the TTL, peers may form a round without us."""
        return time.monotonic() - self.refreshed_at

    def _run(self) -> None:
        while not self._stop.wait(self.interval):
            sent = time.monotonic()  # etcd restarts the TTL no earlier than it receives the refresh
            try:
                # a refresh stuck on a dead member, or forwarded by a follower to a dead leader, is given up after
                # one interval and sent again (elsewhere), rather than eating the client's 3 s of the fence's budget
                responses = etcd_client.refresh_lease(self.lease, timeout=self.interval)
            except Exception as exc:
                if not etcd_client.is_transient(exc):
                    logger.warning("lease %x refresh refused: %s", self.lease.id, exc)
                else:
                    logger.debug("lease %x refresh failed, retrying: %s", self.lease.id, exc)
                continue
            if responses and responses[0].TTL <= 0:
                self.lost = True
                if not self._stop.is_set():
                    self.on_lost()
                return
            self.refreshed_at = sent
