"""Recovery benchmark: seconds from a fault to the first collective of the re-formed world.

For each launcher (elastic-run with warm workers, elastic-run-cold with --no-warm-workers, elastic-run-inprocess
with the probe under elastic.run (survivors re-enter in process), torchrun with the c10d rendezvous) and each fault
(SIGKILL: a dead host; SIGSTOP: a hung host; crash: one worker killed), in one run on this machine:

  1. start 3 agents ("nodes") x 2 workers of examples/collective_probe.py, --nnodes 2:3, --max-restarts 3;
  2. wait until the world of 6 has completed a few collectives, then --settle seconds more (a job that has
     been training a while: elastic-run's warm workers for the next round are ready by then);
  3. hit the LAST node (never the first, which hosts torchrun's c10d store): SIGKILL or SIGSTOP its agent and
     its workers, or SIGKILL one of its workers; or (cascade) SIGKILL one worker of node1 and, 3 s after the job
     trains again, SIGKILL the last node: a second fault while the first's round is young; or (young-stop) the
     same crash, then SIGSTOP of the last node half a step after the job trains again, before its peers' workers
     have stepped enough in the new round to show their pace; or (start-stop) the same crash, then SIGSTOP of
     the last node as its agent sets up the crash's new round, before any worker heartbeats in it;
  4. time the first probe collective of the next world completed after the fault (4 workers after a lost
     node, 6 in a later round after a crash), capped at --deadline.

Both launchers run in the same invocation so that their ratio means something on a machine whose load
changes from minute to minute. Every figure printed is measured in this run.

    python bench/recovery_bench.py                   # elastic-run warm and cold, tuned torchrun; kill, stop, crash
    python bench/recovery_bench.py --launchers elastic-run --faults kill
    python bench/recovery_bench.py --launchers elastic-run,torchrun,torchrun-defaults --deadline 60

bench/training_recovery_bench.py runs examples/train.py instead of the probe (six faults, the steps redone) on
this module's jobs and faults.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import time
import uuid
from dataclasses import dataclass, field
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))  # run from a checkout without installing: `python bench/recovery_bench.py`

from elastic.node_memory import job_memory_dirs  # noqa: E402
from launcher.etcd.server import EtcdServer, free_port  # noqa: E402
from launcher.workers.process_tree import child_pids  # noqa: E402

logger = logging.getLogger("recovery-bench")

PROBE = REPO / "examples" / "collective_probe.py"
NODES = 3
NPROC_PER_NODE = 2
FULL_WORLD = NODES * NPROC_PER_NODE
SMALL_WORLD = (NODES - 1) * NPROC_PER_NODE
FAULTED_NODE = NODES - 1  # the last agent started; node 0 hosts torchrun's c10d store and elastic-run's round 0 rank 0

# elastic-run: its default lease (1 s x 3) and a short last call so the first 3-node round forms at once.
ELASTIC_RDZV_CONF = "keep_alive_interval=1,keep_alive_max_attempt=3,last_call_timeout=2"
# torchrun tuned to be as quick to notice a loss as elastic-run (heartbeat 1 s x 3, last call 2 s, close 10 s);
# its defaults are keep_alive 5 s x 3, last_call 30 s, close 30 s, join 600 s.
TORCHRUN_TUNED_CONF = "keep_alive_interval=1,keep_alive_max_attempt=3,last_call_timeout=2,close_timeout=10"
TORCHRUN_DEFAULT_CONF = ""

LAUNCHERS = ("elastic-run", "elastic-run-cold", "elastic-run-inprocess", "torchrun", "torchrun-defaults")
FAULTS = {
    "kill": signal.SIGKILL,
    "stop": signal.SIGSTOP,
    "crash": signal.SIGKILL,
    "cascade": signal.SIGKILL,
    "young-stop": signal.SIGSTOP,
    "start-stop": signal.SIGSTOP,
}
FAULT_NAMES = {
    "kill": "node SIGKILL",
    "stop": "node SIGSTOP",
    "crash": "one worker SIGKILL",
    "cascade": "node SIGKILL 3 s after a crash's recovery",
    "young-stop": "node SIGSTOP half a step after a crash's recovery",
    "start-stop": "node SIGSTOP as a crash's new round starts",
}
CASCADE_AFTER_S = 3.0  # from the first fault's recovery to the second fault
YOUNG_AFTER_STEPS = 0.5  # young-stop: from the first fault's recovery to the second, in --step-time


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        description=__doc__.splitlines()[0],
        formatter_class=argparse.RawDescriptionHelpFormatter,
        epilog="\n".join(__doc__.splitlines()[2:]),
    )
    parser.add_argument(
        "--launchers",
        default="elastic-run,elastic-run-cold,torchrun",
        help=f"comma-separated, from {', '.join(LAUNCHERS)} (torchrun = tuned c10d conf)",
    )
    parser.add_argument("--faults", default="kill,stop,crash", help=f"comma-separated, from {', '.join(FAULTS)}")
    parser.add_argument(
        "--settle",
        type=float,
        default=8.0,
        help="seconds of training after the warm-up steps before the fault (default 8)",
    )
    parser.add_argument(
        "--deadline",
        type=float,
        default=120.0,
        help="seconds after the fault to wait for a collective at world size 4 (default 120)",
    )
    parser.add_argument(
        "--warmup-steps",
        type=int,
        default=5,
        help="collectives every rank of the 6-worker world completes before the fault (default 5)",
    )
    parser.add_argument(
        "--startup-timeout",
        type=float,
        default=120.0,
        help="seconds allowed for the 6-worker world to reach --warmup-steps (default 120)",
    )
    parser.add_argument("--step-time", type=float, default=0.1, help="probe seconds between collectives (default 0.1)")
    parser.add_argument("--keep-logs", action="store_true", help="keep each scenario's directory and print its path")
    parser.add_argument("--plot", type=Path, default=None, help="also draw the results as bars into this PNG")
    args = parser.parse_args(argv)
    args.launchers = _choices(args.launchers, LAUNCHERS, "--launchers")
    args.faults = _choices(args.faults, tuple(FAULTS), "--faults")
    return args


def _choices(spec: str, allowed: tuple[str, ...], flag: str) -> list[str]:
    chosen = [item.strip() for item in spec.split(",") if item.strip()]
    unknown = [item for item in chosen if item not in allowed]
    if unknown or not chosen:
        raise SystemExit(f"{flag}: expected a comma-separated subset of {', '.join(allowed)}, got {spec!r}")
    return chosen


# -- processes, read from /proc ------------------------------------------------------------------------------
# Both launchers start each worker in a session of its own (torchrun's SubprocessHandler and elastic-run's
# WorkerGroup use start_new_session=True), so killpg of the agent's group alone would not reach the workers:
# a "node" is the agent's process tree, and every process group in it gets the signal.


def _parent_of_every_process() -> dict[int, int]:
    parents = {}
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
        except (OSError, IndexError):
            continue  # the process exited while we looked
        parents[int(stat.parent.name)] = int(fields[1])
    return parents


def process_tree(root: int) -> list[int]:
    """`root` and all its living descendants."""
    parents = _parent_of_every_process()
    tree, frontier = [root], [root]
    while frontier:
        children = [pid for pid, parent in parents.items() if parent in frontier]
        tree += children
        frontier = children
    return tree


def processes_mentioning(marker: str) -> list[int]:
    """Processes whose command line contains `marker` (a scenario directory: only what this script started)."""
    found = []
    for cmdline in Path("/proc").glob("[0-9]*/cmdline"):
        try:
            if marker.encode() in cmdline.read_bytes():
                found.append(int(cmdline.parent.name))
        except OSError:
            continue
    return found


def signal_groups_of(pids: list[int], signum: int) -> list[int]:
    """Send `signum` to every process group that one of `pids` belongs to (never our own group)."""
    groups = []
    for pid in pids:
        try:
            group = os.getpgid(pid)
        except ProcessLookupError:
            continue
        if group != os.getpgrp() and group not in groups:
            groups.append(group)
    for group in groups:
        try:
            os.killpg(group, signum)
        except (ProcessLookupError, PermissionError):
            pass
    return groups


def signal_each(pids: list[int], signum: int) -> None:
    for pid in pids:
        try:
            os.kill(pid, signum)
        except (ProcessLookupError, PermissionError):
            pass


# -- one job: 3 agents of one launcher ---------------------------------------------------------------------


@dataclass
class Job:
    """The agents of one scenario, their logs, and what it takes to stop all of them."""

    launcher: str
    workdir: Path
    agents: list[subprocess.Popen] = field(default_factory=list)
    etcd: EtcdServer | None = None
    output_sizes_at_fault: dict[int, int] = field(default_factory=dict)  # bytes each agent had printed
    rdzv_id: str = field(default_factory=lambda: f"bench-{uuid.uuid4().hex[:8]}")

    @property
    def probe_log(self) -> Path:
        return self.workdir / "probe.jsonl"

    def agent_output(self, node: int) -> Path:
        return self.workdir / f"node{node}.out"

    def log_dir(self, node: int) -> Path:
        return self.workdir / f"node{node}"

    def start(self, step_time: float) -> None:
        rdzv_id = self.rdzv_id
        if self.launcher.startswith("elastic-run"):
            etcd_dir = self.workdir / "etcd"  # inside the scenario directory, so it goes with it
            etcd_dir.mkdir()
            self.etcd = EtcdServer(data_dir=str(etcd_dir)).start()
        store_port = free_port()
        probe_args = [str(PROBE), "--steps", "100000", "--step-time", str(step_time), "--log", str(self.probe_log)]
        if self.launcher == "elastic-run-inprocess":
            probe_args.append("--inprocess")  # survivors take the next round in process (elastic.run)
        for node in range(NODES):
            if self.launcher.startswith("elastic-run"):
                warm = self.launcher != "elastic-run-cold"
                assert self.etcd is not None  # started above for every elastic-run launcher
                command = elastic_run_command(node, self.etcd.endpoint, rdzv_id, self.log_dir(node), probe_args, warm)
            else:
                conf = TORCHRUN_TUNED_CONF if self.launcher == "torchrun" else TORCHRUN_DEFAULT_CONF
                command = torchrun_command(node, store_port, rdzv_id, conf, self.log_dir(node), probe_args)
            self.start_agent(node, command)
            # join in order, so node 0 hosts torchrun's store and the faulted node is the last one in both launchers
            time.sleep(0.5)
        logger.info(
            "  started %d %s agents (pids %s), logs in %s",
            NODES,
            self.launcher,
            " ".join(str(a.pid) for a in self.agents),
            self.workdir,
        )

    def start_agent(self, node: int, command: list[str], env: dict[str, str] | None = None) -> None:
        """Start agent `node` with `command` (and `env` added to ours), its output appended to agent_output(node)."""
        with open(self.agent_output(node), "ab") as output:
            # a session of its own: Ctrl-C in our terminal must not reach the agents before we clean up
            self.agents.append(
                subprocess.Popen(
                    command,
                    cwd=REPO,
                    env=dict(os.environ, OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1", **(env or {})),
                    stdout=output,
                    stderr=subprocess.STDOUT,
                    stdin=subprocess.DEVNULL,
                    start_new_session=True,
                )
            )

    def running_agents(self) -> int:
        return sum(agent.poll() is None for agent in self.agents)

    def hit(self, node: int, signum: int) -> float:
        """Send `signum` to one node (its agent and all its workers); returns the time of the fault."""
        tree = process_tree(self.agents[node].pid)  # read before the signal: a killed agent's orphans are reparented
        self.output_sizes_at_fault = {n: self.agent_output(n).stat().st_size for n in range(NODES)}
        fault_time = time.time()
        groups = signal_groups_of(tree, signum)
        logger.info(
            "  %s node%d: %d processes (agent pid %d), process groups %s",
            signal.Signals(signum).name,
            node,
            len(tree),
            self.agents[node].pid,
            groups,
        )
        return fault_time

    def crash_worker(self, node: int) -> float:
        """SIGKILL one worker of `node` (its agent lives on); returns the time of the fault."""
        worker = child_pids(self.agents[node].pid)[0]  # seen through its supervisor
        fault_time = time.time()
        os.kill(worker, signal.SIGKILL)
        logger.info("  SIGKILL worker pid %d of node%d", worker, node)
        return fault_time

    def stop(self, settle_s: float = 10.0) -> None:
        """Kill every process this job started, stopped ones included, then the etcd it ran on, and remove the
        agents' memory folders (SIGKILLed, they cannot). A process still there after `settle_s` is reported:
        SIGKILLed workers of torch take a moment to go on a loaded machine."""
        started = set(processes_mentioning(str(self.workdir)))
        for agent in self.agents:
            started.update(process_tree(agent.pid) if agent.poll() is None else [])
        pids = sorted(started)
        # a stopped process would take SIGKILL too, but SIGCONT first lets the kernel reap it right away
        signal_groups_of(pids, signal.SIGCONT)
        signal_each(pids, signal.SIGCONT)
        signal_groups_of(pids, signal.SIGKILL)
        signal_each(pids, signal.SIGKILL)
        for agent in self.agents:
            try:
                agent.wait(timeout=10)
            except subprocess.TimeoutExpired:
                logger.warning("  agent pid %d did not exit after SIGKILL", agent.pid)
        if self.etcd is not None:
            self.etcd.stop()
        for folder in job_memory_dirs(self.rdzv_id):
            shutil.rmtree(folder, ignore_errors=True)  # the agents' memory folders: their processes were killed
        deadline = time.monotonic() + settle_s
        while leftover := processes_mentioning(str(self.workdir)):
            if time.monotonic() > deadline:
                logger.warning("  processes still alive %.0f s after cleanup: %s", settle_s, leftover)
                return
            time.sleep(0.2)


def elastic_run_command(
    node: int, endpoint: str, rdzv_id: str, log_dir: Path, probe_args: list[str], warm: bool
) -> list[str]:
    return [
        sys.executable,
        "-m",
        "launcher.commands.cli",  # the `elastic-run` console script, run by this interpreter
        "--nnodes",
        f"{NODES - 1}:{NODES}",
        "--nproc-per-node",
        str(NPROC_PER_NODE),
        "--rdzv-backend",
        "etcd",
        "--rdzv-endpoint",
        endpoint,
        "--rdzv-id",
        rdzv_id,
        "--rdzv-conf",
        ELASTIC_RDZV_CONF,
        "--max-restarts",
        "3",
        "--node-id",
        f"node{node}",
        "--log-dir",
        str(log_dir),
        *([] if warm else ["--no-warm-workers"]),
        *probe_args,
    ]


def torchrun_command(
    node: int, port: int, rdzv_id: str, conf: str, log_dir: Path, probe_args: list[str], max_restarts: int = 3
) -> list[str]:
    # Every agent runs on 127.0.0.1, so each would guess it hosts the store: say explicitly that node 0 does.
    rdzv_conf = ",".join(filter(None, [conf, f"is_host={'true' if node == 0 else 'false'}"]))
    return [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--nnodes",
        f"{NODES - 1}:{NODES}",
        "--nproc-per-node",
        str(NPROC_PER_NODE),
        "--rdzv-backend",
        "c10d",
        "--rdzv-endpoint",
        f"127.0.0.1:{port}",
        "--rdzv-id",
        rdzv_id,
        "--rdzv-conf",
        rdzv_conf,
        "--max-restarts",
        str(max_restarts),
        "--log-dir",
        str(log_dir),
        # torchrun's parser accepts abbreviations and rejects the probe's --log as ambiguous (--log-dir,
        # --logs-specs) unless `--` ends its own flags
        "--",
        *probe_args,
    ]


# -- watching the probe's log ------------------------------------------------------------------------------


class ProbeLog:
    """Reads the probe's JSON lines as they are appended; keeps every collective seen so far."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self.offset = 0
        self.collectives: list[dict] = []

    def read_new(self) -> list[dict]:
        if not self.path.is_file():
            return []
        with open(self.path, "rb") as file:
            file.seek(self.offset)
            data = file.read()
        complete = data[: data.rfind(b"\n") + 1]  # a line being written is read next time
        self.offset += len(complete)
        fresh = [json.loads(line) for line in complete.splitlines() if line.strip()]
        self.collectives += fresh
        return fresh


