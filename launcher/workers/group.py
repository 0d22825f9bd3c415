"""One node's workers for one round: started (cold or warm), polled for their outcome and failures, stopped."""

from __future__ import annotations

import enum
import json
import logging
import os
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from pathlib import Path

from elastic import channel
from elastic.rounds import ROUND_FD_ENV, UNWIND_STUCK_EXIT
from launcher.config import LaunchConfig
from launcher.rendezvous.records import DrainReport, MasterRecord, Member, RoundHeader, WorkerFailure
from launcher.workers import failure_evidence
from launcher.workers.environment import ERROR_FILE, HEARTBEAT_FILE, node_worker_env, worker_env
from launcher.workers.output import STREAMS, StreamRoute, WorkerOutput
from launcher.workers.process_tree import WorkerProcess, stop_group, supervised_command, worker_under
from launcher.workers.round_link import RoundLink
from launcher.workers.stack_dumps import read_dump
from launcher.workers.standby import StandbyWorkers
from launcher.workers.warm_pool import WarmPool, WarmWorker
from launcher.workers.watchdog import StackDump, Watchdog
from launcher.workers.watchdog_rules import NodeHistory, Policy, Stall

logger = logging.getLogger(__name__)

UNCAUGHT_EXCEPTION_EXIT = 1  # what Python exits with after an uncaught exception


def _exit_code(process: WorkerProcess) -> int:
    """The worker's exit code; for one still tearing down after an uncaught exception, the 1 it will exit with."""
    return UNCAUGHT_EXCEPTION_EXIT if process.returncode is None else process.returncode


def read_error_file(path: Path) -> tuple[str, str, float | None]:
    """(message, traceback, time written) from torch's @record error file; empty when there is none."""
    try:
        data = json.loads(path.read_text())
        written = path.stat().st_mtime
    except (OSError, ValueError):
        return "", "", None
    message = data.get("message", {})
    if isinstance(message, str):
        return message, "", written
    extra = message.get("extraInfo", {})
    return str(message.get("message", "")), str(extra.get("py_callstack", "")), written


class WorkerOutcome(enum.Enum):
    RUNNING = "running"
    FAILED = "failed"  # at least one worker exited non-zero
    SUCCEEDED = "succeeded"  # every worker exited 0


