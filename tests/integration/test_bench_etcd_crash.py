"""The rendezvous bench names an etcd that died on its own, with the line its crash began with (etcd 3.5.1 panicked
under 4,096 simulated agents), and does not count a member it killed itself as a crash."""

from __future__ import annotations

import signal
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "bench"))

from rendezvous_bench import BenchEtcd  # noqa: E402 - bench/ is not a package

pytestmark = pytest.mark.timeout(60)


@pytest.mark.parametrize("signum, crash", [(signal.SIGABRT, "SIGABRT: abort"), (signal.SIGKILL, None)])
def test_an_etcd_that_died_on_its_own_is_named_with_its_crash(tmp_path, signum: int, crash: str | None) -> None:
    etcd = BenchEtcd(1, str(tmp_path / "etcd"))
    try:
        assert etcd.crashes() == []
        assert etcd.server is not None and etcd.server.process is not None
        etcd.server.process.send_signal(signum)
        etcd.server.process.wait(timeout=10)
        expected = [] if crash is None else [f"etcd member etcd exited with code 2: {crash}"]
        assert etcd.crashes() == expected
    finally:
        etcd.stop()
