"""The controller: in the one agent that holds the job's controller key, applies `decisions.decide` to a watched view.

It watches the job's whole `state/` range (one watch, resumed across reconnects), keeps the local clock of
the rules, and writes each decision through `launcher.rendezvous.protocol`, whose guards make a stale controller's
writes fail: two controllers can never both form round N. It stops when the job is over, when its agent
stops it, or when it sees that it no longer holds the controller key.
"""

from __future__ import annotations

import logging
import random
import threading
import time
from typing import assert_never

from launcher.config import LaunchConfig
from launcher.etcd.errors import EtcdUnavailable
from launcher.etcd.watch import RangeMirror
from launcher.rendezvous.decisions import (
    Action,
    CallRollCall,
    Clock,
    EndJob,
    ForgetLeft,
    FormRound,
    MarkLost,
    ProbeMembers,
    RequestDrain,
    Settings,
    Wait,
    WithdrawDrain,
    decide,
    track,
)
from launcher.rendezvous.job_view import JobView, ViewParser
from launcher.rendezvous.liveness import Target, probe_all
from launcher.rendezvous.membership_log import LogMirror
from launcher.rendezvous.protocol import ControllerStore, Holder
from launcher.rendezvous.records import DrainRequest, JobStatus, RoundRecord, bucket_count, new_event
from launcher.rendezvous.round_events import round_events

logger = logging.getLogger(__name__)

_IDLE_WAKE_S = 5.0  # a local re-check while nothing changes and no deadline is due; costs etcd nothing
_LOG_SYNC_EVERY_S = 0.5
# Reading and deciding on the whole view costs O(nodes); at thousands of nodes a storm of changes (every agent
# acknowledging a round) would keep the controller's process busy re-reading it. Pausing this many times the last
# read's cost (the decision's included) before the next one batches the storm and caps the controller at a
# fraction of a core.
_PAUSE_PER_READ = 4.0
_MAX_PAUSE_S = 0.25
_RESTART_AFTER_S = 1.0  # after etcd did not answer for a whole retry deadline: a pause, then lead again


def settings_from(config: LaunchConfig) -> Settings:
    return Settings(
        rdzv_id=config.rdzv_id,
        min_nodes=config.min_nodes,
        max_nodes=config.max_nodes,
        max_restarts=config.max_restarts,
        join_timeout=config.rdzv.join_timeout,
        last_call_timeout=config.rdzv.last_call_timeout,
        close_timeout=config.rdzv.close_timeout,
        quarantine_after=config.rdzv.quarantine_after,
        quarantine_cooldown=config.rdzv.quarantine_cooldown,
        probe_timeout=config.rdzv.probe_timeout,
        drain_timeout=config.drain_timeout,
    )


