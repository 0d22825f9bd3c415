"""One node's workers for one round: their environment (torchrun's contract), logs, exit codes and teardown."""

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
from dataclasses import dataclass
from pathlib import Path
from typing import IO

from elastic.channel import HEARTBEAT_ENV
from elastic.node_memory import MEMORY_DIR_ENV, node_memory_dir
from launcher.config import LaunchConfig, Std
from launcher.rendezvous.records import DrainReport, MasterRecord, Member, RoundHeader, WorkerFailure
from launcher.workers import failure_evidence
from launcher.workers.network import gloo_interface_env
from launcher.workers.process_tree import stop_group, supervised_command
from launcher.workers.warm_pool import WarmPool, WarmWorker
from launcher.workers.watchdog import HEARTBEAT_FILE, Policy, Stall, StartupHistory, Watchdog, read_dump

logger = logging.getLogger(__name__)

ERROR_FILE = "error.json"  # TORCHELASTIC_ERROR_FILE, in the worker's attempt folder
UNCAUGHT_EXCEPTION_EXIT = 1  # what Python exits with after an uncaught exception


def node_worker_env(addr: str, nproc: int) -> dict[str, str]:
    """The part of a worker's environment that stays the same from round to round on this node."""
    env = dict(os.environ)
    if nproc > 1 and "OMP_NUM_THREADS" not in os.environ:
        env["OMP_NUM_THREADS"] = "1"
    # gloo would otherwise bind where the hostname resolves, often 127.0.x.1, which peers on other hosts cannot reach
    env.update(gloo_interface_env(addr, os.environ))
    return env


def worker_env(
    config: LaunchConfig, round_: RoundHeader, member: Member, master: MasterRecord, local_rank: int, error_file: Path
) -> dict[str, str]:
    """The variables torchrun sets for a worker, plus ELASTIC_ROUND, ELASTIC_HEARTBEAT_FILE and ELASTIC_MEMORY_DIR."""
    rank = member.first_rank + local_rank
    env = node_worker_env(member.addr, member.nproc)
    env.update(
        RANK=str(rank),
        LOCAL_RANK=str(local_rank),
        GROUP_RANK=str(member.group_rank),
        ROLE_RANK=str(rank),
        ROLE_NAME=config.role,
        LOCAL_WORLD_SIZE=str(member.nproc),
        WORLD_SIZE=str(round_.world_size),
        GROUP_WORLD_SIZE=str(round_.size),
        ROLE_WORLD_SIZE=str(round_.world_size),
        MASTER_ADDR=master.addr,
        MASTER_PORT=str(master.port),
        TORCHELASTIC_RESTART_COUNT=str(round_.restart_count),
        TORCHELASTIC_MAX_RESTARTS=str(config.max_restarts),
        TORCHELASTIC_RUN_ID=config.rdzv_id,
        # rank 0 serves a fresh store on the round's own port: no key of an earlier round can be read back
        TORCHELASTIC_USE_AGENT_STORE="False",
        TORCHELASTIC_ERROR_FILE=str(error_file),
        # as torchrun: the user's value wins; by default a failed NCCL collective tears its process down
        TORCH_NCCL_ASYNC_ERROR_HANDLING=os.environ.get("TORCH_NCCL_ASYNC_ERROR_HANDLING", "1"),
        ELASTIC_ROUND=str(round_.round),
    )
    # the worker's channel to its agent (heartbeats for the watchdog, drains): a file next to the error file,
    # created by WorkerGroup; never the channel of an outer elastic-run
    env[HEARTBEAT_ENV] = str(error_file.parent / HEARTBEAT_FILE)
    # where CheckpointManager(memory_every=...) keeps snapshots; the agent holds the folder for the job's life
    env[MEMORY_DIR_ENV] = str(node_memory_dir(config.rdzv_id, member.node))
    return env


def _exit_code(process: subprocess.Popen) -> int:
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


class LineDuplicator:
    """torchrun's --duplicate-std{out,err}-filters: every line of any local worker's stream that contains one of
    `filters` is copied into one file of the attempt (`filtered_stdout.log`, `filtered_stderr.log`)."""

    def __init__(self, path: Path, filters: list[str]) -> None:
        self.path = path
        self.filters = [f.encode() for f in filters if f]
        self._lock = threading.Lock()
        self._file: IO[bytes] | None = None

    def offer(self, line: bytes) -> None:
        if not any(f in line for f in self.filters):
            return
        with self._lock:
            if self._file is None:
                self._file = open(self.path, "ab")
            self._file.write(line)
            self._file.flush()

    def close(self) -> None:
        with self._lock:
            if self._file is not None:
                self._file.close()


