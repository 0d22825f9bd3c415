"""A secured etcd: TLS with client certificates, and authentication with a user whose role covers one job.

Jobs run on both; a wrong CA, a wrong client certificate, a wrong password, no login and a user without rights
each end elastic-run within seconds with one line that names the fix, and a non-zero exit.
"""

from __future__ import annotations

import logging
import shutil
import subprocess
import time
from pathlib import Path

import pytest
from launcher_harness import PROBE, REPO, elastic_run_command, worker_env
from tls_certs import CertificateAuthority

from launcher.config import EtcdSecurity
from launcher.etcd import client as etcd_client
from launcher.etcd.server import EtcdServer, ServerTls, find_etcd_binary

pytestmark = [pytest.mark.slow, pytest.mark.timeout(120)]

PASSWORD = "s3cret-pw"


@pytest.fixture(scope="module")
def pki(tmp_path_factory) -> dict:
    directory = tmp_path_factory.mktemp("pki")
    ca, rogue = CertificateAuthority(directory, "ca"), CertificateAuthority(directory, "rogue-ca")
    return {
        "ca": ca.files.cert,
        "rogue_ca": rogue.files.cert,
        "server": ca.issue("server", "etcd", server=True),
        "client": ca.issue("client", "trainer"),
        "rogue_client": rogue.issue("rogue-client", "trainer"),
    }


@pytest.fixture(scope="module")
def tls_etcd(pki):
    good = EtcdSecurity(cacert=pki["ca"], cert=pki["client"].cert, key=pki["client"].key)
    server = EtcdServer(tls=ServerTls(pki["server"].cert, pki["server"].key, pki["ca"]), ready_check=good).start()
    yield server
    server.stop()


def etcdctl(endpoint: str, *args: str, user: str | None = None) -> None:
    binary = shutil.which("etcdctl") or str(Path(find_etcd_binary()).with_name("etcdctl"))
    login = ["--user", user] if user else []
    subprocess.run([binary, "--endpoints", endpoint, *login, *args], check=True, capture_output=True, timeout=30)


@pytest.fixture(scope="module")
def auth_etcd():
    """Auth on; user `trainer` may read and write /elastic/secured/ only; user `outsider` has no role. Login
    tokens expire after 2 s unused (etcd's default is 5 min), so clients must log in again."""
    server = EtcdServer(flags=("--auth-token-ttl", "2")).start()
    etcdctl(server.endpoint, "user", "add", "root:rootpw")
    etcdctl(server.endpoint, "user", "grant-role", "root", "root")
    etcdctl(server.endpoint, "role", "add", "job")
    etcdctl(server.endpoint, "role", "grant-permission", "job", "--prefix=true", "readwrite", "/elastic/secured/")
    etcdctl(server.endpoint, "user", "add", f"trainer:{PASSWORD}")
    etcdctl(server.endpoint, "user", "grant-role", "trainer", "job")
    etcdctl(server.endpoint, "user", "add", f"outsider:{PASSWORD}")
    etcdctl(server.endpoint, "auth", "enable")
    yield server
    server.stop()


def elastic_run(
    endpoint: str,
    conf: str,
    tmp_path: Path,
    *,
    rdzv_id: str = "secured",
    password: str | None = None,
    timeout: float = 90,
) -> tuple[int, list[str], float]:
    env = worker_env()
    env.pop("ELASTIC_ETCD_PASSWORD", None)
    if password is not None:
        env["ELASTIC_ETCD_PASSWORD"] = password
    command = [
        *elastic_run_command(),
        "--nnodes",
        "1",
        "--nproc-per-node",
        "1",
        "--rdzv-endpoint",
        endpoint,
        "--rdzv-id",
        rdzv_id,
        "--rdzv-conf",
        f"keep_alive_interval=0.5,last_call_timeout=0,{conf}",
        "--log-dir",
        str(tmp_path / "logs"),
        str(PROBE),
        "--steps",
        "3",
        "--step-time",
        "0.01",
    ]
    started = time.monotonic()
    try:
        result = subprocess.run(command, capture_output=True, text=True, timeout=timeout, cwd=REPO, env=env)
    except subprocess.TimeoutExpired as timed_out:  # what the agent said is the evidence of where it was held
        said = timed_out.stderr.decode(errors="replace") if isinstance(timed_out.stderr, bytes) else timed_out.stderr
        raise AssertionError(f"elastic-run did not exit within {timeout}s; its stderr:\n{said}") from None
    errors = [line for line in result.stderr.splitlines() if line.startswith("elastic-run: error:")]
    return result.returncode, errors, time.monotonic() - started, result.stderr


