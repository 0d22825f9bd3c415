"""bench/chaos_bench.py reads which node holds elastic-run's controller key from the job's etcd, to name the
faults that hit it."""

from __future__ import annotations

import sys
from pathlib import Path
from types import SimpleNamespace

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "bench"))
import chaos_bench  # noqa: E402

from launcher.etcd import client as etcd_client  # noqa: E402
from launcher.rendezvous.protocol import Holder, JobKeys  # noqa: E402

pytestmark = pytest.mark.timeout(60)


def test_the_controller_is_read_from_the_jobs_key(etcd) -> None:
    system = chaos_bench.ElasticRun(chaos_bench.parse_args([]))
    job = SimpleNamespace(etcd=etcd, rdzv_id="bench-x")
    assert system.controller(job) is None  # type: ignore[arg-type]  # no controller yet
    client = etcd_client.connect(etcd.endpoint)
    try:
        client.put(JobKeys("bench-x").controller, Holder("node2", 0x1F).encode())
        client.put(JobKeys("another-job").controller, Holder("node0", 0x2A).encode())
    finally:
        etcd_client.close(client)
    assert system.controller(job) == "node2"  # type: ignore[arg-type]