def wait_for_full_world(probe: ProbeLog, job: Job, steps: int, timeout: float) -> bool:
    """True once every rank of the 6-worker world has completed `steps` collectives."""
    deadline = time.monotonic() + timeout
    done_ranks: set[int] = set()
    while time.monotonic() < deadline:
        for entry in probe.read_new():
            if entry["world_size"] == FULL_WORLD and entry["step"] >= steps - 1:
                done_ranks.add(entry["rank"])
        if len(done_ranks) == FULL_WORLD:
            return True
        if job.running_agents() < NODES:
            return False
        time.sleep(0.1)
    return False


def wait_for_recovery(
    probe: ProbeLog, job: Job, fault_time: float, world_size: int, after_round: int, deadline_s: float
) -> tuple[dict | None, str]:
    """The first collective at `world_size` in a round after `after_round` completed after the fault, or None
    and why there was none."""
    deadline = fault_time + deadline_s
    next_progress = time.time() + 15
    while time.time() < deadline:
        for entry in probe.read_new():
            if entry["world_size"] == world_size and entry["time"] > fault_time and entry["round"] > after_round:
                return entry, ""
        if job.running_agents() == 0:
            return None, f"all agents exited {time.time() - fault_time:.0f} s after the fault"
        if time.time() >= next_progress:
            logger.info(
                "  ... %.0f s after the fault, no collective at world size %d yet", time.time() - fault_time, world_size
            )
            next_progress += 15
        time.sleep(0.05)
    return None, ""


