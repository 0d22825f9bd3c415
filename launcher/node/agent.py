"""The per-node agent: joins the job in etcd under a lease, runs this node's workers for each round it belongs to.

What it does next is decided by the pure rules of `launcher.node.rules`; this module keeps the loop, the
lifecycle and applying the rules' actions.

Threads and what they own:
- the main thread runs `Agent.run`: it owns the current `RoundRun`, the workers, and every write an agent makes
  (but stall reports); it wakes on a change in the watched `state/ctl/` range, on a signal, and every
  `--monitor-interval` to poll its workers (which costs etcd nothing);
- a `LeaseKeeper` thread refreshes the lease; when etcd no longer has it, it wakes the main thread, which
  rejoins as a newcomer. When etcd has not confirmed the lease for most of its TTL (this node is cut off, or
  was stopped), the main thread fences itself: it kills its workers before the others can have formed a
  round without it, and once etcd answers it ends that lease and rejoins as a newcomer;
- the etcd client's watch thread applies changes to the `RangeMirror`;
- a `StallReporter` writes stall reports from a thread of its own;
- while this agent holds the controller key, a `Controller` thread decides rounds (`launcher.node.controller_seat`).
Stopping: the main thread stops the controller and the keeper; all other threads are daemons.
"""

from __future__ import annotations

import logging
import os
import signal
import socket
import sys
import threading
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import Any, assert_never

from elastic import node_memory
from launcher.config import LaunchConfig
from launcher.etcd import client as etcd_client
from launcher.etcd.lease_keeper import LeaseKeeper, Refresh
from launcher.etcd.server import free_port
from launcher.etcd.watch import RangeMirror
from launcher.node import rules
from launcher.node.controller_seat import ControllerSeat
from launcher.node.rules import Phase, RoundRun
from launcher.node.stall_reporter import StallReporter
from launcher.rendezvous.job_view import JobView, ViewParser
from launcher.rendezvous.liveness import LivenessServer
from launcher.rendezvous.membership_log import LogMirror
from launcher.rendezvous.protocol import JobStore, NodeIdTaken
from launcher.rendezvous.records import (
    DrainReport,
    DrainRequest,
    JobStatus,
    MasterRecord,
    Member,
    NodeFailure,
    NodeRecord,
    RoundHeader,
)
from launcher.workers.group import WorkerGroup, WorkerOutcome, node_worker_env
from launcher.workers.warm_pool import JOIN_WAIT_S, WarmPool
from launcher.workers.watchdog import StartupHistory

logger = logging.getLogger(__name__)

_ETCD_WARN_AFTER_S = 2.0

# builds a round's workers: (config, round, member, master, start-up history, warm pool) -> a WorkerGroup
WorkerGroupFactory = Callable[[LaunchConfig, RoundHeader, Member, MasterRecord, StartupHistory, WarmPool | None], Any]


def address_facing(endpoint_host: str) -> str:
    """The local address that routes to etcd: reachable by the other nodes, with no DNS guesswork."""
    try:
        with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as probe:
            probe.connect((socket.gethostbyname(endpoint_host), 9))
            return probe.getsockname()[0]
    except OSError:
        return socket.getfqdn()


