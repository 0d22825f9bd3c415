"""Several "hosts" on one machine: Linux network namespaces on a private bridge, for multi-node tests.

`Network` creates one namespace for etcd, which also holds the bridge (the "switch"), and one per node, each
with a veth `eth0` on the bridge and its own address on a private /24 (10.77.0.0/24). Namespaces, not the
machine's, hold every interface, address and route, so no packet leaves them and no address of the machine
is used. `ip netns` gives each its own network stack only: they share the machine's hostname and files, which
is what these tests need (a hostname that resolves to loopback, as on many real hosts). Their /etc/hosts is made
to say so through ip-netns' own mechanism (/etc/netns/<name>/hosts is bind-mounted over /etc/hosts there).

`Network.close` kills every process it started (by pid: each is its own process group) and deletes the
namespaces and their /etc/netns files, even after a failed test; the processes also die with the test process
(PR_SET_PDEATHSIG), so nothing outlives a killed pytest.
"""

from __future__ import annotations

import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import uuid
from pathlib import Path

from launcher.etcd_server import find_etcd_binary
from launcher.process_tree import orphan_safe_command

SUBNET = "10.77.0"  # /24, private to these namespaces
ETCD_ADDR = f"{SUBNET}.1"
ETCD_PORT = 2379  # the etcd namespace is ours alone, so the default port cannot be taken
NODE_IFACE = "eth0"  # the name of each node namespace's interface, as on a real host


def _ip(*args: str, check: bool = True) -> subprocess.CompletedProcess:
    return subprocess.run(["ip", *args], capture_output=True, text=True, check=check, timeout=30)


def unavailable_reason() -> str | None:
    """Why network-namespace tests cannot run here, or None when they can (tried for real, then removed)."""
    if not sys.platform.startswith("linux"):
        return "network namespaces are Linux-only"
    if os.geteuid() != 0:
        return "creating network namespaces needs root"
    if shutil.which("ip") is None:
        return "`ip` (iproute2) is not installed"
    probe = f"elprobe-{uuid.uuid4().hex[:8]}"
    try:
        _ip("netns", "add", probe)
        _ip("-n", probe, "link", "add", "br0", "type", "bridge")
        _ip("-n", probe, "link", "add", "v0", "type", "veth", "peer", "name", "v1")
    except (OSError, subprocess.SubprocessError) as exc:
        detail = getattr(exc, "stderr", "") or str(exc)
        return f"`ip netns` with a bridge and veth pairs is not available: {detail.strip()}"
    finally:
        _ip("netns", "del", probe, check=False)
    return None


def hostname_resolution(namespace: str) -> str:
    """What the shared hostname resolves to inside `namespace` (getent, as glibc and so gloo see it)."""
    result = subprocess.run(["ip", "netns", "exec", namespace, "getent", "ahostsv4", socket.gethostname()],
                            capture_output=True, text=True, timeout=30)  # fmt: skip
    return result.stdout.split()[0] if result.stdout.split() else ""


