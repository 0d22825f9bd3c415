"""The per-node agent: joins the job in etcd under a lease, runs this node's workers for each round it belongs to.

Threads and what they own:
- the main thread runs `Agent.run`: it owns the phase, the current `RoundRun` (and so the workers), and
  every write an agent makes; it wakes on a change in the watched `state/ctl/` range, on a signal, and every
  `--monitor-interval` to poll its workers (which costs etcd nothing);
- a `LeaseKeeper` thread refreshes the lease; when etcd no longer has it, it wakes the main thread, which
  rejoins as a newcomer. When etcd has not confirmed the lease for most of its TTL (this node is cut off, or
  was stopped), the main thread fences itself: it kills its workers before the others can have formed a
  round without it, and once etcd answers it ends that lease and rejoins as a newcomer;
- the etcd client's watch thread applies changes to the `RangeMirror`;
- while this agent holds the controller key, a `Controller` thread decides rounds (`launcher.rendezvous.controller`).
Stopping: the main thread sets `_stop_controller` and stops the keeper; all other threads are daemons.
"""

from __future__ import annotations

import enum
import logging
import os
import random
import signal
import socket
import sys
import threading
import time
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any

from elastic import node_memory
from launcher.config import LaunchConfig
from launcher.etcd import client as etcd_client
from launcher.etcd.lease_keeper import LeaseKeeper
from launcher.etcd.server import free_port
from launcher.etcd.watch import RangeMirror
from launcher.rendezvous.controller import Controller
from launcher.rendezvous.job_view import JobView, ViewParser
from launcher.rendezvous.liveness import LivenessServer, probe
from launcher.rendezvous.membership_log import LogMirror
from launcher.rendezvous.protocol import Holder, JobStore, NodeIdTaken
from launcher.rendezvous.records import (
    DrainReport,
    DrainRequest,
    JobStatus,
    MasterRecord,
    Member,
    NodeFailure,
    NodeRecord,
    RoundHeader,
    StallReport,
)
from launcher.workers.group import WorkerGroup, WorkerOutcome, node_worker_env
from launcher.workers.warm_pool import JOIN_WAIT_S, WarmPool
from launcher.workers.watchdog import Stall, StartupHistory

logger = logging.getLogger(__name__)

_ETCD_WARN_AFTER_S = 2.0
# Standby controllers wait a random part of this (per member of the round, capped) before claiming a free
# controller key, so that thousands of agents do not all write at once when the controller dies.
_CLAIM_SPREAD_PER_MEMBER_S = 0.001
_CLAIM_SPREAD_MAX_S = 1.0
_WARM_REFILL_AFTER_S = 5.0


def address_facing(endpoint_host: str) -> str:
    """The local address that routes to etcd: reachable by the other nodes, with no DNS guesswork."""
    try:
        with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as probe:
            probe.connect((socket.gethostbyname(endpoint_host), 9))
            return probe.getsockname()[0]
    except OSError:
        return socket.getfqdn()


class Phase(enum.Enum):
    """Where this agent is within the current round.

    WAITING  -> STARTING  a round lists this incarnation of the node
    STARTING -> RUNNING   the round's master address is known; workers started and acknowledged
    RUNNING  -> REPORTED  the workers exited; success or failure is reported (retried until etcd takes it)
    any      -> WAITING   a round forms without this node (a spare), or the lease ended and the node rejoined
    any      -> STARTING  a newer round lists this node: the old round's workers are stopped first
    The job's end and a signal leave the loop from any phase.
    """

    WAITING = "waiting"
    STARTING = "starting"
    RUNNING = "running"
    REPORTED = "reported"


@dataclass
class RoundRun:
    """Everything of one round on this node; a new round replaces it whole."""

    record: RoundHeader
    revision: int  # mod revision of the round record: the guard of every report about it
    member: Member | None  # None: a spare in this round
    phase: Phase
    workers: WorkerGroup | None = None
    acknowledged: bool = False  # the controller knows our workers started (retried until etcd takes it)
    pending_report: NodeFailure | bool | None = None  # a failure, True for success, None for nothing to say
    answered_rollcall: str | None = None
    drain_asked: int = 0  # the drain our workers were asked for (0: none, or withdrawn)
    drain_answered: int = 0  # the drain our answer is in etcd for
    failed: bool = False  # our workers failed in this round
    controller_checked: bool = False  # after our failure, we probed the controller's agent
    stall_reported: bool = False  # our report that all our workers are stalled is in etcd
    stall_write: Future | None = None  # the write that reports or clears it, while etcd has not answered
    refill_warm_at: float | None = None  # when to pre-start the next round's warm workers (monotonic)