def wait_for_round_setup(job: Job, node: int, after_round: int, timeout: float) -> bool:
    """Wait until agent `node` sets up a round after `after_round`: its WorkerGroup creates the round's attempt
    directory (the workers' channels) before it hands the round to any worker."""
    deadline = time.monotonic() + timeout
    pattern = re.compile(r"attempt_(\d+)$")
    while time.monotonic() < deadline:
        try:
            names = os.listdir(job.log_dir(node) / f"node{node}")
        except OSError:
            names = []
        if any((m := pattern.match(name)) and int(m.group(1)) > after_round for name in names):
            return True
        time.sleep(0.002)
    return False


# -- what happened: notes and elastic-run's split ----------------------------------------------------------


def after_fault_note(job: Job, probe: ProbeLog, fault_time: float) -> str:
    """Why there was no recovery, in one line: what the survivors did after the fault."""
    probe.read_new()
    later = [c for c in probe.collectives if c["time"] > fault_time]
    parts = [
        f"collectives after the fault at world sizes {sorted({c['world_size'] for c in later})}"
        if later
        else "no collective after the fault"
    ]
    survivors = [n for n in range(NODES) if n != FAULTED_NODE]
    outputs = {n: job.agent_output(n).read_text(errors="replace") for n in survivors}
    # a re-formed world whose workers could not connect to each other (gloo's C++ log line, once per worker)
    mesh_failures = sum(
        line.startswith("[E") and "connectFullMesh failed" in line
        for text in outputs.values()
        for line in text.splitlines()
    )
    if mesh_failures:
        parts.append(f"{mesh_failures} worker(s) failed gloo connectFullMesh")
    for node in survivors:
        code = job.agents[node].poll()
        if code is not None:
            parts.append(f"node{node} exited rc={code} ({last_exception(outputs[node])})")
        else:  # no workers under a live agent: it is waiting in a rendezvous, not in a collective
            workers = len(child_pids(job.agents[node].pid))  # workers, seen through their supervisors
            parts.append(f"node{node} agent alive with {workers} worker process(es)")
    if all(job.agent_output(n).stat().st_size == job.output_sizes_at_fault.get(n) for n in survivors):
        parts.append("survivors (agents and workers) printed nothing after the fault")
    return "; ".join(parts)


