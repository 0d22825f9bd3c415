"""Multi-node jobs across Linux network namespaces, one per "host", every host with its own address.

The namespaces share the machine's hostname, and it resolves to loopback in each of them: gloo, left to find
its address from the hostname, would announce 127.0.1.1 and every connectFullMesh would be refused. The agents
run without GLOO_SOCKET_IFNAME in their environment, so the job finishing proves elastic-run sets it.
"""

from __future__ import annotations

import ipaddress
import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest
from netns_harness import NODE_IFACE, Network, hostname_resolution, unavailable_reason

REPO = Path(__file__).resolve().parents[2]
PROBE = REPO / "examples" / "collective_probe.py"
GLOO_ENV = Path(__file__).resolve().parents[1] / "workers" / "gloo_env.py"
FAST_RDZV = "keep_alive_interval=0.5,keep_alive_max_attempt=3,last_call_timeout=1,join_timeout=60"
NODES, NPROC = 3, 2

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def network(tmp_path_factory):
    """Three node namespaces and an etcd namespace on a private bridge, removed after the module's tests."""
    reason = unavailable_reason()
    if reason:
        pytest.fail(f"{reason} (these tests need network namespaces; CI runs as root)")
    net = Network(NODES, tmp_path_factory.mktemp("netns"))
    try:
        net.create()
        net.start_etcd()
        yield net
    finally:
        net.close()


def agent_env() -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("PET_")}
    env.pop("GLOO_SOCKET_IFNAME", None)  # what is under test: elastic-run must choose it
    env.update(OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1")
    return env


def run_job(
    network: Network, root: Path, rdzv_id: str, script: Path, script_args: list[str], timeout_s: float = 150.0
) -> list[tuple[int | None, str]]:
    """One agent per node namespace, no --local-addr (the address facing etcd); (exit code, output) of each."""
    agents = []
    for i, ns in enumerate(network.node_ns):
        command = [
            sys.executable,
            "-m",
            "launcher.commands.cli",
            "--nnodes",
            str(NODES),
            "--nproc-per-node",
            str(NPROC),
            "--rdzv-backend",
            "etcd",
            "--rdzv-endpoint",
            network.endpoint,
            "--rdzv-id",
            rdzv_id,
            "--rdzv-conf",
            FAST_RDZV,
            "--node-id",
            f"node{i}",
            "--log-dir",
            str(root / f"node{i}"),
            "--worker-stop-timeout",
            "2",
            str(script),
            *script_args,
        ]
        output = root / f"node{i}.out"
        agents.append((network.popen(ns, command, output, env=agent_env(), cwd=REPO), output))
    deadline = time.monotonic() + timeout_s
    for process, _ in agents:
        try:
            process.wait(timeout=max(deadline - time.monotonic(), 0.1))
        except subprocess.TimeoutExpired:
            break
    return [(process.poll(), output.read_text(errors="replace")) for process, output in agents]


def describe(results: list[tuple[int | None, str]]) -> str:
    return "\n".join(f"--- node{i} (rc {rc}) ---\n{text[-4000:]}" for i, (rc, text) in enumerate(results))


@pytest.mark.timeout(300)
def test_job_across_namespaces_without_gloo_ifname(network, tmp_path):
    resolved = hostname_resolution(network.node_ns[0])
    # The case of the issue; were it not loopback, gloo would still pick an address no namespace holds
    print(f"hostname resolves to {resolved!r} in the node namespaces")
    assert resolved and ipaddress.ip_address(resolved) not in map(ipaddress.ip_address, network.node_addrs)
    probe_log = tmp_path / "probe.jsonl"
    steps = 20
    results = run_job(
        network, tmp_path, "job", PROBE, ["--steps", str(steps), "--step-time", "0.05", "--log", str(probe_log)]
    )
    assert [rc for rc, _ in results] == [0] * NODES, describe(results)
    collectives = [json.loads(line) for line in probe_log.read_text().splitlines() if line.strip()]
    at_six = [c for c in collectives if c["world_size"] == NODES * NPROC]
    assert {c["rank"] for c in at_six} == set(range(NODES * NPROC)), describe(results)
    assert {c["step"] for c in at_six} == set(range(steps))


@pytest.mark.timeout(300)
def test_workers_are_given_the_interface_holding_the_node_address(network, tmp_path):
    out = tmp_path / "env"
    out.mkdir()
    results = run_job(network, tmp_path, "ifname", GLOO_ENV, [str(out)])
    assert [rc for rc, _ in results] == [0] * NODES, describe(results)
    records = [json.loads((out / f"rank{r}.json").read_text()) for r in range(NODES * NPROC)]
    assert {r["GLOO_SOCKET_IFNAME"] for r in records} == {NODE_IFACE}
    assert {r["all_reduce"] for r in records} == {float(NODES * NPROC)}
    # each agent chose the interface from its own namespace's address, the one facing etcd
    for (_, text), addr in zip(results, network.node_addrs):
        assert f"GLOO_SOCKET_IFNAME={NODE_IFACE} (the interface holding {addr})" in text, text[-3000:]
