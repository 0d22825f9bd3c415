"""launcher.etcd.client's watcher: a watch request given up on ends its stream, so that etcd's late confirmation
cannot be taken for the next request (pyetcd matches a confirmation to whichever request is pending)."""

from __future__ import annotations

import queue
import threading

import grpc
import pytest
from pyetcd.exceptions import WatchTimedOut

from launcher.etcd.client import _CancellingWatcher

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
    watcher = _CancellingWatcher(stub, timeout=0.2)
    told: queue.Queue = queue.Queue()
    with pytest.raises(WatchTimedOut):
        watcher.add_callback("a", told.put)
    assert stub.calls[0].cancelled.wait(5), "the stream that held the unconfirmed request was not ended"
    for _ in range(3):  # one sent while the old stream was still ending fails with it; RangeMirror retries
        with pytest.raises((WatchTimedOut, grpc.RpcError)):
            watcher.add_callback("b", told.put)
    assert len(stub.calls) >= 2, "later requests went out on the stream of the unconfirmed one"
    assert all(call.cancelled.is_set() for call in stub.calls), "a stream with an unconfirmed request lived on"
