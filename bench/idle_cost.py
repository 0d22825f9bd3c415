"""Idle cost: etcd requests and raft proposals per second of 3 real `elastic-run` agents whose workers just sleep.

For each --source checkout (default: this one), in one run on this machine:

  1. start one etcd (EtcdServer) and 3 agents as subprocesses, `python -m launcher.commands.cli --nnodes 3
     --nproc-per-node 1 --rdzv-backend etcd ... bench/sleep_worker.py`, with PYTHONPATH and cwd set to the
     checkout, so that `launcher` is imported from that tree (`git worktree add /tmp/elastic_before <commit>`
     gives an older one); every other flag is the CLI default (monitor_interval 0.1 s, lease 1 s x 3);
  2. wait until the round formed and all 3 workers are running (each writes a file into a ready directory);
  3. after --settle seconds, measure etcd's counters over --seconds of idleness (bench/etcd_metrics.py says
     what counts as a request);
  4. stop the agents (SIGTERM, then SIGKILL of their process groups after a grace) and etcd.

    python bench/idle_cost.py
    python bench/idle_cost.py --source /tmp/elastic_before,/work/main     # before/after in one run
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
BENCH = Path(__file__).resolve().parent
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(BENCH))

import etcd_metrics  # noqa: E402

from launcher.etcd.server import EtcdServer  # noqa: E402

logger = logging.getLogger("idle-cost")
NODES = 3


def describe(source: Path) -> str:
    try:
        commit = subprocess.run(
            ["git", "-C", str(source), "rev-parse", "--short", "HEAD"], capture_output=True, text=True, timeout=10
        ).stdout.strip()
        dirty = subprocess.run(
            ["git", "-C", str(source), "status", "--porcelain", "--", "launcher"],
            capture_output=True,
            text=True,
            timeout=10,
        ).stdout.strip()
    except (OSError, subprocess.SubprocessError):
        return "?"
    return f"{commit}{'+dirty launcher/' if dirty else ''}"


class IdleRun:
    """One checkout's measurement: its etcd, its agents (and their workers, in sessions of their own), its folder."""

    def __init__(self, source: Path, args: argparse.Namespace) -> None:
        self.source = source
        self.args = args
        self.workdir = Path(tempfile.mkdtemp(prefix="idle-cost-"))
        self.ready = self.workdir / "ready"  # each running worker writes a file here
        self.etcd: EtcdServer | None = None
        self.agents: list[subprocess.Popen] = []

    def measure(self) -> dict:
        result: dict[str, object] = {"source": str(self.source), "commit": describe(self.source)}
        try:
            self.etcd = EtcdServer(data_dir=str(self.workdir / "etcd")).start()
            self.start_agents(self.etcd.endpoint)
            self.wait_for_workers()
            logger.info("  %s: round formed, %d workers running; settling %.0f s", self.source, NODES, self.args.settle)
            time.sleep(self.args.settle)
            result.update(self.idle_window(self.etcd.endpoint))
            return result
        finally:
            self.stop_agents()
            self.kill_workers()
            self.wait_for_agents()
            if self.etcd is not None:
                self.etcd.stop()
            shutil.rmtree(self.workdir, ignore_errors=True)

    def agent_command(self, endpoint: str, node: str) -> list[str]:
        return [
            sys.executable,
            "-m",
            "launcher.commands.cli",
            "--nnodes",
            str(NODES),
            "--nproc-per-node",
            "1",
            "--rdzv-backend",
            "etcd",
            "--rdzv-endpoint",
            endpoint,
            "--rdzv-id",
            "idle",
            "--node-id",
            node,
            "--log-dir",
            str(self.workdir / node),
            str(BENCH / "sleep_worker.py"),
            "--seconds",
            str(self.args.worker_seconds),
            "--ready-dir",
            str(self.ready),
        ]

    def start_agents(self, endpoint: str) -> None:
        """The agents run from the checkout (cwd and PYTHONPATH), each in a session of its own; output in n<k>.out."""
        env = dict(os.environ, PYTHONPATH=str(self.source), PYTHONUNBUFFERED="1")
        for k in range(NODES):
            with open(self.workdir / f"n{k}.out", "ab") as out:
                self.agents.append(
                    subprocess.Popen(
                        self.agent_command(endpoint, f"n{k}"),
                        cwd=self.source,
                        env=env,
                        stdout=out,
                        stderr=subprocess.STDOUT,
                        stdin=subprocess.DEVNULL,
                        start_new_session=True,
                    )
                )

    def wait_for_workers(self) -> None:
        """Until every worker runs; RuntimeError if an agent exits first or --startup-timeout passes."""
        deadline = time.monotonic() + self.args.startup_timeout
        while len(list(self.ready.glob("*"))) < NODES:
            exited = [a.pid for a in self.agents if a.poll() is not None]
            if exited or time.monotonic() > deadline:
                tail = (self.workdir / "n0.out").read_text(errors="replace")[-1500:]
                raise RuntimeError(
                    f"workers not running ({len(list(self.ready.glob('*')))} of {NODES}; agents exited: "
                    f"{exited}); n0 said:\n{tail}"
                )
            time.sleep(0.1)

    def idle_window(self, endpoint: str) -> dict[str, object]:
        """etcd's counters over --seconds of idleness."""
        before = etcd_metrics.scrape(endpoint)
        time.sleep(self.args.seconds)
        after = etcd_metrics.scrape(endpoint)
        d = etcd_metrics.delta(before, after)
        return dict(
            seconds=round(d.seconds, 2),
            requests=int(d.requests),
            requests_per_s=round(d.requests / d.seconds, 2),
            requests_per_agent_s=round(d.requests / d.seconds / NODES, 3),
            calls=int(d.calls),
            proposals=int(d.proposals),
            proposals_per_s=round(d.proposals / d.seconds, 2),
            sent_bytes_per_s=int(d.sent_bytes / d.seconds),
            by_method={m: int(v) for m, v in d.by_method.items()},
            agents_alive=sum(a.poll() is None for a in self.agents),
        )

    def stop_agents(self) -> None:
        """SIGTERM, --stop-grace to leave, then SIGKILL of each agent's session (the agent itself, if still there)."""
        for agent in self.agents:
            if agent.poll() is None:
                agent.send_signal(signal.SIGTERM)
        deadline = time.monotonic() + self.args.stop_grace
        for agent in self.agents:
            try:
                agent.wait(timeout=max(0.1, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                pass
        for agent in self.agents:
            try:
                os.killpg(agent.pid, signal.SIGKILL)
            except (ProcessLookupError, PermissionError):
                pass

    def kill_workers(self) -> None:
        """The workers run in sessions of their own (their pids are in the ready files' names)."""
        for pidfile in self.ready.glob("*") if self.ready.is_dir() else []:
            try:
                pid = int(pidfile.name.split(".")[1])
                os.killpg(os.getpgid(pid), signal.SIGKILL)
            except (ValueError, IndexError, ProcessLookupError, PermissionError):
                pass

    def wait_for_agents(self) -> None:
        for agent in self.agents:
            try:
                agent.wait(timeout=5)
            except subprocess.TimeoutExpired:
                logger.warning("  agent pid %d did not exit", agent.pid)


def measure(source: Path, args: argparse.Namespace) -> dict:
    """etcd's idle cost of 3 agents run from `source` (see the module docstring)."""
    return IdleRun(source, args).measure()


def print_table(results: list[dict]) -> None:
    header = (
        "source",
        "commit",
        "seconds",
        "requests",
        "req/s",
        "req/s/agent",
        "calls",
        "proposals/s",
        "bytes/s",
        "by method",
    )
    rows = [
        (
            r["source"],
            r["commit"],
            f"{r['seconds']:.1f}",
            str(r["requests"]),
            f"{r['requests_per_s']:.1f}",
            f"{r['requests_per_agent_s']:.2f}",
            str(r["calls"]),
            f"{r['proposals_per_s']:.1f}",
            str(r["sent_bytes_per_s"]),
            " ".join(f"{m}={v}" for m, v in r["by_method"].items()),
        )
        for r in results
        if "requests" in r
    ]
    widths = [max(len(row[i]) for row in [header, *rows]) for i in range(len(header) - 1)]
    print()
    for row in [header, *rows]:
        print(" | ".join(c.ljust(w) for c, w in zip(row, widths)) + " | " + row[-1])
    for r in results:
        if "error" in r:
            print(f"{r['source']}: ERROR {r['error']}")
    done = [r for r in results if "requests" in r]
    if len(done) == 2 and done[1]["requests"]:
        print(
            f"\n{done[0]['commit']} / {done[1]['commit']}: {done[0]['requests'] / done[1]['requests']:.1f}x the "
            f"requests, {done[0]['proposals']} vs {done[1]['proposals']} raft proposals in "
            f"{done[0]['seconds']:.0f} s"
        )
    print(
        f"\n{NODES} agents, --nnodes {NODES} --nproc-per-node 1, CLI defaults otherwise; requests = unary calls + "
        "messages on streams (a lease refresh is 1); calls = grpc_server_handled_total (all) + stream messages"
    )


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(
        description=__doc__.splitlines()[0],
        formatter_class=argparse.RawDescriptionHelpFormatter,
        epilog="\n".join(__doc__.splitlines()[2:]),
    )
    parser.add_argument(
        "--source", default=str(REPO), help="comma-separated checkouts to run the agents from (default: this one)"
    )
    parser.add_argument("--seconds", type=float, default=10.0, help="idle window (default 10)")
    parser.add_argument("--settle", type=float, default=2.0, help="wait after the workers started (default 2)")
    parser.add_argument("--startup-timeout", type=float, default=60.0, help="for the round to form (default 60)")
    parser.add_argument("--stop-grace", type=float, default=15.0, help="SIGTERM to SIGKILL (default 15)")
    parser.add_argument("--worker-seconds", type=float, default=600.0, help="how long workers sleep (default 600)")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(message)s", datefmt="%H:%M:%S")
    results = []
    for source in [Path(s.strip()).resolve() for s in args.source.split(",") if s.strip()]:
        if not (source / "launcher" / "commands" / "cli.py").is_file():
            results.append({"source": str(source), "error": "no launcher/commands/cli.py there"})
            continue
        logger.info("agents from %s (%s):", source, describe(source))
        try:
            result = measure(source, args)
        except RuntimeError as exc:
            result = {"source": str(source), "error": str(exc)}
        results.append(result)
        print(json.dumps(result), flush=True)
    print_table(results)
    return 0 if all("error" not in r for r in results) else 1


if __name__ == "__main__":
    sys.exit(main())
