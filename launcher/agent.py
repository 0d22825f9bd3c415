"""The per-node agent: joins the job in etcd under a lease, runs this node's workers for each round it belongs to."""

from __future__ import annotations

import logging
import os
import signal
import socket
import sys
import threading
import time

from launcher import etcd_client, membership_log
from launcher.config import LaunchConfig
from launcher.controller import RoundController
from launcher.etcd_server import free_port
from launcher.job_state import JobSnapshot, read_snapshot
from launcher.records import JobKeys, MasterRecord, NodeFailure, NodeRecord, RoundRecord, WorkerFailure
from launcher.workers import WorkerGroup

logger = logging.getLogger(__name__)

_MIRROR_EVERY_S = 0.5
_ETCD_WARN_AFTER_S = 2.0


def address_facing(endpoint_host: str) -> str:
    """The local address that routes to etcd: reachable by the other nodes, with no DNS guesswork."""
    try:
        with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as probe:
            probe.connect((socket.gethostbyname(endpoint_host), 9))
            return probe.getsockname()[0]
    except OSError:
        return socket.getfqdn()


class MembershipLost(Exception):
    """Our lease expired, or the controller dropped us: the node must rejoin as a newcomer."""


class Agent:
    def __init__(self, config: LaunchConfig, client) -> None:
        self.config = config
        self.client = client
        self.keys = JobKeys(config.rdzv_id)
        self.node_id = config.node_id
        host = etcd_client.parse_endpoints(config.rdzv_endpoint)[0][0]
        self.addr = config.local_addr or address_facing(host)
        self.mirror = membership_log.LogMirror(config.log_dir)
        self.lease = None
        self.workers: WorkerGroup | None = None
        self.round: RoundRecord | None = None  # the round this node last took part in (or waited through)
        self.round_revision = 0  # etcd mod revision of that round's record
        self.phase = "waiting"  # waiting -> starting -> running -> reported
        self.pending_report: tuple[str, list[WorkerFailure]] | None = None
        self.signal_received: int | None = None
        self._stop = threading.Event()
        self._etcd_down_since: float | None = None
        self._etcd_warned_at = 0.0
        self._last_mirror = 0.0

    # -- lifecycle ---------------------------------------------------------------------------------------
    def run(self) -> int:
        for signum in self.config.signals_to_handle:
            signal.signal(signum, self._on_signal)
        snap = etcd_client.call_with_retry(read_snapshot, self.client, self.keys, deadline_s=10)
        if snap.status is not None:
            return self._job_already_over(snap)
        self._register()
        threads = [
            threading.Thread(target=self._keep_alive, name="lease-keepalive", daemon=True),
            threading.Thread(target=RoundController(self.client, self.keys, self.config, self._lease_id).run,
                             args=(self._stop,), name="round-controller", daemon=True),
        ]  # fmt: skip
        for thread in threads:
            thread.start()
        try:
            return self._loop()
        finally:
            self._stop.set()
            self._stop_workers()
            self._sync_log(force=True)

    def _lease_id(self) -> int | None:
        return self.lease.id if self.lease is not None else None

    def _register(self) -> None:
        lease = etcd_client.call_with_retry(self.client.lease, self.config.rdzv.lease_ttl)
        record = NodeRecord(node=self.node_id, addr=self.addr, nproc=self.config.nproc_per_node, pid=os.getpid())
        event = membership_log.new_event("node_joined", node=self.node_id, message=f"{self.addr}, {record.nproc} worker(s)")
        tx = self.client.transactions
        won, _ = etcd_client.call_with_retry(
            self.client.transaction,
            compare=[tx.version(self.keys.node(self.node_id)) == 0],
            success=[
                tx.put(self.keys.node(self.node_id), record.dumps(), lease=lease.id),
                tx.delete(self.keys.left + self.node_id),
                membership_log.event_put(self.client, self.keys, event, self.node_id),
            ],
            failure=[],
        )
        if not won:
            lease.revoke()
            raise SystemExit(f"error: node id {self.node_id!r} is already in job {self.config.rdzv_id}: "
                             "pass a unique --node-id")  # fmt: skip
        self.lease = lease
        logger.info("node %s (%s) joined job %s, lease %ds", self.node_id, self.addr, self.config.rdzv_id, lease.ttl)

    def _keep_alive(self) -> None:
        interval = self.config.rdzv.keep_alive_interval
        while not self._stop.wait(interval):
            lease = self.lease
            if lease is None:
                continue
            try:
                responses = lease.refresh()
                if responses and responses[0].TTL <= 0:
                    logger.warning("lease of node %s expired", self.node_id)
            except Exception as exc:
                logger.debug("lease refresh failed, retrying: %s", exc)

    def _on_signal(self, signum: int, frame) -> None:
        if self.signal_received is None:
            self.signal_received = signum
        self._stop.set()

    # -- the loop ----------------------------------------------------------------------------------------
    def _loop(self) -> int:
        while True:
            if self.signal_received is not None:
                return self._leave_on_signal(self.signal_received)
            local = self.workers.poll() if self.workers is not None and self.phase == "running" else None
            snap = self._read_snapshot()
            if snap is not None:
                if snap.status is not None:
                    return self._job_over(snap)
                try:
                    self._step(snap, local)
                except MembershipLost as lost:
                    self._rejoin(str(lost))
                except Exception as exc:
                    if not etcd_client.is_transient(exc):
                        raise
                    # every step is safe to repeat: a pending report or an unstarted round is retried next tick
                    logger.debug("etcd call failed, retrying next tick: %s", exc)
                self._sync_log()
            elif local is not None and local[0] != "running":
                self._handle_local(local)  # stop failed workers' peers now; report once etcd answers
            self._stop.wait(self.config.monitor_interval)

    def _read_snapshot(self) -> JobSnapshot | None:
        try:
            snap = read_snapshot(self.client, self.keys)
        except Exception as exc:
            if not etcd_client.is_transient(exc):
                raise
            now = time.monotonic()
            self._etcd_down_since = self._etcd_down_since or now
            if now - self._etcd_down_since >= _ETCD_WARN_AFTER_S and now - self._etcd_warned_at >= _ETCD_WARN_AFTER_S:
                logger.warning("etcd %s unreachable for %.0fs; workers keep running", self.config.rdzv_endpoint,
                               now - self._etcd_down_since)  # fmt: skip
                self._etcd_warned_at = now
            return None
        self._etcd_down_since = None
        return snap

    def _step(self, snap: JobSnapshot, local: tuple[str, list[WorkerFailure]] | None) -> None:
        if self.node_id not in snap.nodes:
            raise MembershipLost("our lease expired or the controller dropped this node")
        current = snap.round
        if current is not None and (self.round is None or current.round != self.round.round):
            self._enter_round(current, snap.round_mod_revision)
        if self.phase == "starting":
            self._start_workers(snap)
        elif self.phase == "running" and local is not None and local[0] != "running":
            self._handle_local(local)
        if self.pending_report is not None:
            self._report()

    def _stop_workers(self, signum: int = signal.SIGTERM) -> None:
        if self.workers is not None:
            self.workers.stop(signum)
            self.workers = None

    def _enter_round(self, round_: RoundRecord, revision: int) -> None:
        if self.workers is not None:
            logger.info("round %d (%s): stopping the workers of round %d", round_.round, round_.reason,
                        self.round.round)  # fmt: skip
        self._stop_workers()
        self.round, self.round_revision, self.pending_report = round_, revision, None
        member = round_.member(self.node_id)
        self.phase = "starting" if member is not None else "waiting"
        if member is None:
            logger.info("round %d formed without this node (at most %d nodes): waiting as a spare",
                        round_.round, self.config.max_nodes)  # fmt: skip

    def _start_workers(self, snap: JobSnapshot) -> None:
        member = self.round.member(self.node_id)
        master = snap.current().master
        if master is None:
            if member.group_rank != 0:
                return  # rank 0's node publishes where its store will listen
            master = MasterRecord(addr=member.addr, port=free_port(member.addr))
            self.client.put(self.keys.master(self.round.round), master.dumps())
        self.workers = WorkerGroup(self.config, self.round, member, master)
        self.workers.start()
        self.phase = "running"
        etcd_client.call_with_retry(self.client.put, self.keys.ack(self.round.round, self.node_id), str(os.getpid()),
                                    deadline_s=self.config.rdzv.close_timeout / 2)  # fmt: skip

    def _handle_local(self, local: tuple[str, list[WorkerFailure]]) -> None:
        outcome, failures = local
        if outcome == "failed":
            for failure in failures:
                logger.error("round %d: worker local_rank %d (rank %d) failed with exit code %d", failure.round,
                             failure.local_rank, failure.rank, failure.exit_code)  # fmt: skip
            self._stop_workers()  # peers of a failed worker usually hang in their next collective
        self.pending_report = (outcome, failures)
        self.phase = "reported"

    def _report(self) -> None:
        outcome, failures = self.pending_report
        tx = self.client.transactions
        round_number = self.round.round
        if outcome == "failed":
            report = NodeFailure(node=self.node_id, round=round_number, failures=failures)
            events = [
                membership_log.new_event("worker_failed", round=round_number, node=self.node_id,
                                         local_rank=f.local_rank, rank=f.rank, exit_code=f.exit_code,
                                         message=f.message or None)
                for f in failures
            ]  # fmt: skip
            ops = [tx.put(self.keys.failed(round_number, self.node_id), report.dumps())]
            ops += [membership_log.event_put(self.client, self.keys, e, self.node_id) for e in events]
        else:
            ops = [tx.put(self.keys.done(round_number, self.node_id), "0")]
        # only while the round is still current: a report must never land in a later round
        guard = [tx.mod(self.keys.round) == self.round_revision]
        self.client.transaction(compare=guard, success=ops, failure=[])
        self.pending_report = None

    # -- leaving -----------------------------------------------------------------------------------------
    def _rejoin(self, why: str) -> None:
        logger.warning("node %s lost its membership (%s): stopping workers and rejoining", self.node_id, why)
        self._stop_workers()
        self.phase, self.round, self.pending_report = "waiting", None, None
        self.lease = None
        self._register()

    def _leave_on_signal(self, signum: int) -> int:
        name = signal.Signals(signum).name
        logger.warning("received %s: stopping workers and leaving job %s", name, self.config.rdzv_id)
        self._stop_workers(signum)  # forwarded as-is, SIGKILL after the grace period
        tx = self.client.transactions
        event = membership_log.new_event("node_left", node=self.node_id, round=self.round.round if self.round else None,
                                         reason=f"agent received {name}")  # fmt: skip
        try:
            etcd_client.call_with_retry(
                self.client.transaction, deadline_s=5,
                compare=[],
                success=[tx.put(self.keys.left + self.node_id, str(time.time())),
                         membership_log.event_put(self.client, self.keys, event, self.node_id),
                         tx.delete(self.keys.node(self.node_id))],
                failure=[],
            )  # fmt: skip
            if self.lease is not None:
                self.lease.revoke()
        except Exception as exc:
            logger.warning("could not leave the membership cleanly (%s); peers will notice when the lease expires", exc)
        return 128 + signum

    def _job_over(self, snap: JobSnapshot) -> int:
        self._stop_workers()
        self._release_lease()
        if snap.status.state == "finished":
            logger.info("%s", snap.status.summary)
            return 0
        print(f"elastic-run: {snap.status.summary}", file=sys.stderr, flush=True)
        return 1

    def _release_lease(self) -> None:
        try:
            if self.lease is not None:
                self.lease.revoke()
        except Exception as exc:
            logger.debug("lease revoke failed: %s", exc)

    def _job_already_over(self, snap: JobSnapshot) -> int:
        if snap.status.state == "finished":
            print(f"elastic-run: job {self.config.rdzv_id} already finished; nothing to do "
                  "(use a new --rdzv-id to start another)", file=sys.stderr, flush=True)  # fmt: skip
            return 0
        print(f"elastic-run: job {self.config.rdzv_id} already failed: {snap.status.summary.splitlines()[0]}; "
              "use a new --rdzv-id to start again", file=sys.stderr, flush=True)  # fmt: skip
        return 1

    def _sync_log(self, force: bool = False) -> None:
        now = time.monotonic()
        if not force and now - self._last_mirror < _MIRROR_EVERY_S:
            return
        try:
            self.mirror.sync(self.client, self.keys)
            self._last_mirror = now
        except Exception as exc:
            logger.debug("membership log mirror failed: %s", exc)
