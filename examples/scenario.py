"""The user stories, run for real on this machine: several elastic-run "nodes" share one host and one etcd.

    python examples/scenario.py kill-node   # 3 nodes x 2 workers; SIGKILL one; the other two carry on at 4
    python examples/scenario.py hang-node   # same, but the node is SIGSTOPped (a hung host)
    python examples/scenario.py grow        # 2 nodes x 4 workers = 8; two more nodes join: 16 workers

Each runs examples/train.py with a shared checkpoint directory, prints the trainer's progress as it comes,
then the job's membership log (`elastic-run log`) and what the sample log says about the resize: the
step each world size resumed from and whether every step's samples were used exactly once. If the job fails
(a worker that cannot even import `elastic`, say), it stops as soon as its agents have exited, prints the
failure summary and the membership log, and exits 1.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from launcher.etcd.server import EtcdServer  # noqa: E402
from launcher.workers.process_tree import child_pids  # noqa: E402

RDZV_CONF = "last_call_timeout=3"
# once one agent has failed, how long the others get to follow before the scenario stops waiting for them
AGENT_EXIT_GRACE_S = 15.0
GLOBAL_BATCH = 48


def start_node(
    endpoint: str, node: str, nnodes: str, nproc: int, work: Path, train_args: list[str]
) -> subprocess.Popen:
    command = [
        sys.executable,
        "-m",
        "launcher.commands.cli",
        "--nnodes",
        nnodes,
        "--nproc-per-node",
        str(nproc),
        "--rdzv-endpoint",
        endpoint,
        "--rdzv-id",
        "scenario",
        "--rdzv-conf",
        RDZV_CONF,
        "--node-id",
        node,
        "--log-dir",
        str(work / "logs" / node),
        "--tee",
        "1",
        "--local-ranks-filter",
        "0",
        str(REPO / "examples" / "train.py"),
        *train_args,
    ]
    print(f"$ elastic-run --node-id {node} ... ({nproc} workers)", flush=True)
    return subprocess.Popen(
        command,
        cwd=REPO,
        start_new_session=True,
        env=dict(os.environ, OMP_NUM_THREADS="1"),
        stderr=open(work / f"{node}.err", "w"),
    )


def steps_done(sample_log: Path) -> list[dict]:
    if not sample_log.is_file():
        return []
    return [json.loads(line) for line in sample_log.read_text().splitlines() if line.strip()]


class ScenarioStopped(Exception):
    """The job ended, or never got where the scenario waits for it to be: nothing more is coming."""


def wait_until(predicate, timeout: float, what: str, agents: list[subprocess.Popen]) -> None:
    """Wait for `predicate`, but no longer than the agents live: a failed job ends with every agent exiting."""
    deadline = time.monotonic() + timeout
    first_failure: float | None = None
    while not predicate():
        codes = [agent.poll() for agent in agents]
        if all(code is not None for code in codes):
            raise ScenarioStopped(f"every agent exited (exit codes {codes}) before {what}")
        # a failed job takes every agent down within moments; one that failed alone leaves the rest waiting
        if first_failure is None and any(code not in (None, 0) for code in codes):
            first_failure = time.monotonic()
        if first_failure is not None and time.monotonic() - first_failure > AGENT_EXIT_GRACE_S:
            raise ScenarioStopped(f"agents exited with {codes} (None: still running) before {what}")
        if time.monotonic() > deadline:
            raise ScenarioStopped(f"timed out after {timeout:.0f} s waiting for {what}")
        time.sleep(0.5)


def print_failure(work: Path, agents: list[subprocess.Popen]) -> None:
    """What the workers printed and the job's failure summary (`elastic-run: ...`), from the agents' stderr."""
    worker_lines: list[str] = []
    summaries: list[str] = []
    for index in range(len(agents)):
        lines = (work / f"node{index}.err").read_text(errors="replace").splitlines()
        starts = [i for i, line in enumerate(lines) if line.startswith("elastic-run: ")]
        end = starts[-1] if starts else len(lines)
        # workers' stderr goes to their agent's; its own log lines start with "[elastic-run"
        worker_lines += [line for line in lines[:end] if line.strip() and not line.startswith("[elastic-run")]
        summary = "\n".join(lines[end : end + 30]) if starts else ""
        if summary and summary not in summaries:
            summaries.append(summary)
    if worker_lines:
        print("\n== the workers' stderr (last lines) ==")
        print("\n".join(list(dict.fromkeys(worker_lines))[-15:]))
    print("\n== job failure (elastic-run) ==")
    print("\n".join(summaries) or f"no agent printed a summary; see {work}/node*.err", flush=True)


def print_membership_log(endpoint: str) -> None:
    print("\n== membership log (elastic-run log) ==", flush=True)
    subprocess.run(
        [sys.executable, "-m", "launcher.commands.cli", "log", "--rdzv-endpoint", endpoint, "--rdzv-id", "scenario"],
        cwd=REPO,
        check=False,
        timeout=60,
    )


def report(endpoint: str, sample_log: Path, global_batch: int) -> None:
    print_membership_log(endpoint)
    print("\n== training, from the sample log ==")
    latest: dict[int, tuple[int, list[int]]] = {}  # step -> (round, samples): a redone step counts once
    for record in steps_done(sample_log):
        round_, samples = latest.get(record["step"], (-1, []))
        if record["round"] > round_:
            latest[record["step"]] = (record["round"], list(record["samples"]))
        elif record["round"] == round_:
            samples.extend(record["samples"])
    worlds: dict[int, list[int]] = {}
    for record in steps_done(sample_log):
        if latest[record["step"]][0] == record["round"]:
            worlds.setdefault(record["world_size"], []).append(record["step"])
    for world, steps in worlds.items():
        print(f"world size {world:3d}: steps {min(steps)}..{max(steps)}")
    used = [i for _, samples in latest.values() for i in samples]
    print(
        f"{len(latest)} steps: {len(used)} samples used, {len(set(used))} distinct, "
        f"{len(latest) * global_batch} expected"
    )
    rounds_of: dict[int, set[int]] = {}
    for record in steps_done(sample_log):
        rounds_of.setdefault(record["step"], set()).add(record["round"])
    redone = sorted(step for step, rounds in rounds_of.items() if len(rounds) > 1)
    print(f"steps redone after a change: {len(redone)}" + (f" ({redone[0]}..{redone[-1]})" if redone else ""))


def run(args: argparse.Namespace) -> int:
    work = Path(args.workdir or tempfile.mkdtemp(prefix=f"elastic-{args.scenario}-"))
    work.mkdir(parents=True, exist_ok=True)
    sample_log = work / "samples.jsonl"
    train_args = [
        "--steps",
        str(args.steps),
        "--ckpt-dir",
        str(work / "ckpt"),
        "--ckpt-every",
        "10",
        "--sample-log",
        str(sample_log),
        "--global-batch",
        str(GLOBAL_BATCH),
        "--micro-batch",
        "16",
    ]
    nodes: list[subprocess.Popen] = []
    with EtcdServer() as etcd:
        try:
            if args.scenario == "grow":
                nodes += [start_node(etcd.endpoint, f"node{i}", "2:4", 4, work, train_args) for i in range(2)]
                wait_until(
                    lambda: any(r["world_size"] == 8 and r["step"] >= 15 for r in steps_done(sample_log)),
                    600,
                    "8 workers to train",
                    nodes,
                )
                print("\n>>> two more nodes join the running job", flush=True)
                nodes += [start_node(etcd.endpoint, f"node{i}", "2:4", 4, work, train_args) for i in range(2, 4)]
                wait_until(
                    lambda: any(r["world_size"] == 16 for r in steps_done(sample_log)),
                    600,
                    "16 workers to train",
                    nodes,
                )
            else:
                nodes += [start_node(etcd.endpoint, f"node{i}", "2:3", 2, work, train_args) for i in range(3)]
                wait_until(
                    lambda: any(r["world_size"] == 6 and r["step"] >= 15 for r in steps_done(sample_log)),
                    600,
                    "6 workers to train",
                    nodes,
                )
                victim = nodes[2]
                if args.scenario == "kill-node":
                    print(f"\n>>> SIGKILL node2 (agent pid {victim.pid}; its workers die with it)", flush=True)
                    os.kill(victim.pid, signal.SIGKILL)
                else:
                    print(f"\n>>> SIGSTOP node2 (agent pid {victim.pid}) and its workers: a hung host", flush=True)
                    os.killpg(victim.pid, signal.SIGSTOP)
                    for pid in child_pids(victim.pid):
                        os.kill(pid, signal.SIGSTOP)
            survivors = nodes[:2] if args.scenario != "grow" else nodes
            codes = [node.wait(timeout=900) for node in survivors]
            print(f"\nagents exited with {codes}")
            if any(code != 0 for code in codes):
                print_failure(work, nodes)
            report(etcd.endpoint, sample_log, GLOBAL_BATCH)
            print(f"\nlogs, checkpoints and the sample log are in {work}")
            return 0 if all(code == 0 for code in codes) else 1
        except ScenarioStopped as stopped:
            print(f"\nscenario {args.scenario} stopped: {stopped}", flush=True)
            print_failure(work, nodes)
            print_membership_log(etcd.endpoint)
            print(f"\nlogs are in {work}", flush=True)
            return 1
        finally:
            for node in nodes:
                for signum in (signal.SIGCONT, signal.SIGKILL):
                    try:
                        os.killpg(node.pid, signum)
                    except ProcessLookupError:
                        pass
                node.wait()


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("scenario", choices=["kill-node", "hang-node", "grow"])
    parser.add_argument("--steps", type=int, default=60, help="training steps of the whole run")
    parser.add_argument("--workdir", help="where logs and checkpoints go (default: a new temp dir)")
    return run(parser.parse_args())


if __name__ == "__main__":
    sys.exit(main())