class Controller:
    def __init__(self, store: ControllerStore, holder: Holder, config: LaunchConfig, log: LogMirror) -> None:
        self.store = store
        self.holder = holder
        self.settings = settings_from(config)
        self.max_events = config.rdzv.max_events
        self.log = log
        self._parser = ViewParser(store.keys.state, store.keys.state)
        self._last_log_sync = 0.0
        self._synced_version = -1  # the mirror version whose events membership.jsonl has: idle costs no reads

    def run(self, stop: threading.Event) -> None:
        """Lead until the job ends, `stop` is set, or another holder appears; never raises, and an etcd that does
        not answer for long makes it start over, not stop."""
        logger.info("%s now controls rendezvous of job %s", self.holder.node, self.settings.rdzv_id)
        while not stop.is_set():
            mirror = None
            try:
                mirror = RangeMirror(self.store.client, self.store.keys.state).start()
                self._lead(mirror, stop)
                return
            except EtcdUnavailable as exc:
                # we hold the controller key: stopping here would leave the job with no controller at all
                logger.warning("controller: etcd did not answer for long (%s); starting over", exc)
                stop.wait(_RESTART_AFTER_S)
            except Exception:
                logger.exception("controller of job %s stopped", self.settings.rdzv_id)
                return
            finally:
                if mirror is not None:
                    mirror.close()

    def _lead(self, mirror: RangeMirror, stop: threading.Event) -> None:
        now = time.monotonic()
        clock = Clock(leading_since=now, wall_offset=time.time() - now)
        while not stop.is_set():
            started = time.monotonic()
            entries, revision, version = mirror.snapshot()
            view = self._parser.parse(entries, revision)
            if view.controller != self.holder.encode():
                logger.info("%s no longer controls job %s", self.holder.node, self.settings.rdzv_id)
                return
            now = time.monotonic()
            clock = track(view, clock, now, self.settings)
            decision = decide(view, clock, now, self.settings)
            work_cost = time.monotonic() - started
            self._sync_log(version)
            if isinstance(decision, Wait):
                if view.status is not None:
                    self._sync_log(version, force=True)
                    return
                timeout = _IDLE_WAKE_S if decision.until is None else min(_IDLE_WAKE_S, decision.until - now)
                mirror.wait(version, max(timeout, 0.0))
                stop.wait(min(_MAX_PAUSE_S, _PAUSE_PER_READ * work_cost))
                continue
            clock = track(view, clock, now, self.settings, applied=decision)  # remembers the probes it makes
            try:
                self._apply(decision, view)
            except EtcdUnavailable as exc:
                logger.warning("controller: etcd did not answer (%s); retrying", exc)
            # our own write comes back through the watch; deciding again before it did would repeat it
            mirror.wait(version, 1.0)

    def _sync_log(self, version: int | None = None, force: bool = False) -> None:
        """Copy new events to membership.jsonl: events come with state changes, so an unchanged view has none."""
        now = time.monotonic()
        if not force and (version == self._synced_version or now - self._last_log_sync < _LOG_SYNC_EVERY_S):
            return
        self._last_log_sync = now
        try:
            self.log.sync(self.store.read_events)
            if version is not None:
                self._synced_version = version
        except Exception as exc:
            logger.debug("membership log mirror failed: %s", exc)

    # -- applying decisions --------------------------------------------------------------------------------
    def _apply(self, decision: Action, view: JobView) -> None:
        match decision:
            case FormRound():
                self._form(decision, view)
            case MarkLost():
                self._mark_lost(decision, view)
            case CallRollCall():
                if self.store.call_rollcall(self.holder, decision.round, view.round_revision):
                    logger.info("round %d: workers failed while members are silent; roll call", decision.round)
            case ProbeMembers():
                self._probe(decision, view)
            case RequestDrain():
                self._request_drain(decision, view)
            case WithdrawDrain():
                self.store.withdraw_drain(self.holder, decision.round)
                logger.info("round %d: %s; withdrawing the drain", decision.round, decision.why)
            case ForgetLeft():
                self.store.forget_left(self.holder, decision.nodes)
            case EndJob():
                self._end(decision, view)
            case _:
                assert_never(decision)

    def _request_drain(self, decision: RequestDrain, view: JobView) -> None:
        request = DrainRequest(
            round=decision.round,
            number=random.randrange(1, 2**63),
            reason=decision.reason,
            in_memory=decision.in_memory,
        )
        if self.store.request_drain(self.holder, view.round_revision, request):
            logger.info(
                "round %d: %s; asking its workers to checkpoint at their next step and wait",
                decision.round,
                decision.reason,
            )

    def _form(self, decision: FormRound, view: JobView) -> None:
        record = RoundRecord.of(
            decision.number,
            decision.members,
            decision.restart_count,
            decision.reason.value,
            decision.strikes,
            decision.quarantined,
        )
        events = round_events(decision, record, self.settings, time.time())
        buckets = bucket_count(len(record.nodes), self.settings.max_nodes)
        if self.store.form_round(self.holder, view.round_revision, record, events, decision.handled_left, buckets):
            members = decision.members
            ranks = ", ".join(f"{m.node}:{m.first_rank}-{m.last_rank}" for m in members[:16])
            more = f" and {len(members) - 16} more" if len(members) > 16 else ""
            logger.info(
                "round %d formed (%s): world size %d [%s%s]",
                decision.number,
                decision.reason.value,
                record.world_size,
                ranks,
                more,
            )
            self._trim_events()

    def _mark_lost(self, decision: MarkLost, view: JobView) -> None:
        assert view.round is not None, "only a member of a round can be lost"
        number = view.round.round
        for node, reason in decision.reasons.items():
            if self.store.mark_lost(self.holder, number, node, reason):
                logger.warning("node %s lost in round %d: %s", node, number, reason)
        for lease in decision.revoke.values():
            self.store.revoke(lease)  # fences the node: an agent alive after all finds its lease gone

    def _probe(self, decision: ProbeMembers, view: JobView) -> None:
        """Probe the silent (or, in a stall, not stalled) members at once; those that do not answer are lost
        now, and fenced."""
        suspects, peers = ({node: Target.of(r) for node, r in rs.items()} for rs in (decision.members, decision.peers))
        misses = probe_all(suspects, peers, self.settings.probe_timeout)
        failed = {node: miss.reason for node, miss in misses.items()}
        if failed:
            revoke = {node: decision.members[node].lease for node in failed}
            self._mark_lost(MarkLost(reasons=failed, revoke=revoke), view)

    def _end(self, decision: EndJob, view: JobView) -> None:
        status = JobStatus(state="finished" if decision.finished else "failed", summary=decision.summary)
        number = view.round.round if view.round else None
        if decision.finished:
            assert view.round is not None, "a job finishes when every member of its round did"
            event = new_event("job_finished", round=number, world_size=view.round.world_size)
        else:
            cause = decision.cause
            fields = {}
            if cause is not None:
                fields = dict(node=cause.node, rank=cause.rank, local_rank=cause.local_rank, exit_code=cause.exit_code)
            event = new_event("job_failed", round=number, message=decision.summary, **fields)
        if self.store.end_job(self.holder, view.round_revision, status, event):
            logger.debug("%s", decision.summary.splitlines()[0])  # every agent, this one too, reports the end
            self._trim_events()

    def _trim_events(self) -> None:
        self._sync_log(force=True)  # membership.jsonl keeps every event: copy what is new before it goes
        try:
            trimmed = self.store.trim_events(self.max_events)
        except Exception as exc:
            logger.debug("trimming events failed: %s", exc)
            return
        if trimmed:
            logger.info(
                "kept the newest %d events of job %s in etcd (membership.jsonl keeps all)",
                self.max_events,
                self.settings.rdzv_id,
            )
