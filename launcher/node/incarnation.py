"""One incarnation of this node in the job: a registration under a lease that a keeper keeps alive.

A node that lost its lease (it expired, it was evicted, it fenced itself) comes back as a new incarnation: a new
lease, and so a new identity to the controller, whatever it did in the old one.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from launcher.config import LaunchConfig
from launcher.etcd.errors import LeaseGone
from launcher.etcd.lease_keeper import LeaseKeeper, LeaseRoutes
from launcher.rendezvous.liveness import LivenessServer
from launcher.rendezvous.protocol import JobStore, NodeIdTaken
from launcher.rendezvous.records import NodeRecord

logger = logging.getLogger(__name__)


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
    ) -> Incarnation:
        """Register a new incarnation of this node under a fresh lease, kept alive from now on."""
        while True:
            lease = store.grant_lease(config.rdzv.lease_ttl)
            liveness.incarnation = lease.id
            record = NodeRecord(
                node=config.node_id,
                addr=addr,
                nproc=config.nproc_per_node,
                lease=lease.id,
                pid=os.getpid(),
                probe_port=liveness.port,
            )
            try:
                store.register(record)
                break
            except NodeIdTaken as exc:
                store.revoke(lease.id)
                raise SystemExit(f"error: {exc}") from None
            except LeaseGone:
                logger.warning("lease %x ended before registration (a stalled etcd); registering again", lease.id)
        keeper = LeaseKeeper(lease, config.rdzv.keep_alive_interval, on_lost, routes=routes).start()
        logger.info("node %s (%s) joined job %s, lease %ds", config.node_id, addr, config.rdzv_id, lease.ttl)
        return cls(lease=lease, record=record, keeper=keeper)