def last_exception(text: str) -> str:
    """The last uncaught exception an agent printed (its class name), or '?'."""
    found = re.findall(r"^([A-Za-z_][\w.]*(?:Error|Exception))\b", text, flags=re.MULTILINE)
    return found[-1].rsplit(".", 1)[-1] if found else "?"


def world_after(fault: str) -> int:
    """The world size training resumes at: a lost node's workers are gone; a crashed worker is restarted."""
    return FULL_WORLD if fault == "crash" else SMALL_WORLD


def membership_events(
    job: Job, fault_time: float, world_size: int, wait_s: float = 3.0, survivor: int = 0
) -> list[dict]:
    """A survivor's membership.jsonl events after the fault; waits for its mirror (every 0.5 s) to catch up."""
    path = job.log_dir(survivor) / "membership.jsonl"
    deadline = time.monotonic() + wait_s
    while True:
        events = [json.loads(line) for line in path.read_text().splitlines()] if path.is_file() else []
        later = [e for e in events if e["time"] > fault_time]
        if any(e["event"] == "round_started" and e.get("world_size") == world_size for e in later):
            return later
        if time.monotonic() > deadline:
            return later
        time.sleep(0.2)


def recovery_split(
    events: list[dict], fault_time: float, first_collective: float, world_size: int, workers_launched: float | None
) -> dict[str, float] | None:
    """fault -> detected (node_lost, or worker_failed) -> round_started -> first collective, in seconds."""
    detected = next(
        (e for e in events if e["event"] in ("node_lost", "worker_failed") and e.get("node") == f"node{FAULTED_NODE}"),
        None,
    )
    started = next((e for e in events if e["event"] == "round_started" and e.get("world_size") == world_size), None)
    if detected is None or started is None:
        return None
    split = {
        f"fault -> {detected['event']}": detected["time"] - fault_time,
        f"{detected['event']} -> round_started": started["time"] - detected["time"],
        "round_started -> first collective": first_collective - started["time"],
    }
    if workers_launched is not None and started["time"] <= workers_launched <= first_collective:
        split["  of which: old workers stopped, new launched"] = workers_launched - started["time"]
        split["  of which: worker start-up to 1st collective"] = first_collective - workers_launched
    return split