def log_command(endpoint: str, conf: str, password: str | None = None) -> subprocess.CompletedProcess:
    env = worker_env()
    if password is not None:
        env["ELASTIC_ETCD_PASSWORD"] = password
    command = [
        *elastic_run_command(),
        "log",
        "--rdzv-endpoint",
        endpoint,
        "--rdzv-id",
        "secured",
        "--rdzv-conf",
        conf,
        "--json",
    ]
    return subprocess.run(command, capture_output=True, text=True, timeout=30, env=env)


def tls_conf(pki: dict, ca: str = "ca", client: str = "client") -> str:
    return f"cacert={pki[ca]},cert={pki[client].cert},key={pki[client].key}"


def test_a_job_runs_on_an_etcd_with_client_certificates(tls_etcd, pki, tmp_path):
    code, errors, _, _ = elastic_run(tls_etcd.endpoint, tls_conf(pki), tmp_path)
    assert code == 0 and not errors
    shown = log_command(tls_etcd.endpoint, tls_conf(pki))
    assert shown.returncode == 0 and '"job_finished"' in shown.stdout


@pytest.mark.parametrize("ca, client", [("rogue_ca", "client"), ("ca", "rogue_client")], ids=["wrong-ca", "wrong-cert"])
def test_a_wrong_ca_or_certificate_is_one_line(tls_etcd, pki, tmp_path, ca, client):
    """The whole of stderr is one line (gRPC logs errors only), and a refused handshake is not retried: the
    5 s that `check_reachable` waits for an etcd that is starting would be spent by now."""
    code, errors, seconds, stderr = elastic_run(tls_etcd.endpoint, tls_conf(pki, ca, client), tmp_path, timeout=30)
    assert code == 1 and stderr.splitlines() == errors and len(errors) == 1 and seconds < 4, (seconds, stderr)
    assert f"TLS with etcd at {tls_etcd.endpoint} failed" in errors[0] and "cacert" in errors[0]
    expected = "CERTIFICATE_VERIFY_FAILED" if ca == "rogue_ca" else "BAD_CERTIFICATE"
    assert expected in errors[0]


def test_a_plain_client_of_a_tls_etcd_is_one_line(tls_etcd, tmp_path):
    code, errors, seconds, stderr = elastic_run(tls_etcd.endpoint, "", tmp_path, timeout=30)
    assert code == 1 and stderr.splitlines() == errors and len(errors) == 1 and seconds < 4, (seconds, stderr)
    assert f"etcd at {tls_etcd.endpoint} speaks TLS" in errors[0] and "cacert=" in errors[0]


def test_a_job_runs_as_a_user_whose_role_covers_its_prefix(auth_etcd, tmp_path):
    code, errors, _, _ = elastic_run(auth_etcd.endpoint, "user=trainer", tmp_path, password=PASSWORD)
    assert code == 0 and not errors
    shown = log_command(auth_etcd.endpoint, "user=trainer", PASSWORD)
    assert shown.returncode == 0 and '"job_finished"' in shown.stdout


@pytest.mark.parametrize(
    "conf, password, rdzv_id, expected",
    [
        (
            "user=trainer",
            "not-the-pw-4711",
            "secured",
            "refused the login of user trainer: wrong user name or password",
        ),
        ("", None, "secured", "wants a login"),
        ("user=outsider", PASSWORD, "secured", "user outsider has no right"),
        ("user=trainer", PASSWORD, "another-job", "user trainer has no right"),
        (
            "user=trainer",
            None,
            "secured",
            "user=trainer needs its password in the environment variable ELASTIC_ETCD_PASSWORD",
        ),
    ],
    ids=["wrong-password", "no-login", "no-role", "other-prefix", "no-password"],
)
def test_bad_logins_are_one_line(auth_etcd, tmp_path, conf, password, rdzv_id, expected):
    code, errors, seconds, _ = elastic_run(
        auth_etcd.endpoint, conf, tmp_path, rdzv_id=rdzv_id, password=password, timeout=30
    )
    assert code in (1, 2) and len(errors) == 1 and seconds < 15, errors
    assert expected in errors[0]
    if password:
        assert password not in errors[0], "a password is never shown"


def test_a_client_logs_in_again_once_its_token_expired(auth_etcd, caplog):
    caplog.set_level(logging.INFO, logger=etcd_client.__name__)
    security = EtcdSecurity(user="trainer", password=PASSWORD)
    client = etcd_client.connect_reachable(auth_etcd.endpoint, security)
    try:
        etcd_client.call_with_retry(client.put, "/elastic/secured/token-check", "1", deadline_s=5)
        # real time, unused: etcd expires a token only on its own clock (--auth-token-ttl 2 s, checked every
        # second), and any call that would show it expired would use it and keep it alive
        time.sleep(3.5)
        value, _ = etcd_client.call_with_retry(client.get, "/elastic/secured/token-check", deadline_s=5)
        assert value == b"1"
    finally:
        client.close()
    assert "logging in again" in caplog.text, "the token had not expired: the sleep proved nothing"