class Agent:
    def __init__(self, config: LaunchConfig, client) -> None:
        self.config = config
        self.client = client
        self.store = JobStore(client, config.rdzv_id)
        self.node_id = config.node_id
        host = etcd_client.parse_endpoints(config.rdzv_endpoint)[0][0]
        self.addr = config.local_addr or address_facing(host)
        self.startups = StartupHistory()  # how long our workers take to their first heartbeat, over rounds
        assert config.log_dir is not None, "elastic-run picks the log dir before an agent starts"
        self.log = LogMirror.for_dir(config.log_dir)
        self._record: NodeRecord | None = None  # our registration: its lease is our incarnation (set by _join)
        self._lease: Any = None
        self._keeper: LeaseKeeper | None = None
        self.run_: RoundRun | None = None
        self.signal_received: int | None = None
        self.mirror = RangeMirror(self.client, self.store.keys.ctl)  # state/ctl/, started by run
        self.liveness = LivenessServer(self.addr)  # answers the controller's probes while this agent lives
        self.memory_dir = node_memory.node_memory_dir(config.rdzv_id, config.node_id)  # workers' snapshots
        # the next round's workers, pre-started with torch imported (None: every worker starts cold)
        self.warm = (
            WarmPool(
                node_worker_env(self.addr, config.nproc_per_node),
                config.nproc_per_node,
                [config.entrypoint, *config.args],
            )
            if config.starts_warm
            else None
        )
        self._parser = ViewParser(self.store.keys.state, self.store.keys.ctl)
        self._controller: threading.Thread | None = None
        self._stop_controller = threading.Event()
        self._claim_at: float | None = None
        self._fenced = False  # our workers were killed because etcd stopped confirming our lease
        # stall reports are written from here: a node cut off from etcd stalls too, and its main thread must
        # go on watching its lease (to fence itself) rather than wait on a write that cannot land
        self._stall_writer = ThreadPoolExecutor(max_workers=1, thread_name_prefix="stall-report")
        self._etcd_down_since: float | None = None
        self._etcd_warned_at = 0.0

    # -- lifecycle -------------------------------------------------------------------------------------------
    def run(self) -> int:
        if threading.current_thread() is threading.main_thread():
            for signum in self.config.signals_to_handle:
                signal.signal(signum, self._on_signal)
        status = self.store.read_status()
        if status is not None:
            return self._job_already_over(status)
        self.mirror.start()
        self.liveness.start()
        node_memory.create_empty(self.memory_dir)
        node_memory.remove_abandoned(self.memory_dir.parent)
        try:
            if self.warm is not None:
                self.warm.fill()  # their imports overlap the rendezvous
                self._wait_for_warm_workers_if_the_job_runs()
            self._join()
            return self._loop()
        finally:
            self._stop_controller.set()
            self._stop_workers()
            if self.warm is not None:
                self.warm.close()
            if self._keeper is not None:
                self._keeper.stop()
            self.liveness.stop()
            self._stall_writer.shutdown(wait=False, cancel_futures=True)
            self.mirror.close()
            node_memory.remove(self.memory_dir)
            self._sync_log()

    def stop(self, signum: int = signal.SIGTERM) -> None:
        """Ask the agent to leave the job as if it had received `signum` (what the signal handler does)."""
        if self.signal_received is None:
            self.signal_received = signum
        self.mirror.poke()

    # -- this incarnation: set by _join, for everything after it ---------------------------------------------
    @property
    def record(self) -> NodeRecord:
        assert self._record is not None, "_join registers before anything uses the registration"
        return self._record

    @property
    def lease(self) -> Any:
        assert self._lease is not None, "_join grants the lease before anything uses it"
        return self._lease

    @property
    def keeper(self) -> LeaseKeeper:
        assert self._keeper is not None, "_join starts the keeper before anything uses it"
        return self._keeper

    def _on_signal(self, signum: int, frame) -> None:
        self.stop(signum)

    def _wait_for_warm_workers_if_the_job_runs(self) -> None:
        """A job that trains already would stand idle in the round that takes us in until our interpreters
        imported torch: join it once they did (launcher.workers.warm_pool)."""
        assert self.warm is not None, "only with warm workers"
        entries, revision, _ = self.mirror.snapshot()
        if self._parser.parse(entries, revision).round_header is None:
            return
        started = time.monotonic()
        ready = self.warm.wait_ready(JOIN_WAIT_S, lambda: self.signal_received is not None)
        logger.info(
            "the job is training: joining once this node's warm workers imported torch (%s after %.1fs)",
            "ready" if ready else "not all ready",
            time.monotonic() - started,
        )

    def _join(self) -> None:
        """Register a new incarnation of this node under a fresh lease, kept alive from now on."""
        while True:
            lease = self.store.grant_lease(self.config.rdzv.lease_ttl)
            self.liveness.incarnation = lease.id
            record = NodeRecord(
                node=self.node_id,
                addr=self.addr,
                nproc=self.config.nproc_per_node,
                lease=lease.id,
                pid=os.getpid(),
                probe_port=self.liveness.port,
            )
            try:
                self.store.register(record)
                break
            except NodeIdTaken as exc:
                self.store.revoke(lease.id)
                raise SystemExit(f"error: {exc}") from None
            except Exception as exc:
                if not etcd_client.is_lease_gone(exc):
                    raise
                logger.warning("lease %x ended before registration (a stalled etcd); registering again", lease.id)
        self._lease, self._record = lease, record
        self._keeper = LeaseKeeper(lease, self.config.rdzv.keep_alive_interval, self.mirror.poke).start()
        logger.info("node %s (%s) joined job %s, lease %ds", self.node_id, self.addr, self.config.rdzv_id, lease.ttl)
        self._claim_controller()

    # -- the loop --------------------------------------------------------------------------------------------
    def _loop(self) -> int:
        seen = -1
        view = JobView()
        while True:
            if self.signal_received is not None:
                return self._leave(self.signal_received)
            if self.keeper.silent_for() >= self.lease.ttl + self.config.rdzv.join_timeout:
                return self._give_up()
            if self.keeper.lost:
                self._rejoin("etcd no longer has our lease (it expired, or the controller evicted this node)")
                continue
            if self._fenced or self._must_fence():
                self._fence()
                continue
            if self.mirror.version != seen:
                entries, revision, seen = self.mirror.snapshot()
                view = self._parser.parse(entries, revision)
            self._note_etcd_health()
            if view.status is not None:
                return self._job_over(view.status)
            try:
                self._step(view)
            except Exception as exc:
                if not etcd_client.is_transient(exc):
                    raise
                # every step is safe to repeat: a pending report or an unstarted round is retried next time
                logger.debug("etcd call failed, retrying: %s", exc)
            self.mirror.wait(seen, self.config.monitor_interval)

    def _step(self, view: JobView) -> None:
        self._maybe_claim_controller(view)
        header = view.round_header
        if header is not None and (self.run_ is None or header.round != self.run_.record.round):
            self._enter_round(header, view.round_revision)
        run = self.run_
        if run is None:
            return
        if run.phase is Phase.STARTING:
            self._start_workers(run, view.masters.get(run.record.round))
        elif run.phase is Phase.RUNNING:
            self._poll_workers(run)
        if self.warm is not None and run.refill_warm_at is not None and time.monotonic() >= run.refill_warm_at:
            run.refill_warm_at = None
            self.warm.fill()
        if run.workers is not None and not run.acknowledged:
            self.store.acknowledge(run.record.round, run.revision, self.node_id, os.getpid())
            run.acknowledged = True
        if run.pending_report is not None:
            self._report(run)
        if run.failed and not run.controller_checked and view.controller is not None:
            run.controller_checked = True
            self._check_controller(Holder.decode(view.controller))
        if run.member is not None:
            self._follow_drain(run, view.drains.get(run.record.round))
            self._follow_stall(run)
        rollcall = view.rollcalls.get(run.record.round)
        if (
            rollcall is not None
            and run.member is not None
            and run.answered_rollcall != rollcall.nonce
            and not self._reporting_hang(run)
        ):
            if self.store.answer_rollcall(run.record.round, run.revision, self.node_id, rollcall.nonce):
                run.answered_rollcall = rollcall.nonce

    def _must_fence(self) -> bool:
        """Workers running while etcd has not confirmed our lease for most of its TTL: the job may move on."""
        ttl = self.lease.ttl
        running = self.run_ is not None and self.run_.workers is not None
        return running and self.keeper.silent_for() >= ttl - min(1.0, ttl / 4)

    def _fence(self) -> None:
        """Kill our workers now; end this incarnation once etcd answers, then rejoin as a newcomer."""
        if not self._fenced:
            logger.warning(
                "etcd has not confirmed this node's lease for %.1fs of its %ds: killing the workers "
                "before the job moves on without them",
                self.keeper.silent_for(),
                self.lease.ttl,
            )
            self._fenced = True
            self._stop_workers(signal.SIGKILL)
        try:
            self.store.revoke(self.record.lease, deadline_s=self.config.monitor_interval)
        except Exception as exc:
            if not etcd_client.is_transient(exc):
                raise
            self.mirror.wait(self.mirror.version, self.config.monitor_interval)  # still cut off; try again
            return
        self._fenced = False
        self._rejoin("fenced after losing touch with etcd")

    def _note_etcd_health(self) -> None:
        now = time.monotonic()
        if self.mirror.connected:
            self._etcd_down_since = None
            return
        self._etcd_down_since = self._etcd_down_since or now
        if now - self._etcd_down_since >= _ETCD_WARN_AFTER_S and now - self._etcd_warned_at >= _ETCD_WARN_AFTER_S:
            logger.warning(
                "etcd %s unreachable for %.0fs; workers keep running",
                self.config.rdzv_endpoint,
                now - self._etcd_down_since,
            )
            self._etcd_warned_at = now

    # -- the controller key ----------------------------------------------------------------------------------
    def _claim_controller(self) -> None:
        if self._controller is not None and self._controller.is_alive():
            return
        holder = Holder(self.node_id, self.lease.id)
        if not self.store.claim_controller(holder):
            return
        self._stop_controller = threading.Event()
        controller = Controller(self.store, holder, self.config, self.log)
        self._controller = threading.Thread(
            target=controller.run, args=(self._stop_controller,), name="round-controller", daemon=True
        )
        self._controller.start()

    def _maybe_claim_controller(self, view: JobView) -> None:
        if view.controller is not None or not self.mirror.connected:
            self._claim_at = None
            return
        now = time.monotonic()
        if self._claim_at is None:
            members = view.round_header.size if view.round_header is not None else 1
            spread = min(_CLAIM_SPREAD_MAX_S, _CLAIM_SPREAD_PER_MEMBER_S * members)
            self._claim_at = now + random.uniform(0, spread)
        if now >= self._claim_at:
            self._claim_at = None
            self._claim_controller()

    def _check_controller(self, holder: Holder) -> None:
        """Our workers failed, maybe because the controller's node died with its workers: then nobody would act
        on our report until its lease ended. Probe its agent; if it is certainly gone, depose it now."""
        timeout = self.config.rdzv.probe_timeout
        if holder.node == self.node_id or not timeout:
            return
        record = self.store.read_node(holder.node)
        if record is None or record.lease != holder.lease or not record.probe_port:
            return  # its registration already ended: the key goes with it
        miss = probe(record.addr, record.probe_port, record.lease, timeout)
        if miss is None or not miss.certain:
            return  # alive, or maybe only slow: its lease decides
        if self.store.depose_controller(holder, miss.reason, self.node_id):
            logger.warning(
                "the controller (node %s) is gone (%s): ended its lease so a standby takes over now",
                holder.node,
                miss.reason,
            )

    # -- rounds ----------------------------------------------------------------------------------------------
    def _enter_round(self, record: RoundHeader, revision: int) -> None:
        member = self.store.read_member(record, self.node_id, self.record.lease)
        if self.run_ is not None and self.run_.workers is not None:
            logger.info(
                "round %d (%s): stopping the workers of round %d", record.round, record.reason, self.run_.record.round
            )
        self._stop_workers()
        phase = Phase.STARTING if member is not None else Phase.WAITING
        self.run_ = RoundRun(record=record, revision=revision, member=member, phase=phase)
        if member is None:
            logger.info(
                "round %d formed without this incarnation of node %s: waiting as a spare for the next "
                "round (at most %d nodes take part, or the round formed before it joined)",
                record.round,
                self.node_id,
                self.config.max_nodes,
            )

    def _start_workers(self, run: RoundRun, master: MasterRecord | None) -> None:
        member = run.member
        assert member is not None, "a spare's round waits in Phase.WAITING, never STARTING"
        if master is None:
            if member.group_rank != 0:
                return  # rank 0's node publishes where its store will listen
            master = MasterRecord(addr=member.addr, port=free_port(member.addr))
            if not self.store.publish_master(run.record.round, run.revision, master):
                return  # the round moved on; the next step enters the new one
        run.workers = WorkerGroup(self.config, run.record, member, master, self.startups, self.warm)
        run.workers.start()
        run.phase = Phase.RUNNING
        # refilled once this round's workers are past their own start-up, not competing with it for the CPU
        run.refill_warm_at = time.monotonic() + max(_WARM_REFILL_AFTER_S, 2 * (self.startups.longest or 0.0))

    def _poll_workers(self, run: RoundRun) -> None:
        assert run.workers is not None, "Phase.RUNNING begins once the workers started"
        outcome, failures = run.workers.poll()
        if outcome is WorkerOutcome.RUNNING:
            return
        if outcome is WorkerOutcome.FAILED:
            for failure in failures:
                if failure.hung:
                    logger.error(
                        "round %d: worker local_rank %d (rank %d) %s",
                        failure.round,
                        failure.local_rank,
                        failure.rank,
                        failure.message,
                    )
                    continue
                logger.error(
                    "round %d: worker local_rank %d (rank %d) failed with exit code %d",
                    failure.round,
                    failure.local_rank,
                    failure.rank,
                    failure.exit_code,
                )
            self._stop_workers()  # peers of a failed worker usually hang in their next collective
            run.pending_report = NodeFailure(node=self.node_id, round=run.record.round, failures=failures)
            run.failed = True
        else:
            run.pending_report = True
        run.phase = Phase.REPORTED

    @staticmethod
    def _reporting_hang(run: RoundRun) -> bool:
        """Our watchdog is killing a hung worker: answer the roll call with that failure, not before it, or the
        round would move on and the hung worker, which may be the cause of the peers' failures, go unreported."""
        reporting = getattr(run.workers, "reporting_hang", None)
        return bool(reporting and reporting())

    def _report(self, run: RoundRun) -> None:
        if isinstance(run.pending_report, NodeFailure):
            self.store.report_failed(run.revision, run.pending_report)
        else:
            self.store.report_done(run.record.round, run.revision, self.node_id)
        run.pending_report = None  # written, or the round moved on and the report no longer matters

    def _follow_drain(self, run: RoundRun, request: DrainRequest | None) -> None:
        """Pass the round's drain to our workers, withdraw it when it is gone, and answer once they drained."""
        if request is None:
            if run.drain_asked and run.workers is not None:
                logger.info("round %d: the drain was withdrawn; workers train on", run.record.round)
                run.workers.request_drain(0)
            run.drain_asked = 0
            return
        if run.drain_answered == request.number:
            return
        if run.workers is None or run.phase is not Phase.RUNNING:
            answer = DrainReport(number=request.number, step=None)  # no workers running: nothing to drain
        else:
            if run.drain_asked != request.number:
                logger.info(
                    "round %d: drain before %s: asking the workers to checkpoint at their next step",
                    run.record.round,
                    request.reason,
                )
                run.workers.request_drain(request.number)
                run.drain_asked = request.number
            pending = run.workers.drain_answer(request.number)
            if pending is None:
                return  # still saving
            answer = pending
        if self.store.report_drained(run.record.round, run.revision, self.node_id, answer):
            run.drain_answered = request.number
            if answer.step is not None:
                logger.info("round %d: workers drained at step %d", run.record.round, answer.step)

    def _follow_stall(self, run: RoundRun) -> None:
        """Tell the controller while all our workers are stalled, so it probes the members that are not."""
        if run.stall_write is not None:
            if not run.stall_write.done():
                return
            failed = run.stall_write.exception()
            run.stall_write = None
            if failed is None:
                run.stall_reported = not run.stall_reported
            else:
                logger.debug("stall report not written (tried again at the next poll): %s", failed)
        stall = run.workers.stall() if run.workers is not None and run.phase is Phase.RUNNING else None
        if (stall is not None) != run.stall_reported and run.phase is Phase.RUNNING:
            run.stall_write = self._stall_writer.submit(self._write_stall, run.record.round, run.revision, stall)

    def _write_stall(self, round_: int, revision: int, stall: Stall | None) -> None:
        """Report `stall` (None: clear our report); on the stall-report thread."""
        if stall is None:
            self.store.clear_stalled(round_, revision, self.node_id)
            logger.info("round %d: the workers make progress again", round_)
            return
        report = StallReport(seconds_silent=stall.seconds_silent, last_step=stall.last_step)
        if self.store.report_stalled(round_, revision, self.node_id, report):
            logger.warning(
                "round %d: every worker has been silent for %.1fs after step %s, as if a peer stopped; "
                "asked the controller to probe the other members",
                round_,
                stall.seconds_silent,
                stall.last_step,
            )

    def _stop_workers(self, signum: int = signal.SIGTERM) -> None:
        if self.run_ is not None and self.run_.workers is not None:
            self.run_.workers.stop(signum)
            self.run_.workers = None

    # -- leaving ---------------------------------------------------------------------------------------------
    def _rejoin(self, why: str) -> None:
        logger.warning(
            "node %s lost its membership (%s): stopping workers and rejoining as a newcomer", self.node_id, why
        )
        self._stop_controller.set()
        self._stop_workers()
        self.keeper.stop()
        self.run_ = None
        self._fenced = False  # that incarnation ends here: a fence still pending would revoke the new one's lease
        self._join()

    def _leave(self, signum: int) -> int:
        """Keep the lease while the workers stop, so peers' failures are not charged and no loss is logged."""
        name = signal.Signals(signum).name
        reason = f"agent received {name}"
        logger.warning("received %s: stopping workers and leaving job %s", name, self.config.rdzv_id)
        try:
            self.store.announce_leaving(self.node_id, self.record.lease, reason)
            self._drain_before_leaving()
        except Exception as exc:
            logger.warning("could not announce leaving (%s); stopping workers anyway", exc)
        self._stop_workers(signum)  # forwarded as-is, SIGKILL after the grace period
        self._stop_controller.set()
        try:
            self.store.leave(self.record, self.run_.record.round if self.run_ else None, reason)
        except Exception as exc:
            logger.warning("could not leave the membership cleanly (%s); peers will notice when the lease expires", exc)
        return 128 + signum

    def _drain_before_leaving(self) -> None:
        """Our leave notice makes the controller ask for a drain: keep the workers until it committed (at most
        --drain-timeout), so the next round redoes nothing of theirs."""
        run = self.run_
        if run is None or run.workers is None or run.phase is not Phase.RUNNING or not self.config.drain_timeout:
            return
        deadline = time.monotonic() + self.config.drain_timeout
        while time.monotonic() < deadline:
            entries, revision, seen = self.mirror.snapshot()
            view = self._parser.parse(entries, revision)
            header = view.round_header
            if view.status is not None or header is None or header.round != run.record.round:
                return  # the job or the round moved on
            if run.workers.poll()[0] is not WorkerOutcome.RUNNING:
                return
            self._follow_drain(run, view.drains.get(run.record.round))
            if run.drain_answered:
                return
            self.mirror.wait(seen, self.config.monitor_interval)
        logger.warning(
            "the workers did not drain within --drain-timeout %gs; leaving anyway (the next round redoes "
            "the steps since the last checkpoint)",
            self.config.drain_timeout,
        )

    def _give_up(self) -> int:
        """etcd has not answered for longer than a node may wait to join: nothing can go on without it."""
        self._stop_workers(signal.SIGKILL)  # fenced long ago, unless they outlived that
        print(
            f"elastic-run: etcd {self.config.rdzv_endpoint or '(standalone)'} has not answered for "
            f"{self.keeper.silent_for():.0f}s, longer than the lease ({self.lease.ttl}s) plus join_timeout "
            f"({self.config.rdzv.join_timeout:g}s): giving up; start this node again once etcd is back",
            file=sys.stderr,
            flush=True,
        )
        return 1

    def _job_over(self, status: JobStatus) -> int:
        if self._controller is not None:
            self._controller.join(timeout=5)  # it copies the job's last events and trims them in etcd
        self._stop_workers()
        self._stop_controller.set()
        self.keeper.stop()
        try:
            self.store.revoke(self.record.lease)
        except Exception as exc:
            logger.debug("lease revoke failed: %s", exc)
        if status.state == "finished":
            logger.info("%s", status.summary)
            return 0
        print(f"elastic-run: {status.summary}", file=sys.stderr, flush=True)
        return 1

    def _job_already_over(self, status: JobStatus) -> int:
        if status.state == "finished":
            print(
                f"elastic-run: job {self.config.rdzv_id} already finished; nothing to do "
                "(use a new --rdzv-id to start another)",
                file=sys.stderr,
                flush=True,
            )
            return 0
        print(
            f"elastic-run: job {self.config.rdzv_id} already failed: {status.summary.splitlines()[0]}; "
            "use a new --rdzv-id to start again",
            file=sys.stderr,
            flush=True,
        )
        return 1

    def _sync_log(self) -> None:
        try:
            self.log.sync(self.client, self.store.keys.events)
        except Exception as exc:
            logger.debug("membership log mirror failed: %s", exc)