def workers_launched_at(job: Job, round_: int) -> float | None:
    """When the last survivor launched its workers of `round_`: elastic-run creates
    <log-dir>/<node-id>/attempt_<round>/<local_rank>/ just before starting each worker, so the attempt
    directory's mtime is the launch of that node's last worker (None if the layout is not there)."""
    times = []
    for node in range(NODES):
        if node == FAULTED_NODE:
            continue
        try:
            times.append((job.log_dir(node) / f"node{node}" / f"attempt_{round_}").stat().st_mtime)
        except OSError:
            return None
    return max(times)


def first_round_ranks(job: Job) -> str:
    """elastic-run's round 0 members and ranks, to show that the faulted node is not rank 0's (the store's) node."""
    path = job.log_dir(0) / "membership.jsonl"
    events = [json.loads(line) for line in path.read_text().splitlines()] if path.is_file() else []
    first = next((e for e in events if e["event"] == "round_started"), None)
    if first is None:
        return "? (no round_started in node0's membership.jsonl yet)"
    return " ".join(f"{m['node']}[{m['first_rank']}-{m['last_rank']}]" for m in first.get("members", []))


def describe_event(event: dict, fault_time: float) -> str:
    details = [
        f"{k}={event[k]}"
        for k in ("round", "node", "world_size", "reason", "restart_count", "exit_code")
        if event.get(k) is not None
    ]
    return f"+{event['time'] - fault_time:6.2f} s  {event['event']:<13} {' '.join(details)}"


