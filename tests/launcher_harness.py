"""Real elastic-run agents against a real etcd, for the launcher's scenario tests.

Every process starts in its own session so a test can kill exactly one node (agent pid, workers die with it),
and `Cluster.close` kills whatever is left, stopped or not, even when the test failed.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
PROBE = REPO / "examples" / "collective_probe.py"
FAST_RDZV = "keep_alive_interval=0.5,keep_alive_max_attempt=3,last_call_timeout=1,join_timeout=60"
# the reason of a member lost on its probe, found silent against its peers' answers (launcher.rendezvous.liveness)
PROBE_MISSED = re.compile(
    r"no answer to a liveness probe within \d+\.\d\ds, while \d+ other member\(s\) answered within "
    r"\d+\.\d{3}s \(probe_timeout=0\.5s\)"
)


def elastic_run_command() -> list[str]:
    """The installed console script when there is one (what users run), else the module."""
    script = shutil.which("elastic-run")
    return [script] if script else [sys.executable, "-m", "launcher.commands.cli"]


def worker_env() -> dict[str, str]:
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1")
    env.pop("PET_NNODES", None)
    return env


class Agent:
    def __init__(self, node_id: str, process: subprocess.Popen, log_dir: Path, output: Path) -> None:
        self.node_id = node_id
        self.process = process
        self.log_dir = log_dir
        self.output = output

    @property
    def pid(self) -> int:
        return self.process.pid

    def wait(self, timeout: float) -> int:
        return self.process.wait(timeout=timeout)

    def text(self) -> str:
        return self.output.read_text(errors="replace")

    def membership(self) -> list[dict]:
        path = self.log_dir / "membership.jsonl"
        return [json.loads(line) for line in path.read_text().splitlines()] if path.is_file() else []


class Cluster:
    """Agents of one or more jobs on one etcd endpoint, all under `root`."""

    def __init__(self, endpoint: str, root: Path) -> None:
        self.endpoint = endpoint
        self.root = root
        self.agents: list[Agent] = []
        self.probe_log = root / "probe.jsonl"

    def start(
        self,
        node_id: str,
        script_args: list[str],
        *,
        rdzv_id: str = "job",
        nnodes: str = "1",
        nproc: int = 2,
        rdzv_conf: str = FAST_RDZV,
        extra: list[str] = (),
        script: Path = PROBE,
        env: dict[str, str | None] | None = None,
    ) -> Agent:
        log_dir = self.root / node_id
        log_dir.mkdir(parents=True, exist_ok=True)
        command = [
            *elastic_run_command(),
            "--nnodes",
            nnodes,
            "--nproc-per-node",
            str(nproc),
            "--rdzv-backend",
            "etcd",
            "--rdzv-endpoint",
            self.endpoint,
            "--rdzv-id",
            rdzv_id,
            "--rdzv-conf",
            rdzv_conf,
            "--node-id",
            node_id,
            "--log-dir",
            str(log_dir),
            "--worker-stop-timeout",
            "2",
            *extra,
            str(script),
            *script_args,
        ]
        output = self.root / f"{node_id}.out"
        process_env = worker_env()
        for name, value in (env or {}).items():
            if value is None:
                process_env.pop(name, None)
            else:
                process_env[name] = value
        with open(output, "ab") as sink:
            process = subprocess.Popen(
                command, stdout=sink, stderr=subprocess.STDOUT, env=process_env, cwd=REPO, start_new_session=True
            )
        agent = Agent(node_id, process, log_dir, output)
        self.agents.append(agent)
        return agent

    def probe(self, steps: int = 400, step_time: float = 0.1, *more: str) -> list[str]:
        return [
            "--steps",
            str(steps),
            "--step-time",
            str(step_time),
            "--log",
            str(self.probe_log),
            "--stop-file",
            str(self.stop_file),
            *more,
        ]

    @property
    def stop_file(self) -> Path:
        return self.root / "stop-training"

    def stop_training(self) -> None:
        """The probes end together after their next collective: the test has seen what it waited for."""
        self.stop_file.touch()

    def stop_all(self, agents: list[Agent], timeout: float) -> None:
        """SIGTERM every one of `agents` at once, as a whole-job preemption or a time limit does, and check that
        each drained and left as told (exit 128 + SIGTERM) within `timeout`."""
        for agent in agents:
            os.kill(agent.pid, signal.SIGTERM)
        for agent in agents:
            assert agent.wait(timeout=timeout) == 128 + signal.SIGTERM, self.dump()

    def collectives(self) -> list[dict]:
        if not self.probe_log.is_file():
            return []
        return [json.loads(line) for line in self.probe_log.read_text().splitlines() if line.strip()]

    def log(self, rdzv_id: str = "job") -> list[dict]:
        """The job's membership log as etcd holds it now; an agent's membership.jsonl is complete once it exits
        (the controller's is kept current while the job runs)."""
        from launcher.etcd import client as etcd_client
        from launcher.rendezvous.protocol import JobStore

        client = etcd_client.connect(self.endpoint)
        try:
            return [json.loads(e.dumps()) for e in JobStore(client, rdzv_id).read_events()]
        finally:
            client.close()

    def controller(self, rdzv_id: str = "job") -> str | None:
        """The node that holds the job's controller key now."""
        from launcher.etcd import client as etcd_client
        from launcher.rendezvous.protocol import Holder, JobKeys

        client = etcd_client.connect(self.endpoint)
        try:
            raw, _ = client.get(JobKeys(rdzv_id).controller)
        finally:
            client.close()
        return Holder.decode(raw.decode()).node if raw is not None else None

    def events(self, name: str, rdzv_id: str = "job") -> list[dict]:
        return [e for e in self.log(rdzv_id) if e["event"] == name]

    def wait_for(self, predicate, timeout: float, what: str):
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            value = predicate()
            if value:
                return value
            time.sleep(0.2)
        raise AssertionError(f"timed out after {timeout:.0f}s waiting for {what}\n{self.dump()}")

    def wait_for_world(self, world_size: int, timeout: float, after: float = 0.0) -> dict:
        def first():
            return next((c for c in self.collectives() if c["world_size"] == world_size and c["time"] > after), None)

        return self.wait_for(first, timeout, f"a collective in a world of {world_size}")

    def dump(self) -> str:
        parts = []
        for agent in self.agents:
            parts.append(
                f"--- {agent.node_id} (pid {agent.pid}, rc {agent.process.poll()}) ---\n{agent.text()[-3000:]}"
            )
        return "\n".join(parts)

    def close(self) -> None:
        for agent in self.agents:
            for signum in (signal.SIGCONT, signal.SIGKILL):
                try:
                    os.killpg(agent.pid, signum)
                except (ProcessLookupError, PermissionError):
                    pass
            try:
                agent.process.wait(timeout=10)
            except subprocess.TimeoutExpired:
                pass


def wait_until(predicate, timeout: float, what: str):
    """`predicate`'s first true value, polled every 50 ms; fails the test past `timeout`."""
    deadline = time.monotonic() + timeout
    while True:
        value = predicate()
        if value or time.monotonic() > deadline:
            assert value, f"timed out after {timeout:.0f}s waiting for {what}"
            return value
        time.sleep(0.05)


def membership_changes(log: list[dict]) -> list[dict]:
    """The log without training_progress: the events whose order a test can state exactly."""
    return [e for e in log if e["event"] != "training_progress"]


def events(agent: Agent, name: str) -> list[dict]:
    return [e for e in agent.membership() if e["event"] == name]


def resume(pids: list[int]) -> None:
    """SIGCONT each of `pids`, paused by a test. One that ended meanwhile is skipped: a process already on its way
    out when it was paused (a round's store closing, say) exits even while stopped."""
    for pid in pids:
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGCONT)
