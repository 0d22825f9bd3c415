"""launcher.workers.network: which interface gloo is told to use, and when elastic-run leaves GLOO_SOCKET_IFNAME
alone."""

from __future__ import annotations

import json
import logging
import os
import shutil
import subprocess
import sys
import uuid
from pathlib import Path
from types import SimpleNamespace

import pytest

from launcher.rendezvous.records import MasterRecord
from launcher.workers import network
from launcher.workers.environment import ROUND_VARIABLES, node_worker_env, standby_env, worker_env
from launcher.workers.network import gloo_interface_env, interface_holding

REPO = Path(__file__).resolve().parents[2]
GLOO_ENV = Path(__file__).resolve().parents[1] / "workers" / "gloo_env.py"


@pytest.fixture(autouse=True)
def fresh_decisions():
    """Each test sees gloo_interface_env decide (and log) anew."""
    network._decided.clear()
    yield
    network._decided.clear()


def host_address() -> tuple[str, str] | None:
    """(a non-loopback IPv4 address of this machine, its interface) per `ip`, or None."""
    if shutil.which("ip") is None:
        return None
    listing = subprocess.run(["ip", "-o", "-4", "addr", "show"], capture_output=True, text=True).stdout
    for line in listing.splitlines():
        fields = line.split()
        if fields[1] != "lo":
            return fields[3].split("/")[0], fields[1].split("@")[0]
    return None


def fake_member(addr: str) -> tuple:
    """Stand-ins for worker_env's arguments: only the attributes it reads."""
    config = SimpleNamespace(
        role="default", max_restarts=0, rdzv_id="job", rdzv=SimpleNamespace(lease_ttl=3), inprocess_timeout=10.0
    )
    member = SimpleNamespace(node="n0", group_rank=0, nproc=2, first_rank=0, addr=addr)
    round_ = SimpleNamespace(round=0, size=1, world_size=2, restart_count=0)
    master = MasterRecord(addr=addr, port=29500)
    return config, round_, member, master


@pytest.mark.timeout(30)
@pytest.mark.parametrize("addr", ["127.0.0.1", "127.0.1.1", "::1", "localhost"])
def test_loopback_sets_nothing(addr):
    assert gloo_interface_env(addr, {}) == {}


@pytest.mark.timeout(30)
def test_loopback_is_held_by_lo():
    assert interface_holding("127.0.0.1") == "lo"


@pytest.mark.timeout(30)
def test_an_address_no_interface_holds_sets_nothing():
    assert interface_holding("203.0.113.77") is None  # TEST-NET-3, never assigned to a real host
    assert gloo_interface_env("203.0.113.77", {}) == {}
    assert interface_holding("not an address") is None


@pytest.mark.timeout(30)
def test_host_address_maps_to_its_interface(caplog):
    found = host_address()
    if found is None:
        pytest.fail("this machine has no non-loopback IPv4 address; the test needs one")
    addr, name = found
    assert interface_holding(addr) == name
    with caplog.at_level(logging.INFO, logger="launcher.workers.network"):
        assert gloo_interface_env(addr, {}) == {"GLOO_SOCKET_IFNAME": name}
        assert gloo_interface_env(addr, {}) == {"GLOO_SOCKET_IFNAME": name}  # every worker, every round
    messages = [r.getMessage() for r in caplog.records]
    assert len(messages) == 1 and f"GLOO_SOCKET_IFNAME={name} (the interface holding {addr})" in messages[0]


@pytest.mark.timeout(30)
def test_user_setting_wins():
    found = host_address()
    addr = found[0] if found else "127.0.0.1"
    assert gloo_interface_env(addr, {"GLOO_SOCKET_IFNAME": "mine0"}) == {}
    assert gloo_interface_env(addr, {"GLOO_SOCKET_IFNAME": ""}) == {}  # set, even empty: theirs


@pytest.mark.timeout(30)
def test_worker_env_passes_user_setting_through(monkeypatch):
    found = host_address()
    addr = found[0] if found else "127.0.0.1"
    monkeypatch.setenv("GLOO_SOCKET_IFNAME", "mine0")
    env = worker_env(*fake_member(addr), local_rank=0, error_file=Path("/tmp/error.json"))
    assert env["GLOO_SOCKET_IFNAME"] == "mine0"


@pytest.mark.timeout(30)
def test_worker_env_names_the_interface_of_the_node_address(monkeypatch):
    found = host_address()
    if found is None:
        pytest.fail("this machine has no non-loopback IPv4 address; the test needs one")
    monkeypatch.delenv("GLOO_SOCKET_IFNAME", raising=False)
    env = worker_env(*fake_member(found[0]), local_rank=1, error_file=Path("/tmp/error.json"))
    assert env["GLOO_SOCKET_IFNAME"] == found[1]
    loopback = worker_env(*fake_member("127.0.0.1"), local_rank=1, error_file=Path("/tmp/error.json"))
    assert "GLOO_SOCKET_IFNAME" not in loopback


