"""The controller key, seen from one agent: claim it when it is free, run the controller while holding it, and
depose a controller whose agent is gone (certainly, or silent while this node's workers stall)."""

from __future__ import annotations

import logging
import random
import threading
import time

from launcher.config import LaunchConfig
from launcher.etcd.errors import EtcdUnavailable
from launcher.node.rules import claim_spread
from launcher.rendezvous.controller import Controller
from launcher.rendezvous.liveness import Target, probe_all
from launcher.rendezvous.membership_log import LogMirror
from launcher.rendezvous.protocol import ControllerStore, Holder, JobStore
from launcher.rendezvous.records import NodeRecord

logger = logging.getLogger(__name__)


class ControllerSeat:
    """Runs a `Controller` thread while this agent's incarnation holds the job's controller key."""

    def __init__(self, store: JobStore, config: LaunchConfig, log: LogMirror, node_id: str) -> None:
        self.store = store
        self.config = config
        self.log = log
        self.node_id = node_id
        self._thread: threading.Thread | None = None
        self._stop = threading.Event()
        self._claim_at: float | None = None

    def claim(self, lease_id: int) -> None:
        """Take the controller key if it is free, and lead from a thread of our own. An etcd that does not answer
        leaves the key to a later claim (`claim_when_free`, while no controller holds it): a node registering again
        into an overloaded etcd must not end over a seat it only might have taken."""
        if self._thread is not None and self._thread.is_alive():
            return
        holder = Holder(self.node_id, lease_id)
        try:
            if not self.store.claim_controller(holder):
                return
        except EtcdUnavailable as exc:
            logger.info("could not claim the controller key (%s); claiming it later if it is still free", exc)
            return
        self._stop = threading.Event()
        controller = Controller(ControllerStore(self.store.client, self.config.rdzv_id), holder, self.config, self.log)
        self._thread = threading.Thread(target=controller.run, args=(self._stop,), name="round-controller", daemon=True)
        self._thread.start()

    def claim_when_free(self, controller: str | None, connected: bool, members: int, lease_id: int) -> None:
        """With no controller, claim after a random part of the spread; the first standby to write wins."""
        if controller is not None or not connected:
            self._claim_at = None
            return
        now = time.monotonic()
        if self._claim_at is None:
            self._claim_at = now + random.uniform(0, claim_spread(members))
        if now >= self._claim_at:
            self._claim_at = None
            self.claim(lease_id)

    def claim_due(self) -> float | None:
        """When (time.monotonic()) `claim_when_free` means to claim the free controller key; None: no claim pending.
        The agent's loop wakes by then: until a standby claims it, no one decides the next round."""
        return self._claim_at

    def check(self, encoded_holder: str, stalled: bool, own: NodeRecord) -> None:
        """Our workers failed, maybe because the controller's node died with its workers, or they are `stalled`,
        maybe because it stopped: then nobody would act on our report until its lease ended. Probe its agent and
        depose it now if it is certainly gone, or, in a stall, if it does not answer as the controller requires of
        a stall's suspects: within probe_timeout, or sooner once our `own` agent, probed with it, answered
        (liveness.silence_deadline). After a failure, an agent flooded by the probes of every failed member answers
        late too, so only certainty counts."""
        holder = Holder.decode(encoded_holder)
        timeout = self.config.rdzv.probe_timeout
        if holder.node == self.node_id or not timeout:
            return
        record = self.store.read_node(holder.node)
        if record is None or record.lease != holder.lease or not record.probe_port:
            return  # its registration already ended: the key goes with it
        peers = {own.node: Target.of(own)} if stalled and own.probe_port else {}
        miss = probe_all({holder.node: Target.of(record)}, peers, timeout).get(holder.node)
        if miss is None or not (miss.certain or stalled):
            return  # alive, or maybe only slow: its lease decides
        reason = miss.reason if miss.certain else f"{miss.reason}; the workers of {self.node_id} stall"
        if self.store.depose_controller(holder, reason, self.node_id):
            logger.warning(
                "the controller (node %s) is gone (%s): ended its lease so a standby takes over now",
                holder.node,
                reason,
            )

    def stop(self) -> None:
        self._stop.set()

    def finish(self, timeout_s: float = 5.0) -> None:
        """Let a controller that ends the job copy its last events and trim them in etcd, then stop it."""
        if self._thread is not None:
            self._thread.join(timeout=timeout_s)
        self._stop.set()
