"""The per-node agent: joins the job in etcd under a lease, runs this node's workers for each round it belongs to.

What it does next is decided by the pure rules of `launcher.node.rules`; this module keeps the loop, the
lifecycle and applying the rules' actions.

Threads and what they own:
- the main thread runs `Agent.run`: it owns the current `RoundRun`, the workers, and every write an agent makes
  (but stall reports); it wakes on a change in the watched `state/ctl/` range, on a signal, when a worker exits
  or rings (`launcher.workers.wakeups`), when a silent worker's silence passes a threshold of its watchdog or a
  claim of the controller key falls due (`_wait_s`), and every `--monitor-interval` to poll its workers (which
  costs etcd nothing);
- a `WorkerWakeups` thread waits on the workers' exits and the doorbell they ring;
- a `LeaseKeeper` thread refreshes the lease; when etcd no longer has it, it wakes the main thread, which
  rejoins as a newcomer. When etcd has not confirmed the lease for most of its TTL (this node is cut off, or
  was stopped), the main thread fences itself: it kills its workers before the others can have formed a
  round without it, and once etcd answers it ends that lease and rejoins as a newcomer;
- the etcd client's watch thread applies changes to the `RangeMirror`;
- a `RoundReporter` writes stall and progress reports from a thread of its own;
- while this agent holds the controller key, a `Controller` thread decides rounds (`launcher.node.controller_seat`).
Stopping: the main thread stops the controller, the keeper and the wake-ups; all other threads are daemons.
"""

from __future__ import annotations

import logging
import os
import random
import signal
import socket
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from typing import assert_never

from elastic import node_memory
from launcher.config import LaunchConfig
from launcher.etcd import client as etcd_client
from launcher.etcd.errors import EtcdUnavailable
from launcher.etcd.lease_keeper import LeaseRoutes
from launcher.etcd.watch import RangeMirror
from launcher.node import exit_deadline, rules
from launcher.node.controller_seat import ControllerSeat
from launcher.node.incarnation import Incarnation, read_before_joining
from launcher.node.member_bucket import WatchedBucket
from launcher.node.round_reporter import RoundReporter
from launcher.node.round_workers import RoundWorkers, WorkerGroupFactory
from launcher.node.rules import Phase, RoundRun
from launcher.rendezvous.job_view import JobView, ViewParser
from launcher.rendezvous.liveness import LivenessServer
from launcher.rendezvous.membership_log import LogMirror
from launcher.rendezvous.protocol import JobStore
from launcher.rendezvous.records import (
    JobStatus,
    NodeFailure,
    RoundHeader,
)
from launcher.workers.environment import node_worker_env
from launcher.workers.group import WorkerGroup
from launcher.workers.standby import StandbyWorkers
from launcher.workers.wakeups import WorkerWakeups
from launcher.workers.warm_pool import WarmPool

logger = logging.getLogger(__name__)