@dataclass
class StreamRoute:
    """Where one worker stream goes: the Popen argument, its log file, the console (and the line prefix there), and
    the duplicator of filtered lines; the agent pumps it line by line when the argument is a pipe."""

    target: IO[bytes] | int | None  # a log file, subprocess.PIPE, or None: the agent's own stream
    log_file: IO[bytes] | None = None
    console: IO[str] | None = None
    prefix: str = ""
    duplicator: LineDuplicator | None = None


def _pump(source: IO[bytes], route: StreamRoute) -> None:
    """Copy a worker's stream line by line into its log file, onto the agent's console, and its filtered lines."""
    with source:
        for line in iter(source.readline, b""):
            if route.log_file is not None:
                route.log_file.write(line)
                route.log_file.flush()
            if route.console is not None:
                route.console.write(route.prefix + line.decode(errors="replace"))
                route.console.flush()
            if route.duplicator is not None:
                route.duplicator.offer(line)
    if route.log_file is not None:
        route.log_file.close()


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
        startups: StartupHistory | None = None,
        warm: WarmPool | None = None,
    ) -> None:
        self.config = config
        self.warm = warm
        self.started_warm = 0  # how many of the workers started in a warm interpreter
        self.started_importing = 0  # of those, how many had not finished importing torch yet
        self.round = round_
        self.member = member
        self.master = master
        assert config.log_dir is not None, "elastic-run picks the log dir before workers start"
        self.attempt_dir = config.log_dir / config.node_id / f"attempt_{round_.round}"
        self.processes: list[subprocess.Popen] = []
        self._pumps: list[threading.Thread] = []
        self._exited_at: dict[int, float] = {}
        # workers that wrote their error file (torch's @record: an uncaught exception) but have not exited yet:
        # their interpreter's teardown takes 0.4-0.8 s with torch loaded, and a peer waiting on them fails only
        # once they exit, so waiting for every exit would chain those delays across the job
        self._raised: set[int] = set()
        self._duplicators = {
            name: LineDuplicator(self.attempt_dir / f"filtered_{name}.log", filters)
            for name, filters in (
                ("stdout", config.duplicate_stdout_filters),
                ("stderr", config.duplicate_stderr_filters),
            )
            if any(filters)
        }
        # heartbeat channels exist before the workers start (or, with the watchdog off, stale ones are gone)
        self.watchdog = Watchdog(
            Policy.from_config(config),
            [self.attempt_dir / str(r) / HEARTBEAT_FILE for r in range(member.nproc)],
            startups=startups,
        )

    def start(self) -> None:
        # each worker runs under a supervisor: its whole tree dies with the agent (even SIGKILLed) or with it
        node_env = node_worker_env(self.member.addr, self.member.nproc)
        for local_rank in range(self.member.nproc):
            directory = self.attempt_dir / str(local_rank)
            directory.mkdir(parents=True, exist_ok=True)
            error_file = directory / ERROR_FILE
            error_file.unlink(missing_ok=True)
            env = worker_env(self.config, self.round, self.member, self.master, local_rank, error_file)
            routes = {name: self._route(directory, local_rank, name) for name in ("stdout", "stderr")}
            warm = self.warm.take(local_rank, node_env) if self.warm is not None else None
            importing = warm is not None and warm.still_importing()
            if warm is not None and self._launch_warm(warm, env, routes):
                process = warm.process
                self.started_warm += 1
                self.started_importing += importing
            else:
                process = self._launch_cold(env, routes)
            for route in routes.values():
                if route.log_file is not None and route.target is not subprocess.PIPE:
                    route.log_file.close()  # the child holds its own descriptor
            self.processes.append(process)
        logger.info(
            "round %d: started %d worker(s) (%d warm%s), ranks %d-%d of %d, logs in %s",
            self.round.round,
            self.member.nproc,
            self.started_warm,
            f", {self.started_importing} still importing" if self.started_importing else "",
            self.member.first_rank,
            self.member.last_rank,
            self.round.world_size,
            self.attempt_dir,
        )

    def _launch_cold(self, env: dict[str, str], routes: dict[str, StreamRoute]) -> subprocess.Popen:
        process = subprocess.Popen(
            supervised_command(self.config.worker_command()),
            env=env,
            start_new_session=True,
            stdin=subprocess.DEVNULL,
            stdout=routes["stdout"].target,
            stderr=routes["stderr"].target,
        )
        for name, route in routes.items():
            if route.target is subprocess.PIPE:
                self._pump(getattr(process, name), route)
        return process

    def _launch_warm(self, warm: WarmWorker, env: dict[str, str], routes: dict[str, StreamRoute]) -> bool:
        """Hand the round to a warm interpreter: stdio as a cold worker's (pipes the agent pumps, log files, or
        the agent's own console), the script and its arguments as `python -u script args` would have them."""
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
        launched = warm.launch(env, [self.config.entrypoint, *self.config.args], *fds)
        for read_end, write_end, route in pumped:
            os.close(write_end)  # the worker holds its own copy
            if launched:
                self._pump(os.fdopen(read_end, "rb"), route)
            else:
                os.close(read_end)
        return launched

    def _pump(self, source: IO[bytes], route: StreamRoute) -> None:
        pump = threading.Thread(target=_pump, args=(source, route), daemon=True)
        pump.start()
        self._pumps.append(pump)

    def _route(self, directory: Path, local_rank: int, name: str) -> StreamRoute:
        """Where one stream goes under --redirects, --tee and --duplicate-std{out,err}-filters."""
        includes = Std.includes_out if name == "stdout" else Std.includes_err
        tee = includes(self.config.std_for(self.config.tee, local_rank))
        redirect = tee or includes(self.config.std_for(self.config.redirects, local_rank))
        duplicator = self._duplicators.get(name)
        log_file = open(directory / f"{name}.log", "ab") if redirect else None
        if not tee and duplicator is None:
            return StreamRoute(target=log_file, log_file=log_file)
        console = sys.stdout if name == "stdout" else sys.stderr
        if tee:
            shown = self.config.local_ranks_filter is None or local_rank in self.config.local_ranks_filter
            prefix = f"[{self.config.role}{self.member.first_rank + local_rank}]:"
            return StreamRoute(subprocess.PIPE, log_file, console if shown else None, prefix, duplicator)
        # only duplicated: the stream reaches its log file or the console as it would without the filters
        return StreamRoute(subprocess.PIPE, log_file, None if redirect else console, "", duplicator)

    def poll(self) -> tuple[WorkerOutcome, list[WorkerFailure]]:
        """The group's outcome so far, and its failures earliest first; dumps and kills hung workers on the way."""
        self.watchdog.check(self.processes, self.member.first_rank)
        now = time.time()
        for local_rank, process in enumerate(self.processes):
            if process.poll() is not None:
                self._exited_at.setdefault(local_rank, now)
            elif local_rank not in self._raised and self._error_file_written(local_rank):
                self._raised.add(local_rank)
        # a worker the watchdog found hung failed, even if it exited 0 once continued for its stack dump; while
        # the watchdog dumps and kills one, failures wait for its exit, so that it is among them
        acting = self.watchdog.acting()
        failures = [
            self._failure(r)
            for r, p in enumerate(self.processes)
            if p.returncode not in (None, 0)
            or (p.returncode == 0 and self.watchdog.hang(r))
            or (r in self._raised and p.returncode is None and not acting and not self.watchdog.hang(r))
        ]
        if failures:
            return WorkerOutcome.FAILED, sorted(failures, key=lambda f: (f.time, f.rank))
        if len(self._exited_at) == len(self.processes):
            return WorkerOutcome.SUCCEEDED, []
        return WorkerOutcome.RUNNING, []

    def request_drain(self, number: int) -> None:
        """Ask the workers to checkpoint at their next step and wait there (0: withdraw the request)."""
        self.watchdog.request_drain(number)

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

    def stall(self) -> Stall | None:
        """Every worker silent for several of its step intervals, as of the last poll (launcher.workers.watchdog)."""
        return self.watchdog.stall

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
            dump = read_dump(directory / "stderr.log")  # every thread's stack: what the failure summary shows
            return WorkerFailure(
                node=self.config.node_id,
                round=self.round.round,
                local_rank=local_rank,
                rank=self.member.first_rank + local_rank,
                exit_code=self.processes[local_rank].returncode,
                time=hang.failed_at(dump),
                message=hang.describe(dump),
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
        stop_group(self.processes, self.config.worker_stop_timeout, signum)
        for pump in self._pumps:
            pump.join(timeout=2)
        for duplicator in self._duplicators.values():
            duplicator.close()
