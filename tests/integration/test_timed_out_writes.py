"""A protocol write etcd did not answer in time, on a real etcd: before it is sent again its marker is read, so a
write etcd applied after all is not proposed twice (thousands of agents resending theirs were most of a slow
etcd's backlog), and one it never applied is sent again."""

from __future__ import annotations

import pytest

from launcher.etcd import client as etcd_client
from launcher.etcd.errors import EtcdTimedOut, EtcdUnavailable
from launcher.rendezvous.protocol import JobStore, ReportKind

pytestmark = pytest.mark.timeout(60)


class FlakyClient:
    """The real client, but its first transaction fails with `error`, after etcd applied it when `applied`."""

    def __init__(self, client, error: Exception, applied: bool) -> None:
        self._client, self._error, self._applied = client, error, applied
        self.sent = 0
        self.reads = 0

    def __getattr__(self, name: str):
        return getattr(self._client, name)

    def transaction(self, **kwargs):
        self.sent += 1
        if self.sent > 1:
            return self._client.transaction(**kwargs)
        if self._applied:
            self._client.transaction(**kwargs)
        raise self._error

    def get_response(self, key, **kwargs):
        self.reads += 1
        return self._client.get_response(key, **kwargs)


@pytest.fixture
def client(etcd):
    connection = etcd_client.connect(etcd.endpoint)
    try:
        yield connection
    finally:
        connection.close()


@pytest.mark.parametrize(
    "error, applied, sent, reads",
    [
        (EtcdTimedOut("DEADLINE_EXCEEDED: answered too late"), True, 1, 1),  # applied after all: not sent again
        (EtcdTimedOut("UNAVAILABLE: etcdserver: request timed out"), False, 2, 1),  # never applied: sent again
        (EtcdUnavailable("UNAVAILABLE: connection refused"), False, 2, 0),  # never reached etcd: nothing to look for
    ],
)
def test_a_timed_out_acknowledgement_is_looked_for_before_it_is_sent_again(client, error, applied, sent, reads) -> None:
    flaky = FlakyClient(client, error, applied)
    store = JobStore(flaky, "job")
    assert store.acknowledge(0, 0, "n1", pid=4242) is True
    assert (flaky.sent, flaky.reads) == (sent, reads)
    value, _ = client.get(store.keys.report(0, ReportKind.ACK, "n1"))
    assert value == b"4242"