class WorkerGroup:
    """The local workers of one round, each in its own process group so its whole tree can be stopped."""

    def __init__(
        self,
        config: LaunchConfig,
        round_: RoundHeader,
        member: Member,
        master: MasterRecord,
        history: NodeHistory | None = None,
        warm: WarmPool | None = None,
    ) -> None:
        self.config = config
        self.warm = warm
        self.started_inprocess = 0  # how many of the workers were handed this round in process
        self.started_warm = 0  # how many of the workers started in a warm worker forked from the zygote
        self.started_prepared = 0  # how many took this round as their first, started in standby before it
        self.round = round_
        self.member = member
        self.master = master
        assert config.log_dir is not None, "elastic-run picks the log dir before workers start"
        self.attempt_dir = config.log_dir / config.node_id / f"attempt_{round_.round}"
        self.processes: list[WorkerProcess] = []
        self.output = WorkerOutput(config, self.attempt_dir, member.first_rank)
        # what the zygote must have been started with for its warm workers to serve this round
        self._node_env = node_worker_env(member.addr, member.nproc)
        self.round_links: dict[int, RoundLink] = {}  # local rank -> its worker's round socket (with --inprocess)
        # local ranks handed this round in process, until the worker opens this round's channel: by when it must
        self.reentering: dict[int, float] = {}
        self._handed_over: set[int] = set()  # local ranks whose worker the next round took over
        self._dumps: dict[int, StackDump] = {}  # local ranks whose worker did not re-enter in time: stacks asked
        # local ranks handed this round in process -> the directory of the round their worker left (its channel
        # and stack dump stay there until it opens this round's)
        self._left_dirs: dict[int, Path] = {}
        self._dumps_shown: set[int] = set()  # local ranks whose stack dump was copied where their stderr goes
        self._exited_at: dict[int, float] = {}
        # workers that wrote their error file (torch's @record: an uncaught exception) but have not exited yet:
        # their interpreter's teardown takes 0.4-0.8 s with torch loaded, and a peer waiting on them fails only
        # once they exit, so waiting for every exit would chain those delays across the job
        self._raised: set[int] = set()
        # heartbeat channels exist before the workers start (or, with the watchdog off, stale ones are gone)
        self.watchdog = Watchdog(
            Policy.from_config(config),
            [self.attempt_dir / str(r) / HEARTBEAT_FILE for r in range(member.nproc)],
            history=history,
            spare_reentrant=config.inprocess,
            store=(master.addr, master.port),
        )

    def start(self, previous: WorkerGroup | None = None, standby: StandbyWorkers | None = None) -> None:
        """Start the round's workers: each local rank takes the worker `previous` hands over in process (it runs
        under `elastic.run`), else its standby worker, else a warm worker, else a new one. What `previous` keeps
        is stopped."""
        for local_rank in range(self.member.nproc):
            self.processes.append(self._launch(local_rank, previous, standby))
        if previous is not None:
            previous.release()
        logger.info(
            "round %d: started %d worker(s) (%d re-entering in process, %d prepared in standby, %d warm), ranks "
            "%d-%d of %d, logs in %s",
            self.round.round,
            self.member.nproc,
            self.started_inprocess,
            self.started_prepared,
            self.started_warm,
            self.member.first_rank,
            self.member.last_rank,
            self.round.world_size,
            self.attempt_dir,
        )

    def _launch(
        self, local_rank: int, previous: WorkerGroup | None, standby: StandbyWorkers | None = None
    ) -> WorkerProcess:
        directory = self.attempt_dir / str(local_rank)
        directory.mkdir(parents=True, exist_ok=True)
        error_file = directory / ERROR_FILE
        error_file.unlink(missing_ok=True)
        env = worker_env(self.config, self.round, self.member, self.master, local_rank, error_file)
        routes = {name: self.output.route(directory, local_rank, name) for name in STREAMS}
        offer = lambda link: self._offer(link, env, routes)  # noqa: E731
        handed = previous.hand_over(local_rank, offer) if previous else None
        if handed is not None:
            self.started_inprocess += 1
        elif standby is not None and (handed := standby.hand_over(local_rank, offer)) is not None:
            self.started_prepared += 1
        process: WorkerProcess
        if handed is not None:
            process, self.round_links[local_rank] = handed
            self.reentering[local_rank] = time.monotonic() + self.config.inprocess_timeout
            if previous is not None:
                self._left_dirs[local_rank] = previous.attempt_dir / str(local_rank)
        else:
            link = RoundLink.pair() if self.config.inprocess else None
            warm = self.warm.take(local_rank, self._node_env) if self.warm is not None else None
            if warm is not None and self._launch_warm(warm, env, routes, link):
                process = warm.process
                self.started_warm += 1
            else:
                process = self._launch_cold(env, routes, link)
            if link is not None:
                link.started()
                self.round_links[local_rank] = link
        for route in routes.values():
            if route.log_file is not None and route.target is not subprocess.PIPE:
                route.log_file.close()  # the child holds its own descriptor
        return process

    def _launch_cold(
        self, env: dict[str, str], routes: dict[str, StreamRoute], link: RoundLink | None
    ) -> subprocess.Popen:
        pass_fds: tuple[int, ...] = ()
        if link is not None:
            env = dict(env, **{ROUND_FD_ENV: str(link.worker_fd)})
            pass_fds = (link.worker_fd,)
        process = subprocess.Popen(
            supervised_command(self.config.worker_command()),
            env=env,
            start_new_session=True,
            stdin=subprocess.DEVNULL,
            stdout=routes["stdout"].target,
            stderr=routes["stderr"].target,
            pass_fds=pass_fds,
        )
        for name, route in routes.items():
            if route.target is subprocess.PIPE:
                self.output.pump(getattr(process, name), route)
        return process

    def _launch_warm(
        self, warm: WarmWorker, env: dict[str, str], routes: dict[str, StreamRoute], link: RoundLink | None
    ) -> bool:
        """Hand the round to a warm worker: stdio as a cold worker's (pipes the agent pumps, log files, or
        the agent's own console), the script and its arguments as `python -u script args` would have them."""
        fds, pumped = self._stdio(routes)
        extra = {ROUND_FD_ENV: link.worker_fd} if link is not None else {}
        launched = warm.launch(env, [self.config.entrypoint, *self.config.args], fds[0], fds[1], extra_fds=extra)
        self._pump(pumped, launched)
        return launched

    def _offer(self, link: RoundLink, env: dict[str, str], routes: dict[str, StreamRoute]) -> bool:
        """Hand this round to a worker of the previous round that takes rounds in process."""
        fds, pumped = self._stdio(routes)
        offered = link.offer(env, *fds)
        self._pump(pumped, offered)
        return offered

    def _stdio(self, routes: dict[str, StreamRoute]) -> tuple[list[int], list[tuple[int, int, StreamRoute]]]:
        """A worker's stdout and stderr descriptors for `routes`, and the pipes the agent pumps among them."""
        fds, pumped = [], []
        for name, route in routes.items():
            if route.target is subprocess.PIPE:
                read_end, write_end = os.pipe()
                fds.append(write_end)
                pumped.append((read_end, write_end, route))
            elif route.target is None:
                fds.append(sys.stdout.fileno() if name == "stdout" else sys.stderr.fileno())
            else:
                assert not isinstance(route.target, int), "subprocess.PIPE is the only descriptor number a route holds"
                fds.append(route.target.fileno())
        return fds, pumped

    def _pump(self, pumped: list[tuple[int, int, StreamRoute]], sent: bool) -> None:
        for read_end, write_end, route in pumped:
            os.close(write_end)  # the worker holds its own copy
            if sent:
                self.output.pump(os.fdopen(read_end, "rb"), route)
            else:
                os.close(read_end)

    def poll(self) -> tuple[WorkerOutcome, list[WorkerFailure]]:
        """The group's outcome so far, and its failures earliest first; dumps and kills hung workers on the way."""
        self._follow_reentries()
        self.watchdog.check(self.processes, self.member.first_rank)
        now = time.time()
        # a worker handed this round in process is `_follow_reentries`' until it re-entered or its exit was seen
        # there: one that left with UNWIND_STUCK_EXIT since is started anew at the next poll, not failed
        settled = {r: p for r, p in enumerate(self.processes) if r not in self.reentering}
        for local_rank, process in settled.items():
            if process.poll() is not None:
                self._exited_at.setdefault(local_rank, now)
            elif local_rank not in self._raised and self._error_file_written(local_rank):
                self._raised.add(local_rank)
        # a worker the watchdog found hung failed, even if it exited 0 once continued for its stack dump; while
        # the watchdog dumps and kills one, failures wait for its exit, so that it is among them. A hung worker
        # left alive (it only waited on a peer) waits too: reported at once, it made the round change before
        # its node's stopped worker, the cause, was killed and reported, and the log named only the bystanders
        acting = self.watchdog.acting()
        failures = [
            self._failure(r)
            for r, p in settled.items()
            if p.returncode not in (None, 0)
            or (p.returncode == 0 and self.watchdog.hang(r))
            or (p.returncode is None and self.watchdog.spared(r) and not acting)
            or (r in self._raised and p.returncode is None and not acting and not self.watchdog.hang(r))
        ]
        if failures:
            return WorkerOutcome.FAILED, sorted(failures, key=lambda f: (f.time, f.rank))
        if len(self._exited_at) == len(self.processes):
            return WorkerOutcome.SUCCEEDED, []
        return WorkerOutcome.RUNNING, []

    def _follow_reentries(self) -> None:
        """A worker handed this round in process has until --inprocess-timeout to open the round's channel;
        past it, its stacks are dumped (to the last round's stacks.log: it never switched) and copied where its
        stderr goes, and once they are written it is killed and its rank starts in a new process. One that found
        itself blocked where no abort reaches exits with `UNWIND_STUCK_EXIT` first (elastic.rounds): its rank
        starts anew at once."""
        now = time.monotonic()
        for local_rank, deadline in list(self.reentering.items()):
            process = self.processes[local_rank]
            dump = self._dumps.get(local_rank)
            if self.watchdog.opened(local_rank):
                del self.reentering[local_rank]
            elif process.poll() is not None:
                del self.reentering[local_rank]
                if process.returncode == UNWIND_STUCK_EXIT:
                    logger.warning(
                        "round %d: worker local_rank %d could not unwind (blocked where no abort reaches; its stacks "
                        "are in the last round's output): starting it anew",
                        self.round.round,
                        local_rank,
                    )
                    self._start_anew(local_rank, process)
            elif now >= deadline and dump is None:
                logger.warning(
                    "round %d: worker local_rank %d did not re-enter within --inprocess-timeout %gs: dumping its "
                    "stacks, then replacing it with a new process",
                    self.round.round,
                    local_rank,
                    self.config.inprocess_timeout,
                )
                self._dumps[local_rank] = StackDump.ask(worker_under(process.pid), channel.DUMP_SIGNAL, now)
            elif dump is not None and dump.over(now):
                del self.reentering[local_rank], self._dumps[local_rank]
                stacks = read_dump(self._left_dirs[local_rank] / channel.STACKS_FILE)
                if stacks:
                    self.output.append_to_stderr(self.attempt_dir / str(local_rank), local_rank, stacks)
                self._start_anew(local_rank, process)

    def _start_anew(self, local_rank: int, process: WorkerProcess) -> None:
        """Replace the worker of `local_rank`, handed this round in process, by a new one (it is killed if it runs)."""
        stop_group([process], 0.0, signal.SIGKILL)
        self.round_links.pop(local_rank).close()
        self.watchdog.renew(local_rank)
        self.processes[local_rank] = self._launch(local_rank, None)

    def hand_over(self, local_rank: int, offer: Callable[[RoundLink], bool]) -> tuple[WorkerProcess, RoundLink] | None:
        """The worker of `local_rank` and its round socket, once `offer` handed it the next round: one that runs
        under `elastic.run`, is alive, neither hung nor stopped, and still holds its socket (None: the rank starts
        anew, and `release` stops this worker with the others it keeps)."""
        if not self._reentrant(local_rank) or local_rank in self.watchdog.stopped(self.processes):
            return None
        if not offer(self.round_links[local_rank]):
            return None
        self._handed_over.add(local_rank)
        return self.processes[local_rank], self.round_links.pop(local_rank)

    def release(self) -> None:
        """The next round took over what it could: stop the other workers. The pumps of those taken over end when
        they switch to the new round's output, in their own time."""
        self.stop_processes([p for r, p in enumerate(self.processes) if r not in self._handed_over])
        threading.Thread(target=self.output.close, name="output-close", daemon=True).start()

    def stop_processes(self, processes: list[WorkerProcess], signum: int = signal.SIGTERM) -> None:
        stop_group(processes, self.config.worker_stop_timeout, signum)
        for local_rank, process in enumerate(self.processes):
            if process in processes and local_rank in self.round_links:
                self.round_links.pop(local_rank).close()

    def stop_all_but_reentrant(self) -> None:
        """After a failure: stop the workers that cannot take the next round in process; the others wait for it
        (their collectives fail, and `elastic.run` waits for the new round)."""
        keep = {r for r in range(len(self.processes)) if self._reentrant(r)}
        self.stop_processes([p for r, p in enumerate(self.processes) if r not in keep])

    def _reentrant(self, local_rank: int) -> bool:
        """Alive, under `elastic.run` (or handed this round and not yet back), not hung (or spared), with its socket."""
        return (
            local_rank in self.round_links
            and self.processes[local_rank].poll() is None
            and self._alive_for_rounds(local_rank)
            and (self.watchdog.inprocess(local_rank) or local_rank in self.reentering)
        )

    def _alive_for_rounds(self, local_rank: int) -> bool:
        """Not hung, or hung and left alive for the next round (the watchdog's `spare_reentrant`)."""
        return self.watchdog.hang(local_rank) is None or self.watchdog.spared(local_rank)

    def request_drain(self, number: int, in_memory: bool = False) -> None:
        """Ask the workers to checkpoint at their next step and wait there (0: withdraw the request); `in_memory`:
        a snapshot in memory is checkpoint enough (the nodes that stay hold all of it)."""
        self.watchdog.request_drain(number, in_memory)

    def drain_answer(self, number: int) -> DrainReport | None:
        """This node's answer to drain `number`: the step its workers committed, step None when none of them
        drains (no CheckpointManager), or None while they are still at it."""
        states = self.watchdog.drain_states()
        draining = [state for state in states if state is not None and state.drainable]
        if not draining:
            return DrainReport(number=number, step=None)
        if any(state.done != number for state in draining):
            return None
        return DrainReport(number=number, step=max((s.step for s in draining if s.step is not None), default=None))

    def why_no_drain(self) -> str | None:
        """What shows that the workers cannot drain (None: nothing does): one of them is stopped, or every one
        is silent past several of its step intervals outside a long operation (a drain's save is one, and may wait
        on slow storage), so none will reach the next step boundary."""
        stopped = self.watchdog.stopped(self.processes)
        if stopped:
            return f"worker local_rank {stopped[0]} is stopped"
        stall = self.watchdog.stall
        if stall is not None and stall.long_op is None:
            return f"every worker has been silent for {stall.seconds_silent:.1f}s, several of its step intervals"
        return None

    def trains_under_elastic_run(self) -> bool:
        """Whether a worker of this round runs under `elastic.run` and reported a training step in it."""
        return self.watchdog.latest_step() is not None and any(
            self.watchdog.inprocess(r) for r in range(len(self.processes))
        )

    def pids(self) -> list[int]:
        return [process.pid for process in self.processes]

    def next_look_at(self) -> float | None:
        """When (time.monotonic()) a silent worker's verdict may change next (None: nothing is due)."""
        return self.watchdog.next_look_at()

    def stall(self) -> Stall | None:
        """Every worker silent for several of its step intervals, as of the last poll (watchdog_rules.stall_of)."""
        return self.watchdog.stall

    def keep_pace(self) -> None:
        """The round ends: its step pace judges the next round's first steps (Watchdog.keep_pace)."""
        self.watchdog.keep_pace()

    def latest_step(self) -> int | None:
        """The newest step this node's workers reported through heartbeat (None: none yet)."""
        return self.watchdog.latest_step()

    def reporting_hang(self) -> bool:
        """A worker found hung is being dumped and killed; its failure follows within seconds."""
        return self.watchdog.acting()

    def _error_file_written(self, local_rank: int) -> bool:
        """Whether the worker wrote its whole error file: it raised, and is only tearing down."""
        path = self.attempt_dir / str(local_rank) / ERROR_FILE
        return path.exists() and read_error_file(path)[2] is not None

    def _failure(self, local_rank: int) -> WorkerFailure:
        directory = self.attempt_dir / str(local_rank)
        message, traceback, written = read_error_file(directory / ERROR_FILE)
        if not traceback:
            stderr_log = directory / "stderr.log"
            if stderr_log.is_file():
                traceback = stderr_log.read_text(errors="replace")[-4000:]
        hang = self.watchdog.hang(local_rank)
        if hang is not None:  # found hung and killed: it failed when it fell silent, unless it waited for a peer
            dump = read_dump(directory / channel.STACKS_FILE)  # every thread's stack: what the summary shows
            if dump and local_rank not in self._dumps_shown:
                self._dumps_shown.add(local_rank)
                self.output.append_to_stderr(directory, local_rank, dump)
            return WorkerFailure(
                node=self.config.node_id,
                round=self.round.round,
                local_rank=local_rank,
                rank=self.member.first_rank + local_rank,
                exit_code=_exit_code(self.processes[local_rank]),  # one left alive for the next round: 1
                time=hang.failed_at(dump),
                message=hang.describe(dump, spared=self.watchdog.spared(local_rank)),
                traceback=dump[-8000:] or traceback,
                hung=True,
                seconds_silent=round(hang.seconds_silent, 3),
                last_step=hang.last_step,
                path_broken=bool(hang.stalled_peers),
                unreachable=list(hang.stalled_peers),
                consequence=hang.waited_on_peer(dump) and not hang.stalled_peers,
            )
        evidence = f"{message}\n{traceback}"
        return WorkerFailure(
            node=self.config.node_id,
            round=self.round.round,
            local_rank=local_rank,
            rank=self.member.first_rank + local_rank,
            exit_code=_exit_code(self.processes[local_rank]),
            time=written or self._exited_at[local_rank],
            message=message,
            traceback=traceback,
            path_broken=failure_evidence.says_unreachable(evidence),
            unreachable=failure_evidence.unreachable_peers(evidence),
            consequence=failure_evidence.says_peer_failed(evidence),
        )

    def stop(self, signum: int = signal.SIGTERM) -> None:
        """Stop every worker and its descendants: `signum`, then SIGKILL after the grace period."""
        self.stop_processes(self.processes, signum)
        self.output.close()
