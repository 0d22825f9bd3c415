"""Workers started before their node's first round, so that a node joining a training job is ready when it asks
for room.

An agent that joins a job already training (a replacement, a scale-up, a spare) starts each local rank in a warm
worker before it registers, with the round-free part of the worker environment and `ELASTIC_STANDBY`
(`standby_env`: no rank, world or master yet). The script runs to `elastic.run`, which says ready over the
worker's round socket and waits. The agent registers once every worker is ready, so the controller asks the
trainers to drain only then. The round that takes the node in reaches the standby workers as a new round reaches
survivors, as an offer over the round socket (`WorkerGroup.start(previous=standby)`), and they enter `main`.

Only a script that calls `elastic.run` (`calls_elastic_run`) starts in standby, and only with warm workers and
in-process rounds. If a worker exits before it is ready (the script read `RANK` at its top level, or failed), or
the workers are not ready within the join timeout, the node joins as before: its ranks start with the round.
Standby output goes to `<log dir>/<node>/standby/<local rank>/{stdout,stderr}.log`; from its first round on, a
worker writes where that round's workers write.
"""

from __future__ import annotations

import logging
import select
import signal
import subprocess
import time
from collections.abc import Callable
from pathlib import Path

from elastic.rounds import READY_MESSAGE, ROUND_FD_ENV
from launcher.config import LaunchConfig
from launcher.workers.environment import node_worker_env, standby_env
from launcher.workers.process_tree import WorkerProcess, own_children, stop_group
from launcher.workers.round_link import RoundLink
from launcher.workers.warm_interpreter import MAX_MESSAGE_BYTES, calls_elastic_run
from launcher.workers.warm_pool import WarmPool

logger = logging.getLogger(__name__)

POLL_S = 0.1  # how often a wait for readiness looks at exits and interruptions
EXIT_WAIT_S = 2.0  # a worker whose round socket closed is exiting: how long to wait for its exit code


class StandbyWorkers:
    """This node's standby workers, one per local rank, each with its round socket."""

    def __init__(self, processes: list[WorkerProcess], links: list[RoundLink], log_dir: Path, grace_s: float) -> None:
        self.processes = processes
        self.links = links
        self.log_dir = log_dir
        self.grace_s = grace_s
        self.ready: set[int] = set()
        self._handed_over: set[int] = set()

    @classmethod
    def start(cls, config: LaunchConfig, warm: WarmPool, addr: str) -> StandbyWorkers | None:
        """Start the node's ranks in standby (None: the script does not call `elastic.run`, or a warm worker
        could not be had; the node joins as before)."""
        if not (config.inprocess and config.starts_warm and calls_elastic_run(config.entrypoint)):
            return None
        assert config.log_dir is not None, "elastic-run picks the log dir before the agent starts"
        log_dir = config.log_dir / config.node_id / "standby"
        node_env = node_worker_env(addr, config.nproc_per_node)
        standby = cls([], [], log_dir, config.worker_stop_timeout)
        for local_rank in range(config.nproc_per_node):
            worker = warm.take(local_rank, node_env)
            link = RoundLink.pair()
            directory = log_dir / str(local_rank)
            directory.mkdir(parents=True, exist_ok=True)
            with open(directory / "stdout.log", "ab") as out, open(directory / "stderr.log", "ab") as err:
                launched = worker is not None and worker.launch(
                    standby_env(config, node_env, local_rank),
                    [config.entrypoint, *config.args],
                    out.fileno(),
                    err.fileno(),
                    extra_fds={ROUND_FD_ENV: link.worker_fd},
                )
            link.started()
            if worker is None or not launched:
                link.close()
                logger.info("local rank %d has no warm worker: this node's ranks start with their round", local_rank)
                standby.stop()
                return None
            standby.processes.append(worker.process)
            standby.links.append(link)
        return standby

    def wait_ready(self, timeout_s: float, interrupted: Callable[[], bool]) -> str | None:
        """Wait until every worker said it is ready; None once they all did, else why not (one exited first, the
        time ran out, or `interrupted()`)."""
        deadline = time.monotonic() + timeout_s
        while len(self.ready) < len(self.links):
            waiting = {self.links[r].control.fileno(): r for r in range(len(self.links)) if r not in self.ready}
            readable, _, _ = select.select(list(waiting), [], [], POLL_S)
            for fd in readable:
                local_rank = waiting[fd]
                try:
                    message = self.links[local_rank].control.recv(MAX_MESSAGE_BYTES)
                except OSError:
                    message = b""
                if message != READY_MESSAGE:
                    return self._exited_before_ready(local_rank)
                self.ready.add(local_rank)
            if interrupted():
                return "interrupted"
            if time.monotonic() >= deadline:
                return f"not all ready within {timeout_s:g}s"
        return None

    def _exited_before_ready(self, local_rank: int) -> str:
        process = self.processes[local_rank]
        try:
            process.wait(EXIT_WAIT_S)
        except subprocess.TimeoutExpired:  # still running with its round socket closed: stopped with the others
            pass
        return (
            f"local rank {local_rank} exited ({process.returncode}) before it reached elastic.run; see "
            f"{self.log_dir / str(local_rank) / 'stderr.log'}"
        )

    def pids(self) -> list[int]:
        """The workers' pids, which the training shows (each runs under a supervisor, `self.processes`)."""
        return [next(iter(own_children(process.pid)), process.pid) for process in self.processes]

    def hand_over(self, local_rank: int, offer: Callable[[RoundLink], bool]) -> tuple[WorkerProcess, RoundLink] | None:
        """The standby worker of `local_rank` and its round socket, once `offer` handed it its first round (None:
        it is not ready, or gone; `release` stops it)."""
        if local_rank not in self.ready or self.processes[local_rank].poll() is not None:
            return None
        if not offer(self.links[local_rank]):
            return None
        self._handed_over.add(local_rank)
        return self.processes[local_rank], self.links[local_rank]

    def release(self) -> None:
        """The round took over what it could: stop the rest."""
        self.stop()

    def stop(self, signum: int = signal.SIGTERM) -> None:
        """Stop the workers no round took over."""
        local_ranks = [r for r in range(len(self.processes)) if r not in self._handed_over]
        stop_group([self.processes[r] for r in local_ranks], self.grace_s, signum)
        for local_rank in local_ranks:
            self.links[local_rank].close()