@pytest.mark.timeout(60)
def test_addresses_on_veth_interfaces_in_a_namespace():
    """Primary and secondary IPv4 and an IPv6 address on a namespace's own veth pair map to their interface."""
    if os.geteuid() != 0 or shutil.which("ip") is None:
        pytest.fail("needs root and `ip` to create a network namespace (CI runs as root)")
    ns = f"elnet-{uuid.uuid4().hex[:8]}"

    def ip(*args: str) -> None:
        subprocess.run(["ip", "-n", ns, *args], check=True, capture_output=True, timeout=30)

    try:
        try:
            subprocess.run(["ip", "netns", "add", ns], check=True, capture_output=True, timeout=30)
            ip("link", "add", "gloo0", "type", "veth", "peer", "name", "gloo1")
        except subprocess.CalledProcessError as exc:
            pytest.fail(f"cannot create a namespace with a veth pair: {exc.stderr.decode().strip()}")
        ip("addr", "add", "10.77.9.2/24", "dev", "gloo0")
        ip("addr", "add", "10.77.9.3/24", "dev", "gloo0")  # a secondary: not what SIOCGIFADDR reports
        ip("addr", "add", "10.77.8.2/24", "dev", "gloo1")
        ip("addr", "add", "fd77::2/64", "dev", "gloo1", "nodad")
        ip("link", "set", "lo", "up")
        probe = (
            "import json; from launcher.workers.network import interface_holding, gloo_interface_env\n"
            "addrs = ['10.77.9.2', '10.77.9.3', '10.77.8.2', 'fd77::2', '10.77.9.9', '127.0.0.1']\n"
            "print(json.dumps({a: [interface_holding(a), gloo_interface_env(a, {})] for a in addrs}))\n"
        )
        result = subprocess.run(
            ["ip", "netns", "exec", ns, sys.executable, "-c", probe],
            cwd=REPO,
            capture_output=True,
            text=True,
            timeout=30,
            check=True,
        )
        assert json.loads(result.stdout) == {
            "10.77.9.2": ["gloo0", {"GLOO_SOCKET_IFNAME": "gloo0"}],
            "10.77.9.3": ["gloo0", {"GLOO_SOCKET_IFNAME": "gloo0"}],
            "10.77.8.2": ["gloo1", {"GLOO_SOCKET_IFNAME": "gloo1"}],
            "fd77::2": ["gloo1", {"GLOO_SOCKET_IFNAME": "gloo1"}],
            "10.77.9.9": [None, {}],
            "127.0.0.1": ["lo", {}],
        }
    finally:
        subprocess.run(["ip", "netns", "del", ns], capture_output=True, timeout=30)


@pytest.mark.slow
@pytest.mark.timeout(120)
@pytest.mark.parametrize("user_value", [None, "lo"])
def test_single_host_job_workers_see(user_value, tmp_path):
    """A real single-host job: loopback sets nothing; a user's GLOO_SOCKET_IFNAME reaches the workers as is."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("PET_") and k != "GLOO_SOCKET_IFNAME"}
    env.update(OMP_NUM_THREADS="1")
    if user_value is not None:
        env["GLOO_SOCKET_IFNAME"] = user_value
    out = tmp_path / "env"
    out.mkdir()
    command = [
        sys.executable,
        "-m",
        "launcher.commands.cli",
        "--standalone",
        "--nproc-per-node",
        "2",
        "--log-dir",
        str(tmp_path / "logs"),
        str(GLOO_ENV),
        str(out),
    ]
    result = subprocess.run(command, cwd=REPO, env=env, capture_output=True, text=True, timeout=100)
    assert result.returncode == 0, result.stderr[-4000:]
    records = [json.loads((out / f"rank{r}.json").read_text()) for r in range(2)]
    assert [r["GLOO_SOCKET_IFNAME"] for r in records] == [user_value, user_value]


@pytest.mark.timeout(30)
@pytest.mark.parametrize("users, expected", [(None, "1"), ("0", "0"), ("3", "3")])
def test_nccl_async_error_handling_is_on_unless_the_user_says_otherwise(monkeypatch, tmp_path, users, expected):
    """torchrun's rule: TORCH_NCCL_ASYNC_ERROR_HANDLING=1 for the workers, the launcher's own value if it has one."""
    if users is None:
        monkeypatch.delenv("TORCH_NCCL_ASYNC_ERROR_HANDLING", raising=False)
    else:
        monkeypatch.setenv("TORCH_NCCL_ASYNC_ERROR_HANDLING", users)
    env = worker_env(*fake_member("127.0.0.1"), 0, tmp_path / "error.json")
    assert env["TORCH_NCCL_ASYNC_ERROR_HANDLING"] == expected


@pytest.mark.timeout(30)
def test_a_standby_worker_has_a_round_workers_environment_but_the_rounds_own_variables(monkeypatch, tmp_path):
    """What the first round's offer brings is exactly what a standby worker lacks: ranks, sizes, master, files;
    even when the agent's own environment holds some (an outer launcher's RANK)."""
    monkeypatch.setenv("RANK", "7")
    monkeypatch.setenv("MASTER_PORT", "1234")
    config, round_, member, master = fake_member("127.0.0.1")
    config.nproc_per_node, config.node_id = member.nproc, member.node
    round_env = worker_env(config, round_, member, master, 1, tmp_path / "error.json")
    later = worker_env(
        config, SimpleNamespace(round=5, size=2, world_size=4, restart_count=3), member, master, 1, tmp_path / "e"
    )
    assert {name for name in round_env if round_env[name] != later[name]} <= set(ROUND_VARIABLES)
    standby = standby_env(config, node_worker_env("127.0.0.1", member.nproc), 1)
    assert standby == {
        **{name: value for name, value in round_env.items() if name not in ROUND_VARIABLES},
        "ELASTIC_STANDBY": "1",
    }
