"""This node's workers in the current round, as the agent drives them: start, poll, drain, stop."""

from __future__ import annotations

import logging
import signal
import time
from collections.abc import Callable
from typing import Any

from launcher.config import LaunchConfig
from launcher.etcd.server import free_port
from launcher.node import rules
from launcher.node.rules import Phase, RoundRun
from launcher.rendezvous.job_view import JobView
from launcher.rendezvous.protocol import JobStore
from launcher.rendezvous.records import DrainReport, DrainRequest, MasterRecord, Member, NodeFailure, RoundHeader
from launcher.workers.group import WorkerOutcome
from launcher.workers.standby import StandbyWorkers
from launcher.workers.warm_pool import WarmPool
from launcher.workers.watchdog_rules import NodeHistory, Stall
from launcher.workers.zygote import RoundStore

logger = logging.getLogger(__name__)

# builds a round's workers: (config, round, member, master, node history, warm pool) -> a WorkerGroup
WorkerGroupFactory = Callable[[LaunchConfig, RoundHeader, Member, MasterRecord, NodeHistory, WarmPool | None], Any]


class RoundWorkers:
    """Holds the WorkerGroup of the round this node runs (None between rounds) and writes what it says to etcd."""

    def __init__(
        self,
        config: LaunchConfig,
        store: JobStore,
        node_id: str,
        factory: WorkerGroupFactory,
        warm: WarmPool | None,
        standby: StandbyWorkers | None = None,
    ) -> None:
        self.config = config
        self.store = store
        self.node_id = node_id
        self.factory = factory
        self.warm = warm
        self.history = NodeHistory()  # our workers' start-ups and step pace, over rounds
        self.group: Any = None
        # the last round's group, kept between rounds with --inprocess: its workers under elastic.run take the
        # next round in process; the rest are stopped when it is retired
        self.retired: Any = None
        self.torch_store: RoundStore | None = None  # the round's TCPStore, when this node serves it
        self.standby = standby  # workers waiting in elastic.run for a round (none with --no-warm-workers)

    @property
    def running(self) -> bool:
        return self.group is not None

    @property
    def alive(self) -> bool:
        """Whether this node holds workers, of this round or kept for the next one."""
        return self.group is not None or self.retired is not None

    def prepare(self, interrupted: Callable[[], bool]) -> int:
        """Before joining a job that trains: start this node's standby workers and wait until each is ready
        (launcher.workers.standby), at most --rdzv-conf join_timeout; how many are (0: the ranks start with the
        round)."""
        started = time.monotonic()
        if self.standby is None or not self._fill_standby():
            return 0
        why_not = self.standby.wait_ready(self.config.rdzv.join_timeout, interrupted)
        if why_not is not None:
            logger.info("the standby workers are not ready (%s): this node's ranks start with their round", why_not)
            return 0
        logger.info(
            "%d worker(s) ready in standby (pids %s) %.2fs after their start: joining",
            len(self.standby.workers),
            ", ".join(map(str, self.standby.pids())),
            time.monotonic() - started,
        )
        return len(self.standby.workers)

    def keep_standby(self) -> None:
        """Once this round's workers train under `elastic.run`, give each local rank a standby worker: started
        after the round's start-up, not during it, and only for a script that showed it calls `elastic.run`."""
        if self.standby is None or self.standby.unusable is not None or self.group is None:
            return
        if len(self.standby.workers) < self.config.nproc_per_node and self.group.trains_under_elastic_run():
            self._fill_standby()
        if self.standby.newly_ready():
            logger.info(
                "round %d: %d standby worker(s) ready (pids %s): a rank that fails takes one instead of a new process",
                self.group.round.round,
                len(self.standby.workers),
                ", ".join(map(str, self.standby.pids())),
            )

    def _fill_standby(self) -> bool:
        """Start the standby workers the node lacks, and fork the warm workers they took; False when there are
        none to start (the script cannot wait in standby, or the zygote still imports: no standby worker waits
        for its imports)."""
        assert self.standby is not None and self.warm is not None, "standby workers come with a warm pool"
        if self.standby.unusable is not None or not self.warm.fill():
            return False
        self.standby.fill()
        self.warm.fill()  # the forks the standby workers took
        return True

    def retire(self) -> None:
        """This round's workers are done with it: keep those that can take the next one in process, stop the rest."""
        if self.group is not None:
            self.group.keep_pace()
        if not self.config.inprocess:
            self.stop()
            return
        if self.group is not None:
            self.stop_retired()
            self.group.stop_all_but_reentrant()  # at once, as without --inprocess: they take no part any more
            self.retired, self.group = self.group, None

    def pids(self) -> list[int]:
        """The processes of this round's workers and of those kept for the next one (their supervisors)."""
        return [pid for group in (self.group, self.retired) if group is not None for pid in group.pids()]

    def next_look_at(self) -> float | None:
        """When (time.monotonic()) this round's watchdog wants its workers looked at next (None: nothing due)."""
        return self.group.next_look_at() if self.group is not None else None

    def reporting_hang(self) -> bool:
        """Our watchdog is killing a hung worker: the roll call is answered with that failure, not before it."""
        return self.group is not None and self.group.reporting_hang()

    def stall(self) -> Stall | None:
        return self.group.stall() if self.group is not None else None

    def latest_step(self) -> int | None:
        return self.group.latest_step() if self.group is not None else None

    def start(self, run: RoundRun, member: Member, master: MasterRecord | None) -> None:
        torch_store = None
        if master is None:  # we are group rank 0: serve the round's store, or publish where rank 0 will
            torch_store = self.warm.serve_store(member.addr, run.header.world_size) if self.warm is not None else None
            port = torch_store.port if torch_store is not None else free_port(member.addr)
            master = MasterRecord(addr=member.addr, port=port, agent_store=torch_store is not None)
            if not self.store.publish_master(run.round, run.revision, master):
                if torch_store is not None:
                    torch_store.close()
                return  # the round moved on; the next step enters the new one
        self.group = self.factory(self.config, run.header, member, master, self.history, self.warm)
        self.group.start(self.retired, self.standby)
        self.retired = None
        self._close_torch_store()  # the last round's: its workers are stopped or took this round
        self.torch_store = torch_store
        run.phase = Phase.RUNNING
        run.refill_warm_at = rules.refill_warm_at(time.monotonic()) if self.warm else None

    def poll(self, run: RoundRun) -> None:
        """Note how the workers ended, if they did: the next step reports it."""
        outcome, failures = self.group.poll()
        if outcome is WorkerOutcome.RUNNING:
            self.keep_standby()
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
                if self.group.processes[failure.local_rank].poll() is None:  # raised; under elastic.run it waits
                    logger.error(
                        "round %d: worker local_rank %d (rank %d) raised: %s",
                        failure.round,
                        failure.local_rank,
                        failure.rank,
                        (failure.message or "an uncaught exception").splitlines()[0][:200],
                    )
                    continue
                logger.error(
                    "round %d: worker local_rank %d (rank %d) failed with exit code %d",
                    failure.round,
                    failure.local_rank,
                    failure.rank,
                    failure.exit_code,
                )
            # peers of a failed worker usually hang in their next collective: they stop, but for those under
            # elastic.run, which wait for the next round (with --inprocess)
            self.retire()
            run.outcome = NodeFailure(node=self.node_id, round=run.round, failures=failures)
        else:
            run.outcome = rules.WorkersSucceeded()
        run.phase = Phase.FINISHED

    def follow_drain(self, run: RoundRun, request: DrainRequest | None) -> None:
        """Pass the round's drain to our workers, withdraw it when it is gone, and answer once they drained."""
        if request is None:
            if run.drain_asked and self.group is not None:
                logger.info("round %d: the drain was withdrawn; workers train on", run.round)
                self.group.request_drain(0)
            run.drain_asked = 0
            return
        if run.drain_answered == request.number:
            return
        if self.group is None or run.phase is not Phase.RUNNING:
            answer = DrainReport(number=request.number, step=None)  # no workers running: nothing to drain
        else:
            if run.drain_asked != request.number:
                logger.info(
                    "round %d: drain before %s: asking the workers to checkpoint at their next step",
                    run.round,
                    request.reason,
                )
                self.group.request_drain(request.number, in_memory=request.in_memory)
                run.drain_asked = request.number
            pending = self.group.drain_answer(request.number)
            why = self.group.why_no_drain() if pending is None else None
            if pending is None and why is None:
                return  # still saving
            if why is not None:
                logger.warning(
                    "round %d: the workers cannot drain (%s): answering without a checkpoint", run.round, why
                )
            answer = pending if pending is not None else DrainReport(number=request.number, step=None)
        if self.store.report_drained(run.round, run.revision, self.node_id, answer):
            run.drain_answered = request.number
            run.drained_step = answer.step
            if answer.step is not None:
                logger.info("round %d: workers drained at step %d", run.round, answer.step)

    def drain_before_leaving(
        self, run: RoundRun | None, read_view: Callable[[], tuple[JobView, int]], wait: Callable[[int, float], Any]
    ) -> bool:
        """Our leave notice makes the controller ask for a drain: keep the workers until it committed (at most
        --drain-timeout), so the next round redoes nothing of theirs. True: they committed a step and wait at
        that step boundary, where nothing they do or fail to do matters to the next round."""
        if run is None or self.group is None or run.phase is not Phase.RUNNING or not self.config.drain_timeout:
            return False
        deadline = time.monotonic() + self.config.drain_timeout
        while time.monotonic() < deadline:
            view, seen = read_view()
            header = view.round_header
            if view.status is not None or header is None or header.round != run.round:
                return False  # the job or the round moved on
            if self.group is None or self.group.poll()[0] is not WorkerOutcome.RUNNING:
                return False
            self.follow_drain(run, view.drains.get(run.round))
            if run.drain_answered:
                return run.drained_step is not None
            wait(seen, self.config.monitor_interval)
        logger.warning(
            "the workers did not drain within --drain-timeout %gs; leaving anyway (the next round redoes "
            "the steps since the last checkpoint)",
            self.config.drain_timeout,
        )
        return False

    def stop(self, signum: int = signal.SIGTERM) -> None:
        self.stop_round_workers(signum)
        if self.standby is not None:
            self.standby.stop(signum)

    def stop_round_workers(self, signum: int = signal.SIGTERM) -> None:
        """Stop the workers of this node's rounds; standby workers wait on for a round that needs them."""
        self.stop_retired(signum)
        if self.group is not None:
            self.group.stop(signum)
            self.group = None
        self._close_torch_store()

    def _close_torch_store(self) -> None:
        if self.torch_store is not None:
            self.torch_store.close()
            self.torch_store = None

    def stop_retired(self, signum: int = signal.SIGTERM) -> None:
        if self.retired is not None:
            self.retired.stop(signum)
            self.retired = None
