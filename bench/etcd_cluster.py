"""A local etcd cluster of K members on loopback ports, at etcd's default timing, for the rendezvous benchmark.

Each member has its own data directory, client and peer port; `leader()` asks each member's status (answered
locally, with or without a leader), and `kill(i)` SIGKILLs one, as a crashed host would.
"""

from __future__ import annotations

import logging
import os
import shutil
import signal
import subprocess
import time

from launcher.etcd import client as etcd_client
from launcher.etcd.server import free_port, member_command
from launcher.workers.process_tree import orphan_safe_command

logger = logging.getLogger(__name__)

HOST = "127.0.0.1"


class EtcdCluster:
    def __init__(self, members: int, data_dir: str) -> None:
        self.data_dir = data_dir
        self.names = [f"m{i}" for i in range(members)]
        self.client_ports = [free_port(HOST) for _ in self.names]
        self.peer_ports = [free_port(HOST) for _ in self.names]
        self.processes: list[subprocess.Popen] = []
        self.commands: list[list[str]] = []

    @property
    def endpoints(self) -> list[str]:
        return [f"{HOST}:{port}" for port in self.client_ports]

    @property
    def endpoint(self) -> str:
        """Every member, as --rdzv-endpoint takes them."""
        return ",".join(self.endpoints)

    def start(self, timeout_s: float = 30.0) -> EtcdCluster:
        peers = ",".join(f"{name}=http://{HOST}:{port}" for name, port in zip(self.names, self.peer_ports))
        for name, client_port, peer_port in zip(self.names, self.client_ports, self.peer_ports):
            client_url, peer_url = f"http://{HOST}:{client_port}", f"http://{HOST}:{peer_port}"
            command = [
                *member_command(name, os.path.join(self.data_dir, name), client_url, peer_url, peers),
                "--initial-cluster-state",
                "new",
                "--log-level",
                "error",
            ]
            self.commands.append(command)
            self.processes.append(self._launch(name, command))
        deadline = time.monotonic() + timeout_s
        while self.leader() is None:
            if time.monotonic() > deadline:
                self.stop()
                raise RuntimeError(f"the {len(self.names)}-member etcd elected no leader within {timeout_s:.0f} s")
            time.sleep(0.1)
        logger.info("started a %d-member etcd cluster %s (leader m%d)", len(self.names), self.endpoint, self.leader())
        return self

    def log_path(self, name: str) -> str:
        """Where member `name`'s stdout and stderr go."""
        return os.path.join(self.data_dir, f"{name}.log")

    def _launch(self, name: str, command: list[str]) -> subprocess.Popen:
        os.makedirs(self.data_dir, exist_ok=True)
        with open(self.log_path(name), "ab") as log:
            return subprocess.Popen(orphan_safe_command(command), stdout=log, stderr=log, start_new_session=True)

    def restart(self, member: int, timeout_s: float = 30.0) -> None:
        """Start a killed member again on its data (a crashed host back); returns once it follows a leader."""
        self.processes[member] = self._launch(self.names[member], self.commands[member])
        client = etcd_client.connect(self.endpoints[member], timeout=1.0)
        deadline = time.monotonic() + timeout_s
        try:
            while True:
                try:
                    if client.status().leader is not None:
                        return
                except Exception:  # noqa: BLE001 - still starting
                    pass
                if time.monotonic() > deadline:
                    raise RuntimeError(f"etcd member {self.names[member]} did not rejoin within {timeout_s:.0f} s")
                time.sleep(0.1)
        finally:
            etcd_client.close(client)

    @property
    def pids(self) -> list[int]:
        return [process.pid for process in self.processes if process.poll() is None]

    def metrics_endpoints(self) -> list[str]:
        """The members still running: each serves its own /metrics."""
        return [endpoint for endpoint, process in zip(self.endpoints, self.processes) if process.poll() is None]

    def leader(self) -> int | None:
        """The member that leads, as the first running member that knows one says (None: none does)."""
        for endpoint, process in zip(self.endpoints, self.processes):
            if process.poll() is not None:
                continue
            client = etcd_client.connect(endpoint, timeout=1.0)
            try:
                leader = client.status().leader
                if leader is not None and leader.name in self.names:
                    return self.names.index(leader.name)
            except Exception:  # noqa: BLE001 - down or electing: ask the next one
                continue
            finally:
                etcd_client.close(client)
        return None

    def kill(self, member: int) -> float:
        """SIGKILL member `member`; the time it died."""
        process = self.processes[member]
        os.killpg(process.pid, signal.SIGKILL)
        died = time.time()
        process.wait(timeout=10)
        return died

    def stop(self) -> None:
        for process in self.processes:
            if process.poll() is None:
                os.killpg(process.pid, signal.SIGTERM)
        for process in self.processes:
            try:
                process.wait(timeout=5)
            except subprocess.TimeoutExpired:
                os.killpg(process.pid, signal.SIGKILL)
                process.wait()
        shutil.rmtree(self.data_dir, ignore_errors=True)