# -- one scenario ------------------------------------------------------------------------------------------


@dataclass
class Result:
    launcher: str
    fault: str
    seconds: float | None
    note: str = ""
    split: dict[str, float] | None = None
    events: list[dict] = field(default_factory=list)
    fault_time: float = 0.0


def run_scenario(launcher: str, fault: str, args: argparse.Namespace) -> Result:
    workdir = Path(tempfile.mkdtemp(prefix=f"recovery-bench-{launcher}-{fault}-"))
    job = Job(launcher, workdir)
    elastic = launcher.startswith("elastic-run")
    try:
        job.start(args.step_time)
        probe = ProbeLog(job.probe_log)
        if not wait_for_full_world(probe, job, args.warmup_steps, args.startup_timeout):
            return Result(
                launcher,
                fault,
                None,
                f"the {FULL_WORLD}-worker world never completed {args.warmup_steps} collectives; see {workdir}",
            )
        logger.info(
            "  world of %d trained %d steps; faulting node%d in %.0f s",
            FULL_WORLD,
            args.warmup_steps,
            FAULTED_NODE,
            args.settle,
        )
        time.sleep(args.settle)
        if elastic:
            logger.info("  round 0 ranks: %s", first_round_ranks(job))
        probe.read_new()
        round_at_fault = max(c["round"] for c in probe.collectives)
        if fault == "start-stop":
            job.crash_worker(1)
            if not wait_for_round_setup(job, FAULTED_NODE, round_at_fault, args.deadline):
                return Result(launcher, fault, None, f"node{FAULTED_NODE} set up no round after the crash")
        if fault in ("cascade", "young-stop"):
            first_fault = job.crash_worker(1)
            back, why = wait_for_recovery(probe, job, first_fault, FULL_WORLD, round_at_fault, args.deadline)
            if back is None:
                return Result(launcher, fault, None, f"the crash before the kill: {why or 'no recovery'}")
            logger.info(
                "  trains again %.2f s after the crash; %s of node%d follows",
                back["time"] - first_fault,
                FAULTS[fault].name,
                FAULTED_NODE,
            )
            time.sleep(CASCADE_AFTER_S if fault == "cascade" else YOUNG_AFTER_STEPS * args.step_time)
            round_at_fault = back["round"]
        if fault == "crash":
            fault_time = job.crash_worker(FAULTED_NODE)
        else:
            fault_time = job.hit(FAULTED_NODE, FAULTS[fault])
        world_size = world_after(fault)
        first, why = wait_for_recovery(probe, job, fault_time, world_size, round_at_fault, args.deadline)
        if first is None:
            note = why or f"no recovery within {args.deadline:.0f} s"
            result = Result(launcher, fault, None, f"{note}; {after_fault_note(job, probe, fault_time)}")
        else:
            seconds = first["time"] - fault_time
            result = Result(
                launcher,
                fault,
                seconds,
                f"world {world_size}, round {first['round']}, restart count {first['restarts']}",
            )
        result.fault_time = fault_time
        if elastic:
            result.events = membership_events(job, fault_time, world_size)
            if first is not None:
                launched = workers_launched_at(job, first["round"])
                result.split = recovery_split(result.events, fault_time, first["time"], world_size, launched)
        return result
    finally:
        job.stop()
        if args.keep_logs:
            logger.info("  kept logs in %s", workdir)
        else:
            shutil.rmtree(workdir, ignore_errors=True)


