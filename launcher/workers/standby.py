"""Workers started before the round they will train in: a joining node is ready when it asks for room, and a
replaced rank enters its round as a survivor does.

A standby worker is a warm worker launched with the round-free part of the worker environment and
`ELASTIC_STANDBY` (`standby_env`: no rank, world or master yet). The script runs up to `elastic.run`, which says
ready over the worker's round socket and waits. A round reaches it as a new round reaches survivors, as an offer
over the round socket (`WorkerGroup.start(..., standby=...)`), and it enters `main`. The agent keeps one per local
rank, started once a round's workers train under `elastic.run` (off the critical path of the round's start-up,
and only for a script that has shown it calls `elastic.run`) and when a node joins:

- an agent joining a job that already trains registers once its standby workers are ready (at most the join
  timeout), so the controller asks the trainers to drain only then, and the node's ranks enter `main` without
  running the script's imports and set-up inside the pause; a spare waits the same way;
- a rank whose worker crashed, hung or could not re-enter takes its standby worker instead of a new process.

Only a script whose source calls `elastic.run` (`calls_elastic_run`) has standby workers, and only with warm
workers and in-process rounds. When one exits before it is ready (the script read `RANK` at its top level, or
failed), the agent stops using them, says why once, and starts ranks as before. Standby output goes to
`<log dir>/<node>/standby/<local rank>/{stdout,stderr}.log`; from its first round on, a worker writes where that
round's workers write.
"""

from __future__ import annotations

import logging
import select
import signal
import subprocess
import time
from collections.abc import Callable
from dataclasses import dataclass

from elastic.rounds import READY_MESSAGE, ROUND_FD_ENV
from launcher.config import LaunchConfig
from launcher.workers.environment import standby_env
from launcher.workers.process_tree import WorkerProcess, stop_group, worker_under
from launcher.workers.round_link import RoundLink
from launcher.workers.warm_interpreter import MAX_MESSAGE_BYTES, STANDBY_NAME, calls_elastic_run
from launcher.workers.warm_pool import WarmPool

logger = logging.getLogger(__name__)

POLL_S = 0.1  # how often a wait for readiness looks at exits and interruptions
EXIT_WAIT_S = 2.0  # a worker whose round socket closed is exiting: how long to wait for its exit code


@dataclass
class StandbyWorker:
    process: WorkerProcess  # its supervisor
    link: RoundLink
    ready: bool = False


class StandbyWorkers:
    """This node's standby workers, at most one per local rank."""

    def __init__(self, config: LaunchConfig, warm: WarmPool) -> None:
        assert config.log_dir is not None, "elastic-run picks the log dir before the agent starts"
        self.config = config
        self.warm = warm  # its environment is the node's part of the worker environment (node_worker_env)
        self.log_dir = config.log_dir / config.node_id / "standby"
        self.workers: dict[int, StandbyWorker] = {}
        # why the script cannot wait in standby (None: it can, as far as we know)
        self.unusable: str | None = None
        if not (config.inprocess and config.starts_warm and calls_elastic_run(config.entrypoint)):
            self.unusable = "the script does not call elastic.run"

    def fill(self) -> None:
        """Start a standby worker for every local rank that has none (a no-op once the script proved unable)."""
        for local_rank in range(self.config.nproc_per_node):
            if self.unusable is None and local_rank not in self.workers:
                self._start(local_rank)

    def _start(self, local_rank: int) -> None:
        worker = self.warm.take(local_rank, self.warm.env)
        if worker is None:
            return  # the warm pool said why; the rank starts warm or cold with its round
        link = RoundLink.pair()
        directory = self.log_dir / str(local_rank)
        directory.mkdir(parents=True, exist_ok=True)
        with open(directory / "stdout.log", "ab") as out, open(directory / "stderr.log", "ab") as err:
            launched = worker.launch(
                standby_env(self.config, self.warm.env, local_rank),
                [self.config.entrypoint, *self.config.args],
                out.fileno(),
                err.fileno(),
                extra_fds={ROUND_FD_ENV: link.worker_fd},
                name=STANDBY_NAME,  # no worker of a round yet, for `ps` and `process_tree.child_pids`
            )
        link.started()
        if launched:
            self.workers[local_rank] = StandbyWorker(worker.process, link)
        else:
            link.close()

    def all_ready(self) -> bool:
        return len(self.workers) == self.config.nproc_per_node and all(w.ready for w in self.workers.values())

    def newly_ready(self) -> bool:
        """Take in what the workers said, without waiting; True when that made every local rank's worker ready."""
        before = self.all_ready()
        self._read(0.0)
        return not before and self.all_ready()

    def wait_ready(self, timeout_s: float, interrupted: Callable[[], bool]) -> str | None:
        """Wait until every local rank's worker said it is ready; None once they all did, else why not (one
        exited first, the time ran out, or `interrupted()`)."""
        deadline = time.monotonic() + timeout_s
        while True:
            self._read(POLL_S)
            if self.unusable is not None:
                return self.unusable
            if len(self.workers) < self.config.nproc_per_node:
                return "not every local rank has a standby worker"
            if self.all_ready():
                return None
            if interrupted():
                return "interrupted"
            if time.monotonic() >= deadline:
                return f"not all ready within {timeout_s:g}s"

    def _read(self, timeout_s: float) -> None:
        """Take in what the workers said within `timeout_s`: ready, or gone (their socket closed)."""
        waiting = {w.link.control.fileno(): r for r, w in self.workers.items() if not w.ready}
        if not waiting:
            return
        readable, _, _ = select.select(list(waiting), [], [], timeout_s)
        for fd in readable:
            local_rank = waiting[fd]
            worker = self.workers[local_rank]
            try:
                message = worker.link.control.recv(MAX_MESSAGE_BYTES)
            except OSError:
                message = b""
            if message == READY_MESSAGE:
                worker.ready = True
                continue
            del self.workers[local_rank]
            worker.link.close()
            self.unusable = self._exited_before_ready(local_rank, worker.process)
            logger.warning("standby workers are off, ranks start with their round: %s", self.unusable)
            self.stop()
            return

    def _exited_before_ready(self, local_rank: int, process: WorkerProcess) -> str:
        try:
            process.wait(EXIT_WAIT_S)
        except subprocess.TimeoutExpired:  # still running with its round socket closed: stopped with the others
            stop_group([process], 0.0, signal.SIGKILL)
        return (
            f"local rank {local_rank} exited ({process.returncode}) before it reached elastic.run; see "
            f"{self.log_dir / str(local_rank) / 'stderr.log'}"
        )

    def pids(self) -> list[int]:
        """The workers' pids, which the training shows (each runs under a supervisor)."""
        return [worker_under(w.process.pid) for w in self.workers.values()]

    def hand_over(self, local_rank: int, offer: Callable[[RoundLink], bool]) -> tuple[WorkerProcess, RoundLink] | None:
        """The standby worker of `local_rank` and its round socket, once `offer` handed it its round (None: there
        is none that is ready and alive)."""
        self._read(0.0)
        worker = self.workers.get(local_rank)
        if worker is None or not worker.ready:
            return None
        del self.workers[local_rank]
        if worker.process.poll() is not None or not offer(worker.link):
            stop_group([worker.process], 0.0, signal.SIGKILL)
            worker.link.close()
            return None
        return worker.process, worker.link

    def stop(self, signum: int = signal.SIGTERM) -> None:
        """Stop every standby worker."""
        workers, self.workers = list(self.workers.values()), {}
        stop_group([w.process for w in workers], self.config.worker_stop_timeout, signum)
        for worker in workers:
            worker.link.close()
