"""Bad input to elastic-run: one clear line, a non-zero exit, and nothing started."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import threading
import time
from http.server import BaseHTTPRequestHandler, HTTPServer

import pytest
from launcher_harness import PROBE, REPO, elastic_run_command, worker_env

from launcher.etcd.server import free_port


def run_cli(*args: str, env: dict | None = None, timeout: float = 30) -> tuple[int, list[str], float]:
    started = time.monotonic()
    result = subprocess.run(
        [*elastic_run_command(), *args],
        capture_output=True,
        text=True,
        timeout=timeout,
        cwd=REPO,
        env={**worker_env(), **(env or {})},
    )
    lines = [line for line in result.stderr.splitlines() if line.strip()]
    return result.returncode, lines, time.monotonic() - started


@pytest.mark.timeout(60)
@pytest.mark.parametrize(
    "args, expected",
    [
        (["--nnodes", "4:2", "--standalone", str(PROBE)], "--nnodes 4:2"),
        (["--nnodes", "two", "--standalone", str(PROBE)], "--nnodes"),
        (["--nproc-per-node", "0", "--standalone", str(PROBE)], "--nproc-per-node 0"),
        (["--standalone", "no_such_script.py"], "no_such_script.py"),
        (["--standalone"], "no training script"),
        (["--standalone", "--rdzv-conf", "keep_alive_interval", str(PROBE)], "malformed --rdzv-conf"),
        (["--standalone", "--rdzv-conf", "keepalive=1", str(PROBE)], "unknown --rdzv-conf key(s) keepalive"),
        (["--standalone", "--rdzv-conf", "keep_alive_interval=-1", str(PROBE)], "keep_alive_interval"),
        (["--standalone", "--rdzv-endpoint", "127.0.0.1:2379", str(PROBE)], "--standalone"),
        (["--standalone", "--master-port", "29500", str(PROBE)], "--master-port"),
        (["--standalone", "--node_rank", "1", str(PROBE)], "--node-rank"),
        (["--rdzv-backend", "c10d", "--rdzv-endpoint", "127.0.0.1:2379", str(PROBE)], "--rdzv-backend c10d"),
        ([str(PROBE)], "--rdzv-endpoint"),
        (["--rdzv-endpoint", "127.0.0.1:notaport", str(PROBE)], "bad etcd endpoint"),
    ],
)
def test_bad_input_is_one_line_and_starts_nothing(args, expected, tmp_path):
    private_tmp = tmp_path / "tmp"
    private_tmp.mkdir()
    code, lines, _ = run_cli("--log-dir", str(tmp_path / "logs"), *args, env={"TMPDIR": str(private_tmp)})
    assert code != 0
    assert len(lines) == 1, lines
    assert lines[0].startswith("elastic-run: error:") and expected in lines[0], lines[0]
    assert not (tmp_path / "logs").exists(), "nothing may be started for bad input"
    assert not list(private_tmp.iterdir()), "no etcd data dir or log dir may be created for bad input"


@pytest.mark.timeout(60)
def test_flags_come_from_pet_environment_like_torchrun(tmp_path):
    code, lines, _ = run_cli("--standalone", str(PROBE), env={"PET_NNODES": "3:1"})
    assert code == 2 and "--nnodes 3:1" in lines[0]


@pytest.mark.timeout(60)
def test_unreachable_endpoint_fails_within_seconds_naming_it(tmp_path):
    endpoint = f"127.0.0.1:{free_port()}"
    code, lines, took = run_cli("--rdzv-endpoint", endpoint, "--log-dir", str(tmp_path / "logs"), str(PROBE))
    assert code == 1
    assert len(lines) == 1 and endpoint in lines[0] and "etcd" in lines[0], lines
    assert took < 15
    assert not (tmp_path / "logs").exists()


class _Hello(BaseHTTPRequestHandler):
    def do_GET(self):  # noqa: N802 - http.server's naming
        self.send_response(200)
        self.end_headers()

    do_POST = do_GET

    def log_message(self, *args):
        pass


@pytest.mark.timeout(60)
def test_endpoint_that_is_not_etcd_fails_within_seconds_naming_it(tmp_path):
    server = HTTPServer(("127.0.0.1", 0), _Hello)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        endpoint = f"127.0.0.1:{server.server_address[1]}"
        code, lines, took = run_cli("--rdzv-endpoint", endpoint, str(PROBE))
    finally:
        server.shutdown()
        server.server_close()
    assert code == 1 and len(lines) == 1 and endpoint in lines[0], lines
    assert took < 15


@pytest.mark.timeout(60)
def test_log_command_errors_are_one_line(etcd, tmp_path):
    code, lines, _ = run_cli("log", "--rdzv-endpoint", etcd.endpoint, "--rdzv-id", "nosuchjob")
    assert code == 1 and len(lines) == 1 and "nosuchjob" in lines[0]
    code, lines, _ = run_cli("log", "--file", str(tmp_path / "membership.jsonl"))
    assert code == 2 and len(lines) == 1 and "membership.jsonl" in lines[0]
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        dead = f"127.0.0.1:{probe.getsockname()[1]}"
    code, lines, _ = run_cli("log", "--rdzv-endpoint", dead, "--rdzv-id", "x")
    assert code == 1 and dead in lines[0]


def standalone_command(tmp_path, *probe_args: str) -> tuple[list[str], dict[str, str], object]:
    """elastic-run --standalone on the probe, with a TMPDIR of its own so a test can see what it leaves there."""
    private_tmp = tmp_path / "tmp"
    private_tmp.mkdir()
    command = [
        *elastic_run_command(),
        "--standalone",
        "--nproc-per-node",
        "2",
        "--log-dir",
        str(tmp_path / "logs"),
        str(PROBE),
        *probe_args,
    ]
    return command, {**worker_env(), "TMPDIR": str(private_tmp)}, private_tmp


@pytest.mark.timeout(120)
def test_standalone_runs_a_job_and_removes_its_etcd(tmp_path):
    command, env, private_tmp = standalone_command(tmp_path, "--steps", "3", "--step-time", "0.01")
    result = subprocess.run(command, capture_output=True, text=True, timeout=100, cwd=REPO, env=env)
    assert result.returncode == 0, result.stderr[-3000:]
    assert "standalone: private etcd at 127.0.0.1:" in result.stderr
    assert (tmp_path / "logs" / "membership.jsonl").read_text().count('"job_finished"') == 1
    assert not list(private_tmp.iterdir()), "the private etcd's data dir must be removed"


@pytest.mark.timeout(120)
def test_standalone_ctrl_c_stops_workers_and_etcd(tmp_path):
    probe_log = tmp_path / "probe.jsonl"
    command, env, private_tmp = standalone_command(
        tmp_path, "--steps", "100000", "--step-time", "0.1", "--log", str(probe_log)
    )
    process = subprocess.Popen(
        command, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, cwd=REPO, start_new_session=True, env=env
    )
    try:
        deadline = time.monotonic() + 90
        while not probe_log.exists():
            assert time.monotonic() < deadline and process.poll() is None, "the job never trained"
            time.sleep(0.2)
        os.killpg(process.pid, signal.SIGINT)  # what a terminal's Ctrl-C does: the whole foreground group
        assert process.wait(timeout=30) == 128 + signal.SIGINT
    finally:
        if process.poll() is None:
            os.killpg(process.pid, signal.SIGKILL)
        process.wait()
    assert not list(private_tmp.iterdir()), "the private etcd and its data must be gone"
