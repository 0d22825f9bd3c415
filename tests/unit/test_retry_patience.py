"""launcher.etcd.client.call_with_retry: a call etcd did not answer in time is asked again with twice the time, up
to the call's deadline; other failures are asked again at the client's own timeout, and the next call starts
from it again."""

from __future__ import annotations

import pytest

from launcher.etcd import client as etcd_client
from launcher.etcd.errors import EtcdTimedOut, EtcdUnavailable

pytestmark = pytest.mark.timeout(30)

TIMEOUT_S = 0.5


@pytest.fixture
def client():
    connection = etcd_client.connect("127.0.0.1:9", timeout=TIMEOUT_S)  # nothing is called: no server needed
    try:
        yield connection
    finally:
        connection.close()


def failing(client, errors: list[Exception], seen: list[float]):
    """A call that notes the time limit its unary call would get, then fails with each of `errors` in turn."""

    def call() -> str:
        seen.append(client.timeout)
        if errors:
            raise errors.pop(0)
        return "answered"

    return call


@pytest.mark.parametrize(
    "errors, deadline_s, limits",
    [
        ([], 30.0, [0.5]),
        ([EtcdTimedOut("DEADLINE_EXCEEDED")] * 3, 30.0, [0.5, 1.0, 2.0, 4.0]),
        ([EtcdUnavailable("UNAVAILABLE")] * 2, 30.0, [0.5, 0.5, 0.5]),  # a refused connection: no longer wait
        ([EtcdTimedOut("DEADLINE_EXCEEDED"), EtcdUnavailable("UNAVAILABLE")], 30.0, [0.5, 1.0, 1.0]),
    ],
)
def test_each_timeout_doubles_the_next_attempts_time(client, errors, deadline_s, limits) -> None:
    seen: list[float] = []
    assert etcd_client.call_with_retry(failing(client, list(errors), seen), deadline_s=deadline_s) == "answered"
    assert seen == pytest.approx(limits, abs=0.01)
    assert client.timeout == TIMEOUT_S  # the next call starts from the client's timeout


def test_the_time_never_passes_the_calls_deadline(client) -> None:
    seen: list[float] = []
    call = failing(client, [EtcdTimedOut("DEADLINE_EXCEEDED")] * 4, seen)
    assert etcd_client.call_with_retry(call, deadline_s=6.0) == "answered"
    assert seen[:4] == pytest.approx([0.5, 1.0, 2.0, 4.0], abs=0.01)
    assert 4.0 < seen[4] <= 6.0  # not 8 s, which would pass the deadline: what is left of it


def test_a_failed_call_leaves_the_next_one_its_own_time(client) -> None:
    seen: list[float] = []
    with pytest.raises(EtcdTimedOut):
        etcd_client.call_with_retry(failing(client, [EtcdTimedOut("DEADLINE_EXCEEDED")] * 99, seen), deadline_s=0.2)
    assert client.timeout == TIMEOUT_S