# -- the report ---------------------------------------------------------------------------------------------


def print_report(results: list[Result], args: argparse.Namespace) -> None:
    print()
    header = ("launcher", "fault", "seconds to the first collective after it", "note")
    rows = [
        (r.launcher, r.fault, f"{r.seconds:.2f}" if r.seconds is not None else f"> {args.deadline:.0f} (none)", r.note)
        for r in results
    ]
    widths = [max(len(row[i]) for row in [header, *rows]) for i in range(3)]
    for row in [header, *rows]:
        print(" | ".join(cell.ljust(width) for cell, width in zip(row, widths)) + " | " + row[3])

    print()
    by_key = {(r.launcher, r.fault): r for r in results}
    for fault in args.faults:
        elastic = by_key.get(("elastic-run", fault))
        for other in (launcher for launcher in args.launchers if launcher != "elastic-run"):
            baseline = by_key.get((other, fault))
            if elastic is None or baseline is None:
                continue
            print(f"{fault}: {ratio_line(elastic, baseline, args.deadline)}")

    for result in results:
        if not result.launcher.startswith("elastic-run"):
            continue
        print(f"\n{result.launcher}, {result.fault}: membership events after the fault (node0's membership.jsonl)")
        for event in result.events:
            print("  " + describe_event(event, result.fault_time))
        if result.split:
            for step, seconds in result.split.items():
                print(f"  {step:<46} {seconds:6.2f} s")
    print(f"\nelastic-run --rdzv-conf {ELASTIC_RDZV_CONF} (elastic-run-cold: the same with --no-warm-workers)")
    print(f"torchrun    --rdzv-conf {TORCHRUN_TUNED_CONF},is_host=true|false")
    print("torchrun-defaults --rdzv-conf is_host=true|false (c10d defaults otherwise)")