class Network:
    """An etcd namespace with the bridge, and `nodes` node namespaces, each a veth away from the bridge."""

    def __init__(self, nodes: int, root: Path) -> None:
        tag = f"el{os.getpid()}{uuid.uuid4().hex[:4]}"
        self.root = root
        self.etcd_ns = f"{tag}-etcd"
        self.node_ns = [f"{tag}-node{i}" for i in range(nodes)]
        self.node_addrs = [f"{SUBNET}.{i + 2}" for i in range(nodes)]
        self.processes: list[subprocess.Popen] = []
        self._etcd_data = Path(tempfile.mkdtemp(prefix="elastic-netns-etcd-"))

    @property
    def namespaces(self) -> list[str]:
        return [self.etcd_ns, *self.node_ns]

    @property
    def endpoint(self) -> str:
        return f"{ETCD_ADDR}:{ETCD_PORT}"

    def create(self) -> "Network":
        hostname = socket.gethostname()
        for ns in self.namespaces:
            _ip("netns", "add", ns)
            _ip("-n", ns, "link", "set", "lo", "up")
            # The failing case of the issue: every host resolves the shared hostname to loopback
            hosts = Path("/etc/netns") / ns / "hosts"
            try:
                hosts.parent.mkdir(parents=True, exist_ok=True)
                hosts.write_text(f"127.0.0.1 localhost\n127.0.1.1 {hostname}\n")
            except OSError:  # a read-only /etc: the machine's own /etc/hosts applies (see hostname_resolution)
                pass
        _ip("-n", self.etcd_ns, "link", "add", "br0", "type", "bridge")
        _ip("-n", self.etcd_ns, "addr", "add", f"{ETCD_ADDR}/24", "dev", "br0")
        _ip("-n", self.etcd_ns, "link", "set", "br0", "up")
        for i, (ns, addr) in enumerate(zip(self.node_ns, self.node_addrs)):
            port = f"veth{i}"
            _ip("-n", self.etcd_ns, "link", "add", port, "type", "veth", "peer", "name", NODE_IFACE, "netns", ns)
            _ip("-n", self.etcd_ns, "link", "set", port, "master", "br0", "up")
            _ip("-n", ns, "addr", "add", f"{addr}/24", "dev", NODE_IFACE)
            _ip("-n", ns, "link", "set", NODE_IFACE, "up")
        return self

    def popen(self, namespace: str, command: list[str], output: Path, env: dict[str, str] | None = None,
              cwd: Path | None = None) -> subprocess.Popen:  # fmt: skip
        """`command` inside `namespace`, in its own process group, killed if the test process dies."""
        with open(output, "ab") as sink:
            process = subprocess.Popen(orphan_safe_command(["ip", "netns", "exec", namespace, *command]),
                                       stdout=sink, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                       env=env, cwd=cwd, start_new_session=True)  # fmt: skip
        self.processes.append(process)
        return process

    def start_etcd(self, timeout_s: float = 30.0) -> None:
        """A real etcd in the etcd namespace on its bridge address; returns once a node namespace reaches it."""
        client_url, peer_url = f"http://{ETCD_ADDR}:{ETCD_PORT}", f"http://{ETCD_ADDR}:{ETCD_PORT + 1}"
        command = [
            find_etcd_binary(), "--name", "elastic", "--data-dir", str(self._etcd_data / "member"),
            "--listen-client-urls", client_url, "--advertise-client-urls", client_url,
            "--listen-peer-urls", peer_url, "--initial-advertise-peer-urls", peer_url,
            "--initial-cluster", f"elastic={peer_url}", "--log-level", "error",
        ]  # fmt: skip
        etcd = self.popen(self.etcd_ns, command, self.root / "etcd.log")
        # Readiness is checked from a node namespace, over the bridge: the path the agents will take
        probe = (
            "import sys, time, urllib.request\n"
            f"deadline = time.monotonic() + {timeout_s}\n"
            "while True:\n"
            "    try:\n"
            f"        urllib.request.urlopen('{client_url}/health', timeout=1).read(); break\n"
            "    except OSError as exc:\n"
            "        if time.monotonic() > deadline: sys.exit(f'etcd not reachable: {exc}')\n"
            "        time.sleep(0.2)\n"
        )
        result = subprocess.run(["ip", "netns", "exec", self.node_ns[0], sys.executable, "-c", probe],
                                capture_output=True, text=True, timeout=timeout_s + 30)  # fmt: skip
        if result.returncode != 0:
            log = (self.root / "etcd.log").read_text(errors="replace")[-2000:]
            raise RuntimeError(f"etcd in {self.etcd_ns} not ready (rc {etcd.poll()}): {result.stderr}\n{log}")

    def close(self) -> None:
        for process in self.processes:
            for signum in (signal.SIGCONT, signal.SIGKILL):
                try:
                    os.killpg(process.pid, signum)  # its own group: the process and its children
                except (ProcessLookupError, PermissionError):
                    pass
            try:
                process.wait(timeout=10)
            except subprocess.TimeoutExpired:
                pass
        for ns in self.namespaces:
            _ip("netns", "del", ns, check=False)  # takes its interfaces, the bridge and veths with it
            shutil.rmtree(Path("/etc/netns") / ns, ignore_errors=True)
        try:
            os.rmdir("/etc/netns")  # only when no one else keeps files there
        except OSError:
            pass
        shutil.rmtree(self._etcd_data, ignore_errors=True)
