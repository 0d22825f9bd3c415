"""launcher.etcd.client's watcher: a watch request given up on ends its stream, so that etcd's late confirmation
cannot be taken for the next request (pyetcd matches a confirmation to whichever request is pending)."""

from __future__ import annotations

import functools
import queue
import threading

import grpc
import pyetcd
import pytest
from pyetcd import etcdrpc

from launcher.etcd.client import _CancellingWatcher, _FailoverClient
from launcher.etcd.errors import EtcdTimedOut

pytestmark = pytest.mark.timeout(30)


class SilentCall:
    """A watch stream etcd never answers; cancelling it ends it with CANCELLED, as gRPC's call does."""

    def __init__(self, requests) -> None:
        self.cancelled = threading.Event()
        threading.Thread(target=lambda: [None for _ in requests], daemon=True).start()  # the stream sends them

    def __iter__(self):
        return self

    def __next__(self):
        self.cancelled.wait()
        raise _Cancelled()

    def cancel(self) -> None:
        self.cancelled.set()


class _Cancelled(grpc.RpcError):
    def code(self) -> grpc.StatusCode:
        return grpc.StatusCode.CANCELLED


class SilentStub:
    def __init__(self) -> None:
        self.calls: list[SilentCall] = []

    def Watch(self, requests, credentials=None, metadata=None) -> SilentCall:
        self.calls.append(SilentCall(requests))
        return self.calls[-1]


def test_a_watch_request_given_up_on_ends_its_stream_and_the_next_opens_another():
    stub = SilentStub()
    watcher = _CancellingWatcher(stub, on_stream_error=lambda exc: None, timeout=0.2)
    told: queue.Queue = queue.Queue()
    # the launcher's error, which every caller retries (pyetcd's own crashed agents registering into a busy etcd)
    with pytest.raises(EtcdTimedOut, match="did not confirm a new watch within 0.2s"):
        watcher.add_callback("a", told.put)
    assert stub.calls[0].cancelled.wait(5), "the stream that held the unconfirmed request was not ended"
    for _ in range(3):  # one sent while the old stream was still ending fails with it; RangeMirror retries
        with pytest.raises((EtcdTimedOut, grpc.RpcError)):
            watcher.add_callback("b", told.put)
    assert len(stub.calls) >= 2, "later requests went out on the stream of the unconfirmed one"
    assert all(call.cancelled.is_set() for call in stub.calls), "a stream with an unconfirmed request lived on"


class _Unavailable(grpc.RpcError):
    def code(self) -> grpc.StatusCode:
        return grpc.StatusCode.UNAVAILABLE

    def details(self) -> str:
        return "Socket closed"


class DyingCall:
    """A watch stream whose member confirms the watch, then dies (SIGKILLed: the connection is reset) once `die`
    is set."""

    def __init__(self, requests, die: threading.Event) -> None:
        self.requests = iter(requests)
        self.die = die

    def __iter__(self):
        next(self.requests)  # the create request
        yield etcdrpc.WatchResponse(created=True, watch_id=1)
        self.die.wait(5)
        raise _Unavailable()

    def cancel(self) -> None:
        pass


def test_a_dead_member_under_a_watch_stream_is_left_before_the_watch_hears_of_it():
    """Issue #18: a 3-member etcd lost its leader under the agents' watch streams; their owners resumed them on
    the dead member, again and again, until some unary call failed over (no agent saw the next round for 40 s).
    The stream's error now moves the client first."""
    client = _FailoverClient(
        endpoints=[pyetcd.Endpoint(host, 1, secure=False) for host in ("127.0.0.1", "127.0.0.2")],
        timeout=1.0,
        failover=True,
    )
    try:
        dead = client.endpoint_label
        die = threading.Event()

        class Stub:
            def Watch(self, requests, credentials=None, metadata=None):
                return iter(DyingCall(requests, die))

        watcher = _CancellingWatcher(
            Stub(), on_stream_error=functools.partial(client._watch_stream_failed, dead), timeout=5
        )
        heard: queue.Queue = queue.Queue()
        watcher.add_callback("k", lambda response: heard.put((response, client.endpoint_label)))
        die.set()
        error, endpoint_then = heard.get(timeout=5)
        assert isinstance(error, grpc.RpcError) and endpoint_then != dead
    finally:
        client.close()
