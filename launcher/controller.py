"""The rendezvous controller: decides rounds, restarts, the end of a job. One agent at a time runs it.

Every agent runs a RoundController thread, but only the holder of the job's controller key (held under
that agent's lease) acts, so a lost controller is replaced as soon as its lease expires. All state lives
in etcd and every decision is written with one transaction that checks the controller key and the round
it read, so two controllers can never both form round N.
"""

from __future__ import annotations

import logging
import threading
import time
from typing import Callable

from launcher import etcd_client, membership_log
from launcher.config import LaunchConfig
from launcher.job_state import JobSnapshot, read_snapshot
from launcher.records import JobKeys, JobStatus, Member, NodeRecord, RoundRecord, WorkerFailure

logger = logging.getLogger(__name__)


def assign_ranks(previous: RoundRecord | None, nodes: dict[str, NodeRecord], max_nodes: int) -> list[Member]:
    """Deterministic membership: surviving members keep their order, then newcomers by join time and name."""
    order = [m.node for m in previous.members if m.node in nodes] if previous else []
    newcomers = sorted((n for n in nodes if n not in order), key=lambda n: (nodes[n].joined_at, n))
    members, next_rank = [], 0
    for group_rank, node in enumerate((order + newcomers)[:max_nodes]):
        record = nodes[node]
        members.append(
            Member(node=node, group_rank=group_rank, nproc=record.nproc, first_rank=next_rank, addr=record.addr)
        )
        next_rank += record.nproc
    return members


def root_cause(failures: list[WorkerFailure]) -> WorkerFailure:
    """The earliest failure: later ones are usually peers noticing the first (as torchrun reports it)."""
    return min(failures, key=lambda f: (f.time, f.rank))


def failure_summary(rdzv_id: str, restarts: int, cause: WorkerFailure) -> str:
    exit_text = f"exit code {cause.exit_code}" if cause.exit_code >= 0 else f"killed by signal {-cause.exit_code}"
    lines = [
        f"job {rdzv_id} failed after {restarts} restart(s): root cause node {cause.node}, "
        f"rank {cause.rank} (local_rank {cause.local_rank}), {exit_text}, in round {cause.round}"
    ]
    if cause.message:
        lines.append(f"error: {cause.message}")
    if cause.traceback:
        lines.append(cause.traceback.rstrip())
    return "\n".join(lines)