class Agent:
    def __init__(
        self,
        config: LaunchConfig,
        client,
        *,
        worker_group: WorkerGroupFactory = WorkerGroup,
        refresh_lease: Refresh = etcd_client.refresh_lease,
    ) -> None:
        self.config = config
        self.client = client
        self.store = JobStore(client, config.rdzv_id)
        self.node_id = config.node_id
        host = etcd_client.parse_endpoints(config.rdzv_endpoint)[0][0]
        self.addr = config.local_addr or address_facing(host)
        self.startups = StartupHistory()  # how long our workers take to their first heartbeat, over rounds
        assert config.log_dir is not None, "elastic-run picks the log dir before an agent starts"
        self.log = LogMirror.for_dir(config.log_dir)
        self._worker_group = worker_group
        self._refresh_lease = refresh_lease
        self._record: NodeRecord | None = None  # our registration: its lease is our incarnation (set by _join)
        self._lease: Any = None
        self._keeper: LeaseKeeper | None = None
        self.run_: RoundRun | None = None
        self.workers: Any = None  # the current round's WorkerGroup, while it runs
        self._stalls: StallReporter | None = None
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
        self.seat = ControllerSeat(self.store, config, self.log, self.node_id)
        self._fence_pending = False  # our workers were killed because etcd stopped confirming our lease
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
            return _job_already_over(self.config.rdzv_id, status)
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
            self.seat.stop()
            self._stop_workers()
            if self.warm is not None:
                self.warm.close()
            if self._keeper is not None:
                self._keeper.stop()
            self.liveness.stop()
            self._stall_writer.shutdown(wait=False, cancel_futures=True)
            self.mirror.close()
            node_memory.remove(self.memory_dir)
            self.sync_log()

    def stop(self, signum: int = signal.SIGTERM) -> None:
        """Ask the agent to leave the job as if it had received `signum` (what the signal handler does)."""
        if self.signal_received is None:
            self.signal_received = signum
        self.mirror.poke()

    def sync_log(self) -> None:
        """Copy the job's new membership events from etcd into the log directory."""
        try:
            self.log.sync(self.client, self.store.keys.events)
        except Exception as exc:
            logger.debug("membership log mirror failed: %s", exc)

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
        interval = self.config.rdzv.keep_alive_interval
        self._keeper = LeaseKeeper(lease, interval, self.mirror.poke, refresh=self._refresh_lease).start()
        logger.info("node %s (%s) joined job %s, lease %ds", self.node_id, self.addr, self.config.rdzv_id, lease.ttl)
        self.seat.claim(lease.id)

    # -- the loop --------------------------------------------------------------------------------------------
    def _loop(self) -> int:
        seen = -1
        view = JobView()
        while True:
            if self.mirror.version != seen:
                entries, revision, seen = self.mirror.snapshot()
                view = self._parser.parse(entries, revision)
            action = rules.lifecycle(
                signal=self.signal_received,
                lease=rules.LeaseFacts(silent_for=self.keeper.silent_for(), ttl=self.lease.ttl, lost=self.keeper.lost),
                join_timeout=self.config.rdzv.join_timeout,
                fence_pending=self._fence_pending,
                workers_running=self.workers is not None,
                status=view.status,
            )
            match action:
                case None:
                    pass
                case rules.Leave(signum=signum):
                    return self._leave(signum)
                case rules.GiveUp(silent_for=silent_for):
                    return self._give_up(silent_for)
                case rules.Rejoin(why=why):
                    self._rejoin(why)
                    continue
                case rules.Fence(silent_for=silent_for):
                    self._fence(silent_for)
                    continue
                case rules.EndWithJob(status=status):
                    return self._job_over(status)
                case _:
                    assert_never(action)
            self._note_etcd_health()
            try:
                self.step(view)
            except Exception as exc:
                if not etcd_client.is_transient(exc):
                    raise
                # every action is safe to repeat: a pending report or an unstarted round is retried next time
                logger.debug("etcd call failed, retrying: %s", exc)
            self.mirror.wait(seen, self.config.monitor_interval)

    def step(self, view: JobView) -> None:
        """Apply the rules' actions for this view until none is left (each kind once)."""
        members = view.round_header.size if view.round_header is not None else 1
        self.seat.claim_when_free(view.controller, self.mirror.connected, members, self.lease.id)
        facts = rules.RoundFacts(
            header=view.round_header,
            header_revision=view.round_revision,
            masters=view.masters,
            controller=view.controller,
            drains=view.drains,
            rollcalls=view.rollcalls,
        )
        done: set[type] = set()
        while True:
            action = rules.next_action(
                facts,
                self.run_,
                now=time.monotonic(),
                workers_started=self.workers is not None,
                reporting_hang=self.workers is not None and self.workers.reporting_hang(),
                done=frozenset(done),
            )
            if action is None:
                return
            done.add(type(action))
            self._apply(action)

    def _apply(self, action: rules.RoundAction) -> None:
        run = self.run_
        match action:
            case rules.EnterRound(header=header, revision=revision):
                self.enter_round(header, revision)
            case rules.StartWorkers(master=master):
                assert run is not None and run.member is not None, "only a member of the round starts workers"
                self._start_workers(run, run.member, master)
            case rules.PollWorkers():
                assert run is not None, "polled only within a round"
                self._poll_workers(run)
            case rules.RefillWarmPool():
                assert run is not None and self.warm is not None, "a refill time is set only with a warm pool"
                run.refill_warm_at = None
                self.warm.fill()
            case rules.Acknowledge():
                assert run is not None, "acknowledged only within a round"
                self.store.acknowledge(run.round, run.revision, self.node_id, os.getpid())
                run.acknowledged = True
            case rules.Report(outcome=outcome):
                assert run is not None, "reported only within a round"
                if isinstance(outcome, NodeFailure):
                    self.store.report_failed(run.revision, outcome)
                else:
                    self.store.report_done(run.round, run.revision, self.node_id)
                run.reported = True  # written, or the round moved on and the report no longer matters
            case rules.CheckController(holder=holder):
                assert run is not None, "checked only after a failure in a round"
                run.controller_checked = True
                self.seat.check(holder)
            case rules.FollowDrain(request=request):
                assert run is not None, "drains belong to a round"
                self._follow_drain(run, request)
            case rules.FollowStall():
                if self._stalls is not None and self.workers is not None and run is not None:
                    if run.phase is Phase.RUNNING:
                        self._stalls.follow(self.workers.stall())
            case rules.AnswerRollCall(nonce=nonce):
                assert run is not None, "roll calls belong to a round"
                if self.store.answer_rollcall(run.round, run.revision, self.node_id, nonce):
                    run.answered_rollcall = nonce
            case _:
                assert_never(action)

    def _fence(self, silent_for: float) -> None:
        """Kill our workers now; end this incarnation once etcd answers, then rejoin as a newcomer."""
        if not self._fence_pending:
            logger.warning(
                "etcd has not confirmed this node's lease for %.1fs of its %ds: killing the workers "
                "before the job moves on without them",
                silent_for,
                self.lease.ttl,
            )
            self._fence_pending = True
            self._stop_workers(signal.SIGKILL)
        try:
            self.store.revoke(self.record.lease, deadline_s=self.config.monitor_interval)
        except Exception as exc:
            if not etcd_client.is_transient(exc):
                raise
            self.mirror.wait(self.mirror.version, self.config.monitor_interval)  # still cut off; try again
            return
        self._fence_pending = False
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

    # -- rounds ----------------------------------------------------------------------------------------------
    def enter_round(self, header: RoundHeader, revision: int) -> None:
        member = self.store.read_member(header, self.node_id, self.record.lease)
        if self.run_ is not None and self.workers is not None:
            logger.info("round %d (%s): stopping the workers of round %d", header.round, header.reason, self.run_.round)
        self._stop_workers()
        phase = Phase.STARTING if member is not None else Phase.SPARE
        self.run_ = RoundRun(header=header, revision=revision, member=member, phase=phase)
        self._stalls = StallReporter(self.store, self.node_id, header.round, revision, self._stall_writer)
        if member is None:
            logger.info(
                "round %d formed without this incarnation of node %s: waiting as a spare for the next "
                "round (at most %d nodes take part, or the round formed before it joined)",
                header.round,
                self.node_id,
                self.config.max_nodes,
            )

    def _start_workers(self, run: RoundRun, member: Member, master: MasterRecord | None) -> None:
        if master is None:  # we are group rank 0: publish where our store will listen
            master = MasterRecord(addr=member.addr, port=free_port(member.addr))
            if not self.store.publish_master(run.round, run.revision, master):
                return  # the round moved on; the next step enters the new one
        self.workers = self._worker_group(self.config, run.header, member, master, self.startups, self.warm)
        self.workers.start()
        run.phase = Phase.RUNNING
        run.refill_warm_at = rules.refill_warm_at(time.monotonic(), self.startups.longest) if self.warm else None

    def _poll_workers(self, run: RoundRun) -> None:
        outcome, failures = self.workers.poll()
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
            run.outcome = NodeFailure(node=self.node_id, round=run.round, failures=failures)
        else:
            run.outcome = rules.WorkersSucceeded()
        run.phase = Phase.FINISHED

    def _follow_drain(self, run: RoundRun, request: DrainRequest | None) -> None:
        """Pass the round's drain to our workers, withdraw it when it is gone, and answer once they drained."""
        if request is None:
            if run.drain_asked and self.workers is not None:
                logger.info("round %d: the drain was withdrawn; workers train on", run.round)
                self.workers.request_drain(0)
            run.drain_asked = 0
            return
        if run.drain_answered == request.number:
            return
        if self.workers is None or run.phase is not Phase.RUNNING:
            answer = DrainReport(number=request.number, step=None)  # no workers running: nothing to drain
        else:
            if run.drain_asked != request.number:
                logger.info(
                    "round %d: drain before %s: asking the workers to checkpoint at their next step",
                    run.round,
                    request.reason,
                )
                self.workers.request_drain(request.number)
                run.drain_asked = request.number
            pending = self.workers.drain_answer(request.number)
            if pending is None:
                return  # still saving
            answer = pending
        if self.store.report_drained(run.round, run.revision, self.node_id, answer):
            run.drain_answered = request.number
            if answer.step is not None:
                logger.info("round %d: workers drained at step %d", run.round, answer.step)

    def _stop_workers(self, signum: int = signal.SIGTERM) -> None:
        if self.workers is not None:
            self.workers.stop(signum)
            self.workers = None

    # -- leaving ---------------------------------------------------------------------------------------------
    def _rejoin(self, why: str) -> None:
        logger.warning(
            "node %s lost its membership (%s): stopping workers and rejoining as a newcomer", self.node_id, why
        )
        self.seat.stop()
        self._stop_workers()
        self.keeper.stop()
        self.run_ = None
        self._fence_pending = False  # that incarnation ends here: a pending fence would revoke the new one's lease
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
        self.seat.stop()
        try:
            self.store.leave(self.record, self.run_.round if self.run_ else None, reason)
        except Exception as exc:
            logger.warning("could not leave the membership cleanly (%s); peers will notice when the lease expires", exc)
        return 128 + signum

    def _drain_before_leaving(self) -> None:
        """Our leave notice makes the controller ask for a drain: keep the workers until it committed (at most
        --drain-timeout), so the next round redoes nothing of theirs."""
        run = self.run_
        if run is None or self.workers is None or run.phase is not Phase.RUNNING or not self.config.drain_timeout:
            return
        deadline = time.monotonic() + self.config.drain_timeout
        while time.monotonic() < deadline:
            entries, revision, seen = self.mirror.snapshot()
            view = self._parser.parse(entries, revision)
            header = view.round_header
            if view.status is not None or header is None or header.round != run.round:
                return  # the job or the round moved on
            if self.workers.poll()[0] is not WorkerOutcome.RUNNING:
                return
            self._follow_drain(run, view.drains.get(run.round))
            if run.drain_answered:
                return
            self.mirror.wait(seen, self.config.monitor_interval)
        logger.warning(
            "the workers did not drain within --drain-timeout %gs; leaving anyway (the next round redoes "
            "the steps since the last checkpoint)",
            self.config.drain_timeout,
        )

    def _give_up(self, silent_for: float) -> int:
        """etcd has not answered for longer than a node may wait to join: nothing can go on without it."""
        self._stop_workers(signal.SIGKILL)  # fenced long ago, unless they outlived that
        print(
            f"elastic-run: etcd {self.config.rdzv_endpoint or '(standalone)'} has not answered for "
            f"{silent_for:.0f}s, longer than the lease ({self.lease.ttl}s) plus join_timeout "
            f"({self.config.rdzv.join_timeout:g}s): giving up; start this node again once etcd is back",
            file=sys.stderr,
            flush=True,
        )
        return 1

    def _job_over(self, status: JobStatus) -> int:
        self.seat.finish()  # it copies the job's last events and trims them in etcd
        self._stop_workers()
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


def _job_already_over(rdzv_id: str, status: JobStatus) -> int:
    if status.state == "finished":
        print(
            f"elastic-run: job {rdzv_id} already finished; nothing to do (use a new --rdzv-id to start another)",
            file=sys.stderr,
            flush=True,
        )
        return 0
    print(
        f"elastic-run: job {rdzv_id} already failed: {status.summary.splitlines()[0]}; "
        "use a new --rdzv-id to start again",
        file=sys.stderr,
        flush=True,
    )
    return 1