def ratio_line(elastic: Result, baseline: Result, deadline: float) -> str:
    if elastic.seconds is not None and baseline.seconds is not None:
        return (
            f"{baseline.launcher}/elastic-run = {baseline.seconds / elastic.seconds:.1f}x "
            f"({baseline.seconds:.2f} s vs {elastic.seconds:.2f} s)"
        )
    if elastic.seconds is not None:
        return (
            f"elastic-run recovered in {elastic.seconds:.2f} s; {baseline.launcher} did not within "
            f"{deadline:.0f} s (ratio > {deadline / elastic.seconds:.0f}x)"
        )
    if baseline.seconds is not None:
        return f"{baseline.launcher} recovered in {baseline.seconds:.2f} s; elastic-run did not within {deadline:.0f} s"
    return f"neither recovered within {deadline:.0f} s"


def terminate_like_ctrl_c(signum: int, frame) -> None:
    raise KeyboardInterrupt  # so that SIGTERM, too, runs every scenario's cleanup


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(message)s", datefmt="%H:%M:%S")
    signal.signal(signal.SIGTERM, terminate_like_ctrl_c)
    results: list[Result] = []
    try:
        for fault in args.faults:
            for launcher in args.launchers:
                logger.info("%s, %s of node%d of %d:", launcher, fault.upper(), FAULTED_NODE, NODES)
                result = run_scenario(launcher, fault, args)
                seconds = f"{result.seconds:.2f} s" if result.seconds is not None else "none"
                logger.info("  -> first collective after the fault: %s %s", seconds, result.note)
                results.append(result)
    except KeyboardInterrupt:
        logger.warning("interrupted: every process started was killed; results so far follow")
        print_report(results, args)
        return 130
    print_report(results, args)
    if args.plot is not None:
        plot(results, args)
    return 0


def plot(results: list[Result], args: argparse.Namespace) -> None:
    """Seconds to the first collective after each fault, one bar per launcher; a hatched bar at the deadline
    for none."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    figure, axes = plt.subplots(figsize=(8, 3.6), dpi=120)
    width = 0.8 / len(args.launchers)
    for index, launcher in enumerate(args.launchers):
        for position, fault in enumerate(args.faults):
            found = next((r for r in results if r.launcher == launcher and r.fault == fault), None)
            if found is None:
                continue
            x = position + (index - (len(args.launchers) - 1) / 2) * width
            seconds = found.seconds if found.seconds is not None else args.deadline
            bar = axes.bar(
                x,
                seconds,
                width,
                color=f"C{index}",
                label=launcher if position == 0 else None,
                hatch="//" if found.seconds is None else None,
                alpha=0.5 if found.seconds is None else 1,
            )
            text = f"{seconds:.2f}" if found.seconds is not None else f"none in {args.deadline:.0f}"
            axes.bar_label(bar, [text], fontsize=7)
    axes.set_xticks(range(len(args.faults)), [f"{f} ({FAULT_NAMES[f]})" for f in args.faults])
    axes.set_ylabel("seconds to the first collective after")
    axes.set_yscale("log")
    axes.legend(fontsize=8)
    axes.set_title(f"{NODES} nodes x {NPROC_PER_NODE} workers, the last node faulted, lease 1 s x 3", fontsize=9)
    figure.tight_layout()
    figure.savefig(args.plot)
    plt.close(figure)
    logger.info("plot written to %s", args.plot)


if __name__ == "__main__":
    sys.exit(main())