class RoundController:
    def __init__(self, client, keys: JobKeys, config: LaunchConfig, lease_id: Callable[[], int | None]) -> None:
        self.client = client
        self.keys = keys
        self.config = config
        self.node_id = config.node_id
        self._lease_id = lease_id
        self._tick_s = min(0.2, config.monitor_interval * 2)
        self._started = time.monotonic()
        self._timers: dict[str, float] = {}
        self._timers_round: int | None = None
        self._last_error = ""

    # -- the loop ---------------------------------------------------------------------------------------
    def run(self, stop: threading.Event) -> None:
        while not stop.wait(self._tick_s):
            try:
                self.tick()
            except Exception as exc:  # a controller must outlive etcd hiccups; the next tick retries
                if etcd_client.is_transient(exc):
                    logger.debug("controller tick: etcd unavailable: %s", exc)
                elif repr(exc) != self._last_error:
                    logger.exception("controller tick failed")
                    self._last_error = repr(exc)

    def tick(self) -> None:
        if not self._lead():
            return
        snap = read_snapshot(self.client, self.keys)
        if snap.status is not None or snap.controller != self.node_id:
            return
        current = snap.round.round if snap.round else None
        if current != self._timers_round:
            self._timers, self._timers_round = {}, current
        if snap.round is None:
            self._first_round(snap)
        else:
            self._watch_round(snap)

    def _lead(self) -> bool:
        lease = self._lease_id()
        if lease is None:
            return False
        tx = self.client.transactions
        won, _ = self.client.transaction(
            compare=[tx.version(self.keys.controller) == 0],
            success=[tx.put(self.keys.controller, self.node_id, lease=lease)],
            failure=[],
        )
        if won:
            logger.info("%s now controls rendezvous of job %s", self.node_id, self.config.rdzv_id)
        return True

    def _since(self, name: str) -> float:
        """Seconds since the condition `name` was first seen in this round (0 on first sight)."""
        now = time.monotonic()
        return now - self._timers.setdefault(name, now)

    # -- decisions --------------------------------------------------------------------------------------
    def _first_round(self, snap: JobSnapshot) -> None:
        count, cfg = len(snap.nodes), self.config
        if count >= cfg.max_nodes:
            self._form(snap, "initial")
        elif count >= cfg.min_nodes:
            if self._since("quorum") >= cfg.rdzv.last_call_timeout:
                self._form(snap, "initial")
        else:
            self._timers.pop("quorum", None)
            if time.monotonic() - self._started >= cfg.rdzv.join_timeout:
                self._fail(snap, f"rendezvous timed out: {count} of at least {cfg.min_nodes} node(s) joined "
                                 f"within join_timeout={cfg.rdzv.join_timeout:g}s")  # fmt: skip

    def _watch_round(self, snap: JobSnapshot) -> None:
        round_, reports = snap.round, snap.current()
        members = [m.node for m in round_.members]
        missing = [n for n in members if n not in snap.nodes]
        unreported = [n for n in members if n not in reports.failed and n not in reports.done]

        if missing:
            self._record_losses(snap, missing)
            self._membership_changed(snap, "node_left" if set(missing) <= snap.left else "node_lost")
        elif reports.failed:
            # A node dying takes its peers' collectives down with it; give its lease time to expire so that
            # a lost node is not counted as a worker failure against --max-restarts.
            if unreported and self._since("failure") < self._lease_expiry_bound():
                return
            self._worker_failed(snap)
        elif not unreported:
            self._finish(snap)
        else:
            self._check_acks(snap, members)
            self._check_scale_up(snap, members)

    def _lease_expiry_bound(self) -> float:
        """Longest a dead node's lease can outlive its death: the whole TTL (it may have just been refreshed),
        plus etcd's lazy expiry checks and a loaded host's scheduling delays."""
        ttl = self.config.rdzv.lease_ttl
        return ttl + max(1.0, ttl / 2)

    def _membership_changed(self, snap: JobSnapshot, reason: str) -> None:
        cfg = self.config
        if len(snap.nodes) >= cfg.min_nodes:
            self._form(snap, reason)
        elif self._since("short") >= cfg.rdzv.join_timeout:
            self._fail(snap, f"only {len(snap.nodes)} node(s) left, fewer than MIN={cfg.min_nodes}, "
                             f"for join_timeout={cfg.rdzv.join_timeout:g}s")  # fmt: skip

    def _worker_failed(self, snap: JobSnapshot) -> None:
        failures = [f for report in snap.current().failed.values() for f in report.failures]
        restarts = snap.round.restart_count + 1
        if restarts > self.config.max_restarts:
            cause = root_cause(failures)
            self._fail(snap, failure_summary(self.config.rdzv_id, snap.round.restart_count, cause), cause)
        else:
            self._form(snap, "worker_failed", restarts)

    def _check_scale_up(self, snap: JobSnapshot, members: list[str]) -> None:
        cfg = self.config
        waiting = [n for n in snap.nodes if n not in members]
        if not waiting or len(members) >= cfg.max_nodes:
            self._timers.pop("joiner", None)
            return
        if len(snap.nodes) >= cfg.max_nodes or self._since("joiner") >= cfg.rdzv.last_call_timeout:
            self._form(snap, "scale_up")

    def _check_acks(self, snap: JobSnapshot, members: list[str]) -> None:
        reports = snap.current()
        silent = [n for n in members if n not in reports.acked and n not in reports.done]
        if not silent or self._since("acks") < self.config.rdzv.close_timeout:
            return
        # Alive but not starting the round (stuck tearing down, say): drop it, as if its lease had expired.
        tx = self.client.transactions
        reason = f"did not start round {snap.round.round} within close_timeout={self.config.rdzv.close_timeout:g}s"
        for node in silent:
            self._mark_lost(snap.round.round, node, reason, extra=[tx.delete(self.keys.node(node))])

    # -- writes -----------------------------------------------------------------------------------------
    def _record_losses(self, snap: JobSnapshot, missing: list[str]) -> None:
        """One node_lost event per node whose lease expired (an agent that left said so itself)."""
        for node in missing:
            if node not in snap.left and node not in snap.current().lost:
                self._mark_lost(snap.round.round, node, "lease expired")

    def _mark_lost(self, round_: int, node: str, reason: str, extra: list = ()) -> None:
        """Record `node` as lost in `round_`, once: its marker and its node_lost event in one transaction."""
        tx = self.client.transactions
        event = membership_log.new_event("node_lost", round=round_, node=node, reason=reason)
        won, _ = self.client.transaction(
            compare=[tx.value(self.keys.controller) == self.node_id, tx.version(self.keys.lost(round_, node)) == 0],
            success=[
                *extra,
                tx.put(self.keys.lost(round_, node), reason),
                membership_log.event_put(self.client, self.keys, event, self.node_id),
            ],
            failure=[],
        )
        if won:
            logger.warning("node %s lost in round %d: %s", node, round_, reason)

    def _guard(self, snap: JobSnapshot) -> list:
        tx = self.client.transactions
        round_guard = (
            tx.mod(self.keys.round) == snap.round_mod_revision if snap.round else tx.version(self.keys.round) == 0
        )
        return [tx.value(self.keys.controller) == self.node_id, round_guard, tx.version(self.keys.status) == 0]

    def _form(self, snap: JobSnapshot, reason: str, restart_count: int | None = None) -> None:
        previous = snap.round
        number = previous.round + 1 if previous else 0
        if restart_count is None:
            restart_count = previous.restart_count if previous else 0
        restarts = restart_count
        members = assign_ranks(previous, snap.nodes, self.config.max_nodes)
        record = RoundRecord(round=number, members=members, restart_count=restarts, reason=reason)
        tx = self.client.transactions
        events = []
        if reason == "worker_failed":
            events.append(membership_log.new_event(
                "restart", round=number, restart_count=restarts, reason=reason,
                message=f"restart {restarts} of --max-restarts {self.config.max_restarts}",
            ))  # fmt: skip
        events.append(membership_log.new_event(
            "round_started", round=number, world_size=record.world_size, members=record.member_summary(),
            reason=reason, restart_count=restarts,
        ))  # fmt: skip
        ops = [
            tx.put(self.keys.round, record.dumps()),
            # the previous rounds' reports and master addresses go with them: nothing stale reaches a new round
            tx.delete(self.keys.rounds, range_end=self.keys.round_prefix(number)),
            *(membership_log.event_put(self.client, self.keys, e, self.node_id) for e in events),
        ]
        won, _ = self.client.transaction(compare=self._guard(snap), success=ops, failure=[])
        if won:
            ranks = ", ".join(f"{m.node}:{m.first_rank}-{m.last_rank}" for m in members)
            logger.info("round %d formed (%s): world size %d [%s]", number, reason, record.world_size, ranks)

    def _finish(self, snap: JobSnapshot) -> None:
        self._end(snap, JobStatus(state="finished", summary=f"job {self.config.rdzv_id} finished"),
                  membership_log.new_event("job_finished", round=snap.round.round, world_size=snap.round.world_size))  # fmt: skip

    def _fail(self, snap: JobSnapshot, summary: str, cause: WorkerFailure | None = None) -> None:
        fields = {}
        if cause is not None:
            fields = dict(node=cause.node, rank=cause.rank, local_rank=cause.local_rank, exit_code=cause.exit_code)
        event = membership_log.new_event(
            "job_failed", round=snap.round.round if snap.round else None, message=summary, **fields
        )
        self._end(snap, JobStatus(state="failed", summary=summary), event)

    def _end(self, snap: JobSnapshot, status: JobStatus, event: membership_log.MembershipEvent) -> None:
        tx = self.client.transactions
        won, _ = self.client.transaction(
            compare=self._guard(snap),
            success=[tx.put(self.keys.status, status.dumps()), membership_log.event_put(self.client, self.keys, event, self.node_id)],
            failure=[],
        )  # fmt: skip
        if won:
            logger.debug("%s", status.summary.splitlines()[0])
