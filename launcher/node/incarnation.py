"""One incarnation of this node in the job: a registration under a lease that a keeper keeps alive.

A node that lost its lease (it expired, it was evicted, it fenced itself) comes back as a new incarnation: a new
lease, and so a new identity to the controller, whatever it did in the old one.
"""

from __future__ import annotations

import logging
import os
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, TypeVar

from launcher.config import LaunchConfig
from launcher.etcd.errors import EtcdUnavailable, LeaseGone
from launcher.etcd.lease_keeper import LeaseKeeper, LeaseRoutes
from launcher.rendezvous.liveness import LivenessServer
from launcher.rendezvous.protocol import JobStore, NodeIdTaken
from launcher.rendezvous.records import NodeRecord

logger = logging.getLogger(__name__)

T = TypeVar("T")


def read_before_joining(config: LaunchConfig, what: str, read: Callable[[], T]) -> T:
    """`read`, a read of etcd the node needs before it registers, asked again while etcd does not answer, for up
    to join_timeout as the registration is: thousands of agents starting at once keep one etcd busy for longer
    than one call's deadline (at 8,192 simulated agents, 50 gave up after 30 s). Then one line, and exit."""
    started = time.monotonic()
    while True:
        try:
            return read()
        except EtcdUnavailable as exc:
            waited = time.monotonic() - started
            if waited > config.rdzv.join_timeout:
                raise SystemExit(
                    f"error: etcd {config.rdzv_endpoint or '(standalone)'} has not answered {what} for "
                    f"join_timeout={config.rdzv.join_timeout:g}s (last: {exc}); start the node again once etcd "
                    "answers"
                ) from None
            logger.warning("etcd has not answered %s for %.0fs (%s); asking again", what, waited, exc)


@dataclass
class Incarnation:
    lease: Any  # the client library's Lease
    record: NodeRecord
    keeper: LeaseKeeper

    @classmethod
    def register(
        cls,
        store: JobStore,
        config: LaunchConfig,
        addr: str,
        liveness: LivenessServer,
        on_lost: Callable[[], None],
        routes: LeaseRoutes,
        prepared: int = 0,
        before_new_lease: Callable[[], None] | None = None,
    ) -> Incarnation:
        """Register a new incarnation of this node under a fresh lease, kept alive from now on.

        An etcd too busy to answer (it refuses with "too many requests" while it catches up) is asked again with
        the same lease and record, so that a registration that committed unanswered is recognised as ours, for
        up to join_timeout; a lease that ended meanwhile is replaced. `prepared`: how many of its workers wait
        in standby (launcher.workers.standby), which node_joined records. `before_new_lease`: called before a lease
        that ended unregistered is replaced (the agent waits there, so that a herd spreads out; None: at once)."""
        lease = record = keeper = None
        failing_since: float | None = None
        while True:
            try:
                if lease is None or record is None:
                    asked_at = time.monotonic()
                    lease = store.grant_lease(config.rdzv.lease_ttl)
                    # kept alive from its grant: a registration that a busy etcd takes seconds to commit must not
                    # outlast the lease (at 1,024 simulated agents registering at once, some took 3 s and joined
                    # with a lease that had just ended)
                    keeper = LeaseKeeper(
                        lease, config.rdzv.keep_alive_interval, on_lost, routes=routes, granted_at=asked_at
                    ).start()
                    liveness.incarnation = lease.id
                    record = NodeRecord(
                        node=config.node_id,
                        addr=addr,
                        nproc=config.nproc_per_node,
                        lease=lease.id,
                        pid=os.getpid(),
                        probe_port=liveness.port,
                        prepared=prepared,
                    )
                store.register(record)
                break
            except NodeIdTaken as exc:
                assert record is not None and keeper is not None, "a registration was tried"
                keeper.stop()
                store.revoke(record.lease)
                raise SystemExit(f"error: {exc}") from None
            except LeaseGone:
                assert record is not None and keeper is not None, "a registration was tried"
                logger.warning("lease %x ended before registration (a stalled etcd); registering again", record.lease)
                keeper.stop()
                lease = record = None
                if before_new_lease is not None:
                    before_new_lease()
            except EtcdUnavailable as exc:
                failing_since = failing_since or time.monotonic()
                if time.monotonic() - failing_since > config.rdzv.join_timeout:
                    if keeper is not None:
                        keeper.stop()
                    raise SystemExit(
                        f"error: etcd {config.rdzv_endpoint or '(standalone)'} has not taken this node's "
                        f"registration for join_timeout={config.rdzv.join_timeout:g}s (last: {exc}); start the "
                        "node again once etcd answers"
                    ) from None
                logger.warning("etcd did not take this node's registration (%s); asking again", exc)
        assert keeper is not None, "registered under a kept lease"
        logger.info(
            "node %s (%s) joined job %s, lease %ds (refreshed every %gs)",
            config.node_id,
            addr,
            config.rdzv_id,
            lease.ttl,
            config.rdzv.keep_alive_interval,
        )
        return cls(lease=lease, record=record, keeper=keeper)