_PAST_THRESHOLD_S = 0.002  # how long after a due moment the loop looks
_ETCD_WARN_AFTER_S = 2.0


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
        lease_routes: LeaseRoutes = etcd_client.LEASE_ROUTES,
    ) -> None:
        self.config = config
        self.client = client
        self.store = JobStore(client, config.rdzv_id)
        self.node_id = config.node_id
        host = etcd_client.parse_endpoints(config.rdzv_endpoint)[0][0]
        self.addr = config.local_addr or address_facing(host)
        assert config.log_dir is not None, "elastic-run picks the log dir before an agent starts"
        self.log = LogMirror.for_dir(config.log_dir)
        self._lease_routes = lease_routes
        self._me: Incarnation | None = None  # our registration under a lease (set by _join)
        self.run_: RoundRun | None = None
        self._reporter: RoundReporter | None = None
        self.signal_received: int | None = None
        self.mirror = RangeMirror(self.client, self.store.keys.ctl)  # state/ctl/, started by run
        self.bucket = WatchedBucket(self.store, config.node_id, config.max_nodes)  # started by run
        self.liveness = LivenessServer(self.addr)  # answers the controller's probes while this agent lives
        # a worker's exit or its ring wakes the loop, which otherwise looks at the workers every monitor_interval
        self.wakeups = WorkerWakeups(config.node_id, self.mirror.poke)
        self.memory_dir = node_memory.node_memory_dir(config.rdzv_id, config.node_id, os.getpid())  # workers' snapshots
        self.warm = _warm_pool(config, self.addr)
        standby = StandbyWorkers(config, self.warm) if self.warm is not None else None
        self.workers = RoundWorkers(config, self.store, self.node_id, worker_group, self.warm, standby)
        self._parser = ViewParser(self.store.keys.state, self.store.keys.ctl)
        self.seat = ControllerSeat(self.store, config, self.log, self.node_id)
        self._fence_pending = False  # our workers were killed because etcd stopped confirming our lease
        self._joined_at = time.monotonic()  # when the current incarnation registered
        self._quick_losses = 0  # incarnations in a row lost soon after they registered (rules.lost_soon)
        self._stopping = threading.Event()  # a signal: a wait before registering again ends
        # etcd writes that must not hold up the loop (a node cut off from etcd must still fence itself)
        self._writer = ThreadPoolExecutor(max_workers=1, thread_name_prefix="etcd-writer")
        self.etcd_health = EtcdHealthLog(config.rdzv_endpoint)

    # -- lifecycle -------------------------------------------------------------------------------------------
    def run(self) -> int:
        if threading.current_thread() is threading.main_thread():
            for signum in self.config.signals_to_handle:
                signal.signal(signum, self._on_signal)
        status = read_before_joining(self.config, "the job's status", self.store.read_status)
        if status is not None:
            return _job_already_over(self.config.rdzv_id, status)
        read_before_joining(self.config, "the job's state", self.mirror.start)
        read_before_joining(self.config, "this node's member bucket", self.bucket.start)
        self.liveness.start()
        node_memory.create_empty(self.memory_dir)
        node_memory.remove_abandoned(self.memory_dir.parent)
        exit_status = 1  # unless the loop decides otherwise
        try:
            prepared = 0
            if self.warm is not None:
                self.warm.fill()  # their imports overlap the rendezvous
                if self._read_view()[0].round_header is not None:
                    interrupted = lambda: self.signal_received is not None  # noqa: E731
                    self.warm.wait_before_joining(interrupted)
                    prepared = self.workers.prepare(interrupted)
            self._join(prepared)
            exit_status = self._loop()
            return exit_status
        finally:
            if threading.current_thread() is threading.main_thread():  # not an agent a bench runs in a thread
                exit_deadline.arm(exit_status, self.config.worker_stop_timeout)
            self.seat.stop()
            self.workers.stop()
            if self.warm is not None:
                self.warm.close()
            if self._me is not None:
                self._me.keeper.stop()
            self.liveness.stop()
            self.wakeups.close()
            self._writer.shutdown(wait=False, cancel_futures=True)
            self.mirror.close()
            self.bucket.close()
            node_memory.remove(self.memory_dir)
            self.sync_log()

    def stop(self, signum: int = signal.SIGTERM) -> None:
        """Ask the agent to leave the job as if it had received `signum` (what the signal handler does)."""
        if self.signal_received is None:
            self.signal_received = signum
        self._stopping.set()
        self.mirror.poke()

    def sync_log(self) -> None:
        """Copy the job's new membership events from etcd into the log directory."""
        try:
            self.log.sync(self.store.read_events)
        except Exception as exc:
            logger.debug("membership log mirror failed: %s", exc)

    # -- this incarnation: set by _join, for everything after it ---------------------------------------------
    @property
    def me(self) -> Incarnation:
        assert self._me is not None, "_join registers before anything uses the registration"
        return self._me

    def _on_signal(self, signum: int, frame) -> None:
        self.stop(signum)

    def _join(self, prepared: int = 0) -> None:
        self._me = Incarnation.register(
            self.store,
            self.config,
            self.addr,
            self.liveness,
            self.mirror.poke,
            self._lease_routes,
            prepared,
            before_new_lease=self._registration_lost,
        )
        self._joined_at = time.monotonic()
        self.seat.claim(self.me.lease.id)

    def _registration_lost(self) -> None:
        """A lease ended before its registration committed: an incarnation lost as soon as it could be."""
        self._quick_losses += 1
        self._wait_before_registering()

    def _wait_before_registering(self) -> None:
        """A random part of the rejoin spread (rules.rejoin_spread), or until a signal comes."""
        spread = rules.rejoin_spread(self.config.max_nodes, self.config.rdzv.keep_alive_interval, self._quick_losses)
        delay = random.uniform(0, spread)
        if self._quick_losses:
            logger.info(
                "registering again in %.2fs (%d incarnation(s) in a row lost soon after registering)",
                delay,
                self._quick_losses,
            )
        self._stopping.wait(delay)

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
                lease=rules.LeaseFacts(
                    silent_for=self.me.keeper.silent_for(), ttl=self.me.lease.ttl, lost=self.me.keeper.lost
                ),
                join_timeout=self.config.rdzv.join_timeout,
                fence_pending=self._fence_pending,
                workers_running=self.workers.alive,
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
            self.etcd_health.note(self.mirror.connected)
            try:
                self.step(view)
            except EtcdUnavailable as exc:
                # every action is safe to repeat: a pending report or an unstarted round is retried next time
                logger.debug("etcd call failed, retrying: %s", exc)
            self.wakeups.watch(self.workers.pids())
            self.mirror.wait(seen, self._wait_s())

    def _wait_s(self) -> float:
        """How long the loop may sleep without news: a monitor interval, less where a controller claim falls due
        or a silent worker's verdict may change (just past its threshold: a silence is judged by `>`)."""
        due = [at for at in (self.seat.claim_due(), self.workers.next_look_at()) if at is not None]
        if not due:
            return self.config.monitor_interval
        return max(0.0, min(self.config.monitor_interval, min(due) + _PAST_THRESHOLD_S - time.monotonic()))

    def step(self, view: JobView) -> None:
        """Apply the rules' actions for this view until none is left (each kind once)."""
        members = view.round_header.size if view.round_header is not None else 1
        self.seat.claim_when_free(view.controller, self.mirror.connected, members, self.me.lease.id)
        facts = rules.RoundFacts.of(view)
        done: set[type] = set()
        run = self.run_
        # the channels are read only where a step can be recorded: group rank 0's running workers
        leading = run is not None and run.member is not None and run.member.group_rank == 0
        latest_step = self.workers.latest_step() if leading else None
        while True:
            action = rules.next_action(
                facts,
                self.run_,
                now=time.monotonic(),
                workers_started=self.workers.running,
                reporting_hang=self.workers.reporting_hang(),
                done=frozenset(done),
                latest_step=latest_step,
                stalled=self.workers.stall() is not None,
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
                self.workers.start(run, run.member, master)
            case rules.PollWorkers():
                assert run is not None, "polled only within a round"
                self.workers.poll(run)
            case rules.RefillWarmPool():
                assert run is not None and self.warm is not None, "a refill time is set only with a warm pool"
                filled = self.warm.fill()
                run.refill_warm_at = None if filled else rules.refill_warm_at(time.monotonic(), filled)
            case rules.Acknowledge():
                assert run is not None and run.member is not None, "acknowledged only by a member of a round"
                group = self.workers.group
                kept = group.started_inprocess + group.started_prepared
                self.store.acknowledge(
                    run.round,
                    run.revision,
                    self.node_id,
                    os.getpid(),
                    group.started_inprocess,
                    run.member.nproc - kept,
                    group.started_prepared,
                )
                run.acknowledged = True
            case rules.Report(outcome=outcome):
                assert run is not None, "reported only within a round"
                if isinstance(outcome, NodeFailure):
                    self.store.report_failed(run.revision, outcome)
                else:
                    self.store.report_done(run.round, run.revision, self.node_id)
                run.reported = True  # written, or the round moved on and the report no longer matters
            case rules.CheckController(holder=holder, stalled=stalled):
                assert run is not None, "checked only after a failure or in a stall, in a round"
                if stalled:
                    run.controller_checked_in_stall_at = time.monotonic()
                else:
                    run.controller_checked = True
                self.seat.check(holder, stalled, self.me.record)
            case rules.FollowDrain(request=request):
                assert run is not None, "drains belong to a round"
                self.workers.follow_drain(run, request)
            case rules.FollowStall():
                if self._reporter is not None and run is not None and run.phase is Phase.RUNNING:
                    self._reporter.follow_stall(self.workers.stall())
            case rules.AnswerRollCall(nonce=nonce):
                assert run is not None, "roll calls belong to a round"
                if self.store.answer_rollcall(run.round, run.revision, self.node_id, nonce):
                    run.answered_rollcall = nonce
            case rules.RecordProgress(step=step):
                assert run is not None, "progress belongs to a round"
                assert self._reporter is not None, "a round has its reporter"
                run.progress_step, run.progress_at = step, time.monotonic()
                self._reporter.record_progress(step)
            case _:
                assert_never(action)

    def _fence(self, silent_for: float) -> None:
        """Kill our workers now; end this incarnation once etcd answers, then rejoin as a newcomer."""
        if not self._fence_pending:
            self._fence_pending = True
            killing = time.monotonic()
            self.workers.stop(signal.SIGKILL)
            # said once they are gone: whoever reads it (a test, an operator) may take it that they are
            logger.warning(
                "etcd has not confirmed this node's lease for %.1fs of its %ds: killed the workers (in %.2fs) "
                "before the job moves on without them",
                silent_for,
                self.me.lease.ttl,
                time.monotonic() - killing,
            )
        try:
            self.store.revoke(self.me.record.lease, deadline_s=self.config.monitor_interval)
        except EtcdUnavailable:
            self.mirror.wait(self.mirror.version, self.config.monitor_interval)  # still cut off; try again
            return
        self._fence_pending = False
        self._rejoin("fenced after losing touch with etcd")

    # -- rounds ----------------------------------------------------------------------------------------------
    def enter_round(self, header: RoundHeader, revision: int) -> None:
        member = self.bucket.member(header, self.me.record.lease)
        if member is None:
            self.workers.stop_round_workers()  # standby workers wait on for a round that takes this node in
        else:
            self.workers.retire()  # with --inprocess, its workers under elastic.run take the new round in process
        phase = Phase.STARTING if member is not None else Phase.SPARE
        self.run_ = RoundRun(header=header, revision=revision, member=member, phase=phase)
        self._reporter = RoundReporter(self.store, self.node_id, header.round, revision, self._writer)
        if member is None:
            logger.info(
                "round %d formed without this incarnation of node %s: waiting as a spare for the next "
                "round (at most %d nodes take part, or the round formed before it joined)",
                header.round,
                self.node_id,
                self.config.max_nodes,
            )

    # -- leaving ---------------------------------------------------------------------------------------------
    def _rejoin(self, why: str) -> None:
        logger.warning(
            "node %s lost its membership (%s): stopping workers and rejoining as a newcomer", self.node_id, why
        )
        self.seat.stop()
        self.workers.stop()
        self.me.keeper.stop()
        self.run_ = None
        self._fence_pending = False  # that incarnation ends here: a pending fence would revoke the new one's lease
        lived = time.monotonic() - self._joined_at
        self._quick_losses = self._quick_losses + 1 if rules.lost_soon(lived, self.me.lease.ttl) else 0
        self._wait_before_registering()
        self._join()

    def _leave(self, signum: int) -> int:
        """Workers that drained wait at a committed step: leave at once, so the next round forms while they stop.
        Others may still fail their peers' collectives: keep the lease while they stop, so those failures are
        not charged and no loss is logged."""
        name = signal.Signals(signum).name
        reason = f"agent received {name}"
        logger.warning("received %s: stopping workers and leaving job %s", name, self.config.rdzv_id)
        drained = False
        try:
            self.store.announce_leaving(self.node_id, self.me.record.lease, reason)
            drained = self.workers.drain_before_leaving(self.run_, self._read_view, self.mirror.wait)
        except Exception as exc:
            logger.warning("could not announce leaving (%s); stopping workers anyway", exc)
        if not drained:
            self.workers.stop(signum)  # forwarded as-is, SIGKILL after the grace period
        self.seat.stop()
        try:
            self.store.leave(self.me.record, self.run_.round if self.run_ else None, reason)
        except Exception as exc:
            logger.warning("could not leave the membership cleanly (%s); peers will notice when the lease expires", exc)
        if drained:
            self.workers.stop(signum)
        return 128 + signum

    def _read_view(self) -> tuple[JobView, int]:
        entries, revision, seen = self.mirror.snapshot()
        return self._parser.parse(entries, revision), seen

    def _give_up(self, silent_for: float) -> int:
        """etcd has not answered for longer than a node may wait to join: nothing can go on without it."""
        self.workers.stop(signal.SIGKILL)  # fenced long ago, unless they outlived that
        print(_etcd_gone(self.config, silent_for, self.me.lease.ttl), file=sys.stderr, flush=True)
        return 1

    def _job_over(self, status: JobStatus) -> int:
        self.seat.finish()  # it copies the job's last events and trims them in etcd
        self.workers.stop()
        self.me.keeper.stop()
        try:
            self.store.revoke(self.me.record.lease)
        except Exception as exc:
            logger.debug("lease revoke failed: %s", exc)
        if status.state == "finished":
            logger.info("%s", status.summary)
            return 0
        print(f"elastic-run: {status.summary}", file=sys.stderr, flush=True)
        return 1


class EtcdHealthLog:
    """Warns every few seconds while etcd is unreachable: the workers keep running meanwhile."""

    def __init__(self, endpoint: str) -> None:
        self.endpoint = endpoint
        self._down_since: float | None = None
        self._warned_at = 0.0

    def note(self, connected: bool) -> None:
        now = time.monotonic()
        if connected:
            self._down_since = None
            return
        self._down_since = self._down_since or now
        if now - self._down_since >= _ETCD_WARN_AFTER_S and now - self._warned_at >= _ETCD_WARN_AFTER_S:
            logger.warning("etcd %s unreachable for %.0fs; workers keep running", self.endpoint, now - self._down_since)
            self._warned_at = now


def _warm_pool(config: LaunchConfig, addr: str) -> WarmPool | None:
    """The next round's workers, pre-started with torch imported (None: every worker starts cold)."""
    if not config.starts_warm:
        return None
    return WarmPool(
        node_worker_env(addr, config.nproc_per_node), config.nproc_per_node, [config.entrypoint, *config.args]
    )


def _etcd_gone(config: LaunchConfig, silent_for: float, ttl: int) -> str:
    return (
        f"elastic-run: etcd {config.rdzv_endpoint or '(standalone)'} has not answered for {silent_for:.0f}s, "
        f"longer than the lease ({ttl}s) plus join_timeout ({config.rdzv.join_timeout:g}s): giving up; "
        "start this node again once etcd is back"
    )


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
